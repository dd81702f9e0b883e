"""What the kernels share: the interpreter switch, dot precision, shape checks, soft-capping."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


def window_arg(sliding_window: int | None) -> int:
    """A layer's sliding window as the kernels' ``SLIDING_WINDOW`` constexpr: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}")
    return sliding_window


def cap_arg(logit_cap: float | None) -> float:
    """A layer's logit cap in base 2 as the kernels' ``LOGIT_CAP`` constexpr: 0.0 for none.

    The kernels hold scores in base 2 (``s * log2(e)``), and
    ``c * tanh(s / c) * log2(e) == C * tanh(s2 / C)`` with ``s2 = s * log2(e)`` and
    ``C = c * log2(e)``: the cap scales with the scores.
    """
    if logit_cap is None:
        return 0.0
    if logit_cap <= 0:
        raise ValueError(f"logit_cap must be > 0 or None, got {logit_cap}")
    return float(logit_cap) * LOG2E


@triton.jit
def soft_cap(qk, LOGIT_CAP: tl.constexpr):
    """``LOGIT_CAP * tanh(qk / LOGIT_CAP)``, finite for every finite ``qk``.

    Not every Triton has ``tanh``: ``tanh(x) = 1 - 2 / (exp(2x) + 1)``, whose
    ``exp`` overflows to ``inf`` for large ``x`` and gives exactly 1 (and -1 as it
    underflows to 0), never ``inf / inf``. Masked scores must be set to ``-inf``
    after capping, since the cap would turn them into ``-LOGIT_CAP``.
    """
    e2x = tl.exp(qk * (2.0 / LOGIT_CAP))
    return LOGIT_CAP - (2.0 * LOGIT_CAP) / (e2x + 1.0)
