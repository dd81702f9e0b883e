"""``framework serve --dp-size 2``: two scheduler replicas behind one HTTP front.

Under both balance methods: one replica's greedy tokens, both replicas serve,
an abort (a client that goes away, or ``/abort_request``) reaches the replica
holding the request and frees its KV slots there, and ``/flush_cache`` and
``/update_weights_from_disk`` answer for every replica.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework import Engine
from tests.server_harness import (
    ServerProcess,
    SharedPool,
    http_client,
    scheduler_info,
    sse_events,
    start_server,
    wait_until_idle,
)

PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(20)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
# Long enough to be still running when the test aborts it (the context is 8192).
LONG = {"temperature": 0.0, "max_new_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", seed=11, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def other_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    """The same shapes as ``model_dir``, other weights."""
    return tiny_checkpoint("llama", seed=12, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """One replica's greedy tokens for every prompt."""
    with Engine(model_path=str(model_dir), launch_mode="thread", log_level="warning") as engine:
        return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=["round_robin", "shortest_queue"])
def server(request: pytest.FixtureRequest, model_dir: Path,
           shared: SharedPool) -> Iterator[ServerProcess]:
    with shared.server(model_dir, "--dp-size", "2", "--load-balance-method", request.param,
                       "--enable-metrics") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=120)


def replicas(client: httpx.Client) -> list[dict[str, Any]]:
    """Each replica's part of ``/get_server_info``."""
    return scheduler_info(client)["replicas"]


def test_greedy_tokens_match_one_replica_and_both_replicas_serve(
    server: ServerProcess, client: httpx.Client, reference: list[list[int]],
) -> None:
    before = [r["load"]["routed_requests"] for r in replicas(client)]
    outputs = client.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
    assert outputs.status_code == 200, outputs.text
    assert [o["output_ids"] for o in outputs.json()] == reference
    info = wait_until_idle(client)
    assert info["dp_size"] == 2
    assert info["load_balance_method"] in server.args
    after = info["replicas"]
    routed = [r["load"]["routed_requests"] - b for r, b in zip(after, before)]
    assert all(count > 0 for count in routed), routed
    assert sum(routed) == len(PROMPTS)
    assert all(r["extend_steps"] > 0 for r in after)  # each ran prefills itself
    assert after[0]["pid"] != after[1]["pid"]


def _holder(client: httpx.Client) -> int:
    """The one replica with a request in flight."""
    loads = [r["load"]["in_flight_requests"] for r in replicas(client)]
    assert sorted(loads) == [0, 1], loads
    return loads.index(1)


def _aborted(client: httpx.Client) -> list[int]:
    return [r["aborted_requests"] for r in replicas(client)]


def _assert_only_holder_aborted(client: httpx.Client, before: list[int], holder: int) -> None:
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    for replica in info["replicas"]:
        assert replica["kv_cache_idle_and_free"] is True, replica  # the idle invariant, each
        assert replica["num_running_reqs"] == 0 and replica["load"]["in_flight_requests"] == 0
    grew = [a - b for a, b in zip(_aborted(client), before)]
    assert grew == [1 if i == holder else 0 for i in range(2)], grew


def test_a_client_that_goes_away_aborts_its_request_on_its_replica(
    client: httpx.Client,
) -> None:
    wait_until_idle(client)
    before = _aborted(client)
    body = {"text": "hello", "sampling_params": LONG, "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        events = sse_events(response)  # kept: a dropped generator would close the stream
        assert next(events)["meta_info"]["finish_reason"] is None  # running
        holder = _holder(client)
        assert replicas(client)[holder]["num_running_reqs"] == 1
    # The stream is closed: the server aborts the request in the replica that holds it.
    _assert_only_holder_aborted(client, before, holder)


def test_abort_request_by_id_reaches_its_replica(client: httpx.Client) -> None:
    wait_until_idle(client)
    before = _aborted(client)
    body = {"text": "hello", "sampling_params": LONG, "stream": True, "rid": "dp-abort"}
    with client.stream("POST", "/generate", json=body) as response:
        events = sse_events(response)
        assert next(events)["meta_info"]["finish_reason"] is None
        holder = _holder(client)
        assert client.post("/abort_request", json={"rid": "dp-abort"}).json()["success"]
        finishes = [e["meta_info"]["finish_reason"] for e in events if e != "[DONE]"]
        assert finishes[-1]["type"] == "abort"
    _assert_only_holder_aborted(client, before, holder)


def test_shortest_queue_routes_around_a_long_request(server: ServerProcess,
                                                     client: httpx.Client) -> None:
    if "shortest_queue" not in server.args:
        pytest.skip("round robin does not look at the load")
    wait_until_idle(client)
    before = [r["load"]["routed_requests"] for r in replicas(client)]
    body = {"text": "hello", "sampling_params": LONG, "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        events = sse_events(response)
        assert next(events)["meta_info"]["finish_reason"] is None
        holder = _holder(client)
        short = client.post("/generate", json={"text": PROMPTS[:4], "sampling_params": GREEDY})
        assert short.status_code == 200, short.text
        after = [r["load"]["routed_requests"] for r in replicas(client)]
    grew = [a - b for a, b in zip(after, before)]
    # The long request's 4000 tokens outweigh the four short ones together.
    assert grew == [1 if i == holder else 4 for i in range(2)], grew
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


def test_flush_cache_acts_on_every_replica(client: httpx.Client) -> None:
    client.post("/generate", json={"text": PROMPTS[:2], "sampling_params": GREEDY})
    wait_until_idle(client)
    assert all(r["evictable_kv_tokens"] > 0 for r in replicas(client))
    reply = client.post("/flush_cache")
    assert reply.status_code == 200, reply.text
    assert "replica 0:" in reply.json()["message"] and "replica 1:" in reply.json()["message"]
    assert [r["evictable_kv_tokens"] for r in replicas(client)] == [0, 0]


def test_update_weights_answers_for_every_replica(client: httpx.Client, model_dir: Path,
                                                  other_dir: Path,
                                                  reference: list[list[int]]) -> None:
    def update(path: Path) -> None:
        reply = client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert reply.status_code == 200, reply.text
        assert reply.json()["success"] is True
        assert "replica 0:" in reply.json()["message"]
        assert "replica 1:" in reply.json()["message"]

    def generate() -> tuple[list[list[int]], list[int]]:
        """Every prompt's tokens, and how many prompts each replica served."""
        before = [r["load"]["routed_requests"] for r in replicas(client)]
        outputs = client.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
        assert outputs.status_code == 200, outputs.text
        routed = [r["load"]["routed_requests"] - b for r, b in zip(replicas(client), before)]
        return [o["output_ids"] for o in outputs.json()], routed

    update(other_dir)  # other weights of the same shapes
    tokens, routed = generate()
    assert all(count > 0 for count in routed), routed
    # Every prompt, whichever replica served it, runs on the new weights.
    unchanged = [i for i, (new, old) in enumerate(zip(tokens, reference)) if new == old]
    assert unchanged == [], f"prompts still on the old weights: {unchanged}"
    update(model_dir)  # and back, for the other tests
    tokens, routed = generate()
    assert all(count > 0 for count in routed), routed
    assert tokens == reference


def test_each_replica_reports_its_load(client: httpx.Client) -> None:
    # Each replica reports about once a second; the deadline is a liveness bound.
    deadline = time.monotonic() + 30
    while True:
        loads = [r["load"]["metrics"] for r in replicas(client)]
        if all(loads) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(load is not None and load["max_total_tokens"] > 0 for load in loads), loads
    info = client.get("/get_server_info").json()
    assert info["metrics"]["max_total_tokens"] == sum(m["max_total_tokens"] for m in loads)
    text = client.get("/metrics").text
    labels = {s.labels.get("replica") for family in text_string_to_metric_families(text)
              for s in family.samples if s.name == "framework:replica_token_usage"}
    assert labels == {"0", "1"}


@pytest.mark.timeout(240)  # a liveness bound: the server must go down, not hang
def test_a_killed_replica_takes_the_server_down_by_name(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    proc = start_server(model_dir, tmp_path_factory.mktemp("dp_death"), "--dp-size", "2")
    try:
        children = proc.children()
        # A scheduler and a detokenizer per replica (and Python's resource tracker).
        assert len(children) >= 4
        with httpx.Client(base_url=proc.base_url, timeout=60) as c:
            victim = replicas(c)[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert proc.proc.wait(60) == 1
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit:\n{proc.log()}")
    finally:
        proc.stop(signal.SIGKILL)
    assert ("the scheduler replica 1 process exited unexpectedly with code -9 "
            "(killed by SIGKILL)") in proc.log()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # no orphans
