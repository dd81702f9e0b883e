"""Prometheus metrics of the TokenizerManager: request timings, token counters, load gauges.

The request-level numbers are measured here, in the main process, from the
TokenizerManager's own timestamps (arrival, each output, the end), because it
sees every output of every request whatever the number of Scheduler processes.
The load gauges are copied from the Scheduler's last ``SchedulerMetrics``.

What one request records (the rules the docs and tests rely on):

- ``time_to_first_token_seconds``: arrival → first output, once per request that
  got an output. A request that does not stream gets its only output when it
  finishes, so its TTFT equals its end-to-end latency.
- ``inter_token_latency_seconds``: for each output after the first, the time
  since the previous output divided by its new tokens, observed once per new
  token (as SGLang does): a request observes ``completion_tokens`` minus the
  tokens of its first output.
- ``time_per_output_token_seconds``: once per request with tokens after its
  first output: (last output − first output) / those tokens.
- ``e2e_request_latency_seconds``: arrival → end, once per request.
- ``queue_time_seconds``: measured by the Scheduler, from taking the request in
  to its first admission into a prefill batch, and sent with its first output;
  once per generation request that got an output (embedding requests are not
  counted).
- Counters: generation tokens as they arrive; prompt and cached tokens and the
  request (by finish reason) when it ends. A request whose caller left before
  its end counts as ``abort``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from framework.messages import SchedulerMetrics

PREFIX = "framework:"
FINISH_REASONS = ("stop", "length", "abort")

# Bucket bounds in seconds: fine where a healthy server lives, coarse in the tail.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                  0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                90.0, 120.0, 180.0, 300.0, 600.0)


@dataclass
class _Timing:
    """One request in flight, as the metrics see it."""

    arrival: float
    prompt_tokens: int
    first_output: float | None = None
    last_output: float | None = None
    first_tokens: int = 0  # tokens of the first output
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float | None = None  # as the Scheduler measured it


class RequestMetrics:
    """Every metric of one server in its own ``CollectorRegistry``, and what records them.

    The TokenizerManager calls ``request_started`` when it registers a request,
    ``output`` for each output (with the running token counts and the finish
    reason, if any) and ``request_released`` when it forgets the request. A
    registry per instance keeps several servers in one process apart.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self._open: dict[str, _Timing] = {}
        self._define_counters()
        self._define_histograms()
        self._define_gauges()

    def _define_counters(self) -> None:
        reg = self.registry
        # prometheus_client appends ``_total`` to a counter's name.
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of ended requests",
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Generated tokens, counted as they arrive", registry=reg)
        self.cached_tokens = Counter(PREFIX + "cached_tokens",
                                     "Prompt tokens of ended requests found in the prefix cache",
                                     registry=reg)
        self.num_requests = Counter(PREFIX + "num_requests", "Ended requests by finish reason",
                                    ["finish_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self.num_requests.labels(reason)  # every label shows, at 0, from the start

    def _define_histograms(self) -> None:
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival to first output", buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between outputs per new token, one observation per token",
                             buckets=_TOKEN_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "First to last output over the tokens after the first output",
                              buckets=_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to end",
                             buckets=_E2E_BUCKETS, registry=reg)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds",
                                    "Estimated wait before admission: TTFT minus one decode step",
                                    buckets=_TTFT_BUCKETS, registry=reg)

    def _define_gauges(self) -> None:
        reg = self.registry
        self.num_running_reqs = Gauge(PREFIX + "num_running_reqs",
                                      "Requests in the Scheduler's running batch", registry=reg)
        self.num_queue_reqs = Gauge(PREFIX + "num_queue_reqs",
                                    "Requests waiting for admission", registry=reg)
        self.token_usage = Gauge(PREFIX + "token_usage", "Used over total KV cache slots",
                                 registry=reg)
        self.cache_hit_rate = Gauge(PREFIX + "cache_hit_rate",
                                    "Cached over admitted prompt tokens in the last report window",
                                    registry=reg)
        self.spec_accept_length = Gauge(
            PREFIX + "spec_accept_length",
            "Speculative decoding: tokens a request gains per verify step, since start",
            registry=reg)
        self.spec_acceptance_rate = Gauge(
            PREFIX + "spec_acceptance_rate",
            "Speculative decoding: accepted over drafted tokens, since start", registry=reg)
        self.gen_throughput = Gauge(PREFIX + "gen_throughput",
                                    "Generated tokens per second in the last report window",
                                    registry=reg)
        # With --dp-size above 1 the gauges above sum the replicas; these show each one.
        self.replica_running_reqs = Gauge(PREFIX + "replica_num_running_reqs",
                                          "Requests in one replica's running batch",
                                          ["replica"], registry=reg)
        self.replica_queue_reqs = Gauge(PREFIX + "replica_num_queue_reqs",
                                        "Requests waiting for admission in one replica",
                                        ["replica"], registry=reg)
        self.replica_token_usage = Gauge(PREFIX + "replica_token_usage",
                                         "Used over total KV cache slots of one replica",
                                         ["replica"], registry=reg)

    # ------------------------------------------------------------------ recording

    def request_started(self, rid: str, prompt_tokens: int) -> None:
        """A request arrived (was registered) with ``prompt_tokens`` prompt tokens."""
        self._open[rid] = _Timing(arrival=self.clock(), prompt_tokens=prompt_tokens)

    def output(self, rid: str, completion_tokens: int, cached_tokens: int,
               finish_reason: str | None, queue_seconds: float | None = None) -> None:
        """An output of ``rid`` arrived: its token counts so far and its finish reason, if any.

        ``queue_seconds`` is the Scheduler's measure of the request's wait, with its
        first output (None where there is none, e.g. embeddings).
        """
        timing = self._open.get(rid)
        if timing is None:
            return  # not started here (or already ended): nothing to measure against
        if timing.queue_seconds is None:
            timing.queue_seconds = queue_seconds
        now = self.clock()
        new_tokens = max(completion_tokens - timing.completion_tokens, 0)
        self.generation_tokens.inc(new_tokens)
        if timing.first_output is None:
            timing.first_output = now
            timing.first_tokens = new_tokens
            self.ttft.observe(now - timing.arrival)
        elif new_tokens and timing.last_output is not None:
            per_token = (now - timing.last_output) / new_tokens
            for _ in range(new_tokens):
                self.itl.observe(per_token)
        timing.last_output = now
        timing.completion_tokens = max(completion_tokens, timing.completion_tokens)
        timing.cached_tokens = cached_tokens
        if finish_reason is not None:
            self._end(rid, finish_reason, now)

    def request_released(self, rid: str) -> None:
        """The TokenizerManager forgot ``rid``; one that has not ended counts as aborted."""
        if rid in self._open:
            self._end(rid, "abort", self.clock())

    def _end(self, rid: str, finish_reason: str, now: float) -> None:
        timing = self._open.pop(rid)
        self.prompt_tokens.inc(timing.prompt_tokens)
        self.cached_tokens.inc(timing.cached_tokens)
        reason = finish_reason if finish_reason in FINISH_REASONS else "abort"
        self.num_requests.labels(reason).inc()
        self.e2e.observe(now - timing.arrival)
        if timing.first_output is None or timing.last_output is None:
            return
        later_tokens = timing.completion_tokens - timing.first_tokens
        if later_tokens > 0:
            self.tpot.observe((timing.last_output - timing.first_output) / later_tokens)
        if timing.queue_seconds is not None:
            self.queue_time.observe(timing.queue_seconds)

    def scheduler_metrics(self, metrics: SchedulerMetrics) -> None:
        """Copy the Scheduler's load report into the gauges."""
        self.num_running_reqs.set(metrics.num_running_reqs)
        self.num_queue_reqs.set(metrics.num_waiting_reqs)
        self.token_usage.set(metrics.token_usage)
        self.cache_hit_rate.set(metrics.cache_hit_rate)
        self.gen_throughput.set(metrics.gen_throughput)
        self.spec_accept_length.set(metrics.spec_accept_length)
        self.spec_acceptance_rate.set(metrics.spec_acceptance_rate)

    def replica_metrics(self, index: int, metrics: SchedulerMetrics) -> None:
        """Copy data-parallel replica ``index``'s own load report into its labelled gauges."""
        replica = str(index)
        self.replica_running_reqs.labels(replica).set(metrics.num_running_reqs)
        self.replica_queue_reqs.labels(replica).set(metrics.num_waiting_reqs)
        self.replica_token_usage.labels(replica).set(metrics.token_usage)

    def render(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)


class NoMetrics:
    """Stands in for ``RequestMetrics`` when metrics are off: every call does nothing."""

    registry = None

    def request_started(self, rid: str, prompt_tokens: int) -> None:
        """Nothing to record."""

    def output(self, rid: str, completion_tokens: int, cached_tokens: int,
               finish_reason: str | None, queue_seconds: float | None = None) -> None:
        """Nothing to record."""

    def request_released(self, rid: str) -> None:
        """Nothing to record."""

    def scheduler_metrics(self, metrics: SchedulerMetrics) -> None:
        """Nothing to record."""

    def replica_metrics(self, index: int, metrics: SchedulerMetrics) -> None:
        """Nothing to record."""


def make_metrics(enabled: bool) -> RequestMetrics | NoMetrics:
    """The metrics of one TokenizerManager: real when ``enabled``, no-ops otherwise."""
    return RequestMetrics() if enabled else NoMetrics()
