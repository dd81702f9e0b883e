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
the layers run no Python loop over requests and no host sync.

Decode steps of an unchanged batch (the same requests, each one token longer)
keep the gathered keys and values of the previous step and only append the
new token's, instead of gathering every request's whole history again; any
other batch gathers afresh. It runs on any device and is the baseline that
faster backends are checked against.
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


# Room for this many more tokens per request in the kept decode keys and values, so that
# they are not reallocated at every step.
_DECODE_HEADROOM = 64


@dataclass
class _DecodeKV:
    """A decode batch's keys and values, gathered into padded tensors, kept across steps."""

    req_pool_indices: list[int]
    seq_lens: list[int]
    capacity: int  # positions allocated per request
    keys: dict[int, torch.Tensor]  # layer id -> [B, kv_heads, capacity, dim]
    values: dict[int, torch.Tensor]
    append_at: torch.Tensor | None = None  # [B] position of the new token; None: gather anew

    def continues(self, req_pool_indices: list[int], seq_lens: list[int]) -> bool:
        """Whether a decode batch is this one a token later (and still fits)."""
        return (req_pool_indices == self.req_pool_indices
                and all(new == old + 1 for new, old in zip(seq_lens, self.seq_lens))
                and max(seq_lens) <= self.capacity)


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
        self._decode_kv: _DecodeKV | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the gather indices and the mask once for all layers of this batch."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        assert seq_lens is not None  # filled above
        if forward_batch.forward_mode.is_decode():
            new_lens = [1] * len(seq_lens)
            self._prepare_decode_kv(forward_batch, seq_lens)
        else:
            self._decode_kv = None
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

    def _prepare_decode_kv(self, forward_batch: ForwardBatch, seq_lens: list[int]) -> None:
        indices = forward_batch.req_pool_indices_cpu
        assert indices is not None  # filled by fill_cpu_lengths
        kept = self._decode_kv
        if kept is not None and kept.continues(indices, seq_lens):
            kept.seq_lens = seq_lens
            kept.append_at = torch.tensor(seq_lens, dtype=torch.int64, device=self.device) - 1
            return
        self._decode_kv = _DecodeKV(list(indices), seq_lens, max(seq_lens) + _DECODE_HEADROOM,
                                    {}, {})

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
        if self._decode_kv is not None and save_kv_cache:
            keys, values = self._decode_keys_values(k_buffer, v_buffer, layer.layer_id, layout)
        else:
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


    def _decode_keys_values(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            layer_id: int, layout: _BatchLayout
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's kept keys and values, with the new token appended (or gathered anew)."""
        kept = self._decode_kv
        assert kept is not None  # checked by the caller
        longest = layout.kv_slots.shape[1]
        if kept.append_at is not None and layer_id in kept.keys:
            rows = torch.arange(len(kept.seq_lens), device=self.device)
            new_slots = layout.kv_slots[rows, kept.append_at]
            kept.keys[layer_id][rows, :, kept.append_at] = k_buffer[new_slots]
            kept.values[layer_id][rows, :, kept.append_at] = v_buffer[new_slots]
        else:
            kept.keys[layer_id] = _padded(_gather(k_buffer, layout.kv_slots), kept.capacity)
            kept.values[layer_id] = _padded(_gather(v_buffer, layout.kv_slots), kept.capacity)
        return kept.keys[layer_id][:, :, :longest], kept.values[layer_id][:, :, :longest]


def _padded(gathered: torch.Tensor, capacity: int) -> torch.Tensor:
    """``gathered`` ``[B, H, L, D]`` in a zero-filled ``[B, H, capacity, D]`` tensor.

    Zeros, not garbage: a masked key's value still enters SDPA's product with weight 0,
    and 0 * NaN would be NaN.
    """
    batch, heads, length, dim = gathered.shape
    out = gathered.new_zeros(batch, heads, capacity, dim)
    out[:, :, :length] = gathered
    return out


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
