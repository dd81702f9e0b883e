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
