"""Segmented LoRA in Triton: one shrink and one expand launch over the adapter segments.

The packed rows with an adapter are grouped by slot (``LoraBatch.rows``); segment ``i``
covers ``rows[seg_starts[i] : seg_starts[i] + seg_lens[i]]`` and uses slot
``seg_slots[i]``. Each program handles one block of one segment, so the rows are read
through ``rows`` (no padded copy of ``x`` is built) and partial blocks are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.lora.batch import LoraBatch

#: tl.dot needs every dimension of at least 16.
_MIN_DOT = 16


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr, scal_ptr, mid_ptr,
                   K, R, stride_x, stride_as, stride_ar, stride_mid,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``mid[j] = scaling * a[slot] @ x[rows[j]]`` for one block of one segment."""
    seg = tl.program_id(0)
    seg_len = tl.load(lens_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < seg_len:
        start = tl.load(starts_ptr + seg)
        slot = tl.load(slots_ptr + seg)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seg_len
        rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                         mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)
            acc += tl.dot(xs.to(tl.float32), at.to(tl.float32))
        acc *= tl.load(scal_ptr + slot).to(tl.float32)
        tl.store(mid_ptr + (start + offs_m)[:, None] * stride_mid + offs_r[None, :], acc,
                 mask=mask_m[:, None] & (offs_r[None, :] < R))


@triton.jit
def _expand_kernel(mid_ptr, b_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr, out_ptr,
                   N, R, stride_mid, stride_bs, stride_bn, stride_out,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """``out[rows[j], n-block] = b[slot][n-block] @ mid[j]`` for one block of one segment."""
    seg = tl.program_id(0)
    seg_len = tl.load(lens_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 < seg_len:
        start = tl.load(starts_ptr + seg)
        slot = tl.load(slots_ptr + seg)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seg_len
        rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0)
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mid = tl.load(mid_ptr + (start + offs_m)[:, None] * stride_mid + offs_r[None, :],
                      mask=mask_m[:, None] & (offs_r[None, :] < R), other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                     mask=mask_n[None, :] & (offs_r[:, None] < R), other=0.0)
        acc = tl.dot(mid, bt.to(tl.float32))
        tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _seg_tensors(batch: LoraBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The segments' starts and lengths on the kernels' device."""
    starts = torch.tensor(batch.seg_starts, dtype=torch.int64, device=device)
    lens = torch.tensor(batch.seg_lens, dtype=torch.int64, device=device)
    return starts, lens


def triton_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      scalings: torch.Tensor, batch: LoraBatch, block_m: int = 16,
                      block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """The LoRA delta ``[n, out]`` of ``LORA_BACKENDS``: rows without an adapter are zero."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    if not batch.seg_lens:
        return out
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    rank = a.shape[1]
    block_r = max(_MIN_DOT, triton.next_power_of_2(rank))
    starts, lens = _seg_tensors(batch, x.device)
    # The shrunk rows stay in float32 between the two launches, as in the reference's
    # float32 accumulation.
    mid = torch.empty(batch.rows.shape[0], rank, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    segments = len(batch.seg_lens)
    _shrink_kernel[(segments, m_blocks)](
        x, a, batch.rows, starts, lens, batch.seg_slots, scalings, mid,
        x.shape[1], rank, x.stride(0), a.stride(0), a.stride(1), mid.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k)
    _expand_kernel[(segments, m_blocks, triton.cdiv(b.shape[1], block_n))](
        mid, b, batch.rows, starts, lens, batch.seg_slots, out,
        b.shape[1], rank, mid.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return out
