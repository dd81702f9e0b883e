"""Where every KV slot and request row is: the check behind the idle invariant.

Counting (free + evictable == pool size) cannot see a slot that is both free and
held, or one lost while another is counted twice; this check compares the sets.
It walks the whole cache, so it is for checks (``/get_server_info``, tests), not
for every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from framework.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from framework.mem_cache.prefix_cache import PrefixCache


def slot_accounting_problem(allocator: TokenToKVPoolAllocator, cache: PrefixCache,
                            rows: ReqToTokenPool, owned_slots: Sequence[torch.Tensor],
                            held_rows: Sequence[int]) -> str | None:
    """``None`` when each KV slot is free, held by the prefix cache, or in ``owned_slots``
    (what the live requests own), exactly once, and each request row is free or in
    ``held_rows``, exactly once; otherwise what is wrong."""
    slots = torch.cat([allocator.free_indices(), cache.held_indices(), *owned_slots]).cpu()
    # Slot 0 is the padding slot, never handed out: it must appear zero times.
    counts = torch.bincount(slots, minlength=allocator.size + 1)
    expected = torch.ones_like(counts)
    expected[0] = 0
    if counts.numel() != expected.numel() or not torch.equal(counts, expected):
        lost = int((counts[: allocator.size + 1] == 0).sum()) - 1
        shared = int((counts > 1).sum())
        return (f"KV slots leaked or shared: {lost} accounted for nowhere, {shared} "
                f"accounted for more than once, of {allocator.size}")
    all_rows = sorted([*held_rows, *rows.free_indices()])
    if all_rows != list(range(rows.size)):
        return f"request rows leaked or shared: {all_rows}"
    return None
