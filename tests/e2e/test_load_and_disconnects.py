"""Overload and impatient clients against a real server.

- 500 concurrent streams against a small KV pool and ``--max-running-requests 8``:
  every one completes with the tokens it gets alone.
- 100 streaming clients that hang up at random points: every request ends, the idle
  invariant holds afterwards and the server still answers.
- ``--max-queued-requests``: requests past the limit get an immediate 503 with
  ``Retry-After``; the others complete.

Time limits here are generous liveness bounds, not performance claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import (
    ServerProcess,
    SharedPool,
    http_client,
    start_server,
    wait_until_idle,
)

NEW_TOKENS = 8
PROMPTS = [" ".join(f"w{(seed * 7 + i) % 50}" for i in range(3 + seed % 11)) for seed in range(20)]
LIVENESS_S = 600.0


def generate_body(prompt: str, stream: bool, new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    return {"text": prompt, "stream": stream, "sampling_params": {
        "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama", seed=21)


@pytest.fixture(scope="module")
def server(checkpoint: Path, shared: SharedPool) -> Iterator[ServerProcess]:
    # A pool of 256 tokens for 8 running requests: retraction and queueing, not just batching.
    with shared.server(checkpoint, "--max-running-requests", "8", "--max-total-tokens", "256",
                       "--chunked-prefill-size", "64") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=120)


@pytest.fixture(scope="module")
def unloaded(client: httpx.Client) -> dict[str, list[int]]:
    """Each prompt's greedy output ids, served alone."""
    return {p: client.post("/generate", json=generate_body(p, False)).json()["output_ids"]
            for p in PROMPTS}


async def stream_ids(client: httpx.AsyncClient, body: dict[str, Any],
                     hang_up_after: int | None = None) -> list[int] | None:
    """The output ids of a streamed /generate; None when hanging up after that many events."""
    ids: list[int] = []
    events = 0
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if hang_up_after is not None and events >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            ids = json.loads(line[len("data: "):])["output_ids"]
    return ids


def run_concurrently(base_url: str, jobs: list[Any]) -> list[Any]:
    async def main() -> list[Any]:
        limits = httpx.Limits(max_connections=len(jobs), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=LIVENESS_S,
                                     limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(job(client) for job in jobs)), LIVENESS_S)

    return asyncio.run(main())


def test_500_concurrent_streams_all_complete_with_their_unloaded_tokens(
        server: ServerProcess, client: httpx.Client, unloaded: dict[str, list[int]]) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(500)]
    jobs = [lambda c, p=p: stream_ids(c, generate_body(p, True)) for p in prompts]
    results = run_concurrently(server.base_url, jobs)
    for prompt, ids in zip(prompts, results):
        assert ids == unloaded[prompt], prompt
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["retracted_requests"] > 0 or info["evictable_kv_tokens"] > 0, info


def test_100_clients_hanging_up_at_random_leave_nothing_behind(
        server: ServerProcess, client: httpx.Client, unloaded: dict[str, list[int]]) -> None:
    rng = random.Random(7)
    aborted_before = wait_until_idle(client)["aborted_requests"]
    plans = [(PROMPTS[rng.randrange(len(PROMPTS))], rng.randrange(0, 12)) for _ in range(100)]
    # Far more tokens than the 0-11 events read before hanging up: a server that runs ahead
    # of a slow client (its events wait in the socket's buffer) still has requests to abort.
    jobs = [lambda c, p=p, k=k: stream_ids(c, generate_body(p, True, new_tokens=96), k)
            for p, k in plans]
    run_concurrently(server.base_url, jobs)
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["aborted_requests"] > aborted_before  # hang-ups reached the Scheduler
    # Still serving, with the same tokens.
    prompt = PROMPTS[3]
    assert client.post("/generate", json=generate_body(prompt, False)).json()[
        "output_ids"] == unloaded[prompt]


def test_requests_past_max_queued_requests_get_503_with_retry_after(
        tmp_path: Path) -> None:
    # Long streams keep the first requests in flight while the next ones arrive.
    ckpt = make_tiny_checkpoint(tmp_path, "llama", seed=21, max_position_embeddings=8192)
    proc = start_server(ckpt, tmp_path, "--max-running-requests", "2",
                        "--max-queued-requests", "2")
    try:
        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=LIVENESS_S) as client:
                body = generate_body(PROMPTS[0], True, new_tokens=6000)
                async with contextlib.AsyncExitStack() as streams:
                    # 2 running + 2 queued: all four are taken. The line iterators are kept:
                    # dropping one would close its stream (a hang-up).
                    lines = []
                    for _ in range(4):
                        response = await streams.enter_async_context(
                            client.stream("POST", "/generate", json=body))
                        assert response.status_code == 200
                        lines.append(response.aiter_lines())
                    for running in lines[:2]:
                        assert (await anext(running)).startswith("data: ")
                    deadline = time.monotonic() + LIVENESS_S
                    while True:  # until the two queued ones reached the Scheduler
                        info = (await client.get("/get_server_info")).json()["scheduler"]
                        if info["num_waiting_reqs"] == 2:
                            break
                        assert time.monotonic() < deadline, info
                        await asyncio.sleep(0.05)
                    assert info["num_running_reqs"] == 2
                    refused = await client.post("/generate", json=body)
                    assert refused.status_code == 503, refused.text
                    assert int(refused.headers["retry-after"]) >= 1
                    error = refused.json()["error"]
                    assert error["code"] == "overloaded" and "overloaded" in error["message"]
                # The four hung up: their slots come back, and a request is served again.
                with httpx.Client(base_url=proc.base_url, timeout=60) as sync_client:
                    assert wait_until_idle(sync_client)["kv_cache_idle_and_free"] is True
                accepted = await client.post("/generate", json=generate_body(PROMPTS[1], False))
                assert accepted.status_code == 200

        asyncio.run(asyncio.wait_for(scenario(), LIVENESS_S))
    finally:
        assert proc.stop() == 0, proc.log()
