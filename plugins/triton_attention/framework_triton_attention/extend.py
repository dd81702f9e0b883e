"""Extend (prefill) attention: new tokens over a cached prefix, then causally over themselves.

One program handles one request, one KV head and ``BLOCK_M`` rows, where a row
is a (new token, query head of the group) pair: row ``r`` is token
``r // group``, head ``kv_head * group + r % group``. Folding the group's heads
into the rows makes every key and value tile serve the whole group in one
``tl.dot``, so grouped-query attention needs no repeated K/V.

The program first walks the request's cached prefix in the paged pool (slots
``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``), which every new token sees
whole, then the request's new keys and values, read straight from the packed
``k``/``v`` of the step (``qo_indptr[b]:qo_indptr[b + 1]``) under the causal
mask, keeping a running max and sum (online softmax) so that scores are never
materialized. A prefill with no cached prefix anywhere in the batch is the
same kernel compiled without the prefix walk (``HAS_PREFIX=False``).

Two per-layer variants are compiled in only when asked for, so that the
default kernel is today's: ``SLIDING_WINDOW`` W > 0 lets the token at position
``p`` see only the keys at ``p - W < j <= p`` (both walks start at the first key
block that meets the window of the block's first token, and mask inside it),
and ``LOGIT_CAP`` C > 0 soft-caps every base-2 score to ``C * tanh(s / C)``.

Over a quantized pool (``_extend_codes_kernel``) both walks load 8-bit codes and
dequantize them in registers (``kv_codes.load_kv``); the new tokens' keys and
values are read back from the pool at their slots, where the store kernel has just
written them.
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


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores ``qk`` (masked entries ``-inf``) and values ``v`` in."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # Rows that have seen no key yet (padding rows, or rows whose window starts past this
    # tile) keep m = -inf; shift them by 0 instead, so that no -inf - -inf turns into NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(qk - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _scores(q, k, qk_scale, visible, DOT_PRECISION: tl.constexpr, LOGIT_CAP: tl.constexpr):
    """Base-2 scores of a query tile against a key tile, soft-capped, ``-inf`` where not visible."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if LOGIT_CAP > 0:
        qk = soft_cap(qk, LOGIT_CAP)
    return tl.where(visible, qk, float("-inf"))


@triton.jit
def _walk_start(first_pos, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr):
    """Where a key walk starts: key 0, or under a window the tile holding the first key seen.

    ``first_pos`` is the block's first token in the walk's key positions; the
    block's later tokens see no key before its window.
    """
    start = 0
    if SLIDING_WINDOW > 0:
        start = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    return start


@triton.jit
def _extend_codes_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_buffer_ptr, v_buffer_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    qk_scale,  # the softmax scale times log2(e): scores in base 2
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_kb_slot, stride_kb_head,
    stride_vb_slot, stride_vb_head,
    loc_ptr,  # a quantized pool's new tokens: their slots, where their codes are read
    k_scale_ptr, v_scale_ptr, stride_scale_slot,  # a quantized pool's scales (kv_codes)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # keys each token sees, its own included; 0: all earlier
    LOGIT_CAP: tl.constexpr,  # soft cap of the base-2 scores; 0: none
    KV_QUANT: tl.constexpr,  # the pool's format (kv_codes): codes are dequantized on load
):
    """Attention output of ``BLOCK_M`` (new token, head) rows of one request and KV head."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_start = tl.program_id(2) * BLOCK_M

    qo_start = tl.load(qo_indptr_ptr + req)
    num_new = tl.load(qo_indptr_ptr + req + 1) - qo_start
    # A request with fewer new tokens than the batch's longest leaves its last blocks empty:
    # they walk no keys and store nothing.
    block_empty = row_start >= num_new * GROUP

    rows = row_start + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = tokens < num_new
    dims = tl.arange(0, HEAD_DIM)
    # Packed-token offsets in int64: a long prefill times a wide row can pass 2**31.
    q_rows = (qo_start + tokens).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok
                + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if HAS_PREFIX:
        kv_start = tl.load(kv_indptr_ptr + req)
        prefix_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
        prefix_hi = tl.where(block_empty, 0, prefix_len)
        prefix_lo = _walk_start(prefix_len + row_start // GROUP, BLOCK_N, SLIDING_WINDOW)
        for start in range(prefix_lo, prefix_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_prefix = pos < prefix_len
            slots = tl.load(kv_indices_ptr + kv_start + pos, mask=in_prefix, other=0)
            slots = slots.to(tl.int64)
            k = load_kv(k_buffer_ptr, k_scale_ptr, slots, kv_head, dims, in_prefix,
                        stride_kb_slot, stride_kb_head, stride_scale_slot, KV_QUANT).to(q.dtype)
            visible = in_prefix[None, :]
            if SLIDING_WINDOW > 0:
                # Prefix key j is at position j, token t at prefix_len + t.
                visible = visible & (pos[None, :] > prefix_len + tokens[:, None]
                                     - SLIDING_WINDOW)
            qk = _scores(q, k, qk_scale, visible, DOT_PRECISION, LOGIT_CAP)
            v = load_kv(v_buffer_ptr, v_scale_ptr, slots, kv_head, dims, in_prefix,
                        stride_vb_slot, stride_vb_head, stride_scale_slot, KV_QUANT).to(q.dtype)
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # The block's last token sees new keys up to itself: no tile past it is needed.
    new_hi = tl.where(block_empty, 0,
                      tl.minimum(num_new, (row_start + BLOCK_M - 1) // GROUP + 1))
    new_lo = _walk_start(row_start // GROUP, BLOCK_N, SLIDING_WINDOW)
    for start in range(new_lo, new_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_new = pos < num_new
        kv_rows = (qo_start + pos).to(tl.int64)
        if KV_QUANT != KV_PLAIN:
            # The new tokens as the pool holds them, so that every query sees a token's
            # rounding alike, whichever step reads it.
            new_slots = tl.load(loc_ptr + kv_rows, mask=in_new, other=0).to(tl.int64)
            k = load_kv(k_buffer_ptr, k_scale_ptr, new_slots, kv_head, dims, in_new,
                        stride_kb_slot, stride_kb_head, stride_scale_slot, KV_QUANT).to(q.dtype)
        else:
            k = tl.load(k_ptr + kv_rows[:, None] * stride_k_tok
                        + kv_head * stride_k_head + dims[None, :],
                        mask=in_new[:, None], other=0.0)
        visible = in_new[None, :] & (pos[None, :] <= tokens[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (pos[None, :] > tokens[:, None] - SLIDING_WINDOW)
        qk = _scores(q, k, qk_scale, visible, DOT_PRECISION, LOGIT_CAP)
        if KV_QUANT != KV_PLAIN:
            v = load_kv(v_buffer_ptr, v_scale_ptr, new_slots, kv_head, dims, in_new,
                        stride_vb_slot, stride_vb_head, stride_scale_slot, KV_QUANT).to(q.dtype)
        else:
            v = tl.load(v_ptr + kv_rows[:, None] * stride_v_tok
                        + kv_head * stride_v_head + dims[None, :],
                        mask=in_new[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    # Valid rows saw at least their own key, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_o_tok
             + heads[:, None] * stride_o_head + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_buffer_ptr, v_buffer_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
    qk_scale,  # the softmax scale times log2(e): scores in base 2
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_kb_slot, stride_kb_head,
    stride_vb_slot, stride_vb_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # keys each token sees, its own included; 0: all earlier
    LOGIT_CAP: tl.constexpr,  # soft cap of the base-2 scores; 0: none
):
    """Extend attention over a pool in the model's dtype."""
    _extend_codes_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, k_buffer_ptr, v_buffer_ptr,
        qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, qk_scale,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
        stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
        stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head,
        kv_indices_ptr, k_buffer_ptr, v_buffer_ptr, 0,  # no codes: never read
        GROUP, HEAD_DIM, HAS_PREFIX, BLOCK_M, BLOCK_N, DOT_PRECISION, SLIDING_WINDOW,
        LOGIT_CAP, KV_PLAIN,
    )


def extend_config(head_dim: int, dtype: torch.dtype, token_scales: bool = False
                  ) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``, picked so that no configuration spills registers.

    Checked with ptxas for sm_90: float32 dots run on the CUDA cores in full
    precision and hold far more in registers than 16-bit tensor-core dots.
    ``token_scales``: the pool holds int8 codes with a scale per token, whose 16-bit
    tiles past head dim 64 need narrower key tiles.
    """
    if dtype == torch.float32:
        if head_dim <= 32:
            return 32, 32, 8
        return (16, 16, 8) if head_dim <= 128 else (32, 16, 8)
    if head_dim <= 64:
        return 64, 64, 4
    if token_scales:
        return (64, 32, 8) if head_dim <= 128 else (16, 16, 8)
    return (64, 64, 8) if head_dim <= 128 else (32, 16, 4)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_new_tokens: int,
    sm_scale: float,
    has_prefix: bool = True,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    codes: KVCodes | None = None,
    new_loc: torch.Tensor | None = None,
) -> None:
    """Write into ``o`` ``[T, heads, dim]`` the causal attention of the new tokens.

    ``q`` ``[T, heads, dim]``, ``k``/``v`` ``[T, kv_heads, dim]``: the new tokens of all
    requests packed, request ``b``'s at ``qo_indptr[b]:qo_indptr[b + 1]`` (at most
    ``max_new_tokens``). Its cached prefix is at slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` of ``k_buffer``/``v_buffer``
    ``[slots, kv_heads, dim]``. ``has_prefix=False`` promises every prefix is empty
    and skips the prefix walk (plain prefill). ``sliding_window`` and ``logit_cap`` are
    the layer's (``RadixAttention``): a token at position ``p`` of its request sees the
    keys at ``p - sliding_window < j <= p``, and scores ``s`` become
    ``logit_cap * tanh(s / logit_cap)``; ``None``: all earlier keys, scores as they are.
    With ``codes`` (``kv_codes.layer_kv``) the buffers hold 8-bit codes, dequantized as
    they are loaded, and the new tokens' keys and values are read as codes too, at their
    slots ``new_loc`` ``[T]`` (written there already), rather than from ``k``/``v``.
    """
    batch = qo_indptr.shape[0] - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = extend_config(
        head_dim, q.dtype, token_scales=codes is not None and codes.per_token)
    grid = (batch, num_kv_heads, triton.cdiv(max_new_tokens * group, block_m))
    extra = {} if is_interpreter() else {"num_warps": num_warps, "num_stages": 2}
    args = (q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
            sm_scale * LOG2E,  # scores in base 2, so that the softmax can use exp2
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1),
            v.stride(0), v.stride(1),
            o.stride(0), o.stride(1),
            k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1))
    constants = dict(GROUP=group, HEAD_DIM=head_dim, HAS_PREFIX=has_prefix,
                     BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
                     SLIDING_WINDOW=window_arg(sliding_window), LOGIT_CAP=cap_arg(logit_cap),
                     **extra)
    if codes is None:
        _extend_kernel[grid](*args, **constants)
        return
    if new_loc is None:
        raise ValueError("extend over 8-bit KV codes reads the new tokens at new_loc")
    _extend_codes_kernel[grid](*args, new_loc, codes.k_scales, codes.v_scales,
                               codes.scale_stride, KV_QUANT=codes.fmt, **constants)
