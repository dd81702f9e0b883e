"""Online quantization of a loaded model's linear layers (``--quantization int8|fp8``).

As soon as its float weight has loaded (``quantize_on_load``), each ``LinearBase`` layer's
local weight (its tensor-parallel shard) is quantized per output channel (a row-parallel
rank's scales from its rows' magnitudes over every rank's columns, ``LinearBase.row_amax``),
handed to the quantized-linear kernel's ``prepare``, and its float copy is freed; the
layer then multiplies through the kernel's ``apply``. A layer a load leaves float is
quantized after it (``quantize_linear_layers``).
MoE layers' experts are quantized alike, one expert's matrix at a time
(``moe/quantized_experts.py``).
The embedding table and the LM head stay float unless asked for in int8, one scale a row:
``--quantize-embeddings`` (``quantize_embeddings``: the table's lookups, and the logits
where the head is tied to it) and ``--quantize-lm-head`` (``quantize_lm_head``: an untied
head). A weight update from disk gives the quantized layers float weights again
(``float_weights_for_reload``), loads, and quantizes anew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.layers.deferred import deferred
from framework.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from framework.layers.linear import LinearBase
from framework.layers.moe.experts import FusedMoE
from framework.layers.moe.quantized_experts import quantize_experts
from framework.layers.quantization.fp8 import Fp8Weight
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.weights import QuantizedWeight
from framework.registry import QUANT_LINEAR_BACKENDS

#: The formats quantized online from a float checkpoint, by ``--quantization`` name.
ONLINE_FORMATS: dict[str, type[Int8Weight] | type[Fp8Weight]] = {
    "int8": Int8Weight, "fp8": Fp8Weight}


def resolve_quant_backend(name: str, device: torch.device) -> str:
    """``auto`` → ``cpu`` on a CPU, else ``torch``; any other name must be registered.

    Raises:
        ValueError: a name no quantized-linear kernel is registered under.
    """
    if name == "auto":
        return "cpu" if device.type == "cpu" else "torch"
    QUANT_LINEAR_BACKENDS.get(name)  # raises on an unknown name
    return name


def quantize_linear_layers(model: nn.Module, quantization: str, backend: str) -> int:
    """Quantize every ``LinearBase`` of ``model``, and every MoE layer's experts, online
    (those ``quantize_on_load`` quantized already are left as they are); returns how many
    layers it quantized.

    Raises:
        ValueError: a ``quantization`` that is not quantized online from float weights.
    """
    quantize = _online_quantizer(quantization, backend)
    layers = [m for m in model.modules() if _held_in_float(m)]
    for layer in layers:
        quantize(layer)
    return len(layers)


def _held_in_float(module: nn.Module) -> bool:
    """Whether ``module`` is a linear or MoE layer whose weights are float."""
    if isinstance(module, LinearBase):
        return module.quant_weight is None
    return isinstance(module, FusedMoE) and module.quant_experts is None


@dataclass(frozen=True)
class OnlineQuantization:
    """``--quantization int8|fp8`` of a float checkpoint: the format, and the quantized-linear
    kernel (a ``QUANT_LINEAR_BACKENDS`` name) that multiplies it."""

    format: str
    backend: str


def quantize_on_load(model: nn.Module, quantization: str, backend: str) -> None:
    """Have every ``LinearBase`` and MoE layer of ``model`` quantize itself online as soon
    as its float weight has loaded whole (``when_loaded``), so that with deferred weights
    (framework/layers/deferred.py) a load holds the float weights of the few layers it is
    filling, not the float model's; counts what loaded from zero (call before each
    load).

    Raises:
        ValueError: a ``quantization`` that is not quantized online from float weights.
    """
    quantize = _online_quantizer(quantization, backend)
    layers = [m for m in model.modules() if isinstance(m, LinearBase | FusedMoE)]
    for layer in layers:
        layer.float_loaded = 0
        layer.when_loaded = quantize


def _online_quantizer(quantization: str, backend: str) -> Callable[[LinearBase | FusedMoE], None]:
    """What quantizes one loaded linear or MoE layer to ``quantization`` for ``backend``."""
    if quantization not in ONLINE_FORMATS:
        raise ValueError(f"online quantization supports {sorted(ONLINE_FORMATS)}, "
                         f"got {quantization!r}")
    kernel: Any = QUANT_LINEAR_BACKENDS.get(backend)()
    from_float = ONLINE_FORMATS[quantization].from_float

    def quantize(layer: LinearBase | FusedMoE) -> None:
        if isinstance(layer, FusedMoE):
            quantize_experts(layer, from_float, kernel)
            return
        amax, layer.row_amax = layer.row_amax, None
        attach_quantized_weight(layer, from_float(layer.weight.data, amax), kernel)

    return quantize


def quantize_lm_head(model: nn.Module, backend: str) -> int:
    """Quantize ``model``'s untied LM head (this rank's rows) to int8 per output channel;
    returns how many heads (0 where the head is the embedding table, or on a pipeline
    stage without it)."""
    return _int8_tables([m for m in model.modules() if isinstance(m, ParallelLMHead)],
                        backend)


def quantize_embeddings(model: nn.Module, backend: str) -> int:
    """Quantize ``model``'s embedding tables (this rank's rows; not an untied LM head) to
    int8 per row, for lookups and, where the head is tied to one, logits; returns how many
    tables (0 on a pipeline stage without one)."""
    return _int8_tables([m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                         and not isinstance(m, ParallelLMHead)], backend)


def _int8_tables(tables: list[VocabParallelEmbedding], backend: str) -> int:
    """Hold each table's rows in int8 (one scale a row), prepared by ``backend`` for
    logits and as quantized for lookups; returns how many tables."""
    kernel: Any = QUANT_LINEAR_BACKENDS.get(backend)()
    for table in tables:
        weight = Int8Weight.from_float(table.weight.data)
        attach_quantized_weight(table, weight, kernel)
        table.quant_rows = weight
    return len(tables)


def quantized_layers(model: nn.Module) -> list[LinearBase | VocabParallelEmbedding]:
    """The layers of ``model`` whose weights are held quantized."""
    return [m for m in model.modules() if isinstance(m, LinearBase | VocabParallelEmbedding)
            and m.quant_weight is not None]


def attach_quantized_weight(layer: LinearBase | VocabParallelEmbedding,
                            weight: QuantizedWeight, kernel: Any) -> None:
    """Make ``layer`` multiply by ``weight`` through ``kernel`` and free its float weight.

    The float parameter stays (empty, same dtype and device) so code reading its
    dtype still works; the layer's shape is ``weight.shape``.
    """
    layer.quant_weight = kernel.prepare(weight)
    layer.quant_kernel = kernel
    layer.packed_weight = None
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)


def float_weights_for_reload(model: nn.Module) -> int:
    """Give every quantized layer of ``model`` (MoE experts included) a float weight of
    its shape again, deferred (allocated as a float checkpoint loads into it: a
    pre-quantized one gives quantized parts instead), and drop its quantized one;
    returns how many layers."""
    moe_layers = quantized_moe_layers(model)
    for moe in moe_layers:
        moe.hold_float()
    layers = quantized_layers(model)
    for layer in layers:
        layer.weight.data = deferred(layer.quant_weight.shape, layer.weight.dtype,
                                     layer.weight.device)
        layer.quant_weight = None
        layer.quant_kernel = None
        if isinstance(layer, VocabParallelEmbedding):
            layer.quant_rows = None
    return len(layers) + len(moe_layers)


def quantized_moe_layers(model: nn.Module) -> list[FusedMoE]:
    """The MoE layers of ``model`` whose experts are held quantized."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.quant_experts is not None]


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized tensors the quantized layers of ``model`` hold."""
    tensors = [t for m in quantized_layers(model) for t in m.quant_weight.tensors.values()]
    tensors += [t for m in quantized_moe_layers(model) for t in m.quant_experts.tensors()]
    return sum(t.numel() * t.element_size() for t in tensors)
