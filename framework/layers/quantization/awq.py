"""AWQ 4-bit weights in the AutoAWQ GEMM checkpoint layout.

A layer ``[out, in]`` is stored as:

* ``qweight`` int32 ``[in, out/8]``: eight 4-bit values along the output dim per int32,
  interleaved: nibbles 0..7 (from the lowest bits) hold output columns
  ``0, 2, 4, 6, 1, 3, 5, 7`` of their group of eight;
* ``qzeros`` int32 ``[groups, out/8]``: the zero points, packed the same way (no offset);
* ``scales`` float16 ``[groups, out]``.

``w[o, i] = (q[i, o] - zero[i // group_size, o]) * scale[i // group_size, o]``.

The writer quantizes asymmetrically, as AutoAWQ does, over each group's range widened
to include 0 (so the zero point is an integer in 0..15 and every value lies within half
a step of the grid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from framework.layers.quantization.grid import QuantGrid
from framework.layers.quantization.weights import (
    NIBBLES_PER_INT32,
    QuantizedWeight,
    cat_tensors,
    check_aligned,
    check_parts,
    check_span,
    effective_group_size,
    narrowed,
    pack_int4,
    require_tensors,
    round_scale_up_to_half,
    unpack_int4,
)

#: The output column that nibble ``j`` of an AWQ int32 holds (within its group of eight).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: The smallest scale written: a float16 normal, so an all-zero group still divides.
MIN_SCALE = 2.0**-14


@dataclass
class AwqWeight(QuantizedWeight):
    """An AWQ checkpoint's tensors (``qweight``, ``qzeros``, ``scales``)."""

    format: ClassVar[str] = "awq"

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], group_size: int) -> AwqWeight:
        """Check a layer's checkpoint tensors and wrap them.

        Raises:
            ValueError: a missing tensor or shapes that do not fit together.
        """
        require_tensors(tensors, ("qweight", "qzeros", "scales"), "AWQ")
        qweight = tensors["qweight"]
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        groups = in_features // effective_group_size(group_size, in_features)
        if (tensors["scales"].shape != (groups, out_features)
                or tensors["qzeros"].shape != (groups, out_features // 8)):
            raise ValueError(f"AWQ tensors do not fit a [{out_features}, {in_features}] weight "
                             f"with {groups} groups")
        packed = {name: tensors[name] for name in ("qweight", "qzeros", "scales")}
        return cls(packed, (out_features, in_features), group_size)

    def int_weight(self) -> torch.Tensor:
        """The 4-bit values ``q`` as int32 ``[in, out]`` (the checkpoint's orientation)."""
        return unpack_int4(self.tensors["qweight"], AWQ_ORDER)

    def zeros(self) -> torch.Tensor:
        """The zero points ``[groups, out]``."""
        return unpack_int4(self.tensors["qzeros"], AWQ_ORDER)

    def dequantize(self) -> torch.Tensor:
        """``(q - zero) * scale`` per group, as float32 ``[out, in]``."""
        size = effective_group_size(self.group_size, self.in_features)
        q = self.int_weight().float()
        zeros = self.zeros().float().repeat_interleave(size, 0)
        scales = self.tensors["scales"].float().repeat_interleave(size, 0)
        return ((q - zeros) * scales).t().contiguous()

    def narrow_out(self, start: int, length: int) -> AwqWeight:
        """Output columns ``start:start+length`` (``qweight`` and ``qzeros`` pack eight)."""
        check_span(start, length, self.out_features, "AWQ output rows")
        check_aligned(start, length, NIBBLES_PER_INT32, "AWQ output rows (packed qweight)")
        t = self.tensors
        packed = {"qweight": narrowed(t["qweight"], 1, start // 8, length // 8),
                  "qzeros": narrowed(t["qzeros"], 1, start // 8, length // 8),
                  "scales": narrowed(t["scales"], 1, start, length)}
        return AwqWeight(packed, (length, self.in_features), self.group_size)

    def narrow_in(self, start: int, length: int) -> AwqWeight:
        """Input rows ``start:start+length`` with their groups; a boundary must fall between
        groups (with one group, ``group_size`` -1, it stays whole for any rows)."""
        check_span(start, length, self.in_features, "AWQ input rows")
        t = self.tensors
        qzeros, scales = t["qzeros"], t["scales"]
        if self.group_size != -1:
            check_aligned(start, length, self.group_size, "AWQ input rows (groups)")
            first, count = start // self.group_size, length // self.group_size
            qzeros, scales = narrowed(qzeros, 0, first, count), narrowed(scales, 0, first, count)
        packed = {"qweight": narrowed(t["qweight"], 0, start, length),
                  "qzeros": qzeros, "scales": scales}
        return AwqWeight(packed, (self.out_features, length), self.group_size)

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> AwqWeight:
        """``parts`` stacked along the output."""
        in_features = check_parts(cls, parts)
        packed = {name: cat_tensors(parts, name, 1) for name in ("qweight", "qzeros", "scales")}
        return cls(packed, (packed["scales"].shape[1], in_features), parts[0].group_size)


def awq_grid(weight: torch.Tensor, group_size: int = 128) -> QuantGrid:
    """The asymmetric 4-bit grid of a float ``[out, in]`` weight: each group's float16 scale
    spans its range widened to include 0, its zero an integer in 0..15."""
    out_features, in_features = weight.shape
    size = effective_group_size(group_size, in_features)
    groups = weight.float().reshape(out_features, in_features // size, size)
    low = groups.amin(dim=2).clamp(max=0)
    high = groups.amax(dim=2).clamp(min=0)
    scale = round_scale_up_to_half(((high - low) / 15).clamp(min=MIN_SCALE)).float()
    zero = torch.round(-low / scale).clamp(0, 15)
    return QuantGrid(scale, zero, torch.arange(in_features) // size, low=0, high=15)


def quantize_awq(weight: torch.Tensor, group_size: int = 128, grid: QuantGrid | None = None
                 ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to AWQ GEMM checkpoint tensors.

    Args:
        weight: the float matrix; ``out`` a multiple of 8.
        group_size: input rows per group, ``-1`` for one group (unless ``grid`` is given).
        grid: the grid to round to (default: ``awq_grid``'s, to nearest).
    """
    grid = awq_grid(weight, group_size) if grid is None else grid
    return {
        "qweight": pack_int4(grid.codes(weight).to(torch.int32).t().contiguous(), AWQ_ORDER),
        "qzeros": pack_int4(grid.zero.t().contiguous().to(torch.int32), AWQ_ORDER),
        "scales": grid.scale.t().to(torch.float16).contiguous(),
    }
