"""What the Scheduler sends: token-id batches, embedding batches and metrics reports.

Pure builders over ``Req`` state: they know nothing of the Scheduler and send
nothing themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from framework.messages import BatchEmbeddingOutput, BatchTokenIDOutput, SchedulerMetrics
from framework.runtime.request import Req

#: Prompt ids sent as decoding context with a request's first output, so that its first
#: token decodes with the spacing it has after the prompt. The Scheduler's stop-string
#: matcher decodes with the same context, so both see the same text.
CONTEXT_IDS = 5


def context_ids(req: Req) -> list[int]:
    """The prompt ids a request's output is decoded after."""
    return req.origin_input_ids[-CONTEXT_IDS:]


def token_id_output(reqs: list[Req]) -> BatchTokenIDOutput:
    """Each request's ids since its last output (and marks them sent)."""
    out = BatchTokenIDOutput(
        rids=[], finished_reasons=[], output_ids=[], skip_special_tokens=[],
        spaces_between_special_tokens=[], no_stop_trim=[], prompt_tokens=[],
        completion_tokens=[], cached_tokens=[],
    )
    # Optional lists stay empty (not one empty list per request) when nobody needs them.
    with_logprobs = any(r.return_logprob for r in reqs)
    with_first = any(r.sent_len == 0 for r in reqs)
    for req in reqs:
        start = req.sent_len
        params = req.sampling_params
        out.rids.append(req.rid)
        out.finished_reasons.append(req.finished_reason)
        out.output_ids.append(req.output_ids[start:])
        out.skip_special_tokens.append(params.skip_special_tokens)
        out.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
        out.no_stop_trim.append(params.no_stop_trim)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        if with_logprobs:
            out.output_token_logprobs_val.append(req.output_logprobs[start:])
            out.output_token_logprobs_idx.append(
                req.output_ids[start:] if req.return_logprob else [])
            out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:])
            out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:])
        if with_first:
            first = req.sent_len == 0
            out.stop_strs.append(list(params.stop) if first else [])
            out.context_ids.append(context_ids(req) if first else [])
        req.sent_len = len(req.output_ids)
    return out


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
