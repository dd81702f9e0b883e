"""Writing the step's new keys and values into the paged KV pool at their slots.

A quantized pool's codes are made in the kernel, as ``MHATokenToKVPool.set_kv_buffer``
makes them (``kv_codes``): fp8 divides by the head's scale, clamps to ±448 and
rounds to E4M3; int8 takes each token and head's absmax / 127 as its float16
scale, stores it at the token's slot and rounds ``x / scale`` to the nearest
code, ties to even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework_triton_attention.common import is_interpreter
from framework_triton_attention.kv_codes import (
    FP8_MAX,
    INT8_MAX,
    KV_FP8,
    MIN_INT8_SCALE,
    KVCodes,
    float_to_e4m3,
    round_half_even,
)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, loc_ptr, k_buffer_ptr, v_buffer_ptr,
    stride_k_tok, stride_v_tok, stride_kb_slot, stride_vb_slot,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    """Copy token ``t``'s ``kv_heads * dim`` keys and values to slot ``loc[t]``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + token).to(tl.int64)
    for start in tl.static_range(0, ROW, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < ROW
        k = tl.load(k_ptr + token * stride_k_tok + cols, mask=in_row)
        v = tl.load(v_ptr + token * stride_v_tok + cols, mask=in_row)
        tl.store(k_buffer_ptr + slot * stride_kb_slot + cols,
                 k.to(k_buffer_ptr.dtype.element_ty), mask=in_row)
        tl.store(v_buffer_ptr + slot * stride_vb_slot + cols,
                 v.to(v_buffer_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _quantize(x, scale_ptr, slot, kv_head, stride_scale_slot, KV_QUANT: tl.constexpr):
    """Codes of one token and head's ``x`` (float32 ``[HEAD_DIM]``); int8 stores the scale."""
    if KV_QUANT == KV_FP8:
        scaled = tl.math.div_rn(x, tl.load(scale_ptr + kv_head))
        scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
        return float_to_e4m3(scaled).to(tl.uint8)
    else:
        absmax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(tl.math.div_rn(absmax, INT8_MAX), MIN_INT8_SCALE).to(tl.float16)
        tl.store(scale_ptr + slot * stride_scale_slot + kv_head, scale)
        codes = round_half_even(tl.math.div_rn(x, scale.to(tl.float32)))
        return tl.minimum(tl.maximum(codes, -INT8_MAX), INT8_MAX).to(tl.int8)


@triton.jit
def _store_kv_codes_kernel(
    k_ptr, v_ptr, loc_ptr, k_buffer_ptr, v_buffer_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, stride_scale_slot,
    HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
):
    """Quantize token ``t``'s keys and values of one KV head into slot ``loc[t]``."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.load(loc_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + kv_head * stride_k_head + dims).to(tl.float32)
    v = tl.load(v_ptr + token * stride_v_tok + kv_head * stride_v_head + dims).to(tl.float32)
    tl.store(k_buffer_ptr + slot * stride_kb_slot + kv_head * stride_kb_head + dims,
             _quantize(k, k_scale_ptr, slot, kv_head, stride_scale_slot, KV_QUANT))
    tl.store(v_buffer_ptr + slot * stride_vb_slot + kv_head * stride_vb_head + dims,
             _quantize(v, v_scale_ptr, slot, kv_head, stride_scale_slot, KV_QUANT))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    codes: KVCodes | None = None,
) -> None:
    """``k_buffer[loc[t]] = k[t]`` and ``v_buffer[loc[t]] = v[t]`` for every new token ``t``.

    ``k``/``v`` are ``[T, kv_heads, dim]`` (each token's row contiguous), the buffers
    ``[slots, kv_heads, dim]`` contiguous, ``loc`` ``[T]`` integer slots. With ``codes``
    (``kv_codes.layer_kv``) the buffers take the tokens' 8-bit codes, and int8's
    scales their slots' new scales.
    """
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    row = k_buffer.shape[1] * k_buffer.shape[2]
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"store_kv needs each token's row of {name} contiguous")
    if codes is not None:
        _store_codes(k, v, loc, k_buffer, v_buffer, codes)
        return
    block = min(triton.next_power_of_2(row), 1024)
    extra = {} if is_interpreter() else {"num_warps": 4}
    _store_kv_kernel[(num_tokens,)](
        k, v, loc, k_buffer, v_buffer,
        k.stride(0), v.stride(0), k_buffer.stride(0), v_buffer.stride(0),
        ROW=row, BLOCK=block, **extra,
    )


def _store_codes(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buffer: torch.Tensor,
                 v_buffer: torch.Tensor, codes: KVCodes) -> None:
    """``store_kv`` into a quantized layer: one program per (token, KV head)."""
    extra = {} if is_interpreter() else {"num_warps": 1}
    _store_kv_codes_kernel[(loc.shape[0], k_buffer.shape[1])](
        k, v, loc, k_buffer, v_buffer, codes.k_scales, codes.v_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        codes.scale_stride,
        HEAD_DIM=k_buffer.shape[2], KV_QUANT=codes.fmt, **extra,
    )
