"""The radix prefix cache: shared token prefixes keep their KV slots (page size 1).

A radix tree over token ids. Each node below the root holds a run of tokens
(``key``) and the KV slots of those tokens (``value``, same length); the path
from the root to a node spells a cached prefix, and the concatenated values
are its slots. Children are keyed by the first token of their key, so that a
lookup follows at most one child per step.

Nodes are split whenever a match or an insert ends inside a key, so that the
handle a request locks always ends exactly where its prefix ends. A split
keeps the original node object as the deeper half: handles that requests
already hold keep pointing at the same end position.

Every slot the tree holds is either evictable (its node has ``lock_ref == 0``)
or protected (``lock_ref > 0``); both sizes are kept as counters. Eviction
frees least recently used unlocked leaves first; a parent whose last child
went becomes a leaf and a candidate in turn. Access times come from a counter,
not the wall clock, so that the order is deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from framework.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from framework.mem_cache.prefix_cache import (
    CachedRequest,
    MatchResult,
    PrefixCache,
    request_cache_key,
)


class TreeNode:
    """One node of the radix tree: a run of tokens and the KV slots holding them."""

    __slots__ = ("children", "key", "last_access_time", "lock_ref", "node_id", "parent", "value")

    def __init__(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        parent: TreeNode | None,
        node_id: int,
        last_access_time: int,
    ) -> None:
        self.key = key
        self.value = value  # int64 KV slots, one per token of ``key``
        self.parent = parent  # None for the root, and for nodes no longer in a tree
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.node_id = node_id  # breaks ties in the eviction heap; never compared otherwise

    @property
    def size(self) -> int:
        """Number of tokens (and slots) this node holds."""
        return len(self.key)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, key={self.key!r}, lock_ref={self.lock_ref}, "
            f"last_access_time={self.last_access_time})"
        )


def _common_prefix_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:]``."""
    n = min(len(key), len(tokens) - start)
    # The whole-run comparison runs in C; only a mismatch needs the Python loop.
    if key[:n] == tokens[start : start + n]:
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    """A radix tree of cached token prefixes and their KV slots (see the module docstring).

    Handles (``MatchResult.last_node``, ``req.last_node``) are ``TreeNode``s;
    ``None`` is accepted wherever a handle is and means the root (no lock).
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self._clock = 0
        self._node_ids = itertools.count()
        self.reset()

    # --- the tree -------------------------------------------------------------

    @property
    def root(self) -> TreeNode:
        """The node of the empty prefix (locking it is a no-op)."""
        return self._root

    def reset(self) -> None:
        """Forget every entry and zero the counters (frees nothing: see ``flush``)."""
        self._root = TreeNode((), self._empty_indices(), None, next(self._node_ids), 0)
        self._evictable = 0
        self._protected = 0

    def evictable_size(self) -> int:
        """Slots held by nodes that no request has locked."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots held by nodes that some request has locked."""
        return self._protected

    def total_size(self) -> int:
        """Slots held by the whole tree, counted by walking it (for checks, not hot paths)."""
        return sum(node.size for node in self._nodes())

    def held_indices(self) -> torch.Tensor:
        """Every slot of the tree, walked (for checks, not hot paths)."""
        return torch.cat([self._empty_indices(), *(node.value for node in self._nodes())])

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node below the root (iterative: deep trees must not hit the recursion limit)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens; returns the new upper half.

        ``node`` itself becomes the lower half, so handles to it still end
        where they did. The upper half carries every lock that passes through
        ``node``, hence the same ``lock_ref``; the counters do not change.
        """
        parent = node.parent
        assert parent is not None and 0 < at < node.size
        upper = TreeNode(
            node.key[:at], node.value[:at], parent, next(self._node_ids), node.last_access_time
        )
        upper.lock_ref = node.lock_ref
        upper.children[node.key[at]] = node
        parent.children[node.key[0]] = upper
        node.key = node.key[at:]
        node.value = node.value[at:]
        node.parent = upper
        return upper

    def _walk(self, tokens: tuple[int, ...]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``tokens`` down the tree, splitting where the match ends inside a key.

        Returns the node ending exactly at the matched length, that length, and
        the values along the way. Every node on the path is marked used now.
        """
        now = self._tick()
        node = self._root
        matched = 0
        values: list[torch.Tensor] = []
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common_prefix_len(child.key, tokens, matched)
            if common < child.size:
                child = self._split(child, common)
            child.last_access_time = now
            values.append(child.value)
            matched += common
            node = child
        return node, matched, values

    # --- matching and inserting -------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached prefix of ``token_ids``; ``last_node`` ends exactly at it."""
        node, _, values = self._walk(tuple(token_ids))
        # cat copies, so the caller can never write into the tree's own values.
        indices = torch.cat(values) if values else self._empty_indices()
        return MatchResult(indices=indices, last_node=node)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor) -> int:
        """Cache ``kv_indices`` as the slots of ``token_ids``; returns the length already cached.

        The tree keeps its own slots for that cached part; the caller still
        owns (and must free or keep) ``kv_indices[:returned]``. The rest is
        copied into a new leaf, which owns those slots from now on.
        """
        tokens = tuple(token_ids)
        if kv_indices.dim() != 1 or kv_indices.numel() != len(tokens):
            raise ValueError(
                f"insert needs one KV slot per token: {len(tokens)} tokens, "
                f"kv_indices of shape {tuple(kv_indices.shape)}"
            )
        node, matched, _ = self._walk(tokens)
        if matched < len(tokens):
            leaf = TreeNode(
                tokens[matched:],
                kv_indices[matched:].to(dtype=torch.int64, copy=True),
                node,
                next(self._node_ids),
                self._clock,  # the tick _walk just took: the leaf is as fresh as its path
            )
            node.children[tokens[matched]] = leaf
            self._evictable += leaf.size
        return matched

    # --- locking ---------------------------------------------------------------

    def _path_to_root(self, node: TreeNode | None) -> list[TreeNode]:
        """``node`` and its ancestors, without the root; empty for the root or ``None``."""
        path: list[TreeNode] = []
        while node is not self._root and node is not None:
            path.append(node)
            node = node.parent
        if path and node is None:
            # Evicted nodes and nodes from before a reset have lost their way to
            # this root: touching their lock_ref would corrupt the counters.
            raise RuntimeError(f"{path[0]!r} is not in this cache (evicted, or from before reset)")
        return path

    def inc_lock_ref(self, node: Any) -> None:
        """Protect the prefix ending at ``node``: every node up to the root gains one lock."""
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._evictable -= n.size
                self._protected += n.size
            n.lock_ref += 1

    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``; raises RuntimeError if it was not locked."""
        path = self._path_to_root(node)
        # Check the whole path before touching it, so a bad call changes nothing.
        if any(n.lock_ref <= 0 for n in path):
            raise RuntimeError(f"dec_lock_ref on an unlocked node: {path[0]!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= n.size
                self._evictable += n.size

    # --- eviction --------------------------------------------------------------

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self._root and node.lock_ref == 0 and not node.children

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` slots are free.

        Whole nodes go, so more than ``num_tokens`` may be freed; fewer only
        when nothing evictable is left. Returns the number of slots freed.
        """
        if num_tokens <= 0:
            return 0
        heap = [
            (n.last_access_time, n.node_id, n) for n in self._nodes() if self._is_evictable_leaf(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            freed += self._remove_leaf(leaf)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> int:
        """Give an unlocked leaf's slots back to the allocator and unlink it."""
        parent = leaf.parent
        assert parent is not None
        self.allocator.free(leaf.value)
        del parent.children[leaf.key[0]]
        leaf.parent = None  # a stale handle to it now fails loudly in _path_to_root
        self._evictable -= leaf.size
        return leaf.size

    # --- requests --------------------------------------------------------------

    def _request_kv(self, req: CachedRequest) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The request's ``req_to_token`` row, a copy of its first ``kv_len`` slots, its tokens."""
        if req.req_pool_idx is None:
            raise RuntimeError(f"request has kv_len={req.kv_len} but no req_pool_idx")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        tokens = request_cache_key(req, req.kv_len)
        if len(tokens) != req.kv_len:
            raise RuntimeError(f"request has kv_len={req.kv_len} but {len(tokens)} fill_ids")
        return row, row[: req.kv_len].clone(), tokens

    def _insert_request(self, req: CachedRequest) -> tuple[torch.Tensor, list[int]]:
        """Insert the request's KV and free the slots it computed for tokens already cached.

        Returns its row and tokens. Slots before ``cache_protected_len`` are the
        tree's own (the request matched them); from ``insert``'s return on they
        now belong to the tree; in between are duplicates nobody else holds.
        """
        row, kv, tokens = self._request_kv(req)
        cached = self.insert(tokens, kv)
        if cached < req.cache_protected_len:
            raise RuntimeError(
                f"the request's locked prefix ({req.cache_protected_len} tokens) is no longer "
                f"cached (only {cached})"
            )
        self.allocator.free(kv[req.cache_protected_len : cached])
        return row, tokens

    def cache_finished_req(self, req: CachedRequest) -> None:
        """Hand the request's KV over to the tree and unlock its prefix (see PrefixCache)."""
        if req.kv_len:
            self._insert_request(req)
        self.dec_lock_ref(req.last_node)
        req.kv_len = 0
        req.cache_protected_len = 0
        req.last_node = self._root

    def cache_unfinished_req(self, req: CachedRequest) -> None:
        """Cache what the request computed so far and move its lock there (see PrefixCache)."""
        new_node = self._root
        if req.kv_len:
            row, tokens = self._insert_request(req)
            match = self.match_prefix(tokens)
            if match.length != req.kv_len:
                raise RuntimeError(f"inserted {req.kv_len} tokens but matched {match.length}")
            # The freed duplicates must no longer be read: point the row at the tree's slots.
            row[: req.kv_len] = match.indices.to(row.device)
            new_node = match.last_node
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_node)
        req.last_node = new_node
        req.cache_protected_len = req.kv_len
