"""Structured outputs over HTTP on the default model, through the official ``openai`` client.

``response_format`` (json_schema and json_object) on both OpenAI routes, streamed and not,
with ``n > 1``; SGLang's ``regex`` and ``ebnf`` as extra fields; and the Scheduler idle
and free afterwards.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, wait_until_idle
from tests.structured_cases import (
    EBNF,
    REGEXES,
    SCHEMAS,
    UNSUPPORTED_KEYWORDS,
    check_json,
    check_regex,
    lark_parser,
)

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    choices = []
    for n, schema in enumerate(SCHEMAS):
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, response_format=json_schema_format(schema),
            n=3, seed=n, temperature=0.8, max_tokens=200)
        choices += [(c, schema) for c in reply.choices]
    stopped = [(c, s) for c, s in choices if c.finish_reason == "stop"]
    for choice, schema in stopped:
        check_json(choice.message.content or "", schema)
    assert len(stopped) >= 0.9 * len(choices)


def test_streamed_completions_and_json_object(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="JSON:", stream=True, seed=3, temperature=1.0, max_tokens=200,
        # The client's completions.create has no response_format argument; the route has.
        extra_body={"response_format": json_schema_format(SCHEMAS[1])})
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    check_json(text, SCHEMAS[1])
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format={"type": "json_object"},
        temperature=0, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_regex_and_ebnf_as_extra_fields(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="An address:", n=4, seed=1,
                                      temperature=1.0, max_tokens=64,
                                      extra_body={"regex": REGEXES[3]})
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        check_regex(choice.text, REGEXES[3])
    reply = client.chat.completions.create(model=model, messages=MESSAGES, seed=2,
                                           temperature=1.0, max_tokens=64,
                                           extra_body={"ebnf": EBNF})
    assert reply.choices[0].finish_reason == "stop"
    lark_parser().parse(reply.choices[0].message.content or "")


def test_bad_constraint_is_an_openai_bad_request(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8,
            response_format=json_schema_format({"type": "object", "required": 5}))
    assert info.value.status_code == 400
    assert "invalid json_schema" in info.value.message


def test_each_keyword_that_is_not_enforced_is_a_400_naming_it(server: ServerProcess) -> None:
    """Before, these were 200s whose outputs broke the schema and finished with stop."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for schema, keyword, pointer in UNSUPPORTED_KEYWORDS:
            reply = http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 8,
                "response_format": json_schema_format(schema)})
            assert reply.status_code == 400, (keyword, reply.text)
            error = reply.json()["error"]
            assert error["message"].startswith(f"invalid json_schema: '{keyword}' at {pointer} ")
            # The pointer is into the schema; param names the field as the request did.
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error", "response_format", "unsupported_schema_keyword")
        # SGLang's field on the native route, and a regex with a lookahead, alike.
        reply = http.post("/generate", json={"text": "x", "sampling_params": {
            "json_schema": {"type": "array", "uniqueItems": True}}})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "json_schema"
        assert "'uniqueItems' at /uniqueItems" in reply.json()["error"]["message"]
        reply = http.post("/v1/completions", json={"prompt": "x", "regex": "^(?=x)[a-z]{3}$"})
        assert reply.status_code == 400 and "lookahead" in reply.json()["error"]["message"]


def test_a_constraint_past_a_size_limit_is_a_400_naming_the_limit(server: ServerProcess) -> None:
    """Before, a 50,000-entry enum passed the edge, then compiled for minutes."""
    enum = {"type": "string", "enum": [f"value-{i}" for i in range(50_000)]}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"prompt": "x", "json_schema": enum})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {
        "message": "invalid json_schema: the schema's enums have 50000 entries in all; the "
                   "limit is 1000 (enum entries)",
        "type": "invalid_request_error", "param": "json_schema",
        "code": "constraint_too_large"}


def test_idle_and_free_afterwards(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        info = wait_until_idle(http)
    assert info["kv_cache_idle_and_free"] is True
    assert info["failed_requests"] == 0
