"""The linear backends: oneDNN on packed weights against a float64 product, and who gets packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.config import ServerArgs
from framework.layers import linear_kernel
from framework.layers.embedding import VocabParallelEmbedding
from framework.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from framework.layers.linear_kernel import (
    linear,
    onednn_available,
    pack_weight,
    resolve_linear_backend,
)
from framework.model_executor.model_runner import ModelRunner, matmul_modules
from tests.model_fixtures import make_tiny_checkpoint

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
CPU = torch.device("cpu")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_matches_float64(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 80, generator=generator)
    out = linear(x, weight, bias, pack_weight(weight))
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packed_product_takes_leading_dimensions_and_strided_input() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator)
    x = torch.randn(2, 5, 32, generator=generator)
    out = linear(x, weight, None, pack_weight(weight))
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, reference(x, weight, None), atol=1e-4, rtol=1e-5)
    strided = torch.randn(32, 9, generator=generator).T  # [9, 32], not contiguous
    torch.testing.assert_close(linear(strided, weight, None, pack_weight(weight)),
                               reference(strided, weight, None), atol=1e-4, rtol=1e-5)


def test_without_a_packed_weight_the_product_is_torch_s() -> None:
    x, weight, bias = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(linear(x, weight, bias, None), torch.nn.functional.linear(x, weight, bias))


def test_auto_picks_onednn_for_float32_on_a_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_kernel, "cpu_vendor", lambda: "AuthenticAMD")
    expected = "onednn" if onednn_available() else "torch"
    assert resolve_linear_backend("auto", CPU, torch.float32) == expected
    assert resolve_linear_backend("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"


def test_auto_leaves_an_intel_cpu_s_products_to_mkl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_kernel, "cpu_vendor", lambda: "GenuineIntel")
    with_mkl = torch.backends.mkl.is_available()
    assert linear_kernel.mkl_preferred() == with_mkl
    expected = "onednn" if onednn_available() and not with_mkl else "torch"
    assert resolve_linear_backend("auto", CPU, torch.float32) == expected
    if onednn_available():  # asked for by name, it is what runs
        assert resolve_linear_backend("onednn", CPU, torch.float32) == "onednn"


def test_onednn_where_it_cannot_run_and_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="float32 on a CPU"):
        resolve_linear_backend("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on a CPU"):
        resolve_linear_backend("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)


@needs_onednn
def test_layers_use_their_packed_weight_when_they_have_one() -> None:
    """A packed copy that differs from the weight shows which one the layer multiplied by."""
    layers: list[LinearBase] = [QKVParallelLinear(16, 4, 2, 1), RowParallelLinear(16, 16)]
    head = VocabParallelEmbedding(40, 16)
    x = torch.randn(3, 16)
    for module in [*layers, head]:
        torch.nn.init.normal_(module.weight)
        other = torch.randn_like(module.weight)
        module.packed_weight = pack_weight(other)
        out = module.compute_logits(x) if module is head else module(x)
        torch.testing.assert_close(out, reference(x, other, None), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_the_runner_packs_every_linear_layer_and_the_head(tmp_path: Path, tied: bool) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    args = {"model_path": str(path), "device": "cpu", "max_total_tokens": 256}
    backend = "onednn" if onednn_available() else "torch"
    runner = ModelRunner(ServerArgs(**args, linear_backend=backend), str(path))
    modules = matmul_modules(runner.model)
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert len(modules) == len(linears) + 1  # and the head
    assert modules[-1] is runner.model.lm_head
    if tied:
        assert runner.model.lm_head is runner.model.model.embed_tokens
    packed = runner.linear_backend == "onednn"
    assert packed == onednn_available()
    assert all((m.packed_weight is not None) == packed for m in modules)

    plain = ModelRunner(ServerArgs(**args, linear_backend="torch"), str(path))
    assert plain.linear_backend == "torch"
    assert all(m.packed_weight is None for m in matmul_modules(plain.model))
