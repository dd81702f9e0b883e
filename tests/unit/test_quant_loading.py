"""Online int8/FP8 quantization of a loaded tiny Llama (``--quantization``).

Each quantized linear layer must match the float64 product by the dequantized weight of
the float checkpoint's layer, the LM head and the embedding table must stay float unless
``--quantize-lm-head`` or ``--quantize-embeddings`` (then their logits and lookups are
those of their int8 rows), and the reported weight bytes must shrink to the quantized
tensors'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from framework.config import ServerArgs
from framework.layers.linear import LinearBase
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.linear_method import ONLINE_FORMATS
from framework.model_executor.model_runner import ModelRunner, weight_bytes


def _runner(model_dir: Path, **args: Any) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(model_dir), linear_backend="torch", **args),
                       str(model_dir))


@pytest.fixture(scope="module")
def float_runner(tiny_checkpoint: Any) -> ModelRunner:
    """The float32 tiny Llama, the reference of every quantized one."""
    return _runner(tiny_checkpoint("llama"))


def _linears(runner: ModelRunner) -> dict[str, LinearBase]:
    return {name: m for name, m in runner.model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_layers_match_float64_dequantized_reference(
        tiny_checkpoint: Any, float_runner: ModelRunner, quantization: str, backend: str) -> None:
    """Every linear layer multiplies by the quantized float weight, to float32 rounding."""
    runner = _runner(tiny_checkpoint("llama"), quantization=quantization,
                     quantized_linear_backend=backend)
    floats = _linears(float_runner)
    quantized = _linears(runner)
    assert quantized.keys() == floats.keys() and quantized
    torch.manual_seed(0)
    for name, layer in quantized.items():
        assert layer.quant_weight is not None, name
        w = floats[name].weight.data
        reference_w = ONLINE_FORMATS[quantization].from_float(w).dequantize().double()
        x = torch.randn(5, w.shape[1])
        expected = x.double() @ reference_w.T
        if layer.bias is not None:
            expected += floats[name].bias.double()
        got = layer.product(x, layer.bias)
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4, msg=name)


def test_lm_head_stays_float_and_weight_bytes_shrink(
        tiny_checkpoint: Any, float_runner: ModelRunner) -> None:
    """int8 layers hold a quarter of the float32 bytes (plus scales); the head is untouched."""
    runner = _runner(tiny_checkpoint("llama"), quantization="int8")
    assert runner.model.lm_head.weight.numel() == float_runner.model.lm_head.weight.numel()
    float_linear = sum(m.weight.numel() * 4 for m in _linears(float_runner).values())
    saved = weight_bytes(float_runner.model)[0] - weight_bytes(runner.model)[0]
    assert saved >= 0.7 * float_linear
    assert runner.ranks_info()["weight_bytes_rank_0"] == weight_bytes(runner.model)[1]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_quantized_lm_head_gives_the_logits_of_its_int8_rows(
        tiny_checkpoint: Any, float_runner: ModelRunner, quantization: str | None) -> None:
    """With ``--quantize-lm-head`` (alone, or beside quantized layers) the head holds int8
    rows: logits equal the float64 product by them, and a quarter of its float bytes."""
    runner = _runner(tiny_checkpoint("llama"), quantization=quantization,
                     quantize_lm_head=True, quantized_linear_backend="cpu")
    head, float_head = runner.model.lm_head, float_runner.model.lm_head
    assert head.quant_weight is not None and head.weight.numel() == 0
    reference = Int8Weight.from_float(float_head.weight.data).dequantize().double()
    hidden = torch.randn(3, reference.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(head.compute_logits(hidden).double(),
                               (hidden.double() @ reference.T)[:, :head.num_embeddings],
                               rtol=1e-4, atol=1e-4)
    unquantized = _runner(tiny_checkpoint("llama"), quantization=quantization)
    saved = weight_bytes(unquantized.model)[0] - weight_bytes(runner.model)[0]
    assert saved >= 0.7 * float_head.weight.numel() * 4


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_embeddings_look_up_and_project_their_int8_rows(
        tiny_checkpoint: Any, tied: bool) -> None:
    """With ``--quantize-embeddings`` the table's lookups are its int8 rows times their
    scales; a head tied to it gives the logits of those rows, an untied one stays float."""
    path = tiny_checkpoint("llama", tie_word_embeddings=tied)
    float_model = _runner(path).model
    runner = _runner(path, quantize_embeddings=True, quantized_linear_backend="cpu")
    table, float_table = runner.model.model.embed_tokens, float_model.model.embed_tokens
    reference = Int8Weight.from_float(float_table.weight.data).dequantize()
    ids = torch.tensor([0, 7, 7, reference.shape[0] - 1])
    assert table.quant_rows is not None and table.weight.numel() == 0
    torch.testing.assert_close(table(ids), reference[ids], rtol=1e-6, atol=1e-6)
    assert (table(ids) - float_table(ids)).abs().max() > 0  # the rows were rounded
    head = runner.model.lm_head
    assert (head is table) == tied and (head.quant_weight is None) != tied
    hidden = torch.randn(3, reference.shape[1], generator=torch.Generator().manual_seed(0))
    expected = hidden.double() @ (reference if tied else float_model.lm_head.weight).double().T
    torch.testing.assert_close(head.compute_logits(hidden).double(),
                               expected[:, :head.num_embeddings], rtol=1e-4, atol=1e-4)


def test_unknown_quantized_backend_is_an_error(tiny_checkpoint: Any) -> None:
    """A kernel name that is not registered fails while the model is made."""
    with pytest.raises(Exception, match="nope"):
        _runner(tiny_checkpoint("llama"), quantization="int8", quantized_linear_backend="nope")
