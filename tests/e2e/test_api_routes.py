"""API and operations on one real server: the API key, model ids, /tokenize and /detokenize,
fields the server refuses, abort_all, and --log-requests.

The server is started with ``--api-key``, ``--served-model-name`` and ``--log-requests``;
the official ``openai`` client talks to it where it can, httpx everywhere else.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.model_fixtures import TINY_VOCAB_SIZE
from tests.server_harness import ServerProcess, SharedPool, sse_events, wait_until_idle

KEY = "sk-test"
MODEL = "tiny"
CHAT = [{"role": "user", "content": "hello"}]

# (route, field, a value that asks for something the server does not do)
UNSUPPORTED: list[tuple[str, str, Any]] = [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "lora_path", "adapter"),
    ("/v1/completions", "lora_path", "adapter"),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", " end"),
]


def _body(route: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    if route == "/generate":
        return {"text": "hello", "sampling_params": {"max_new_tokens": 2}, "stream": stream,
                **extra}
    key = "messages" if route == "/v1/chat/completions" else "prompt"
    return {key: CHAT if key == "messages" else "hello", "max_tokens": 2, "stream": stream,
            **extra}


@pytest.fixture(scope="module")
def server(shared: SharedPool, tiny_checkpoint: Callable[..., Path]) -> Iterator[ServerProcess]:
    # A long context, so that the abort test's requests are still running when it aborts.
    ckpt = tiny_checkpoint("llama", max_position_embeddings=8192)
    with shared.server(ckpt, "--api-key", KEY, "--served-model-name", MODEL, "--log-requests",
                       "--log-level", "info") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def oa(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def test_api_key_is_required_except_on_health(server: ServerProcess, oa: openai.OpenAI) -> None:
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
    bare = httpx.Client(base_url=server.base_url, timeout=60)
    for path in ("/v1/models", "/get_server_info", "/no-such-route"):
        response = bare.get(path)
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert bare.post("/tokenize", json={"text": "hi"}).status_code == 401
    assert bare.get("/health").status_code == 200
    assert bare.get("/health_generate").status_code == 200
    assert oa.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    # The key is never echoed back.
    info_body = httpx.get(f"{server.base_url}/get_server_info",
                          headers={"Authorization": f"Bearer {KEY}"}).json()
    assert KEY not in str(info_body)


def test_served_model_name_and_unknown_models(oa: openai.OpenAI, client: httpx.Client) -> None:
    assert [m.id for m in oa.models.list().data] == [MODEL]
    card = oa.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert oa.completions.create(model=MODEL, prompt="hi", max_tokens=2).model == MODEL
    chat = oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert chat.model == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        oa.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "The model `gpt-4o` does not exist" in info.value.message
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=CHAT, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4o")
    # An id may hold slashes (a model directory): still the route's own 404.
    response = client.get("/v1/models/org/other-model")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(client: httpx.Client) -> None:
    text = "the quick brown fox"
    tokens = client.post("/tokenize", json={"text": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == tokens["tokens"]
    # The same ids as the prompt of a completion.
    done = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == tokens["count"]
    back = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["text"]
    assert text in back
    for bad in ([1, TINY_VOCAB_SIZE], [-1], ["a"]):
        response = client.post("/detokenize", json={"tokens": bad})
        assert response.status_code == 400
        assert "tokens must hold integer token ids" in response.json()["error"]["message"]
    response = client.post("/tokenize", json={"text": "a", "prompt": "b"})
    assert response.status_code == 400 and "text" in response.json()["error"]["message"]


def test_unimplemented_fields_are_refused_by_name(client: httpx.Client) -> None:
    for route, field, value in UNSUPPORTED:
        for stream in (False, True):
            response = client.post(route, json=_body(route, stream, **{field: value}))
            assert response.status_code == 400, (route, field, response.text)
            error = response.json()["error"]
            assert error["message"] == f"`{field}` is not supported by this server", error
            assert error["param"] == field
    # At their defaults (or what means the same) they are accepted.
    accepted = [("/v1/completions", {"best_of": 1, "suffix": None}),
                ("/v1/chat/completions", {"tools": None, "tool_choice": "none",
                                          "parallel_tool_calls": False,
                                          "response_format": {"type": "text"}}),
                ("/v1/completions", {"some_unknown_field": 1})]
    for route, extra in accepted:
        response = client.post(route, json=_body(route, **extra))
        assert response.status_code == 200, (route, extra, response.text)


def test_abort_all_ends_every_running_request(client: httpx.Client) -> None:
    body = {"prompt": "hello", "max_tokens": 8000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as first, \
            client.stream("POST", "/v1/completions", json=body) as second:
        streams = [sse_events(first), sse_events(second)]
        for events in streams:
            assert next(events)["choices"][0]["finish_reason"] is None  # running
        assert client.post("/abort_request", json={"abort_all": True}).json()["success"]
        for events in streams:
            finishes = [e["choices"][0]["finish_reason"] for e in events
                        if e != "[DONE]" and e["choices"]]
            assert finishes[-1] == "abort"
    info = wait_until_idle(client)
    assert info["kv_cache_idle_and_free"] is True, info
    assert info["aborted_requests"] >= 2


def test_log_requests_logs_start_and_finish(server: ServerProcess, client: httpx.Client) -> None:
    secret = "a prompt that must not reach the log"
    rid = "logged-request-1"
    out = client.post("/generate", json={"text": secret, "rid": rid,
                                         "sampling_params": {"max_new_tokens": 3,
                                                             "ignore_eos": True}}).json()
    assert out["meta_info"]["id"] == rid
    deadline = time.monotonic() + 5
    while f"request {rid} finished" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log()
    prompt_tokens = out["meta_info"]["prompt_tokens"]
    assert re.search(rf"request {rid} /generate: prompt_tokens={prompt_tokens} .*"
                     r"sampling_params=\{.*\"max_new_tokens\":3", log), log
    assert re.search(rf"request {rid} finished: reason=\{{\"type\":\"length\",\"length\":3\}} "
                     rf"prompt_tokens={prompt_tokens} completion_tokens=3", log), log
    assert secret not in log


# ------------------------------------------------------------------ logprobs of split characters

# The tiny tokenizer has no merges for these characters: each of their bytes is a token.
MULTIBYTE = "abc 日本語 café"


def _shown(raw: list[int]) -> str:
    """A token's string as its bytes give it: a byte of no whole character as an escape."""
    return bytes(raw).decode("utf-8", errors="backslashreplace")


def _without_values(entries: list[dict[str, Any]]) -> list[Any]:
    """Chat logprob entries with their tops, less the logprob values."""
    return [({k: v for k, v in e.items() if k not in ("logprob", "top_logprobs")},
             [{k: v for k, v in t.items() if k != "logprob"} for t in e["top_logprobs"]])
            for e in entries]


def _values(entries: list[dict[str, Any]]) -> list[float]:
    """Every logprob value of chat logprob entries and their tops, in order."""
    return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]


def _chat_entries(events: list[Any]) -> list[dict[str, Any]]:
    return [entry for e in events if e != "[DONE]" and e["choices"]
            and e["choices"][0]["logprobs"] for entry in e["choices"][0]["logprobs"]["content"]]


def test_chat_logprobs_bytes_rebuild_split_characters(client: httpx.Client) -> None:
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0, "regex": MULTIBYTE,
            "logprobs": True, "top_logprobs": 2}
    reply = client.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == MULTIBYTE
    content = choice["logprobs"]["content"]
    joined = bytes(b for entry in content if entry["bytes"] is not None for b in entry["bytes"])
    assert joined.decode() == MULTIBYTE
    assert "\\xe6" in [entry["token"] for entry in content]  # the first byte of "日"
    for entry in content:
        for shown in (entry, *entry["top_logprobs"]):
            if shown["bytes"] is not None:
                assert shown["token"] == _shown(shown["bytes"]), shown
    if choice["finish_reason"] == "stop":  # ended by </s>: a token the text leaves out
        assert content[-1]["token"] == "</s>" and content[-1]["bytes"] is None
    streamed = _chat_entries(list(sse_events_of(client, "/v1/chat/completions",
                                                {**body, "stream": True})))
    # The same entries; the values to float32 rounding (the second request reuses the
    # first one's cached prefix, so its prefill sums in another order).
    assert _without_values(streamed) == _without_values(content)
    assert _values(streamed) == pytest.approx(_values(content), abs=1e-5)


def sse_events_of(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """Every event of a streamed request."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return list(sse_events(response))


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Offsets run through ``text``; a whole token's text is found at its offset, a token
    holding part of a character starts at that character."""
    assert len(offsets) == len(tokens)
    assert offsets == sorted(offsets) and offsets[0] >= 0 and offsets[-1] <= len(text)
    for token, offset in zip(tokens, offsets):
        if "\\x" in token:
            assert not text[offset].isascii(), (token, offset, text)
        elif token not in ("<s>", "</s>"):
            assert text.startswith(token, offset), (token, offset, text)


def test_completion_text_offsets_are_positions_in_the_text(client: httpx.Client) -> None:
    want = f"{MULTIBYTE} é done"
    body = {"prompt": "x", "max_tokens": 40, "temperature": 0, "regex": want, "logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == want
    logprobs = choice["logprobs"]
    _check_offsets(want, logprobs["tokens"], logprobs["text_offset"])
    # The three tokens of "日" start where "日" does.
    starts = [o for t, o in zip(logprobs["tokens"], logprobs["text_offset"]) if t == "\\xe6"]
    assert starts[0] == want.index("日")


@pytest.mark.parametrize("top", [0, 1, 3])
def test_completion_top_logprobs_always_hold_the_chosen_token(client: httpx.Client,
                                                              top: int) -> None:
    """Each position's ``top_logprobs`` has its top tokens and the chosen one: at most
    ``logprobs + 1`` entries (sampled hot, the chosen token is often not the top one)."""
    body = {"prompt": "the", "max_tokens": 12, "temperature": 1.5, "seed": 7,
            "ignore_eos": True, "logprobs": top, "echo": True}
    logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    rows = list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]))
    assert rows[0][2] is None  # the first prompt token: nothing comes before it
    for token, logprob, row in rows[1:]:
        assert row[token] == pytest.approx(logprob) or len(row) == top, (token, row)
        assert token in row and top <= len(row) <= top + 1, (token, row)


@pytest.mark.parametrize("cut", [False, True], ids=["text", "ids ending inside a character"])
def test_echoed_offsets_run_through_prompt_and_output(client: httpx.Client, cut: bool) -> None:
    prompt: Any = "日本語 café"
    if cut:  # token ids, the last of which holds the second byte of "日"
        prompt = client.post("/tokenize", json={"text": "x 日"}).json()["tokens"][:-1]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "echo": True,
            "regex": "é!"}
    reply = client.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].endswith("é!")
    _check_offsets(choice["text"], logprobs["tokens"], logprobs["text_offset"])
    # The output's first token starts right after the echoed prompt.
    echoed = len(choice["text"]) - len("é!")
    assert logprobs["text_offset"][reply["usage"]["prompt_tokens"]] == echoed
    # Streamed, the chunks carry the same tokens and offsets.
    chunks = [e["choices"][0] for e in sse_events_of(client, "/v1/completions",
                                                     {**body, "stream": True})
              if e != "[DONE]" and e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    for key in ("tokens", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == logprobs[key]


# ------------------------------------------------------------------ stream_options, /v1/models


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage_is_null_on_every_chunk_but_the_last(client: httpx.Client,
                                                          route: str) -> None:
    body = _body(route, stream=True, stream_options={"include_usage": True})
    events = sse_events_of(client, route, body)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
    # Without include_usage the chunks carry no usage at all.
    plain = sse_events_of(client, route, _body(route, stream=True))
    assert all("usage" not in c for c in plain[:-1])


def test_models_created_is_fixed(client: httpx.Client) -> None:
    first = client.get("/v1/models").json()["data"][0]["created"]
    time.sleep(1.1)  # the clock's second has changed
    assert client.get("/v1/models").json()["data"][0]["created"] == first
    assert client.get(f"/v1/models/{MODEL}").json()["created"] == first
    assert first <= time.time()
