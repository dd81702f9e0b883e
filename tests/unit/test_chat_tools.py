"""A chat request's tool fields (``ChatTools``, ``constrain``) and a choice's answer shaped
from its text (``ChoiceOutput``), without a server."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from framework.constrained.base import InvalidConstraintError
from framework.reasoning_parsers import Qwen3ReasoningParser
from framework.registry import TOOL_PARSERS
from framework.sampling_params import FieldError, SamplingParams
from framework.server.chat_output import ChoiceOutput
from framework.server.chat_tools import (
    ChatTools,
    ToolDef,
    constrain,
    keep_markers,
    reasoning_markers,
    template_kwargs,
    thinking_on,
)
from framework.server.openai import ChatCompletionRequest, chat_conversation

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tools(*defs: dict[str, Any]) -> list[ToolDef]:
    return msgspec.convert(list(defs), list[ToolDef])


def test_tools_default_to_auto_and_need_a_parser() -> None:
    auto = ChatTools.of(tools(WEATHER), None, True, "hermes")
    assert (auto.parser, auto.grammar) == ("hermes", None)
    assert auto.template_tools == [{"type": "function", "function": WEATHER["function"]}]
    assert [s.name for s in auto.specs] == ["get_weather"]
    with pytest.raises(FieldError) as refused:
        ChatTools.of(tools(WEATHER), "auto", True, None)
    assert refused.value.param == "tools"


def test_none_shows_the_tools_but_parses_nothing() -> None:
    none = ChatTools.of(tools(WEATHER), "none", True, "hermes")
    assert none.template_tools is not None and none.new_parser() is None
    assert ChatTools.of(None, None, True, None).template_tools is None


def test_required_and_named_choices_get_a_grammar_of_their_tools() -> None:
    required = ChatTools.of(tools(WEATHER, TIME), "required", True, "hermes")
    named = ChatTools.of(tools(WEATHER, TIME),
                         {"type": "function", "function": {"name": "get_time"}}, True, "hermes")
    assert required.grammar and named.grammar
    assert "get_weather" in required.grammar and "get_time" in required.grammar
    assert "get_time" in named.grammar and "get_weather" not in named.grammar


@pytest.mark.parametrize(("defs", "choice", "parser", "param"), [
    ((), "required", "hermes", "tool_choice"),
    ((WEATHER,), {"type": "function", "function": {"name": "other"}}, "hermes", "tool_choice"),
    ((WEATHER,), {"type": "function"}, "hermes", "tool_choice"),
    ((WEATHER,), "always", "hermes", "tool_choice"),
    ((WEATHER,), "required", "pythonic", "tool_choice"),
    ((WEATHER, {"type": "code", "function": {"name": "x"}}), "auto", "hermes", "tools[1].type"),
    ((WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}),
     "required", "hermes", "tools[1].function.parameters"),
])
def test_bad_tool_fields_name_the_field(defs: tuple[dict[str, Any], ...], choice: Any,
                                        parser: str, param: str) -> None:
    with pytest.raises((FieldError, InvalidConstraintError)) as refused:
        ChatTools.of(tools(*defs) if defs else None, choice, True, parser)
    assert refused.value.param == param, refused.value


def test_a_named_tool_s_unenforceable_schema_is_named_by_its_place_in_tools() -> None:
    bad = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
    with pytest.raises(InvalidConstraintError) as refused:
        ChatTools.of(tools(WEATHER, bad), {"type": "function", "function": {"name": "bad"}},
                     True, "hermes")
    assert refused.value.param == "tools[1].function.parameters"
    assert "uniqueItems" in str(refused.value)


def test_the_grammar_excludes_another_constraint_and_follows_the_reasoning() -> None:
    required = ChatTools.of(tools(WEATHER), "required", False, "hermes")
    params = SamplingParams(json_schema='{"type": "object"}')
    with pytest.raises(FieldError) as refused:
        constrain(params, required, None, False)
    assert refused.value.param == "tool_choice"
    params = SamplingParams()
    constrain(params, required, None, False)
    assert params.constraint() == ("ebnf", required.grammar)
    reasoned = SamplingParams()
    constrain(reasoned, required, "qwen3", False)
    kind, grammar = reasoned.constraint() or ("", "")
    assert kind == "ebnf" and "<think>" in grammar and grammar != required.grammar


def test_only_response_format_waits_for_the_reasoning() -> None:
    none = ChatTools.of(None, None, True, None)
    schema = '{"type": "object"}'
    raw = SamplingParams(json_schema=schema)
    constrain(raw, none, "qwen3", False)  # SGLang's field: the whole output
    assert raw.constraint() == ("json_schema", schema)
    formatted = SamplingParams(json_schema=schema)
    constrain(formatted, none, "qwen3", True)
    assert formatted.json_schema is None and formatted.ebnf and "think" in formatted.ebnf
    off = SamplingParams(json_schema=schema)
    constrain(off, none, None, True)  # thinking off: nothing to wait for
    assert off.constraint() == ("json_schema", schema)


def test_template_kwargs_switch_thinking_and_may_not_set_the_call_s_arguments() -> None:
    assert thinking_on(template_kwargs(None))
    assert not thinking_on(template_kwargs({"enable_thinking": False}))
    assert not thinking_on({"thinking": False}) and thinking_on({"enable_thinking": True})
    with pytest.raises(FieldError) as refused:
        template_kwargs({"tokenize": False})
    assert refused.value.param == "chat_template_kwargs"


def test_history_calls_reach_the_template_with_object_arguments() -> None:
    body = msgspec.json.decode(json.dumps({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]}), type=ChatCompletionRequest)
    conversation = chat_conversation(body.messages)
    assert conversation[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}
    assert conversation[2] == {"role": "tool", "content": "21C", "tool_call_id": "call_1"}


def shaper(reasoning: bool = False, parsed: bool = True) -> ChoiceOutput:
    parser = TOOL_PARSERS.get("hermes")(ChatTools.of(tools(WEATHER), None, True,
                                                     "hermes").specs) if parsed else None
    return ChoiceOutput(Qwen3ReasoningParser() if reasoning else None, parser)


def test_a_whole_answer_splits_reasoning_content_and_calls() -> None:
    text = f"<think>cold?</think>Checking.\n{CALL}"
    out = shaper(reasoning=True)
    message = out.message(text)
    assert message["reasoning_content"] == "cold?" and message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    plain = ChoiceOutput(None, None)
    assert plain.message(text) == {"role": "assistant", "content": text}
    assert plain.finish_reason("stop") == "stop"


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_stream_gives_the_same_answer_in_openai_s_delta_shape(step: int) -> None:
    text = f"<think>cold?</think>Checking.\n{CALL}"
    out = shaper(reasoning=True)
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [out.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    joined = {key: "".join(d.get(key) or "" for d in deltas)
              for key in ("reasoning_content", "content")}
    assert (joined["reasoning_content"].strip(), joined["content"].strip()) == (
        "cold?", "Checking.")
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    assert entries[0]["id"].startswith("call_") and entries[0]["function"]["name"] == \
        "get_weather"
    assert all("id" not in e and "name" not in e["function"] for e in entries[1:])
    assert {e["index"] for e in entries} == {0}
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Paris"}'
    assert out.finish_reason("stop") == "tool_calls"


def test_without_parsers_a_stream_is_its_text() -> None:
    assert ChoiceOutput(None, None).feed("a<tool_call>", final=False) == {"content": "a<tool_call>"}


def test_a_marker_held_as_a_special_token_keeps_special_tokens_in_the_text() -> None:
    from tests.model_fixtures import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    hermes = ChatTools.of(tools(WEATHER), None, True, "hermes")
    params = SamplingParams()
    keep_markers(params, hermes.markers + reasoning_markers("qwen3"), tokenizer)
    assert params.skip_special_tokens  # spelled in plain tokens here
    tokenizer.add_special_tokens({"additional_special_tokens": ["</think>"]})
    keep_markers(params, hermes.markers, tokenizer)
    assert params.skip_special_tokens
    keep_markers(params, reasoning_markers("qwen3"), tokenizer)
    assert not params.skip_special_tokens
    assert reasoning_markers(None) == () and ChatTools.of(None, None, True, None).markers == ()
