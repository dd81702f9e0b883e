"""Reasoning parsers: a reasoning model's output split into its reasoning and its answer.

Reasoning models write their thinking between ``<think>`` and ``</think>``, then the
answer; the API returns the thinking as ``reasoning_content`` and the answer as
``content``. Two conventions are served (``--reasoning-parser``):

* DeepSeek-R1 (``deepseek-r1``): the chat template ends the prompt with ``<think>\\n``,
  so the output starts inside the reasoning and usually holds only ``</think>``.
  Everything before ``</think>`` is reasoning (a leading ``<think>`` the model writes
  anyway is dropped), the rest is content. An output without ``</think>`` is all
  reasoning: it was cut before the answer.
* Qwen3 (``qwen3``): the model opens the reasoning itself. The output is reasoning only
  when it starts (after whitespace) with ``<think>``; then it is reasoning up to
  ``</think>`` (all of it, when ``</think>`` never comes) and content after. An output
  that does not start with ``<think>`` is all content.

A request that turned thinking off (``thinking=False``) gets all its text as content.
Both parts are stripped of surrounding whitespace, in ``parse`` and in a stream alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ReasoningDelta:
    """One piece of a stream: reasoning text or content text (one of the two is set)."""

    reasoning: str | None = None
    content: str | None = None


class _Part(Enum):
    """Where a stream is: before the output shows whether it reasons, or in a part."""

    UNDECIDED = "undecided"
    REASONING = "reasoning"
    CONTENT = "content"


class _Stripped:
    """Emits one part of a stream without its leading and trailing whitespace.

    Leading whitespace is dropped; whitespace is held back until text follows it, so
    whitespace that ends the part is never emitted.
    """

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, text: str) -> str:
        """The part's text that ``text`` makes known (``""`` while it is all whitespace)."""
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _stripped(text: str) -> str | None:
    return text.strip() or None


class ReasoningParser:
    """Splits one output (one choice) into reasoning and content; one instance per choice.

    ``feed`` takes the output's text piece by piece and returns what each piece makes
    known at once, holding back only what may still be the start of a marker (or
    whitespace that may end a part); the pieces of a whole stream (``finish`` included)
    joined per part equal what ``parse`` gives for the whole text (None: no piece).
    """

    start: str = "<think>"
    end: str = "</think>"
    #: Whether an output starts inside the reasoning even without `start` (the chat
    #: template opened it).
    starts_in_reasoning: bool = False

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self._part = _Part.UNDECIDED if thinking else _Part.CONTENT
        self._buffer = ""
        self._reasoning = _Stripped()
        self._content = _Stripped()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output, each stripped, None when empty."""
        if not self.thinking:
            return None, _stripped(text)
        head = text.lstrip()
        if head.startswith(self.start):
            text = head[len(self.start):]
        elif not self.starts_in_reasoning:
            return None, _stripped(text)
        reasoning, found, content = text.partition(self.end)
        return _stripped(reasoning), _stripped(content) if found else None

    def feed(self, text: str) -> list[ReasoningDelta]:
        """The pieces that ``text`` (the output's next characters) makes known."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[ReasoningDelta]:
        """The pieces still held back, at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ReasoningDelta]:
        """Emit what the buffer makes known; at the end (``final``), all of it."""
        out: list[ReasoningDelta] = []
        if self._part is _Part.UNDECIDED:
            self._decide(final)
        if self._part is _Part.REASONING:
            self._scan_reasoning(out, final)
        if self._part is _Part.CONTENT:
            self._emit(out, content=self._content.push(self._buffer))
            self._buffer = ""
        return out

    def _decide(self, final: bool) -> None:
        """Leave UNDECIDED once the buffer shows whether the output opens with ``start``."""
        head = self._buffer.lstrip()
        if head.startswith(self.start):
            self._buffer = head[len(self.start):]
            self._part = _Part.REASONING
        elif final or not self.start.startswith(head):
            self._part = _Part.REASONING if self.starts_in_reasoning else _Part.CONTENT

    def _scan_reasoning(self, out: list[ReasoningDelta], final: bool) -> None:
        """Emit reasoning up to ``end`` (then switch to content), or all but a partial marker."""
        before, found, after = self._buffer.partition(self.end)
        if found:
            self._emit(out, reasoning=self._reasoning.push(before))
            self._buffer = after
            self._part = _Part.CONTENT
            return
        keep = 0 if final else _held_back(self._buffer, self.end)
        self._emit(out, reasoning=self._reasoning.push(self._buffer[:len(self._buffer) - keep]))
        self._buffer = self._buffer[len(self._buffer) - keep:]

    @staticmethod
    def _emit(out: list[ReasoningDelta], reasoning: str = "", content: str = "") -> None:
        if reasoning:
            out.append(ReasoningDelta(reasoning=reasoning))
        if content:
            out.append(ReasoningDelta(content=content))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the prompt opened the reasoning, so output is reasoning until ``</think>``."""

    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: output is reasoning only when it opens with ``<think>``."""

    starts_in_reasoning = False
