"""A Mixture-of-Experts layer's experts held quantized.

Each expert's gate and up projections (stacked, ``[2I, H]``) and its down projection
(``[H, I]``) are ``QuantizedWeight``s of a checkpoint format, prepared by the
quantized-linear kernel (``--quantized-linear-backend``), which multiplies each expert's
block of routed rows as it multiplies a linear layer's input: the experts run through
the same kernels as the other quantized layers, one expert at a time
(``torch_moe.run_experts``), whatever the ``--moe-backend``.

They come from a pre-quantized checkpoint (each expert's tensors in the format's layout,
this rank's part of them kept as they load: ``stack_expert_parts``) or from the float
experts of a loaded model (``--quantization int8|fp8``: ``quantize_experts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.layers.activation import GatedActivation
from framework.layers.moe.experts import DOWN, GATE, PROJECTIONS, UP
from framework.layers.quantization.weights import QuantizedWeight

if TYPE_CHECKING:
    from framework.layers.moe.experts import FusedMoE


@dataclass
class QuantizedExperts:
    """This rank's experts, quantized: ``w13[e]`` ``[2I, H]`` (gate rows first), ``w2[e]``
    ``[H, I]``, each as ``kernel.prepare`` made it, multiplied by ``kernel``."""

    w13: list[QuantizedWeight]
    w2: list[QuantizedWeight]
    kernel: Any

    @property
    def count(self) -> int:
        """Experts held."""
        return len(self.w13)

    def mlp(self, act: GatedActivation) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Expert ``e``'s gated MLP on its block of rows ``[m, H]``, as
        ``run_experts`` calls it."""
        def run(expert: int, rows: torch.Tensor) -> torch.Tensor:
            hidden = act(self.kernel.apply(self.w13[expert], rows))
            return self.kernel.apply(self.w2[expert], hidden)
        return run

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every quantized tensor the experts hold (their bytes are the layer's)."""
        for weight in (*self.w13, *self.w2):
            yield from weight.tensors.values()


def stack_expert_parts(parts: dict[tuple[int, str], QuantizedWeight], count: int,
                       what: str) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    """Each of the ``count`` local experts' ``(gate on up, down)`` weights from the parts
    it loaded, keyed ``(local expert, GATE | UP | DOWN)``.

    Raises:
        ValueError: an expert whose projections did not all load quantized (some of a
            layer's experts quantized and others float), naming the layer ``what``.
    """
    w13, w2 = [], []
    for expert in range(count):
        missing = [part for part in PROJECTIONS if (expert, part) not in parts]
        if missing:
            raise ValueError(f"{what}: expert {expert}'s {', '.join(missing)} projection(s) "
                             "did not load quantized while others did (a checkpoint must "
                             "quantize all of a layer's experts or none)")
        gate, up = parts[expert, GATE], parts[expert, UP]
        w13.append(type(gate).concat_out([gate, up]))
        w2.append(parts[expert, DOWN])
    return w13, w2


def attach_checkpoint_experts(layer: FusedMoE, kernel: Any, name: str) -> None:
    """Give ``layer`` (named ``name`` in its model) the quantized experts it loaded
    (``quant_parts``), on its device, multiplied by ``kernel``.

    Raises:
        ValueError: experts that did not all load quantized (``stack_expert_parts``).
    """
    w13, w2 = stack_expert_parts(layer.quant_parts, layer.num_local, name)
    device = layer.w13.device
    layer.quant_parts = {}
    layer.hold_quantized(QuantizedExperts([kernel.prepare(w.to(device)) for w in w13],
                                          [kernel.prepare(w.to(device)) for w in w2], kernel))


def quantize_experts(layer: FusedMoE,
                     quantize: Callable[[torch.Tensor, torch.Tensor | None], QuantizedWeight],
                     kernel: Any) -> None:
    """Quantize ``layer``'s loaded float experts one matrix at a time with ``quantize``
    (a format's ``from_float``; a down projection with its whole rows' magnitudes when a
    rank holds some of its columns: ``down_row_amax``), multiplied by ``kernel``."""
    down_amax = layer.down_row_amax
    w13 = [kernel.prepare(quantize(w, None)) for w in layer.w13]
    w2 = [kernel.prepare(quantize(w, down_amax.get(expert))) for expert, w in enumerate(layer.w2)]
    layer.down_row_amax = {}
    layer.hold_quantized(QuantizedExperts(w13, w2, kernel))
