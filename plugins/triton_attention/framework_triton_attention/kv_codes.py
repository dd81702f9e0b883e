"""8-bit KV codes in the kernels: the formats of a quantized pool and their exact conversions.

A pool built with ``--kv-cache-dtype`` (``framework.mem_cache.kv_quant``) holds
``fp8_e4m3`` codes with one float32 scale per layer and KV head, or ``int8``
codes with one float16 scale per slot and KV head (``x ≈ code * scale``). The
kernels take a layer's format as the ``KV_QUANT`` constexpr (``KV_PLAIN``,
``KV_FP8``, ``KV_INT8``) and its scales as pointers.

E4M3 codes reach the kernels as their bytes (``uint8``) and are widened and
narrowed here with integer operations: Triton's interpreter rounds float32 to
float8 wrongly when the mantissa's carry reaches the exponent, and the bit
arithmetic is exact on every target. Rounding to the nearest integer is written
out too (the interpreter has no ``rint``), as is the division (``div_rn``: a GPU's
``/`` on float32 is approximate), so that the codes written equal the pool's own
``set_kv_buffer`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from framework.mem_cache.memory_pool import MHATokenToKVPool

#: ``KV_QUANT`` of a pool in the model's dtype, of E4M3 codes, of int8 codes.
KV_PLAIN = tl.constexpr(0)
KV_FP8 = tl.constexpr(1)
KV_INT8 = tl.constexpr(2)
_FORMATS = {"fp8_e4m3": KV_FP8.value, "int8": KV_INT8.value}

# The largest E4M3 magnitude, and the int8 codes' bound and smallest scale, as the pool's.
FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)
MIN_INT8_SCALE = tl.constexpr(1e-4)


@dataclass(frozen=True)
class KVCodes:
    """One quantized layer's format and scales, as the kernels take them."""

    fmt: int  # KV_FP8 or KV_INT8
    k_scales: torch.Tensor  # float32 [kv_heads] (fp8) or float16 [slots, kv_heads] (int8)
    v_scales: torch.Tensor

    @property
    def per_token(self) -> bool:
        """Whether each slot has scales of its own (int8), not each head one (fp8)."""
        return self.k_scales.dim() == 2

    @property
    def scale_stride(self) -> int:
        """Elements between two slots' scales: 0 for a per-head (fp8) scale."""
        return self.k_scales.stride(0) if self.per_token else 0


def layer_kv(pool: MHATokenToKVPool, layer_id: int
             ) -> tuple[torch.Tensor, torch.Tensor, KVCodes | None]:
    """A layer's key and value buffers as the kernels read them, and its codes' format.

    E4M3 buffers come as their bytes; a pool in the model's dtype has no ``KVCodes``.
    """
    k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
    if not pool.quantized:
        return k_buffer, v_buffer, None
    k_scales, v_scales = pool.k_scales[layer_id], pool.v_scales[layer_id]
    assert k_scales is not None and v_scales is not None  # a quantized pool keeps scales
    if k_scales.stride() != v_scales.stride():
        raise ValueError("the kernels need the key and value scales laid out alike")
    if k_buffer.dtype == torch.float8_e4m3fn:
        k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
    return k_buffer, v_buffer, KVCodes(_FORMATS[pool.kv_cache_dtype], k_scales, v_scales)


def scale_args(codes: KVCodes | None, dummy: torch.Tensor) -> tuple[torch.Tensor,
                                                                    torch.Tensor, int, int]:
    """``(k_scale, v_scale, scale_stride, KV_QUANT)`` for a kernel; ``dummy`` stands in for
    the scales of a plain pool, which the kernels never read."""
    if codes is None:
        return dummy, dummy, 0, KV_PLAIN.value
    return codes.k_scales, codes.v_scales, codes.scale_stride, codes.fmt


@triton.jit
def round_half_even(x):
    """``x`` (float32, ``|x| < 2**23``) rounded to the nearest integer, ties to even."""
    whole = x.to(tl.int32)  # toward zero
    truncated = whole.to(tl.float32)
    frac = tl.abs(x - truncated)  # exact: x and its truncation share their leading bits
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    return tl.where(up, truncated + tl.where(x < 0, -1.0, 1.0), truncated)


@triton.jit
def e4m3_to_float(code):
    """float32 values of E4M3 (``float8_e4m3fn``) codes given as bytes, exactly.

    Sign, 4-bit exponent of bias 7, 3-bit mantissa; exponent 0 holds the
    subnormals ``m * 2**-9``; ``0x7F``/``0xFF`` are NaN (the format has no infinity).
    """
    bits = code.to(tl.int32) & 0xFF
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    # A normal code's float32: the exponent rebiased from 7 to 127, the mantissa on top.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9
    magnitude = tl.where(exponent == 0, subnormal, normal)
    value = tl.where(bits >= 0x80, -magnitude, magnitude)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def float_to_e4m3(x):
    """E4M3 codes (int32, 0..255) of float32 ``x`` within ±448, rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Normal range (>= 2**-6): round float32's mantissa to 3 bits, ties to even; a carry
    # runs on into the exponent, which is then rebiased from 127 to 7.
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal range: whole steps of 2**-9 (8 steps round up to the smallest normal code).
    subnormal = round_half_even(tl.abs(x) * 512.0).to(tl.int32)
    code = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000: 2**-6
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def load_kv(buffer_ptr, scale_ptr, slots, kv_head, dims, in_range,
            stride_slot, stride_head, stride_scale_slot, KV_QUANT: tl.constexpr):
    """The ``[len(slots), HEAD_DIM]`` keys or values of one KV head at ``slots``.

    As the buffer holds them for a plain pool; dequantized to float32 (``code *
    scale``: the head's scale for fp8, each slot's for int8) for a quantized one.
    Rows outside ``in_range`` are 0.
    """
    raw = tl.load(buffer_ptr + slots[:, None] * stride_slot + kv_head * stride_head
                  + dims[None, :], mask=in_range[:, None], other=0)
    if KV_QUANT == KV_FP8:
        return e4m3_to_float(raw) * tl.load(scale_ptr + kv_head)
    elif KV_QUANT == KV_INT8:
        scales = tl.load(scale_ptr + slots * stride_scale_slot + kv_head, mask=in_range,
                         other=0.0)
        return raw.to(tl.float32) * scales.to(tl.float32)[:, None]
    else:
        return raw
