"""FP8 (E4M3) weights, as the hub's FP8 checkpoints store them (compressed-tensors, fbgemm).

A layer ``[out, in]`` is stored as ``weight`` ``torch.float8_e4m3fn`` ``[out, in]`` and
``weight_scale``: one float for the tensor (a scalar, or ``[1]``) or one per output channel
(``[out, 1]``). ``w = weight.float() * weight_scale``. Checkpoints quantized for FP8
activations also carry an ``input_scale``; weight-only kernels leave it unused.

The writer quantizes per channel: ``weight_scale = amax / 448`` (448 is E4M3's largest
finite value) and ``weight = (w / weight_scale)`` rounded to E4M3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from framework.layers.quantization.grid import FP8_MAX, QuantGrid, channel_grid
from framework.layers.quantization.weights import (
    QuantizedWeight,
    check_parts,
    check_span,
    narrowed,
    require_tensors,
)

#: The smallest scale written, so an all-zero row still divides.
MIN_SCALE = 2.0**-30


@dataclass
class Fp8Weight(QuantizedWeight):
    """An FP8 checkpoint's ``weight`` and ``weight_scale`` (and any ``input_scale``)."""

    format: ClassVar[str] = "fp8"

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        """Check a layer's checkpoint tensors and wrap them.

        Raises:
            ValueError: a missing tensor, a weight that is not E4M3, or a scale that is
                neither per tensor nor per output channel.
        """
        require_tensors(tensors, ("weight", "weight_scale"), "FP8")
        weight, scale = tensors["weight"], tensors["weight_scale"]
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"FP8 weight must be a 2-D float8_e4m3fn, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if scale.numel() != 1 and tuple(scale.shape) != (weight.shape[0], 1):
            raise ValueError(f"FP8 weight_scale must be per tensor or [{weight.shape[0]}, 1], "
                             f"got {tuple(scale.shape)}")
        return cls(dict(tensors), (weight.shape[0], weight.shape[1]))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Fp8Weight:
        """Quantize a float ``[out, in]`` weight online (``quantize_fp8``) and wrap the result."""
        return cls.from_checkpoint(quantize_fp8(weight))

    def channel_scales(self) -> torch.Tensor:
        """The scale of each output channel as float32 ``[out]`` (a per-tensor one repeated)."""
        return self.tensors["weight_scale"].float().reshape(-1).expand(self.out_features)

    def dequantize(self) -> torch.Tensor:
        """``weight * weight_scale`` as float32 ``[out, in]``."""
        return self.tensors["weight"].float() * self.channel_scales()[:, None]

    def _with(self, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
        """A weight of these codes and scales, keeping any ``input_scale``."""
        tensors = {"weight": weight, "weight_scale": scale}
        if "input_scale" in self.tensors:
            tensors["input_scale"] = self.tensors["input_scale"]
        return Fp8Weight(tensors, (weight.shape[0], weight.shape[1]))

    def narrow_out(self, start: int, length: int) -> Fp8Weight:
        """Output rows ``start:start+length``; a per-channel scale is narrowed with them."""
        check_span(start, length, self.out_features, "FP8 output rows")
        scale = self.tensors["weight_scale"]
        if scale.numel() != 1:
            scale = narrowed(scale, 0, start, length)
        return self._with(narrowed(self.tensors["weight"], 0, start, length), scale)

    def narrow_in(self, start: int, length: int) -> Fp8Weight:
        """Input columns ``start:start+length``; every row keeps its scale."""
        check_span(start, length, self.in_features, "FP8 input columns")
        return self._with(narrowed(self.tensors["weight"], 1, start, length),
                          self.tensors["weight_scale"])

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> Fp8Weight:
        """``parts`` stacked along the output, their scales made per channel (parts quantized
        per tensor keep their own scale for their rows); the largest ``input_scale`` stays."""
        in_features = check_parts(cls, parts)
        fp8_parts = [part for part in parts if isinstance(part, Fp8Weight)]
        weight = torch.cat([part.tensors["weight"] for part in fp8_parts])
        scale = torch.cat([part.channel_scales()[:, None] for part in fp8_parts])
        tensors = {"weight": weight, "weight_scale": scale}
        input_scales = [part.tensors["input_scale"].reshape(-1).float().max()
                        for part in fp8_parts if "input_scale" in part.tensors]
        if input_scales:
            tensors["input_scale"] = torch.stack(input_scales).max()
        return cls(tensors, (weight.shape[0], in_features))


def fp8_grid(weight: torch.Tensor) -> QuantGrid:
    """The E4M3 grid of a float ``[out, in]`` weight: a scale per output channel that puts
    the channel's largest magnitude at ``FP8_MAX``."""
    scale = (weight.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return channel_grid(scale, weight.shape[1], e4m3=True)


def quantize_fp8(weight: torch.Tensor, grid: QuantGrid | None = None
                 ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to E4M3 with a float32 scale per output channel
    (``grid``, default ``fp8_grid(weight)``)."""
    grid = fp8_grid(weight) if grid is None else grid
    return {"weight": grid.codes(weight).to(torch.float8_e4m3fn),
            "weight_scale": grid.scale.clone()}
