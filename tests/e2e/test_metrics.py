"""``GET /metrics`` of a real server started with ``--enable-metrics``.

Three greedy requests with known token counts (one plain completion, two
native streams) must move every counter by exactly their tokens, and every
histogram by exactly its rule's number of observations (see
``framework/runtime/metrics.py``).
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework.messages import SchedulerMetrics
from tests.server_harness import ServerProcess, stream_events

PROMPT = "The scheduler picks which requests run next, and the tokenizer turns text into ids."
GAUGES = ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate",
          "gen_throughput")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


def scrape(server: ServerProcess) -> Samples:
    """Every sample of ``/metrics``, by name and sorted labels."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much the sample ``framework:<name>`` grew."""
    key = ("framework:" + name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_counters_and_histograms_move_by_exactly_the_requests(server: ServerProcess) -> None:
    before = scrape(server)
    prompt_tokens = cached_tokens = generated = itl_observations = 0

    # A plain completion: one output, so no ITL and no TPOT.
    done = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}, timeout=120).json()
    usage = done["usage"]
    assert done["choices"][0]["finish_reason"] == "length" and usage["completion_tokens"] == 5
    prompt_tokens += usage["prompt_tokens"]
    cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    generated += 5

    # Two streams: one ITL observation per token after the first output.
    with httpx.Client(base_url=server.base_url) as client:
        for max_tokens in (7, 9):
            events = stream_events(client, "/generate", {
                "text": PROMPT, "stream": True, "sampling_params": {
                    "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
            metas = [e["meta_info"] for e in events if e != "[DONE]"]
            assert len(metas) > 1 and metas[-1]["completion_tokens"] == max_tokens
            assert metas[-1]["finish_reason"]["type"] == "length"
            prompt_tokens += metas[-1]["prompt_tokens"]
            cached_tokens += metas[-1]["cached_tokens"]
            generated += max_tokens
            itl_observations += max_tokens - metas[0]["completion_tokens"]

    after = scrape(server)
    assert moved(before, after, "prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "generation_tokens_total") == generated == 21
    assert moved(before, after, "cached_tokens_total") == cached_tokens
    assert moved(before, after, "num_requests_total", finish_reason="length") == 3
    assert moved(before, after, "num_requests_total", finish_reason="stop") == 0
    assert moved(before, after, "num_requests_total", finish_reason="abort") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "queue_time_seconds"):
        assert moved(before, after, name + "_count") == 3, name
        assert moved(before, after, name + "_sum") > 0, name
    assert itl_observations > 0
    assert moved(before, after, "inter_token_latency_seconds_count") == itl_observations
    assert moved(before, after, "time_per_output_token_seconds_count") == 2
    for gauge in GAUGES:
        assert ("framework:" + gauge, ()) in after, gauge


def test_server_info_names_the_last_scheduler_metrics(server: ServerProcess) -> None:
    # The Scheduler reports about once a second; a generous liveness bound only.
    deadline = time.monotonic() + 60
    metrics = None
    while metrics is None and time.monotonic() < deadline:
        metrics = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["metrics"]
        if metrics is None:
            time.sleep(0.2)
    assert isinstance(metrics, dict)
    assert set(metrics) == set(SchedulerMetrics.__struct_fields__)
    assert metrics["max_total_tokens"] > 0
    gauges = scrape(server)
    assert all(("framework:" + g, ()) in gauges for g in GAUGES)
