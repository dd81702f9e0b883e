"""``GET /openapi.json``, nulls that mean the defaults, and ``n`` on ``/generate``, on one
real server.

The server runs with ``--api-key`` and ``--enable-metrics``, so that the document has
every route, the bearer scheme and the 401 answers; it is checked against the route
table of an app built in this process with the same flags.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
import transformers
from openai.types.chat.completion_create_params import (
    CompletionCreateParamsNonStreaming as ChatParams,
)
from openai.types.completion_create_params import (
    CompletionCreateParamsNonStreaming as CompletionParams,
)
from openapi_spec_validator import validate
from starlette.routing import Route
from typing_extensions import Required

from framework.config import ServerArgs
from framework.model_facts import ModelFacts
from framework.sampling_params import SamplingParams
from framework.server import openai as oai
from framework.server.app import OPEN_PATHS, ServerState, build_app
from framework.server.openapi_schema import openapi_path
from tests.server_harness import (
    ServerProcess,
    SharedPool,
    stream_events,
    wait_until_idle,
)

KEY = "sk-openapi"
PROMPT = "hello there"
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(ckpt: Path, shared: SharedPool) -> Iterator[ServerProcess]:
    with shared.server(ckpt, "--api-key", KEY, "--enable-metrics") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def document(server: ServerProcess) -> dict[str, Any]:
    # No key: the document is open, like /health.
    response = httpx.get(f"{server.base_url}/openapi.json", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _app_routes() -> dict[str, set[str]]:
    """Path -> methods of an app built here with the server's flags."""
    args = ServerArgs(model_path="unused", api_key=KEY, enable_metrics=True)
    state = ServerState(tokenizer_manager=None, server_args=args,  # type: ignore[arg-type]
                        model_name="m", model_path="unused",
                        model=ModelFacts(context_len=16, vocab_size=16,
                                           is_embedding=False, hidden_size=32))
    out = {}
    for route in build_app(state).routes:
        assert isinstance(route, Route)
        # Starlette adds HEAD to every GET route by itself; it is not part of the table.
        out[openapi_path(route.path)[0]] = {m.lower() for m in route.methods or ()} - {"head"}
    return out


def test_openapi_document_is_valid_and_covers_every_route(document: dict[str, Any]) -> None:
    validate(document)
    routes = _app_routes()
    assert {p: set(ops) for p, ops in document["paths"].items()} == routes
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in document["paths"].items():
        for op in ops.values():
            if path in OPEN_PATHS:
                assert op["security"] == [] and "401" not in op["responses"], path
            else:
                error = op["responses"]["401"]["content"]["application/json"]["schema"]
                assert error == {"$ref": "#/components/schemas/ErrorResponse"}, path
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert document["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
    error = document["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_request_schemas_carry_the_ranges(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "SamplingParams"):
        props = schemas[name]["properties"]
        assert props["temperature"]["minimum"] == 0 and props["temperature"]["maximum"] == 100
        assert props["top_p"]["exclusiveMinimum"] == 0 and props["top_p"]["maximum"] == 1
        assert props["n"]["minimum"] == 1 and props["n"]["maximum"] == 128
        assert props["seed"]["minimum"] == -(2**63) and props["seed"]["maximum"] == 2**64 - 1
        assert props["presence_penalty"]["maximum"] == 2
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["maximum"] == 20
    assert schemas["ChatCompletionRequest"]["properties"]["top_logprobs"]["maximum"] == 20
    generate = schemas["GenerateRequestBody"]["properties"]
    assert {"$ref": "#/components/schemas/SamplingParams"} in (
        generate["sampling_params"]["anyOf"])


# ------------------------------------------------------------------ null means the default


def _nullable(params: type, *, required: bool = False) -> set[str]:
    """The fields that the ``openai`` package's request type ``params`` marks Optional:
    those a client may leave out (or, with ``required``, those it must send)."""
    out = set()
    for name, hint in typing.get_type_hints(params, include_extras=True).items():
        if (typing.get_origin(hint) is Required) != required:
            continue
        if type(None) in typing.get_args(typing.get_args(hint)[0] if required else hint):
            out.add(name)
    return out


# Per route: its request struct, a body with what it requires, and the paths of the fields
# a client may send as null. The OpenAI routes' come from the ``openai`` package's types,
# every one of them: implemented (null is the default), known but not implemented (null is
# "not set", so not refused) and unknown here (ignored). ``stream_options.include_usage``
# is nullable in OpenAI's API reference, though not in the package's type. /generate's are
# those SGLang's ``GenerateReqInput`` marks Optional, and every field of ``sampling_params``.
NULLABLE: dict[str, tuple[type[msgspec.Struct], dict[str, Any], list[str]]] = {
    "/v1/completions": (oai.CompletionRequest, {"prompt": PROMPT},
                        [*sorted(_nullable(CompletionParams)), "stream_options.include_usage"]),
    "/v1/chat/completions": (oai.ChatCompletionRequest, {"messages": CHAT},
                             [*sorted(_nullable(ChatParams)), "stream_options.include_usage"]),
    "/generate": (oai.GenerateRequestBody, {"text": PROMPT},
                  ["input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num",
                   "logprob_start_len", "lora_path",
                   *(f"sampling_params.{name}" for name in SamplingParams.__struct_fields__)]),
}


def _with_null(base: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``base`` with the field at ``path`` (``name`` or ``parent.name``) null, and without it."""
    parent, _, name = path.rpartition(".")
    if parent:
        return {**base, parent: {name: None}}, {**base, parent: {}}
    return {**base, name: None}, base


def _as_read(route: str, body: dict[str, Any]) -> Any:
    """What ``route`` reads of ``body``: the decoded request, and on /generate the
    ``SamplingParams`` it builds from ``sampling_params``."""
    request = msgspec.json.decode(json.dumps(body), type=NULLABLE[route][0])
    if isinstance(request, oai.GenerateRequestBody):
        return (msgspec.structs.replace(request, sampling_params=None),
                SamplingParams.from_dict(request.sampling_params))
    return request


@pytest.mark.parametrize(("route", "path"), [(route, path) for route, (_, _, paths)
                                             in NULLABLE.items() for path in paths])
def test_a_null_field_reads_as_its_default(route: str, path: str) -> None:
    with_null, without = _with_null(NULLABLE[route][1], path)
    assert _as_read(route, with_null) == _as_read(route, without)


def test_the_only_nullable_field_openai_requires_is_the_prompt() -> None:
    """A null prompt is refused (tests/e2e/test_bad_requests.py): this server has no
    default prompt."""
    assert _nullable(CompletionParams, required=True) == {"prompt"}
    assert _nullable(ChatParams, required=True) == set()


def _all_null(route: str) -> dict[str, Any]:
    """A body of ``route`` with every nullable field null: each field of ``sampling_params``,
    and ``stream_options`` itself (its fields need ``stream: true``)."""
    base, paths = NULLABLE[route][1:]
    body = {**base, **{path: None for path in paths if "." not in path}}
    sampling = [path.split(".")[1] for path in paths if path.startswith("sampling_params.")]
    if sampling:
        body["sampling_params"] = dict.fromkeys(sampling)
    return body


def _validator(document: dict[str, Any], route: str) -> jsonschema.Draft202012Validator:
    """A validator of ``route``'s request body by /openapi.json (its ``$ref``s resolved)."""
    name = NULLABLE[route][0].__name__
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": document["components"]})


@pytest.mark.parametrize("route", sorted(NULLABLE))
def test_every_nullable_field_may_be_null_and_means_its_default(
        client: httpx.Client, document: dict[str, Any], route: str) -> None:
    body = _all_null(route)
    if route != "/generate":
        body["ignore_eos"] = True  # so that the default max_tokens is what is generated
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    validator = _validator(document, route)
    validator.validate(body)  # the document says null is allowed...
    hot = ({**body, "sampling_params": {"temperature": "hot"}} if route == "/generate"
           else {**body, "temperature": "hot"})
    assert not validator.is_valid(hot)  # ...and still refuses a value of the wrong type
    assert response.headers["content-type"].startswith("application/json")  # no stream
    answer = response.json()
    if route == "/generate":
        meta = answer["meta_info"]  # one object: n is 1
        assert "output_token_logprobs" not in meta
        assert meta["completion_tokens"] == 128 or meta["finish_reason"]["type"] == "stop"
        return
    [choice] = answer["choices"]
    assert choice["logprobs"] is None
    if route == "/v1/completions":
        assert answer["usage"]["completion_tokens"] == 16
    else:  # up to the context length (256)
        assert answer["usage"]["total_tokens"] == 256


def test_a_null_include_usage_sends_no_usage(client: httpx.Client,
                                             document: dict[str, Any]) -> None:
    route = "/v1/chat/completions"
    body = {"messages": CHAT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": None}}
    events = stream_events(client, route, body)
    _validator(document, route).validate(body)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


# ------------------------------------------------------------------ n on /generate


def _generate(client: httpx.Client, **sampling: Any) -> Any:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True,
                                                "n": 3, **sampling}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_n_returns_n_outputs(client: httpx.Client) -> None:
    greedy = _generate(client, temperature=0)
    assert isinstance(greedy, list) and len(greedy) == 3
    assert len({tuple(o["output_ids"]) for o in greedy}) == 1
    assert all(o["meta_info"]["completion_tokens"] == 6 for o in greedy)
    sampled = _generate(client, temperature=1.0, seed=7)
    assert len(sampled) == 3
    # Each choice samples with seed + its index, so the choices differ from one another...
    assert len({tuple(o["output_ids"]) for o in sampled}) > 1
    # ...and the same seed gives the same choices again.
    again = _generate(client, temperature=1.0, seed=7)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in sampled]
    # A batch of 2 prompts x n=2 is a flat list of 4, prompt-major.
    batch = client.post("/generate", json={
        "text": [PROMPT, "another prompt"],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}}).json()
    assert len(batch) == 4 and batch[0]["output_ids"] == batch[1]["output_ids"]
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


def test_generate_n_streams_every_index(client: httpx.Client) -> None:
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "n": 3,
                                "temperature": 1.0, "seed": 3}}
    events = stream_events(client, "/generate", body)
    assert events[-1] == "[DONE]"
    data = events[:-1]
    assert {e["index"] for e in data} == {0, 1, 2}
    finished = {e["index"] for e in data if e["meta_info"]["finish_reason"] is not None}
    assert finished == {0, 1, 2}
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


def test_generate_n_out_of_range_is_refused(client: httpx.Client) -> None:
    response = client.post("/generate", json={"text": PROMPT, "stream": True,
                                              "sampling_params": {"n": 129}})
    assert response.status_code == 400
    assert "n must be in [1, 128]" in response.json()["error"]["message"]


def test_generate_takes_per_prompt_lists(client: httpx.Client) -> None:
    """A batch may give each prompt its own sampling_params, rid and logprob options."""
    body = {"text": [PROMPT, "another prompt"], "rid": ["first-rid", "second-rid"],
            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                {"max_new_tokens": 5, "ignore_eos": True}],
            "return_logprob": [True, False], "top_logprobs_num": [2, 0]}
    first, second = client.post("/generate", json=body).json()
    assert [first["meta_info"]["id"], second["meta_info"]["id"]] == ["first-rid", "second-rid"]
    assert [first["meta_info"]["completion_tokens"],
            second["meta_info"]["completion_tokens"]] == [2, 5]
    assert len(first["meta_info"]["output_token_logprobs"]) == 2
    assert all(len(row) == 2 for row in first["meta_info"]["output_top_logprobs"])
    assert "output_token_logprobs" not in second["meta_info"]
    # With a prompt of n = 2, its choices carry no rid; the other prompt keeps its own.
    fanned = client.post("/generate", json={
        "text": [PROMPT, "another prompt"], "rid": ["a-rid", "b-rid"],
        "sampling_params": [{"max_new_tokens": 1, "n": 2}, {"max_new_tokens": 1}]}).json()
    ids = [o["meta_info"]["id"] for o in fanned]
    assert len(ids) == 3 and "a-rid" not in ids and ids[2] == "b-rid"
    assert wait_until_idle(client)["kv_cache_idle_and_free"] is True


def test_generate_logprob_entries_carry_token_texts_when_asked(client: httpx.Client,
                                                               ckpt: Path) -> None:
    """``[logprob, token_id, text]`` triples: ``text`` is null unless
    ``return_text_in_logprobs``, then the token decoded alone, for every kind of entry."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    body = {"text": "héllo wörld, 日本", "return_logprob": True, "top_logprobs_num": 3,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    plain = client.post("/generate", json=body).json()["meta_info"]
    named = client.post("/generate", json={**body, "return_text_in_logprobs": True}).json()
    meta = named["meta_info"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    rows = [row for row in meta["input_top_logprobs"] + meta["output_top_logprobs"] if row]
    assert len(entries) == meta["prompt_tokens"] + 6 and len(rows) == len(entries) - 1
    every = entries + [entry for row in rows for entry in row]
    assert [text for _, _, text in every] == [tokenizer.decode([tid]) for _, tid, _ in every]
    assert any(text.strip() for _, _, text in every)
    # The same answer otherwise, with null texts.
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [entry[:2] for entry in plain[key]] == [entry[:2] for entry in meta[key]]
        assert all(text is None for _, _, text in plain[key])
    response = client.post("/generate", json={**body, "return_text_in_logprobs": "yes"})
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("field", ["sampling_params", "rid", "return_logprob",
                                   "top_logprobs_num", "logprob_start_len"])
def test_generate_lists_of_the_wrong_length_are_refused(client: httpx.Client,
                                                        field: str) -> None:
    one = {"sampling_params": {}, "rid": "x", "return_logprob": True, "top_logprobs_num": 1,
           "logprob_start_len": 0}[field]
    body = {"text": [PROMPT, "another prompt"], field: [one] * 3}
    if field == "logprob_start_len":
        body["return_logprob"] = True
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert f"{field} has 3 entries for 2 prompt(s)" in error["message"]
