"""The Detokenizer against real tokenizers: GPT-2 byte-level BPE and a 32k SentencePiece model.

The central property: however a token sequence is cut into chunks, the texts
emitted for it concatenate to the tokenizer's decoding of the whole sequence,
and no chunk but the last ends in a half-made character.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import framework.default_model
from framework.comm.codec import MsgpackCodec
from framework.comm.inproc import InprocTransport
from framework.comm.transport import TransportError
from framework.messages import (
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishReason,
    FlushCacheReqInput,
    RequestConstants,
)
from framework.runtime.detokenizer import Detokenizer
from framework.runtime.hf_tokenizer import (
    load_tokenizer,
    start_loading_tokenizer,
    tokenizer_class_path,
)
from framework.runtime.incremental_decoder import (
    REPLACEMENT_CHAR,
    IncrementalDecoder,
    make_decode_fn,
)
from tests.chunks import split
from tests.message_strategies import token_id_outputs

FRAGMENTS = [
    "Hello world",
    " The quick brown fox jumps over the lazy dog.",
    "👍🏽",
    " 🧑‍🚀 in orbit",
    "日本語のテキスト",
    " café, naïve, résumé, Ångström",
    "def f(x):\n    if x:\n        return 1\n\treturn 2\n",
    "  two  spaces ",
    " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ",
    "\n\n",
    "Привет, мир!",
]

PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

chunk_sizes = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=40)
texts = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=4).map("".join)


# --------------------------------------------------------------------------- helpers


#: Outputs name requests by handle; the tests name them by rid, each rid its own handle.
_HANDLES: dict[str, int] = {}


def handle_of(rid: str) -> int:
    """The handle that stands for ``rid`` in these tests (the same one every time)."""
    return _HANDLES.setdefault(rid, len(_HANDLES) + 1)


def token_batch(
    rids: list[str],
    output_ids: list[list[int]],
    finished_reasons: list[FinishReason | None],
    *,
    new: Sequence[RequestConstants | None] | None = None,
    uniform: bool = False,
) -> BatchTokenIDOutput:
    """A Scheduler output for ``rids`` (by their handles) with the given ids and reasons.

    ``new[i]`` holds request ``i``'s constants if this is its first output, else
    ``None``; without ``new`` every request is new, with default constants.
    ``uniform`` sends no offsets (every request must then have as many ids).
    """
    if new is None:
        new = [RequestConstants(prompt_tokens=3) for _ in rids]
    return BatchTokenIDOutput(
        handles=np.array([handle_of(rid) for rid in rids], dtype=np.int64),
        output_ids=np.array([i for ids in output_ids for i in ids], dtype=np.int32),
        output_offsets=None if uniform else np.cumsum([0, *map(len, output_ids)], dtype=np.int32),
        finished_indices=[i for i, r in enumerate(finished_reasons) if r is not None],
        finished_reasons=[r for r in finished_reasons if r is not None],
        new_indices=[i for i, c in enumerate(new) if c is not None],
        new_constants=[c for c in new if c is not None],
    )


def first_only(index: int, constants: RequestConstants) -> list[RequestConstants | None]:
    """``new`` for a one-request batch: its constants in the first output, none later."""
    return [constants if index == 0 else None]


def stream(
    detokenizer: Detokenizer,
    chunks: list[list[int]],
    finish: FinishReason,
    *,
    skip_special_tokens: bool = True,
    no_stop_trim: bool = False,
    rid: str = "r",
) -> list[str]:
    """Feed one request's chunks (the last one finished by ``finish``); return each text."""
    constants = RequestConstants(skip_special_tokens=skip_special_tokens,
                                 no_stop_trim=no_stop_trim)
    outputs = []
    for index, chunk in enumerate(chunks):
        reason = finish if index == len(chunks) - 1 else None
        batch = token_batch([rid], [chunk], [reason], new=first_only(index, constants))
        outputs.append(detokenizer.handle_batch(batch).output_strs[0])
    return outputs


def check_stream(outputs: list[str], expected: str) -> None:
    """The texts add up to ``expected``; no text but the last ends in a half-made character."""
    assert "".join(outputs) == expected
    for output in outputs[:-1]:
        assert not output.endswith(REPLACEMENT_CHAR), outputs


LENGTH = FinishReason(type="length")


# --------------------------------------------------------------------------- the property


@PROPERTY_SETTINGS
@given(text=texts, sizes=chunk_sizes)
def test_gpt2_any_chunking_gives_the_whole_text(gpt2: Any, text: str, sizes: list[int]) -> None:
    ids = gpt2.encode(text)
    outputs = stream(Detokenizer(gpt2), split(ids, sizes), LENGTH)
    # Byte-level BPE is lossless, so the stream also gives back the original text.
    check_stream(outputs, gpt2.decode(ids))
    assert "".join(outputs) == text


@PROPERTY_SETTINGS
@given(
    ids=st.lists(st.integers(min_value=0, max_value=50256), min_size=1, max_size=30),
    sizes=chunk_sizes,
    skip=st.booleans(),
)
def test_gpt2_arbitrary_ids_including_broken_bytes(
    gpt2: Any, ids: list[int], sizes: list[int], skip: bool
) -> None:
    """Random ids make invalid UTF-8 too: the stream still matches the whole decoding."""
    outputs = stream(Detokenizer(gpt2), split(ids, sizes), LENGTH, skip_special_tokens=skip)
    check_stream(outputs, gpt2.decode(ids, skip_special_tokens=skip))


@PROPERTY_SETTINGS
@given(
    pieces=st.lists(
        st.tuples(st.sampled_from(FRAGMENTS), st.sampled_from([None, "bos", "eos"])),
        min_size=1,
        max_size=4,
    ),
    sizes=chunk_sizes,
    skip=st.booleans(),
)
def test_sentencepiece_any_chunking_gives_the_whole_text(
    llama: Any, pieces: list[tuple[str, str | None]], sizes: list[int], skip: bool
) -> None:
    """SentencePiece: leading "▁" spacing, byte fallback and special tokens in between."""
    ids: list[int] = []
    for fragment, special in pieces:
        ids += llama.encode(fragment, add_special_tokens=False)
        if special is not None:
            ids.append(llama.bos_token_id if special == "bos" else llama.eos_token_id)
    outputs = stream(Detokenizer(llama), split(ids, sizes), LENGTH, skip_special_tokens=skip)
    check_stream(outputs, llama.decode(ids, skip_special_tokens=skip))


def test_sentencepiece_spacing_needs_the_window(llama: Any) -> None:
    """One token at a time keeps the spaces that decoding tokens one by one would lose."""
    text = "Hello world and more words"
    ids = llama.encode(text, add_special_tokens=False)
    one_by_one = "".join(llama.decode([token]) for token in ids)
    assert one_by_one != text  # what a naive decoder would produce
    outputs = stream(Detokenizer(llama), [[token] for token in ids], LENGTH)
    check_stream(outputs, text)


# --------------------------------------------------------------------------- held-back characters


def test_byte_fallback_character_is_held_until_complete(llama: Any) -> None:
    ids = llama.encode("a 🧑", add_special_tokens=False)
    byte_tokens = [t for t in llama.convert_ids_to_tokens(ids) if t.startswith("<0x")]
    assert len(byte_tokens) == 4  # 🧑 is spelled with four byte-fallback tokens
    outputs = stream(Detokenizer(llama), [[token] for token in ids], LENGTH)
    assert outputs[-4:-1] == ["", "", ""]
    assert outputs[-1] == "🧑"
    check_stream(outputs, "a 🧑")


def test_text_before_an_incomplete_character_is_not_held(llama: Any) -> None:
    ids = llama.encode("a b🧑", add_special_tokens=False)
    assert llama.convert_ids_to_tokens(ids)[1:3] == ["▁b", "<0xF0>"]
    chunks = [ids[:1], ids[1:3], ids[3:5], ids[5:]]
    outputs = stream(Detokenizer(llama), chunks, LENGTH)
    assert outputs[1] == " b"  # shown at once; only the half-made 🧑 waits
    assert outputs[2:] == ["", "🧑"]
    check_stream(outputs, "a b🧑")


def test_byte_level_emoji_is_held_until_complete(gpt2: Any) -> None:
    ids = gpt2.encode(" 👍🏽")
    assert len(ids) > 2  # the emoji and its modifier span several byte-level tokens
    detokenizer = Detokenizer(gpt2)
    running = [
        detokenizer.handle_batch(
            token_batch(["r"], [[t]], [None], new=first_only(k, RequestConstants()))
        ).output_strs[0]
        for k, t in enumerate(ids)
    ]
    for output in running:
        assert REPLACEMENT_CHAR not in output
    assert "".join(running) == " 👍🏽"


def test_incomplete_character_is_flushed_at_finish(gpt2: Any) -> None:
    ids = gpt2.encode("ok 🧑")[:-1]  # the emoji's last byte never arrives
    expected = gpt2.decode(ids)
    assert expected.endswith(REPLACEMENT_CHAR)
    outputs = stream(Detokenizer(gpt2), [[token] for token in ids], LENGTH)
    check_stream(outputs, expected)
    assert outputs[-1].endswith(REPLACEMENT_CHAR)


# --------------------------------------------------------------------------- stop trimming


STOP_TEXT = "The answer is 42. STOP here 👍🏽 then more text after it"


@settings(max_examples=40, deadline=None)
@given(
    stop=st.sampled_from(["STOP", "swer", " is", "42.", "👍🏽", "e"]),
    sizes=chunk_sizes,
    no_stop_trim=st.booleans(),
)
def test_stop_string_is_trimmed_from_the_final_text(
    gpt2: Any, stop: str, sizes: list[int], no_stop_trim: bool
) -> None:
    """The Scheduler finishes at the token completing the stop string; the text ends before it."""
    all_ids = gpt2.encode(STOP_TEXT)
    stop_at = STOP_TEXT.index(stop)
    # The request ends with the first token whose text completes the stop string.
    end = next(k for k in range(1, len(all_ids) + 1) if stop in gpt2.decode(all_ids[:k]))
    # The tokens that overlap the stop string all arrive in the final chunk.
    first = next(k for k in range(end) if len(gpt2.decode(all_ids[: k + 1])) > stop_at)
    chunks = [*split(all_ids[:first], sizes), all_ids[first:end]] if first else [all_ids[:end]]
    finish = FinishReason(type="stop", matched=stop)
    outputs = stream(Detokenizer(gpt2), chunks, finish, no_stop_trim=no_stop_trim)
    whole = gpt2.decode(all_ids[:end])
    check_stream(outputs, whole if no_stop_trim else whole[:stop_at])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("no_stop_trim", [True, False])
def test_special_stop_token(gpt2: Any, skip: bool, no_stop_trim: bool) -> None:
    eos = gpt2.eos_token_id
    ids = [*gpt2.encode("Hello 👍🏽 world"), eos]
    finish = FinishReason(type="stop", matched=eos)
    outputs = stream(
        Detokenizer(gpt2),
        split(ids, [2]),
        finish,
        skip_special_tokens=skip,
        no_stop_trim=no_stop_trim,
    )
    kept = ids if no_stop_trim else ids[:-1]
    check_stream(outputs, gpt2.decode(kept, skip_special_tokens=skip))
    assert ("<|endoftext|>" in "".join(outputs)) == (no_stop_trim and not skip)


@pytest.mark.parametrize("no_stop_trim", [True, False])
def test_plain_stop_token_is_trimmed_unless_asked(gpt2: Any, no_stop_trim: bool) -> None:
    ids = gpt2.encode("Hello world.")
    period = gpt2.encode(".")[0]
    assert ids[-1] == period
    finish = FinishReason(type="stop", matched=period)
    outputs = stream(Detokenizer(gpt2), [[t] for t in ids], finish, no_stop_trim=no_stop_trim)
    check_stream(outputs, "Hello world." if no_stop_trim else "Hello world")


def test_stop_token_from_an_earlier_chunk_is_not_trimmed_again(gpt2: Any) -> None:
    """An abort-like final chunk without ids does not cut text that was already emitted."""
    ids = gpt2.encode("Hello world.")
    finish = FinishReason(type="stop", matched=ids[-1])
    outputs = stream(Detokenizer(gpt2), [ids, []], finish)
    check_stream(outputs, "Hello world.")


# --------------------------------------------------------------------------- per-request settings


def test_skip_special_tokens_is_per_request(llama: Any) -> None:
    ids = [
        llama.bos_token_id,
        *llama.encode("Hi there", add_special_tokens=False),
        llama.eos_token_id,
        *llama.encode("again", add_special_tokens=False),
    ]
    detokenizer = Detokenizer(llama)
    texts_by_rid = {"skip": "", "keep": ""}
    chunks = split(ids, [3])
    first = [RequestConstants(skip_special_tokens=skip) for skip in (True, False)]
    for index, chunk in enumerate(chunks):
        reason = LENGTH if index == len(chunks) - 1 else None
        batch = token_batch(
            ["skip", "keep"], [chunk, chunk], [reason, reason],
            new=first if index == 0 else [None, None],
        )
        for rid, text in zip(["skip", "keep"], detokenizer.handle_batch(batch).output_strs):
            texts_by_rid[rid] += text
    assert texts_by_rid["skip"] == llama.decode(ids, skip_special_tokens=True)
    assert texts_by_rid["keep"] == llama.decode(ids, skip_special_tokens=False)
    assert texts_by_rid["skip"] != texts_by_rid["keep"]


class _SpacingTokenizer:
    """A tokenizer whose decode names ``spaces_between_special_tokens``: records what it got."""

    def __init__(self) -> None:
        self.spacing_flags: list[bool] = []

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        self.spacing_flags.append(spaces_between_special_tokens)
        return "".join(chr(ord("a") + i) for i in ids)


class _PlainTokenizer:
    """A tokenizer whose decode does not know ``spaces_between_special_tokens``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_spaces_between_special_tokens_is_passed_where_supported() -> None:
    spacing = _SpacingTokenizer()
    batch = token_batch(
        ["r"], [[0, 1]], [LENGTH], new=[RequestConstants(spaces_between_special_tokens=False)])
    assert Detokenizer(spacing).handle_batch(batch).output_strs == ["ab"]
    assert spacing.spacing_flags and not any(spacing.spacing_flags)
    assert Detokenizer(_PlainTokenizer()).handle_batch(batch).output_strs == ["ab"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_decode_function_gives_the_tokenizers_own_text(name: str,
                                                           request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("".join(FRAGMENTS))
    for skip in (True, False):
        decode = make_decode_fn(tokenizer, skip_special_tokens=skip,
                                spaces_between_special_tokens=True)
        for start in range(0, len(ids), 7):
            for end in (start, start + 1, start + 5, len(ids)):
                assert decode(ids[start:end]) == tokenizer.decode(ids[start:end],
                                                                  skip_special_tokens=skip)


def test_a_fast_tokenizer_decodes_in_rust_directly_unless_its_decode_is_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(framework.default_model.default_model_path())
    ids = tokenizer.encode("def f(x):\n    return x")
    expected = tokenizer.decode(ids, skip_special_tokens=True)

    def refuse(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("transformers' decode was called")

    overriding = type("Overriding", (type(tokenizer),), {"_decode": refuse})
    monkeypatch.setattr(tokenizer, "__class__", overriding)  # a decode of its own
    with pytest.raises(AssertionError, match="was called"):
        make_decode_fn(tokenizer, skip_special_tokens=True,
                       spaces_between_special_tokens=True)(ids)
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer, "decode", refuse)  # as it is: the Rust tokenizer's decode
    assert make_decode_fn(tokenizer, skip_special_tokens=True,
                          spaces_between_special_tokens=True)(ids) == expected


# --------------------------------------------------------------------------- state and batches


def test_state_lives_until_the_request_finishes(gpt2: Any) -> None:
    detokenizer = Detokenizer(gpt2)
    ids = {rid: gpt2.encode(f"request {rid} says 🧑‍🚀") for rid in ("a", "b", "c")}
    texts_by_rid = dict.fromkeys(ids, "")
    longest = max(len(v) for v in ids.values())
    for step in range(longest):
        rids = [rid for rid in ids if step < len(ids[rid])]
        reasons = [LENGTH if step == len(ids[rid]) - 1 else None for rid in rids]
        new = [RequestConstants() if step == 0 else None for _ in rids]
        batch = token_batch(rids, [[ids[rid][step]] for rid in rids], reasons, new=new)
        for rid, text in zip(rids, detokenizer.handle_batch(batch).output_strs):
            texts_by_rid[rid] += text
        assert detokenizer.num_live_states() == sum(len(ids[rid]) > step + 1 for rid in ids)
    assert detokenizer.num_live_states() == 0
    assert texts_by_rid == {rid: gpt2.decode(v) for rid, v in ids.items()}


def test_abort_without_new_ids_drops_the_state(gpt2: Any) -> None:
    detokenizer = Detokenizer(gpt2)
    detokenizer.handle_batch(token_batch(["r"], [gpt2.encode("partial")], [None]))
    assert detokenizer.num_live_states() == 1
    abort = FinishReason(type="abort", message="client went away")
    out = detokenizer.handle_batch(token_batch(["r"], [[]], [abort], new=[None]))
    assert out.output_strs == [""] and out.finished_reasons == [abort]
    assert detokenizer.num_live_states() == 0


def test_batch_fields_are_copied_through(gpt2: Any) -> None:
    ids = [gpt2.encode("one"), gpt2.encode(" two three"), gpt2.encode(" four")]
    batch = token_batch(["x", "y", "z"], ids, [None, LENGTH, None], new=[
        RequestConstants(prompt_tokens=5, cached_tokens=0),
        RequestConstants(prompt_tokens=6, cached_tokens=4),
        RequestConstants(prompt_tokens=7, cached_tokens=1),
    ])
    # "x" and "y" asked for logprobs; "z" did not: NaN in the flat array, empty top lists.
    values = [[-0.5 * (k + 1) for k in range(len(i))] for i in ids[:2]]
    tops = [[[v, v - 1.0] for v in row] for row in values]
    top_ids = [[[t, t + 1] for t in i] for i in ids[:2]]
    batch.output_token_logprobs = np.array(
        [*values[0], *values[1], *[np.nan] * len(ids[2])], dtype=np.float32)
    batch.output_top_logprobs_val = [*tops[0], *tops[1], *[[]] * len(ids[2])]
    batch.output_top_logprobs_idx = [*top_ids[0], *top_ids[1], *[[]] * len(ids[2])]
    out = Detokenizer(gpt2).handle_batch(batch)
    assert out.handles == [handle_of(rid) for rid in ("x", "y", "z")]
    assert out.output_strs == ["one", " two three", " four"]
    assert out.output_ids == ids
    assert out.finished_reasons == [None, LENGTH, None]
    assert out.prompt_tokens == [5, 6, 7]
    assert out.completion_tokens == [len(i) for i in ids]  # first outputs: their own ids
    assert out.cached_tokens == [0, 4, 1]
    assert out.output_token_logprobs_val == [*values, []]
    assert out.output_token_logprobs_idx == [*ids[:2], []]
    assert out.output_top_logprobs_val == [*tops, []]
    assert out.output_top_logprobs_idx == [*top_ids, []]


def test_a_batch_of_new_and_continuing_requests(gpt2: Any) -> None:
    """Constants come with a request's first output only; later outputs use the kept ones."""
    detokenizer = Detokenizer(gpt2)
    first = token_batch(["old"], [gpt2.encode("Hello")], [None], new=[
        RequestConstants(stop_strs=[" world"], prompt_tokens=4, cached_tokens=2)])
    assert detokenizer.handle_batch(first).output_strs == ["Hello"]
    # "old" continues without constants; "new" starts, with its own.
    batch = token_batch(["old", "new"], [gpt2.encode(" wor"), gpt2.encode("Bye")],
                        [None, None], new=[None, RequestConstants(prompt_tokens=9)])
    out = detokenizer.handle_batch(batch)
    assert out.output_strs == ["", "Bye"]  # " wor" may start the stop string " world"
    assert out.prompt_tokens == [4, 9] and out.cached_tokens == [2, 0]
    assert out.output_token_logprobs_val == []  # nobody asked
    stop = FinishReason(type="stop", matched=" world")
    last = token_batch(["new", "old"], [gpt2.encode(" now"), gpt2.encode("ld")],
                       [LENGTH, stop], new=[None, None])
    out = detokenizer.handle_batch(last)
    assert out.output_strs == [" now", ""]
    assert out.finished_reasons == [LENGTH, stop]
    assert out.prompt_tokens == [9, 4]
    assert detokenizer.num_live_states() == 0
    assert detokenizer.constants == {}


def test_output_before_a_first_output_uses_default_constants(
    gpt2: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        out = Detokenizer(gpt2).handle_batch(
            token_batch(["lost"], [gpt2.encode("text")], [LENGTH], new=[None]))
    assert out.output_strs == ["text"] and out.prompt_tokens == [0]
    assert "before its first output" in caplog.text


class _NumberTokenizer:
    """A tokenizer that spells each id out, so any id decodes and every text is distinct."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


@settings(max_examples=100, deadline=None)
@given(batch=token_id_outputs())
def test_any_laid_out_batch_is_read_request_by_request(batch: BatchTokenIDOutput) -> None:
    """Whatever the mix of new, running, finished and logprob requests, each gets its own."""
    detokenizer = Detokenizer(_NumberTokenizer())
    out = detokenizer.handle_batch(batch)
    size = len(batch.handles)
    assert out.output_ids == [batch.ids_of(i) for i in range(size)]
    # A fresh Detokenizer: each request's count is the ids of this (its first) output.
    assert out.completion_tokens == [len(batch.ids_of(i)) for i in range(size)]
    for i, constants in batch.new_constants_by_index().items():
        assert out.prompt_tokens[i] == constants.prompt_tokens
        assert out.cached_tokens[i] == constants.cached_tokens
    if batch.output_token_logprobs is None:
        assert out.output_token_logprobs_val == out.output_top_logprobs_val == []
    for i in range(size if batch.output_token_logprobs is not None else 0):
        values = batch.logprobs_of(i)
        assert out.output_token_logprobs_val[i] == values
        assert out.output_token_logprobs_idx[i] == (batch.ids_of(i) if values else [])
        assert out.output_top_logprobs_val[i] == batch.top_logprobs_of(i)[0]
    handles = batch.handles.tolist()
    assert out.handles == handles
    finished = {handles[i] for i in batch.finished_indices}
    assert [r is not None for r in out.finished_reasons] == [h in finished for h in handles]
    assert set(detokenizer.constants) == set(handles) - finished
    assert set(detokenizer.completion_tokens) == set(handles) - finished


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("output_offsets", np.array([0, 1], dtype=np.int32), "output_offsets"),
        ("output_offsets", np.array([0, 3, 2], dtype=np.int32), "must not decrease"),
        ("output_offsets", np.array([[0, 1, 2]], dtype=np.int32), "output_offsets"),
        ("output_ids", np.array([1, 2, 3], dtype=np.int32), "output_offsets"),
        ("finished_indices", [0, 1], "finished_indices and finished_reasons"),
        ("new_indices", [0, 5], "out of range"),
        ("output_token_logprobs", np.zeros(1, dtype=np.float32), "output_token_logprobs"),
    ],
)
def test_misaligned_batch_is_refused(gpt2: Any, field: str, value: Any, problem: str) -> None:
    batch = token_batch(["x", "y"], [[1], [2]], [LENGTH, None])
    setattr(batch, field, value)
    with pytest.raises(ValueError, match=problem):
        Detokenizer(gpt2).handle_batch(batch)


def test_uneven_ids_without_offsets_are_refused(gpt2: Any) -> None:
    batch = token_batch(["x", "y"], [[1], [2, 3]], [None, None])
    batch.output_offsets = None  # 3 ids do not divide among 2 requests
    with pytest.raises(ValueError, match="do not divide"):
        Detokenizer(gpt2).handle_batch(batch)


def test_completion_tokens_are_counted_over_steps() -> None:
    """The count of a request's ids so far, from the ids themselves; dropped when it ends."""
    detokenizer = Detokenizer(_NumberTokenizer())
    steps = [
        # (rids, ids per request, finish reasons, uniform offsets)
        (["a", "b"], [[1, 2], [3]], [None, None], False),  # irregular: offsets
        (["a", "b"], [[4], [5]], [None, None], True),  # one id each: no offsets
        (["a", "b", "c"], [[], [6, 7, 8], [9]], [None, LENGTH, None], False),  # "b" ends
        (["a", "c"], [[10, 11], [12, 13]], [None, None], True),
        (["c", "a"], [[14], []], [None, LENGTH], False),  # "a" ends on no new id
    ]
    seen: set[str] = set()
    counts: list[list[int]] = []
    for rids, ids, reasons, uniform in steps:
        new = [None if rid in seen else RequestConstants(prompt_tokens=1) for rid in rids]
        seen.update(rids)
        out = detokenizer.handle_batch(token_batch(rids, ids, reasons, new=new, uniform=uniform))
        assert out.output_ids == ids
        counts.append(out.completion_tokens)
    assert counts == [[2, 1], [3, 2], [3, 5, 1], [5, 3], [4, 5]]
    assert detokenizer.completion_tokens == {handle_of("c"): 4}  # finished ones dropped
    detokenizer.handle_batch(token_batch(["c"], [[]], [LENGTH], new=[None], uniform=True))
    assert detokenizer.completion_tokens == {} and detokenizer.num_live_states() == 0


@pytest.mark.parametrize("uniform", [False, True])
def test_uniform_batches_read_the_same_with_or_without_offsets(uniform: bool) -> None:
    ids = [[1, 2], [3, 4], [5, 6]]
    batch = token_batch(["x", "y", "z"], ids, [None, LENGTH, None], uniform=uniform)
    assert (batch.output_offsets is None) == uniform
    assert batch.id_lists() == ids and [batch.ids_of(i) for i in range(3)] == ids
    out = Detokenizer(_NumberTokenizer()).handle_batch(batch)
    assert out.output_ids == ids and out.completion_tokens == [2, 2, 2]
    assert out.output_strs == ["<1><2>", "<3><4>", "<5><6>"]


def test_decode_step_can_be_overridden(gpt2: Any) -> None:
    class Shouting(Detokenizer):
        def decode_step(self, handle: int, new_ids: Sequence[int], *args: Any, **kw: Any) -> str:
            return super().decode_step(handle, new_ids, *args, **kw).upper()

    outputs = stream(Shouting(gpt2), [gpt2.encode("quiet please")], LENGTH)
    assert outputs == ["QUIET PLEASE"]


def test_incremental_decoder_alone(gpt2: Any) -> None:
    decoder = IncrementalDecoder(gpt2.decode)
    ids = gpt2.encode("日本語")
    pieces = [decoder.step([token]) for token in ids[:-1]]
    pieces.append(decoder.finish(ids[-1:]))
    check_stream(pieces, "日本語")


# --------------------------------------------------------------------------- the run loop


def test_run_over_inproc_transport(gpt2: Any, caplog: pytest.LogCaptureFixture) -> None:
    ids = gpt2.encode("Streaming 🧑‍🚀 text")
    chunks = split(ids, [2])

    async def scenario() -> list[BatchStrOutput]:
        transport = InprocTransport()
        into_detokenizer = transport.receiver("inproc://t/detokenizer", MsgpackCodec())
        out_of_detokenizer = transport.receiver("inproc://t/tokenizer", MsgpackCodec())
        scheduler_side = transport.sender("inproc://t/detokenizer", MsgpackCodec())
        detokenizer = Detokenizer(gpt2)
        to_tokenizer = transport.sender("inproc://t/tokenizer", MsgpackCodec())
        task = asyncio.create_task(detokenizer.run(into_detokenizer, to_tokenizer))
        # A garbled frame and a message of another type are skipped, not fatal.
        transport.pipe_sender("inproc://t/detokenizer").send_frames_nowait([b"\xc1garbage"])
        await scheduler_side.send(FlushCacheReqInput())
        for index, chunk in enumerate(chunks):
            reason = LENGTH if index == len(chunks) - 1 else None
            await scheduler_side.send(
                token_batch(["r"], [chunk], [reason], new=first_only(index, RequestConstants())))
        replies = [await asyncio.wait_for(out_of_detokenizer.recv(), timeout=5) for _ in chunks]
        assert out_of_detokenizer.recv_nowait() is None
        assert detokenizer.num_live_states() == 0
        # Closing the input channel ends the loop.
        into_detokenizer.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(task, timeout=5)
        out_of_detokenizer.close()
        return replies

    with caplog.at_level(logging.WARNING):
        replies = asyncio.run(scenario())
    assert all(isinstance(reply, BatchStrOutput) for reply in replies)
    check_stream([reply.output_strs[0] for reply in replies], "Streaming 🧑‍🚀 text")
    assert [reply.output_ids[0] for reply in replies] == chunks
    assert replies[-1].finished_reasons == [LENGTH]
    assert "did not decode" in caplog.text
    assert "FlushCacheReqInput" in caplog.text


# --------------------------------------------------------------------------- load_tokenizer


def test_load_tokenizer_round_trips_a_saved_tokenizer(llama: Any, tmp_path: Path) -> None:
    llama.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    text = "Hello 日本語 🧑‍🚀\n    code"
    assert loaded.encode(text) == llama.encode(text)
    assert loaded.decode(llama.encode(text)) == llama.decode(llama.encode(text))


def test_load_tokenizer_reads_vocab_and_merges(gpt2: Any) -> None:
    assert len(gpt2) == 50257
    assert gpt2.decode(gpt2.encode("naïve café")) == "naïve café"


def test_load_tokenizer_refuses_a_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "absent"))


def test_a_tokenizer_loads_once_its_class_is_known_but_a_bad_path_is_refused_at_once(
        tmp_path: Path) -> None:
    def known_class() -> concurrent.futures.Future[str]:
        return concurrent.futures.Future()

    with pytest.raises(ValueError, match="not a directory"):
        start_loading_tokenizer(str(tmp_path / "absent"), tokenizer_class=known_class())
    with pytest.raises(ValueError, match="no tokenizer files"):
        start_loading_tokenizer(str(tmp_path), tokenizer_class=known_class())
    default = str(Path(framework.default_model.__file__).parent)
    picked = load_tokenizer(default)
    tokenizer_class = known_class()
    loading = start_loading_tokenizer(default, tokenizer_class=tokenizer_class)
    assert not loading.done()  # it waits for the class
    tokenizer_class.set_result(tokenizer_class_path(picked))
    assert loading.result(timeout=120).encode("def f():") == picked.encode("def f():")
    # Start-up failed before a Scheduler reported the class: the load ends with that error.
    tokenizer_class = known_class()
    loading = start_loading_tokenizer(default, tokenizer_class=tokenizer_class)
    tokenizer_class.set_exception(RuntimeError("the scheduler failed to start"))
    with pytest.raises(RuntimeError, match="failed to start"):
        loading.result(timeout=120)
    (tmp_path / "tokenizer.json").write_text("not json")
    tokenizer_class = known_class()
    broken = start_loading_tokenizer(str(tmp_path), tokenizer_class=tokenizer_class)
    tokenizer_class.set_result(tokenizer_class_path(picked))  # found, but fails to load: later
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        broken.result(timeout=120)


@pytest.mark.parametrize("fixture", ["gpt2_dir", "saved_llama", "default_model"])
def test_a_tokenizer_loads_as_the_class_autotokenizer_picked(
        fixture: str, request: pytest.FixtureRequest, llama: Any, tmp_path: Path) -> None:
    # What the Detokenizer and the HTTP process do with the class the Scheduler reports.
    if fixture == "saved_llama":
        directory = str(tmp_path)
        llama.save_pretrained(directory)
    elif fixture == "default_model":
        directory = str(Path(framework.default_model.__file__).parent)
    else:
        directory = str(request.getfixturevalue(fixture))
    picked = load_tokenizer(directory)
    loaded = load_tokenizer(directory, tokenizer_class=tokenizer_class_path(picked))
    assert type(loaded) is type(picked)
    text = "Hello 日本語 🧑‍🚀\n    code <|endoftext|> </s>"
    assert loaded.encode(text) == picked.encode(text)
    assert loaded.decode(loaded.encode(text)) == picked.decode(picked.encode(text))


def test_a_tokenizer_of_a_known_class_loads_without_torch() -> None:
    # The HTTP process and the Detokenizer load one: torch would add seconds to their start
    # (AutoTokenizer imports it through transformers' model configurations).
    default = str(Path(framework.default_model.__file__).parent)
    name = tokenizer_class_path(load_tokenizer(default))
    code = ("import sys\n"
            "from framework.runtime.hf_tokenizer import load_tokenizer\n"
            f"assert load_tokenizer({default!r}, tokenizer_class={name!r}).encode('def f():')\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_load_tokenizer_reports_broken_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


# --------------------------------------------------------------------------- first-output context


def stream_with_first(
    detokenizer: Detokenizer,
    chunks: list[list[int]],
    finish: FinishReason,
    *,
    stop_strs: list[str] = (),  # type: ignore[assignment]
    context_ids: list[int] = (),  # type: ignore[assignment]
) -> list[str]:
    """Like ``stream``, with stop strings and context ids sent in the first output only."""
    constants = RequestConstants(stop_strs=list(stop_strs), context_ids=list(context_ids))
    outputs = []
    for index, chunk in enumerate(chunks):
        reason = finish if index == len(chunks) - 1 else None
        batch = token_batch(["r"], [chunk], [reason], new=first_only(index, constants))
        outputs.append(detokenizer.handle_batch(batch).output_strs[0])
    return outputs


@settings(max_examples=40, deadline=None)
@given(stop=st.sampled_from(["STOP", "swer", " is", "42.", "👍🏽"]), sizes=chunk_sizes)
def test_a_stream_never_shows_part_of_a_stop_string(
    gpt2: Any, stop: str, sizes: list[int]
) -> None:
    """Whatever the chunking, text that could start a stop string waits for the next chunk."""
    all_ids = gpt2.encode(STOP_TEXT)
    end = next(k for k in range(1, len(all_ids) + 1) if stop in gpt2.decode(all_ids[:k]))
    finish = FinishReason(type="stop", matched=stop)
    outputs = stream_with_first(Detokenizer(gpt2), split(all_ids[:end], sizes), finish,
                                stop_strs=[stop])
    whole = gpt2.decode(all_ids[:end])
    # Emitted text is never taken back, so the joined stream proves no partial stop leaked.
    check_stream(outputs, whole[: whole.index(stop)])


def test_a_request_that_runs_on_after_a_partial_stop_match_gets_its_text(gpt2: Any) -> None:
    ids = gpt2.encode("The answer is 4 and more")
    outputs = stream_with_first(Detokenizer(gpt2), [[t] for t in ids], LENGTH,
                                stop_strs=["is 42"])
    check_stream(outputs, "The answer is 4 and more")


def test_context_ids_give_the_first_token_its_leading_space(llama: Any) -> None:
    prompt = llama.encode("The capital of France is", add_special_tokens=False)
    full = llama.encode("The capital of France is Paris", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt):]
    with_context = stream_with_first(Detokenizer(llama), [output], LENGTH,
                                     context_ids=prompt[-5:])
    without = stream_with_first(Detokenizer(llama), [output], LENGTH)
    assert "".join(with_context) == " Paris"
    assert "".join(without) == "Paris"
