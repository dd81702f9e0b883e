"""``framework router`` in front of real processes: a ``framework serve`` on the tiny model
and stub OpenAI-compatible workers (a Starlette app of this module, served by Hypercorn).

A worker killed mid-run costs no non-streamed request and leaves every stream ended; a
removed worker gets no new request but finishes its own; requests sharing a long prefix
stay on one worker under cache_aware; the ``openai`` client works through the router, and
the router's key, its 503 and its metrics answer as OpenAI-style clients expect.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, sse_events

ROOT = Path(__file__).resolve().parents[2]
ROUTER_LINE = re.compile(r"framework router is serving at (http://\S+) ")
STUB_LINE = re.compile(r"stub serving at (http://\S+)")
STREAM_EVENTS = 8


# --------------------------------------------------------------------------- the stub worker


def stub_app(name: str, delay: float) -> Any:
    """An OpenAI-compatible worker answering after ``delay`` s, naming itself in each answer."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    served = {"requests": 0}

    async def completion(request: Request) -> Any:
        body = await request.json()
        served["requests"] += 1
        if body.get("stream"):
            return StreamingResponse(_events(name, delay), media_type="text/event-stream")
        await asyncio.sleep(delay)
        return JSONResponse({"id": "cmpl-stub", "object": "text_completion", "model": "tiny",
                             "system_fingerprint": name,
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                       "total_tokens": 2}})

    async def ok(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(served)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    return Starlette(routes=[
        Route("/v1/completions", completion, methods=["POST"]),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/health", ok), Route("/stats", stats), Route("/v1/models", models),
    ])


async def _events(name: str, delay: float) -> AsyncIterator[bytes]:
    for _ in range(STREAM_EVENTS):
        await asyncio.sleep(delay / STREAM_EVENTS)
        event = {"object": "text_completion", "system_fingerprint": name,
                 "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def serve_stub(name: str, delay: float) -> None:
    """Serve a stub on a free port until killed (run in its own process)."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from framework.server.serve import listening_socket

    listener = listening_socket("127.0.0.1", 0)
    print(f"stub serving at http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]
    config.accesslog = None
    asyncio.run(serve(stub_app(name, delay), config))


# --------------------------------------------------------------------------- processes


def _start(args: list[str], line: re.Pattern[str], log_dir: Path) -> ServerProcess:
    """Start ``args``, wait for ``line`` naming its URL and for its /health to answer."""
    log_path = Path(tempfile.mkstemp(suffix=".log", dir=log_dir)[1])
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    process = ServerProcess(proc, "", log_path, args)
    for _ in range(600):  # a liveness bound: 60 s
        found = line.search(process.log())
        if found:
            process.base_url = found.group(1)
            try:
                if httpx.get(f"{process.base_url}/health", timeout=2).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            break
        threading.Event().wait(0.1)
    process.stop(signal.SIGKILL)
    raise RuntimeError(f"{args} did not start:\n{process.log()}")


@contextmanager
def stub(tmp_path: Path, name: str, delay: float = 0.05) -> Iterator[ServerProcess]:
    code = f"from tests.e2e.test_router import serve_stub; serve_stub({name!r}, {delay})"
    process = _start([sys.executable, "-c", code], STUB_LINE, tmp_path)
    try:
        yield process
    finally:
        process.stop(signal.SIGKILL)


@contextmanager
def router(tmp_path: Path, urls: list[str], *flags: str) -> Iterator[ServerProcess]:
    args = [sys.executable, "-m", "framework.cli", "router", "--port", "0", "--log-level",
            "warning", "--health-check-interval", "0.5", "--worker-url", *urls, *flags]
    process = _start(args, ROUTER_LINE, tmp_path)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


def completion(client: httpx.Client, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body)


def served(client: httpx.Client) -> dict[str, int]:
    return {w["url"]: w["served"] for w in client.get("/list_workers").json()["workers"]}


# --------------------------------------------------------------------------- the tests


def test_a_killed_worker_costs_no_request_and_no_stream_hangs(
        tmp_path: Path, tiny_server: ServerProcess) -> None:
    with stub(tmp_path, "steady") as steady, stub(tmp_path, "doomed", delay=0.6) as doomed, \
            router(tmp_path, [tiny_server.base_url, steady.base_url, doomed.base_url],
                   "--policy", "round_robin") as front, \
            httpx.Client(base_url=front.base_url, timeout=60) as client:

        def stream(i: int) -> list[Any]:
            body = {"model": "tiny", "prompt": f"stream {i}", "max_tokens": 4, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                return list(sse_events(response))

        with ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(stream, i) for i in range(6)]
            answers = [pool.submit(completion, client, f"request {i}") for i in range(24)]
            threading.Event().wait(0.3)  # requests are in flight on the doomed stub
            doomed.stop(signal.SIGKILL)
            answers += [pool.submit(completion, client, f"later {i}") for i in range(6)]
            statuses = [a.result().status_code for a in answers]
            events = [s.result() for s in streams]

        assert statuses == [200] * len(statuses)
        for stream_events in events:
            assert stream_events[-1] == "[DONE]"
        cut = [e for e in events if any(isinstance(x, dict) and "error" in x for x in e)]
        assert cut, "no stream of the killed worker ended with an error event"
        metrics = client.get("/metrics").text
        assert re.search(r'router_retries_total\{route="/v1/completions"\} [1-9]', metrics)
        listed = {w["url"]: w for w in client.get("/list_workers").json()["workers"]}
        assert listed[doomed.base_url]["state"] == "unhealthy"


def test_a_removed_worker_finishes_its_request_and_gets_no_new_one(tmp_path: Path) -> None:
    with stub(tmp_path, "kept") as kept, stub(tmp_path, "removed", delay=0.8) as removed, \
            router(tmp_path, [kept.base_url, removed.base_url], "--policy",
                   "round_robin") as front, \
            httpx.Client(base_url=front.base_url, timeout=60) as client:
        with ThreadPoolExecutor(2) as pool:
            # Round robin: the first request goes to "kept", the second to "removed".
            first = completion(client, "first")
            slow = pool.submit(completion, client, "in flight")
            threading.Event().wait(0.3)
            assert client.post("/remove_worker", params={"url": removed.base_url}).json()[
                "state"] == "draining"
            later = [completion(client, f"after {i}") for i in range(4)]
            assert slow.result().status_code == 200
        assert slow.result().json()["system_fingerprint"] == "removed"
        assert first.json()["system_fingerprint"] == "kept"
        assert {r.json()["system_fingerprint"] for r in later} == {"kept"}
        assert httpx.get(f"{removed.base_url}/stats").json()["requests"] == 1
        assert list(served(client)) == [kept.base_url]  # drained: forgotten
        assert client.post("/remove_worker", params={"url": removed.base_url}).status_code == 404


def test_cache_aware_keeps_a_shared_prefix_on_one_worker(
        tmp_path: Path, tiny_server: ServerProcess) -> None:
    with stub(tmp_path, "a") as a, stub(tmp_path, "b") as b, \
            router(tmp_path, [a.base_url, tiny_server.base_url, b.base_url]) as front, \
            httpx.Client(base_url=front.base_url, timeout=60) as client:
        owners = {}
        for group in ("alpha", "beta"):
            prefix = f"{group} shared context, " * 12
            before = served(client)
            for i in range(5):
                assert completion(client, f"{prefix} question {i}").status_code == 200
            grew = {url for url, n in served(client).items() if n != before[url]}
            assert len(grew) == 1, f"group {group} spread over {grew}"
            owners[group] = grew.pop()
        # A new prefix goes to an empty tree, not to the worker already holding one.
        assert owners["alpha"] != owners["beta"]
        assert 'router_prefix_hit_rate{worker=' in client.get("/metrics").text


def test_the_openai_client_works_through_the_router(
        tmp_path: Path, tiny_server: ServerProcess) -> None:
    key = "router-key"
    with router(tmp_path, [tiny_server.base_url], "--api-key", key) as front:
        oa = openai.OpenAI(base_url=f"{front.base_url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in oa.models.list()] == ["tiny"]
        text = oa.completions.create(model="tiny", prompt="hello", max_tokens=3,
                                     temperature=0).choices[0].text
        assert isinstance(text, str)
        chunks = list(oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True))
        assert chunks and chunks[-1].choices[-1].finish_reason is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="wrong",
                          max_retries=0).models.list()


def test_no_healthy_worker_is_a_503(tmp_path: Path) -> None:
    with stub(tmp_path, "gone") as gone:
        url = gone.base_url
    with router(tmp_path, [url]) as front:
        response = completion(httpx.Client(base_url=front.base_url), "anyone?")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_worker"
