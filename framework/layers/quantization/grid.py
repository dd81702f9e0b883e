"""The values a quantized format can give one linear weight, apart from how it packs them.

Every format written here (GPTQ, AWQ, FP8, int8) puts a weight ``[out, in]`` on a grid
``w[o, i] = (code - zero[o, g]) * scale[o, g]`` with ``g = group[i]``: one group for a
per-channel format, input rows in groups for the 4-bit ones. Only the codes differ:
integers in ``low..high``, or E4M3 values. A writer fits the grid to a weight and encodes
the weight's nearest codes; a calibrated writer (``calibration.py``) fits the grid, moves
the weight column by column onto it, and has the format encode the result, which then
lies on the grid exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: The smallest normal float8_e4m3fn magnitude: below it the codes are evenly spaced.
FP8_MIN_NORMAL = 2.0**-6
#: E4M3's mantissa bits: each binade holds 2**3 codes.
FP8_MANTISSA_BITS = 3


@dataclass(frozen=True)
class QuantGrid:
    """A format's grid for one weight ``[out, in]``.

    Attributes:
        scale: float32 ``[out, groups]`` (float16 scales held as their exact float32 value).
        zero: float32 ``[out, groups]``, integers (zero for symmetric and FP8 codes).
        group: int64 ``[in]``, the group of each input row.
        e4m3: codes are float8 E4M3 values (``low``/``high`` unused) rather than integers.
        low: the smallest integer code.
        high: the largest integer code.
    """

    scale: torch.Tensor
    zero: torch.Tensor
    group: torch.Tensor
    e4m3: bool = False
    low: float = 0.0
    high: float = 0.0

    def _columns(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and zero of input rows ``rows`` (all by default), broadcastable
        against them: a per-channel grid's single column is not gathered per row."""
        if self.scale.shape[1] == 1:
            return self.scale, self.zero
        group = self.group if rows is None else self.group[rows]
        return self.scale[:, group], self.zero[:, group]

    def _codes(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
               ) -> torch.Tensor:
        """The nearest codes of ``weight`` on columns of ``scale`` and ``zero``."""
        scaled = weight.float() / scale
        # Integers are rounded before the zero is added: ties go to even in the scaled
        # value, as the hub's writers round.
        return self.nearest(scaled if self.e4m3 else torch.round(scaled) + zero)

    def nearest(self, values: torch.Tensor) -> torch.Tensor:
        """The nearest codes (as float32) of ``values`` given in code units."""
        if self.e4m3:
            return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return torch.round(values).clamp(self.low, self.high)

    def code_step(self, codes: torch.Tensor) -> torch.Tensor:
        """The distance from each code to the next one away from zero: 1 for integers;
        for E4M3 it grows with the code's binade."""
        if not self.e4m3:
            return torch.ones_like(codes)
        binade = torch.floor(torch.log2(codes.abs().clamp(min=FP8_MIN_NORMAL)))
        return torch.exp2(binade - FP8_MANTISSA_BITS)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """The weight ``[out, in]`` that codes ``[out, in]`` stand for."""
        scale, zero = self._columns(None)
        return (codes - zero) * scale

    def codes(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The nearest codes (as float32) of ``weight``'s columns (``[out, n]``), which are
        the input rows ``rows`` (default: all of them, in order)."""
        return self._codes(weight, *self._columns(rows))

    def snap(self, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``weight``'s columns (input rows ``rows``) moved to their nearest grid values."""
        scale, zero = self._columns(rows)
        return (self._codes(weight, scale, zero) - zero) * scale


def channel_amax(weight: torch.Tensor, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Each output row's largest magnitude, float32 ``[out]``: ``weight``'s own, or
    ``row_amax`` (the whole rows' when ``weight`` holds some of their columns, as a
    tensor-parallel rank does) on ``weight``'s device."""
    if row_amax is None:
        return weight.float().abs().amax(dim=1)
    return row_amax.to(weight.device, torch.float32)


def channel_grid(scale: torch.Tensor, in_features: int, **codes: float | bool) -> QuantGrid:
    """A grid of one scale per output channel (``scale`` ``[out]``) and no zero."""
    column = scale.float().reshape(-1, 1)
    return QuantGrid(column, torch.zeros_like(column),
                     torch.zeros(in_features, dtype=torch.long), **codes)  # type: ignore[arg-type]
