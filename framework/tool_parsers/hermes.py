"""Hermes-style tool calls (Hermes, Qwen2.5, Qwen3): ``<tool_call>`` JSON ``</tool_call>``.

Each call is ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; calls
follow each other, and the text around them is content. A call without its closing
tag, or whose JSON is malformed, stays content.
"""

from __future__ import annotations

from framework.tool_parsers.base import CallFormat
from framework.tool_parsers.streaming import (
    Block,
    SegmentedToolParser,
    Status,
    held_length,
    scan_json_call,
    skip_space,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(SegmentedToolParser):
    """Reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls."""

    markers = (OPEN, CLOSE)
    call_format = CallFormat(prefix="", separator="\n", suffix="",
                             call_begin_template=OPEN + '\n{"name": "{name}", "arguments": ',
                             call_end="}\n" + CLOSE)

    def _find(self, text: str, pos: int) -> int:
        return text.find(OPEN, pos)

    def _held(self, text: str, start: int) -> int:
        return held_length(text, start, OPEN)

    def _block(self, text: str, pos: int, final: bool) -> Block | None:
        call = scan_json_call(text, skip_space(text, pos + len(OPEN)), ("arguments",), self.known)
        if call.status is Status.PARTIAL and not final:
            return Block(pending=call if call.committed else None)
        if call.status is not Status.COMPLETE:
            return None
        end = skip_space(text, call.end)
        if text.startswith(CLOSE, end):
            return Block(calls=[call], resume=end + len(CLOSE))
        if not final and CLOSE.startswith(text[end:]):
            return Block(pending=call)
        return None
