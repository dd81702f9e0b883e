"""GPTQ 4-bit weights in the AutoGPTQ / GPTQModel v1 checkpoint layout.

A layer ``[out, in]`` is stored as:

* ``qweight`` int32 ``[in/8, out]``: eight 4-bit values along the input dim per int32,
  input row ``8r + j`` in nibble ``j`` (from the lowest bits);
* ``qzeros`` int32 ``[groups, out/8]``: the zero points packed along the output dim the
  same way, each stored as ``zero - 1`` (the v1 convention, read back with ``+ 1``);
* ``scales`` float16 ``[groups, out]``;
* ``g_idx`` int32 ``[in]``: the group of each input row.

``w[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``.

The writer quantizes symmetrically (GPTQ's default ``sym=True``): each group's scale is
``2 * amax / 15`` and its zero 8, so every value lies within half a step of the grid and
the stored zero, 7, never meets v1's wrap of a zero of 0. With act-order it follows
AutoGPTQ's ``desc_act``: input rows are taken in an order ``perm`` (most important
first), the ``k``-th of them joins group ``k // group_size``, and ``qweight`` keeps the
rows in their original order, so ``g_idx[i] = position of i in perm // group_size``.
Without calibration data the default order is by descending column norm of the weight.
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

#: The zero point of symmetric 4-bit quantization (the middle of 0..15).
SYMMETRIC_ZERO = 8
#: The smallest scale written: a float16 normal, so an all-zero group still divides.
MIN_SCALE = 2.0**-14


@dataclass
class GptqWeight(QuantizedWeight):
    """A GPTQ checkpoint's tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``)."""

    format: ClassVar[str] = "gptq"

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], group_size: int) -> GptqWeight:
        """Check a layer's checkpoint tensors and wrap them (``g_idx`` made if absent).

        Raises:
            ValueError: a missing tensor or shapes that do not fit together.
        """
        require_tensors(tensors, ("qweight", "qzeros", "scales"), "GPTQ")
        qweight = tensors["qweight"]
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        size = effective_group_size(group_size, in_features)
        g_idx = tensors.get("g_idx")
        if g_idx is None:
            g_idx = torch.arange(in_features, dtype=torch.int32) // size
        groups = tensors["scales"].shape[0]
        if (tensors["scales"].shape != (groups, out_features)
                or tensors["qzeros"].shape != (groups, out_features // 8)
                or g_idx.shape != (in_features,)
                or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"GPTQ tensors do not fit a [{out_features}, {in_features}] weight "
                             f"with {groups} groups")
        packed = {"qweight": qweight, "qzeros": tensors["qzeros"], "scales": tensors["scales"],
                  "g_idx": g_idx.to(torch.int32)}
        return cls(packed, (out_features, in_features), group_size)

    def int_weight(self) -> torch.Tensor:
        """The 4-bit values ``q`` as int32 ``[in, out]`` (the checkpoint's orientation)."""
        return unpack_int4(self.tensors["qweight"].t().contiguous()).t()

    def zeros(self) -> torch.Tensor:
        """The zero points ``[groups, out]`` (stored value + 1)."""
        return unpack_int4(self.tensors["qzeros"]) + 1

    def dequantize(self) -> torch.Tensor:
        """``(q - zero[g_idx]) * scale[g_idx]`` as float32 ``[out, in]``."""
        g_idx = self.tensors["g_idx"].long()
        q = self.int_weight().float()
        zeros = self.zeros().float()[g_idx]
        scales = self.tensors["scales"].float()[g_idx]
        return ((q - zeros) * scales).t().contiguous()

    def group_rows(self) -> int:
        """Rows per group when groups hold consecutive input rows in order (no act-order):
        row ``i`` in group ``i // size``; 0 otherwise."""
        groups = self.tensors["scales"].shape[0]
        size = self.in_features // groups
        expected = torch.arange(self.in_features, dtype=torch.int32) // max(size, 1)
        return size if torch.equal(self.tensors["g_idx"], expected) else 0

    def narrow_out(self, start: int, length: int) -> GptqWeight:
        """Output columns ``start:start+length`` of every tensor (``qzeros`` packs eight)."""
        check_span(start, length, self.out_features, "GPTQ output rows")
        check_aligned(start, length, NIBBLES_PER_INT32, "GPTQ output rows (packed qzeros)")
        t = self.tensors
        packed = {"qweight": narrowed(t["qweight"], 1, start, length),
                  "qzeros": narrowed(t["qzeros"], 1, start // 8, length // 8),
                  "scales": narrowed(t["scales"], 1, start, length),
                  "g_idx": t["g_idx"]}
        return GptqWeight(packed, (length, self.in_features), self.group_size)

    def narrow_in(self, start: int, length: int) -> GptqWeight:
        """Input rows ``start:start+length`` (``qweight`` packs eight).

        With several groups in input order, the rows' groups come along (renumbered from
        0), so a boundary must fall between groups. With one group, or act-order (any
        ``g_idx``), every group's scales and zeros stay, and ``g_idx`` keeps pointing at them.
        """
        check_span(start, length, self.in_features, "GPTQ input rows")
        check_aligned(start, length, NIBBLES_PER_INT32, "GPTQ input rows (packed qweight)")
        t = self.tensors
        g_idx = narrowed(t["g_idx"], 0, start, length)
        qzeros, scales = t["qzeros"], t["scales"]
        size = self.group_rows()
        if size and scales.shape[0] > 1:
            check_aligned(start, length, size, "GPTQ input rows (groups)")
            first, count = start // size, length // size
            qzeros, scales = narrowed(qzeros, 0, first, count), narrowed(scales, 0, first, count)
            g_idx = g_idx - first
        packed = {"qweight": narrowed(t["qweight"], 0, start // 8, length // 8),
                  "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
        return GptqWeight(packed, (self.out_features, length), self.group_size)

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> GptqWeight:
        """``parts`` stacked along the output; they must share ``g_idx`` (one input grouping).

        Raises:
            ValueError: parts whose input rows are grouped differently.
        """
        in_features = check_parts(cls, parts)
        g_idx = parts[0].tensors["g_idx"]
        if any(not torch.equal(part.tensors["g_idx"], g_idx) for part in parts):
            raise ValueError("cannot stack GPTQ weights whose g_idx differ (act-order "
                             "checkpoints must group the stacked projections' inputs alike)")
        packed = {name: cat_tensors(parts, name, 1) for name in ("qweight", "qzeros", "scales")}
        packed["g_idx"] = g_idx
        return cls(packed, (packed["scales"].shape[1], in_features), parts[0].group_size)


def padded_groups(g_idx: torch.Tensor, groups: int, multiple: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A layout of equal runs for input rows in groups ``g_idx`` of unequal sizes (a
    tensor-parallel rank's share of act-order rows, or groups of a size a kernel cannot
    step through): ``(perm, held, size)``.

    ``held`` are the groups that hold rows, in order; each takes ``size`` positions (the
    largest group's rows rounded up to ``multiple``): its rows in input order, then
    padding. ``perm[k]`` is the input row at position ``k``, or ``len(g_idx)`` for a
    padding row, which a kernel points at a zero column appended to ``x``.
    """
    g_idx = g_idx.long()
    rows, device = g_idx.numel(), g_idx.device
    counts = torch.bincount(g_idx, minlength=groups)
    held = torch.nonzero(counts).squeeze(1)
    size = -(-int(counts.max()) // multiple) * multiple
    slot = torch.zeros(groups, dtype=torch.long, device=device)
    slot[held] = torch.arange(len(held), device=device)  # each held group's run
    order = torch.argsort(g_idx, stable=True)
    first = torch.cumsum(counts, 0) - counts  # each group's first position once sorted
    sorted_groups = g_idx[order]
    positions = slot[sorted_groups] * size + torch.arange(rows, device=device) \
        - first[sorted_groups]
    perm = torch.full((len(held) * size,), rows, dtype=torch.long, device=device)
    perm[positions] = order
    return perm, held, size


def act_order_g_idx(perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """``g_idx`` for input rows quantized in the order ``perm``: rank in ``perm`` // size."""
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(perm.numel(), dtype=perm.dtype)
    return (rank // group_size).to(torch.int32)


def gptq_grid(weight: torch.Tensor, group_size: int = 128, act_order: bool = False,
              perm: torch.Tensor | None = None) -> QuantGrid:
    """The symmetric 4-bit grid of a float ``[out, in]`` weight: each group's float16 scale
    covers its largest magnitude, the zero is 8.

    Args:
        weight: the float matrix.
        group_size: input rows per group, ``-1`` for one group.
        act_order: group the rows in the order ``perm`` instead of their own.
        perm: the act-order row order (default: descending column norm of ``weight``).
    """
    out_features, in_features = weight.shape
    size = effective_group_size(group_size, in_features)
    if not act_order:
        perm = torch.arange(in_features)
    elif perm is None:
        perm = weight.float().norm(dim=0).argsort(descending=True, stable=True)
    groups = in_features // size
    # Group k is the rows perm[k * size : (k + 1) * size].
    amax = weight.float()[:, perm].abs().reshape(out_features, groups, size).amax(dim=2)
    scale = round_scale_up_to_half((2 * amax / 15).clamp(min=MIN_SCALE)).float()
    return QuantGrid(scale, torch.full_like(scale, SYMMETRIC_ZERO),
                     act_order_g_idx(perm, size).long(), low=0, high=15)


def quantize_gptq(weight: torch.Tensor, group_size: int = 128, act_order: bool = False,
                  perm: torch.Tensor | None = None, grid: QuantGrid | None = None
                  ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to GPTQ v1 checkpoint tensors.

    Args:
        weight: the float matrix; ``out`` and ``in`` multiples of 8.
        group_size, act_order, perm: the grid's (``gptq_grid``), unless ``grid`` is given.
        grid: the grid to round to (default: ``gptq_grid``'s, to nearest).
    """
    if grid is None:
        grid = gptq_grid(weight, group_size, act_order, perm)
    zeros = grid.zero.t().contiguous().to(torch.int32) - 1
    return {
        "qweight": pack_int4(grid.codes(weight).to(torch.int32)).t().contiguous(),
        "qzeros": pack_int4(zeros),
        "scales": grid.scale.t().to(torch.float16).contiguous(),
        "g_idx": grid.group.to(torch.int32),
    }
