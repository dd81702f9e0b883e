"""Decode keys and values kept across steps, in the slots of a few length groups.

The torch backend's decode attention reads each request's keys and values
from padded ``[slots, kv_heads, capacity, dim]`` tensors, one per group of
requests of similar length, rather than gathering every request's history
from the paged pool at every step. ``KeptDecodeKV`` decides, once per decode
step, where each request of the batch lives:

* a request kept from an earlier decode step, one token longer now, stays in
  its slot and only its new token is appended;
* a request that is new to decoding (or outgrew its group's capacity, or
  whose length does not follow on) takes a free slot of a group of similar
  length, or a new group, and its keys and values are gathered from the pool
  once;
* a slot whose request is not in the batch is freed for the next newcomer,
  and a group left empty is dropped.

So requests joining and leaving a running batch (the usual case when
serving) cost a gather of the newcomers only, not of everyone. Requests are
known by their ``req_pool_idx``; a row of the request pool is reused by
another request only after a prefill, so every extend batch evicts its rows
(``evict``). When the groups hold many more slots than the batch has
requests, everything is placed afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Room for this many more tokens per request in a group's tensors, so that a slot is not
# moved at every step.
DECODE_HEADROOM = 64


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
            floor = lengths[i] - within(slack, lengths[i])
        groups[-1].append(i)
    return [sorted(group) for group in groups]


def within(slack: int, length: int) -> int:
    """How far below ``length`` a request may be to share its group (``max(slack, l // 4)``)."""
    return max(slack, length // 4)


@dataclass
class KeptGroup:
    """A few requests of similar length whose keys and values are kept, one slot each."""

    capacity: int  # positions per slot
    owners: list[int | None]  # req_pool_idx in each slot; None: free
    lens: list[int]  # tokens kept in each slot (0: free)
    # Per layer id, [slots, kv_heads, capacity, dim]; made at the layer's first use.
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        """How many requests the group can hold."""
        return len(self.owners)

    def longest(self) -> int:
        """The longest request it holds."""
        return max(self.lens)

    def free(self, slot: int) -> None:
        """Give ``slot`` up."""
        self.owners[slot] = None
        self.lens[slot] = 0


@dataclass
class GroupStep:
    """What one decode step does with one group: built once, used by every layer."""

    group: KeptGroup
    longest: int  # keys read per slot
    query_rows: torch.Tensor  # [slots] batch row whose query each slot takes (free: row 0)
    out_slots: torch.Tensor  # [n] slots that hold a request of the batch
    out_rows: torch.Tensor  # [n] their batch rows
    mask: torch.Tensor  # [slots, 1, 1, longest] bool: keys each slot's query may see
    lens: torch.Tensor  # [slots] keys of each slot's request (free: 1)
    append_rows: torch.Tensor | None  # flat rows (``flat_rows``) of the new tokens
    append_batch_rows: torch.Tensor | None  # batch rows those new tokens come from
    fill_slots: torch.Tensor | None  # [m] slots placed this step, gathered from the pool
    fill_kv: torch.Tensor | None  # [m, L] their KV slots (padding slot 0 past their end)
    req_to_token: torch.Tensor  # the request pool's table, for ``kv_slots``
    # The masks of sliding-window layers, by window: made at the first such layer of the
    # step, shared by the others.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def layer_mask(self, window: int | None) -> torch.Tensor:
        """``[slots, 1, 1, longest]``: the keys each query of a layer with ``window`` sees.

        A query sits at its request's last position ``len - 1``: a window of W keeps it to
        the keys at positions ``>= len - W``. A window at least ``longest`` cuts nothing.
        """
        if window is None or window >= self.longest:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            keys = torch.arange(self.longest, device=self.mask.device)
            in_window = keys[None, :] >= (self.lens - window)[:, None]
            mask = self.window_masks[window] = self.mask & in_window[:, None, None, :]
        return mask

    @property
    def whole(self) -> bool:
        """Whether every slot holds a request (nothing to pick from the output)."""
        return int(self.out_slots.shape[0]) == self.group.slots

    def kv_slots(self, slots: list[int]) -> torch.Tensor:
        """``[len(slots), L]`` KV slots of those slots' requests (0 past each one's end)."""
        owners = [self.group.owners[s] for s in slots]
        return padded_kv_slots(self.req_to_token, [idx for idx in owners if idx is not None],
                               [self.group.lens[s] for s in slots])

    def occupied(self) -> list[int]:
        """The slots that hold a request."""
        return [slot for slot, idx in enumerate(self.group.owners) if idx is not None]


class KeptDecodeKV:
    """Where each decoding request's keys and values are kept (see the module docstring)."""

    def __init__(self, num_kv_heads: int, slack: int, device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        self.slack = slack
        self.device = device
        self.groups: list[KeptGroup] = []
        self.where: dict[int, tuple[KeptGroup, int]] = {}  # req_pool_idx -> (group, slot)

    def evict(self, req_pool_indices: list[int]) -> None:
        """Forget these requests (their pool rows are being filled anew by a prefill)."""
        for idx in req_pool_indices:
            if (place := self.where.pop(idx, None)) is not None:
                place[0].free(place[1])
        self.groups = [g for g in self.groups if any(o is not None for o in g.owners)]

    def plan(self, req_pool_indices: list[int], seq_lens: list[int], req_to_token: torch.Tensor,
             token_rows: list[int] | None = None) -> list[GroupStep]:
        """Place every decoding request; the steps each layer then carries out.

        ``token_rows``: where each request's token sits among the step's packed tokens
        (default: request ``i`` at row ``i``, as in a decode batch).
        """
        rows = token_rows if token_rows is not None else range(len(req_pool_indices))
        rows_of = dict(zip(req_pool_indices, rows, strict=True))
        self.evict([idx for idx in self.where if idx not in rows_of])
        newcomers = [row for row, (idx, n) in enumerate(zip(req_pool_indices, seq_lens))
                     if not self._follows_on(idx, n)]
        if sum(g.slots for g in self.groups) > 2 * len(req_pool_indices) + 8:
            self.evict(list(self.where))  # too many holes: place everyone afresh
            newcomers = list(range(len(req_pool_indices)))
        placed = self._place(newcomers, req_pool_indices, seq_lens)
        return [self._group_step(g, rows_of, placed, req_to_token) for g in self.groups]

    def _follows_on(self, idx: int, seq_len: int) -> bool:
        """Whether ``idx`` is kept one token shorter and still fits: then count the token."""
        place = self.where.get(idx)
        if place is None:
            return False
        group, slot = place
        if group.lens[slot] + 1 == seq_len <= group.capacity:
            group.lens[slot] = seq_len
            return True
        self.evict([idx])
        return False

    def _place(self, rows: list[int], req_pool_indices: list[int],
               seq_lens: list[int]) -> set[int]:
        """Put each newcomer in a free slot of a group like it, or in new groups."""
        homeless = []
        for row in sorted(rows, key=lambda r: -seq_lens[r]):
            group = self._group_for(seq_lens[row])
            if group is None:
                homeless.append(row)
                continue
            slot = group.owners.index(None)
            group.owners[slot], group.lens[slot] = req_pool_indices[row], seq_lens[row]
            self.where[req_pool_indices[row]] = (group, slot)
        for members in length_groups([seq_lens[r] for r in homeless], self.slack):
            chosen = [homeless[m] for m in members]
            lens = [seq_lens[r] for r in chosen]
            group = KeptGroup(max(lens) + DECODE_HEADROOM,
                              [req_pool_indices[r] for r in chosen], lens)
            self.groups.append(group)
            for slot, row in enumerate(chosen):
                self.where[req_pool_indices[row]] = (group, slot)
        return {req_pool_indices[row] for row in rows}

    def _group_for(self, seq_len: int) -> KeptGroup | None:
        """A group with a free slot whose requests are about ``seq_len`` long."""
        best = None
        for group in self.groups:
            if None not in group.owners or seq_len > group.capacity:
                continue
            longest = group.longest()
            if abs(longest - seq_len) > within(self.slack, max(longest, seq_len)):
                continue
            if best is None or abs(longest - seq_len) < abs(best.longest() - seq_len):
                best = group
        return best

    def _group_step(self, group: KeptGroup, rows_of: dict[int, int], placed: set[int],
                    req_to_token: torch.Tensor) -> GroupStep:
        device, heads = self.device, self.num_kv_heads
        occupied = [slot for slot, idx in enumerate(group.owners) if idx is not None]
        batch_rows = [rows_of[group.owners[slot]] for slot in occupied]  # type: ignore[index]
        longest = group.longest()
        query_rows = [0] * group.slots
        for slot, row in zip(occupied, batch_rows):
            query_rows[slot] = row
        fills = [s for s in occupied if group.owners[s] in placed]
        appends = [s for s in occupied if group.owners[s] not in placed]
        lens = torch.tensor([max(n, 1) for n in group.lens], device=device)  # free: key 0
        mask = torch.arange(longest, device=device)[None, :] < lens[:, None]
        step = GroupStep(
            group, longest,
            query_rows=torch.tensor(query_rows, device=device),
            out_slots=torch.tensor(occupied, device=device),
            out_rows=torch.tensor(batch_rows, device=device),
            mask=mask[:, None, None, :], lens=lens,
            append_rows=None, append_batch_rows=None, fill_slots=None, fill_kv=None,
            req_to_token=req_to_token,
        )
        if appends:
            step.append_rows = flat_rows(appends, [group.lens[s] - 1 for s in appends], heads,
                                         group.capacity, device)
            step.append_batch_rows = torch.tensor([query_rows[s] for s in appends],
                                                  device=device)
        if fills:
            step.fill_slots = torch.tensor(fills, device=device)
            step.fill_kv = step.kv_slots(fills)
        return step


def flat_rows(slots: list[int], positions: list[int], heads: int, capacity: int,
              device: torch.device) -> torch.Tensor:
    """Rows of ``[slots * heads * capacity, dim]`` at ``positions`` of ``slots``, every head.

    The flat view of a group's ``[slots, heads, capacity, dim]`` tensor: one
    ``index_copy_`` writes a token into every head of several slots.
    """
    first = (torch.tensor(slots, device=device)[:, None] * heads
             + torch.arange(heads, device=device)[None, :]) * capacity
    return (first + torch.tensor(positions, device=device)[:, None]).flatten()


def padded_kv_slots(req_to_token: torch.Tensor, req_pool_indices: list[int],
                    lens: list[int]) -> torch.Tensor:
    """``[n, max(lens)]``: the KV slots of each request's first ``lens`` tokens, then 0.

    Slot 0 is the pool's padding slot, so the padded positions gather harmless keys.
    """
    device = req_to_token.device
    longest = max(lens)
    rows = torch.tensor(req_pool_indices, dtype=torch.int64, device=device)
    lengths = torch.tensor(lens, dtype=torch.int64, device=device)
    in_request = torch.arange(longest, device=device)[None, :] < lengths[:, None]
    return torch.where(in_request, req_to_token[rows, :longest], 0)
