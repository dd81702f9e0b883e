"""Tool-call parsers: whole outputs and streams split into content and OpenAI tool calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.registry import TOOL_PARSERS
from framework.tool_parsers.base import Delta, ParsedOutput, ToolCall, ToolParser, ToolSpec
from framework.tool_parsers.hermes import HermesToolParser
from framework.tool_parsers.llama3 import Llama3ToolParser
from framework.tool_parsers.mistral import MistralToolParser
from framework.tool_parsers.pythonic import PythonicToolParser

HERMES, LLAMA3, MISTRAL, PYTHONIC = (HermesToolParser, Llama3ToolParser, MistralToolParser,
                                     PythonicToolParser)
PARSERS = [HERMES, LLAMA3, MISTRAL, PYTHONIC]
TOOLS = [ToolSpec("get_weather"), ToolSpec("get_time")]

PARIS = {"city": "Paris"}
RICH = {"city": "São Paulo", "days": 3, "units": None, "flags": [True, False],
        "nested": {"a": [1, 2.5, {"b": "x"}], "e": {}}, "quote": 'He said "hi" \\ ok\n',
        "emoji": "☀ 😀"}
LONG = {f"key{i}": f"value number {i}" for i in range(20)}


def write(parser: type[ToolParser], calls: list[tuple[str, dict[str, Any]]],
          before: str = "", after: str = "") -> str:
    """An output as the parser's model family writes it: content, calls, content."""
    if parser is HERMES:
        body = "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a},
                                                      ensure_ascii=False) + "\n</tool_call>"
                         for n, a in calls)
    elif parser is LLAMA3:
        body = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)
    elif parser is MISTRAL:
        body = "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                           ensure_ascii=False)
    else:
        body = "[" + ", ".join(n + "(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"
    return before + body + after


def expected(calls: list[tuple[str, dict[str, Any]]]) -> list[ToolCall]:
    """The calls as a parse gives them: compact JSON arguments."""
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


def stream(parser: type[ToolParser], pieces: list[str], tools: list[ToolSpec] = TOOLS
           ) -> list[Delta]:
    """The deltas of one fresh parser fed ``pieces`` and finished."""
    instance = parser(tools)
    deltas = [d for piece in pieces for d in instance.feed(piece)]
    return deltas + instance.finish()


def check_stream(parser: type[ToolParser], text: str, pieces: list[str],
                 tools: list[ToolSpec] = TOOLS) -> None:
    """The stream of ``pieces`` (of ``text``) carries the content and calls of a parse."""
    assert "".join(pieces) == text
    whole = parser(tools).parse(text)
    deltas = stream(parser, pieces, tools)
    content = "".join(d.content for d in deltas if d.content is not None)
    assert content == (whole.content or "")
    calls: list[list[Delta]] = []
    for delta in (d for d in deltas if d.content is None):
        if delta.index == len(calls):
            calls.append([])
        assert delta.index == len(calls) - 1  # calls arrive in order, one after another
        calls[-1].append(delta)
    assert [(c[0].name, "".join(d.arguments for d in c)) for c in calls] == \
        [(call.name, call.arguments) for call in whole.calls]
    assert all(d.name is None for c in calls for d in c[1:])


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every split into two pieces, one character at a time, and a few random splits."""
    rng = random.Random(seed)
    result = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    result.append(list(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return result


# (parser, calls, content before, content after, parsed content).
REALISTIC = [
    (HERMES, [("get_weather", PARIS)], "Let me check.\n", "", "Let me check."),
    (HERMES, [("get_weather", PARIS), ("get_time", {"zone": "UTC"})], "", "", None),
    (HERMES, [("get_weather", RICH)], "", "\nAnything else?", "Anything else?"),
    (HERMES, [], "Paris is sunny; no <tool_ needed.", "", "Paris is sunny; no <tool_ needed."),
    (LLAMA3, [("get_weather", PARIS)], "", "", None),
    (LLAMA3, [("get_weather", PARIS), ("get_time", {})], "<|python_tag|>", "", None),
    (LLAMA3, [("get_weather", RICH)], "  ", "", None),
    (LLAMA3, [("get_time", {})], "", " I called it.", "I called it."),
    (LLAMA3, [], "It is {sunny} in Paris.", "", "It is {sunny} in Paris."),
    (MISTRAL, [("get_weather", PARIS)], "Sure. ", "", "Sure."),
    (MISTRAL, [("get_weather", PARIS), ("get_time", {"zone": "UTC"})], "", "", None),
    (MISTRAL, [("get_weather", RICH)], "", " Done.", "Done."),
    (MISTRAL, [], "See [1] and [TOOL] here.", "", "See [1] and [TOOL] here."),
    (PYTHONIC, [("get_weather", PARIS)], "", "", None),
    (PYTHONIC, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
     "<|python_start|>", "<|python_end|>", None),
    (PYTHONIC, [("get_weather", RICH)], " ", "\nDone.", "Done."),
    (PYTHONIC, [], "[1] is a citation (see below).", "", "[1] is a citation (see below)."),
]
REALISTIC_IDS = [f"{case[0].__name__}-{i}" for i, case in enumerate(REALISTIC)]


@pytest.mark.parametrize(("parser", "calls", "before", "after", "content"), REALISTIC,
                         ids=REALISTIC_IDS)
def test_parse_realistic(parser: type[ToolParser], calls: list[tuple[str, dict[str, Any]]],
                         before: str, after: str, content: str | None) -> None:
    """Content around the calls and the calls with compact JSON arguments."""
    text = write(parser, calls, before, after) if calls else before
    assert parser(TOOLS).parse(text) == ParsedOutput(content, expected(calls))


@pytest.mark.parametrize(("parser", "calls", "before", "after", "content"), REALISTIC,
                         ids=REALISTIC_IDS)
def test_stream_matches_parse_for_every_split(parser: type[ToolParser],
                                              calls: list[tuple[str, dict[str, Any]]],
                                              before: str, after: str, content: str | None
                                              ) -> None:
    """Any split of the output streams the content and calls that a parse gives."""
    text = write(parser, calls, before, after) if calls else before
    for pieces in splits(text):
        check_stream(parser, text, pieces)


# (parser, malformed output, whether it is known malformed before the call is announced):
# all of it stays content; a stream announces no call for the early ones.
MALFORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>', False),
    (HERMES, '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', True),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', True),
    (HERMES, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', True),
    (HERMES, '<tool_call>\n["get_weather"]\n</tool_call>', True),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call', False),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"a": 1, "a": 2}}</tool_call>',
     False),
    (LLAMA3, '{"name": "get_weather", "parameters": [1]}', True),
    (LLAMA3, '{"answer": 42}', True),
    (LLAMA3, '{"name": "launch", "parameters": {}}', True),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Pa', False),
    (LLAMA3, 'Sure: {"name": "get_weather", "parameters": {}}', True),
    (LLAMA3, "<|python_tag|>print(1)", True),
    (MISTRAL, "[TOOL_CALLS] not json", True),
    (MISTRAL, "[TOOL_CALLS][]", True),
    (MISTRAL, '[TOOL_CALLS][{"name": "launch", "arguments": {}}]', True),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]', True),
    (PYTHONIC, "[launch(x=1)]", True),
    (PYTHONIC, "[1, 2, 3]", True),
    (PYTHONIC, "[get_weather]", True),
    (PYTHONIC, '[get_weather("Paris")]', False),
    (PYTHONIC, "[get_weather(city=paris)]", False),
    (PYTHONIC, "[get_weather(city=b'x')]", False),
    (PYTHONIC, "[get_weather(city={1, 2})]", False),
    (PYTHONIC, "[get_weather(city='a', city='b')]", False),
]


@pytest.mark.parametrize(("parser", "text", "early"), MALFORMED,
                         ids=[f"{p.__name__}-{i}" for i, (p, *_) in enumerate(MALFORMED)])
def test_malformed_calls_stay_content(parser: type[ToolParser], text: str, early: bool) -> None:
    """A call that is not well formed, or names no tool of the request, is content."""
    assert parser(TOOLS).parse(text) == ParsedOutput(text.strip(), [])
    deltas = stream(parser, list(text))
    assert "".join(d.content or "" for d in deltas) == text.strip()
    if early:
        check_stream(parser, text, list(text))
    else:  # announced before it broke: that stays, and its text follows as content
        assert [d.name for d in deltas if d.name] == ["get_weather"]


@pytest.mark.parametrize("parser", PARSERS)
def test_any_name_without_tools(parser: type[ToolParser]) -> None:
    """Without tools in the request, any well-formed call is a call."""
    text = write(parser, [("launch", PARIS)])
    assert parser([]).parse(text) == ParsedOutput(None, expected([("launch", PARIS)]))
    assert parser(TOOLS).parse(text).calls == []


@pytest.mark.parametrize("parser", [MISTRAL, PYTHONIC])
def test_calls_before_a_malformed_one_stay_calls(parser: type[ToolParser]) -> None:
    """In a list of calls, the ones before a malformed element stay; the rest is content."""
    good = write(parser, [("get_weather", PARIS)])
    text = good[:-1] + ", " + write(parser, [("launch", {})])[len(good) - len(good.lstrip()):]
    tail = text[len(good) - 1:]
    assert parser(TOOLS).parse(text) == ParsedOutput(tail.strip(), expected([("get_weather",
                                                                                PARIS)]))
    for pieces in splits(text):
        check_stream(parser, text, pieces)


def test_hermes_content_between_and_after_calls() -> None:
    """Text between and after Hermes calls is content, in order."""
    text = write(HERMES, [("get_weather", PARIS)], "A ", " B ") + write(HERMES, [("get_time", {})],
                                                                          after=" C")
    parsed = HERMES(TOOLS).parse(text)
    assert parsed.content == "A  B  C"
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("parser", PARSERS)
def test_arguments_stream_before_the_call_ends(parser: type[ToolParser]) -> None:
    """A long arguments object streams while its call is still being written."""
    text = write(parser, [("get_weather", LONG)])
    instance = parser(TOOLS)
    deltas = [d for char in text[:-len('value number 19")]')] for d in instance.feed(char)]
    sent = "".join(d.arguments for d in deltas)
    assert deltas[0].name == "get_weather"
    assert len(sent) > len(json.dumps(LONG)) // 2


# (parser, first piece, the content it sends at once, the rest, the content of the whole).
HELD = [
    (HERMES, "Hi <tool_", "Hi", 'call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Hi"),
    (HERMES, "Hi <tool_", "Hi", "tip> here", "Hi <tool_tip> here"),
    (MISTRAL, "Hi [TOOL_", "Hi", 'CALLS][{"name": "get_time", "arguments": {}}]', "Hi"),
    (MISTRAL, "Hi [TOOL_", "Hi", "TIP]", "Hi [TOOL_TIP]"),
    (LLAMA3, " <|python_", "", 'tag|>{"name": "get_time", "parameters": {}}', ""),
    (LLAMA3, " <|python_", "", "snake|>", "<|python_snake|>"),
    (PYTHONIC, " <|python_st", "", "art|>[get_time()]<|python_end|>", ""),
    (PYTHONIC, "[get_time()]<|python_e", "", "nd|>", ""),
]


@pytest.mark.parametrize(("parser", "held", "sent", "rest", "content"), HELD,
                         ids=[f"{p.__name__}-{i}" for i, (p, *_) in enumerate(HELD)])
def test_possible_call_markers_are_held(parser: type[ToolParser], held: str, sent: str,
                                        rest: str, content: str) -> None:
    """Text that may begin a call marker waits; the content before it is sent at once."""
    instance = parser(TOOLS)
    assert "".join(d.content or "" for d in instance.feed(held)) == sent
    check_stream(parser, held + rest, [held, rest])
    assert (parser(TOOLS).parse(held + rest).content or "") == content


@pytest.mark.parametrize("parser", PARSERS)
def test_plain_content_is_sent_at_once(parser: type[ToolParser]) -> None:
    """Content that cannot begin a call is sent as it arrives, not at the end."""
    instance = parser(TOOLS)
    assert "".join(d.content or "" for d in instance.feed("Hello there, ")) == "Hello there,"
    assert "".join(d.content or "" for d in instance.feed("friend")) == " friend"
    assert instance.finish() == []


def test_call_cut_short_after_it_began_streaming() -> None:
    """A call announced before its text broke off: what was sent stays, its text is content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "da'
    assert HERMES(TOOLS).parse(text) == ParsedOutput(text, [])
    deltas = stream(HERMES, [text])
    assert deltas[0] == Delta(index=0, name="get_weather", arguments='{"city": "Paris"')
    assert deltas[1:] == [Delta(content=text)]


@pytest.mark.parametrize("parser", [HERMES, LLAMA3, MISTRAL])
def test_call_format_reads_back(parser: type[ToolParser]) -> None:
    """Text written by ``call_format`` parses back to exactly the intended calls."""
    fmt = parser.call_format
    assert fmt is not None
    calls = [("get_weather", RICH), ("get_time", {})]
    text = fmt.prefix + fmt.separator.join(fmt.call_begin(n) + json.dumps(a) + fmt.call_end
                                           for n, a in calls) + fmt.suffix
    assert parser(TOOLS).parse(text) == ParsedOutput(None, expected(calls))
    check_stream(parser, text, list(text))


def test_pythonic_has_no_call_format() -> None:
    """Pythonic arguments are not JSON, so its output cannot be constrained to it."""
    assert PYTHONIC.call_format is None


@pytest.mark.parametrize("name", ["hermes", "qwen25", "llama3", "mistral", "pythonic"])
def test_registered_names(name: str) -> None:
    """Each registered name loads its parser class."""
    assert TOOL_PARSERS.get(name) in PARSERS


# Random outputs: well-formed calls among content fragments that cannot begin one.
SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
NAMES = st.sampled_from(["get_weather", "get_time"])
JSON_CALLS = st.tuples(NAMES, st.dictionaries(st.text(max_size=5), VALUES, max_size=3))
PY_CALLS = st.tuples(NAMES, st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,4}", fullmatch=True),
                                            VALUES, max_size=3))
FRAGMENTS = {
    HERMES: ["Hi", " ", "\n", "<tool", "<tool_call>", "<tool_call>\n{", "</tool_call>", "{", "}",
             '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', "é"],
    LLAMA3: ["Hi", " ", "\n", ";", "; ", "{", "}", "<|python_tag|>", '"name"', "é"],
    MISTRAL: ["Hi", " ", "\n", "[TOOL", "[TOOL_CALLS]", "[TOOL_CALLS] [", "[", "]", ",", "{",
              '[TOOL_CALLS][{"name": "launch", "arguments": {}}]', "é"],
    PYTHONIC: ["Hi", " ", "\n", "[", "]", ",", "get", "x=1", "'", '"', "<|python_start|>",
               "<|python_end|>", "{", "é"],
}


@st.composite
def outputs(draw: st.DrawFn, parser: type[ToolParser]) -> str:
    """A random output of ``parser``'s format (content fragments and well-formed calls)."""
    content = st.lists(st.sampled_from(FRAGMENTS[parser]), max_size=4).map("".join)
    if parser is HERMES or parser is MISTRAL:
        parts = draw(st.lists(st.one_of(content, st.lists(JSON_CALLS, min_size=1, max_size=2)),
                              max_size=4))
        return "".join(p if isinstance(p, str) else write(parser, p) for p in parts)
    calls = draw(st.lists(PY_CALLS if parser is PYTHONIC else JSON_CALLS, max_size=2))
    tag = draw(st.sampled_from(["", " ", "<|python_tag|>" if parser is LLAMA3
                                else "<|python_start|>"]))
    after = draw(content)
    return tag + write(parser, calls) + after if calls else after


def random_pieces(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at random places."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser", PARSERS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_outputs_stream_as_parsed(parser: type[ToolParser], data: st.DataObject) -> None:
    """For random outputs and random splits, the stream carries what a parse gives."""
    text = data.draw(outputs(parser))
    check_stream(parser, text, random_pieces(data.draw, text))


SOUP = sorted({f for fragments in FRAGMENTS.values() for f in fragments} | {
    '{"name": "get_weather", "arguments": {', '{"name": "get_time", "parameters": {"a": ',
    '"x"', "1", "}}", "get_time(", "zone='UTC'", ")", "</tool_call>", "\\", "\ud83d", "[[[[",
    '"\\u00', "True", "None"})


@pytest.mark.parametrize("parser", PARSERS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_text_never_raises(parser: type[ToolParser], data: st.DataObject) -> None:
    """Any text, whole or in pieces, gives content and calls without an exception."""
    text = "".join(data.draw(st.lists(st.sampled_from(SOUP) | st.text(max_size=3), max_size=12)))
    parsed = parser(TOOLS).parse(text)
    assert all(json.loads(call.arguments) is not None for call in parsed.calls)
    deltas = stream(parser, random_pieces(data.draw, text))
    indices = [d.index for d in deltas if d.content is None]
    assert indices == sorted(indices) and set(indices) == set(range(len(set(indices))))
