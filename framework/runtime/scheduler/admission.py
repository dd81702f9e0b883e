"""Admission and retraction: which waiting requests join a prefill, and which running
ones give their KV back when the next decode step would not fit.

The policy (``policy.py``) orders the queue and checks what fits; this part walks the
queue with it, waits for grammars still compiling, and keeps the step's statistics.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from framework.lora.names import adapters_per_batch
from framework.messages import FinishReason
from framework.runtime.request import Req
from framework.runtime.scheduler.batch import ScheduledBatch
from framework.runtime.scheduler.policy import (
    Admission,
    PrefillAdder,
    SchedulePolicy,
    retraction_order,
)

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.constrained.manager import GrammarManager
    from framework.mem_cache.memory_pool import ReqToTokenPool
    from framework.mem_cache.prefix_cache import PrefixCache
    from framework.runtime.scheduler.queues import RequestQueues
    from framework.runtime.scheduler.stats import SchedulerStats

logger = logging.getLogger("framework.scheduler")


class Admitter:
    """Builds prefill batches from the waiting queue and makes room for decode steps."""

    def __init__(self, *, server_args: ServerArgs, queues: RequestQueues,
                 policy: SchedulePolicy, tree_cache: PrefixCache,
                 req_to_token_pool: ReqToTokenPool, grammars: GrammarManager,
                 stats: SchedulerStats) -> None:
        self.server_args = server_args
        self.queues = queues
        self.policy = policy
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.grammars = grammars
        self.stats = stats
        self.max_adapters = adapters_per_batch(server_args.max_loras_per_batch,
                                               server_args.max_loaded_loras,
                                               server_args.lora_paths)

    def select_prefill(self, uncached: list[Req] | None = None) -> ScheduledBatch | None:
        """The partly prefilled request first, then waiting requests in the policy's order.

        ``uncached``: requests whose prefill is computing in a step not applied yet;
        those sharing a long prefix with one wait for it to be cached.
        """
        queues = self.queues
        if queues.chunked_req is None and not queues.waiting:
            return None
        self.policy.order(queues.waiting)
        budget = self.server_args.chunked_prefill_size
        if self.server_args.enable_mixed_chunk:
            budget -= len(queues.running)  # the step's decode tokens count against it too
        adder = PrefillAdder(
            cache=self.tree_cache, req_to_token_pool=self.req_to_token_pool,
            token_budget=budget, num_running=len(queues.running),
            max_running_requests=self.server_args.max_running_requests, uncached=uncached,
        )
        if queues.chunked_req is not None and not adder.add_chunked(queues.chunked_req):
            return None  # it goes first; wait until running requests free KV
        deferred: list[Req] = []
        adapters = self.adapters_in_use(uncached or [])
        while queues.waiting:
            req = queues.waiting.popleft()
            if not self.grammar_ready(req):
                if not req.finished:
                    deferred.append(req)  # its grammar is compiling; the others go on
                continue
            if not self.adapter_fits(req, adapters):
                deferred.append(req)  # waits for a running adapter's requests to end
                continue
            first = not req.admitted
            admission = adder.add(req)
            if admission is Admission.FULL:
                queues.waiting.appendleft(req)
                break
            if admission is Admission.DEFERRED:
                deferred.append(req)
                continue
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            if first:
                self.stats.count_admission(len(req.origin_input_ids), req.cached_tokens)
        queues.waiting.extendleft(reversed(deferred))
        queues.chunked_req = adder.chunked
        return adder.batch()

    def adapters_in_use(self, in_flight: list[Req]) -> set[str]:
        """The LoRA adapters of the requests that hold KV and of those whose prefill is in
        flight: they all decode in one step with the requests admitted now."""
        return self.queues.adapters_holding_kv() | {
            req.lora_name for req in in_flight if req.lora_name is not None}

    def adapter_fits(self, req: Req, adapters: set[str]) -> bool:
        """Whether ``req`` keeps a step within ``--max-loras-per-batch`` distinct adapters."""
        name = req.lora_name
        return name is None or name in adapters or len(adapters) < self.max_adapters

    def grammar_ready(self, req: Req) -> bool:
        """Whether ``req``'s grammar (if any) is compiled; one that fails to compile ends it."""
        try:
            return self.grammars.ready(req)
        except Exception as exc:  # the edge validates first; this is the last line
            self.queues.end(req, FinishReason("abort", message=str(exc)))
            return False

    def make_room_for_decode(self) -> None:
        """Retract requests, least progress first, until every running one gets a KV slot.

        The partly prefilled request is a candidate too: its slots count as much.
        """
        queues = self.queues
        while self.tree_cache.available_size() < len(queues.running):
            # A lone running request always fits: its length is capped by the pool.
            victims = [r for r in retraction_order(queues.holding_kv())
                       if r is queues.chunked_req or len(queues.running) > 1]
            if not victims:
                for req in list(queues.running):  # cannot happen by construction; never crash
                    queues.end(req, FinishReason(
                        "abort", message="internal error: no KV slot left for decoding"))
                return
            queues.retract(victims[0])
            logger.info("retracted %s to free KV cache", victims[0].rid)
