"""Llama 3.1/3.2/3.3 JSON tool calls: ``{"name": "f", "parameters": {...}}``, ``; ``-separated.

Only an output that starts (after whitespace and an optional ``<|python_tag|>``)
with ``{`` is read as calls; any other output is content. ``arguments`` is accepted
in place of ``parameters``. Text after the last call is content.
"""

from __future__ import annotations

from framework.tool_parsers.base import CallFormat
from framework.tool_parsers.streaming import (
    Block,
    CallScan,
    SegmentedToolParser,
    calls_start,
    scan_calls,
    scan_json_call,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3ToolParser(SegmentedToolParser):
    """Reads Llama 3 JSON calls at the start of the output."""

    markers = (PYTHON_TAG,)
    call_format = CallFormat(prefix="", separator="; ", suffix="",
                             call_begin_template='{"name": "{name}", "parameters": ',
                             call_end="}")

    def _find(self, text: str, pos: int) -> int:
        return 0 if pos == 0 and calls_start(text, "{", PYTHON_TAG) != -1 else -1

    def _held(self, text: str, start: int) -> int:
        return 0  # an undecided start is a block still being read

    def _block(self, text: str, pos: int, final: bool) -> Block | None:
        start = calls_start(text, "{", PYTHON_TAG)
        if start is None:
            return None if final else Block()
        return scan_calls(text, start, final, self._call, ";", None)

    def _call(self, text: str, pos: int) -> CallScan:
        return scan_json_call(text, pos, ("parameters", "arguments"), self.known)
