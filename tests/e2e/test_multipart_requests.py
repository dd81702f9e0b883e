"""Requests the API fans out (a list of prompts, ``n`` choices) run whole or not at all.

One real server on a tiny model with a small context: when one part of a
request is refused (its prompt does not fit the context), the whole request is
a 400 and none of its parts reaches the Scheduler, streaming or not; when the
client leaves a fanned-out stream, every part is aborted and its KV freed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess, http_client, wait_until_idle

CONTEXT = 64
SHORT_IDS = [5, 6, 7]
LONG_IDS = [5] * (CONTEXT + 8)
LONG_TEXT = "word " * (4 * CONTEXT)
CHAT_LONG = [{"role": "user", "content": LONG_TEXT}]
# Long enough that a part left running would still be running when the test looks: all
# the context leaves after the short prompt (more is refused).
SLOW = {"max_tokens": CONTEXT - len(SHORT_IDS), "ignore_eos": True, "temperature": 0}
# Scheduler counters that move once any part of a request reaches it.
TOUCHED = ("extend_steps", "decode_steps", "aborted_requests", "failed_requests")
# (route, body): one part of each is too long for the context.
ONE_PART_TOO_LONG: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": [SHORT_IDS, LONG_IDS], **SLOW}),
    ("/v1/completions", {"prompt": [SHORT_IDS, LONG_IDS], "stream": True, **SLOW}),
    ("/v1/completions", {"prompt": ["hello there", LONG_TEXT], "n": 2, **SLOW}),
    ("/v1/completions", {"prompt": ["hello there", LONG_TEXT], "n": 2, "stream": True,
                         **SLOW}),
    ("/v1/chat/completions", {"messages": CHAT_LONG, "n": 3, **SLOW}),
    ("/v1/chat/completions", {"messages": CHAT_LONG, "n": 3, "stream": True, **SLOW}),
    ("/generate", {"input_ids": [SHORT_IDS, LONG_IDS],
                   "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True}}),
    ("/generate", {"text": ["hello there", LONG_TEXT], "stream": True,
                   "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True}}),
]


@pytest.fixture(scope="module")
def server(small_context_server: ServerProcess) -> ServerProcess:
    """A context small enough for one prompt to overflow."""
    assert small_context_server.args[-4:-2] == ["--context-length", str(CONTEXT)]
    return small_context_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=60)


@pytest.mark.parametrize(("path", "body"), ONE_PART_TOO_LONG,
                         ids=[f"{p} n={b.get('n', 1)} stream={b.get('stream', False)}"
                              for p, b in ONE_PART_TOO_LONG])
def test_one_part_too_long_refuses_the_whole_request(client: httpx.Client, path: str,
                                                     body: dict[str, Any]) -> None:
    before = wait_until_idle(client)
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"context length is {CONTEXT}" in error["message"], error
    after = wait_until_idle(client)
    assert after["kv_cache_idle_and_free"] is True, after
    assert after["num_running_reqs"] == 0, after
    # No part reached the Scheduler: nothing was prefilled, decoded or had to be aborted.
    assert {k: after[k] for k in TOUCHED} == {k: before[k] for k in TOUCHED}


def test_leaving_a_fanned_out_stream_aborts_every_part(tiny_server: ServerProcess) -> None:
    # The tiny server's whole context (256) to generate in: a part left running is still
    # running long after the client has gone, however loaded the machine.
    slow = {"max_tokens": 256 - len(SHORT_IDS), "ignore_eos": True, "temperature": 0}
    body = {"prompt": [SHORT_IDS, [8, 9]], "n": 2, "stream": True, **slow}
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        before = wait_until_idle(client)["aborted_requests"]
        seen: set[int] = set()
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(seen) == 4:
                    break  # every part is running; the connection closes here
        info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["num_running_reqs"] == 0, info
    assert info["aborted_requests"] == before + 4


def test_the_server_still_serves_whole_requests(client: httpx.Client) -> None:
    body = {"prompt": [SHORT_IDS, [8, 9]], "n": 2, "max_tokens": 3,
            "ignore_eos": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert sorted(c["index"] for c in reply.json()["choices"]) == [0, 1, 2, 3]
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True

