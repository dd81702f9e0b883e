"""What the Scheduler sends: token-id batches, embedding batches and metrics reports.

Pure builders over ``Req`` state: they know nothing of the Scheduler and send
nothing themselves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from framework.messages import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    PromptLogprobs,
    RequestConstants,
    SchedulerMetrics,
)
from framework.runtime.request import Req

#: Prompt ids sent as decoding context with a request's first output, so that its first
#: token decodes with the spacing it has after the prompt. The Scheduler's stop-string
#: matcher decodes with the same context, so both see the same text.
CONTEXT_IDS = 5


def context_ids(req: Req) -> list[int]:
    """The prompt ids a request's output is decoded after."""
    return req.origin_input_ids[-CONTEXT_IDS:]


def request_constants(req: Req) -> RequestConstants:
    """What the Detokenizer keeps for ``req``: sent with its first output only."""
    params = req.sampling_params
    return RequestConstants(
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        no_stop_trim=params.no_stop_trim,
        stop_strs=list(params.stop),
        context_ids=context_ids(req),
        prompt_tokens=len(req.origin_input_ids),
        cached_tokens=req.cached_tokens,
        queue_seconds=req.queue_seconds,
    )


def prompt_logprobs(req: Req) -> PromptLogprobs:
    """The logprobs of ``req``'s prompt from its ``logprob_start_len`` (sent once)."""
    start = req.logprob_start_len
    head = 1 if start == 0 else 0  # position 0: no logprob, no alternatives
    return PromptLogprobs(
        start=start,
        token_ids=req.origin_input_ids[start:],
        values=[None] * head + req.input_logprobs,
        top_values=[[]] * head + req.input_top_logprobs_val,
        top_ids=[[]] * head + req.input_top_logprobs_idx,
    )


def _uniform(offsets: list[int]) -> bool:
    """Whether ``offsets`` (from 0, one more than requests) give each request as many ids."""
    if len(offsets) < 2:
        return False
    step = offsets[1]
    return all(end - start == step for start, end in pairwise(offsets))


def token_id_output(reqs: list[Req]) -> BatchTokenIDOutput:
    """Each request's ids since its last output (and marks them sent).

    The ids go out as one flat array with offsets, or without offsets when every
    request has as many new ids (the usual decode step); a request's constants go
    with its first output only, and finish reasons only for those that finished.
    Completion counts are not sent: the Detokenizer counts the ids.
    """
    logprobs, top_val, top_idx = (
        _logprobs(reqs) if any(r.return_logprob for r in reqs) else (None, [], []))
    ids: list[int] = []
    offsets = [0]
    new_indices: list[int] = []
    new_constants: list[RequestConstants] = []
    finished_indices: list[int] = []
    finished_reasons: list[FinishReason] = []
    prompt_indices: list[int] = []
    prompts: list[PromptLogprobs] = []
    for i, req in enumerate(reqs):
        if req.sent_len == 0:
            new_indices.append(i)
            new_constants.append(request_constants(req))
            if req.wants_prompt_logprobs:
                prompt_indices.append(i)
                prompts.append(prompt_logprobs(req))
        if req.finished_reason is not None:
            finished_indices.append(i)
            finished_reasons.append(req.finished_reason)
        ids += req.output_ids[req.sent_len:]
        offsets.append(len(ids))
        req.sent_len = len(req.output_ids)
    return BatchTokenIDOutput(
        # Handles, not rids: one small array instead of a string per request every step.
        handles=np.array([r.handle for r in reqs], dtype=np.int64),
        # int32 holds any token id (vocabularies are far below 2**31) and any count here.
        output_ids=np.array(ids, dtype=np.int32),
        # None: as many new ids for every request, the offsets say nothing.
        output_offsets=None if _uniform(offsets) else np.array(offsets, dtype=np.int32),
        finished_indices=finished_indices,
        finished_reasons=finished_reasons,
        new_indices=new_indices,
        new_constants=new_constants,
        output_token_logprobs=logprobs,
        output_top_logprobs_val=top_val,
        output_top_logprobs_idx=top_idx,
        prompt_logprob_indices=prompt_indices,
        prompt_logprobs=prompts,
    )


def _logprobs(reqs: list[Req]) -> tuple[np.ndarray, list[list[float]], list[list[int]]]:
    """The unsent ids' logprobs and top logprobs, aligned with them (placeholders if not asked)."""
    values: list[float] = []
    top_val: list[list[float]] = []
    top_idx: list[list[int]] = []
    for req in reqs:
        start = req.sent_len
        if req.return_logprob:
            values += req.output_logprobs[start:]
            top_val += req.output_top_logprobs_val[start:]
            top_idx += req.output_top_logprobs_idx[start:]
        else:
            count = len(req.output_ids) - start
            values += [math.nan] * count
            top_val += [[] for _ in range(count)]
            top_idx += [[] for _ in range(count)]
    return np.array(values, dtype=np.float32), top_val, top_idx


def embedding_output(reqs: list[Req], vectors: np.ndarray | None = None) -> BatchEmbeddingOutput:
    """The embeddings of finished requests (``vectors`` row ``i`` for ``reqs[i]``).

    Without ``vectors`` (requests that ended without running) the array has no columns.
    """
    if vectors is None:
        vectors = np.zeros((len(reqs), 0), dtype=np.float32)
    return BatchEmbeddingOutput(
        rids=[r.rid for r in reqs],
        finished_reasons=[r.finished_reason for r in reqs],
        embeddings=vectors,
        prompt_tokens=[len(r.origin_input_ids) for r in reqs],
    )


@dataclass
class SchedulerStats:
    """Counters behind the periodic ``SchedulerMetrics`` and ``get_server_info``."""

    started: float = field(default_factory=time.monotonic)
    last_report: float = 0.0
    generated_since_report: int = 0
    prompt_tokens_since_report: int = 0
    cached_tokens_since_report: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    retracted_requests: int = 0
    step_seconds: float = 0.0  # steps that ran a batch, from intake to outputs sent
    forward_seconds: float = 0.0  # their model forwards

    @property
    def non_model_fraction(self) -> float:
        """The share of step time spent outside the model forward."""
        if self.step_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.forward_seconds / self.step_seconds)

    def count_admission(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first admission: its prompt and how much of it was cached."""
        self.prompt_tokens_since_report += prompt_tokens
        self.cached_tokens_since_report += cached_tokens
        self.prompt_tokens_total += prompt_tokens
        self.cached_tokens_total += cached_tokens

    def since_last_report(self) -> float:
        """Seconds since the last report (or since start)."""
        return time.monotonic() - (self.last_report or self.started)

    @property
    def cache_hit_rate(self) -> float:
        """Cached over admitted prompt tokens since start."""
        return self.cached_tokens_total / max(self.prompt_tokens_total, 1)

    def report(
        self, *, num_running: int, num_waiting: int, used_tokens: int, max_total_tokens: int
    ) -> SchedulerMetrics:
        """A metrics message for the time since the last report (and restart the window)."""
        now = time.monotonic()
        elapsed = self.since_last_report()
        window_hit_rate = self.cached_tokens_since_report / max(
            self.prompt_tokens_since_report, 1)
        metrics = SchedulerMetrics(
            num_running_reqs=num_running, num_waiting_reqs=num_waiting,
            num_used_tokens=used_tokens, max_total_tokens=max_total_tokens,
            token_usage=used_tokens / max(max_total_tokens, 1),
            gen_throughput=self.generated_since_report / max(elapsed, 1e-9),
            cache_hit_rate=window_hit_rate, timestamp=time.time(),
        )
        self.last_report = now
        self.generated_since_report = 0
        self.prompt_tokens_since_report = 0
        self.cached_tokens_since_report = 0
        return metrics
