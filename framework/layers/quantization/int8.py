"""int8 weight-only quantization: symmetric, one scale per output channel.

A layer ``[out, in]`` is held as ``qweight`` int8 ``[out, in]`` and ``scale`` float32
``[out]``, made online from a float weight: ``scale = amax / 127`` and
``qweight = round(w / scale)``. ``w = qweight * scale[:, None]``.

A checkpoint (``framework quantize --format int8``, ``quant_method: int8``) stores them as
``weight`` (the int8 ``qweight``) and ``weight_scale`` ``[out]`` (or ``[out, 1]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from framework.layers.quantization.grid import QuantGrid, channel_amax, channel_grid
from framework.layers.quantization.weights import (
    QuantizedWeight,
    cat_tensors,
    check_parts,
    check_span,
    narrowed,
    require_tensors,
)

#: The largest magnitude written (symmetric: -128 is left unused).
INT8_MAX = 127
#: The smallest scale written, so an all-zero row still divides.
MIN_SCALE = 2.0**-30


@dataclass
class Int8Weight(QuantizedWeight):
    """An int8 ``qweight`` ``[out, in]`` with its float ``scale`` ``[out]``."""

    format: ClassVar[str] = "int8"

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Int8Weight:
        """Check ``qweight`` and ``scale`` and wrap them.

        Raises:
            ValueError: a missing tensor, or a dtype or shape that does not fit.
        """
        require_tensors(tensors, ("qweight", "scale"), "int8")
        qweight, scale = tensors["qweight"], tensors["scale"]
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"int8 qweight must be a 2-D int8, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        if tuple(scale.shape) != (qweight.shape[0],):
            raise ValueError(f"int8 scale must be [{qweight.shape[0]}], got {tuple(scale.shape)}")
        return cls({"qweight": qweight, "scale": scale}, (qweight.shape[0], qweight.shape[1]))

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor]) -> Int8Weight:
        """Wrap a checkpoint's ``weight`` (int8) and ``weight_scale`` (``[out]`` or
        ``[out, 1]``).

        Raises:
            ValueError: a missing tensor, or a dtype or shape that does not fit.
        """
        require_tensors(tensors, ("weight", "weight_scale"), "int8")
        scale = tensors["weight_scale"]
        if scale.dim() == 2 and scale.shape[1] == 1:
            scale = scale[:, 0]
        return cls.from_tensors({"qweight": tensors["weight"], "scale": scale})

    @classmethod
    def from_float(cls, weight: torch.Tensor, row_amax: torch.Tensor | None = None
                   ) -> Int8Weight:
        """Quantize a float ``[out, in]`` weight (``quantize_int8``) and wrap the result;
        ``row_amax``: each row's largest magnitude when ``weight`` holds only some of the
        row's columns (a tensor-parallel rank's), so the scales are the whole rows'."""
        return cls.from_tensors(quantize_int8(weight, int8_grid(weight, row_amax)))

    def dequantize(self) -> torch.Tensor:
        """``qweight * scale`` as float32 ``[out, in]``."""
        return self.tensors["qweight"].float() * self.tensors["scale"].float()[:, None]

    def narrow_out(self, start: int, length: int) -> Int8Weight:
        """Output rows ``start:start+length`` with their scales."""
        check_span(start, length, self.out_features, "int8 output rows")
        return Int8Weight({"qweight": narrowed(self.tensors["qweight"], 0, start, length),
                           "scale": narrowed(self.tensors["scale"], 0, start, length)},
                          (length, self.in_features))

    def narrow_in(self, start: int, length: int) -> Int8Weight:
        """Input columns ``start:start+length``; every row keeps its scale."""
        check_span(start, length, self.in_features, "int8 input columns")
        return Int8Weight({"qweight": narrowed(self.tensors["qweight"], 1, start, length),
                           "scale": self.tensors["scale"]}, (self.out_features, length))

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> Int8Weight:
        """``parts`` stacked along the output."""
        in_features = check_parts(cls, parts)
        tensors = {"qweight": cat_tensors(parts, "qweight", 0),
                   "scale": cat_tensors(parts, "scale", 0)}
        return cls(tensors, (tensors["qweight"].shape[0], in_features))


def int8_grid(weight: torch.Tensor, row_amax: torch.Tensor | None = None) -> QuantGrid:
    """The int8 grid of a float ``[out, in]`` weight: ``amax / 127`` per output channel
    (``row_amax``: the rows' largest magnitudes, if not ``weight``'s own)."""
    amax = channel_amax(weight, row_amax)
    scale = (amax / INT8_MAX).clamp(min=MIN_SCALE)
    return channel_grid(scale, weight.shape[1], low=-INT8_MAX, high=INT8_MAX)


def quantize_int8(weight: torch.Tensor, grid: QuantGrid | None = None
                  ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to int8 with a float32 scale per output channel
    (``grid``, default ``int8_grid(weight)``): ``qweight``, ``scale`` (a checkpoint names
    them ``weight``, ``weight_scale``)."""
    grid = int8_grid(weight) if grid is None else grid
    return {"qweight": grid.codes(weight).to(torch.int8), "scale": grid.scale[:, 0].clone()}
