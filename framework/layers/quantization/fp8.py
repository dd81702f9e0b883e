"""FP8 (E4M3) weights, as the hub's FP8 checkpoints store them.

Per tensor or per channel (compressed-tensors, fbgemm): a layer ``[out, in]`` is stored as
``weight`` ``torch.float8_e4m3fn`` ``[out, in]`` and ``weight_scale``: one float for the
tensor (a scalar, or ``[1]``) or one per output channel (``[out, 1]``).
``w = weight.float() * weight_scale``. Checkpoints quantized for FP8 activations also carry
an ``input_scale``; weight-only kernels leave it unused.

Block-wise (``quantization_config.weight_block_size: [rows, cols]``, as DeepSeek-V3's and
Qwen3's FP8 checkpoints): ``weight`` as above and ``weight_scale_inv`` float32
``[ceil(out / rows), ceil(in / cols)]``, one scale per block of the weight (the last ones
cut short where the block does not divide the shape):
``w[o, i] = weight[o, i] * weight_scale_inv[o // rows, i // cols]`` (despite its name, the
tensor multiplies). A part of the output rows that does not fall on block boundaries (a
tensor-parallel rank's share of a small projection, or q/k/v stacked with a projection
smaller than a block) keeps a scale per row instead: blocks of one row, the same values.
Input columns split only on block boundaries.

The writer sets each scale (a channel's or a block's) to ``amax / 448`` (448 is E4M3's
largest finite value) and rounds ``w / scale`` to E4M3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from framework.layers.quantization.grid import FP8_MAX, QuantGrid, channel_amax, channel_grid
from framework.layers.quantization.weights import (
    QuantizedWeight,
    cat_tensors,
    check_parts,
    check_span,
    narrowed,
    require_tensors,
)

#: The smallest scale written, so an all-zero row still divides.
MIN_SCALE = 2.0**-30


def _check_e4m3(weight: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``weight`` is a 2-D float8_e4m3fn tensor."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"FP8 weight must be a 2-D float8_e4m3fn, got {weight.dtype} "
                         f"{tuple(weight.shape)}")


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
        _check_e4m3(weight)
        if scale.numel() != 1 and tuple(scale.shape) != (weight.shape[0], 1):
            raise ValueError(f"FP8 weight_scale must be per tensor or [{weight.shape[0]}, 1], "
                             f"got {tuple(scale.shape)}")
        return cls(dict(tensors), (weight.shape[0], weight.shape[1]))

    @classmethod
    def from_float(cls, weight: torch.Tensor, row_amax: torch.Tensor | None = None
                   ) -> Fp8Weight:
        """Quantize a float ``[out, in]`` weight online (``quantize_fp8``) and wrap the
        result; ``row_amax``: each row's largest magnitude when ``weight`` holds only some
        of the row's columns (a tensor-parallel rank's), so the scales are the whole rows'."""
        return cls.from_checkpoint(quantize_fp8(weight, fp8_grid(weight, row_amax)))

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


def fp8_grid(weight: torch.Tensor, row_amax: torch.Tensor | None = None) -> QuantGrid:
    """The E4M3 grid of a float ``[out, in]`` weight: a scale per output channel that puts
    the channel's largest magnitude (``row_amax`` if given) at ``FP8_MAX``."""
    amax = channel_amax(weight, row_amax)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return channel_grid(scale, weight.shape[1], e4m3=True)


def quantize_fp8(weight: torch.Tensor, grid: QuantGrid | None = None
                 ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to E4M3 with a float32 scale per output channel
    (``grid``, default ``fp8_grid(weight)``)."""
    grid = fp8_grid(weight) if grid is None else grid
    return {"weight": grid.codes(weight).to(torch.float8_e4m3fn),
            "weight_scale": grid.scale.clone()}


def _blocks(size: int, block: int) -> int:
    """How many blocks of ``block`` cover ``size`` (the last one may be short)."""
    return -(-size // block)


@dataclass
class Fp8BlockWeight(QuantizedWeight):
    """A block-wise FP8 checkpoint's ``weight`` and ``weight_scale_inv`` (module notes);
    ``block`` is ``weight_block_size``: rows, then columns, of a block."""

    format: ClassVar[str] = "fp8_block"
    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, torch.Tensor], block: tuple[int, int]
                        ) -> Fp8BlockWeight:
        """Check a layer's checkpoint tensors against ``block`` and wrap them.

        Raises:
            ValueError: a missing tensor, a weight that is not E4M3, or scales that are not
                one per block.
        """
        require_tensors(tensors, ("weight", "weight_scale_inv"), "block-wise FP8")
        weight, scale = tensors["weight"], tensors["weight_scale_inv"]
        _check_e4m3(weight)
        out_features, in_features = weight.shape
        expected = (_blocks(out_features, block[0]), _blocks(in_features, block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"FP8 weight_scale_inv of a {tuple(weight.shape)} weight in "
                             f"{block[0]}x{block[1]} blocks must be {list(expected)}, got "
                             f"{list(scale.shape)}")
        return cls({"weight": weight, "weight_scale_inv": scale},
                   (out_features, in_features), block=block)

    def row_scales(self) -> torch.Tensor:
        """Each output row's scale in each block of input columns, float32
        ``[out, ceil(in / cols)]``."""
        scale = self.tensors["weight_scale_inv"].float()
        return scale.repeat_interleave(self.block[0], 0)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        """``weight * weight_scale_inv`` (each block's) as float32 ``[out, in]``."""
        scale = self.row_scales().repeat_interleave(self.block[1], 1)[:, :self.in_features]
        return self.tensors["weight"].float() * scale

    def by_rows(self) -> Fp8BlockWeight:
        """The same weight with blocks of one row (each row its blocks' scales)."""
        return Fp8BlockWeight({"weight": self.tensors["weight"], "weight_scale_inv":
                               self.row_scales()}, self.shape, block=(1, self.block[1]))

    def _cuts(self, dim: int, start: int, length: int) -> bool:
        """Whether ``start:start+length`` along ``dim`` ends inside a block."""
        block = self.block[dim]
        return bool(start % block or (length % block and start + length != self.shape[dim]))

    def _narrowed(self, dim: int, start: int, length: int) -> Fp8BlockWeight:
        """Rows (``dim`` 0) or columns (1) ``start:start+length``, with their blocks' scales.

        Raises:
            ValueError: a span outside the weight, or columns that cut a block.
        """
        what = ("output rows", "input columns")[dim]
        check_span(start, length, self.shape[dim], f"block-wise FP8 {what}")
        if dim == 0 and self._cuts(0, start, length):
            return self.by_rows()._narrowed(0, start, length)
        block = self.block[dim]
        if self._cuts(dim, start, length):
            raise ValueError(f"block-wise FP8 {what} {start}:{start + length} cut a block of "
                             f"{block}; a part must start and end on block boundaries")
        first = start // block
        count = _blocks(start + length, block) - first
        weight = narrowed(self.tensors["weight"], dim, start, length)
        scale = narrowed(self.tensors["weight_scale_inv"], dim, first, count)
        return Fp8BlockWeight({"weight": weight, "weight_scale_inv": scale},
                              (weight.shape[0], weight.shape[1]), block=self.block)

    def narrow_out(self, start: int, length: int) -> Fp8BlockWeight:
        """Output rows ``start:start+length`` (off block boundaries: by rows)."""
        return self._narrowed(0, start, length)

    def narrow_in(self, start: int, length: int) -> Fp8BlockWeight:
        """Input columns ``start:start+length``, on block boundaries."""
        return self._narrowed(1, start, length)

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> Fp8BlockWeight:
        """``parts`` stacked along the output: by their blocks where each but the last fills
        its blocks and all share them, else by rows.

        Raises:
            ValueError: parts of other column blocks.
        """
        in_features = check_parts(cls, parts)
        blocks = [part for part in parts if isinstance(part, Fp8BlockWeight)]
        block = blocks[0].block
        if any(part.block[1] != block[1] for part in blocks):
            raise ValueError(f"cannot stack block-wise FP8 weights of blocks "
                             f"{sorted({part.block for part in blocks})}: their column blocks "
                             "differ")
        if any(part.block != block for part in blocks) \
                or any(part.out_features % block[0] for part in blocks[:-1]):
            blocks = [part.by_rows() for part in blocks]
            block = blocks[0].block
        weight = cat_tensors(blocks, "weight", 0)
        scale = cat_tensors(blocks, "weight_scale_inv", 0)
        return cls({"weight": weight, "weight_scale_inv": scale}, (weight.shape[0], in_features),
                   block=block)


def fp8_block_grid(weight: torch.Tensor, block: int) -> QuantGrid:
    """The block-wise E4M3 grid of a float ``[out, in]`` weight: each ``block x block`` block
    (cut short at the edges) shares a scale that puts its largest magnitude at ``FP8_MAX``."""
    out_features, in_features = weight.shape
    rows, cols = _blocks(out_features, block), _blocks(in_features, block)
    padded = F.pad(weight.float().abs(), (0, cols * block - in_features,
                                           0, rows * block - out_features))
    amax = padded.reshape(rows, block, cols, block).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).repeat_interleave(block, 0)[:out_features]
    group = torch.arange(in_features) // block
    return QuantGrid(scale, torch.zeros_like(scale), group, e4m3=True)


def quantize_fp8_block(weight: torch.Tensor, block: int, grid: QuantGrid | None = None
                       ) -> dict[str, torch.Tensor]:
    """Quantize a float ``[out, in]`` weight to E4M3 with a float32 scale per
    ``block x block`` block (``grid``, default ``fp8_block_grid(weight, block)``)."""
    grid = fp8_block_grid(weight, block) if grid is None else grid
    return {"weight": grid.codes(weight).to(torch.float8_e4m3fn),
            "weight_scale_inv": grid.scale[::block].contiguous()}
