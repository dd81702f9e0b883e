"""Token bytes and text offsets of logprobs answers, on the vocabularies tokenizers use.

Byte-level BPE (the default model's and the tiny models' tokenizers) and SentencePiece
with byte fallback (Llama-style, fast and slow) split a character such as "日" over
several tokens; each token must still give its own bytes, and every offset must be a
position in the decoded text.
"""

from __future__ import annotations

import io
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import transformers

from framework.default_model import default_model_path
from framework.runtime.incremental_decoder import REPLACEMENT_CHAR
from framework.server.token_text import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    TextOffsets,
    TokenText,
    byte_level_alphabet,
    vocabulary_kind,
)
from tests.model_fixtures import make_tiny_tokenizer

TEXT = "abc 日本語 café é done"
SPACE_MARK = "\u2581"


@cache
def default_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@cache
def llama_style_tokenizer() -> Any:
    """A fast tokenizer as Llama's: "▁" for spaces, <0xNN> tokens for unknown characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    pieces = [SPACE_MARK, "a", "b", "c", "d", "e", "f", "n", "o", "é", f"{SPACE_MARK}c",
              "ab", f"{SPACE_MARK}d", "on"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2,
             **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)},
             **{piece: 259 + i for i, piece in enumerate(pieces)}}
    merges = [(SPACE_MARK, "c"), ("a", "b"), (SPACE_MARK, "d"), ("o", "n")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK),
                                               normalizers.Replace(" ", SPACE_MARK)])
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def slow_sentencepiece_tokenizer(tmp_path: Path) -> Any:
    """A slow (``sp_model``) SentencePiece tokenizer with byte fallback, trained here."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    corpus = ["The quick brown fox jumps over the lazy dog.", "abc done, and more text"] * 20
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=300,
        byte_fallback=True, model_type="bpe", minloglevel=2)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return SentencePieceBackend(vocab_file=str(path))


def text_ids(tokenizer: Any) -> list[int]:
    """TEXT's ids without the special tokens the tokenizer adds."""
    return tokenizer.encode(TEXT, add_special_tokens=False)


def test_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["a"] == ord("a") and alphabet["\u0120"] == ord(" ")  # "Ġ" is a space


def test_kinds_of_vocabulary() -> None:
    assert vocabulary_kind(default_tokenizer()) == BYTE_LEVEL
    assert vocabulary_kind(make_tiny_tokenizer()) == BYTE_LEVEL
    assert vocabulary_kind(llama_style_tokenizer()) == SENTENCEPIECE


@pytest.mark.parametrize("tokenizer", [default_tokenizer, make_tiny_tokenizer],
                         ids=["default", "tiny"])
def test_byte_level_tokens_hold_the_bytes_of_split_characters(tokenizer: Any) -> None:
    tok = tokenizer()
    text = TokenText(tok)
    ids = text_ids(tok)
    assert b"".join(text.token_bytes(t) for t in ids) == TEXT.encode()
    # "日" (e6 97 a5) is spread over tokens: each holds its part, shown as escapes.
    partial = [t for t in ids if text.token_bytes(t) == b"\xe6"]
    assert partial and text.shown(partial[0]) == "\\xe6"
    assert "".join(text.shown(t) for t in ids).startswith("abc ")


def test_sentencepiece_tokens_hold_their_byte_and_their_space() -> None:
    tok = llama_style_tokenizer()
    text = TokenText(tok)
    ids = text_ids(tok)
    assert "<0xE6>" in tok.convert_ids_to_tokens(ids)
    # "▁" is a space; the one the tokenizer puts first is dropped by decoding alone.
    assert b"".join(text.token_bytes(t) for t in ids) == f" {TEXT}".encode()
    assert text.token_bytes(tok.convert_tokens_to_ids("<0xE6>")) == b"\xe6"


def test_slow_sentencepiece_tokens_hold_their_byte(tmp_path: Path) -> None:
    tok = slow_sentencepiece_tokenizer(tmp_path)
    text = TokenText(tok)
    assert text.kind == SENTENCEPIECE
    ids = text_ids(tok)
    assert b"".join(text.token_bytes(t) for t in ids) == f" {TEXT}".encode()


def test_an_id_past_the_tokenizer_has_no_bytes() -> None:
    # Models pad their vocabulary past the tokenizer's; such an id may be among the top ones.
    text = TokenText(default_tokenizer())
    assert text.token_bytes(len(default_tokenizer()) + 3) == b""


def test_special_tokens_are_left_out_of_the_text_only_when_skipped() -> None:
    tok = default_tokenizer()
    text = TokenText(tok)
    eos = tok.eos_token_id
    assert text.shown(eos) == tok.eos_token and text.token_bytes(eos) == tok.eos_token.encode()
    assert not text.in_text(eos, text.decode_fn(skip_special_tokens=True))
    assert text.in_text(eos, text.decode_fn(skip_special_tokens=False))
    assert text.in_text(text_ids(tok)[0], text.decode_fn(skip_special_tokens=True))


def expected_offsets(decode: Any, context: list[int], ids: list[int]) -> list[int]:
    """Token i starts where the text of the tokens before it ends, back to the last token
    that ends a whole character: found by decoding every prefix (byte fallback turns the
    bytes of a run with an incomplete character all into U+FFFD)."""
    before = len(decode(context)) if context else 0
    offsets = []
    for i in range(len(ids)):
        while decode(context + ids[:i]).endswith(REPLACEMENT_CHAR):
            i -= 1
        offsets.append(len(decode(context + ids[:i])) - before)
    return offsets


@pytest.mark.parametrize("tokenizer", [default_tokenizer, llama_style_tokenizer],
                         ids=["byte-level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_offsets_are_positions_in_the_decoded_text(tokenizer: Any,
                                                   skip_special_tokens: bool) -> None:
    tok = tokenizer()
    decode = TokenText(tok).decode_fn(skip_special_tokens)
    ids = [*tok.encode(TEXT), tok.eos_token_id]  # with the special tokens around it
    offsets = TextOffsets(decode).take(ids, final=True)
    assert offsets == expected_offsets(decode, [], ids)
    assert offsets == sorted(offsets) and offsets[-1] <= len(decode(ids))


def test_offsets_after_a_context_and_across_calls() -> None:
    tok = llama_style_tokenizer()
    decode = TokenText(tok).decode_fn(skip_special_tokens=True)
    context = tok.encode("ab")
    ids = tok.encode(TEXT, add_special_tokens=False)
    offsets = TextOffsets(decode, context, start=7)
    # Fed in two parts, as a stream's outputs come: the same offsets as in one go.
    got = offsets.take(ids[:5]) + offsets.take(ids[5:], final=True)
    # After the context the first token keeps its space: the output is " abc 日本語 ...".
    assert got == [7 + o for o in expected_offsets(decode, context, ids)]
    assert offsets.offset == 7 + len(f" {TEXT}")


def test_a_character_cut_off_at_the_end_is_text_once_final() -> None:
    tok = default_tokenizer()
    decode = TokenText(tok).decode_fn(skip_special_tokens=True)
    ids = text_ids(tok)
    cut = next(i for i in range(len(ids)) if decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    offsets = TextOffsets(decode)
    offsets.take(ids[:cut], final=True)
    assert offsets.offset == len(decode(ids[:cut]))  # the U+FFFD counts, as in the text
