"""Calibrated rounding: grids, GPTQ's error compensation, the corrected target, the text.

``compensate`` is checked against a plain implementation of the same sequential rounding
written from its definition (after each input row is rounded, the rows not yet rounded
move by the optimal update of the least-squares problem over them, through an explicit
inverse of their Gram matrix); the package's version uses GPTQ's Cholesky form in blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from framework.layers.quantization.awq import AwqWeight, awq_grid, quantize_awq
from framework.layers.quantization.calibration import calibration_windows, text_files
from framework.layers.quantization.error_compensation import (
    BLOCK,
    compensate,
    corrected_weight,
    damped,
    input_order,
)
from framework.layers.quantization.fp8 import (
    Fp8BlockWeight,
    Fp8Weight,
    fp8_block_grid,
    fp8_grid,
    quantize_fp8,
    quantize_fp8_block,
)
from framework.layers.quantization.gptq import GptqWeight, gptq_grid, quantize_gptq
from framework.layers.quantization.grid import QuantGrid
from framework.layers.quantization.int8 import Int8Weight, int8_grid, quantize_int8

OUT = 16
#: Each format: its grid of a weight, and the dequantized weight its writer makes on a grid.
FORMATS: dict[str, tuple[Callable[[torch.Tensor], QuantGrid],
                         Callable[[torch.Tensor, QuantGrid], torch.Tensor]]] = {
    "fp8": (fp8_grid,
            lambda w, g: Fp8Weight.from_checkpoint(quantize_fp8(w, g)).dequantize()),
    # Blocks of 8 rows by 8 columns: two row blocks, and several column blocks per step.
    "fp8_block": (lambda w: fp8_block_grid(w, 8),
                  lambda w, g: Fp8BlockWeight.from_checkpoint(
                      quantize_fp8_block(w, 8, g), (8, 8)).dequantize()),
    "int8": (int8_grid, lambda w, g: Int8Weight(
        quantize_int8(w, g), tuple(w.shape)).dequantize()),  # type: ignore[arg-type]
    "gptq": (lambda w: gptq_grid(w, 32),
             lambda w, g: GptqWeight.from_checkpoint(quantize_gptq(w, grid=g), 32).dequantize()),
    "gptq_act_order": (
        lambda w: gptq_grid(w, 32, act_order=True, perm=torch.randperm(w.shape[1])),
        lambda w, g: GptqWeight.from_checkpoint(quantize_gptq(w, grid=g), 32).dequantize()),
    "awq": (lambda w: awq_grid(w, 32),
            lambda w, g: AwqWeight.from_checkpoint(quantize_awq(w, grid=g), 32).dequantize()),
}


def correlated_inputs(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose features are correlated and unequally large, as activations are."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=g) / features**0.5
    scales = torch.rand(features, generator=g) * 3 + 0.1
    return (torch.randn(rows, features, generator=g) @ mixing + 0.3
            * torch.randn(rows, features, generator=g)) * scales


def reference_compensation(weight: torch.Tensor, hessian: torch.Tensor, grid: QuantGrid,
                           damp: float) -> torch.Tensor:
    """Round the input rows in ``input_order``; after each, the rows left take the
    update ``-err * Hinv[i, rest] / Hinv[i, i]``, ``Hinv`` the inverse of the Gram matrix
    of the rows not yet rounded (including ``i``)."""
    h = damped(hessian, damp)
    order = input_order(hessian).tolist()
    w = weight.double().clone()
    out = torch.empty_like(weight, dtype=torch.float32)
    for k, i in enumerate(order):
        left = order[k:]
        inverse = torch.linalg.inv(h[left][:, left])
        value = grid.snap(w[:, i:i + 1], torch.tensor([i]))
        out[:, i] = value[:, 0]
        err = w[:, i] - value[:, 0].double()
        rest = left[1:]
        if rest:
            w[:, rest] -= err[:, None] * (inverse[0, 1:] / inverse[0, 0])[None, :]
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_weight_on_a_grid_is_written_exactly(fmt: str) -> None:
    # The grid is fitted to another weight (as calibration fits it before moving the
    # weight): the writer must still store the snapped values exactly.
    fit, written = FORMATS[fmt]
    w = torch.randn(OUT, 64, generator=torch.Generator().manual_seed(1))
    grid = fit(w)
    moved = grid.snap(w + 0.05 * torch.randn(w.shape))
    assert torch.equal(written(moved, grid), moved)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compensation_matches_the_sequential_definition(fmt: str) -> None:
    # 160 input rows: more than one of the implementation's lazy blocks.
    columns = BLOCK + 32
    x = correlated_inputs(400, columns)
    hessian = x.double().t() @ x.double()
    w = torch.randn(OUT, columns, generator=torch.Generator().manual_seed(2))
    grid = FORMATS[fmt][0](w)
    got = compensate(w, hessian, grid, 0.01)
    expected = reference_compensation(w, hessian, grid, 0.01)
    assert torch.equal(grid.snap(got), got)  # on the grid
    # Rounding decisions may differ where a value lies on a midpoint within float error.
    assert (got != expected).float().mean() < 0.002
    assert torch.allclose(got, expected, atol=float(grid.scale.max()) * 1.01)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compensation_reduces_the_output_error(fmt: str) -> None:
    x = correlated_inputs(600, 128, seed=3)
    hessian = x.double().t() @ x.double()
    w = torch.randn(OUT, 128, generator=torch.Generator().manual_seed(4))
    grid = FORMATS[fmt][0](w)
    nearest = grid.snap(w)
    compensated = compensate(w, hessian, grid, 0.01)
    held_out = correlated_inputs(600, 128, seed=3)[300:]  # same inputs' distribution

    def error(q: torch.Tensor) -> float:
        return float((held_out @ (q - w).t()).square().mean())

    assert error(compensated) < 0.7 * error(nearest)


def test_uncorrelated_inputs_round_to_nearest() -> None:
    # A diagonal Gram matrix spreads no error: each row is rounded on its own.
    w = torch.randn(OUT, 64)
    grid = fp8_grid(w)
    hessian = torch.diag(torch.rand(64, dtype=torch.float64) + 0.5)
    assert torch.equal(compensate(w, hessian, grid, 0.01), grid.snap(w))


def test_the_corrected_weight_maps_quantized_inputs_to_float_outputs() -> None:
    xf = correlated_inputs(500, 48, seed=5)
    w = torch.randn(OUT, 48)
    same = corrected_weight(w, xf.double().t() @ xf.double(),
                            xf.double().t() @ xf.double(), 0.01)
    assert torch.allclose(same, w, atol=1e-5)  # nothing to correct
    # The layers below, quantized, distort the inputs (here a linear map and a little noise).
    distortion = torch.eye(48) + 0.1 * torch.randn(48, 48) / 48**0.5
    xq = xf @ distortion + 0.01 * torch.randn(xf.shape) * xf.std(dim=0)
    fixed = corrected_weight(w, xq.double().t() @ xq.double(), xq.double().t() @ xf.double(),
                             0.01)
    target = xf @ w.t()
    assert (xq @ fixed.t() - target).square().mean() < \
        0.1 * (xq @ w.t() - target).square().mean()


def test_windows_are_fixed_by_the_seed_and_skip_binary_and_short_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(" ".join(str(i) for i in range(100)))
    (tmp_path / "short.txt").write_text("1 2 3")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text(" ".join(str(i) for i in range(1000, 1040)))
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 50)

    def tokenize(text: str) -> list[int]:
        return [int(word) for word in text.split()]

    files = text_files((tmp_path,))
    assert len(files) == 4
    windows = calibration_windows(tokenize, files, 5, 30, seed=0)
    assert windows.shape == (5, 30)
    assert torch.equal(windows, calibration_windows(tokenize, files, 5, 30, seed=0))
    for row in windows.tolist():  # a run of one long file
        assert row == list(range(row[0], row[0] + 30))
    assert {row[0] >= 1000 for row in windows.tolist()} == {True, False}
    with pytest.raises(ValueError, match="no calibration file holds 200 tokens"):
        calibration_windows(tokenize, files, 5, 200, seed=0)
    with pytest.raises(ValueError, match="does not exist"):
        text_files((tmp_path / "missing",))
