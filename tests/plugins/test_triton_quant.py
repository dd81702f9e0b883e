"""The ``triton`` quantized-linear kernel: every format against float64, and through an Engine.

The kernel cases multiply 21 rows by a ``[72, 128]`` weight in 16 x 32 x 32 tiles: a
partial row block, a partial column block, four K steps (four groups of 32), with the
output poisoned with NaN so that a tile the kernel never writes fails the comparison.
The 4-bit formats come with groups of 32, one group, act-order, groups of 8 (padded to
16 rows) and act-order groups of uneven sizes (as a tensor-parallel rank holds them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from framework import Engine
from framework.cli_quantize import quantize_checkpoint
from framework.layers.quantization.awq import AwqWeight, quantize_awq
from framework.layers.quantization.fp8 import FP8_MAX, Fp8BlockWeight, Fp8Weight, quantize_fp8_block
from framework.layers.quantization.gptq import GptqWeight, quantize_gptq
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.torch_kernels import TorchQuantLinear
from framework.layers.quantization.weights import QuantizedWeight
from framework.registry import QUANT_LINEAR_BACKENDS

pytest.importorskip("triton")
from framework_triton_kernels import quant_gemm
from framework_triton_kernels.quant_gemm import GemmConfig, gemm_config, int4_block_k
from framework_triton_kernels.quant_linear import TritonQuantLinear

from tests.plugins.greedy_rule import (
    FLOAT16_LOGPROB_TOLERANCE,
    FLOAT16_NEAR_TIE,
    assert_same_greedy,
)

ROWS, OUT, IN = 21, 72, 128
SMALL = GemmConfig(block_m=16, block_n=32, block_k=32)
#: Max abs error allowed against the float64 reference: outputs are of order one, and
#: the bound is about one unit in the last place of the largest in each dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 6.25e-2}


def _fp8_per_tensor(w: torch.Tensor) -> Fp8Weight:
    scale = w.abs().max() / FP8_MAX
    return Fp8Weight.from_checkpoint({"weight": (w / scale).to(torch.float8_e4m3fn),
                                      "weight_scale": scale.reshape(1)})


def _uneven_groups(weight: GptqWeight) -> GptqWeight:
    """``weight`` with its four groups of 32 holding 40, 24, 32 and 32 rows, as a
    tensor-parallel rank's share of act-order rows does."""
    g_idx = torch.arange(IN, dtype=torch.int32) // 32
    g_idx[32:40] = 0
    tensors = dict(weight.tensors, g_idx=g_idx[torch.randperm(
        IN, generator=torch.Generator().manual_seed(2))])
    return GptqWeight(tensors, weight.shape, weight.group_size)


#: Each format as a checkpoint (or online quantization) writes it, from a float weight.
FORMATS: dict[str, Callable[[torch.Tensor], QuantizedWeight]] = {
    "gptq-g32": lambda w: GptqWeight.from_checkpoint(quantize_gptq(w, 32), 32),
    "gptq-g32-act-order": lambda w: GptqWeight.from_checkpoint(
        quantize_gptq(w, 32, act_order=True), 32),
    "gptq-channel": lambda w: GptqWeight.from_checkpoint(quantize_gptq(w, -1), -1),
    "awq-g32": lambda w: AwqWeight.from_checkpoint(quantize_awq(w, 32), 32),
    "awq-channel": lambda w: AwqWeight.from_checkpoint(quantize_awq(w, -1), -1),
    "awq-g8-padded": lambda w: AwqWeight.from_checkpoint(quantize_awq(w, 8), 8),
    "gptq-act-order-uneven-groups": lambda w: _uneven_groups(
        GptqWeight.from_checkpoint(quantize_gptq(w, 32, act_order=True), 32)),
    "fp8-channel": Fp8Weight.from_float,
    "fp8-tensor": _fp8_per_tensor,
    # Blocks of 32 (one per K step), and of 48 (K steps of 16; the last block 32 wide).
    "fp8-block-32": lambda w: Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w, 32),
                                                             (32, 32)),
    "fp8-block-48": lambda w: Fp8BlockWeight.from_checkpoint(quantize_fp8_block(w, 48),
                                                             (48, 48)),
    "int8": Int8Weight.from_float,
}


@pytest.fixture(scope="module")
def weights() -> dict[str, QuantizedWeight]:
    """Every format's quantized weight of one float ``[OUT, IN]`` matrix."""
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) / IN**0.5
    return {name: make(w) for name, make in FORMATS.items()}


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every result tensor the launchers make starts as NaN."""
    make = quant_gemm._output
    monkeypatch.setattr(quant_gemm, "_output",
                        lambda x, cols, out: make(x, cols, out).fill_(float("nan")))
    yield


def _activations(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, IN, generator=gen).to(dtype),
            torch.randn(OUT, generator=gen).to(dtype))


def _max_error(weight: QuantizedWeight, dtype: torch.dtype) -> float:
    """Max abs error of the kernel's ``x @ w.T + bias`` against float64."""
    x, bias = _activations(dtype)
    kernel = TritonQuantLinear(SMALL)
    got = kernel.apply(kernel.prepare(weight), x, bias)
    expected = x.double() @ weight.dequantize().double().T + bias.double()
    assert got.dtype == dtype and got.shape == (ROWS, OUT)
    return (got.double() - expected).abs().max().item()  # NaN anywhere makes this NaN


#: Each format in the activation dtype(s) it is checked in: each kernel (int4, 8-bit)
#: meets each dtype in two formats or more, each format one dtype at least (the
#: interpreter runs every program in Python, and a format's own code does not depend on
#: the dtype).
FORMAT_DTYPES = {
    "gptq-g32": (torch.float32, torch.float16),
    "gptq-g32-act-order": (torch.float16,),
    "gptq-channel": (torch.float32,),
    "awq-g32": (torch.float16,),
    "awq-channel": (torch.float32,),
    "awq-g8-padded": (torch.float16,),
    "gptq-act-order-uneven-groups": (torch.float32,),
    "fp8-channel": (torch.float32,),
    "fp8-tensor": (torch.float16,),
    "fp8-block-32": (torch.float16,),
    "fp8-block-48": (torch.float32,),
    "int8": (torch.float32, torch.float16),
}


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize(("name", "dtype"), [(name, dtype) for name in FORMATS
                                             for dtype in FORMAT_DTYPES[name]])
def test_matches_float64_dequantized_reference(weights: dict[str, QuantizedWeight], name: str,
                                               dtype: torch.dtype) -> None:
    err = _max_error(weights[name], dtype)
    assert err < TOLERANCE[dtype], err


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("name", ["gptq-g32-act-order", "fp8-channel", "int8"])
def test_bfloat16_activations(weights: dict[str, QuantizedWeight], name: str) -> None:
    err = _max_error(weights[name], torch.bfloat16)
    assert err < TOLERANCE[torch.bfloat16], err


@pytest.mark.parametrize("name", list(FORMATS))
def test_prepared_weight_stands_for_the_same_matrix(weights: dict[str, QuantizedWeight],
                                                    name: str) -> None:
    """The repacked layout (sorted rows, GPTQ packing, unpacked zeros) loses nothing."""
    prepared = TritonQuantLinear().prepare(weights[name])
    assert prepared.shape == (OUT, IN)
    assert torch.equal(prepared.dequantize(), weights[name].dequantize())


def test_kernel_rows_sorted_padded_or_kept(weights: dict[str, QuantizedWeight]) -> None:
    kernel = TritonQuantLinear()
    act_order = kernel.prepare(weights["gptq-g32-act-order"])
    assert act_order.tensors["perm"].numel() == IN and act_order.group_size == 32
    plain = kernel.prepare(weights["gptq-g32"])
    assert "perm" not in plain.tensors
    assert plain.tensors["qweight"] is weights["gptq-g32"].tensors["qweight"]
    uneven = kernel.prepare(weights["gptq-act-order-uneven-groups"])  # 40 rows pad to 48
    assert uneven.group_size == 48 and uneven.tensors["qweight"].shape == (4 * 48 // 8, OUT)
    small = kernel.prepare(weights["awq-g8-padded"])  # sixteen groups of 8 pad to 16
    assert small.group_size == 16 and small.tensors["perm"].numel() == 2 * IN


def test_leading_dims_and_an_empty_batch(weights: dict[str, QuantizedWeight]) -> None:
    kernel = TritonQuantLinear(SMALL)
    prepared = kernel.prepare(weights["int8"])
    x = torch.randn(2, 3, IN)
    got = kernel.apply(prepared, x)
    # A plain max: torch.testing.assert_close's first call imports for seconds.
    assert (got - TorchQuantLinear().apply(weights["int8"], x)).abs().max().item() < 1e-5
    assert kernel.apply(prepared, torch.randn(0, IN)).shape == (0, OUT)


def test_refusals(weights: dict[str, QuantizedWeight]) -> None:
    kernel = TritonQuantLinear(SMALL)
    with pytest.raises(ValueError, match="activations"):
        kernel.apply(kernel.prepare(weights["int8"]), torch.randn(2, IN, dtype=torch.float64))
    with pytest.raises(ValueError, match="prepare"):
        kernel.apply(weights["int8"], torch.randn(2, IN))
    narrow_blocks = Fp8BlockWeight.from_checkpoint(
        quantize_fp8_block(torch.randn(OUT, IN), 24), (24, 24))
    with pytest.raises(ValueError, match="a multiple of 16 input rows wide, got 24x24"):
        kernel.prepare(narrow_blocks)


def test_tile_choices() -> None:
    assert [int4_block_k(g, 128) for g in (32, 48, 128, 4096)] == [32, 16, 128, 128]
    assert int4_block_k(128, 32) == 32
    prefill = gemm_config(4096, torch.float16)
    assert quant_gemm.w8_config(prefill, 0) == prefill
    scaled = quant_gemm.w8_config(prefill, 128)  # block-wise FP8: a smaller tile
    assert scaled.block_m * scaled.block_n <= quant_gemm.SCALED_TILE_ELEMENTS
    assert 128 % scaled.block_k == 0 and quant_gemm.w8_config(SMALL, 48).block_k == 16
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for rows in (1, 16, 17, 64, 65, 4096):
            config = gemm_config(rows, dtype)
            assert min(config.block_m, config.block_n, config.block_k) >= quant_gemm.MIN_DOT


PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "def add(a, b):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
#: float16 models round hidden states at 2^-11 of their size: DESIGN's greedy rule, at


def _generate(model_dir: Path, quantization: str | None, backend: str) -> list[dict[str, Any]]:
    # float16: the native CPU kernels (float32 and bfloat16 only) are then neither built
    # nor bound, and the quantized layers see the activations a GPU model gives them.
    with Engine(model_path=str(model_dir), launch_mode="thread", device="cpu",
                dtype="float16", quantization=quantization,
                quantized_linear_backend=backend) as engine:
        return engine.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=2)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_engine_greedy_tokens_match_the_torch_kernel(tiny_checkpoint: Callable[..., Path],
                                                     quantization: str) -> None:
    """Online-quantized tiny Llama in float16: the registered ``triton`` kernel (default
    GPU tiles) gives the torch reference kernel's greedy tokens and logprobs."""
    assert QUANT_LINEAR_BACKENDS.get("triton") is TritonQuantLinear
    model_dir = tiny_checkpoint("llama")
    for got, ref in zip(_generate(model_dir, quantization, "triton"),
                        _generate(model_dir, quantization, "torch"), strict=True):
        assert_same_greedy(got, ref, FLOAT16_NEAR_TIE, FLOAT16_LOGPROB_TOLERANCE)


@pytest.mark.parametrize(("fmt", "options"), [
    ("gptq", {"group_size": 32, "act_order": True}), ("fp8", {"block_size": 32})])
def test_engine_on_a_quantized_checkpoint(tiny_checkpoint: Callable[..., Path], tmp_path: Path,
                                          fmt: str, options: dict[str, Any]) -> None:
    """Checkpoints from ``framework quantize``: GPTQ with act-order (the int4 kernel, its
    rows sorted by group and ``x``'s columns gathered alike) and block-wise FP8 (a scale
    per K step) give the torch kernel's tokens."""
    model_dir = tmp_path / fmt
    quantize_checkpoint(tiny_checkpoint("llama"), model_dir, fmt, **options)
    for got, ref in zip(_generate(model_dir, None, "triton"),
                        _generate(model_dir, None, "torch"), strict=True):
        assert_same_greedy(got, ref, FLOAT16_NEAR_TIE, FLOAT16_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("fmt", ["gptq", "fp8_block"])
def test_quantized_moe_experts_run_on_the_triton_kernel(fmt: str) -> None:
    # An MoE layer's quantized experts (gate/up stacked, down) multiply through this kernel
    # as any quantized layer does, one expert's routed rows at a time.
    from tests.unit.test_quant_experts import FORMATS, loaded, quantized_experts, reference, routed

    weights = quantized_experts(FORMATS[fmt])
    layer = loaded(weights, "triton")
    assert layer.quant_experts is not None
    assert isinstance(layer.quant_experts.kernel, TritonQuantLinear)
    with torch.no_grad():
        got = layer(*routed())
    torch.testing.assert_close(got.double(), reference(weights), rtol=1e-4, atol=1e-4)
