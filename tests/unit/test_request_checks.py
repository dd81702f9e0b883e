"""Where a generation request is checked, and against what.

Once per API request: ``SamplingParams.verify`` runs once for an OpenAI request whatever
its prompts and choices, at most once per prompt on ``/generate``, and once for a request
handed to the TokenizerManager directly. Against ranges declared once: a change to the
table shows in ``verify()``'s refusals, in their messages and in ``/openapi.json``.

The Scheduler and the Detokenizer are played by the test over the inproc transport.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from framework.config import PortArgs, ServerArgs
from framework.messages import BatchStrOutput, FinishReason, TokenizedGenerateReqInput
from framework.model_facts import ModelFacts
from framework.registry import create_codec, create_transport
from framework.runtime.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager
from framework.sampling_params import (
    MAX_N,
    REQUEST_RANGES,
    SAMPLING_RANGES,
    Range,
    SamplingParams,
    check_top_logprobs_num,
)
from framework.server import openai as oai
from framework.server.app import ServerState, build_app
from framework.server.openapi_schema import RouteSpec, build_openapi
from tests.model_fixtures import TINY_VOCAB_SIZE, make_tiny_tokenizer

CODEC = "msgpack"
CONTEXT = 64
# A liveness bound only: every wait below ends as soon as what it waits for happens.
DEADLINE_S = 20.0
CHAT = [{"role": "user", "content": "hello"}]


# --------------------------------------------------------------------------- checked once


class AnsweringRuntime:
    """Plays the Scheduler and the Detokenizer: answers each request with one token."""

    def __init__(self, transport: Any, port_args: PortArgs) -> None:
        self.inbox = transport.receiver(port_args.scheduler_input, create_codec(CODEC))
        self.outputs = transport.sender(port_args.tokenizer_input, create_codec(CODEC))
        self.requests: list[TokenizedGenerateReqInput] = []

    async def serve(self) -> None:
        """Answer every request the manager sends, until cancelled."""
        while True:
            msg = await self.inbox.recv()
            if not isinstance(msg, TokenizedGenerateReqInput):
                continue
            self.requests.append(msg)
            self.outputs.send_nowait(BatchStrOutput(
                handles=[msg.handle], finished_reasons=[FinishReason("length")],
                output_strs=[" x"], output_ids=[[7]], prompt_tokens=[len(msg.input_ids)],
                completion_tokens=[1], cached_tokens=[0]))

    def close(self) -> None:
        self.inbox.close()
        self.outputs.close()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]]:
    """A manager with a tokenizer, the runtime that answers it, and the list of every
    ``SamplingParams`` that ``verify()`` ran on, in order."""
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="inproc", codec=CODEC),
                          port_args, transport, tokenizer=make_tiny_tokenizer(),
                          model=ModelFacts(context_len=CONTEXT, vocab_size=TINY_VOCAB_SIZE,
                                           is_embedding=False, hidden_size=32))
    runtime = AnsweringRuntime(transport, port_args)
    verified: list[SamplingParams] = []
    verify = SamplingParams.verify

    def counting_verify(self: SamplingParams, vocab_size: int | None = None) -> None:
        verified.append(self)
        verify(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "verify", counting_verify)
    yield tm, runtime, verified
    runtime.close()
    port_args.cleanup()


async def _serving(tm: TokenizerManager, runtime: AnsweringRuntime, work: Any) -> Any:
    """``work``'s result, awaited while the runtime answers the manager."""
    tm.start()
    answering = asyncio.create_task(runtime.serve())
    try:
        return await asyncio.wait_for(work, DEADLINE_S)
    finally:
        answering.cancel()
        await asyncio.gather(answering, return_exceptions=True)
        await tm.close()


def _post(tm: TokenizerManager, runtime: AnsweringRuntime, path: str,
          body: dict[str, Any]) -> httpx.Response:
    """``POST path`` to an app over ``tm``, in this process."""
    app = build_app(ServerState(tokenizer_manager=tm, server_args=tm.server_args,
                                model_name="tiny", model_path="unused", model=tm.model))

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(_serving(tm, runtime, post()))


def test_a_completions_request_of_two_prompts_and_three_choices_is_verified_once(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    tm, runtime, verified = served
    response = _post(tm, runtime, "/v1/completions",
                     {"prompt": ["hello", "world"], "n": 3, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 6
    assert len(runtime.requests) == 6
    assert len(verified) == 1


def test_a_chat_request_of_two_choices_is_verified_once(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    tm, runtime, verified = served
    response = _post(tm, runtime, "/v1/chat/completions",
                     {"messages": CHAT, "n": 2, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
    assert len(verified) == 1


def test_a_generate_request_is_verified_at_most_once_per_prompt(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    tm, runtime, verified = served
    response = _post(tm, runtime, "/generate",
                     {"text": ["hello", "world"],
                      "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert response.status_code == 200, response.text
    assert len(response.json()) == 4
    assert 1 <= len(verified) <= 2


def test_a_request_handed_to_the_manager_directly_is_verified_once(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    tm, runtime, verified = served
    req = GenerateRequest(text="hello", sampling_params=SamplingParams(max_new_tokens=1))
    out = asyncio.run(_serving(tm, runtime, tm.generate_one(req)))
    assert out.text == " x"
    assert verified == [req.sampling_params]


def test_choices_are_derived_from_their_checked_request_without_a_check_each(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    """Prompts that share their parameters (as an OpenAI request's do) are verified once;
    each choice differs from its request only in n and seed."""
    tm, _, verified = served
    params = SamplingParams(n=3, seed=5, max_new_tokens=1)
    reqs = [GenerateRequest(input_ids=[3, 4], sampling_params=params),
            GenerateRequest(input_ids=[5], sampling_params=params)]
    prepared = asyncio.run(tm.prepare_choices(reqs))
    assert verified == [params]
    assert [p.req.sampling_params.seed for p in prepared] == [5, 6, 7, 5, 6, 7]
    assert all(p.req.sampling_params.n == 1 for p in prepared)
    assert [p.input_ids for p in prepared] == [[3, 4]] * 3 + [[5]] * 3


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(n=MAX_N + 1), rf"n must be in \[1, {MAX_N}\], got {MAX_N + 1}"),
    (SamplingParams(n=2, temperature=-1.0), r"temperature must be in \[0, 100\]"),
])
def test_a_request_of_several_choices_is_refused_as_a_whole(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]],
        params: SamplingParams, message: str) -> None:
    tm, _, verified = served
    with pytest.raises(RequestError, match=message):
        asyncio.run(tm.prepare_choices([GenerateRequest(input_ids=[3], sampling_params=params)]))
    assert verified == [params]
    assert not tm.rid_to_state


def test_a_request_sent_alone_must_be_one_sequence(
        served: tuple[TokenizerManager, AnsweringRuntime, list[SamplingParams]]) -> None:
    tm, _, _ = served
    with pytest.raises(RequestError, match="must be fanned out into its choices"):
        asyncio.run(tm.prepare(GenerateRequest(input_ids=[3],
                                               sampling_params=SamplingParams(n=2))))


# --------------------------------------------------------------------------- declared once


async def _handler(request: Request) -> Response:
    return Response()


def _schemas() -> dict[str, Any]:
    """The component schemas of /openapi.json, for the routes that take sampling values."""
    bodies = [oai.CompletionRequest, oai.ChatCompletionRequest, oai.GenerateRequestBody]
    specs = [RouteSpec(f"/{body.__name__}", _handler, ("POST",), body.__name__, body)
             for body in bodies]
    return build_openapi(specs, api_key=False, open_paths=())["components"]["schemas"]


def _accepts(field: str, value: float) -> bool:
    try:
        SamplingParams(**{field: value}).verify()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("field", sorted(SAMPLING_RANGES))
def test_the_schema_states_where_verify_starts_refusing(field: str) -> None:
    """Each end in the generated schema is the last value ``verify()`` accepts (or, for
    an exclusive end, the first it refuses), and each ``const`` is a value it accepts."""
    bounds = _schemas()["SamplingParams"]["properties"][field]
    step = 1 if SAMPLING_RANGES[field].integer else 1e-3
    if SAMPLING_RANGES[field].special:  # an anyOf: the special values, then the range
        *specials, bounds = bounds["anyOf"]
        assert all(_accepts(field, special["const"]) for special in specials)
    if "minimum" in bounds:
        assert _accepts(field, bounds["minimum"])
        assert not _accepts(field, bounds["minimum"] - step)
    if "exclusiveMinimum" in bounds:
        assert not _accepts(field, bounds["exclusiveMinimum"])
        assert _accepts(field, bounds["exclusiveMinimum"] + step)
    if field == "min_new_tokens":
        return  # its top is also max_new_tokens, whose own maximum is checked
    assert _accepts(field, bounds["maximum"])
    assert not _accepts(field, bounds["maximum"] + step)


def test_a_changed_range_changes_the_schema_and_the_refusals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SAMPLING_RANGES, "n", Range(1, 4, integer=True))
    monkeypatch.setitem(SAMPLING_RANGES, "temperature",
                        Range(0.0, 50.0, low_open=True, note="a note"))
    monkeypatch.setitem(SAMPLING_RANGES, "top_k", Range(
        2, 9, integer=True, special=((-1, "off"), (0, "none"))))
    monkeypatch.setitem(SAMPLING_RANGES, "max_new_tokens", Range(0, 1000, integer=True))
    monkeypatch.setitem(REQUEST_RANGES, "top_logprobs_num", Range(0, 5, integer=True))
    schemas = _schemas()
    for name in ("CompletionRequest", "ChatCompletionRequest", "SamplingParams"):
        props = schemas[name]["properties"]
        assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 4)
        assert props["temperature"]["exclusiveMinimum"] == 0
        assert "minimum" not in props["temperature"]
        assert props["top_k"]["anyOf"] == [{"const": -1}, {"const": 0},
                                           {"minimum": 2, "maximum": 9}]
    assert schemas["SamplingParams"]["properties"]["max_new_tokens"]["maximum"] == 1000
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] == 1000
    assert schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"][
        "maximum"] == 1000
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["maximum"] == 5
    assert schemas["ChatCompletionRequest"]["properties"]["top_logprobs"]["maximum"] == 5
    assert schemas["GenerateRequestBody"]["properties"]["top_logprobs_num"]["maximum"] == 5

    refusals = [
        (lambda: SamplingParams(n=5).verify(), "n must be in [1, 4], got 5"),
        (lambda: SamplingParams(temperature=0.0).verify(),
         "temperature must be in (0, 50] (a note), got 0.0"),
        (lambda: SamplingParams(top_k=1).verify(),
         "top_k must be -1 (off) or 0 (none) or in [2, 9], got 1"),
        (lambda: SamplingParams(max_new_tokens=1001).verify(),
         "max_new_tokens must be in [0, 1000], got 1001"),
        (lambda: oai.CompletionRequest(prompt="x").sampling_params(1001, 16, "max_tokens"),
         "max_tokens must be in [0, 1000], got 1001"),
        (lambda: check_top_logprobs_num(6, "logprobs"),
         "logprobs must be an integer in [0, 5], got 6"),
    ]
    for refuse, message in refusals:
        with pytest.raises(ValueError, match=re.escape(message)):
            refuse()
    SamplingParams(n=4, temperature=50.0, top_k=0, max_new_tokens=1000).verify()
    check_top_logprobs_num(5)
