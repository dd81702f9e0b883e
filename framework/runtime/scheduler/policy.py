"""Scheduling policy: the order of the waiting queue, admission into a prefill, retraction.

Admission is correct by construction: a request joins a prefill only when the
KV slots it needs now (its chunk, plus one for its first decode step) fit in
what is free or evictable after every earlier commitment of the step (one slot
per running request for its next decode, and the chunks already admitted).
A request's cached prefix is locked as it is admitted, so the slots counted
as evictable never include its own prefix.

These parts are handed the cache and the pools they need; they know nothing
of the Scheduler.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable

from framework.forward_batch import ForwardMode
from framework.mem_cache.memory_pool import ReqToTokenPool
from framework.mem_cache.prefix_cache import PrefixCache, request_cache_key
from framework.runtime.request import Req
from framework.runtime.scheduler.batch import ScheduledBatch

# Matching every waiting request costs time; past this queue length lpm falls back to fcfs.
LPM_QUEUE_LIMIT = 128
# A request sharing at least this many uncached prefix tokens with one admitted in the same
# step waits one step: the prefix is cached after that step, and it reuses it then.
IN_BATCH_SHARE_THRESHOLD = 32


class Admission(enum.Enum):
    """What ``PrefillAdder.add`` did with a request."""

    ADDED = enum.auto()
    DEFERRED = enum.auto()  # it shares an uncached prefix with this step; next step
    FULL = enum.auto()  # nothing more fits this step


class SchedulePolicy:
    """Orders the waiting queue before each prefill selection.

    A policy is registered by name in ``framework.registry.SCHEDULE_POLICIES``
    (entry-point group ``framework.schedule_policies``) and chosen with
    ``--schedule-policy``. The Scheduler builds it once as ``cls(cache)``, with
    its prefix cache (to look up what each request would reuse: ``match_prefix``
    of ``admission_key(req)``), and calls ``order`` before each prefill selection.
    Admission then walks the queue in that order; the policy decides no more
    than the order.
    """

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def order(self, waiting: deque[Req]) -> None:
        """Reorder ``waiting`` in place (leave it as it is to admit in arrival order)."""
        raise NotImplementedError


class FcfsPolicy(SchedulePolicy):
    """``fcfs``: arrival order (a retracted request goes back to the front)."""

    def order(self, waiting: deque[Req]) -> None:
        """Keep the queue as it is."""


class LpmPolicy(SchedulePolicy):
    """``lpm``: longest cached prefix first, so that requests sharing a prefix run while it
    is still cached; ties keep arrival order, and long queues fall back to it."""

    def order(self, waiting: deque[Req]) -> None:
        """Sort ``waiting`` by cached prefix length, longest first."""
        if len(waiting) > LPM_QUEUE_LIMIT:
            return
        matched = {id(r): self.cache.match_prefix(admission_key(r)).length for r in waiting}
        ordered = sorted(waiting, key=lambda r: -matched[id(r)])
        waiting.clear()
        waiting.extend(ordered)


def admission_key(req: Req) -> list[int]:
    """The tokens whose cached prefix a request may reuse (``Req.prefix_limit``)."""
    return request_cache_key(req, req.prefix_limit())


class PrefillAdder:
    """Builds one prefill batch: admits requests while slots, the token budget and KV allow.

    ``reserved`` counts the KV slots already promised in this step: one per
    running request (its next decode token) and, per admitted request, its
    chunk plus one for its first decode.
    """

    def __init__(
        self,
        *,
        cache: PrefixCache,
        req_to_token_pool: ReqToTokenPool,
        token_budget: int,
        num_running: int,
        max_running_requests: int,
        uncached: list[Req] | None = None,
    ) -> None:
        self.cache = cache
        self.req_to_token_pool = req_to_token_pool
        self.token_budget = token_budget
        self.num_running = num_running
        self.max_running_requests = max_running_requests
        self.reserved = num_running
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        #: The request admitted with only part of what it has to prefill.
        self.chunked: Req | None = None
        #: Requests whose prefill is computing and not cached yet (overlap scheduling: a
        #: step in flight); a request sharing their prefix waits for it as for this step's.
        self.uncached = uncached or []

    def room(self) -> int:
        """KV slots still available for this step's prefills."""
        return self.cache.available_size() - self.reserved

    def add_chunked(self, req: Req) -> bool:
        """Continue a partly prefilled request (it holds its slots); False if no room now.

        Its next chunk may be smaller than the token budget when KV is short: it
        must not wait for a larger chunk while holding memory.
        """
        chunk = min(req.extend_remaining, self.token_budget, self.room() - 1)
        if chunk <= 0:
            return False
        self._take(req, chunk)
        return True

    def add(self, req: Req) -> Admission:
        """Admit a waiting request if it fits, defer it, or say that nothing more fits."""
        if self.token_budget <= 0 or self.chunked is not None:
            return Admission.FULL
        holders = self.num_running + len(self.reqs)
        if holders >= self.max_running_requests or self.req_to_token_pool.available_size() == 0:
            return Admission.FULL
        key = admission_key(req)
        match = self.cache.match_prefix(key)
        if self._shares_uncached_prefix(key, match.length):
            return Admission.DEFERRED
        self.cache.inc_lock_ref(match.last_node)  # before counting what is evictable
        extend = req.seq_len - match.length
        chunk = extend if req.is_embedding else min(extend, self.token_budget)
        embedding_too_big = req.is_embedding and chunk > self.token_budget and self.reqs
        slots = None if chunk + 1 > self.room() or embedding_too_big else (
            self.req_to_token_pool.alloc(1))
        if slots is None:
            self.cache.dec_lock_ref(match.last_node)
            return Admission.FULL
        req.req_pool_idx = slots[0]
        prefix_len = match.length
        self.req_to_token_pool.req_to_token[req.req_pool_idx, :prefix_len] = match.indices
        req.last_node = match.last_node
        req.kv_len = req.cache_protected_len = prefix_len
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = prefix_len
            req.queue_seconds = time.monotonic() - req.queued_at
        self._take(req, chunk)
        return Admission.ADDED

    def _shares_uncached_prefix(self, key: list[int], cached: int) -> bool:
        """Whether a request of this step shares ``key``'s prefix well past what is cached."""
        end = cached + IN_BATCH_SHARE_THRESHOLD
        if len(key) < end:
            return False
        head = key[:end]  # one slice comparison per request, in C
        return any(other.fill_ids[:end] == head for other in (*self.reqs, *self.uncached))

    def _take(self, req: Req, chunk: int) -> None:
        self.reqs.append(req)
        self.extend_lens.append(chunk)
        self.token_budget -= chunk
        self.reserved += chunk + 1
        if chunk < req.extend_remaining:
            self.chunked = req

    def batch(self) -> ScheduledBatch | None:
        """The prefill batch, or None when nothing was admitted."""
        if not self.reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, self.reqs, self.extend_lens)


def retraction_order(reqs: Iterable[Req]) -> list[Req]:
    """Requests in the order to retract them: least progress first.

    Fewest output tokens first (least work is redone), and among those the
    longest sequence first (it frees the most slots).
    """
    return sorted(reqs, key=lambda r: (len(r.output_ids), -r.seq_len))
