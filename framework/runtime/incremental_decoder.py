"""Incremental decoding of a request's output, shared by the Detokenizer and the Scheduler.

Decoding is incremental, as in vLLM and SGLang. Each request keeps its output
ids and two offsets: ``read_offset`` ends the ids whose text has been
accounted for, and ``prefix_offset`` starts a window of context before them.
A step decodes the window ``ids[prefix_offset:]`` and subtracts the decoding
of ``ids[prefix_offset:read_offset]``: decoding tokens one by one would lose
SentencePiece's leading-space handling and split byte-level characters, while
decoding the whole output every step would cost O(n²).

Text must never end in the middle of a character. A multi-byte character
spread over several tokens (byte-level BPE, SentencePiece byte fallback)
decodes to U+FFFD until its last byte arrives, so a trailing run of U+FFFD is
held back until the character completes, or until the request finishes, when
everything left is flushed.

The Detokenizer streams this text to the client; the Scheduler matches stop
strings on the very same text (``StopStringMatcher``), so that a stop string
is found exactly where the client would see it, and both decode with the
function that ``make_decode_fn`` builds.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: What a decoder yields for bytes that do not (yet) form a whole character.
REPLACEMENT_CHAR = "\ufffd"

#: Ids to text, with the request's settings (special tokens skipped or not) already bound.
DecodeFn = Callable[[Sequence[int]], str]

_SPACING_FLAG = "spaces_between_special_tokens"


def make_decode_fn(
    tokenizer: Any, *, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> DecodeFn:
    """The tokenizer's decode with a request's settings bound.

    ``spaces_between_special_tokens`` is passed only where the tokenizer's
    decode names it (slow transformers tokenizers do; the Rust-backed ones
    take no such flag). The Detokenizer and the Scheduler both decode through
    this function, so that they see the same text.

    Where all that ``tokenizer.decode`` would do is call its Rust tokenizer
    (``_rust_decode``), that is called directly: the same text, without a few
    microseconds of transformers' argument handling on each of the two decodes of
    every step of every request.
    """
    rust_decode = _rust_decode(tokenizer)
    if rust_decode is not None:

        def decode_directly(ids: Sequence[int]) -> str:
            return rust_decode(list(ids), skip_special_tokens=skip_special_tokens)

        return decode_directly
    settings: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
    if _accepts_keyword(tokenizer, _SPACING_FLAG):
        settings[_SPACING_FLAG] = spaces_between_special_tokens

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), **settings)

    return decode


def _rust_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's ``decode``, when ``tokenizer.decode(ids, skip_special_tokens=s)``
    does nothing else: a transformers fast tokenizer (``TokenizersBackend``) with
    transformers' own ``decode`` and ``_decode``, which cleans up no spaces. Else None.
    """
    backend_module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base_module = sys.modules.get("transformers.tokenization_utils_base")
    backend = getattr(backend_module, "TokenizersBackend", None)
    base = getattr(base_module, "PreTrainedTokenizerBase", None)
    if backend is None or base is None or not isinstance(tokenizer, backend):
        return None
    cls = type(tokenizer)
    if cls.decode is not base.decode or cls._decode is not backend._decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return tokenizer._tokenizer.decode


def _accepts_keyword(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's decode (or the ``_decode`` it delegates to) names ``name``."""
    for method_name in ("decode", "_decode"):
        method = getattr(tokenizer, method_name, None)
        if method is None:
            continue
        try:
            parameters = inspect.signature(method).parameters
        except (TypeError, ValueError):  # builtins without a signature
            continue
        if name in parameters:
            return True
    return False


class IncrementalDecoder:
    """The text state of one request: its output ids, the two offsets, what was emitted.

    ``decode`` turns a list of ids into text with the request's settings
    (special tokens skipped or not) already bound. With ``stop_strs``, a tail
    of the text that could be the start of a stop string is held back while
    streaming (see ``step``).
    """

    def __init__(self, decode: DecodeFn, context_ids: Sequence[int] = (),
                 stop_strs: Sequence[str] = ()) -> None:
        self.decode = decode
        # Context ids (the end of the prompt) sit before the output in the window but are
        # never part of the text: the first output token then keeps its leading space.
        self.ids: list[int] = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop_strs = [s for s in stop_strs if s]
        #: The text of ``ids[:read_offset]``.
        self.text = ""
        #: How many characters have been emitted; may run ahead of ``text`` by a printable tail.
        self.sent_len = 0

    def step(self, new_ids: Sequence[int]) -> str:
        """Add ids of a running request; return the new text that is safe to show.

        That is the text so far, without a trailing incomplete character and
        without a tail that could be the start of a stop string.
        """
        self.ids.extend(new_ids)
        tail = self._unread_text(len(self.ids))
        if tail and not tail.endswith(REPLACEMENT_CHAR):
            self.text += tail
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return self._emit(self._hold_stop_prefix(self.text))
        # The offsets stay put: the window is decoded again once the character's
        # remaining bytes arrive. What precedes the incomplete character is final.
        return self._emit(self._hold_stop_prefix(self.text + tail.rstrip(REPLACEMENT_CHAR)))

    def finish(
        self,
        new_ids: Sequence[int],
        *,
        stop_token: int | None = None,
        stop_str: str | None = None,
    ) -> str:
        """Add the last ids of a finished request; return all the text not yet emitted.

        ``stop_token`` is left out of the text when it is the last new id;
        ``stop_str`` cuts the whole text right before its first occurrence,
        which is where ``StopStringMatcher`` found it.
        """
        self.ids.extend(new_ids)
        end = len(self.ids)
        if stop_token is not None and len(new_ids) > 0 and new_ids[-1] == stop_token:
            end -= 1
        full_text = self.text + self._unread_text(end)
        if stop_str:
            cut = full_text.find(stop_str)
            if cut != -1:
                full_text = full_text[:cut]
        return self._emit(full_text)

    def _hold_stop_prefix(self, text: str) -> str:
        """``text`` without a tail that could be the start of a stop string.

        The Scheduler ends a request on the token that completes a stop string
        and ``finish`` cuts it; until then a partial match must not be shown,
        since emitted text is never taken back. ``text`` never ends in U+FFFD
        here: an incomplete character is cut off before, and its bytes are
        not shown either, so a stop string that starts with it needs no hold.
        """
        hold = 0
        # Searching the unsent part is enough: a longer match would start in text that
        # the last step held already, as a shorter match ending where that text ended.
        unsent = len(text) - self.sent_len
        for stop in self.stop_strs:
            for k in range(min(len(stop) - 1, unsent), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold] if hold else text

    def _unread_text(self, end: int) -> str:
        """The text of ``ids[read_offset:end]``, decoded in the context of the window."""
        if end <= self.read_offset:
            return ""
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self.decode(self.ids[self.prefix_offset : end])
        return window_text[len(prefix_text) :]

    def _emit(self, visible_text: str) -> str:
        """The part of ``visible_text`` not emitted yet (emitted text is never taken back)."""
        new_text = visible_text[self.sent_len :]
        self.sent_len += len(new_text)
        return new_text


class StopStringMatcher:
    """Finds a request's stop strings in its output text as the client receives it.

    The text is that of an ``IncrementalDecoder`` built like the
    Detokenizer's (same decode function, same context ids) and holding
    nothing back for stop strings: the decoded text plus its decodable tail.
    A trailing incomplete character (U+FFFD) is not text yet, so a stop
    string made of multi-byte characters is found at the token that
    completes its last character, and a SentencePiece leading space or a
    special token's text (with ``skip_special_tokens=False``) is found as the
    client sees it.

    Each ``append`` searches only its new text plus the ``len(longest stop) -
    1`` characters before it, so a request's whole search is linear in its
    length.
    """

    def __init__(
        self, decode: DecodeFn, stop_strs: Sequence[str], context_ids: Sequence[int] = ()
    ) -> None:
        # Empty stop strings would match everywhere; repeated ones add nothing.
        self.stop_strs: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strs if s))
        self._decoder = IncrementalDecoder(decode, context_ids)
        self._overlap = max((len(s) for s in self.stop_strs), default=1) - 1
        #: The last ``_overlap`` characters of the text searched so far.
        self._recent = ""
        #: How many output ids were appended.
        self.num_output_ids = 0

    def append(self, new_ids: Sequence[int]) -> str | None:
        """Add output ids; return the stop string the text now contains, or ``None``.

        Only an occurrence that ends in the text these ids added counts, so a
        stop string is reported once, at the ids that complete it. When
        several stop strings are completed at once, the one whose occurrence
        starts first in the text wins (``IncrementalDecoder.finish`` cuts the
        text right there); of those starting at the same place, the longest.
        """
        self.num_output_ids += len(new_ids)
        if not self.stop_strs:
            return None
        new_text = self._decoder.step(new_ids)
        if not new_text:
            return None
        searched = self._recent + new_text
        self._recent = searched[max(0, len(searched) - self._overlap) :]
        return _first_occurrence(searched, self.stop_strs, len(searched) - len(new_text))


def _first_occurrence(text: str, stops: Sequence[str], new_from: int) -> str | None:
    """The stop that occurs first in ``text`` among those ending after ``new_from``.

    Ties (same start) go to the longest stop string.
    """
    best: tuple[int, int] | None = None
    found: str | None = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start == -1:
            continue
        rank = (start, -len(stop))
        if best is None or rank < best:
            best, found = rank, stop
    return found
