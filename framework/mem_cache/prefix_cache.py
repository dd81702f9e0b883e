"""The prefix-cache interface, and the cache that reuses nothing.

A prefix cache remembers which KV slots hold the keys and values of which
token sequences, so that a new request starting with a known prefix skips
computing it. The Scheduler owns the cache and talks to it in four moments
of a request's life:

* admission: ``match_prefix(tokens)`` gives the slots of the longest cached
  prefix and a handle to it; ``inc_lock_ref(handle)`` keeps that prefix from
  being evicted while the request runs;
* after a prefill chunk: ``cache_unfinished_req(req)`` puts what the request
  has computed so far into the cache, so that others can share it;
* at the end (finished, aborted or retracted): ``cache_finished_req(req)``
  hands the request's KV over to the cache (or frees it) and unlocks;
* under memory pressure: ``evict(n)`` frees least recently used, unlocked
  entries back to the allocator.

Slot accounting: every KV slot is at any time either free (in the
allocator), owned by the cache (``evictable_size()`` unlocked plus
``protected_size()`` locked), or owned by one running request (its slots past
``req.cache_protected_len``). With nothing running, free + evictable equals the
pool size and nothing is locked: the idle invariant.

The interface takes a ``page_size`` (how many tokens share one unit of
matching and eviction); only 1 is implemented for now.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from framework.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class CachedRequest(Protocol):
    """What a prefix cache reads and updates on a request (the Scheduler's ``Req``).

    ``req_to_token[req_pool_idx, :kv_len]`` are the KV slots of
    ``fill_ids[:kv_len]``; the first ``cache_protected_len`` of them belong to
    the cache (locked through ``last_node``), the rest to the request.
    """

    req_pool_idx: int | None
    kv_len: int
    cache_protected_len: int
    last_node: Any

    @property
    def fill_ids(self) -> list[int]: ...


#: Larger than any token id: the cache keys of an adapter's requests are their token
#: ids offset by a multiple of this, so that no prefix is shared across adapters.
ADAPTER_KEY_STRIDE = 1 << 32


def cache_key(tokens: list[int], adapter_key: int) -> list[int]:
    """The prefix-cache key of ``tokens`` computed with adapter number ``adapter_key``
    (0: the base model, whose keys are the token ids themselves)."""
    if not adapter_key:
        return tokens
    offset = adapter_key * ADAPTER_KEY_STRIDE
    return [token + offset for token in tokens]


def request_cache_key(req: CachedRequest, end: int) -> list[int]:
    """The key of ``req.fill_ids[:end]``, in the key space of the request's LoRA adapter
    (its ``lora_key``; a request without one runs the base model)."""
    return cache_key(req.fill_ids[:end], getattr(req, "lora_key", 0))


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence."""

    indices: torch.Tensor  # [prefix_len] int64: KV slot of each prefix token
    last_node: Any  # handle for inc_lock_ref / dec_lock_ref

    @property
    def length(self) -> int:
        """Number of prefix tokens found."""
        return int(self.indices.numel())


class PrefixCache(ABC):
    """Maps token prefixes to KV slots (see the module docstring for the protocol)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        if page_size != 1:
            raise ValueError(f"only page_size 1 is supported, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached prefix of ``token_ids`` (marks it recently used)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor) -> int:
        """Cache ``kv_indices`` as the slots of ``token_ids``.

        Returns how many leading tokens were cached already; the caller still
        owns those of its ``kv_indices`` (the cache keeps its own slots for them).
        """

    @abstractmethod
    def cache_finished_req(self, req: CachedRequest) -> None:
        """Take over (or free) the request's KV slots and unlock its prefix.

        Afterwards the request owns no KV slot: ``kv_len`` and
        ``cache_protected_len`` are 0 and ``last_node`` is the root handle.
        The request slot (``req_pool_idx``) is left to the caller.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: CachedRequest) -> None:
        """Cache ``fill_ids[:kv_len]`` of a request that goes on running.

        Its row of ``req_to_token`` is rewritten to the cache's slots, and the
        lock moves to the new, longer prefix (``cache_protected_len = kv_len``).
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the prefix ending at ``node`` from eviction (counted per holder)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of unlocked entries if there are that many.

        Least recently used first. Returns the number of slots freed.
        """

    @abstractmethod
    def evictable_size(self) -> int:
        """Slots the cache owns that no request has locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Slots the cache owns that some request has locked."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every entry (their slots must be freed first, or be about to be)."""

    @abstractmethod
    def held_indices(self) -> torch.Tensor:
        """Every KV slot the cache holds, locked or not (for checks, not hot paths)."""

    def available_size(self) -> int:
        """Slots a new allocation can get: free ones plus those eviction can free."""
        return self.allocator.available_size() + self.evictable_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` KV slots, evicting unlocked entries if the free ones are too few."""
        shortfall = num_tokens - self.allocator.available_size()
        if shortfall > 0:
            self.evict(shortfall)
        return self.allocator.alloc(num_tokens)

    @property
    def root(self) -> Any:
        """The handle of the empty prefix (locking it is a no-op)."""
        return None

    def flush(self) -> bool:
        """Free every cached slot and forget every entry; refused (False) while locked."""
        if self.protected_size():
            return False
        self.evict(self.evictable_size())
        self.reset()
        return True


class ChunkCache(PrefixCache):
    """The cache that reuses nothing (``--disable-radix-cache``).

    Matching always finds the empty prefix; a request's KV slots are freed
    when it ends.
    """

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), self.root)

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor) -> int:
        return 0

    def cache_finished_req(self, req: CachedRequest) -> None:
        if req.req_pool_idx is not None and req.kv_len:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self.allocator.free(row[: req.kv_len].clone())
        req.kv_len = 0
        req.cache_protected_len = 0
        req.last_node = self.root

    def cache_unfinished_req(self, req: CachedRequest) -> None:
        return None

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

    def held_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)
