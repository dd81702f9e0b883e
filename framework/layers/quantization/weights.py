"""The quantized weight of a linear layer, and the 4-bit packing its checkpoint formats share.

A ``QuantizedWeight`` holds a layer's tensors as a checkpoint stores them (or as a
kernel repacked them once after loading) with the layer's shape ``(out, in)``, and
can rebuild the float matrix it stands for (``dequantize``). The formats live beside
this module, one a file: ``gptq``, ``awq``, ``fp8`` and ``int8``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
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


def require_tensors(tensors: dict[str, torch.Tensor], names: Sequence[str], what: str) -> None:
    """Check that a layer's checkpoint ``tensors`` hold every one of ``names``.

    Raises:
        ValueError: naming the ``what`` weight and the tensors it lacks.
    """
    missing = set(names) - tensors.keys()
    if missing:
        raise ValueError(f"{what} weight lacks {sorted(missing)}")


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
