"""``RequestMetrics`` with made-up timestamps, and the ``/metrics`` route's wiring.

A fake clock makes every observation exact, so each rule of
``framework/runtime/metrics.py`` is checked by its numbers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework.cli import build_parser
from framework.config import ServerArgs
from framework.messages import SchedulerMetrics
from framework.model_facts import ModelFacts
from framework.runtime.metrics import NoMetrics, RequestMetrics, make_metrics
from framework.server.app import ServerState, build_app


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(metrics: RequestMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text, by name and sorted labels."""
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: RequestMetrics, name: str, **labels: str) -> float:
    """One sample's value."""
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> RequestMetrics:
    return RequestMetrics(clock=clock)


def test_a_streamed_request_records_each_rule(metrics: RequestMetrics, clock: FakeClock) -> None:
    metrics.request_started("a", prompt_tokens=10)
    clock.now += 0.5  # TTFT 0.5 s
    metrics.output("a", completion_tokens=1, cached_tokens=4, finish_reason=None,
                   queue_seconds=0.125)
    clock.now += 0.2  # 2 tokens in 0.2 s: two ITL observations of 0.1 s
    metrics.output("a", completion_tokens=3, cached_tokens=4, finish_reason=None,
                   queue_seconds=9.0)  # only the first output's counts
    clock.now += 0.4  # 2 tokens in 0.4 s: two of 0.2 s; ends with length
    metrics.output("a", completion_tokens=5, cached_tokens=4, finish_reason="length")

    assert value(metrics, "framework:prompt_tokens_total") == 10
    assert value(metrics, "framework:generation_tokens_total") == 5
    assert value(metrics, "framework:cached_tokens_total") == 4
    assert value(metrics, "framework:num_requests_total", finish_reason="length") == 1
    assert value(metrics, "framework:num_requests_total", finish_reason="stop") == 0
    assert value(metrics, "framework:time_to_first_token_seconds_count") == 1
    assert value(metrics, "framework:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "framework:inter_token_latency_seconds_count") == 4
    assert value(metrics, "framework:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    # One TPOT: (last - first output) / tokens after the first = 0.6 / 4.
    assert value(metrics, "framework:time_per_output_token_seconds_count") == 1
    assert value(metrics, "framework:time_per_output_token_seconds_sum") == pytest.approx(0.15)
    assert value(metrics, "framework:e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    # Queue time: as the Scheduler measured it, with the first output.
    assert value(metrics, "framework:queue_time_seconds_count") == 1
    assert value(metrics, "framework:queue_time_seconds_sum") == pytest.approx(0.125)


def test_a_request_with_one_output_has_no_itl_nor_tpot(metrics: RequestMetrics,
                                                       clock: FakeClock) -> None:
    metrics.request_started("b", prompt_tokens=3)
    clock.now += 2.0
    metrics.output("b", completion_tokens=8, cached_tokens=0, finish_reason="stop",
                   queue_seconds=1.5)

    assert value(metrics, "framework:generation_tokens_total") == 8
    assert value(metrics, "framework:num_requests_total", finish_reason="stop") == 1
    assert value(metrics, "framework:time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value(metrics, "framework:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value(metrics, "framework:inter_token_latency_seconds_count") == 0
    assert value(metrics, "framework:time_per_output_token_seconds_count") == 0
    assert value(metrics, "framework:queue_time_seconds_sum") == pytest.approx(1.5)


def test_an_output_without_a_queue_time_observes_none(metrics: RequestMetrics,
                                                      clock: FakeClock) -> None:
    metrics.request_started("e", prompt_tokens=3)  # e.g. an embedding request
    clock.now += 0.5
    metrics.output("e", completion_tokens=0, cached_tokens=0, finish_reason="stop")
    assert value(metrics, "framework:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "framework:queue_time_seconds_count") == 0


def test_a_released_request_that_did_not_end_counts_as_abort(metrics: RequestMetrics,
                                                             clock: FakeClock) -> None:
    metrics.request_started("c", prompt_tokens=6)
    clock.now += 0.1
    metrics.output("c", completion_tokens=1, cached_tokens=2, finish_reason=None)
    clock.now += 0.3
    metrics.request_released("c")  # the client went away
    metrics.request_released("c")  # a second release changes nothing
    metrics.output("c", completion_tokens=3, cached_tokens=2, finish_reason="stop")  # late

    assert value(metrics, "framework:num_requests_total", finish_reason="abort") == 1
    assert value(metrics, "framework:num_requests_total", finish_reason="stop") == 0
    assert value(metrics, "framework:prompt_tokens_total") == 6
    assert value(metrics, "framework:cached_tokens_total") == 2
    assert value(metrics, "framework:generation_tokens_total") == 1
    assert value(metrics, "framework:e2e_request_latency_seconds_sum") == pytest.approx(0.4)


def test_a_request_released_before_any_output(metrics: RequestMetrics) -> None:
    metrics.request_started("d", prompt_tokens=2)
    metrics.request_released("d")
    assert value(metrics, "framework:num_requests_total", finish_reason="abort") == 1
    assert value(metrics, "framework:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "framework:time_to_first_token_seconds_count") == 0
    assert value(metrics, "framework:queue_time_seconds_count") == 0


def test_gauges_copy_the_scheduler_report(metrics: RequestMetrics) -> None:
    metrics.scheduler_metrics(SchedulerMetrics(
        num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=50, max_total_tokens=200,
        token_usage=0.25, gen_throughput=123.5, cache_hit_rate=0.75, timestamp=0.0))
    assert value(metrics, "framework:num_running_reqs") == 3
    assert value(metrics, "framework:num_queue_reqs") == 2
    assert value(metrics, "framework:token_usage") == 0.25
    assert value(metrics, "framework:gen_throughput") == 123.5
    assert value(metrics, "framework:cache_hit_rate") == 0.75


def test_two_instances_do_not_share_a_registry(clock: FakeClock) -> None:
    first, second = RequestMetrics(clock=clock), RequestMetrics(clock=clock)
    first.request_started("x", prompt_tokens=7)
    first.output("x", completion_tokens=1, cached_tokens=0, finish_reason="stop")
    assert value(first, "framework:prompt_tokens_total") == 7
    assert value(second, "framework:prompt_tokens_total") == 0


def test_the_flag_turns_metrics_on() -> None:
    assert isinstance(make_metrics(False), NoMetrics)
    assert isinstance(make_metrics(True), RequestMetrics)
    assert ServerArgs().enable_metrics is False
    ns = build_parser().parse_args(["serve", "--enable-metrics"])
    assert ServerArgs.from_cli_args(ns).enable_metrics is True


class StubManager:
    """Just what the two routes read from a TokenizerManager."""

    def __init__(self, enabled: bool) -> None:
        self.metrics = make_metrics(enabled)
        self.last_metrics = SchedulerMetrics(
            num_running_reqs=1, num_waiting_reqs=0, num_used_tokens=8, max_total_tokens=64,
            token_usage=0.125, gen_throughput=9.0, cache_hit_rate=0.5, timestamp=1.0)
        self.dead_reason = None

    async def get_scheduler_info(self) -> dict[str, Any]:
        return {"num_running_reqs": 1}


def get(enabled: bool, path: str) -> httpx.Response:
    """GET ``path`` from an app over a stub manager, with metrics on or off."""
    args = ServerArgs(enable_metrics=enabled)
    tm: Any = StubManager(enabled)
    app = build_app(ServerState(tokenizer_manager=tm, server_args=args, model_name="tiny",
                                model_path="unused",
                                model=ModelFacts(context_len=64, vocab_size=100,
                                                 is_embedding=False, hidden_size=32)))

    async def fetch() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(fetch())


def test_metrics_route_is_404_without_the_flag() -> None:
    assert get(False, "/metrics").status_code == 404


def test_metrics_route_serves_prometheus_text_with_the_flag() -> None:
    response = get(True, "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert {"framework:prompt_tokens", "framework:time_to_first_token_seconds",
            "framework:num_running_reqs"} <= names


def test_server_info_names_the_metrics_fields() -> None:
    metrics = get(False, "/get_server_info").json()["metrics"]
    assert metrics["num_running_reqs"] == 1
    assert metrics["token_usage"] == 0.125
    assert set(metrics) == set(SchedulerMetrics.__struct_fields__)

