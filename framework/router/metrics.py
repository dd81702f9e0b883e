"""The router's Prometheus metrics, in a registry of its own (never the process-wide one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from framework.router.policies import Choice
from framework.router.workers import WorkerSet


class RouterMetrics:
    """Requests, errors and retries by route; load and prefix hits by worker."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("router_requests", "Requests sent to a worker.",
                                ["route", "worker"], registry=r)
        self.errors = Counter("router_errors", "Requests answered with an error by the router.",
                              ["route", "reason"], registry=r)
        self.retries = Counter("router_retries", "Requests sent again to another worker.",
                               ["route"], registry=r)
        self.in_flight = Gauge("router_worker_in_flight", "Requests in flight per worker.",
                               ["worker"], registry=r)
        self.healthy = Gauge("router_worker_healthy", "1 while a worker passes its checks.",
                             ["worker"], registry=r)
        self.prompt_chars = Counter("router_prompt_chars", "Prompt characters routed.",
                                    ["worker"], registry=r)
        self.matched_chars = Counter("router_prefix_match_chars",
                                     "Prompt characters matched by the worker's prefix tree.",
                                     ["worker"], registry=r)
        self.hit_rate = Gauge("router_prefix_hit_rate",
                              "Matched over routed prompt characters, per worker.",
                              ["worker"], registry=r)
        self.choices = Counter("router_choices", "Workers chosen, by the policy's reason.",
                               ["worker", "reason"], registry=r)
        # worker -> [prompt chars, matched chars], the hit rate's terms
        self._chars: dict[str, list[int]] = {}

    def routed(self, route: str, choice: Choice, prompt_chars: int) -> None:
        """Count a request routed to ``choice.worker``."""
        url = choice.worker.url
        self.requests.labels(route, url).inc()
        self.choices.labels(url, choice.reason).inc()
        self.prompt_chars.labels(url).inc(prompt_chars)
        self.matched_chars.labels(url).inc(choice.matched_chars)
        totals = self._chars.setdefault(url, [0, 0])
        totals[0] += prompt_chars
        totals[1] += choice.matched_chars
        if totals[0]:
            self.hit_rate.labels(url).set(totals[1] / totals[0])

    def render(self, workers: WorkerSet) -> bytes:
        """The text exposition, with the per-worker gauges read now."""
        for worker in workers.active():
            self.in_flight.labels(worker.url).set(worker.in_flight)
            self.healthy.labels(worker.url).set(int(worker.healthy))
        return generate_latest(self.registry)
