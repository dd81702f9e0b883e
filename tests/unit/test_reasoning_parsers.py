"""Reasoning parsers: whole outputs and streams split into reasoning and content."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
)
from framework.registry import REASONING_PARSERS

R1, QWEN3 = DeepSeekR1ReasoningParser, Qwen3ReasoningParser

# (parser, output, reasoning, content) as a whole-output parse gives them.
PARSE_CASES = [
    (R1, "Let me see.\n</think>\n\nThe answer is 4.", "Let me see.", "The answer is 4."),
    (R1, "<think>\nLet me see.</think>4", "Let me see.", "4"),
    (R1, "  <think>x</think>", "x", None),
    (R1, "Still thinking when cut", "Still thinking when cut", None),
    (R1, "</think>Only an answer", None, "Only an answer"),
    (R1, "a < b </thin k> </think> c </think> d", "a < b </thin k>", "c </think> d"),
    (R1, "", None, None),
    (QWEN3, "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    (QWEN3, "\n <think>x</think>y", "x", "y"),
    (QWEN3, "The answer is 4.", None, "The answer is 4."),
    (QWEN3, "The answer </think> is 4.", None, "The answer </think> is 4."),
    (QWEN3, "<think>cut short", "cut short", None),
    (QWEN3, "<think></think>\n\n4", None, "4"),
    (QWEN3, "<thinking>4", None, "<thinking>4"),
    (QWEN3, "<thi", None, "<thi"),
    (QWEN3, "   ", None, None),
]

# Realistic outputs for the streaming checks, with markers and whitespace in many places.
STREAMED = [
    "<think>\nThe user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
    "Okay, so <b>bold</b> and </thin k>.\n</think>\n\nDone </think> twice.",
    "  <think>  a  </think>  b  ",
    "<think>cut short <",
    "plain answer < with </ a partial marker </thin",
    "\n\n<thi",
    "</think>",
]


def _joined(deltas: list[ReasoningDelta]) -> tuple[str | None, str | None]:
    """The reasoning and content a stream's pieces add up to (None: no piece)."""
    for delta in deltas:
        assert (delta.reasoning is None) != (delta.content is None), delta
        assert delta.reasoning != "" and delta.content != ""
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning is not None)
    content = "".join(d.content for d in deltas if d.content is not None)
    return reasoning or None, content or None


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return _joined(deltas + parser.finish())


@pytest.mark.parametrize(("cls", "text", "reasoning", "content"), PARSE_CASES)
def test_parse_splits_reasoning_from_content(cls: type[ReasoningParser], text: str,
                                             reasoning: str | None,
                                             content: str | None) -> None:
    assert cls().parse(text) == (reasoning, content)


@pytest.mark.parametrize("cls", [R1, QWEN3])
def test_thinking_off_makes_all_text_content(cls: type[ReasoningParser]) -> None:
    text = "<think>not reasoning</think> answer"
    assert cls(thinking=False).parse(text) == (None, text)
    assert _stream(cls(thinking=False), [text[:9], text[9:]]) == (None, text)


@pytest.mark.parametrize("cls", [R1, QWEN3])
@pytest.mark.parametrize("text", STREAMED)
def test_stream_at_every_split_equals_parse(cls: type[ReasoningParser], text: str) -> None:
    expected = cls().parse(text)
    for cut in range(len(text) + 1):
        assert _stream(cls(), [text[:cut], text[cut:]]) == expected, cut
    assert _stream(cls(), list(text)) == expected


@settings(max_examples=150, deadline=None)
@given(cls=st.sampled_from([R1, QWEN3]),
       parts=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "</thi", "think",
                                       ">", " ", "\n", "word", "k>"]), max_size=12),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_stream_of_any_pieces_equals_parse(cls: type[ReasoningParser], parts: list[str],
                                           cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert _stream(cls(), pieces) == cls().parse(text)


def test_known_text_is_emitted_at_once() -> None:
    parser = QWEN3()
    assert parser.feed("<thi") == []  # may still open the reasoning
    assert parser.feed("nk>\nLet me") == [ReasoningDelta(reasoning="Let me")]
    assert parser.feed(" see </th") == [ReasoningDelta(reasoning=" see")]  # a partial end held
    assert parser.feed("ink>\n\nIt is") == [ReasoningDelta(content="It is")]
    assert parser.feed(" 4.") == [ReasoningDelta(content=" 4.")]
    assert parser.finish() == []


def test_deepseek_reasoning_flows_before_any_marker() -> None:
    parser = R1()
    assert parser.feed("Hmm") == [ReasoningDelta(reasoning="Hmm")]
    assert parser.feed(", so</think>4") == [ReasoningDelta(reasoning=", so"),
                                            ReasoningDelta(content="4")]


def test_qwen3_content_flows_when_no_reasoning_opens() -> None:
    parser = QWEN3()
    assert parser.feed("The ") == [ReasoningDelta(content="The")]
    assert parser.feed("answer </think>") == [ReasoningDelta(content=" answer </think>")]


def test_registry_names_the_parsers() -> None:
    assert REASONING_PARSERS.get("deepseek-r1") is R1
    assert REASONING_PARSERS.get("qwen3") is QWEN3
