"""The Scheduler's counters, behind its periodic ``SchedulerMetrics`` and ``/get_server_info``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from framework.messages import SchedulerMetrics


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
    # Speculative decoding: request-steps that verified drafts, the tokens drafted for
    # them and those accepted.
    spec_verifications: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0

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

    def count_verification(self, drafted: int, accepted: int) -> None:
        """One request's verify step: ``drafted`` tokens, ``accepted`` of them taken."""
        self.spec_verifications += 1
        self.spec_drafted_tokens += drafted
        self.spec_accepted_tokens += accepted

    @property
    def spec_accept_length(self) -> float:
        """Tokens a request gains per verify step: accepted drafts plus the target's own."""
        return 1.0 + self.spec_accepted_tokens / max(self.spec_verifications, 1)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens since start."""
        return self.spec_accepted_tokens / max(self.spec_drafted_tokens, 1)

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
            spec_accept_length=self.spec_accept_length if self.spec_verifications else 0.0,
            spec_acceptance_rate=self.spec_acceptance_rate,
        )
        self.last_report = now
        self.generated_since_report = 0
        self.prompt_tokens_since_report = 0
        self.cached_tokens_since_report = 0
        return metrics
