"""A step's result applied to its requests: new tokens (with their logprobs and the
prompt's), stop checks, outputs sent, and prefills moved on to the running batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.messages import FinishReason
from framework.runtime.request import Req
from framework.runtime.scheduler.batch import ScheduledBatch
from framework.runtime.scheduler.worker import StepResult

if TYPE_CHECKING:
    import torch

    from framework.mem_cache.prefix_cache import PrefixCache
    from framework.runtime.scheduler.output import OutputSender
    from framework.runtime.scheduler.queues import RequestQueues
    from framework.runtime.scheduler.stats import SchedulerStats
    from framework.runtime.scheduler.step import PreparedStep


@dataclass
class PromptLogprobChunk:
    """The logprobs of some prompt positions of one request, with their top alternatives."""

    values: list[float]
    top_values: list[list[float]]
    top_ids: list[list[int]]


class ResultProcessor:
    """Applies each step's ``StepResult``; ``check_finished`` says when a token ends a
    request (the Scheduler's method, so that a subclass's override is the one asked)."""

    def __init__(self, *, queues: RequestQueues, tree_cache: PrefixCache,
                 outputs: OutputSender, stats: SchedulerStats,
                 check_finished: Callable[[Req], FinishReason | None]) -> None:
        self.queues = queues
        self.tree_cache = tree_cache
        self.outputs = outputs
        self.stats = stats
        self.check_finished = check_finished

    def apply(self, step: PreparedStep, result: StepResult) -> None:
        """Apply a successful step to its requests, then send outputs and move requests on.

        A request that ended after the step was launched (overlap scheduling: aborted,
        or stopped by the step before) takes nothing from it; its slots, kept while the
        step held it, are released once no step holds it.
        """
        batch = step.batch
        ended = [req.finished for req in batch.reqs]
        step.landed()
        for req, chunk in zip(batch.reqs, prompt_logprob_chunks(step.prompt_spans, result)):
            req.input_logprobs += chunk.values
            req.input_top_logprobs_val += chunk.top_values
            req.input_top_logprobs_idx += chunk.top_ids
        if result.embeddings is not None:
            self.finish_embeddings(batch, result.embeddings)
            return
        for k, i in enumerate(step.sampled):
            req = batch.reqs[i]
            if ended[i]:
                continue
            try:
                self.append_tokens(req, result, k, drafted=len(batch.drafted(i)))
            except Exception as exc:  # e.g. a tokenizer error while matching stop strings
                self.queues.fail(req, exc)
        due = [r for r, done in zip(batch.reqs, ended) if not done and r.output_due()]
        if due:
            self.outputs.send(due)
        if batch.mode.is_extend():
            for i, req in enumerate(batch.reqs):
                if req.finished or batch.decodes(i):  # a decode token: it runs already
                    continue
                # What the prefill computed is shared at once, before the request ends.
                self.tree_cache.cache_unfinished_req(req)
        if any(ended):
            self.queues.release_retired()

    def append_tokens(self, req: Req, result: StepResult, k: int, drafted: int = 0) -> None:
        """Add the ``k``-th sampling row's tokens to ``req``, up to the one that ends it.

        After a verify step (``drafted`` tokens fed after the last one), the KV of the
        drafts not kept is given back before the request can end.
        """
        if req.sampling_params.max_new_tokens == 0:
            self.queues.finish(req, FinishReason("length", length=0))
            return
        reason, appended = None, 0
        tokens = result.next_ids[k]
        if drafted:
            self.stats.count_verification(drafted, len(tokens) - 1)
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += len(tokens) - 1
        try:
            for j, token in enumerate(tokens):
                if req.grammar is not None and not req.grammar.accept_token(token):
                    raise RuntimeError(f"token {token} is not allowed by the request's grammar")
                req.output_ids.append(token)
                if req.return_logprob:
                    req.output_logprobs.append(result.logprobs[k][j])
                    req.output_top_logprobs_val.append(result.top_logprobs_val[k][j])
                    req.output_top_logprobs_idx.append(result.top_logprobs_idx[k][j])
                self.stats.generated_since_report += 1
                appended = j + 1
                reason = self.check_finished(req)
                if reason is not None:
                    break
        finally:
            if drafted:
                self.drop_unkept_kv(req, 1 + drafted - appended)
        if reason is not None:
            self.queues.finish(req, reason)

    def drop_unkept_kv(self, req: Req, count: int) -> None:
        """Free the KV slots of ``req``'s last ``count`` fed tokens (drafts rejected, or
        past the token that ended it): the cache holds only what its tokens are."""
        if count <= 0:
            return
        pool = self.tree_cache.req_to_token_pool
        end = req.kv_len
        req.kv_len -= count
        slots = pool.req_to_token[req.req_pool_idx, req.kv_len:end]
        self.tree_cache.allocator.free(slots)  # it copies them

    def finish_embeddings(self, batch: ScheduledBatch, embeddings: torch.Tensor) -> None:
        """Send pooled embeddings to the TokenizerManager and free the requests."""
        vectors = embeddings.float().cpu().numpy()  # [batch, hidden]
        for req in batch.reqs:
            req.finished_reason = FinishReason("stop")
            self.queues.release(req)
        self.outputs.send_embeddings(batch.reqs, vectors)


def prompt_logprob_chunks(spans: list[range], result: StepResult) -> list[PromptLogprobChunk]:
    """The step's prompt logprobs (one per position of ``spans``, in order), per request."""
    if not result.prompt_values:
        return []
    chunks, start = [], 0
    for span in spans:
        end = start + len(span)
        chunks.append(PromptLogprobChunk(result.prompt_values[start:end],
                                         result.prompt_top_values[start:end],
                                         result.prompt_top_ids[start:end]))
        start = end
    return chunks
