"""Tool-call and after-reasoning grammars, checked by the strings xgrammar accepts."""

from __future__ import annotations

import functools
import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.constrained.base import Constraint, InvalidConstraintError
from framework.constrained.json_schema import UNSUPPORTED
from framework.constrained.xgrammar_backend import XGrammarBackend
from framework.tool_parsers.base import CallFormat, ToolSpec
from framework.tool_parsers.grammar import (
    _fresh_name,
    _rename_root,
    after_reasoning_ebnf,
    tool_calls_ebnf,
)

HERMES = CallFormat("", "\n", "", '<tool_call>\n{"name": "{name}", "arguments": ',
                    "}\n</tool_call>")
MISTRAL = CallFormat("[TOOL_CALLS][", ", ", "]", '{"name": "{name}", "arguments": ', "}")
WEATHER = ToolSpec("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
})
NOW = ToolSpec("now")
TOOLS = [WEATHER, NOW]
PARIS = {"city": "Paris", "days": 3}


@functools.cache
def _compiled(ebnf: str) -> xgr.CompiledGrammar:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    return compiler.compile_grammar(ebnf)


def accepts(ebnf: str, text: str) -> bool:
    """Whether ``ebnf`` accepts all of ``text`` (and nothing needs to follow)."""
    matcher = xgr.GrammarMatcher(_compiled(ebnf), terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())


def call(fmt: CallFormat, name: str, arguments: dict[str, object]) -> str:
    """One call as the format writes it (arguments as the grammar writes JSON)."""
    return fmt.call_begin(name) + json.dumps(arguments) + fmt.call_end


def calls(fmt: CallFormat, *each: tuple[str, dict[str, object]]) -> str:
    return fmt.prefix + fmt.separator.join(call(fmt, n, a) for n, a in each) + fmt.suffix


# ---------------------------------------------------------------- tool calls


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL], ids=["hermes", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_one_call_to_each_tool_is_accepted(fmt: CallFormat, parallel: bool) -> None:
    ebnf = tool_calls_ebnf(fmt, TOOLS, parallel=parallel)
    XGrammarBackend.validate(Constraint("ebnf", ebnf))  # what the backend will be sent
    assert accepts(ebnf, calls(fmt, ("get_weather", PARIS)))
    assert accepts(ebnf, calls(fmt, ("get_weather", {"city": "Oslo"})))
    assert accepts(ebnf, calls(fmt, ("now", {})))


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL], ids=["hermes", "mistral"])
def test_several_calls_only_when_parallel(fmt: CallFormat) -> None:
    two = calls(fmt, ("get_weather", PARIS), ("now", {}))
    three = calls(fmt, ("now", {}), ("get_weather", PARIS), ("now", {"tz": "UTC"}))
    assert accepts(tool_calls_ebnf(fmt, TOOLS, parallel=True), two)
    assert accepts(tool_calls_ebnf(fmt, TOOLS, parallel=True), three)
    assert not accepts(tool_calls_ebnf(fmt, TOOLS, parallel=False), two)


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL], ids=["hermes", "mistral"])
@pytest.mark.parametrize("bad", [
    pytest.param(lambda f: calls(f, ("get_time", {})), id="unknown name"),
    pytest.param(lambda f: calls(f, ("get_weather", {"days": 3})), id="missing required"),
    pytest.param(lambda f: calls(f, ("get_weather", {"city": 5})), id="wrong type"),
    pytest.param(lambda f: calls(f, ("get_weather", {"city": "a", "x": 1})), id="extra key"),
    pytest.param(lambda f: "Sure! " + calls(f, ("now", {})), id="text before"),
    pytest.param(lambda f: calls(f, ("now", {})) + " done", id="text after"),
    pytest.param(calls, id="no call"),
])
def test_other_outputs_are_refused(fmt: CallFormat, bad: object) -> None:
    text = bad(fmt)  # type: ignore[operator]
    assert not accepts(tool_calls_ebnf(fmt, TOOLS, parallel=True), text)


def test_arguments_follow_a_recursive_schema() -> None:
    # The schema's own root refers to itself: the grammar's root must still be free.
    tree = ToolSpec("tree", {"type": "object", "properties": {"child": {"$ref": "#"}}})
    ebnf = tool_calls_ebnf(HERMES, [tree], parallel=True)
    nested = {"child": {"child": {}}}
    assert accepts(ebnf, calls(HERMES, ("tree", nested), ("tree", {})))
    assert not accepts(ebnf, calls(HERMES, ("tree", {"child": 1})))


def test_unenforceable_parameters_name_the_tool() -> None:
    bad = ToolSpec("bad", {"type": "object", "properties": {"a": {"not": {}}}})
    with pytest.raises(InvalidConstraintError) as info:
        tool_calls_ebnf(HERMES, [WEATHER, bad], parallel=False)
    assert info.value.param == "tools[1].function.parameters"
    assert info.value.code == UNSUPPORTED
    assert str(info.value) == ("invalid tools[1].function.parameters: "
                               "'not' at /properties/a/not is not enforced "
                               "(a grammar cannot exclude a sub-language)")


def test_root_is_renamed_only_when_nothing_refers_to_it() -> None:
    renamed = _rename_root('root ::= "a" b\nb ::= "root"\n', "call")
    assert renamed == 'call ::= "a" b\nb ::= "root"\n'
    with pytest.raises(ValueError, match="referred to"):
        _rename_root('root ::= "a" b\nb ::= "(" root ")" | "x"\n', "call")


def test_fresh_name_skips_names_in_use_but_not_text_in_literals() -> None:
    assert _fresh_name('root ::= tool_call\ntool_call ::= "x"', "tool_call") == "tool_call_1"
    assert _fresh_name('root ::= "tool_call" [tool_call]', "tool_call") == "tool_call"


# ---------------------------------------------------------------- after reasoning


OBJECT = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def test_json_after_reasoning() -> None:
    ebnf = after_reasoning_ebnf("json_schema", OBJECT)
    XGrammarBackend.validate(Constraint("ebnf", ebnf))
    assert accepts(ebnf, 'thinking...</think>\n{"a": 1}')
    assert accepts(ebnf, '</think>{"a": 1}')
    assert accepts(ebnf, 'a <b> </thin k> </</think> \n\t{"a": 1}')
    assert not accepts(ebnf, "thinking...</think>\nnot json")
    assert not accepts(ebnf, '{"a": 1}')  # no end of reasoning
    assert not accepts(ebnf, 'a</think>b</think>{"a": 1}')  # the first end ends it


def test_end_marker_may_appear_inside_the_answer() -> None:
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}})
    ebnf = after_reasoning_ebnf("json_schema", schema)
    assert accepts(ebnf, 'ok</think>{"s": "</think>"}')


def test_reasoning_opened_by_the_output() -> None:
    ebnf = after_reasoning_ebnf("regex", "[0-9]+", starts_in_reasoning=False)
    assert accepts(ebnf, "<think>two and two</think> 4")
    assert not accepts(ebnf, "two and two</think> 4")
    assert not accepts(ebnf, "<think>a</think>b</think>4")


def test_end_may_overlap_the_start() -> None:
    # "ab" + "a" holds "ba": the reasoning ends there, though most of it is the start.
    ebnf = after_reasoning_ebnf("regex", "x", start="ab", end="ba", starts_in_reasoning=False)
    assert accepts(ebnf, "abax")
    assert not accepts(ebnf, "ababax")
    with pytest.raises(ValueError, match="contains its end"):
        after_reasoning_ebnf("regex", "x", start="<ab>", end="ab", starts_in_reasoning=False)


def test_ebnf_constraint_after_reasoning() -> None:
    ebnf = after_reasoning_ebnf("ebnf", 'root ::= "yes" | "no"')
    assert accepts(ebnf, "hmm</think>yes")
    assert not accepts(ebnf, "hmm</think>maybe")


@pytest.mark.parametrize(("kind", "value"), [
    ("json_schema", json.dumps({"type": "object", "not": {}})),
    ("regex", "(?=a)b"),
    ("ebnf", "root ::= undefined_rule"),
])
def test_invalid_constraints_are_refused(kind: str, value: str) -> None:
    with pytest.raises(InvalidConstraintError) as info:
        after_reasoning_ebnf(kind, value)
    assert info.value.param in (kind, "json_schema")


def _first_end_oracle(text: str, end: str) -> bool:
    """Whether ``text`` is reasoning that first contains ``end`` at its end, then ``x``."""
    body = text[:-1]
    return text.endswith("x") and body.endswith(end) and body.find(end) == len(body) - len(end)


def _texts(alphabet: str, end: str) -> st.SearchStrategy[str]:
    """Random texts, many of them made of pieces of ``end`` and ending with ``end`` + x."""
    pieces = st.lists(st.sampled_from([*alphabet, end, end[:-1], end[1:], end[:2]]),
                      max_size=8).map("".join)
    return st.one_of(st.text(alphabet, max_size=16), pieces,
                     st.tuples(pieces, st.sampled_from(["x", end + "x"])).map("".join))


@pytest.mark.parametrize(("end", "alphabet"), [("</think>", "</thinkx>"), ("aab", "abx"),
                                               ("abab", "abx")])
def test_reasoning_ends_exactly_at_the_first_end(end: str, alphabet: str) -> None:
    ebnf = after_reasoning_ebnf("regex", "x", end=end)

    @settings(max_examples=300, deadline=None)
    @given(text=_texts(alphabet, end))
    def check(text: str) -> None:
        assert accepts(ebnf, text) == _first_end_oracle(text, end), text

    check()
