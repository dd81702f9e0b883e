"""Mistral tool calls: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects.

Text before ``[TOOL_CALLS]`` (and after the array) is content. The calls read
before a malformed element stay calls; the text from there on is content.
"""

from __future__ import annotations

from framework.tool_parsers.base import CallFormat
from framework.tool_parsers.streaming import (
    Block,
    CallScan,
    SegmentedToolParser,
    held_length,
    scan_calls,
    scan_json_call,
    skip_space,
)

MARKER = "[TOOL_CALLS]"


class MistralToolParser(SegmentedToolParser):
    """Reads ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    markers = (MARKER,)
    call_format = CallFormat(prefix=MARKER + "[", separator=", ", suffix="]",
                             call_begin_template='{"name": "{name}", "arguments": ',
                             call_end="}")

    def _find(self, text: str, pos: int) -> int:
        return text.find(MARKER, pos)

    def _held(self, text: str, start: int) -> int:
        return held_length(text, start, MARKER)

    def _block(self, text: str, pos: int, final: bool) -> Block | None:
        pos = skip_space(text, pos + len(MARKER))
        if pos == len(text):
            return None if final else Block()
        if text[pos] != "[":
            return None
        return scan_calls(text, pos + 1, final, self._call, ",", "]")

    def _call(self, text: str, pos: int) -> CallScan:
        return scan_json_call(text, pos, ("arguments",), self.known)
