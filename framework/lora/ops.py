"""Batched LoRA kernels: many adapters in one packed batch.

A kernel computes, for every packed row ``x_i`` whose slot is ``s_i``,
``scalings[s_i] * b[s_i] @ a[s_i] @ x_i`` and zeros for rows without an adapter:

    kernel(x [n, in], a [S, R, in], b [S, out, R], scalings [S], batch: LoraBatch) -> [n, out]

Ranks below ``R`` are zero-padded in ``a`` and ``b``, so every slot multiplies
alike. The kernels are registered in ``framework.registry.LORA_BACKENDS``.
"""

from __future__ import annotations

import torch

from framework.lora.batch import LoraBatch


def torch_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     scalings: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """The reference kernel: the rows of each slot padded into one segment of a grid
    ``[segments, max_seg_len, in]``, then two batched matmuls over the segments."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    if not batch.seg_lens:
        return out
    segments, length = len(batch.seg_lens), batch.max_seg_len
    grid = x.new_zeros(segments * length, x.shape[1]).index_copy_(
        0, batch.padded_index, x.index_select(0, batch.rows))
    shrunk = torch.bmm(grid.view(segments, length, -1),
                       a.index_select(0, batch.seg_slots).transpose(1, 2))
    shrunk = shrunk * scalings.index_select(0, batch.seg_slots).view(segments, 1, 1)
    expanded = torch.bmm(shrunk, b.index_select(0, batch.seg_slots).transpose(1, 2))
    return out.index_copy_(0, batch.rows,
                           expanded.view(segments * length, -1).index_select(0, batch.padded_index))


def cpu_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scalings: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """The CPU kernel: the reference's batched products, with shortcuts for the common
    batches where they only add work.

    With no row on an adapter it costs one ``zeros``; with every row on one adapter
    it is two plain matrix products (no grid to fill, no rows to gather or
    scatter). On a CPU, a Python loop of small products per slot measured slower
    than the two batched products over the padded segments, so mixed batches take
    those.
    """
    if not batch.seg_lens:
        return x.new_zeros(x.shape[0], b.shape[1])
    if batch.seg_lens == (x.shape[0],):
        slot = batch.seg_slots[0]
        return (x @ a[slot].T).mul_(scalings[slot]) @ b[slot].T
    return torch_lora_delta(x, a, b, scalings, batch)
