"""The tokens of a logprobs answer: each token's bytes, how it is shown, where it starts.

Byte-level BPE and SentencePiece byte-fallback vocabularies spread a multi-byte character
over several tokens, and each such token decoded alone is U+FFFD. ``TokenText`` reads a
token's bytes from the vocabulary instead: its string (``convert_ids_to_tokens``) through
the vocabulary's byte mapping. ``TextOffsets`` finds where each token starts in a decoded
text, decoding as the Detokenizer does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import Any

from framework.runtime.incremental_decoder import DecodeFn, IncrementalDecoder, make_decode_fn

# How a vocabulary's token strings stand for bytes.
BYTE_LEVEL = "byte_level"  # GPT-2's alphabet: one printable character per byte
SENTENCEPIECE = "sentencepiece"  # "▁" for a space, "<0xNN>" for a byte of byte fallback
PLAIN = "plain"  # a token string is its text

_SPACE_MARK = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character stands for.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...)
    take the characters from U+0100 on, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: byte for byte in printable}
    shifted = 256
    for byte in range(256):
        if byte not in chars:
            chars[byte] = shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


_BYTE_LEVEL_ALPHABET = byte_level_alphabet()


def _decoder_parts(spec: Any) -> Iterator[dict[str, Any]]:
    """Every decoder in a ``tokenizers`` decoder's JSON, those inside a Sequence too."""
    if isinstance(spec, dict):
        yield spec
        for inner in spec.get("decoders") or ():
            yield from _decoder_parts(inner)


def vocabulary_kind(tokenizer: Any) -> str:
    """How ``tokenizer``'s token strings stand for bytes: ``BYTE_LEVEL``, ``SENTENCEPIECE``
    or ``PLAIN``, read from its decoder (or, for a slow tokenizer, from its attributes)."""
    if getattr(tokenizer, "byte_decoder", None):  # slow GPT-2-style tokenizers
        return BYTE_LEVEL
    if getattr(tokenizer, "sp_model", None) is not None:  # slow SentencePiece tokenizers
        return SENTENCEPIECE
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return PLAIN
    parts = list(_decoder_parts(json.loads(decoder.__getstate__())))
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return BYTE_LEVEL
    marks_spaces = any(part.get("type") == "Replace"
                       and part.get("pattern") == {"String": _SPACE_MARK} for part in parts)
    if marks_spaces or types & {"ByteFallback", "Metaspace"}:
        return SENTENCEPIECE
    return PLAIN


class TokenText:
    """The bytes and the shown string of each token of one tokenizer (cached by id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = vocabulary_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # Added tokens (special ones included) are stored as their text, in any vocabulary.
        self._added: dict[int, str] = {int(i): getattr(token, "content", str(token))
                                    for i, token in added.items()}
        self._bytes: dict[int, bytes] = {}
        self._decode_fns: dict[tuple[bool, bool], DecodeFn] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for; a piece of a character is that piece."""
        value = self._bytes.get(token_id)
        if value is None:
            value = self._bytes[token_id] = self._read_bytes(token_id)
        return value

    def _read_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        token = self.tokenizer.convert_ids_to_tokens([token_id])[0]
        if token is None:  # an id of the model's padded vocabulary that the tokenizer lacks
            return b""
        if self.kind == BYTE_LEVEL and all(c in _BYTE_LEVEL_ALPHABET for c in token):
            return bytes(_BYTE_LEVEL_ALPHABET[c] for c in token)
        if self.kind == SENTENCEPIECE:
            byte = _BYTE_TOKEN.fullmatch(token)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            return token.replace(_SPACE_MARK, " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def shown(self, token_id: int) -> str:
        """``token_id`` as a string: its bytes as UTF-8, each byte that is not part of a whole
        character in them written as a ``\\xNN`` escape."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def in_text(self, token_id: int, decode: DecodeFn) -> bool:
        """False for an added token that ``decode`` leaves out (a special token skipped)."""
        return token_id not in self._added or decode([token_id]) != ""

    def decode_fn(self, skip_special_tokens: bool,
                  spaces_between_special_tokens: bool = True) -> DecodeFn:
        """The tokenizer's decode with these settings, as the Detokenizer builds it."""
        key = (skip_special_tokens, spaces_between_special_tokens)
        decode = self._decode_fns.get(key)
        if decode is None:
            decode = self._decode_fns[key] = make_decode_fn(
                self.tokenizer, skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens)
        return decode


class TextOffsets:
    """Where each token of a sequence starts in its decoded text, fed token after token.

    It decodes incrementally as the Detokenizer does (same decode settings, same
    context), so an offset is a position in the text the client gets. A character
    spread over several tokens enters the text at the token that completes it: every
    token that holds part of it starts at the character's offset. A token the text
    leaves out (a special token skipped) starts where the next one does.
    """

    def __init__(self, decode: DecodeFn, context_ids: Sequence[int] = (),
                 start: int = 0) -> None:
        self._decoder = IncrementalDecoder(decode, context_ids)
        #: Where the next token starts.
        self.offset = start

    def take(self, token_ids: Sequence[int], final: bool = False) -> list[int]:
        """The offsets of ``token_ids``, the next tokens; ``final``: the sequence ends with
        them, so an incomplete character at its end is text too (as U+FFFD)."""
        offsets = []
        for i, token_id in enumerate(token_ids):
            offsets.append(self.offset)
            if final and i == len(token_ids) - 1:
                self.offset += len(self._decoder.finish([token_id]))
            else:
                self.offset += len(self._decoder.step([token_id]))
        return offsets


__all__ = ["BYTE_LEVEL", "PLAIN", "SENTENCEPIECE", "TextOffsets", "TokenText",
           "byte_level_alphabet", "vocabulary_kind"]
