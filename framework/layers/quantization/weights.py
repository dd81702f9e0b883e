"""The quantized weight of a linear layer, and the 4-bit packing its checkpoint formats share.

A ``QuantizedWeight`` holds a layer's tensors as a checkpoint stores them (or as a
kernel repacked them once after loading) with the layer's shape ``(out, in)``, and
can rebuild the float matrix it stands for (``dequantize``). The formats live beside
this module, one a file: ``gptq``, ``awq``, ``fp8`` and ``int8``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

#: 4-bit values per int32 of a packed checkpoint tensor.
NIBBLES_PER_INT32 = 8
#: Nibble ``j`` (from the lowest bits) holds element ``j`` of its group of eight.
SEQUENTIAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)


@dataclass
class QuantizedWeight(ABC):
    """A linear layer's quantized weight: its tensors, shape ``(out, in)`` and group size.

    ``group_size`` is the number of input features that share a scale (``-1``: all of
    them; per-channel formats use ``-1`` too).
    """

    format: ClassVar[str]
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, int]
    group_size: int = -1

    @property
    def out_features(self) -> int:
        """Rows of the float matrix (output features)."""
        return self.shape[0]

    @property
    def in_features(self) -> int:
        """Columns of the float matrix (input features)."""
        return self.shape[1]

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 matrix ``[out, in]`` this weight stands for."""

    def to(self, device: torch.device) -> QuantizedWeight:
        """This weight with its tensors on ``device`` (a checkpoint's are read on CPU)."""
        return replace(self, tensors={name: t.to(device) for name, t in self.tensors.items()})

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Refused: only a linear layer's loader takes a quantized weight (its parts with
        ``narrow_out`` / ``narrow_in``); any other parameter reading it is an error."""
        raise ValueError(f"a {self.format} quantized weight loads only into a linear layer")

    def __getitem__(self, index: object) -> torch.Tensor:
        """Refused, as ``narrow``."""
        raise ValueError(f"a {self.format} quantized weight loads only into a linear layer")

    def narrow_out(self, start: int, length: int) -> QuantizedWeight:
        """Output rows ``start:start+length`` (a column-parallel rank's part).

        Checkpoint formats override it; a kernel's repacked layout cannot be split.

        Raises:
            ValueError: a boundary that splits a packed int32, or a layout that cannot split.
        """
        raise ValueError(f"a {self.format} weight cannot be split")

    def narrow_in(self, start: int, length: int) -> QuantizedWeight:
        """Input columns ``start:start+length`` (a row-parallel rank's part).

        Checkpoint formats override it; a kernel's repacked layout cannot be split.

        Raises:
            ValueError: a boundary that splits a packed int32 or a group of scales, or a
                layout that cannot split.
        """
        raise ValueError(f"a {self.format} weight cannot be split")

    @classmethod
    def concat_out(cls, parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """``parts`` stacked along the output (q/k/v, gate/up), as one weight.

        Checkpoint formats override it; a kernel's repacked layout cannot be stacked.

        Raises:
            ValueError: parts of another format, or whose inputs are not quantized alike.
        """
        raise ValueError(f"{cls.format} weights cannot be stacked")


def require_tensors(tensors: dict[str, torch.Tensor], names: Sequence[str], what: str) -> None:
    """Check that a layer's checkpoint ``tensors`` hold every one of ``names``.

    Raises:
        ValueError: naming the ``what`` weight and the tensors it lacks.
    """
    missing = set(names) - tensors.keys()
    if missing:
        raise ValueError(f"{what} weight lacks {sorted(missing)}")


def check_span(start: int, length: int, total: int, what: str) -> None:
    """Raise ``ValueError`` unless ``start:start+length`` lies within ``0:total``."""
    if start < 0 or length <= 0 or start + length > total:
        raise ValueError(f"{what} {start}:{start + length} is outside 0:{total}")


def check_aligned(start: int, length: int, multiple: int, what: str) -> None:
    """Raise ``ValueError`` unless both ends of ``start:start+length`` are multiples of
    ``multiple`` (a boundary inside a packed int32 or a group cannot be cut)."""
    if start % multiple or length % multiple:
        raise ValueError(f"{what} {start}:{start + length} splits a {multiple}-wide unit; "
                         f"its ends must be multiples of {multiple}")


def check_parts(cls: type[QuantizedWeight], parts: Sequence[QuantizedWeight]) -> int:
    """Check ``parts`` can stack along the output: all of ``cls``, one input width and
    group size; returns the input width.

    Raises:
        ValueError: no parts, or parts that differ in format, input width or group size.
    """
    if not parts:
        raise ValueError(f"no {cls.format} weights to concatenate")
    first = parts[0]
    for part in parts:
        if (not isinstance(part, cls) or part.in_features != first.in_features
                or part.group_size != first.group_size):
            raise ValueError(f"cannot stack a {part.format} weight {part.shape} (group size "
                             f"{part.group_size}) on a {first.format} weight {first.shape} "
                             f"(group size {first.group_size})")
    return first.in_features


def narrowed(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """A contiguous copy of ``tensor.narrow(dim, start, length)``: a rank's part must not
    keep the whole checkpoint tensor alive through a view."""
    return tensor.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def cat_tensors(parts: Sequence[QuantizedWeight], name: str, dim: int) -> torch.Tensor:
    """Tensor ``name`` of every part, concatenated along ``dim``."""
    return torch.cat([part.tensors[name] for part in parts], dim=dim)


def effective_group_size(group_size: int, in_features: int) -> int:
    """``group_size``, with ``-1`` (one group) resolved to ``in_features``.

    Raises:
        ValueError: a group size that does not divide ``in_features``.
    """
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size:
        raise ValueError(f"group size {group_size} does not divide {in_features} input features")
    return size


def pack_int4(values: torch.Tensor, order: Sequence[int] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """Pack 4-bit values (0..15) along the last dim, eight to an int32.

    Nibble ``j`` of each int32 (from the lowest bits) takes element ``order[j]`` of its
    group of eight; the last dim shrinks eightfold.
    """
    if values.shape[-1] % NIBBLES_PER_INT32:
        raise ValueError(f"cannot pack {values.shape[-1]} values in groups of eight")
    if values.min() < 0 or values.max() > 15:
        raise ValueError("4-bit values must lie in 0..15")
    groups = values.to(torch.int64).reshape(*values.shape[:-1], -1, NIBBLES_PER_INT32)
    packed = torch.zeros(groups.shape[:-1], dtype=torch.int64, device=values.device)
    for nibble, element in enumerate(order):
        packed |= groups[..., element] << (4 * nibble)
    # The top nibble reaches bit 31: store the bits as a two's-complement int32.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor, order: Sequence[int] = SEQUENTIAL_ORDER) -> torch.Tensor:
    """The inverse of ``pack_int4``: int32 ``[..., k]`` → int32 values 0..15 ``[..., 8k]``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed 4-bit tensors are int32, got {packed.dtype}")
    values = torch.empty(*packed.shape, NIBBLES_PER_INT32, dtype=torch.int32,
                         device=packed.device)
    for nibble, element in enumerate(order):
        # An arithmetic shift of a negative int32 still leaves the nibble in the low bits.
        values[..., element] = (packed >> (4 * nibble)) & 0xF
    return values.reshape(*packed.shape[:-1], -1)


def round_scale_up_to_half(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as float16, never below it, so a group's range still fits 16 steps.

    float16 keeps 11 significant bits, so nudging the value up by 2^-10 of itself before
    rounding to nearest gives the nearest float16 at or above it.
    """
    return (scale.float() * (1 + 2.0**-10)).to(torch.float16)
