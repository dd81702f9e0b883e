"""Bad sampling values are refused where a request enters, and never reach the Scheduler.

One real server (and one Engine) on a tiny model: every bad value is a 400 (or a
``ValueError``) whose message names the field, the Scheduler's counters do not move, and
the server still answers normal requests afterwards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from framework import Engine
from tests.model_fixtures import TINY_VOCAB_SIZE
from tests.server_harness import ServerProcess, SharedPool, http_client, wait_until_idle

VOCAB = TINY_VOCAB_SIZE
CHAT = [{"role": "user", "content": "hello"}]
# Scheduler counters that move once a request reaches it (admitted, refused or failed).
TOUCHED = ("extend_steps", "decode_steps", "aborted_requests", "failed_requests")

# (route, body, the error's param, words its message must hold)
BAD_JSON: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": -1}, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21},
     "logprobs", "logprobs must be an integer in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1, "stream": True}, "logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "top_logprobs must be an integer in [0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1},
     "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2},
     "top_logprobs", "top_logprobs needs logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": -1},
     "top_logprobs_num", "top_logprobs_num must be an integer in [0, 20]"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21,
                   "stream": True}, "top_logprobs_num", "top_logprobs_num"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64},
     "seed", "seed must be in [-2**63, 2**64 - 1]"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed", "seed must be in"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, "seed", "seed"),
    ("/generate", {"input_ids": [1, VOCAB]},
     "input_ids", f"input_ids must hold integer token ids in [0, {VOCAB})"),
    ("/generate", {"input_ids": [1, -1]}, "input_ids", "input_ids must hold integer token ids"),
    ("/generate", {"input_ids": [[1, 2], [VOCAB + 7]], "stream": True}, "input_ids", "input_ids"),
    ("/v1/completions", {"prompt": [1, VOCAB]},
     "prompt", f"prompt must hold integer token ids in [0, {VOCAB})"),
    ("/v1/completions", {"prompt": [[3, -5]]}, "prompt", "prompt must hold integer token ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [VOCAB]},
     "stop_token_ids", f"stop_token_ids must hold integer token ids in [0, {VOCAB})"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [-1]}},
     "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "n must be in [1, 128]"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "n must be in [1, 128]"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"n": 129}},
     "n", "n must be in [1, 128]"),
    ("/v1/completions", {"prompt": "hi", "top_k": 0},
     "top_k", "top_k must be -1 (disabled) or in [1, "),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -2}}, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ("/v1/chat/completions", {"messages": CHAT, "min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1},
     "temperature", "temperature must be in [0, 100]"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e300},
     "temperature", "temperature must be in [0, 100]"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}},
     "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3},
     "frequency_penalty", "frequency_penalty"),
    # Structured outputs: a constraint that does not compile, or two at once.
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "invalid json_schema: 'type' at /type must be one of null"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format",
     "invalid response_format: a json_schema response_format needs json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}},
     "response_format", "invalid response_format: type must be text, json_object or json_schema"),
    ("/v1/completions", {"prompt": "hi", "regex": "a", "response_format": {
        "type": "json_object"}},
     "response_format", "give either response_format or regex, not both"),
    ("/v1/completions", {"prompt": "hi", "regex": "a(b"},
     "regex", "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= foo"}},
     "ebnf", 'invalid ebnf: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {
        "json_schema": {"type": "object"}, "regex": "a+"}},
     "regex", "give at most one of json_schema, regex, ebnf; got json_schema and regex"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}},
     "json_schema", "invalid json_schema: Failed to parse JSON"),
]

# (route, body, the error's param, words its message must hold): the field is named as the
# request gave it.
BAD_FIELDS: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens",
     "max_tokens must be in [0, 9223372036854775807], got -1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64, "stream": True}, "max_tokens",
     "max_tokens must be in [0, "),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, "max_tokens",
     "max_tokens must be in [0, "),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1, "max_tokens": 4},
     "max_completion_tokens", "max_completion_tokens must be in [0, "),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream_options is only allowed when stream is true"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": False, "stream_options": {}},
     "stream_options", "stream_options is only allowed when stream is true"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role", "must be one of system, developer, user, assistant, tool, function"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"},
                                           {"role": "user"}], "stream": True},
     "messages[1].content", "messages[1].content is missing"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": None}]},
     "messages[1].content", "messages[1].content is missing"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "user", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls", "messages[1].tool_calls is for assistant messages"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}]},
     "tools", "tool calls need the server started with --tool-call-parser"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"},
     "tool_choice", "tool_choice needs tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "messages[0].content[1].type", "messages[0].content[1].type is 'image_url'"),
    ("/v1/chat/completions", {"stream": True, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]},
     "messages[0].content[0].type", "'input_audio', but this model reads text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "messages[0].content[0].text must be a string"),
    # Refused while decoding: msgspec's path to the value is the param.
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature",
     "Expected `float | null`, got `str` - at `$.temperature`"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["ok", 7]}, "stop[1]",
     "got `int` - at `$.stop[1]`"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", "Expected `array`, got `str`"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role",
     "Object missing required field `role`"),
    ("/v1/completions", {"max_tokens": 2}, "prompt", "Object missing required field `prompt`"),
    # A null means the default, but the prompt has none here (OpenAI's is its own end-of-text).
    ("/v1/completions", {"prompt": None}, "prompt",
     "Expected `str | array`, got `null` - at `$.prompt`"),
    # Checked with the rest of the sampling values: named as the request names them.
    ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens",
     "min_new_tokens (5) must be <= max_new_tokens (2)"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2, "min_tokens": 3},
     "min_tokens", "min_new_tokens (3) must be <= max_new_tokens (2)"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias",
     "logit_bias keys must be token ids, got 'abc'"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, "logit_bias",
     "logit_bias values must be in [-100, 100], got 101"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2, 2], got 3"),
]

# Bodies that JSON encoders write but strict JSON has no number for.
BAD_RAW: list[tuple[str, bytes, str]] = [
    # 1e400 overflows a double: refused while decoding, at the field's path.
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1e400}', "top_p"),
    # NaN and Infinity are not JSON numbers: the body is refused as malformed.
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "JSON"),
    ("/generate", b'{"text": "hi", "sampling_params": {"top_p": Infinity}}', "JSON"),
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    """A tiny random Llama with its tokenizer (and chat template)."""
    return tiny_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def server(checkpoint: Path, shared: SharedPool) -> Iterator[ServerProcess]:
    """One server for the whole module; msgpack, the codec with the narrowest integers."""
    with shared.server(checkpoint, "--transport", "zmq", "--codec", "msgpack") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    yield from http_client(server, timeout=60)


def _counters(client: httpx.Client) -> dict[str, Any]:
    scheduler = client.get("/get_server_info").json()["scheduler"]
    return {key: scheduler[key] for key in TOUCHED}


def _assert_refused(client: httpx.Client, response: httpx.Response, words: str,
                    before: dict[str, Any]) -> None:
    """A 400 with OpenAI's error body naming ``words``, and a Scheduler that saw nothing."""
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert _counters(client) == before


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_JSON,
                         ids=[f"{p} {json.dumps(b)}" for p, b, _, _ in BAD_JSON])
def test_bad_value_is_a_400_naming_the_field(client: httpx.Client, path: str,
                                             body: dict[str, Any], param: str,
                                             words: str) -> None:
    before = _counters(client)
    response = client.post(path, json=body)
    _assert_refused(client, response, words, before)
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_FIELDS,
                         ids=[f"{p} {json.dumps(b)}" for p, b, _, _ in BAD_FIELDS])
def test_bad_field_is_a_400_with_its_param(client: httpx.Client, path: str,
                                           body: dict[str, Any], param: str,
                                           words: str) -> None:
    before = _counters(client)
    response = client.post(path, json=body)
    _assert_refused(client, response, words, before)
    assert response.json()["error"]["param"] == param


# An explicit max_tokens past the context (256 tokens) is refused, whatever the route.
PAST_THE_CONTEXT: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": ["hi", "hello"], "max_tokens": 255, "stream": True},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 256}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1000,
                              "max_tokens": 4, "stream": True}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), PAST_THE_CONTEXT,
                         ids=[f"{p} {json.dumps(b)}" for p, b, _ in PAST_THE_CONTEXT])
def test_max_tokens_past_the_context_is_a_400(client: httpx.Client, path: str,
                                              body: dict[str, Any], param: str) -> None:
    before = _counters(client)
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    assert re.fullmatch(rf"this model's context length is 256 tokens, but the prompt has "
                        rf"(\d+) tokens and {param} asks for {requested} more \(\d+ in all\); "
                        rf"ask for at most \d+", error["message"]), error
    assert _counters(client) == before


def test_max_tokens_that_fill_the_context_or_unset_are_served(client: httpx.Client) -> None:
    prompt_tokens = client.post("/tokenize", json={"text": "hello"}).json()["count"]
    room = 256 - prompt_tokens
    body = {"prompt": "hello", "max_tokens": room, "ignore_eos": True, "temperature": 0}
    full = client.post("/v1/completions", json=body)
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["total_tokens"] == 256
    # Unset, chat's max_tokens is what the context leaves (cut to fit, not refused).
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True,
                                                     "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["total_tokens"] == 256
    assert chat.json()["choices"][0]["finish_reason"] == "length"


def test_a_prompt_may_fill_the_context_only_to_be_scored(client: httpx.Client) -> None:
    """A prompt of the whole context (256 tokens) is scored with max_tokens 0; asked for
    more, or one token longer, it is a 400 context_length_exceeded."""
    full = [5] * 256
    scored = client.post("/v1/completions", json={"prompt": full, "max_tokens": 0,
                                                  "echo": True, "logprobs": 0})
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["token_logprobs"]) == 256
    native = client.post("/generate", json={"input_ids": full, "return_logprob": True,
                                             "logprob_start_len": 0,
                                             "sampling_params": {"max_new_tokens": 0}})
    assert native.status_code == 200, native.text
    assert len(native.json()["meta_info"]["input_token_logprobs"]) == 256
    before = _counters(client)
    for path, body in [("/v1/completions", {"prompt": full}),
                       ("/v1/completions", {"prompt": [*full, 5], "max_tokens": 0}),
                       ("/generate", {"input_ids": full}),
                       ("/generate", {"input_ids": [*full, 5],
                                      "sampling_params": {"max_new_tokens": 0}})]:
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert "the model's context length is 256" in error["message"], error
    assert _counters(client) == before
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_zero_generates_nothing(client: httpx.Client, field: str) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, field: 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("path", "body", "words"), BAD_RAW,
                         ids=[b.decode() for _, b, _ in BAD_RAW])
def test_numbers_json_cannot_hold_are_a_400(client: httpx.Client, path: str, body: bytes,
                                           words: str) -> None:
    before = _counters(client)
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    _assert_refused(client, response, words, before)


def test_openai_client_gets_bad_request_errors(server: ServerProcess,
                                               client: httpx.Client) -> None:
    oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model = oa.models.list().data[0].id
    before = _counters(client)
    with pytest.raises(openai.BadRequestError, match=r"logprobs must be an integer in \[0, 20\]"):
        oa.completions.create(model=model, prompt="hello", max_tokens=4, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oa.chat.completions.create(model=model, messages=CHAT, max_tokens=4, logprobs=True,
                                   top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="seed"):
        oa.completions.create(model=model, prompt="hello", max_tokens=4, seed=2**64,
                              stream=True)
    assert _counters(client) == before


def test_server_still_serves_after_the_refusals(server: ServerProcess,
                                                client: httpx.Client) -> None:
    """Liveness after every refusal above, with the range ends that are accepted."""
    assert server.proc.poll() is None, server.log()
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "logprobs": 20,
            "seed": 2**64 - 1, "n": 2, "temperature": 1e-30, "top_k": VOCAB + 10}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == 2
    assert all(c["text"] for c in choices)
    assert len(choices[0]["logprobs"]["token_logprobs"]) == 4
    sampled = client.post("/generate", json={
        "input_ids": [1, VOCAB - 1], "return_logprob": True, "top_logprobs_num": 20,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "seed": -(2**63),
                            "temperature": 100, "stop_token_ids": [0, VOCAB - 1]}})
    assert sampled.status_code == 200, sampled.text
    meta = sampled.json()["meta_info"]
    assert meta["completion_tokens"] >= 1
    # The legacy completions object keys top logprobs by text, which may repeat; these may not.
    assert all(len(row) == 20 for row in meta["output_top_logprobs"])
    info = client.get("/get_server_info")
    assert info.status_code == 200
    scheduler = info.json()["scheduler"]
    assert scheduler["failed_requests"] == 0
    assert scheduler["kv_cache_idle_and_free"] is True
    assert server.proc.poll() is None, server.log()


# --------------------------------------------------------------------------- Engine


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[Engine]:
    # Of the Engine's checks, not of its launch: threads of this process start fastest.
    with Engine(model_path=str(checkpoint), launch_mode="thread") as eng:
        yield eng


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "hi", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"prompt": "hi", "return_logprob": True, "top_logprobs_num": 21}, "[0, 20]"),
        ({"prompt": "hi", "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"seed": 2**64}}, "seed"),
        ({"input_ids": [1, -2]}, "input_ids"),
        ({"input_ids": [1, VOCAB]}, f"[0, {VOCAB})"),
        ({"prompt": "hi", "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ],
)
def test_engine_refuses_with_a_value_error(engine: Engine, kwargs: dict[str, Any],
                                           words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.generate(**kwargs)


def test_engine_still_generates_after_the_refusals(engine: Engine) -> None:
    out = engine.generate("hi", {"max_new_tokens": 3, "ignore_eos": True, "temperature": 1e-30})
    assert out["meta_info"]["completion_tokens"] == 3
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_logit_bias_moves_the_chosen_token_and_bad_bias_is_a_400(
        server: ServerProcess, client: httpx.Client) -> None:
    oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    model = oa.models.list().data[0].id
    greedy = {"max_new_tokens": 1, "temperature": 0}
    plain = client.post("/generate", json={"text": "hello", "sampling_params": greedy}).json()
    target = 7 if plain["output_ids"] != [7] else 8  # a token greedy decoding did not pick
    bias = {str(target): 100}
    native = client.post("/generate", json={
        "text": "hello", "sampling_params": {**greedy, "logit_bias": bias}}).json()
    assert native["output_ids"] == [target]
    biased = oa.completions.create(model=model, prompt="hello", max_tokens=1, temperature=0,
                                   logit_bias=bias)
    unbiased = oa.completions.create(model=model, prompt="hello", max_tokens=1, temperature=0)
    assert biased.choices[0].text == native["text"]
    assert unbiased.choices[0].text == plain["text"]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oa.completions.create(model=model, prompt="hello", max_tokens=1,
                              logit_bias={"999999": 5})
