"""The reference attention backend: plain ``torch`` SDPA, a few calls per batch.

A batch's requests are split into a few **length groups** (requests of
similar length), and each layer runs one ``scaled_dot_product_attention``
call per group over padded ``[group, heads, length, head_dim]`` tensors. One
call for the whole batch would pad every request to the longest one; on a
batch of mixed lengths that doubles the keys and values read (and attention
is bound by reading them), while grouping keeps the padding to about a
quarter of a group's longest request, for a handful of calls.

* **Prefill without a cached prefix** (the common case): a request's keys and
  values are its own new tokens, so they are laid out straight from the
  layer's ``k`` and ``v`` (no gather from the pool) and SDPA runs with
  ``is_causal`` (no mask; the kernel skips the masked half).
* **Prefill over a cached prefix**: keys and values are gathered from the
  paged pool through ``req_to_token`` and a mask keeps each query to its own
  request's keys, causally.
* **Decode**: the gathered keys and values of each group are kept across
  steps while the batch is unchanged (the same requests, each one token
  longer), and the step's new token is appended instead of gathering every
  request's whole history again; any other batch gathers afresh.

Grouped-query heads read their key/value head without copies (SDPA's
``enable_gqa``). Everything that depends only on the batch's shape (groups,
gather indices, masks, where each packed token sits in the padded layout) is
built once per batch in ``init_forward_metadata`` from the host copies of the
lengths, so the layers run no Python loop over requests and no host sync. It
runs on any device and is the baseline that faster backends are checked
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


def length_groups(lengths: list[int], slack: int) -> list[list[int]]:
    """Indices of ``lengths`` split into groups of similar length, longest group first.

    Each group's indices are in ascending order (one group of all: ``0 .. n - 1``).

    Taken longest first, a group holds the requests within ``max(slack, longest // 4)``
    tokens of its longest one: padding every request of a group to its longest
    wastes at most that much per request, for one attention call per group.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    floor = -1
    for i in order:
        if lengths[i] < floor or not groups:
            groups.append([])
            floor = lengths[i] - max(slack, lengths[i] // 4)
        groups[-1].append(i)
    return [sorted(group) for group in groups]


@dataclass
class _Group:
    """Requests of the batch attended together in one SDPA call per layer."""

    members: list[int]  # index of each of the group's requests in the batch
    rows: torch.Tensor  # [G] int64: ``members`` on the device
    num_queries: int  # Q: the most new tokens of one of its requests (1 in decode)
    # Extend only: the group's packed new-token rows, and where each sits in the flat
    # [G * Q] padded queries.
    token_src: torch.Tensor | None = None
    token_dst: torch.Tensor | None = None
    # Keys gathered from the pool (decode, prefill over a prefix): [G, L] KV slot of each
    # key (slot 0 past a request's end) and the [G, 1, Q, L] bool mask. None for a
    # prefill without prefix, whose keys are its new tokens, causally.
    kv_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # Decode only: kept keys and values per layer id, [G, kv_heads, capacity, dim].
    capacity: int = 0
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    # [G * kv_heads] rows of the flat kept keys [G * kv_heads * capacity, dim] where the
    # step's new token goes; None: gather anew.
    append_rows: torch.Tensor | None = None
    #: Whether the group is the whole batch in order (no rows to pick or scatter).
    whole: bool = False

    @property
    def size(self) -> int:
        """How many requests the group holds."""
        return len(self.members)


@dataclass
class _DecodeState:
    """The decode batch whose groups hold kept keys and values."""

    req_pool_indices: list[int]
    seq_lens: list[int]
    groups: list[_Group]

    def continues(self, req_pool_indices: list[int], seq_lens: list[int]) -> bool:
        """Whether a decode batch is this one a token later (and still fits)."""
        if req_pool_indices != self.req_pool_indices or any(
                new != old + 1 for new, old in zip(seq_lens, self.seq_lens)):
            return False
        return all(max(seq_lens[i] for i in group.members) <= group.capacity
                   for group in self.groups)


class TorchNativeAttnBackend(AttentionBackend):
    """Causal attention over the paged KV cache with ``torch.nn.functional`` SDPA."""

    #: A group takes the requests within ``max(group_slack, longest // 4)`` tokens of
    #: its longest one (``length_groups``).
    group_slack = 64

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        self._groups: list[_Group] | None = None
        self._decode: _DecodeState | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the groups, gather indices and masks once for all layers of this batch."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        assert seq_lens is not None  # filled above
        if forward_batch.forward_mode.is_decode():
            self._groups = self._decode_groups(forward_batch, seq_lens)
            return
        self._decode = None
        new_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        assert new_lens is not None and prefix_lens is not None  # filled above
        for num_new, prefix_len, seq_len in zip(new_lens, prefix_lens, seq_lens, strict=True):
            if prefix_len + num_new != seq_len:
                raise ValueError(
                    f"extend batch: prefix ({prefix_len}) + new ({num_new}) tokens != "
                    f"seq_len ({seq_len})"
                )
        self._groups = self._extend_groups(forward_batch, seq_lens, new_lens, prefix_lens)

    # ------------------------------------------------------------------ batch layout

    def _decode_groups(self, forward_batch: ForwardBatch, seq_lens: list[int]) -> list[_Group]:
        indices = forward_batch.req_pool_indices_cpu
        assert indices is not None  # filled by fill_cpu_lengths
        kept = self._decode
        ones = [1] * len(seq_lens)
        kept = self._decode
        if kept is not None and kept.continues(indices, seq_lens):
            kept.seq_lens = seq_lens
            groups = kept.groups
            for group in groups:
                group.append_rows = self._append_rows(group, seq_lens)
        else:
            groups = [self._group(members) for members in length_groups(seq_lens,
                                                                         self.group_slack)]
            for group in groups:
                group.capacity = max(seq_lens[i] for i in group.members) + _DECODE_HEADROOM
                group.whole = len(groups) == 1
            self._decode = _DecodeState(list(indices), seq_lens, groups)
        for group in groups:
            group.kv_slots = self._kv_slots(forward_batch, group, seq_lens)
            group.mask = self._mask(group, seq_lens, ones)
        return groups

    def _append_rows(self, group: _Group, seq_lens: list[int]) -> torch.Tensor:
        heads, capacity = self.num_kv_heads, group.capacity
        position = self._lengths(group, seq_lens) - 1  # of the new token, per request
        first = torch.arange(group.size * heads, device=self.device).view(-1, heads) * capacity
        return (first + position[:, None]).flatten()

    def _group(self, members: list[int], num_queries: int = 1) -> _Group:
        rows = torch.tensor(members, dtype=torch.int64, device=self.device)
        return _Group(members, rows, num_queries)

    def _extend_groups(self, forward_batch: ForwardBatch, seq_lens: list[int],
                       new_lens: list[int], prefix_lens: list[int]) -> list[_Group]:
        starts = [0]
        for n in new_lens[:-1]:
            starts.append(starts[-1] + n)
        fresh = [i for i, p in enumerate(prefix_lens) if p == 0]
        cached = [i for i, p in enumerate(prefix_lens) if p > 0]
        groups = []
        for family in (fresh, cached):
            lengths = [seq_lens[i] for i in family]
            for members in length_groups(lengths, self.group_slack):
                group = self._token_layout([family[m] for m in members], starts, new_lens)
                if family is cached:
                    group.kv_slots = self._kv_slots(forward_batch, group, seq_lens)
                    group.mask = self._mask(group, seq_lens, new_lens)
                groups.append(group)
        return groups

    def _token_layout(self, rows: list[int], starts: list[int], new_lens: list[int]) -> _Group:
        """A group of ``rows`` with its new tokens' places in the packed and padded layouts."""
        most_new = max(new_lens[i] for i in rows)
        src: list[int] = []
        dst: list[int] = []
        for slot, i in enumerate(rows):
            src.extend(range(starts[i], starts[i] + new_lens[i]))
            dst.extend(range(slot * most_new, slot * most_new + new_lens[i]))
        group = self._group(rows, most_new)
        group.token_src = torch.tensor(src, dtype=torch.int64, device=self.device)
        group.token_dst = torch.tensor(dst, dtype=torch.int64, device=self.device)
        return group

    def _kv_slots(self, forward_batch: ForwardBatch, group: _Group,
                  seq_lens: list[int]) -> torch.Tensor:
        longest = max(seq_lens[i] for i in group.members)
        table = self.req_to_token_pool.req_to_token
        req_rows = table[forward_batch.req_pool_indices[group.rows], :longest]
        lens = self._lengths(group, seq_lens)
        in_request = torch.arange(longest, device=self.device)[None, :] < lens[:, None]
        return torch.where(in_request, req_rows, 0)

    def _lengths(self, group: _Group, lengths: list[int]) -> torch.Tensor:
        return torch.tensor([lengths[i] for i in group.members], dtype=torch.int64,
                            device=self.device)

    def _mask(self, group: _Group, seq_lens: list[int], new_lens: list[int]) -> torch.Tensor:
        """``[G, 1, Q, L]``: may query ``q`` of request ``g`` see key ``l`` (causally)."""
        device = self.device
        lens, new = self._lengths(group, seq_lens), self._lengths(group, new_lens)
        longest, most_new = max(seq_lens[i] for i in group.members), group.num_queries
        key_pos = torch.arange(longest, device=device)
        # Query j of request g sits at position seq_len - new_len + j: it sees keys up to it.
        query_pos = (lens - new)[:, None] + torch.arange(most_new, device=device)[None, :]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [G, Q, L]
        mask &= (key_pos[None, :] < lens[:, None])[:, None, :]
        # Padding queries (j >= new_len) see key 0 only, so that no row is fully masked.
        mask[:, :, 0] |= torch.arange(most_new, device=device)[None, :] >= new[:, None]
        return mask.unsqueeze(1)

    # ------------------------------------------------------------------ attention

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
        groups = self._groups
        if groups is None:
            raise RuntimeError("init_forward_metadata must run before the layers")
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        else:  # the new tokens' keys and values are the ones already in the pool
            k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            k, v = k_buffer[forward_batch.out_cache_loc], v_buffer[forward_batch.out_cache_loc]
        queries = q.view(q.shape[0], layer.num_heads, layer.head_dim)
        new_keys = k.view(k.shape[0], layer.num_kv_heads, layer.head_dim)
        new_values = v.view(new_keys.shape)
        decode = forward_batch.forward_mode.is_decode()
        if decode and groups[0].whole:
            return self._decode_group(groups[0], queries, new_keys, new_values, layer,
                                      save_kv_cache).to(q.dtype)
        out = queries.new_empty(queries.shape[0], layer.num_heads * layer.head_dim)
        for group in groups:
            if decode:
                result = self._decode_group(group, queries, new_keys, new_values, layer,
                                            save_kv_cache)
                out.index_copy_(0, group.rows, result)
            else:
                result = self._extend_group(group, queries, new_keys, new_values, layer)
                out.index_copy_(0, group.token_src, result)
        return out.to(q.dtype)

    def _decode_group(self, group: _Group, queries: torch.Tensor, new_keys: torch.Tensor,
                      new_values: torch.Tensor, layer: RadixAttention,
                      save_kv_cache: bool) -> torch.Tensor:
        """``[G, heads * dim]``: the group's decode attention over its kept keys and values."""
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        assert group.kv_slots is not None and group.mask is not None  # decode groups gather
        longest = group.mask.shape[-1]
        layer_id = layer.layer_id
        if not save_kv_cache:
            keys, values = _gather(k_buffer, group.kv_slots), _gather(v_buffer, group.kv_slots)
        elif group.append_rows is not None and layer_id in group.keys:
            keys, values = group.keys[layer_id], group.values[layer_id]
            _append(keys, group.append_rows, new_keys if group.whole else new_keys[group.rows])
            _append(values, group.append_rows,
                    new_values if group.whole else new_values[group.rows])
        else:
            keys = group.keys[layer_id] = _padded(_gather(k_buffer, group.kv_slots),
                                                  group.capacity)
            values = group.values[layer_id] = _padded(_gather(v_buffer, group.kv_slots),
                                                      group.capacity)
        q = (queries if group.whole else queries[group.rows]).to(keys.dtype).unsqueeze(2)
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :longest], values[:, :, :longest], attn_mask=group.mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [G, heads, 1, dim]
        return out.view(group.size, layer.num_heads * layer.head_dim).to(queries.dtype)

    def _extend_group(self, group: _Group, queries: torch.Tensor, new_keys: torch.Tensor,
                      new_values: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """``[T, heads * dim]``: attention of the group's new tokens, in packed order."""
        assert group.token_src is not None and group.token_dst is not None  # extend groups
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        q = self._padded_tokens(queries, group).to(k_buffer.dtype)
        if group.kv_slots is None:  # no prefix: the keys are the new tokens themselves
            keys = self._padded_tokens(new_keys.to(k_buffer.dtype), group)
            values = self._padded_tokens(new_values.to(v_buffer.dtype), group)
            causal = True
        else:
            keys, values = _gather(k_buffer, group.kv_slots), _gather(v_buffer, group.kv_slots)
            causal = False
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=group.mask, is_causal=causal, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # [G, heads, Q, dim]
        flat = out.transpose(1, 2).reshape(-1, layer.num_heads * layer.head_dim)
        return flat[group.token_dst].to(queries.dtype)

    @staticmethod
    def _padded_tokens(rows: torch.Tensor, group: _Group) -> torch.Tensor:
        """Packed ``[T, heads, dim]`` rows of the group in a zero-padded ``[G, heads, Q, dim]``."""
        assert group.token_src is not None and group.token_dst is not None
        padded = rows.new_zeros(group.size * group.num_queries, *rows.shape[1:])
        padded[group.token_dst] = rows[group.token_src]
        return padded.view(group.size, group.num_queries, *rows.shape[1:]).transpose(1, 2)


def _padded(gathered: torch.Tensor, capacity: int) -> torch.Tensor:
    """``gathered`` ``[B, H, L, D]`` in a zero-filled ``[B, H, capacity, D]`` tensor.

    Zeros, not garbage: a masked key's value still enters SDPA's product with weight 0,
    and 0 * NaN would be NaN.
    """
    batch, heads, length, dim = gathered.shape
    out = gathered.new_zeros(batch, heads, capacity, dim)
    out[:, :, :length] = gathered
    return out


def _append(kept: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Write ``new`` ``[G, kv_heads, dim]`` into the kept ``[G, kv_heads, capacity, dim]``.

    ``rows`` are the flat rows (``_append_rows``): one ``index_copy_`` for the group.
    """
    dim = kept.shape[-1]
    return kept.view(-1, dim).index_copy_(0, rows, new.reshape(-1, dim).to(kept.dtype))


def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[B, kv_heads, L, dim]`` rows of ``buffer`` at ``slots`` ``[B, L]``.

    ``index_select`` on the flat slots is several times faster than advanced indexing.
    """
    rows = buffer.index_select(0, slots.flatten())
    return rows.view(*slots.shape, *buffer.shape[1:]).transpose(1, 2)
