"""Writing the step's new keys and values into the paged KV pool at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework_triton_attention.common import is_interpreter


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


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
) -> None:
    """``k_buffer[loc[t]] = k[t]`` and ``v_buffer[loc[t]] = v[t]`` for every new token ``t``.

    ``k``/``v`` are ``[T, kv_heads, dim]`` (each token's row contiguous), the buffers
    ``[slots, kv_heads, dim]`` contiguous, ``loc`` ``[T]`` integer slots.
    """
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    row = k_buffer.shape[1] * k_buffer.shape[2]
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"store_kv needs each token's row of {name} contiguous")
    block = min(triton.next_power_of_2(row), 1024)
    extra = {} if is_interpreter() else {"num_warps": 4}
    _store_kv_kernel[(num_tokens,)](
        k, v, loc, k_buffer, v_buffer,
        k.stride(0), v.stride(0), k_buffer.stride(0), v_buffer.stride(0),
        ROW=row, BLOCK=block, **extra,
    )
