"""What the kernels share: the interpreter switch, dot precision, shape checks."""

from __future__ import annotations

import os

import torch

# Softmax in base 2 (exp2 is the GPU's native exponent): scores are scaled by log2(e).
LOG2E = 1.4426950408889634

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def is_interpreter() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is defined, so it must be set before the
    kernel modules are imported.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full float32 products, never TF32, for float32 inputs.

    16-bit inputs take the tensor cores' native path whatever this says.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def check_head_dim(head_dim: int) -> None:
    """Refuse head dims the kernels do not tile: powers of two from 16 to 256."""
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0):
        raise ValueError(
            f"the triton attention kernels need a head dim that is a power of two from "
            f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM}, got {head_dim}"
        )

