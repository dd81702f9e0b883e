"""The real server as a subprocess: OpenAI and native routes, SSE, aborts, weights, shutdown."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from framework import Engine
from tests.server_harness import (
    ServerProcess,
    SharedPool,
    http_client,
    stream_events,
    wait_until_idle,
)

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over",
    "a",
    "one two three four five six seven eight nine ten",
    "serving systems batch requests",
    "def add(a, b):",
    "tokens",
    "the cache holds keys and values for every layer of the model",
]
MAX_TOKENS = 12
STREAM_INTERVAL = 2
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}

CONFIGS = [("zmq", "pickle"), ("zmq", "msgpack"), ("shm", "msgpack")]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, Path]:
    """Two tiny Llama checkpoints of the same shape with different weights."""
    return tiny_checkpoint("llama", seed=1), tiny_checkpoint("llama", seed=2)


def _engine_outputs(model: Path) -> list[dict[str, Any]]:
    # Threads of this process (seconds faster to start): the same tokens as processes.
    with Engine(model_path=str(model), launch_mode="thread") as engine:
        return engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> dict[Path, list[dict[str, Any]]]:
    """Greedy outputs of the offline Engine for both checkpoints: the reference."""
    return {ckpt: _engine_outputs(ckpt) for ckpt in checkpoints}


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{t}+{c}" for t, c in CONFIGS])
def server(request: pytest.FixtureRequest, checkpoints: tuple[Path, Path],
           shared: SharedPool) -> Iterator[ServerProcess]:
    transport, codec = request.param
    with shared.server(checkpoints[0], "--transport", transport, "--codec", codec,
                       "--stream-interval", str(STREAM_INTERVAL)) as server:
        yield server


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=60)


def _completion_body(prompt: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}


def _expected_events(tokens: int) -> int:
    """The first token alone, then one event every STREAM_INTERVAL tokens, then the rest."""
    return 1 + math.ceil((tokens - 1) / STREAM_INTERVAL)


def test_completions_json(client: httpx.Client, expected: dict, checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    response = client.post("/v1/completions", json=_completion_body(PROMPTS[1]))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == ref[1]["text"]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": ref[1]["meta_info"]["prompt_tokens"],
        "completion_tokens": MAX_TOKENS,
        "total_tokens": ref[1]["meta_info"]["prompt_tokens"] + MAX_TOKENS,
    }


def test_completions_sse(client: httpx.Client, expected: dict, checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    events = stream_events(client, "/v1/completions", _completion_body(
        PROMPTS[3], stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(chunks) == _expected_events(MAX_TOKENS)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref[3]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"]


def test_generate_json(client: httpx.Client, expected: dict, checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    body = client.post("/generate", json={"text": PROMPTS[5], "sampling_params": GREEDY}).json()
    assert body["text"] == ref[5]["text"]
    assert body["output_ids"] == ref[5]["output_ids"]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_TOKENS}
    assert body["meta_info"]["completion_tokens"] == MAX_TOKENS


def test_generate_sse(client: httpx.Client, expected: dict, checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    events = stream_events(client, "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY,
                                                 "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == _expected_events(MAX_TOKENS)
    assert chunks[-1]["text"] == ref[0]["text"]  # /generate streams the text so far
    assert chunks[-1]["output_ids"] == ref[0]["output_ids"]
    counts = list(range(1, MAX_TOKENS + 1, STREAM_INTERVAL))
    if counts[-1] != MAX_TOKENS:
        counts.append(MAX_TOKENS)
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == counts


def test_32_concurrent_streams_match_the_engine(server: ServerProcess, expected: dict,
                                                checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, int, bool]:
        prompt = i % len(PROMPTS)
        body = _completion_body(PROMPTS[prompt], stream=True)
        text, events, done = "", 0, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
                events += 1
        return prompt, text, events, done

    async def run_all() -> list[tuple[int, str, int, bool]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text, events, done in results:
        assert done, "a stream did not end with [DONE]"
        assert events == _expected_events(MAX_TOKENS)
        assert text == ref[prompt]["text"]


def test_openai_client(server: ServerProcess, expected: dict, checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    model = oa.models.list().data[0].id
    completion = oa.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == ref[2]["text"]
    assert completion.usage.completion_tokens == MAX_TOKENS
    stream = oa.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == ref[2]["text"]


def test_bad_input_is_a_400_with_an_openai_error(client: httpx.Client) -> None:
    cases = [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": []}, "empty"),
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"sampling_params": {}}, "text"),
        ("/v1/embeddings", {"input": "x"}, "embedding"),
    ]
    for path, body, word in cases:
        response = client.post(path, json=body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert word in error["message"], error
        assert error["type"] == "invalid_request_error"
        assert error["code"] == 400
    response = client.post("/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]
    # A model this server does not serve is a 404, as OpenAI answers it.
    response = client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_operational_endpoints(client: httpx.Client, server: ServerProcess,
                               checkpoints: tuple) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == str(checkpoints[0])
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True
    assert info["model_path"] == str(checkpoints[0])
    server_info = client.get("/get_server_info").json()
    assert server_info["stream_interval"] == STREAM_INTERVAL
    assert server_info["scheduler"]["kv_cache_idle_and_free"] is True
    # The start-up banner names the backend the runtime chose, not the setting ("auto").
    backend = server_info["scheduler"]["attention_backend"]
    assert backend in ("cpu", "torch")
    assert f"attention backend {backend})" in server.log()
    assert client.post("/flush_cache").json()["success"] is True
    assert client.get("/flush_cache").json()["success"] is True  # as SGLang, GET works too
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


def test_only_the_scheduler_process_loads_torch(client: httpx.Client,
                                                server: ServerProcess) -> None:
    # The HTTP process and the Detokenizer need a tokenizer, not torch: importing it there
    # would cost each of them seconds of start-up and hundreds of MB.
    scheduler_pid = client.get("/get_server_info").json()["scheduler"]["pid"]
    processes = [server.proc.pid] + [
        pid for pid in server.children()
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert scheduler_pid in processes and len(processes) == 3
    loads_torch = {pid: "libtorch" in Path(f"/proc/{pid}/maps").read_text()
                   for pid in processes}
    assert loads_torch == {pid: pid == scheduler_pid for pid in processes}


def test_client_disconnect_aborts_and_frees_kv(client: httpx.Client) -> None:
    before = client.get("/get_server_info").json()["scheduler"]["aborted_requests"]
    # Nearly the whole context (256 tokens): still running when the client goes away.
    body = {"prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(4))]
        assert any(line.startswith("data: ") for line in got)
    # The connection is closed mid-stream; the request must be aborted and its slots freed.
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["aborted_requests"] == before + 1


@pytest.mark.parametrize("path, body, parts", [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 240, "n": 2,
                         "ignore_eos": True}, 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 200, "ignore_eos": True}, 1),
    ("/generate", {"text": [PROMPTS[0], PROMPTS[1]],
                   "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}, 2),
], ids=["completions", "chat", "generate"])
def test_client_disconnect_aborts_non_streamed_answers(
        server: ServerProcess, client: httpx.Client, path: str, body: dict[str, Any],
        parts: int) -> None:
    """A client that leaves before its whole answer is ready ends every part of it."""
    before = client.get("/get_server_info").json()["scheduler"]["aborted_requests"]

    async def leave_while_running() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as ac:
            task = asyncio.create_task(ac.post(path, json=body))
            while True:  # until every part runs (or the answer came: the assertion shows it)
                info = (await ac.get("/get_server_info")).json()["scheduler"]
                if info["num_running_reqs"] == parts or task.done():
                    break
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_while_running())
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["aborted_requests"] == before + parts


def _update_during_stream(server: ServerProcess, update: dict[str, Any]
                          ) -> tuple[list[str], dict[str, Any]]:
    """POST ``update`` to /update_weights_from_disk while a stream runs: the stream's
    lines and the update's reply."""

    async def run() -> tuple[list[str], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as ac:
            body = _completion_body(PROMPTS[0], stream=True, max_tokens=200)

            async def stream() -> list[str]:
                async with ac.stream("POST", "/v1/completions", json=body) as response:
                    return [line async for line in response.aiter_lines() if line]

            task = asyncio.create_task(stream())
            while (await ac.get("/get_server_info")).json()["scheduler"][
                    "num_running_reqs"] == 0 and not task.done():
                await asyncio.sleep(0.02)
            reply = (await ac.post("/update_weights_from_disk", json=update)).json()
            return await asyncio.wait_for(task, 60), reply

    return asyncio.run(run())


def test_update_weights_from_disk(server: ServerProcess, client: httpx.Client, expected: dict,
                                  checkpoints: tuple, tmp_path: Path) -> None:
    first, second = checkpoints
    lines, reply = _update_during_stream(server, {"model_path": str(second)})
    assert reply["success"] is True, reply
    assert lines[-1] == "data: [DONE]"  # the in-flight request finished, it did not hang
    for i in (1, 4):
        body = client.post("/generate", json={"text": PROMPTS[i], "sampling_params": GREEDY})
        assert body.json()["output_ids"] == expected[second][i]["output_ids"]

    bad = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none")})
    assert bad.status_code == 400
    assert bad.json()["success"] is False
    assert "none" in bad.json()["message"]
    body = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY})
    assert body.json()["output_ids"] == expected[second][1]["output_ids"]

    restored = client.post("/update_weights_from_disk", json={"model_path": str(first)})
    assert restored.json()["success"] is True


def test_update_weights_can_abort_the_requests_in_flight(
        server: ServerProcess, client: httpx.Client, checkpoints: tuple) -> None:
    before = client.get("/get_server_info").json()["scheduler"]["aborted_requests"]
    lines, reply = _update_during_stream(
        server, {"model_path": str(checkpoints[0]), "abort_all_requests": True})
    assert reply["success"] is True, reply
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort", lines[-3:]
    info = wait_until_idle(client)
    assert info["aborted_requests"] == before + 1 and info["kv_cache_idle_and_free"] is True


def test_chat_completions_json_and_sse(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["object"] == "chat.completion"
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 6
    events = stream_events(client, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices_and_logprobs(client: httpx.Client, expected: dict,
                                checkpoints: tuple) -> None:
    ref = expected[checkpoints[0]]
    body = _completion_body(PROMPTS[1], n=3, logprobs=2)
    reply = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert all(c["text"] == ref[1]["text"] for c in reply["choices"])  # greedy: all the same
    logprobs = reply["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == MAX_TOKENS
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert reply["usage"]["completion_tokens"] == 3 * MAX_TOKENS
    fanned = client.post("/generate", json={"text": "x", "sampling_params": {**GREEDY, "n": 2}})
    assert fanned.status_code == 200 and len(fanned.json()) == 2
