"""Where each unfinished request is, and every way out: finish, abort, fail, retract.

A request waits (``waiting``, holding no KV), is prefilled in chunks
(``chunked_req``, holding its slots between steps) or runs (``running``, decoding
together). Whatever way it leaves, its request row is freed and its KV goes to the
prefix cache (or back to the allocator, when the KV itself may be what went wrong).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from framework.messages import AbortReq, FinishReason
from framework.runtime.request import Req

if TYPE_CHECKING:
    from framework.constrained.manager import GrammarManager
    from framework.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from framework.mem_cache.prefix_cache import PrefixCache
    from framework.runtime.scheduler.output import OutputSender
    from framework.runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger("framework.scheduler")


class RequestQueues:
    """The Scheduler's requests by where they are, and the ways out of the queues."""

    def __init__(self, *, tree_cache: PrefixCache, req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator, grammars: GrammarManager,
                 stats: SchedulerStats, outputs: OutputSender) -> None:
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.grammars = grammars
        self.stats = stats
        self.outputs = outputs
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        #: The request being prefilled in chunks; it holds KV slots between steps.
        self.chunked_req: Req | None = None
        #: Requests that ended while a step in flight held them (overlap scheduling), with
        #: whether their own KV is to be discarded rather than cached: their slots are
        #: released once no step holds them (``release_retired``).
        self.retiring: list[tuple[Req, bool]] = []

    def all(self) -> list[Req]:
        """Every unfinished request: waiting, partly prefilled and running."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return [*self.waiting, *chunked, *self.running]

    def holders(self) -> list[Req]:
        """Every request that may hold slots: the unfinished ones and those retiring."""
        return [*self.all(), *(req for req, _ in self.retiring)]

    def holding_kv(self) -> list[Req]:
        """The requests that hold KV slots: the partly prefilled one and the running ones."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return [*chunked, *self.running]

    def adapters_holding_kv(self) -> set[str]:
        """The LoRA adapters of the requests that hold KV slots."""
        return {req.lora_name for req in self.holding_kv() if req.lora_name is not None}

    def abort(self, msg: AbortReq) -> None:
        """End the named request (or all) with an abort reason the client sees."""
        reason = FinishReason("abort", message=msg.reason)
        for req in self.all():
            if msg.abort_all or req.rid == msg.rid:
                self.stats.aborted_requests += 1
                self.end(req, reason)

    def end(self, req: Req, reason: FinishReason) -> None:
        """Finish ``req`` wherever it is and send its last output."""
        self.finish(req, reason)
        self.outputs.send([req])

    def fail(self, req: Req, exc: BaseException) -> None:
        """Finish ``req`` because handling it raised; its last output carries the error."""
        logger.error("request %s failed and was ended: %r", req.rid, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
        self.stats.failed_requests += 1
        # Its own KV past the cached prefix may be what went wrong: do not cache it.
        self.finish(req, FinishReason(
            "abort", message=f"internal error while serving this request: "
                             f"{type(exc).__name__}: {exc}"), discard_kv=True)

    def finish(self, req: Req, reason: FinishReason, discard_kv: bool = False) -> None:
        """Set the finish reason, free the slots and take ``req`` out of every queue.

        ``discard_kv``: free the request's own KV instead of caching it. While a step in
        flight holds the request, its slots wait for that step (``release_retired``).
        """
        req.finished_reason = reason
        self.grammars.release(req)  # a compile it alone waited for is abandoned
        req.grammar = None
        if req.in_flight:
            self.retiring.append((req, discard_kv))
        else:
            self.release(req, discard_kv)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def retract(self, req: Req) -> None:
        """Give back the KV and request slot of an unfinished request and queue it again.

        Its KV goes into the prefix cache, so a readmission reuses whatever is not
        evicted by then; its output so far is kept.
        """
        self.release(req)
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.retracted_requests += 1

    def release_retired(self) -> None:
        """Release the retiring requests that no step in flight holds any more."""
        done = [(req, discard) for req, discard in self.retiring if not req.in_flight]
        if not done:
            return
        self.retiring = [(req, discard) for req, discard in self.retiring if req.in_flight]
        for req, discard in done:
            self.release(req, discard)

    def release(self, req: Req, discard_kv: bool = False) -> None:
        """Hand the request's KV to the prefix cache (its own part freed instead, with
        ``discard_kv``) and free its request slot."""
        if req.req_pool_idx is None:
            return
        if discard_kv:
            self.discard_own_kv(req)
        self.tree_cache.cache_finished_req(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def discard_own_kv(self, req: Req) -> None:
        """Free the KV slots the request owns past its cached prefix, without caching them."""
        if req.req_pool_idx is None or req.kv_len <= req.cache_protected_len:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.allocator.free(row[req.cache_protected_len:req.kv_len].clone())
        req.kv_len = req.cache_protected_len
