"""Loading pre-quantized checkpoints: which format one holds, and its tensors per layer.

A checkpoint says it is quantized in ``config.json``'s ``quantization_config``
(``quant_method``: ``gptq``, ``awq``, ``fp8`` or ``int8``); ``--quantization`` may name the
same method, never another. While the weights load, each quantized layer's tensors
(``<layer>.qweight``, ``.qzeros``, ``.scales``, ``.g_idx`` for GPTQ and AWQ;
``<layer>.weight`` with ``.weight_scale`` for FP8 and int8, with ``.weight_scale_inv`` for
block-wise FP8) are gathered into one
``QuantizedWeight`` and handed to the model as ``<layer>.weight``, so that each model's
``load_weights`` maps and stacks it as it does a float weight. The linear layer's loader
keeps this rank's part of it (``narrow_out`` / ``narrow_in``); once every weight is in,
``attach_checkpoint_weights`` stacks each layer's parts (``concat_out``) and hands the
result to the quantized-linear kernel. Tensors of unquantized layers (embeddings, norms,
the LM head) pass through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.layers.linear import CheckpointWeight, LinearBase
from framework.layers.moe.experts import FusedMoE
from framework.layers.moe.quantized_experts import attach_checkpoint_experts
from framework.layers.quantization.awq import AwqWeight
from framework.layers.quantization.fp8 import Fp8BlockWeight, Fp8Weight
from framework.layers.quantization.gptq import GptqWeight
from framework.layers.quantization.int8 import Int8Weight
from framework.layers.quantization.linear_method import attach_quantized_weight
from framework.layers.quantization.weights import QuantizedWeight
from framework.registry import QUANT_LINEAR_BACKENDS


@dataclass(frozen=True)
class TensorLayout:
    """How one format names a layer's tensors in a checkpoint.

    ``marker``: the tensor whose presence makes ``<layer>`` quantized; ``parts``: every
    tensor of the layer that belongs to its quantized weight.
    """

    marker: str
    parts: tuple[str, ...]


#: Each checkpoint format's tensor names, by ``quant_method``.
LAYOUTS: dict[str, TensorLayout] = {
    "gptq": TensorLayout("qweight", ("qweight", "qzeros", "scales", "g_idx")),
    "awq": TensorLayout("qweight", ("qweight", "qzeros", "scales")),
    "fp8": TensorLayout("weight_scale", ("weight", "weight_scale", "input_scale")),
    "int8": TensorLayout("weight_scale", ("weight", "weight_scale")),
}
#: Block-wise FP8's tensor names (``quant_method: fp8`` with ``weight_block_size``).
FP8_BLOCK_LAYOUT = TensorLayout("weight_scale_inv", ("weight", "weight_scale_inv", "input_scale"))
#: The methods whose checkpoints load (``quantization_config.quant_method``).
CHECKPOINT_METHODS = tuple(LAYOUTS)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization: its method and, for the 4-bit ones, the group size; for
    block-wise FP8, the block (rows, columns)."""

    method: str
    group_size: int = -1
    block: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CheckpointQuantization:
        """Read ``quantization_config``; only layouts this package loads are accepted.

        Raises:
            ValueError: an unknown method, or options of a known one that are not loaded
                (bits other than 4, AWQ other than GEMM, GPTQ v2 zeros, FP8 blocks that are
                not two positive integers).
        """
        method = str(config.get("quant_method", "")).lower()
        if method not in LAYOUTS:
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                             f"(supported: {', '.join(CHECKPOINT_METHODS)})")
        problem = _unsupported_option(method, config)
        if problem:
            raise ValueError(f"{method} checkpoint: {problem}")
        block = config.get("weight_block_size") if method == "fp8" else None
        return cls(method, int(config.get("group_size", -1)),
                   None if block is None else (int(block[0]), int(block[1])))

    @property
    def layout(self) -> TensorLayout:
        """The names of a quantized layer's tensors in this checkpoint."""
        return FP8_BLOCK_LAYOUT if self.block else LAYOUTS[self.method]

    def build(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One layer's quantized weight from its checkpoint tensors (short names).

        Raises:
            ValueError: tensors missing or of shapes that do not fit together.
        """
        builders: dict[str, Callable[[], QuantizedWeight]] = {
            "gptq": lambda: GptqWeight.from_checkpoint(tensors, self.group_size),
            "awq": lambda: AwqWeight.from_checkpoint(tensors, self.group_size),
            "fp8": lambda: Fp8Weight.from_checkpoint(tensors) if self.block is None
            else Fp8BlockWeight.from_checkpoint(tensors, self.block),
            "int8": lambda: Int8Weight.from_checkpoint(tensors),
        }
        return builders[self.method]()

    def group(self, weights: Iterable[tuple[str, CheckpointWeight]], names: Iterable[str]
              ) -> Iterator[tuple[str, CheckpointWeight | QuantizedWeight]]:
        """``weights`` with each quantized layer's tensors gathered into one weight.

        ``names`` are every tensor name of the checkpoint, read beforehand, so that a
        layer's weight is yielded (as ``<layer>.weight``) as soon as its last tensor is
        read, wherever in the files its tensors lie; at most a few layers' quantized
        tensors are held at once.

        Raises:
            ValueError: a layer's tensors that do not make a weight of this format.
        """
        expected = self._layer_parts(names)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            layer, _, part = name.rpartition(".")
            if part not in expected.get(layer, ()):
                yield name, tensor
                continue
            parts = pending.setdefault(layer, {})
            parts[part] = tensor[...]
            if parts.keys() == expected[layer]:
                del pending[layer]
                try:
                    weight = self.build(parts)
                except ValueError as exc:
                    raise ValueError(f"checkpoint layer {layer!r}: {exc}") from None
                yield f"{layer}.weight", weight

    def _layer_parts(self, names: Iterable[str]) -> dict[str, set[str]]:
        """For each quantized layer of a checkpoint with tensors ``names``, its parts."""
        by_layer: dict[str, set[str]] = {}
        for name in names:
            layer, _, part = name.rpartition(".")
            by_layer.setdefault(layer, set()).add(part)
        layout = self.layout
        return {layer: parts & set(layout.parts) for layer, parts in by_layer.items()
                if layout.marker in parts}


def _unsupported_option(method: str, config: dict[str, Any]) -> str | None:
    """Why a ``quantization_config`` of a known method does not load here (None: it does)."""
    if method in ("gptq", "awq") and int(config.get("bits", 4)) != 4:
        return f"only 4-bit weights load, got bits={config.get('bits')}"
    if method == "gptq" and config.get("checkpoint_format", "gptq") != "gptq":
        return f"only the v1 layout (checkpoint_format gptq) loads, got " \
               f"{config.get('checkpoint_format')!r}"
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        return f"only the GEMM layout (version gemm) loads, got {config.get('version')!r}"
    block = config.get("weight_block_size")
    if method == "fp8" and block is not None and not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(side, int) and side > 0 for side in block)):
        return f"weight_block_size must be two positive integers [rows, columns], got {block!r}"
    return None


def read_quantization_config(model_path: str | Path) -> dict[str, Any] | None:
    """``quantization_config`` of ``model_path``'s ``config.json`` (None: none, or no file).

    Raises:
        ValueError: a ``config.json`` that is not JSON, or a ``quantization_config`` that is
            not an object.
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed {path}: {exc}") from exc
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{path}: quantization_config must be an object")
    return quant


def checkpoint_quantization(model_path: str | Path, requested: str | None
                            ) -> CheckpointQuantization | None:
    """The pre-quantized format of the checkpoint at ``model_path``, checked against
    ``--quantization`` (``requested``). None: a float checkpoint (which ``int8`` and
    ``fp8`` quantize online).

    Raises:
        ValueError: ``requested`` contradicts the checkpoint's ``quant_method``; ``gptq`` or
            ``awq`` asked of a float checkpoint; a configuration that does not load.
    """
    config = read_quantization_config(model_path)
    if config is None:
        if requested in ("gptq", "awq"):
            raise ValueError(f"--quantization {requested} loads a {requested} checkpoint, but "
                             f"{Path(model_path) / 'config.json'} has no quantization_config "
                             f"(make one with `framework quantize --format {requested}`)")
        return None
    method = str(config.get("quant_method", "")).lower()
    if requested is not None and requested != method:
        raise ValueError(f"--quantization {requested} contradicts the checkpoint's "
                         f"quantization_config.quant_method {method!r} "
                         f"({Path(model_path) / 'config.json'})")
    return CheckpointQuantization.from_config(config)


def describe_quantization(quantization: CheckpointQuantization | None) -> str:
    """A checkpoint's quantization in words (``gptq, group size 128``; ``float``)."""
    if quantization is None:
        return "float"
    details = [quantization.method]
    if quantization.group_size != -1:
        details.append(f"group size {quantization.group_size}")
    if quantization.block is not None:
        details.append(f"blocks of {quantization.block[0]} x {quantization.block[1]}")
    return ", ".join(details)


def stack_parts(parts: dict[int, QuantizedWeight], shape: tuple[int, int], what: str
                ) -> QuantizedWeight:
    """The parts a layer loaded (by their first output row) as one ``[out, in]`` weight.

    Raises:
        ValueError: parts that leave rows out, overlap, or do not fit ``shape`` (a stacked
            layer with some projections quantized and others float).
    """
    ordered = [parts[offset] for offset in sorted(parts)]
    starts = [0]
    for part in ordered:
        starts.append(starts[-1] + part.out_features)
    if sorted(parts) != starts[:-1] or starts[-1] != shape[0] \
            or any(part.in_features != shape[1] for part in ordered):
        got = {offset: part.shape for offset, part in sorted(parts.items())}
        raise ValueError(f"{what}: quantized parts {got} do not make its {shape} weight "
                         "(are some of its projections quantized and others not?)")
    return ordered[0] if len(ordered) == 1 else type(ordered[0]).concat_out(ordered)


def attach_checkpoint_weights(model: nn.Module, backend: str) -> int:
    """Give every ``LinearBase`` that loaded quantized parts its stacked weight, and every
    MoE layer whose experts loaded quantized those experts, on the layer's device,
    multiplied by the quantized-linear kernel registered as ``backend``; returns how many
    layers. Layers the checkpoint holds in float stay float.

    Raises:
        ValueError: a layer whose parts do not make its weight (``stack_parts``), or MoE
            experts only some of which loaded quantized.
    """
    kernel = QUANT_LINEAR_BACKENDS.get(backend)()
    count = 0
    for name, layer in model.named_modules():
        if isinstance(layer, FusedMoE) and layer.quant_parts:
            attach_checkpoint_experts(layer, kernel, name)
            count += 1
        if not isinstance(layer, LinearBase) or not layer.quant_parts:
            continue
        shape = (layer.weight.shape[0], layer.weight.shape[1])
        weight = stack_parts(layer.quant_parts, shape, name).to(layer.weight.device)
        layer.quant_parts = {}
        attach_quantized_weight(layer, weight, kernel)
        count += 1
    return count
