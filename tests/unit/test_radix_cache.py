"""The radix prefix cache: matching, splitting, locking, LRU eviction, slot accounting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from framework.mem_cache import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from framework.mem_cache.radix_cache import TreeNode

CPU = torch.device("cpu")

# --- helpers ------------------------------------------------------------------


def make_cache(pool_size: int, rows: int = 4, context: int = 16) -> RadixCache:
    """A radix cache over real pools."""
    return RadixCache(ReqToTokenPool(rows, context, CPU), TokenToKVPoolAllocator(pool_size, CPU))


def free_slots(allocator: TokenToKVPoolAllocator) -> list[int]:
    """The allocator's free slots."""
    free = allocator.free_indices().tolist()
    assert len(free) == allocator.available_size()
    return free


def nodes_with_prefix(cache: RadixCache) -> list[tuple[TreeNode, tuple[int, ...]]]:
    """Every node below the root with the prefix its path spells (ending at the node)."""
    out: list[tuple[TreeNode, tuple[int, ...]]] = []
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            # Structure: keyed by first token, one slot per token, parent link right.
            assert child.key and child.key[0] == first
            assert child.value.dtype == torch.int64 and child.value.numel() == len(child.key)
            assert child.parent is node
            child_prefix = prefix + tuple(child.key)
            out.append((child, child_prefix))
            stack.append((child, child_prefix))
    return out


def cached_slots(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix → the slot of its last token, enumerated from the tree."""
    out: dict[tuple[int, ...], int] = {}
    for node, prefix in nodes_with_prefix(cache):
        start = len(prefix) - len(node.key)
        for i, slot in enumerate(node.value.tolist()):
            out[prefix[: start + i + 1]] = slot
    return out


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    """The prefix a handle ends at, read by walking up to the root."""
    parts: list[tuple[int, ...]] = []
    current: TreeNode | None = node
    while current is not None:
        parts.append(tuple(current.key))
        current = current.parent
    return tuple(t for part in reversed(parts) for t in part)


def prefixes(seq: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The non-empty prefixes of ``seq``."""
    return {seq[: i + 1] for i in range(len(seq))}


def alloc(cache: RadixCache, n: int) -> torch.Tensor:
    slots = cache.allocator.alloc(n)
    assert slots is not None
    return slots


def insert_fresh(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Insert ``tokens`` with new slots, freeing the already-cached part as a caller would."""
    kv = alloc(cache, len(tokens))
    cached = cache.insert(tokens, kv)
    cache.allocator.free(kv[:cached])
    return kv


# --- 1. against a reference model ------------------------------------------------

POOL = 40
MAX_LEN = 8
SEQS = st.lists(st.integers(0, 3), max_size=MAX_LEN).map(tuple)


class RadixCacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks and evictions against a dict of cached prefixes.

    The reference maps every cached prefix to the slot of its last token and
    to the time (one tick per insert or match) it was last used.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(POOL)
        self.allocator = self.cache.allocator
        self.slots: dict[tuple[int, ...], int] = {}
        self.used: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []

    def longest_cached(self, seq: tuple[int, ...]) -> int:
        n = 0
        while n < len(seq) and seq[: n + 1] in self.slots:
            n += 1
        return n

    def touch(self, seq: tuple[int, ...], n: int) -> None:
        self.clock += 1
        for i in range(n):
            self.used[seq[: i + 1]] = self.clock

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        return set().union(*(prefixes(seq) for _, seq in self.locks))

    def evict_and_check(self, amount: int) -> None:
        before = dict(self.slots)
        evictable = self.cache.evictable_size()
        available = self.allocator.available_size()
        freed = self.cache.evict(amount)
        after = cached_slots(self.cache)
        # Eviction only removes entries; it never moves a slot.
        assert after.items() <= before.items()
        removed = before.keys() - after.keys()
        assert freed == len(removed)
        assert not removed & self.locked_prefixes(), "a locked prefix was evicted"
        assert self.allocator.available_size() == available + freed
        assert {before[p] for p in removed} <= set(free_slots(self.allocator))
        if amount <= evictable:
            assert freed >= amount
            # Whole nodes go, but never more than one node (at most MAX_LEN) past the need.
            assert amount == 0 or freed < amount + MAX_LEN
        else:
            assert freed == evictable, "evict must take everything unlocked when asked for more"
        # LRU over leaves: nothing evicted was used after an unlocked leaf that stays.
        locked = self.locked_prefixes()
        kept_leaves = [
            p for p in after if p not in locked and not any((*p, t) in after for t in range(4))
        ]
        if removed and kept_leaves:
            assert max(self.used[p] for p in removed) <= min(self.used[p] for p in kept_leaves)
        self.slots = after
        for p in removed:
            del self.used[p]

    @rule(seq=SEQS)
    def insert(self, seq: tuple[int, ...]) -> None:
        if self.allocator.available_size() < len(seq):
            self.evict_and_check(len(seq) - self.allocator.available_size())
        kv = self.allocator.alloc(len(seq))
        if kv is None:
            return  # locked entries fill the pool
        expected = self.longest_cached(seq)
        cached = self.cache.insert(list(seq), kv)
        assert cached == expected
        self.allocator.free(kv[:cached])  # the tree keeps its own slots for these
        for i in range(cached, len(seq)):
            self.slots[seq[: i + 1]] = int(kv[i])
        self.touch(seq, len(seq))

    @rule(seq=SEQS, lock=st.booleans())
    def match(self, seq: tuple[int, ...], lock: bool) -> None:
        n = self.longest_cached(seq)
        result = self.cache.match_prefix(list(seq))
        assert result.length == n
        assert result.indices.dtype == torch.int64
        assert result.indices.tolist() == [self.slots[seq[: i + 1]] for i in range(n)]
        assert path_tokens(result.last_node) == seq[:n], "last_node must end at the match"
        self.touch(seq, n)
        if lock:
            self.cache.inc_lock_ref(result.last_node)
            self.locks.append((result.last_node, seq[:n]))

    @rule(pick=st.integers(0, 1000))
    def unlock(self, pick: int) -> None:
        if not self.locks:
            return
        node, _ = self.locks.pop(pick % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(amount=st.integers(0, POOL + 2))
    def evict(self, amount: int) -> None:
        self.evict_and_check(amount)

    @invariant()
    def tree_matches_reference(self) -> None:
        assert cached_slots(self.cache) == self.slots

    @invariant()
    def slots_are_accounted(self) -> None:
        nodes = nodes_with_prefix(self.cache)
        in_tree = [slot for node, _ in nodes for slot in node.value.tolist()]
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        assert evictable + protected == len(in_tree) == self.cache.total_size()
        assert sorted(self.cache.held_indices().tolist()) == sorted(in_tree)
        assert self.allocator.available_size() + evictable + protected == POOL
        # Each slot in exactly one place: none lost, none twice.
        assert sorted(free_slots(self.allocator) + in_tree) == list(range(1, POOL + 1))
        assert protected == sum(len(node.key) for node, _ in nodes if node.lock_ref > 0)
        assert protected == len(self.locked_prefixes())

    @invariant()
    def locks_are_counted_per_holder(self) -> None:
        for node, prefix in nodes_with_prefix(self.cache):
            holders = sum(1 for _, seq in self.locks if seq[: len(prefix)] == prefix)
            assert node.lock_ref == holders
        for node, seq in self.locks:
            assert path_tokens(node) == seq, "a split must not move a held handle"


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestRadixCacheAgainstReference = RadixCacheMachine.TestCase


# --- 1b. request life cycles, with request-owned slots -------------------------


@dataclass
class FakeReq:
    """The fields of the Scheduler's Req that a prefix cache reads and writes."""

    fill_ids: list[int]
    req_pool_idx: int | None = None
    kv_len: int = 0
    cache_protected_len: int = 0
    last_node: Any = None


REQ_POOL = 32
REQ_ROWS = 4


class RequestMachine(RuleBasedStateMachine):
    """Requests that match, compute in chunks, cache unfinished and finish, sharing prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(REQ_POOL, rows=REQ_ROWS, context=MAX_LEN)
        self.allocator = self.cache.allocator
        self.rows = self.cache.req_to_token_pool
        self.live: list[FakeReq] = []

    def row(self, req: FakeReq) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.rows.req_to_token[req.req_pool_idx]

    @initialize()
    def start_empty(self) -> None:
        assert self.cache.evictable_size() == self.cache.protected_size() == 0

    @rule(seq=st.lists(st.integers(0, 2), min_size=1, max_size=MAX_LEN))
    def admit(self, seq: list[int]) -> None:
        if not self.rows.available_size():
            return
        match = self.cache.match_prefix(seq)
        self.cache.inc_lock_ref(match.last_node)
        taken = self.rows.alloc()
        assert taken is not None
        req = FakeReq(seq, taken[0], match.length, match.length, match.last_node)
        self.row(req)[: match.length] = match.indices
        self.live.append(req)

    @rule(pick=st.integers(0, 100), chunk=st.integers(1, 4))
    def compute(self, pick: int, chunk: int) -> None:
        if not self.live:
            return
        req = self.live[pick % len(self.live)]
        need = min(chunk, len(req.fill_ids) - req.kv_len)
        if self.allocator.available_size() < need:
            self.cache.evict(need - self.allocator.available_size())
        kv = self.allocator.alloc(need)
        if kv is None:
            return
        self.row(req)[req.kv_len : req.kv_len + need] = kv
        req.kv_len += need

    @rule(pick=st.integers(0, 100))
    def cache_unfinished(self, pick: int) -> None:
        if not self.live:
            return
        req = self.live[pick % len(self.live)]
        self.cache.cache_unfinished_req(req)
        assert req.cache_protected_len == req.kv_len
        tokens = req.fill_ids[: req.kv_len]
        assert path_tokens(req.last_node) == tuple(tokens)
        assert torch.equal(self.row(req)[: req.kv_len], self.cache.match_prefix(tokens).indices)

    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        if not self.live:
            return
        req = self.live.pop(pick % len(self.live))
        self.cache.cache_finished_req(req)
        assert (req.kv_len, req.cache_protected_len) == (0, 0)
        assert req.last_node is self.cache.root
        assert req.req_pool_idx is not None
        self.rows.free(req.req_pool_idx)

    @invariant()
    def every_slot_in_exactly_one_place(self) -> None:
        in_tree = [
            slot for node, _ in nodes_with_prefix(self.cache) for slot in node.value.tolist()
        ]
        owned = [
            s for r in self.live for s in self.row(r)[r.cache_protected_len : r.kv_len].tolist()
        ]
        evictable, protected = self.cache.evictable_size(), self.cache.protected_size()
        assert self.allocator.available_size() + evictable + protected + len(owned) == REQ_POOL
        assert sorted(free_slots(self.allocator) + in_tree + owned) == list(range(1, REQ_POOL + 1))
        locked = set().union(
            *(prefixes(tuple(r.fill_ids[: r.cache_protected_len])) for r in self.live)
        )
        assert protected == len(locked)
        # A request's protected part is read from the tree's own slots.
        tree = cached_slots(self.cache)
        for r in self.live:
            expected = [tree[tuple(r.fill_ids[: i + 1])] for i in range(r.cache_protected_len)]
            assert self.row(r)[: r.cache_protected_len].tolist() == expected

    def teardown(self) -> None:
        for req in self.live:
            self.cache.cache_finished_req(req)
        # The idle invariant.
        assert self.cache.protected_size() == 0
        assert self.allocator.available_size() + self.cache.evictable_size() == REQ_POOL


RequestMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRequestLifeCycles = RequestMachine.TestCase


# --- 2. eviction ------------------------------------------------------------------


def test_evict_frees_least_recently_used_leaves_and_spares_locked_prefixes() -> None:
    cache = make_cache(8)
    kv = {seq: insert_fresh(cache, list(seq)) for seq in [(1, 2), (3, 4), (5, 6), (7, 8)]}
    assert cache.allocator.available_size() == 0 and cache.evictable_size() == 8
    locked = cache.match_prefix([5, 6])
    cache.inc_lock_ref(locked.last_node)
    cache.match_prefix([3, 4])
    cache.match_prefix([1, 2, 9])
    # Least recently used first: (7, 8) was never matched, then (3, 4), then (1, 2).
    for seq in [(7, 8), (3, 4)]:
        before = set(free_slots(cache.allocator))
        assert cache.evict(1) == 2, "a whole leaf goes even when fewer slots are asked for"
        assert cache.match_prefix(list(seq)).length == 0
        assert set(free_slots(cache.allocator)) - before == set(kv[seq].tolist())
    assert cache.match_prefix([1, 2]).length == 2
    assert cache.evict(100) == 2
    assert cache.evict(100) == 0, "only the locked prefix is left"
    assert torch.equal(cache.match_prefix([5, 6]).indices, kv[(5, 6)])
    assert (cache.allocator.available_size(), cache.protected_size()) == (6, 2)
    cache.dec_lock_ref(locked.last_node)
    assert cache.evict(100) == 2
    assert sorted(free_slots(cache.allocator)) == list(range(1, 9))


def test_evict_continues_into_parents_that_become_leaves() -> None:
    cache = make_cache(8)
    for seq in [[1, 2, 3], [1, 2, 4], [5]]:
        insert_fresh(cache, seq)
    cache.match_prefix([5])  # (5) is now the most recent leaf
    assert cache.evict(3) == 4, "both children of (1, 2), then (1, 2) itself"
    assert cache.match_prefix([1]).length == 0
    assert cache.match_prefix([5]).length == 1
    assert cache.evictable_size() == 1 and cache.allocator.available_size() == 7


def test_evict_nothing() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1, 2])
    assert cache.evict(0) == 0
    assert cache.evictable_size() == 2


# --- 3. splitting ------------------------------------------------------------------


def test_match_splits_the_node_where_the_match_ends() -> None:
    cache = make_cache(8)
    kv = insert_fresh(cache, [1, 2, 3, 4])
    result = cache.match_prefix([1, 2, 9])
    assert result.length == 2
    assert torch.equal(result.indices, kv[:2])
    assert tuple(result.last_node.key) == (1, 2) and result.last_node.parent is cache.root
    cache.inc_lock_ref(result.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)

    new = alloc(cache, 3)
    assert cache.insert([1, 2, 5], new) == 2, "the first two tokens are reused"
    cache.allocator.free(new[:2])
    assert torch.equal(cache.match_prefix([1, 2, 5]).indices, torch.cat((kv[:2], new[2:])))
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, kv)

    # A later split above a held handle leaves the handle where it was.
    assert cache.match_prefix([1]).length == 1
    assert path_tokens(result.last_node) == (1, 2)
    assert cache.protected_size() == 2
    cache.dec_lock_ref(result.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 5)


def test_insert_of_a_shorter_prefix_splits_and_caches_nothing_new() -> None:
    cache = make_cache(8)
    kv = insert_fresh(cache, [1, 2, 3])
    assert cache.insert([1, 2], torch.tensor([7, 8])) == 2
    assert cache.evictable_size() == 3
    assert tuple(cache.match_prefix([1, 2]).last_node.key) == (1, 2)
    assert torch.equal(cache.match_prefix([1, 2, 3]).indices, kv)


def test_empty_match_is_the_root() -> None:
    cache = make_cache(4)
    for tokens in ([], [1, 2]):
        result = cache.match_prefix(tokens)
        assert result.length == 0 and result.indices.dtype == torch.int64
        assert result.last_node is cache.root


def test_match_returns_a_copy_of_the_slots() -> None:
    cache = make_cache(4)
    kv = insert_fresh(cache, [1, 2])
    cache.match_prefix([1, 2]).indices.fill_(0)
    assert torch.equal(cache.match_prefix([1, 2]).indices, kv)


def test_insert_needs_one_slot_per_token() -> None:
    cache = make_cache(4)
    with pytest.raises(ValueError, match="one KV slot per token"):
        cache.insert([1, 2, 3], torch.tensor([1, 2]))


# --- locking -----------------------------------------------------------------------


def test_lock_is_counted_per_holder_and_unlocking_too_often_raises() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 3, "one holder is left"
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)


def test_locking_the_root_is_a_no_op() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1])
    cache.inc_lock_ref(cache.root)
    cache.dec_lock_ref(cache.root)
    cache.dec_lock_ref(cache.root)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 1)


def test_an_evicted_handle_cannot_be_locked() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(RuntimeError, match="not in this cache"):
        cache.inc_lock_ref(node)
    assert cache.protected_size() == cache.evictable_size() == 0


# --- 4. requests ---------------------------------------------------------------------


def start(cache: RadixCache, tokens: list[int], computed: int | None = None) -> FakeReq:
    """Admit a request like the Scheduler: match, lock, take a row, compute ``computed`` tokens."""
    match = cache.match_prefix(tokens)
    cache.inc_lock_ref(match.last_node)
    taken = cache.req_to_token_pool.alloc()
    assert taken is not None
    req = FakeReq(tokens, taken[0], match.length, match.length, match.last_node)
    row = cache.req_to_token_pool.req_to_token[taken[0]]
    row[: match.length] = match.indices
    end = len(tokens) if computed is None else computed
    row[req.kv_len : end] = alloc(cache, end - req.kv_len)
    req.kv_len = end
    return req


def row_of(cache: RadixCache, req: FakeReq) -> torch.Tensor:
    assert req.req_pool_idx is not None
    return cache.req_to_token_pool.req_to_token[req.req_pool_idx]


def test_finished_requests_share_a_prefix_and_free_their_duplicates() -> None:
    cache = make_cache(16)
    a = start(cache, [1, 2, 3, 4, 5])
    b = start(cache, [1, 2, 3, 9, 9])  # started before A was cached: computes everything
    a_kv, b_kv = row_of(cache, a)[:5].clone(), row_of(cache, b)[:5].clone()
    assert cache.allocator.available_size() == 6

    cache.cache_finished_req(a)
    assert (a.kv_len, a.cache_protected_len, a.last_node) == (0, 0, cache.root)
    assert cache.evictable_size() == 5 and cache.allocator.available_size() == 6

    before = set(free_slots(cache.allocator))
    cache.cache_finished_req(b)
    # B's first three slots duplicate A's and go back; its last two join the tree.
    assert set(free_slots(cache.allocator)) - before == set(b_kv[:3].tolist())
    assert torch.equal(cache.match_prefix([1, 2, 3, 9, 9]).indices, torch.cat((a_kv[:3], b_kv[3:])))
    assert cache.protected_size() == 0
    assert cache.allocator.available_size() + cache.evictable_size() == 16
    assert cache.evictable_size() == 7


def test_a_finished_request_that_matched_a_prefix_keeps_the_tree_slots() -> None:
    cache = make_cache(16)
    cache.cache_finished_req(start(cache, [1, 2, 3]))
    tree_kv = cache.match_prefix([1, 2, 3]).indices
    req = start(cache, [1, 2, 3, 4])
    assert req.cache_protected_len == 3 and cache.protected_size() == 3
    assert torch.equal(row_of(cache, req)[:3], tree_kv)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert (cache.evictable_size(), cache.allocator.available_size()) == (4, 12)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices[:3], tree_kv)


def test_cache_unfinished_req_rewrites_the_row_and_moves_the_lock() -> None:
    cache = make_cache(16)
    a = start(cache, [1, 2, 3, 4, 5])
    c = start(cache, [1, 2, 3, 4, 7], computed=4)  # a first chunk, before A is cached
    c_chunk = row_of(cache, c)[:4].clone()
    cache.cache_finished_req(a)
    a_kv = cache.match_prefix([1, 2, 3, 4, 5]).indices
    available = cache.allocator.available_size()
    before = set(free_slots(cache.allocator))

    cache.cache_unfinished_req(c)
    assert torch.equal(row_of(cache, c)[:4], a_kv[:4]), "the row now reads the tree's slots"
    assert cache.allocator.available_size() == available + 4, "C's own copies were freed"
    assert set(free_slots(cache.allocator)) - before == set(c_chunk.tolist())
    assert c.cache_protected_len == 4 and path_tokens(c.last_node) == (1, 2, 3, 4)
    assert cache.protected_size() == 4

    # The next chunk: the lock moves from (1, 2, 3, 4) to (1, 2, 3, 4, 7).
    row_of(cache, c)[4:5] = alloc(cache, 1)
    c.kv_len = 5
    old_node = c.last_node
    cache.cache_unfinished_req(c)
    assert c.last_node is not old_node and path_tokens(c.last_node) == (1, 2, 3, 4, 7)
    assert old_node.lock_ref == 1, "held through the new node only"
    assert cache.protected_size() == 5 and c.cache_protected_len == 5

    cache.cache_finished_req(c)
    assert cache.protected_size() == 0
    assert cache.allocator.available_size() + cache.evictable_size() == 16


def test_cache_unfinished_req_of_fresh_tokens_keeps_the_requests_slots() -> None:
    cache = make_cache(8)
    req = start(cache, [4, 5, 6])
    kv = row_of(cache, req)[:3].clone()
    cache.cache_unfinished_req(req)
    assert torch.equal(row_of(cache, req)[:3], kv)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 0)
    assert cache.evict(8) == 0, "a running request's prefix cannot be evicted"
    cache.cache_finished_req(req)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)


def test_requests_with_no_kv() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1, 2])
    never_admitted = FakeReq([1, 2, 3], req_pool_idx=None, last_node=cache.root)
    cache.cache_unfinished_req(never_admitted)
    cache.cache_finished_req(never_admitted)
    assert never_admitted.last_node is cache.root

    # Matched and locked, then aborted before computing: kv_len == 0, but it must unlock.
    match = cache.match_prefix([1, 2])
    cache.inc_lock_ref(match.last_node)
    aborted = FakeReq([1, 2], req_pool_idx=None, kv_len=0, last_node=match.last_node)
    cache.cache_finished_req(aborted)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 2)
    assert cache.allocator.available_size() == 6


# --- 5. flush --------------------------------------------------------------------------


def test_flush_refuses_while_locked_and_frees_everything_otherwise() -> None:
    cache = make_cache(8)
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 4])
    node = cache.match_prefix([1, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.flush() is False
    assert cache.match_prefix([1, 2, 3]).length == 3, "a refused flush changes nothing"
    assert cache.evictable_size() + cache.protected_size() == 4

    cache.dec_lock_ref(node)
    assert cache.flush() is True
    assert cache.evictable_size() == cache.protected_size() == 0
    assert sorted(free_slots(cache.allocator)) == list(range(1, 9))
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.root.children == {}
    with pytest.raises(RuntimeError, match="not in this cache"):
        cache.inc_lock_ref(node)


def test_a_request_with_kv_but_no_row_or_tokens_is_refused() -> None:
    cache = make_cache(8)
    with pytest.raises(RuntimeError, match="no req_pool_idx"):
        cache.cache_finished_req(FakeReq([1, 2], req_pool_idx=None, kv_len=2))
    with pytest.raises(RuntimeError, match="fill_ids"):
        cache.cache_unfinished_req(FakeReq([1], req_pool_idx=0, kv_len=2))
    assert cache.evictable_size() == 0 and cache.allocator.available_size() == 8
