"""Pythonic tool calls (Llama 3.2/4): a Python list of calls with keyword arguments.

``[get_weather(city="Paris", days=3), get_time(zone='UTC')]``, optionally wrapped in
``<|python_start|>``…``<|python_end|>``. Only an output that starts (after
whitespace and the optional tag) with ``[`` is read as calls. Argument values are
Python literals, read with ``ast.literal_eval`` (never evaluated) and written as
JSON; a value that is not a literal JSON can hold makes the call malformed.
"""

from __future__ import annotations

import ast
import json
import re
import warnings

from framework.tool_parsers.streaming import (
    PARTIAL,
    Block,
    CallScan,
    SegmentedToolParser,
    Status,
    calls_start,
    scan_calls,
    skip_space,
)

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"

_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_KEYWORD = re.compile(r"[A-Za-z_]\w*")
_SPECIAL = re.compile(r"""["'()\[\]{},]""")
_CLOSERS = {")": "(", "]": "[", "}": "{"}
# A string runs to its closing quote; a stop elsewhere is the end of the text, a
# final backslash, or (for one-line strings) a newline.
_STRINGS = {
    quote: re.compile(quote + (rf"(?:[^{quote[0]}\\]|\\.|{quote[0]}(?!{quote[0] * 2}))*"
                               if len(quote) == 3 else rf"(?:[^{quote}\\\n]|\\.)*")
                      + f"({quote})?", re.S)
    for quote in ('"""', "'''", '"', "'")
}


def literal_json(source: str) -> str | None:
    """The Python literal ``source`` as compact JSON, or None when it is not one JSON holds."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. an invalid escape in a string literal
            value = ast.literal_eval(source.strip())
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _string_end(text: str, pos: int) -> tuple[Status, int]:
    """Reads the string literal whose opening quote is at ``pos``."""
    quote = text[pos:pos + 3] if text[pos:pos + 3] in ('"""', "'''") else text[pos]
    match = _STRINGS[quote].match(text, pos)
    if match.group(1):
        return Status.COMPLETE, match.end()
    stop = match.end()
    if stop == len(text) or (stop == len(text) - 1 and text[stop] == "\\"):
        return Status.PARTIAL, pos
    return Status.INVALID, pos


def value_end(text: str, pos: int) -> tuple[Status, int]:
    """Where the argument value at ``pos`` ends: at a ``,`` or ``)`` outside brackets."""
    opened: list[str] = []
    while True:
        match = _SPECIAL.search(text, pos)
        if match is None:
            return Status.PARTIAL, pos
        char, pos = match.group(), match.start()
        if char in "\"'":
            status, pos = _string_end(text, pos)
            if status is not Status.COMPLETE:
                return status, pos
            continue
        if not opened and char in ",)":
            return Status.COMPLETE, pos
        if char in "([{":
            opened.append(char)
        elif char in _CLOSERS and (not opened or opened.pop() != _CLOSERS[char]):
            return Status.INVALID, pos
        pos += 1


class PythonicToolParser(SegmentedToolParser):
    """Reads ``[f(a=1, b="x"), g()]`` at the start of the output."""

    markers = (START_TAG, END_TAG)
    call_format = None  # arguments are Python literals, not a JSON object

    def _find(self, text: str, pos: int) -> int:
        return 0 if pos == 0 and calls_start(text, "[", START_TAG) != -1 else -1

    def _held(self, text: str, start: int) -> int:
        return 0  # an undecided start is a block still being read

    def _block(self, text: str, pos: int, final: bool) -> Block | None:
        start = calls_start(text, "[", START_TAG)
        if start is None:
            return None if final else Block()
        block = scan_calls(text, start + 1, final, self._call, ",", "]")
        if block is None or block.resume is None:
            return block
        end = skip_space(text, block.resume)
        if text.startswith(END_TAG, end):
            block.resume = end + len(END_TAG)
        elif not final and block.resume > block.calls[-1].end and END_TAG.startswith(text[end:]):
            block.resume = None  # the closing tag may be arriving
        return block

    def _call(self, text: str, pos: int) -> CallScan:
        """Reads ``name(key=value, ...)``; committed once ``(`` follows a known name."""
        match = _NAME.match(text, pos)
        if match is None or match.end() == len(text):
            return PARTIAL if pos == len(text) or match else CallScan(Status.INVALID)
        name = match.group()
        pos = skip_space(text, match.end())
        if pos == len(text):
            return PARTIAL
        if text[pos] != "(" or not self.known(name):
            return CallScan(Status.INVALID)
        return _arguments(text, pos + 1, name)


def _arguments(text: str, pos: int, name: str) -> CallScan:
    """Reads the keyword arguments after ``name(`` as a JSON object, pair by pair."""
    pairs: dict[str, str] = {}

    def begun() -> CallScan:
        return CallScan(Status.PARTIAL, name, _object(pairs), committed=True)

    while True:
        pos = skip_space(text, pos)
        if pos == len(text):
            return begun()
        if text[pos] == ")":
            return CallScan(Status.COMPLETE, name, _object(pairs) + "}", end=pos + 1)
        match = _KEYWORD.match(text, pos)
        if match is None:
            return CallScan(Status.INVALID)
        pos = skip_space(text, match.end())
        if pos == len(text):
            return begun()
        if text[pos] != "=" or match.group() in pairs:
            return CallScan(Status.INVALID)
        status, end = value_end(text, pos + 1)
        if status is not Status.COMPLETE:
            return begun() if status is Status.PARTIAL else CallScan(Status.INVALID)
        value = literal_json(text[pos + 1:end])
        if value is None:
            return CallScan(Status.INVALID)
        pairs[match.group()] = value
        if text[end] == ")":
            return CallScan(Status.COMPLETE, name, _object(pairs) + "}", end=end + 1)
        pos = end + 1


def _object(pairs: dict[str, str]) -> str:
    """The beginning of a JSON object, up to and without its ``}``."""
    return "{" + ", ".join(json.dumps(key, ensure_ascii=False) + ": " + value
                           for key, value in pairs.items())
