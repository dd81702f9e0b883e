"""One chat choice's answer: its text split into reasoning, content and tool calls.

A ``ChoiceOutput`` runs a choice's text through the server's reasoning parser
(``reasoning_content``) and then through the request's tool-call parser
(``tool_calls``), for a whole answer (``message``) or a stream (``feed``), in
OpenAI's shapes. Without either parser the text is the content, as it comes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from framework.reasoning_parsers import ReasoningParser
from framework.tool_parsers.base import Delta, ToolParser, new_call_id


class ChoiceOutput:
    """Shapes one choice's output; ``reasoning`` and ``tools`` are fresh parsers, or None."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._call_ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        """Whether a tool call has been streamed (or, after ``message``, made)."""
        return bool(self._call_ids)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when an output that stopped made calls."""
        return "tool_calls" if reason == "stop" and self.called else reason

    # ------------------------------------------------------------------ whole answers

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` of a whole answer whose output is ``text``."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text)
            message["reasoning_content"] = reasoning
            message["content"] = content
            text = content or ""
        if self.tools is not None:
            parsed = self.tools.parse(text)
            message["content"] = parsed.content
            if parsed.calls:
                message["tool_calls"] = [
                    self._call_entry(i, call.name, call.arguments)
                    for i, call in enumerate(parsed.calls)]
        return message

    def _call_entry(self, index: int, name: str, arguments: str) -> dict[str, Any]:
        call_id = self._call_ids.setdefault(index, new_call_id())
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    # ------------------------------------------------------------------ streams

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The ``delta`` of a stream's chunk for its next ``text``; ``final``: the output
        ends with it, so nothing is held back."""
        if self.reasoning is None and self.tools is None:
            return {"content": text}
        reasoning_parts: list[str] = []
        content_parts: list[str] = []
        if self.reasoning is None:
            content_parts.append(text)
        else:
            pieces = self.reasoning.feed(text)
            if final:
                pieces += self.reasoning.finish()
            for piece in pieces:
                if piece.reasoning:
                    reasoning_parts.append(piece.reasoning)
                if piece.content:
                    content_parts.append(piece.content)
        delta: dict[str, Any] = {}
        if reasoning_parts:
            delta["reasoning_content"] = "".join(reasoning_parts)
        if self.tools is None:
            if content_parts:
                delta["content"] = "".join(content_parts)
            return delta or {"content": ""}
        tool_deltas = self.tools.feed("".join(content_parts))
        if final:
            tool_deltas += self.tools.finish()
        content = "".join(d.content for d in tool_deltas if d.content)
        if content:
            delta["content"] = content
        calls = self._stream_calls(d for d in tool_deltas if d.index is not None)
        if calls:
            delta["tool_calls"] = calls
        return delta or {"content": ""}

    def _stream_calls(self, deltas: Iterable[Delta]) -> list[dict[str, Any]]:
        """OpenAI's streamed ``tool_calls`` entries of ``deltas``: a call's id, type and name
        in its first entry, its argument fragments after (one entry per call here)."""
        entries: dict[int, dict[str, Any]] = {}
        for delta in deltas:
            index = delta.index
            assert index is not None
            entry = entries.get(index)
            if entry is None:
                entry = entries[index] = {"index": index, "function": {"arguments": ""}}
                if delta.name is not None and index not in self._call_ids:
                    entry.update(id=self._call_ids.setdefault(index, new_call_id()),
                                 type="function")
                    entry["function"] = {"name": delta.name, "arguments": ""}
            entry["function"]["arguments"] += delta.arguments
        return [entries[i] for i in sorted(entries)]
