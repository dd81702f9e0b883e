"""One model step: its KV slots allocated, its ``WorkerBatch`` built, the worker run,
the result applied; a failure ends only the request that caused it.

When a step of several requests raises, it is run again request by request (each
alone) to find the one at fault: that one ends with an error reason its client
sees, the others carry on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from framework.runtime.scheduler.batch import ScheduledBatch
from framework.runtime.scheduler.worker import StepResult, WorkerBatch

if TYPE_CHECKING:
    from framework.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from framework.mem_cache.prefix_cache import PrefixCache
    from framework.runtime.scheduler.overlap import OverlapWorker
    from framework.runtime.scheduler.queues import RequestQueues
    from framework.runtime.scheduler.results import ResultProcessor
    from framework.runtime.scheduler.sampling import SamplingPreparer
    from framework.runtime.scheduler.stats import SchedulerStats
    from framework.runtime.scheduler.worker import ModelWorker

logger = logging.getLogger("framework.scheduler")


@dataclass
class PreparedStep:
    """A step ready for the worker, with what the Scheduler needs back when it returns."""

    batch: ScheduledBatch
    work: WorkerBatch
    out_cache_loc: torch.Tensor  # the step's new KV slots, freed again if it fails
    sampled: list[int]  # the batch rows that sample a token
    #: Per request, the prompt positions whose logprobs the step computes.
    prompt_spans: list[range]

    def launched(self, placeholders: list[int] | None = None) -> None:
        """Count the step in its requests as it goes to the worker: its new tokens as
        computed, and a token to come for each sampling row (named by ``placeholders``,
        one per row, where a later step is built before this one's result)."""
        for req, n in zip(self.batch.reqs, self.batch.extend_lens):
            req.kv_len += n
            req.in_flight += 1
        for k, i in enumerate(self.sampled):
            req = self.batch.reqs[i]
            req.unapplied += 1
            if placeholders is not None:
                req.future_token = placeholders[k]

    def prompts_completed(self) -> list[int]:
        """Rows whose prompt the step completes and that go on decoding (not embeddings,
        which end with the step)."""
        if self.work.sampling is None or not self.batch.mode.is_extend():
            return []
        return [i for i in self.sampled if not self.batch.decodes(i)]

    def landed(self) -> None:
        """The step's result is being applied: it no longer holds its requests."""
        for req in self.batch.reqs:
            req.in_flight -= 1
        for i in self.sampled:
            self.batch.reqs[i].unapplied -= 1

    def taken_back(self) -> None:
        """The step failed or was dropped: its requests are as they were before it."""
        self.landed()
        for req, n in zip(self.batch.reqs, self.batch.extend_lens):
            req.kv_len -= n


@dataclass
class InFlightStep:
    """A step launched on the ``OverlapWorker``, and its result to come."""

    step: PreparedStep
    future: Future[StepResult]


class StepExecutor:
    """Runs scheduled batches on the worker and applies their results.

    ``run`` does a whole step at once. With overlap scheduling (``overlap``, the
    worker's own ``OverlapWorker``), ``launch`` hands a prepared step to the worker's
    thread and returns, and ``land`` applies it later.
    """

    def __init__(self, *, worker: ModelWorker, tree_cache: PrefixCache,
                 req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 sampling: SamplingPreparer, results: ResultProcessor, queues: RequestQueues,
                 stats: SchedulerStats, is_embedding: bool,
                 overlap: OverlapWorker | None = None) -> None:
        self.worker = worker
        self.overlap = overlap
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.sampling = sampling
        self.results = results
        self.queues = queues
        self.stats = stats
        self.is_embedding = is_embedding
        #: Steps run so far, by kind (``extend``, ``decode``, ``verify``: a decode step
        #: with drafts).
        self.steps = {"extend": 0, "decode": 0, "verify": 0}

    def run(self, batch: ScheduledBatch) -> None:
        """Run one model step for ``batch``; a failure ends only the request that caused it."""
        self.steps["verify" if batch.drafts else batch.mode.name.lower()] += 1
        try:
            step = self.prepare(batch)
            self.start(step)
            result = self.execute(step)
        except Exception as exc:
            self.contain(batch, exc)
            return
        self.results.apply(step, result)

    def contain(self, batch: ScheduledBatch, exc: Exception) -> None:
        """End the request of ``batch`` at fault for ``exc`` (its step retried one by one)."""
        batch = batch.without_finished()
        if not batch.reqs:
            return
        if len(batch.reqs) == 1:
            self.queues.fail(batch.reqs[0], exc)
            self.queues.outputs.send(batch.reqs)
            return
        logger.warning("a %s step of %d requests failed (%r); retrying them one by one",
                       batch.mode.name.lower(), len(batch.reqs), exc)
        for i in range(len(batch.reqs)):
            self.run(batch.subset(i))

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """Allocate the step's KV slots and build what the worker runs; no request changes.

        Raises when no slot is left or building fails (the slots are given back then).
        """
        out_cache_loc = self.tree_cache.alloc(batch.num_tokens)
        if out_cache_loc is None:
            raise RuntimeError(f"no KV slot left for a step of {batch.num_tokens} tokens")
        try:
            forward_batch = batch.to_forward_batch(
                self.req_to_token_pool.req_to_token, out_cache_loc, self.worker.device)
            forward_batch.lora_in_use = sorted(self.queues.adapters_holding_kv()) or None
            # Requests whose prompt is then fully in the cache sample a token; a partial
            # chunk does not (its logits are for a token in the middle of the prompt).
            sampled = [i for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens))
                       if req.kv_len + n - len(batch.drafted(i)) == req.seq_len]
            spans = batch.prompt_logprob_spans()
            sampling = None if self.is_embedding else self.sampling.request(
                batch, sampled, spans, self.worker.sampling_device)
        except BaseException:
            self.allocator.free(out_cache_loc)
            raise
        drafts = None if batch.drafts is None else [batch.drafted(i) for i in sampled]
        return PreparedStep(batch, WorkerBatch(forward_batch, sampling, drafts=drafts),
                            out_cache_loc, sampled, spans)

    def execute(self, step: PreparedStep) -> StepResult:
        """Run ``step`` on the worker; on failure it is taken back (it can be retried)."""
        try:
            result = self.worker.forward_step(step.work)
        except BaseException:
            self.take_back(step)
            raise
        self.stats.forward_seconds += result.forward_seconds
        return result

    def start(self, step: PreparedStep, placeholders: list[int] | None = None) -> None:
        """Count ``step`` in its requests as it goes to the worker; a prefill that completes
        a prompt puts its request in the running batch at once (its first token to come),
        so that the next step, built before this one's result, decodes it."""
        step.launched(placeholders)
        for i in step.prompts_completed():
            self.queues.running.append(step.batch.reqs[i])

    def take_back(self, step: PreparedStep) -> None:
        """Undo a step that failed or is dropped: its requests as before, its slots freed."""
        for i in step.prompts_completed():
            req = step.batch.reqs[i]
            if req in self.queues.running:
                self.queues.running.remove(req)
        step.taken_back()
        self.allocator.free(step.out_cache_loc)
        self.queues.release_retired()

    def launch(self, step: PreparedStep) -> InFlightStep:
        """Hand ``step`` to the worker's thread; it runs after the steps launched before."""
        assert self.overlap is not None, "launching needs the overlap worker"
        self.steps[step.batch.mode.name.lower()] += 1
        numbers = self.overlap.reserve(len(step.sampled))
        step.work.future_slots = numbers
        self.start(step, [self.overlap.placeholder(n) for n in numbers])
        return InFlightStep(step, self.overlap.launch(step.work))

    def land(self, flight: InFlightStep, after: InFlightStep | None) -> bool:
        """Wait for ``flight`` and apply its result.

        If it failed, ``after`` (launched since, on the tokens ``flight`` was to give)
        is waited for and dropped, and ``flight``'s requests are retried one by one to
        find the one at fault. Returns whether ``after`` still stands.
        """
        try:
            result = flight.future.result()
        except Exception as exc:
            if after is not None:
                self.drop(after)
            self.take_back(flight.step)
            self.contain(flight.step.batch, exc)
            return False
        self.stats.forward_seconds += result.forward_seconds
        self.results.apply(flight.step, result)
        return True

    def drop(self, flight: InFlightStep) -> None:
        """Wait for ``flight`` to end, whatever it gives, and take it back."""
        try:
            flight.future.result()
        except Exception:  # its error is the earlier step's doing: that one is contained
            logger.debug("a step launched after a failed one was dropped", exc_info=True)
        self.take_back(flight.step)
