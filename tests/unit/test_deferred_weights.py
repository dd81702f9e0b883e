"""Deferred float weights (``framework/layers/deferred.py``): a pre-quantized checkpoint's
model allocates no float weight a quantized part replaces, and online quantization holds
the float weights of the layers it is loading alone.

The model of a pre-quantized checkpoint is built on the meta device and placed on its
device with its linear weights (and MoE experts) deferred; the bytes of float tensors
allocated while it loads, counted by a dispatch mode that sees every factory call, must be
those of the weights it keeps in float alone (the embedding table, norms, LM head, a
router), where a model built on its device first allocates every float weight too. With
``--quantization int8|fp8`` each layer is quantized once its float weight is in: watched
between the checkpoint's tensors, at most two layers hold float weights at once (q/k/v
and the output projection, whose tensors interleave in the file), where a float load
ends with all of them, and the quantized weights are those of the whole-model path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from framework.cli_quantize import quantize_checkpoint
from framework.layers.deferred import deferred, is_deferred, materialized, place_on_device
from framework.layers.linear import LinearBase
from framework.layers.moe.experts import FusedMoE
from framework.layers.quantization.checkpoint import (
    attach_checkpoint_weights,
    checkpoint_quantization,
)
from framework.layers.quantization.linear_method import (
    OnlineQuantization,
    float_weights_for_reload,
    quantize_linear_layers,
)
from framework.layers.rotary import RotaryEmbedding
from framework.model_executor import weight_loader
from framework.model_executor.model_config import ModelConfig
from framework.model_executor.weight_loader import (
    create_model,
    fill_dummy_weights,
    load_model,
    load_weights,
)
from tests.model_fixtures import make_tiny_checkpoint

_FACTORIES = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.zeros,
              torch.ops.aten.ones, torch.ops.aten.full}


class FloatAllocations(TorchDispatchMode):
    """Bytes of the floating-point tensors factory calls create off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _FACTORIES and out.is_floating_point() \
                and out.device.type != "meta":
            self.bytes += out.untyped_storage().nbytes()
        return out


@pytest.fixture(scope="module")
def quantized_copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GPTQ tiny Llama and a GPTQ tiny Qwen2-MoE (its experts quantized too)."""
    root = tmp_path_factory.mktemp("deferred")
    copies = {}
    for arch in ("llama", "qwen2_moe"):
        float_dir = make_tiny_checkpoint(root, arch, seed=3)
        copies[arch] = root / f"{arch}_gptq"
        quantize_checkpoint(float_dir, copies[arch], "gptq", group_size=16)
    return copies


def _float_bytes(params: Iterator[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _quantized_params(model: nn.Module) -> list[nn.Parameter]:
    """The float weights a quantized checkpoint's parts replace: linear weights, experts."""
    return [param for module in model.modules()
            for name, param in module.named_parameters(recurse=False)
            if name in getattr(module, "deferrable_weights", ())]


def test_a_deferred_weight_keeps_its_shape_and_takes_no_write_until_materialized() -> None:
    param = nn.Parameter(deferred((6, 4), torch.float32, torch.device("cpu")),
                         requires_grad=False)
    assert is_deferred(param) and param.shape == (6, 4) and param.dtype == torch.float32
    assert param.untyped_storage().nbytes() == 4  # one element
    with pytest.raises(RuntimeError):
        param.data.copy_(torch.ones(6, 4))
    materialized(param).copy_(torch.ones(6, 4))
    assert not is_deferred(param) and torch.equal(param.data, torch.ones(6, 4))
    assert materialized(param).data_ptr() == param.data_ptr()  # allocated once
    assert not is_deferred(deferred((1, 1), torch.float32, torch.device("cpu")))
    assert is_deferred(deferred((64, 1), torch.float32, torch.device("cpu")))  # one input


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_pre_quantized_load_allocates_only_the_weights_kept_in_float(
        quantized_copies: dict[str, Path], arch: str) -> None:
    path = quantized_copies[arch]
    config = ModelConfig.from_pretrained(str(path))
    quantization = checkpoint_quantization(path, None)
    assert quantization is not None
    meter = FloatAllocations()
    with meter:
        model = load_model(config, torch.device("cpu"), quantization=quantization)
    replaced = [p for p in model.parameters() if is_deferred(p)]
    kept = [p for p in model.parameters() if not is_deferred(p)]
    # Every deferrable weight got a one-element placeholder; those a float tensor loaded
    # into (a router's) were allocated whole, and counted among the kept.
    placeholders = sum(p.element_size() for p in _quantized_params(model))
    assert meter.bytes == _float_bytes(iter(kept)) + placeholders
    # A model built on its device first allocated every float weight as well.
    eager = FloatAllocations()
    with eager:
        create_model(config, torch.device("cpu"))
    assert eager.bytes >= meter.bytes + _float_bytes(iter(replaced)) - placeholders
    moe_layers = sum(isinstance(m, FusedMoE) for m in model.modules())
    assert (arch == "qwen2_moe") == (moe_layers > 0)
    # Each MoE layer defers two weights (w13, w2) and attaches as one layer.
    assert attach_checkpoint_weights(model, "cpu") == len(replaced) - moe_layers
    assert all(p.numel() == 0 for p in replaced)


def test_layers_a_checkpoint_holds_in_float_are_allocated_as_they_load(
        quantized_copies: dict[str, Path], tmp_path: Path) -> None:
    """A router, a float layer among quantized ones, gets its float weight on load."""
    path = quantized_copies["qwen2_moe"]
    model = load_model(ModelConfig.from_pretrained(str(path)), torch.device("cpu"),
                       quantization=checkpoint_quantization(path, None))
    routers = [m for name, m in model.named_modules()
               if isinstance(m, LinearBase) and name.endswith("mlp.gate")]
    assert routers and not any(is_deferred(m.weight) for m in routers)
    assert all(m.weight.abs().sum() > 0 for m in routers)
    assert any(isinstance(m, FusedMoE) and m.quant_parts for m in model.modules())


def test_place_on_device_computes_buffers_again_and_keeps_shared_weights(
        tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    config = ModelConfig.from_pretrained(str(path))
    model = create_model(config, torch.device("meta"))
    loaders = {name: p.weight_loader for name, p in model.named_parameters()
               if hasattr(p, "weight_loader")}
    count = place_on_device(model, torch.device("cpu"))
    assert count == sum(isinstance(m, LinearBase) for m in model.modules())
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {name: p.weight_loader for name, p in model.named_parameters()
            if hasattr(p, "weight_loader")} == loaders
    built = create_model(config, torch.device("cpu"))
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes
    for rope, reference in zip(ropes, [m for m in built.modules()
                                       if isinstance(m, RotaryEmbedding)], strict=True):
        torch.testing.assert_close(rope.inv_freq, reference.inv_freq, rtol=0, atol=0)


def test_a_module_whose_buffers_cannot_be_computed_again_is_refused() -> None:
    with torch.device("meta"):
        module = nn.BatchNorm1d(4)
    with pytest.raises(TypeError, match="BatchNorm1d holds buffers"):
        place_on_device(module, torch.device("cpu"))


def test_reload_defers_the_float_weights_until_a_checkpoint_fills_them(
        quantized_copies: dict[str, Path], tmp_path: Path) -> None:
    """Before a weight update, quantized layers get deferred float weights; a float
    checkpoint (or random weights) allocates them as it fills them."""
    float_dir = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    config = ModelConfig.from_pretrained(str(float_dir))
    model = load_model(config, torch.device("cpu"))
    expected = {name: p.clone() for name, p in model.named_parameters()}
    path = quantized_copies["llama"]
    quantized = load_model(ModelConfig.from_pretrained(str(path)), torch.device("cpu"),
                           quantization=checkpoint_quantization(path, None))
    layers = attach_checkpoint_weights(quantized, "cpu")
    assert float_weights_for_reload(quantized) == layers
    assert sum(is_deferred(p) for p in quantized.parameters()) == layers
    load_weights(quantized, float_dir, "auto")
    for name, param in quantized.named_parameters():
        assert torch.equal(param, expected[name]), name
    float_weights_for_reload(quantized)  # no quantized layer left: nothing deferred
    assert not any(is_deferred(p) for p in quantized.parameters())
    attach_checkpoint_weights(quantized, "cpu")
    random = load_model(ModelConfig.from_pretrained(str(path)), torch.device("cpu"),
                        quantization=checkpoint_quantization(path, None))
    fill_dummy_weights(random, seed=0)
    assert not any(is_deferred(p) for p in random.parameters())


def _layers(model: nn.Module) -> list[LinearBase | FusedMoE]:
    return [m for m in model.modules() if isinstance(m, LinearBase | FusedMoE)]


def _holds_float(layer: LinearBase | FusedMoE) -> bool:
    weight = layer.w13 if isinstance(layer, FusedMoE) else layer.weight
    return weight.numel() > 0 and not is_deferred(weight)


def _quantized_tensors(layer: LinearBase | FusedMoE) -> list[torch.Tensor]:
    if isinstance(layer, FusedMoE):
        assert layer.quant_experts is not None
        return list(layer.quant_experts.tensors())
    assert layer.quant_weight is not None
    return list(layer.quant_weight.tensors.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_online_quantization_holds_the_float_weights_of_the_layers_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, load_format: str) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, seed=4)
    config = ModelConfig.from_pretrained(str(path))
    held: list[int] = []
    original = weight_loader.checkpoint_weights

    def watched(model: nn.Module, files: list[Path]) -> Iterator[tuple[str, Any]]:
        for item in original(model, files):
            held.append(sum(_holds_float(layer) for layer in _layers(model)))
            yield item
        held.append(sum(_holds_float(layer) for layer in _layers(model)))

    monkeypatch.setattr(weight_loader, "checkpoint_weights", watched)
    reference = load_model(config, torch.device("cpu"), load_format)
    layers = len(_layers(reference))
    if load_format == "auto":
        assert held[-1] == layers  # a float load ends holding every layer in float
        held.clear()
    quantized = load_model(config, torch.device("cpu"), load_format,
                           online=OnlineQuantization("int8", "cpu"))
    assert max(held, default=0) <= 2 and (load_format == "dummy") == (not held)
    assert not any(_holds_float(layer) for layer in _layers(quantized))
    # The same int8 weights as quantizing the float model whole, after its load.
    assert quantize_linear_layers(reference, "int8", "cpu") == layers
    assert quantize_linear_layers(quantized, "int8", "cpu") == 0
    for ours, theirs in zip(_layers(quantized), _layers(reference), strict=True):
        for a, b in zip(_quantized_tensors(ours), _quantized_tensors(theirs), strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                    "(benchmarks/run_triton_kernels_gpu.sh runs it there)")
def test_pre_quantized_load_on_a_gpu_peaks_below_the_float_weights(
        quantized_copies: dict[str, Path]) -> None:
    path = quantized_copies["qwen2_moe"]
    config = ModelConfig.from_pretrained(str(path))
    device = torch.device("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model(config, device, quantization=checkpoint_quantization(path, None))
    attach_checkpoint_weights(model, "torch")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    float_model = _float_bytes(create_model(config, torch.device("meta")).parameters())
    kept = _float_bytes(p for p in model.parameters() if p.numel() > 0)
    assert peak < kept + (float_model - kept) / 2, (peak, kept, float_model)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_row_parallel_rank_quantized_as_it_loads_scales_whole_rows(quantization: str) -> None:
    """Two ranks' row-parallel parts (and an MoE layer's down projections under tensor
    parallelism), each quantized as it loads, hold the one-rank quantization's codes and
    scales of their columns: the channel scales span every rank's columns."""
    from framework.layers.linear import RowParallelLinear
    from framework.layers.moe.experts import DOWN, GATE, UP
    from framework.layers.quantization.linear_method import ONLINE_FORMATS, quantize_on_load

    torch.manual_seed(0)
    full = torch.randn(24, 64)
    full[:, 40] *= 8  # the rows' largest magnitudes lie in rank 1's columns
    whole = ONLINE_FORMATS[quantization].from_float(full)
    experts = [torch.randn(16, 32) for _ in range(2)]  # down: [hidden 16, intermediate 32]
    for rank in (0, 1):
        layer = RowParallelLinear(64, 24, tp_rank=rank, tp_size=2)
        moe = FusedMoE(2, 16, 32, tp_rank=rank, tp_size=2)
        quantize_on_load(nn.ModuleList([layer, moe]), quantization, "torch")
        layer.weight_loader(layer.weight, full)
        torch.testing.assert_close(layer.quant_weight.dequantize(),
                                   whole.narrow_in(rank * 32, 32).dequantize(), rtol=0, atol=0)
        for expert, down in enumerate(experts):
            moe.weight_loader(moe.w2, down, (expert, DOWN))
            for part in (GATE, UP):
                moe.weight_loader(moe.w13, torch.randn(32, 16), (expert, part))
        assert moe.quant_experts is not None
        for expert, down in enumerate(experts):
            theirs = ONLINE_FORMATS[quantization].from_float(down).narrow_in(rank * 16, 16)
            torch.testing.assert_close(moe.quant_experts.w2[expert].dequantize(),
                                       theirs.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral"])
def test_every_family_built_deferred_and_quantized_as_it_loads_equals_the_eager_path(
        tmp_path: Path, arch: str) -> None:
    """Built on the meta device, placed with deferred weights and quantized as it loads, a
    model holds what one built on its device, loaded, then quantized whole holds: every
    float parameter, every buffer (the rotary frequencies computed again) and every
    quantized tensor, exactly."""
    path = make_tiny_checkpoint(tmp_path, arch, seed=6)
    config = ModelConfig.from_pretrained(str(path))
    ours = load_model(config, torch.device("cpu"), online=OnlineQuantization("int8", "cpu"))
    eager = create_model(config, torch.device("cpu"))
    load_weights(eager, path, "auto")
    quantize_linear_layers(eager, "int8", "cpu")
    for (name, a), (_, b) in zip(ours.named_parameters(), eager.named_parameters(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
    for (name, a), (_, b) in zip(ours.named_buffers(), eager.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for ours_layer, eager_layer in zip(_layers(ours), _layers(eager), strict=True):
        for a, b in zip(_quantized_tensors(ours_layer), _quantized_tensors(eager_layer),
                        strict=True):
            assert torch.equal(a, b)
