"""Tool calling and reasoning on the chat API, through the official ``openai`` client.

One server on a tiny random Llama with a tool-aware chat template (Hermes' call
format), ``--tool-call-parser hermes`` and ``--reasoning-parser qwen3``:
``tool_choice`` ``"required"`` and a named function constrain a random model to
valid calls (arguments checked with ``jsonschema``), streamed and not; ``auto``
parses calls out of crafted outputs (a ``regex`` forces the text); a whole round
trip renders its history through the template as transformers does; reasoning
is split into ``reasoning_content``; bad tool fields are a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
import transformers

from framework.runtime.prompt_input import chat_template_ids
from framework.server import openai as oai
from framework.server.chat_tools import tools_for_template
from tests.server_harness import ServerProcess, SharedPool, wait_until_idle

# Hermes' format (as Qwen 2.5 writes it): the tools in the system turn, each call in
# <tool_call> tags, each result in <tool_response> tags; Qwen 3's switch of thinking.
TOOLS_TEMPLATE = """\
{%- if tools %}<|system|>You can call these functions; write each call as \
<tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call>.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>\
{{ message.content or '' }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif message.role == 'tool' %}<|tool|><tool_response>
{{ message.content }}
</tool_response>
{% else %}<|{{ message.role }}|>{{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>\
{%- if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["zone", "hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# A schema a grammar cannot enforce ("if" is refused by the structured outputs).
UNENFORCEABLE = {"type": "object", "properties": {"a": {"type": "boolean"}},
                 "if": {"required": ["a"]}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(10)
# A call as the model writes it in Hermes' format.
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "c"}}\n</tool_call>')


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    # The tiny vocabulary spells the tools' definitions in some 500 tokens.
    return tiny_checkpoint("llama", seed=4, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(shared: SharedPool, model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("tools-template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    with shared.server(model_dir, "--chat-template", str(template), "--served-model-name",
                       "tiny", "--tool-call-parser", "hermes", "--reasoning-parser",
                       "qwen3") as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def no_thinking() -> dict[str, Any]:
    """The request's switch that turns the template's thinking off (and the parser)."""
    return {"chat_template_kwargs": {"enable_thinking": False}}


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    """Each call names one of ``names`` and its arguments satisfy that tool's schema."""
    assert calls
    for name, arguments in calls:
        assert name in names, name
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[str, str], list[Any], str]:
    """A streamed chat's joined content and reasoning, its calls rebuilt from their deltas
    (id and name first, argument fragments after), and its finish reason."""
    text = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        text["content"] += delta.content or ""
        text["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        for part in delta.tool_calls or []:
            if part.index not in calls:
                assert part.id and part.function.name, "a call's first delta names it"
                calls[part.index] = {"id": part.id, "name": part.function.name,
                                     "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def calls_made(client: openai.OpenAI, stream: bool, **args: Any
               ) -> tuple[str | None, list[tuple[str, str]]]:
    """The finish reason and the (name, arguments) calls of one chat, streamed or not."""
    if stream:
        _, calls, finish = streamed(client, **args)
        return finish, [(c["name"], c["arguments"]) for c in calls]
    choice = client.chat.completions.create(**args).choices[0]
    calls = choice.message.tool_calls or []
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    return choice.finish_reason, [(c.function.name, c.function.arguments) for c in calls]


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("choice", "names"), [
    ("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})],
    ids=["required", "named"])
def test_required_and_named_choices_give_valid_calls(
        client: openai.OpenAI, stream: bool, choice: Any, names: set[str]) -> None:
    finished = 0
    for seed in SEEDS:
        # One call each: one or more (below) may run to max_tokens on a random model.
        finish, pairs = calls_made(
            client, stream, model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=256,
            extra_body=no_thinking())
        if finish == "tool_calls":
            finished += 1
            assert len(pairs) == 1
            check_calls(pairs, names)
    assert finished >= 9, finished


def test_parallel_calls_are_each_valid(client: openai.OpenAI) -> None:
    counts = []
    for seed in SEEDS:
        choice = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=seed, max_tokens=256, extra_body=no_thinking()).choices[0]
        calls = choice.message.tool_calls or []
        # Cut by max_tokens, the unfinished last call stays text; the others are whole.
        check_calls([(c.function.name, c.function.arguments) for c in calls],
                    {"get_weather", "get_time"})
        assert choice.finish_reason == ("tool_calls" if not choice.message.content
                                        else "length")
        counts.append(len(calls))
    assert max(counts) > 1, counts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_the_calls_a_model_writes(client: openai.OpenAI, stream: bool) -> None:
    # A regex forces the model's text: content, then a call in Hermes' format.
    forced = "Let me check\\.\n" + re.escape(CALL_TEXT)
    args = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=100,
                extra_body={"regex": forced})
    if stream:
        text, calls, finish = streamed(client, **args)
        content = text["content"].strip()
    else:
        choice = client.chat.completions.create(**args).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
    assert finish == "tool_calls"
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})]


def test_without_tools_or_with_none_the_call_stays_text(client: openai.OpenAI) -> None:
    forced = re.escape(CALL_TEXT)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = client.chat.completions.create(
            model="tiny", messages=ASK, temperature=0, max_tokens=100,
            extra_body={"regex": forced}, **extra).choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content == CALL_TEXT
        assert not choice.message.tool_calls


ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_a_round_trip_renders_its_history_as_transformers_does(
        client: openai.OpenAI, server: ServerProcess, model_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE
    # transformers' way: the call's arguments as an object.
    expected_messages = json.loads(json.dumps(ROUND_TRIP))
    expected_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris",
                                                                      "unit": "c"}
    expected = tokenizer.apply_chat_template(expected_messages, tools=TOOLS,
                                             add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if isinstance(expected, Mapping) else expected)
    text = tokenizer.decode(expected)
    assert '"arguments": {"city": "Paris", "unit": "c"}' in text and "<tool_response>" in text
    # The server's way, from the request body the client sends.
    body = msgspec.json.decode(json.dumps({"messages": ROUND_TRIP, "tools": TOOLS}),
                               type=oai.ChatCompletionRequest)
    ours = chat_template_ids(tokenizer, oai.chat_conversation(body.messages),
                             tools_for_template(body.tools or []))
    assert ours == expected
    reply = client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS,
                                           temperature=0, max_tokens=5)
    assert reply.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_the_answer(client: openai.OpenAI, stream: bool) -> None:
    args = dict(model="tiny", messages=ASK, temperature=0, max_tokens=100,
                extra_body={"regex": "<think>\nI should greet\\.\n</think>\n\nHello there!"})
    if stream:
        text, _, finish = streamed(client, **args)
        reasoning, content = text["reasoning_content"].strip(), text["content"].strip()
    else:
        choice = client.chat.completions.create(**args).choices[0]
        message, finish = choice.message, choice.finish_reason
        reasoning, content = message.reasoning_content, message.content
    assert finish == "stop"
    assert (reasoning, content) == ("I should greet.", "Hello there!")


def test_thinking_off_leaves_the_text_as_content(client: openai.OpenAI) -> None:
    forced = "<think>x</think>y"
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=50,
        extra_body={"regex": forced, **no_thinking()}).choices[0]
    assert choice.message.content == forced
    assert choice.message.reasoning_content is None


def test_response_format_applies_after_the_reasoning(client: openai.OpenAI) -> None:
    # Qwen 3's reasoning opens with <think>: the grammar makes the model open it first, and
    # what follows is reasoning until it closes it.
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=20,
        response_format={"type": "json_object"}).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert choice.message.reasoning_content


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, {"type": "function", "function": {
        "name": "bad", "parameters": UNENFORCEABLE}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server: ServerProcess,
                                                    body: dict[str, Any], param: str) -> None:
    request = {"model": "tiny", "messages": ASK, "max_tokens": 4, **body}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=request)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.json()
        assert wait_until_idle(http)["kv_cache_idle_and_free"] is True


def test_tools_without_a_tool_call_parser_are_a_400(tiny_server: ServerProcess) -> None:
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools" and "--tool-call-parser" in error["message"]
