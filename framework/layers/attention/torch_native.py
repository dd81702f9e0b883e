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
* **Decode**: each request's keys and values are kept across steps in a
  slot of a length group (``kept_kv.KeptDecodeKV``): a request that goes on
  decoding only appends its new token, a newcomer is gathered from the pool
  once, and requests joining or leaving the batch leave the others in place.

A layer with a sliding window attends under a mask that also bounds each
query's keys from below (made once per batch and window, shared by the
layers). A layer with a soft cap computes its scores explicitly (SDPA cannot
cap them); the others keep SDPA.

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
from framework.layers.attention.kept_kv import (
    GroupStep,
    KeptDecodeKV,
    length_groups,
    padded_kv_slots,
)

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention
    from framework.mem_cache.memory_pool import MHATokenToKVPool


@dataclass
class _Group:
    """Requests of a prefill batch attended together in one attention call per layer."""

    members: list[int]  # index of each of the group's requests in the batch
    rows: torch.Tensor  # [G] int64: ``members`` on the device
    num_queries: int  # Q: the most new tokens of one of its requests
    # The group's packed new-token rows, and where each sits in the flat [G * Q] padded
    # queries.
    token_src: torch.Tensor | None = None
    token_dst: torch.Tensor | None = None
    # Keys gathered from the pool (prefill over a prefix): [G, L] KV slot of each key
    # (slot 0 past a request's end) and the [G, 1, Q, L] bool mask. None for a prefill
    # without prefix, whose keys are its new tokens, causally.
    kv_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # [G, 1, Q, 1] position of each query in its request (prefill over a prefix).
    query_pos: torch.Tensor | None = None
    # The masks of sliding-window layers, by window: made at the first layer that needs
    # one, shared by the others.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """How many requests the group holds."""
        return len(self.members)

    def layer_mask(self, window: int | None) -> torch.Tensor | None:
        """The ``[G or 1, 1, Q, L]`` mask of a layer with ``window`` over the group's keys.

        None: the keys are the new tokens, seen causally (SDPA's ``is_causal``). A window
        at least as long as the group's keys cuts nothing, so it is no window.
        """
        num_keys = self.num_queries if self.mask is None else self.mask.shape[-1]
        if window is None or window >= num_keys:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            mask = self.window_masks[window] = self._windowed_mask(window)
        return mask

    def _windowed_mask(self, window: int) -> torch.Tensor:
        device = self.rows.device
        if self.mask is None or self.query_pos is None:  # no prefix: query j is at position j
            pos = torch.arange(self.num_queries, device=device)
            offset = pos[:, None] - pos[None, :]  # [Q, Q]: how far back each key is
            return ((offset >= 0) & (offset < window))[None, None]
        keys = torch.arange(self.mask.shape[-1], device=device)
        mask = self.mask & (keys > self.query_pos - window)
        # Padding queries (past a request's end) may lie beyond the window of every key:
        # they see key 0, so that no row is fully masked.
        mask[..., 0] |= ~mask.any(dim=-1)
        return mask


class TorchNativeAttnBackend(AttentionBackend):
    """Causal attention over the paged KV cache with ``torch.nn.functional`` SDPA.

    Honours each layer's sliding window and soft cap (``RadixAttention``).
    """

    #: A group takes the requests within ``max(group_slack, longest // 4)`` tokens of
    #: its longest one (``length_groups``).
    group_slack = 64
    #: The kept decode keys and values: up to a second copy of the running requests'.
    extra_kv_copies = 1.0
    reads_quantized_kv = True

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        self._groups: list[_Group] | None = None  # of an extend batch
        self._steps: list[GroupStep] | None = None  # of a decode batch
        # Per micro-batch (pipeline parallelism runs a step's requests in two, each
        # request always in the same one): the decoding requests' kept keys and values.
        self._kept: dict[int, KeptDecodeKV] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the groups, gather indices and masks once for all layers of this batch."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        indices = forward_batch.req_pool_indices_cpu
        assert seq_lens is not None and indices is not None  # filled above
        kept = self._kept.get(forward_batch.micro_batch)
        if kept is None:
            kept = self._kept[forward_batch.micro_batch] = KeptDecodeKV(
                self.num_kv_heads, self.group_slack, self.device)
        table = self.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            self._groups = None
            self._steps = kept.plan(indices, seq_lens, table)
            return
        new_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        assert new_lens is not None and prefix_lens is not None  # filled above
        prefills = len(indices) - forward_batch.decode_tail
        # A prefill fills these requests' pool rows anew: what was kept for them is stale.
        kept.evict(indices[:prefills])
        self._steps = None
        if forward_batch.decode_tail:  # a mixed step: its decode tokens attend as in decode
            first = sum(new_lens[:prefills])  # the decode tokens come after the prefills'
            token_rows = list(range(first, first + forward_batch.decode_tail))
            self._steps = kept.plan(indices[prefills:], seq_lens[prefills:], table, token_rows)
        self._groups = self._extend_groups(forward_batch, prefills, seq_lens, new_lens,
                                           prefix_lens)

    # ------------------------------------------------------------------ batch layout

    def _group(self, members: list[int], num_queries: int) -> _Group:
        rows = torch.tensor(members, dtype=torch.int64, device=self.device)
        return _Group(members, rows, num_queries)

    def _extend_groups(self, forward_batch: ForwardBatch, prefills: int, seq_lens: list[int],
                       new_lens: list[int], prefix_lens: list[int]) -> list[_Group]:
        """Length groups of the first ``prefills`` requests (the others decode)."""
        starts = [0]
        for n in new_lens[:-1]:
            starts.append(starts[-1] + n)
        fresh = [i for i, p in enumerate(prefix_lens[:prefills]) if p == 0]
        cached = [i for i, p in enumerate(prefix_lens[:prefills]) if p > 0]
        groups = []
        for family in (fresh, cached):
            lengths = [seq_lens[i] for i in family]
            for members in length_groups(lengths, self.group_slack):
                group = self._token_layout([family[m] for m in members], starts, new_lens)
                if family is cached:
                    indices = forward_batch.req_pool_indices_cpu or []
                    group.kv_slots = padded_kv_slots(
                        self.req_to_token_pool.req_to_token,
                        [indices[i] for i in group.members],
                        [seq_lens[i] for i in group.members])
                    self._set_mask(group, seq_lens, new_lens)
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

    def _lengths(self, group: _Group, lengths: list[int]) -> torch.Tensor:
        return torch.tensor([lengths[i] for i in group.members], dtype=torch.int64,
                            device=self.device)

    def _set_mask(self, group: _Group, seq_lens: list[int], new_lens: list[int]) -> None:
        """The group's ``[G, 1, Q, L]`` mask: may query ``q`` of request ``g`` see key ``l``.

        Causally; the queries' positions are kept too, for windowed layers' masks.
        """
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
        group.mask = mask.unsqueeze(1)
        group.query_pos = query_pos[:, None, :, None]

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
        if self._groups is None and self._steps is None:
            raise RuntimeError("init_forward_metadata must run before the layers")
        pool = self.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if not save_kv_cache or pool.quantized:
            # The new tokens' keys and values as the pool holds them: a quantized pool's
            # rounding then reaches every query alike, whatever step reads the tokens.
            k, v = pool.read_kv(layer.layer_id, forward_batch.out_cache_loc)
        queries = q.view(q.shape[0], layer.num_heads, layer.head_dim)
        new_keys = k.view(k.shape[0], layer.num_kv_heads, layer.head_dim)
        new_values = v.view(new_keys.shape)
        out = queries.new_empty(queries.shape[0], layer.num_heads * layer.head_dim)
        for step in self._steps or ():
            result = self._decode_step(step, queries, new_keys, new_values, layer)
            out.index_copy_(0, step.out_rows, result if step.whole else result[step.out_slots])
        for group in self._groups or ():
            result = self._extend_group(group, queries, new_keys, new_values, layer)
            out.index_copy_(0, group.token_src, result)
        return out.to(q.dtype)

    def _decode_step(self, step: GroupStep, queries: torch.Tensor, new_keys: torch.Tensor,
                     new_values: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """``[slots, heads * dim]``: decode attention of a group's slots over what it keeps.

        The step's new keys and values are in the pool already (``_run`` writes them
        first): a newcomer's slot is gathered from there, new tokens already kept get
        appended.
        """
        pool = self.token_to_kv_pool
        group, layer_id = step.group, layer.layer_id
        keys, values = group.keys.get(layer_id), group.values.get(layer_id)
        if keys is None or values is None:
            # The layer's first sight of the group: fill every slot from the pool (after a
            # failed step, slots kept by the other layers may be new to this one).
            shape = (group.slots, self.num_kv_heads, group.capacity, self.head_dim)
            keys = group.keys[layer_id] = torch.zeros(shape, dtype=pool.dtype, device=self.device)
            values = group.values[layer_id] = torch.zeros_like(keys)
            occupied = step.occupied()
            _fill(keys, values, pool, layer_id, torch.tensor(occupied, device=self.device),
                  step.kv_slots(occupied))
        else:
            if step.fill_slots is not None and step.fill_kv is not None:
                _fill(keys, values, pool, layer_id, step.fill_slots, step.fill_kv)
            if step.append_rows is not None and step.append_batch_rows is not None:
                _append(keys, step.append_rows, new_keys[step.append_batch_rows])
                _append(values, step.append_rows, new_values[step.append_batch_rows])
        q = queries[step.query_rows].to(keys.dtype).unsqueeze(2)  # [slots, heads, 1, dim]
        out = attention(q, keys[:, :, :step.longest], values[:, :, :step.longest],
                        step.layer_mask(layer.sliding_window), layer.scaling,
                        layer.logit_cap)  # [slots, heads, 1, dim]
        return out.view(group.slots, layer.num_heads * layer.head_dim).to(queries.dtype)

    def _extend_group(self, group: _Group, queries: torch.Tensor, new_keys: torch.Tensor,
                      new_values: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """``[T, heads * dim]``: attention of the group's new tokens, in packed order."""
        assert group.token_src is not None and group.token_dst is not None  # extend groups
        dtype = self.token_to_kv_pool.dtype
        q = self._padded_tokens(queries, group).to(dtype)
        if group.kv_slots is None:  # no prefix: the keys are the new tokens themselves
            keys = self._padded_tokens(new_keys.to(dtype), group)
            values = self._padded_tokens(new_values.to(dtype), group)
        else:
            keys, values = _gather(self.token_to_kv_pool, layer.layer_id, group.kv_slots)
        out = attention(q, keys, values, group.layer_mask(layer.sliding_window), layer.scaling,
                        layer.logit_cap)  # [G, heads, Q, dim]
        flat = out.transpose(1, 2).reshape(-1, layer.num_heads * layer.head_dim)
        return flat[group.token_dst].to(queries.dtype)

    @staticmethod
    def _padded_tokens(rows: torch.Tensor, group: _Group) -> torch.Tensor:
        """Packed ``[T, heads, dim]`` rows of the group in a zero-padded ``[G, heads, Q, dim]``."""
        assert group.token_src is not None and group.token_dst is not None
        padded = rows.new_zeros(group.size * group.num_queries, *rows.shape[1:])
        padded[group.token_dst] = rows[group.token_src]
        return padded.view(group.size, group.num_queries, *rows.shape[1:]).transpose(1, 2)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None, scale: float, logit_cap: float | None) -> torch.Tensor:
    """``[B, heads, Q, dim]``: attention of ``q`` over ``[B, kv_heads, L, dim]`` keys, values.

    ``mask`` ``[B or 1, 1, Q, L]`` bool says which keys each query sees; None: causally,
    the queries being the last ``Q`` keys. ``logit_cap`` c soft-caps each score ``s`` to
    ``c * tanh(s / c)`` before the softmax: SDPA has no such step, so capped scores are
    computed explicitly; uncapped attention stays with SDPA's fused kernels.
    """
    if logit_cap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1])
    batch, heads, num_queries, dim = q.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    # Query head h reads key/value head h // (heads // kv_heads): folding those heads into
    # the query rows lets one matmul per key/value head serve them, without repeating keys.
    grouped = q.reshape(batch, kv_heads, -1, dim)  # [B, kv_heads, heads / kv_heads * Q, dim]
    scores = (grouped @ keys.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if mask is None:
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
            num_keys - num_queries)[None, None]
    scores = scores.view(batch, kv_heads, -1, num_queries, num_keys)
    scores.masked_fill_(~mask.unsqueeze(2), float("-inf"))  # mask: [B or 1, 1, 1, Q, L]
    probs = scores.softmax(dim=-1).to(values.dtype).view(batch, kv_heads, -1, num_keys)
    return (probs @ values).view(batch, heads, num_queries, dim)


def _fill(keys: torch.Tensor, values: torch.Tensor, pool: MHATokenToKVPool, layer_id: int,
          slots: torch.Tensor, kv_slots: torch.Tensor) -> None:
    """Gather the keys and values at ``kv_slots`` ``[n, L]`` into ``slots`` of a group."""
    length = kv_slots.shape[1]
    gathered_keys, gathered_values = _gather(pool, layer_id, kv_slots)
    keys[slots, :, :length] = gathered_keys.to(keys.dtype)
    values[slots, :, :length] = gathered_values.to(values.dtype)


def _append(kept: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Write ``new`` ``[n, kv_heads, dim]`` into a group's ``[slots, kv_heads, capacity, dim]``.

    ``rows`` are the flat rows (``kept_kv.flat_rows``): one ``index_copy_`` for the group.
    """
    dim = kept.shape[-1]
    return kept.view(-1, dim).index_copy_(0, rows, new.reshape(-1, dim).to(kept.dtype))


def _gather(pool: MHATokenToKVPool, layer_id: int, slots: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, kv_heads, L, dim]`` keys and values of one layer at ``slots`` ``[B, L]``, in
    the model's dtype (``read_kv`` selects the flat slots: several times faster than
    advanced indexing)."""
    keys, values = pool.read_kv(layer_id, slots)
    return keys.transpose(1, 2), values.transpose(1, 2)
