"""Stop strings matched on the text the client receives, with real tokenizers.

The Scheduler's ``StopStringMatcher`` must report a stop string at exactly the
token that completes it in the streamed text, and the Detokenizer, told that
the request stopped on it, must have streamed exactly the text before it and
never a part of it. The cases are those a decoding of the last few tokens
gets wrong: multi-byte characters spread over several tokens (byte-level BPE,
SentencePiece byte fallback), a SentencePiece leading space on the first
output token, and the text of a special token kept with
``skip_special_tokens=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.messages import FinishReason
from framework.runtime.detokenizer import Detokenizer
from framework.runtime.incremental_decoder import (
    REPLACEMENT_CHAR,
    StopStringMatcher,
    make_decode_fn,
)
from tests.chunks import split

#: How many prompt ids the Scheduler sends as context with a request's first output.
CONTEXT_LEN = 5


@dataclass(frozen=True)
class Case:
    """A prompt and an output whose text holds ``stop`` in its middle.

    With ``special``, ``stop`` is the text of the tokenizer's EOS token,
    which sits between ``output`` and ``after`` as a single id.
    ``min_span`` is how many output tokens the stop string must at least
    overlap, so that the case keeps testing what it is named for.
    """

    name: str
    prompt: str
    output: str
    stop: str
    min_span: int = 1
    special: bool = False
    after: str = " and then some more"


CASES = [
    Case("emoji", "Say it:", " wait 🧑 then go on", "🧑", min_span=3),
    Case("cjk", "Name it:", " the 饕餮 feast goes on", "饕餮", min_span=6),
    # Right at the first output token: only the context gives SentencePiece its space.
    Case("leading-space", "Hello", " world and more words", " world"),
    Case("multi-token", "Count:", " one two ENDOFTEXT three four", "ENDOFTEXT", min_span=4),
    Case("special", "Write:", " some text", "", special=True),
]

TOKENIZERS = ["gpt2", "llama"]


# --------------------------------------------------------------------------- helpers


@dataclass
class Built:
    """A case made into ids for one tokenizer, with what the client should see."""

    tokenizer: Any
    context: list[int]
    output: list[int]
    stop: str
    skip_special_tokens: bool

    def client_text(self, count: int) -> str:
        """The text of the first ``count`` output ids, as the tokenizer decodes it in context."""
        context_text = self.decode(self.context)
        return self.decode(self.context + self.output[:count])[len(context_text) :]

    def decode(self, ids: Sequence[int]) -> str:
        """The tokenizer's own decoding with the case's settings."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def completing_token(self) -> int:
        """How many output ids it takes for the whole stop string to be shown."""
        for count in range(1, len(self.output) + 1):
            if self.stop in self.client_text(count).rstrip(REPLACEMENT_CHAR):
                return count
        raise AssertionError(f"{self.stop!r} is not in {self.client_text(len(self.output))!r}")

    def text_before_stop(self) -> str:
        """What the client should get in all: the text before the stop string."""
        text = self.client_text(self.completing_token())
        return text[: text.index(self.stop)]

    def span(self) -> int:
        """How many output ids overlap the stop string."""
        start = len(self.text_before_stop())
        untouched = max(k for k in range(len(self.output) + 1)
                        if len(self.client_text(k)) <= start)
        return self.completing_token() - untouched

    def matcher(self) -> StopStringMatcher:
        """A matcher built as the Scheduler builds it."""
        decode = make_decode_fn(
            self.tokenizer,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=True,
        )
        return StopStringMatcher(decode, [self.stop], self.context)


def build(tokenizer: Any, case: Case, *, skip_special_tokens: bool | None = None) -> Built:
    """Tokenize ``case``: the prompt's last ids as context, the rest as output ids."""
    prompt_ids = tokenizer.encode(case.prompt, add_special_tokens=False)
    if case.special:
        whole = tokenizer.encode(case.prompt + case.output, add_special_tokens=False)
        whole += [tokenizer.eos_token_id, *tokenizer.encode(case.after, add_special_tokens=False)]
        stop = tokenizer.eos_token
    else:
        whole = tokenizer.encode(case.prompt + case.output + case.after, add_special_tokens=False)
        stop = case.stop
    # The prompt must tokenize alike on its own, or the split would change the text.
    assert whole[: len(prompt_ids)] == prompt_ids
    return Built(
        tokenizer,
        context=prompt_ids[-CONTEXT_LEN:],
        output=whole[len(prompt_ids) :],
        stop=stop,
        skip_special_tokens=not case.special if skip_special_tokens is None
        else skip_special_tokens,
    )


def stream(detokenizer: Detokenizer, built: Built, chunks: list[list[int]]) -> list[str]:
    """Feed ``chunks`` as one request; the last one ends it on the stop string."""
    finish = FinishReason(type="stop", matched=built.stop)
    return [
        detokenizer.decode_step(
            1,
            chunk,
            finish if index == len(chunks) - 1 else None,
            skip_special_tokens=built.skip_special_tokens,
            spaces_between_special_tokens=True,
            no_stop_trim=False,
            context_ids=built.context,
            stop_strs=[built.stop],
        )
        for index, chunk in enumerate(chunks)
    ]


def check_never_shows_the_stop(outputs: list[str], expected: str) -> None:
    """Every prefix of the stream stays within the text before the stop string."""
    shown = ""
    for output in outputs:
        shown += output
        assert expected.startswith(shown), (outputs, expected)
    assert shown == expected


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> Any:
    """Each real tokenizer in turn: byte-level BPE, then SentencePiece."""
    return request.getfixturevalue(request.param)


# --------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matcher_reports_the_stop_at_the_token_completing_it(tokenizer: Any, case: Case) -> None:
    built = build(tokenizer, case)
    end = built.completing_token()
    assert end < len(built.output)  # the stop string sits in the middle of the text
    assert built.span() >= case.min_span
    matcher = built.matcher()
    reports = [matcher.append([token]) for token in built.output]
    assert reports[: end - 1] == [None] * (end - 1)
    assert reports[end - 1] == built.stop
    assert matcher.num_output_ids == len(built.output)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_detokenizer_streams_the_text_before_the_stop(tokenizer: Any, case: Case) -> None:
    built = build(tokenizer, case)
    detokenizer = Detokenizer(tokenizer)
    ids = built.output[: built.completing_token()]
    outputs = stream(detokenizer, built, [[token] for token in ids])
    check_never_shows_the_stop(outputs, built.text_before_stop())
    assert detokenizer.num_live_states() == 0


@settings(max_examples=60, deadline=None)
@given(
    which=st.tuples(st.sampled_from(TOKENIZERS), st.sampled_from(CASES)),
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=12),
)
def test_any_chunking_agrees(
    gpt2: Any, llama: Any, which: tuple[str, Case], sizes: list[int]
) -> None:
    """Chunks of several ids (a stream interval) change neither the verdict nor the text."""
    name, case = which
    built = build(gpt2 if name == "gpt2" else llama, case)
    ids = built.output[: built.completing_token()]
    chunks = split(ids, sizes)
    matcher = built.matcher()
    reports = [matcher.append(chunk) for chunk in chunks]
    assert reports == [None] * (len(chunks) - 1) + [built.stop]
    outputs = stream(Detokenizer(built.tokenizer), built, chunks)
    check_never_shows_the_stop(outputs, built.text_before_stop())


FRAGMENTS = [" Hello world", " 🧑 in orbit", "👍🏽", " 饕餮", "日本語", " café", "\n\n", " 42."]


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(TOKENIZERS),
    pieces=st.lists(st.sampled_from(FRAGMENTS), min_size=2, max_size=5),
    where=st.tuples(st.floats(0, 1, exclude_max=True), st.integers(min_value=1, max_value=6)),
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=12),
)
def test_any_stop_string_cut_from_the_text(
    gpt2: Any, llama: Any, name: str, pieces: list[str], where: tuple[float, int],
    sizes: list[int],
) -> None:
    """Any piece of the output's text is found where it completes, and never streamed."""
    tokenizer = gpt2 if name == "gpt2" else llama
    output = tokenizer.encode("".join(pieces), add_special_tokens=False)
    built = Built(tokenizer, tokenizer.encode("Text:", add_special_tokens=False), output,
                  stop="", skip_special_tokens=True)
    text = built.client_text(len(output))
    start = int(where[0] * len(text))
    built.stop = text[start : start + where[1]]
    end = built.completing_token()
    matcher = built.matcher()
    reports = [matcher.append([token]) for token in output[:end]]
    assert reports == [None] * (end - 1) + [built.stop]
    chunks = split(output[:end], sizes)
    outputs = stream(Detokenizer(tokenizer), built, chunks)
    check_never_shows_the_stop(outputs, built.text_before_stop())


# --------------------------------------------------------------------------- special tokens


def test_special_token_text_is_not_matched_when_skipped(tokenizer: Any) -> None:
    special = next(case for case in CASES if case.special)
    built = build(tokenizer, special, skip_special_tokens=True)
    assert tokenizer.eos_token_id in built.output
    matcher = built.matcher()
    assert [matcher.append([token]) for token in built.output] == [None] * len(built.output)


def test_special_token_text_spelled_out_is_matched_when_skipped(tokenizer: Any) -> None:
    """Written with ordinary tokens, the same characters are text the client sees."""
    stop = tokenizer.eos_token
    ids = tokenizer.encode(f"one {stop} two", add_special_tokens=False,
                           split_special_tokens=True)
    assert tokenizer.eos_token_id not in ids
    decode = make_decode_fn(tokenizer, skip_special_tokens=True,
                            spaces_between_special_tokens=True)
    matcher = StopStringMatcher(decode, [stop])
    reports = [matcher.append([token]) for token in ids]
    assert stop in reports
    assert stop in tokenizer.decode(ids[: reports.index(stop) + 1])
    assert stop not in tokenizer.decode(ids[: reports.index(stop)])


# --------------------------------------------------------------------------- which stop, once


def gpt2_matcher(gpt2: Any, stops: list[str]) -> StopStringMatcher:
    """A matcher on GPT-2 that skips special tokens."""
    decode = make_decode_fn(gpt2, skip_special_tokens=True, spaces_between_special_tokens=True)
    return StopStringMatcher(decode, stops)


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["wor", "world"], "world"),  # same start: the longest
        (["world", "lo w"], "lo w"),  # the one that starts first in the text
        (["d", "o w"], "o w"),  # even when a shorter one ends first
    ],
)
def test_stops_completed_together(gpt2: Any, stops: list[str], expected: str) -> None:
    ids = gpt2.encode("Hello world")
    assert len(ids) == 2  # " world" is one token: every stop completes with it
    matcher = gpt2_matcher(gpt2, stops)
    assert [matcher.append([token]) for token in ids] == [None, expected]
    # The Detokenizer cuts where the chosen stop starts, as at any first occurrence.
    finish = FinishReason(type="stop", matched=expected)
    detokenizer = Detokenizer(gpt2)
    text = "".join(
        detokenizer.decode_step(1, [token], finish if i else None, skip_special_tokens=True,
                                spaces_between_special_tokens=True, no_stop_trim=False,
                                stop_strs=stops)
        for i, token in enumerate(ids)
    )
    assert text == "Hello world"[: "Hello world".index(expected)]


def test_a_stop_is_reported_once(gpt2: Any) -> None:
    """Text already searched is not searched again, even after a match."""
    matcher = gpt2_matcher(gpt2, ["lo", "a much longer stop string"])
    reports = [matcher.append([token]) for token in gpt2.encode("Hello there, all good")]
    assert reports.count("lo") == 1


def test_stop_strings_far_apart_in_a_long_output(gpt2: Any) -> None:
    """Only the new text and a tail the length of the longest stop are searched."""
    filler = " and so on" * 200
    ids = gpt2.encode(filler + " the 饕餮 feast")
    matcher = gpt2_matcher(gpt2, ["饕餮", "so on and so on and so on and so forth"])
    reports = [matcher.append([token]) for token in ids]
    assert [r for r in reports if r is not None] == ["饕餮"]
    assert len(matcher._recent) < 40  # what is kept between appends stays bounded


def test_no_stop_strings_match_nothing(gpt2: Any) -> None:
    matcher = gpt2_matcher(gpt2, ["", ""])
    assert matcher.append(gpt2.encode("anything at all")) is None


# --------------------------------------------------------------------------- one decode function


class _RecordingTokenizer:
    """A tokenizer whose decode names ``spaces_between_special_tokens``; records its calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, bool]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        self.calls.append({"skip": skip_special_tokens, "spaces": spaces_between_special_tokens})
        return "".join(chr(ord("a") + i) for i in ids)


def test_decode_fn_binds_the_request_settings() -> None:
    recording = _RecordingTokenizer()
    decode = make_decode_fn(recording, skip_special_tokens=True,
                            spaces_between_special_tokens=False)
    assert decode((0, 1, 2)) == "abc"
    assert recording.calls == [{"skip": True, "spaces": False}]


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_decodes_with_the_same_function(llama: Any, skip: bool) -> None:
    ids = [llama.bos_token_id, *llama.encode("Hi 🧑 there", add_special_tokens=False),
           llama.eos_token_id]
    decode = make_decode_fn(llama, skip_special_tokens=skip, spaces_between_special_tokens=True)
    detokenizer = Detokenizer(llama)
    assert detokenizer.decode(ids, skip_special_tokens=skip,
                              spaces_between_special_tokens=True) == decode(ids)
    assert decode(ids) == llama.decode(ids, skip_special_tokens=skip)
