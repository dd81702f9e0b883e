"""The shapes of OpenAI's answers built from runtime outputs: ids, usage, finish reasons,
logprobs (legacy completions and chat), and the chunks of a streamed answer.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from framework.runtime.incremental_decoder import DecodeFn
from framework.server.token_text import TextOffsets, TokenText


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp."""
    return int(time.time())


def finish_reason_name(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason string from the runtime's finish reason object."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason["type"], "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _legacy_top(entry: list[Any], row: list[list[Any]] | None,
                text: TokenText) -> dict[str, float] | None:
    """One position's ``top_logprobs``: its top tokens, and always the chosen one (so
    ``logprobs + 1`` entries at most, as OpenAI's API answers)."""
    if row is None:
        return None
    top = {text.shown(tid): lp for lp, tid, _ in row}
    logprob, chosen, _ = entry
    top.setdefault(text.shown(chosen), logprob)
    return top


def _legacy_logprobs(entries: list[list[Any]], tops: list[Any], text: TokenText,
                     offsets: list[int]) -> dict[str, Any]:
    """The legacy ``logprobs`` object of ``[logprob, id, text]`` entries, their top rows
    and offsets."""
    return {
        "tokens": [text.shown(tid) for _, tid, _ in entries],
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [_legacy_top(entry, row, text) for entry, row in zip(entries, tops)],
        "text_offset": offsets,
    }


def completion_logprobs(meta: dict[str, Any], text: TokenText, offsets: TextOffsets,
                        start: int) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for output tokens ``start:`` of ``meta``.

    ``offsets`` has taken the output's tokens before ``start`` (it started where the
    output starts in the choice's text); it takes these ones.
    """
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in entries]
    new = entries[start:]
    final = meta.get("finish_reason") is not None
    return _legacy_logprobs(new, tops[start:], text,
                            offsets.take([tid for _, tid, _ in new], final=final))


def prompt_logprobs(meta: dict[str, Any], text: TokenText,
                    offsets: TextOffsets) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for the prompt (``echo``).

    As OpenAI's API answers, the first token has ``null`` for its logprob and
    top logprobs: nothing comes before it. ``offsets`` decodes as the echoed prompt is.
    """
    entries = meta.get("input_token_logprobs")
    if entries is None:
        return None
    tops = meta.get("input_top_logprobs") or [None for _ in entries]
    return _legacy_logprobs(entries, tops, text,
                            offsets.take([tid for _, tid, _ in entries], final=True))


def join_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None
                  ) -> dict[str, Any] | None:
    """Two legacy ``logprobs`` objects one after the other (the prompt's, then the output's)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in then}


def chat_logprobs(meta: dict[str, Any], text: TokenText, decode: DecodeFn,
                  start: int) -> dict[str, Any] | None:
    """The chat ``logprobs`` object (``content`` list) for tokens ``start:``.

    ``bytes`` are each token's own bytes, so that joining them rebuilds the text, also
    where a character is spread over several tokens; they are ``null`` for a token the
    text leaves out (a special token that ``decode``, the request's, skips).
    """
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in entries]

    def entry(logprob: float, tid: int, _text: str | None) -> dict[str, Any]:
        in_text = text.in_text(tid, decode)
        return {"token": text.shown(tid), "logprob": logprob,
                "bytes": list(text.token_bytes(tid)) if in_text else None}

    return {"content": [
        {**entry(*first), "top_logprobs": [entry(*each) for each in row]}
        for first, row in zip(entries[start:], tops[start:])
    ]}


@dataclasses.dataclass
class StreamChunks:
    """The chunks of one streamed OpenAI answer: one id, object and creation time for all."""

    id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    model: str
    include_usage: bool  # stream_options.include_usage: the last chunk carries usage
    created: int = dataclasses.field(default_factory=now)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk with one choice's news; with ``include_usage``, ``usage`` is null on it."""
        out = self._chunk([choice])
        if self.include_usage:
            out["usage"] = None
        return out

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of an ``include_usage`` stream: no choices, the request's usage."""
        return {**self._chunk([]), "usage": usage}
