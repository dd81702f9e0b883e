"""Decode attention over the paged KV cache: one query token per request, split-KV.

Stage 1 cuts each request's keys into ``num_splits`` contiguous ranges and runs
one program per (request, KV head, split). The program loads that KV head's
keys and values once for all the query heads that share it (grouped-query
attention without repeating K/V: the group's heads are the rows of one
``tl.dot``), runs an online softmax over the range and writes the range's
normalized partial output and its log-sum-exp. Stage 2 runs one program per
(request, query head) and merges the partial outputs, weighting each by the
exponent of its log-sum-exp. Splitting keeps a GPU busy when the batch alone
has too few (request, KV head) pairs to fill it; the merge is cheap.

Keys are reached as ``k_buffer[kv_indices[kv_indptr[b] + i]]``: ``kv_indices``
lists every request's KV slots back to back, ``kv_indptr`` where each starts.

A sliding window (``SLIDING_WINDOW`` W > 0) narrows the keys to the last W of
each request, and the splits cut only those; a logit cap (``LOGIT_CAP`` C > 0)
soft-caps the base-2 scores to ``C * tanh(s / C)``. Both are compiled in only
when asked for, so that the default kernels are today's. Over a quantized pool
(``_decode_split_codes_kernel``) keys and values are loaded as 8-bit codes and
dequantized in registers (``kv_codes.load_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework_triton_attention.common import (
    LOG2E,
    cap_arg,
    check_head_dim,
    dot_precision,
    is_interpreter,
    soft_cap,
    window_arg,
)
from framework_triton_attention.kv_codes import KV_PLAIN, KVCodes, load_kv

# Rows of the per-group dot: the query heads sharing one KV head, padded up to the
# smallest tile tl.dot accepts.
_MIN_GROUP_ROWS = 16


@triton.jit
def _first_key(seq_len, SLIDING_WINDOW: tl.constexpr):
    """The first key the request's last token sees: 0, or the window's first."""
    first = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    return first


@triton.jit
def _decode_split_codes_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indptr_ptr, kv_indices_ptr,
    partial_out_ptr, partial_lse_ptr,
    qk_scale,  # the softmax scale times log2(e): scores in base 2
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    num_splits,
    k_scale_ptr, v_scale_ptr, stride_scale_slot,  # a quantized pool's scales (kv_codes)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # keys the new token sees, its own included; 0: all
    LOGIT_CAP: tl.constexpr,  # soft cap of the base-2 scores; 0: none
    KV_QUANT: tl.constexpr,  # the pool's format (kv_codes): codes are dequantized on load
):
    """Stage 1: the partial output and log-sum-exp of one (request, KV head, split)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr_ptr + req)
    seq_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
    first = _first_key(seq_len, SLIDING_WINDOW)
    split_len = tl.cdiv(seq_len - first, num_splits)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + req * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < hi
        slots = tl.load(kv_indices_ptr + kv_start + pos, mask=in_range, other=0).to(tl.int64)
        k = load_kv(k_buffer_ptr, k_scale_ptr, slots, kv_head, dims, in_range, stride_k_slot,
                    stride_k_head, stride_scale_slot, KV_QUANT).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if LOGIT_CAP > 0:
            qk = soft_cap(qk, LOGIT_CAP)
        qk = tl.where(in_range[None, :], qk, float("-inf"))
        # Every block holds at least one key in range, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_kv(v_buffer_ptr, v_scale_ptr, slots, kv_head, dims, in_range, stride_v_slot,
                    stride_v_head, stride_scale_slot, KV_QUANT).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (more splits than keys) writes -inf: stage 2 gives it no weight.
    not_empty = lo < hi
    l_safe = tl.where(not_empty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(not_empty, m_i + tl.log2(l_safe), float("-inf"))
    po = (partial_out_ptr + req * stride_po_req + heads[:, None] * stride_po_head
          + split * stride_po_split + dims[None, :])
    tl.store(po, out, mask=row_valid[:, None])
    tl.store(partial_lse_ptr + req * stride_pl_req + heads * stride_pl_head + split, lse,
             mask=row_valid)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indptr_ptr, kv_indices_ptr,
    partial_out_ptr, partial_lse_ptr,
    qk_scale,  # the softmax scale times log2(e): scores in base 2
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # keys the new token sees, its own included; 0: all
    LOGIT_CAP: tl.constexpr,  # soft cap of the base-2 scores; 0: none
):
    """Stage 1 over a pool in the model's dtype."""
    _decode_split_codes_kernel(
        q_ptr, k_buffer_ptr, v_buffer_ptr, kv_indptr_ptr, kv_indices_ptr,
        partial_out_ptr, partial_lse_ptr, qk_scale,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
        stride_po_req, stride_po_head, stride_po_split, stride_pl_req, stride_pl_head,
        num_splits,
        k_buffer_ptr, v_buffer_ptr, 0,  # no scales: never read
        GROUP, HEAD_DIM, BLOCK_H, BLOCK_N, DOT_PRECISION, SLIDING_WINDOW, LOGIT_CAP, KV_PLAIN,
    )


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr, partial_lse_ptr, kv_indptr_ptr, o_ptr,
    stride_po_req, stride_po_head, stride_po_split,
    stride_pl_req, stride_pl_head,
    stride_o_tok, stride_o_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # as in stage 1, which split the window's keys alone
):
    """Stage 2: one (request, query head)'s output from its splits' partial outputs."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(kv_indptr_ptr + req + 1) - tl.load(kv_indptr_ptr + req)
    num_keys = seq_len - _first_key(seq_len, SLIDING_WINDOW)
    split_len = tl.cdiv(num_keys, num_splits)
    dims = tl.arange(0, HEAD_DIM)

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for split in range(0, num_splits):
        # Empty splits wrote nothing meaningful (their buffers may hold anything): skip them.
        if split * split_len < num_keys:
            lse = tl.load(partial_lse_ptr + req * stride_pl_req + head * stride_pl_head + split)
            part = tl.load(partial_out_ptr + req * stride_po_req + head * stride_po_head
                           + split * stride_po_split + dims)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp2(m_i - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * alpha + part * weight
            l_i = l_i * alpha + weight
            m_i = m_new
    out = acc / l_i
    tl.store(o_ptr + req * stride_o_tok + head * stride_o_head + dims,
             out.to(o_ptr.dtype.element_ty))


def decode_config(head_dim: int, dtype: torch.dtype, token_scales: bool = False
                  ) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of stage 1, picked so that no configuration spills registers.

    Checked with ptxas for sm_90: float32 (full-precision dots on the CUDA cores) and
    256-wide heads need the registers of eight warps. ``token_scales``: the pool holds
    int8 codes with a scale per token, whose 16-bit tiles need eight warps from head
    dim 128 and half as many keys at 256.
    """
    if token_scales and dtype != torch.float32 and head_dim > 64:
        return (16 if head_dim > 128 else 32), 8
    return 32, 8 if head_dim > 128 or dtype == torch.float32 else 4


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    codes: KVCodes | None = None,
) -> None:
    """Write into ``o`` ``[B, heads, dim]`` the attention of ``q`` ``[B, heads, dim]``.

    ``k_buffer``/``v_buffer`` are ``[slots, kv_heads, dim]``; request ``b``'s keys are at
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (at least one each); with ``codes``
    (``kv_codes.layer_kv``) they hold 8-bit codes, dequantized as they are loaded.
    ``partial_out`` ``[>= B, heads, >= num_splits, dim]`` and ``partial_lse``
    ``[>= B, heads, >= num_splits]`` are float32 scratch buffers for the splits.
    ``sliding_window`` and ``logit_cap`` are the layer's (``RadixAttention``): the token
    sees its request's last ``sliding_window`` keys, and scores ``s`` become
    ``logit_cap * tanh(s / logit_cap)``; ``None``: all keys, scores as they are.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    block_h = max(_MIN_GROUP_ROWS, triton.next_power_of_2(group))
    block_n, num_warps = decode_config(head_dim, q.dtype,
                                       token_scales=codes is not None and codes.per_token)
    extra = {} if is_interpreter() else {"num_warps": num_warps, "num_stages": 2}
    window = window_arg(sliding_window)
    args = (q, k_buffer, v_buffer, kv_indptr, kv_indices, partial_out, partial_lse,
            sm_scale * LOG2E,  # scores in base 2, so that the softmax can use exp2
            q.stride(0), q.stride(1),
            k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            num_splits)
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_N=block_n,
                     DOT_PRECISION=dot_precision(q.dtype), SLIDING_WINDOW=window,
                     LOGIT_CAP=cap_arg(logit_cap), **extra)
    grid = (batch, num_kv_heads, num_splits)
    if codes is None:
        _decode_split_kernel[grid](*args, **constants)
    else:
        _decode_split_codes_kernel[grid](*args, codes.k_scales, codes.v_scales,
                                         codes.scale_stride, KV_QUANT=codes.fmt, **constants)
    _decode_merge_kernel[(batch, num_heads)](
        partial_out, partial_lse, kv_indptr, o,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        o.stride(0), o.stride(1),
        num_splits,
        HEAD_DIM=head_dim, SLIDING_WINDOW=window,
    )
