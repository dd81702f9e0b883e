"""The reference attention backend: plain ``torch`` SDPA over the whole batch at once.

Each layer runs one ``scaled_dot_product_attention`` call for the batch: every
request's keys and values are gathered from the paged pool through
``req_to_token`` into a ``[batch, kv_heads, longest, head_dim]`` tensor, its
new tokens' queries into ``[batch, heads, most_new, head_dim]``, and a mask
keeps each query to its own request's keys (causally, in a prefill). Grouped
query heads read their key/value head without copies (SDPA's ``enable_gqa``).

Everything that depends only on the batch's shape (the gather indices, the
mask, where each packed token sits in the padded layout) is built once per
batch in ``init_forward_metadata`` from the host copies of the lengths, so
the layers run no Python loop over requests and no host sync. It runs on any
device and is the baseline that faster backends are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention


@dataclass
class _BatchLayout:
    """How the batch's packed tokens map onto the padded tensors of one SDPA call."""

    kv_slots: torch.Tensor  # [B, L] int64 KV slot of each key (slot 0 past a request's end)
    mask: torch.Tensor  # [B, 1, Q, L] bool: may query q of request b see key l
    token_rows: torch.Tensor | None  # [T] int64 row in the flat [B * Q] queries; None: Q == 1
    num_queries: int  # Q: the most new tokens of one request (1 in decode)


class TorchNativeAttnBackend(AttentionBackend):
    """Causal attention over the paged KV cache with ``torch.nn.functional`` SDPA."""

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        self._layout: _BatchLayout | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the gather indices and the mask once for all layers of this batch."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        assert seq_lens is not None  # filled above
        if forward_batch.forward_mode.is_decode():
            new_lens = [1] * len(seq_lens)
        else:
            new_lens = forward_batch.extend_seq_lens_cpu
            prefix_lens = forward_batch.extend_prefix_lens_cpu
            assert new_lens is not None and prefix_lens is not None  # filled above
            for num_new, prefix_len, seq_len in zip(new_lens, prefix_lens, seq_lens, strict=True):
                if prefix_len + num_new != seq_len:
                    raise ValueError(
                        f"extend batch: prefix ({prefix_len}) + new ({num_new}) tokens != "
                        f"seq_len ({seq_len})"
                    )
        self._layout = self._build_layout(forward_batch, seq_lens, new_lens)

    def _build_layout(self, forward_batch: ForwardBatch, seq_lens: list[int],
                      new_lens: list[int]) -> _BatchLayout:
        device = self.device
        longest, most_new = max(seq_lens), max(new_lens)
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
        key_pos = torch.arange(longest, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        new = torch.tensor(new_lens, dtype=torch.int64, device=device)
        in_request = key_pos[None, :] < lens[:, None]  # [B, L]
        kv_slots = torch.where(in_request, rows[:, :longest], 0)
        # Query j of request b sits at position seq_len - new_len + j: it sees keys up to it.
        query_pos = (lens - new)[:, None] + torch.arange(most_new, device=device)[None, :]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L], causal
        mask &= in_request[:, None, :]
        # Padding queries (j >= new_len) see key 0 only, so that no row is fully masked.
        padding = torch.arange(most_new, device=device)[None, :] >= new[:, None]
        mask[:, :, 0] |= padding
        token_rows = None
        if most_new > 1:
            starts = torch.arange(len(new_lens), device=device) * most_new
            total = sum(new_lens)  # given, so that repeat_interleave needs no host sync
            token_rows = (torch.repeat_interleave(starts, new, output_size=total)
                          + _ranks_within(new_lens, device))
        return _BatchLayout(kv_slots, mask.unsqueeze(1), token_rows, most_new)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Prefill: each request's new tokens attend causally to its prefix and themselves."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decode: each request's single new token attends to all of its tokens."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        layout = self._layout
        if layout is None:
            raise RuntimeError("init_forward_metadata must run before the layers")
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        batch, num_queries = layout.kv_slots.shape[0], layout.num_queries
        keys, values = _gather(k_buffer, layout.kv_slots), _gather(v_buffer, layout.kv_slots)
        queries = q.reshape(-1, layer.num_heads, layer.head_dim).to(keys.dtype)
        if layout.token_rows is not None:
            padded = queries.new_zeros(batch * num_queries, layer.num_heads, layer.head_dim)
            padded[layout.token_rows] = queries
            queries = padded
        queries = queries.view(batch, num_queries, layer.num_heads, layer.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=layout.mask, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [B, heads, Q, dim]
        out = out.transpose(1, 2).reshape(batch * num_queries, layer.num_heads * layer.head_dim)
        if layout.token_rows is not None:
            out = out[layout.token_rows]
        return out.to(q.dtype)


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[B, kv_heads, L, dim]`` rows of ``buffer`` at ``slots`` ``[B, L]``.

    ``index_select`` on the flat slots is several times faster than advanced indexing.
    """
    rows = buffer.index_select(0, slots.flatten())
    return rows.view(*slots.shape, *buffer.shape[1:]).transpose(1, 2)


def _ranks_within(lengths: list[int], device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., n0 - 1, 0, 1, ..., n1 - 1, ...]`` for ``lengths = [n0, n1, ...]``."""
    total = sum(lengths)
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64, device=device).cumsum(0)
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    return torch.arange(total, device=device) - torch.repeat_interleave(
        starts, counts, output_size=total)
