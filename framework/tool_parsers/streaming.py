"""What the four tool-call parsers share: one scan of the text, read whole or streamed.

A parser describes its format as one function, ``_segments(text, final)``: the text
so far cut into content and calls, keeping only what is already certain (content
that cannot start a call; a call once its name and the start of its arguments are
known, with the beginning of its arguments that no later text can change). With
``final`` the text is the whole output and every call is decided.

``parse`` reads the segments of the whole output; ``feed`` and ``finish`` send the
difference between the segments of the text so far and those already sent, so a
stream carries the same content and calls as ``parse`` of the same text. The one
exception: a call whose name and arguments have begun, but whose text later turns
out malformed (cut short, bad JSON after the first pairs, no closing tag). Its
pieces are already sent and stay; its text then follows as content.

Arguments are sent as compact JSON (``json.dumps(obj, ensure_ascii=False)``), built
pair by pair, so each fragment is a prefix of the final text: a pair is sent once
its value is complete, and a string value as it arrives.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from framework.tool_parsers.base import Delta, ParsedOutput, ToolCall, ToolParser, ToolSpec

# Deeper values are taken as malformed, so decoding and encoding them cannot recurse too far.
MAX_DEPTH = 128

_SPACE = re.compile(r"\s*")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_STRING_UNITS = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_STRING = re.compile(f'"{_STRING_UNITS}"')
_STRING_BEGUN = re.compile(f'"{_STRING_UNITS}' + r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z")
_STRING_BODY = re.compile(_STRING_UNITS)
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_BEGUN = re.compile(r"-?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d*)?)?\Z")
_LITERALS = ("true", "false", "null")


class Status(Enum):
    """How far a piece of text goes toward a well-formed value or call."""

    COMPLETE = "complete"  # well formed, and ends at a known position
    PARTIAL = "partial"  # a well-formed beginning that the text so far leaves open
    INVALID = "invalid"  # malformed, whatever text follows


@dataclass(frozen=True)
class Segment:
    """Content text, or (``name`` set) a call with its arguments so far."""

    text: str
    name: str | None = None


@dataclass(frozen=True)
class CallScan:
    """One call read from the text.

    While PARTIAL, ``arguments`` is the beginning of the final arguments, and
    ``committed`` says that the name and the start of the arguments are known (the
    call may be announced). ``end`` is where a COMPLETE call's text ends.
    """

    status: Status
    name: str | None = None
    arguments: str = ""
    end: int = 0
    committed: bool = False


@dataclass
class Block:
    """A run of calls starting at a call marker.

    ``resume`` is where content starts again after it (None while undecided, when
    ``pending`` is the call still being read, if announced).
    """

    calls: list[CallScan] = field(default_factory=list)
    resume: int | None = None
    pending: CallScan | None = None


PARTIAL = CallScan(Status.PARTIAL)
INVALID = CallScan(Status.INVALID)


def skip_space(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not whitespace."""
    return _SPACE.match(text, pos).end()


def held_length(text: str, start: int, marker: str) -> int:
    """How many characters at the end of ``text[start:]`` may begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def canonical_json(source: str) -> str | None:
    """``source`` (one JSON value) as compact JSON text, or None when it cannot be read."""
    try:
        return json.dumps(json.loads(source), ensure_ascii=False)
    except (ValueError, RecursionError):  # e.g. an integer too long to convert
        return None


def _scalar_end(text: str, pos: int) -> tuple[Status, int]:
    """Reads the string, number or literal at ``pos``."""
    if text[pos] == '"':
        match = _STRING.match(text, pos)
        if match:
            return Status.COMPLETE, match.end()
        return (Status.PARTIAL if _STRING_BEGUN.match(text, pos) else Status.INVALID), pos
    if text[pos] in "-0123456789":
        if _NUMBER_BEGUN.match(text, pos):  # a number at the end of the text may go on
            return Status.PARTIAL, pos
        match = _NUMBER.match(text, pos)
        return (Status.COMPLETE, match.end()) if match else (Status.INVALID, pos)
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return Status.COMPLETE, pos + len(literal)
        if len(text) - pos < len(literal) and text.startswith(literal[:len(text) - pos], pos):
            return Status.PARTIAL, pos
    return Status.INVALID, pos


def scan_value(text: str, pos: int) -> tuple[Status, int]:
    """Reads one JSON value at ``pos``; with COMPLETE, also where it ends."""
    stack: list[str] = []
    expect = "value"  # value, first_value, key, first_key, colon, next
    while True:
        pos = _JSON_SPACE.match(text, pos).end()
        if pos == len(text):
            return Status.PARTIAL, pos
        char = text[pos]
        if expect in ("value", "first_value") and char in "{[":
            if len(stack) == MAX_DEPTH:
                return Status.INVALID, pos
            stack.append("}" if char == "{" else "]")
            expect, pos = ("first_key" if char == "{" else "first_value"), pos + 1
            continue
        if char in "}]" and (expect in ("first_key", "first_value", "next")) and stack[-1] == char:
            stack.pop()
            pos += 1
        elif expect in ("value", "first_value", "key", "first_key"):
            if expect.endswith("key") and char != '"':
                return Status.INVALID, pos
            status, pos = _scalar_end(text, pos)
            if status is not Status.COMPLETE:
                return status, pos
            if expect.endswith("key"):
                expect = "colon"
                continue
        elif expect == "colon" and char == ":":
            expect, pos = "value", pos + 1
            continue
        elif expect == "next" and char == ",":
            expect, pos = ("key" if stack[-1] == "}" else "value"), pos + 1
            continue
        else:
            return Status.INVALID, pos
        if not stack:
            return Status.COMPLETE, pos
        expect = "next"


def _begun_string(text: str, pos: int) -> str:
    """The compact JSON of the string begun at ``pos`` so far, without its closing quote."""
    body = _STRING_BODY.match(text, pos + 1).group()
    decoded = json.loads(f'"{body}"')
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":  # its low half has yet to come
        decoded = decoded[:-1]
    return json.dumps(decoded, ensure_ascii=False)[:-1]


def scan_arguments(text: str, pos: int) -> CallScan:
    """Reads the JSON object at ``pos`` as arguments: their compact JSON, or its beginning.

    A repeated key makes the object malformed (the earlier pair could not be unsent).
    """
    pairs: list[str] = []
    keys: set[str] = set()

    def begun(extra: str = "") -> CallScan:
        return CallScan(Status.PARTIAL, arguments="{" + ", ".join(pairs) + extra)

    pos = _JSON_SPACE.match(text, pos + 1).end()
    if pos < len(text) and text[pos] == "}":
        return CallScan(Status.COMPLETE, arguments="{}", end=pos + 1)
    while True:
        if pos == len(text):
            return begun()
        status, key_end = scan_value(text, pos) if text[pos] == '"' else (Status.INVALID, pos)
        if status is not Status.COMPLETE:
            return begun() if status is Status.PARTIAL else INVALID
        key = json.loads(text[pos:key_end])
        if key in keys:
            return INVALID
        keys.add(key)
        pos = _JSON_SPACE.match(text, key_end).end()
        if pos == len(text):
            return begun()
        if text[pos] != ":":
            return INVALID
        start = _JSON_SPACE.match(text, pos + 1).end()
        status, end = scan_value(text, start)
        if status is Status.PARTIAL:
            if start < len(text) and text[start] == '"':
                head = json.dumps(key, ensure_ascii=False) + ": " + _begun_string(text, start)
                return begun((", " if pairs else "") + head)
            return begun()
        value = canonical_json(text[start:end]) if status is Status.COMPLETE else None
        if value is None:
            return INVALID
        pairs.append(json.dumps(key, ensure_ascii=False) + ": " + value)
        pos = _JSON_SPACE.match(text, end).end()
        if pos == len(text):
            return begun()
        if text[pos] == "}":
            return CallScan(Status.COMPLETE, arguments=begun().arguments + "}", end=pos + 1)
        if text[pos] != ",":
            return INVALID
        pos = _JSON_SPACE.match(text, pos + 1).end()


def scan_json_call(text: str, pos: int, argument_keys: Sequence[str],
                   known: Callable[[str], bool]) -> CallScan:
    """Reads a call written as a JSON object ``{"name": ..., <argument key>: {...}}``.

    Other keys are allowed and ignored; missing arguments are ``{}``. The call is
    committed once its (known) name is read and its arguments object has begun.
    """
    if pos >= len(text):
        return PARTIAL
    if text[pos] != "{":
        return INVALID
    name: str | None = None
    arguments: str | None = None
    keys: set[str] = set()

    def begun() -> CallScan:
        return CallScan(Status.PARTIAL, name, arguments or "",
                        committed=name is not None and arguments is not None)

    pos = _JSON_SPACE.match(text, pos + 1).end()
    while True:
        if pos == len(text):
            return begun()
        status, key_end = scan_value(text, pos) if text[pos] == '"' else (Status.INVALID, pos)
        if status is not Status.COMPLETE:
            return begun() if status is Status.PARTIAL else INVALID
        key = json.loads(text[pos:key_end])
        pos = _JSON_SPACE.match(text, key_end).end()
        if key in keys or (key in argument_keys and arguments is not None):
            return INVALID
        keys.add(key)
        if pos == len(text):
            return begun()
        if text[pos] != ":":
            return INVALID
        pos = _JSON_SPACE.match(text, pos + 1).end()
        if pos == len(text):
            return begun()
        if key in argument_keys:
            if text[pos] != "{":
                return INVALID
            read = scan_arguments(text, pos)
            arguments = read.arguments
            if read.status is not Status.COMPLETE:
                return begun() if read.status is Status.PARTIAL else INVALID
            end = read.end
        else:
            status, end = scan_value(text, pos)
            if status is not Status.COMPLETE:
                return begun() if status is Status.PARTIAL else INVALID
            if key == "name":
                name = json.loads(text[pos:end]) if text[pos] == '"' else None
                if name is None or not known(name):
                    return INVALID
        pos = _JSON_SPACE.match(text, end).end()
        if pos == len(text):
            return begun()
        if text[pos] == "}":
            if name is None:
                return INVALID
            return CallScan(Status.COMPLETE, name, arguments or "{}", end=pos + 1)
        if text[pos] != ",":
            return INVALID
        pos = _JSON_SPACE.match(text, pos + 1).end()


def calls_start(text: str, opener: str, tag: str) -> int | None:
    """Where the calls of an output that opens with ``opener`` begin: -1 when it does not.

    None while the text so far (whitespace, part of ``tag``) leaves it open.
    """
    pos = skip_space(text, 0)
    if text.startswith(tag, pos):
        pos = skip_space(text, pos + len(tag))
    elif tag.startswith(text[pos:]):
        return None
    if pos == len(text):
        return None
    return pos if text[pos] == opener else -1


def scan_calls(text: str, pos: int, final: bool, read_call: Callable[[str, int], CallScan],
               separator: str, closer: str | None) -> Block | None:
    """Reads ``call (separator call)* closer`` at ``pos`` (whitespace allowed between).

    The calls read before a malformed one, or before a missing ``closer``, stay
    calls and content resumes where the last of them ends; None when the first call
    is malformed.
    """
    block = Block()
    while True:
        call = read_call(text, skip_space(text, pos))
        if call.status is Status.PARTIAL and not final:
            block.pending = call if call.committed else None
            return block
        if call.status is not Status.COMPLETE:
            break
        block.calls.append(call)
        pos = skip_space(text, call.end)
        if closer is not None and text.startswith(closer, pos):
            block.resume = pos + len(closer)
            return block
        if text.startswith(separator, pos):
            pos += len(separator)
            continue
        tail = text[pos:]
        if not final and (separator.startswith(tail) or (closer or "").startswith(tail)):
            return block
        break
    if not block.calls:
        return None
    block.resume = block.calls[-1].end
    return block


class SegmentedToolParser(ToolParser):
    """A tool parser whose whole and streamed reading come from one ``_segments`` scan.

    Content is sent with the whitespace at its two ends removed, as ``parse`` gives it.
    """

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        self._names = {tool.name for tool in self.tools}
        self._text = ""
        self._sent: list[Segment] = []
        self._indices: list[int | None] = []
        self._next_index = 0
        self._content_begun = False
        self._space = ""  # whitespace held until more content follows it

    def known(self, name: str) -> bool:
        """Whether ``name`` may be called: one of the tools, or any name without tools."""
        return not self._names or name in self._names

    @abstractmethod
    def _find(self, text: str, pos: int) -> int:
        """Where the next block of calls may start at or after ``pos``; -1 when none."""

    @abstractmethod
    def _held(self, text: str, start: int) -> int:
        """How many characters at the end of content ``text[start:]`` to hold back."""

    @abstractmethod
    def _block(self, text: str, pos: int, final: bool) -> Block | None:
        """The calls of the block at ``pos``, or None when it is not one (then content)."""

    def _segments(self, text: str, final: bool) -> list[Segment]:
        """The content and calls of ``text`` that are certain (all of them with ``final``)."""
        segments: list[Segment] = []
        start = search = 0
        while True:
            pos = self._find(text, search)
            if pos < 0:
                end = len(text) if final else len(text) - self._held(text, start)
                _add_content(segments, text[start:end])
                return segments
            block = self._block(text, pos, final)
            if block is None:
                search = pos + 1
                continue
            _add_content(segments, text[start:pos])
            segments.extend(Segment(call.arguments, call.name) for call in block.calls)
            if block.resume is None:
                if block.pending is not None:
                    segments.append(Segment(block.pending.arguments, block.pending.name))
                return segments
            start = search = block.resume

    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a whole output."""
        segments = self._segments(text, final=True)
        content = "".join(s.text for s in segments if s.name is None).strip()
        calls = [ToolCall(s.name, s.text) for s in segments if s.name is not None]
        return ParsedOutput(content or None, calls)

    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the output's next characters) completes."""
        self._text += text
        return self._send(self._segments(self._text, final=False))

    def finish(self) -> list[Delta]:
        """The pieces still held back, at the end of the output."""
        deltas = self._send(self._segments(self._text, final=True))
        self._space = ""
        return deltas

    def _send(self, segments: list[Segment]) -> list[Delta]:
        """The deltas that take what was sent to ``segments``."""
        deltas: list[Delta] = []
        for i, segment in enumerate(segments):
            sent = self._sent[i] if i < len(self._sent) else None
            if sent is not None and (sent.name != segment.name
                                     or not segment.text.startswith(sent.text)):
                # A call announced earlier turned out malformed: what was sent of it
                # stands, and the segments from here are sent anew.
                del self._sent[i:], self._indices[i:]
                sent = None
            if sent is None:
                self._sent.append(segment)
                self._indices.append(None if segment.name is None else self._next_index)
                self._next_index += segment.name is not None
            self._sent[i] = segment
            delta = self._delta(segment, segment.text[len(sent.text) if sent else 0:], i,
                                first=sent is None)
            if delta is not None:
                deltas.append(delta)
        del self._sent[len(segments):], self._indices[len(segments):]
        return deltas

    def _delta(self, segment: Segment, new_text: str, i: int, first: bool) -> Delta | None:
        """The delta for ``new_text`` of segment ``i`` (the whole call header when ``first``)."""
        if segment.name is not None:
            if first:
                return Delta(index=self._indices[i], name=segment.name, arguments=new_text)
            return Delta(index=self._indices[i], arguments=new_text) if new_text else None
        if not self._content_begun:
            new_text = new_text.lstrip()
        text = self._space + new_text
        body = text.rstrip()
        self._space = text[len(body):]
        if not body:
            return None
        self._content_begun = True
        return Delta(content=body)


def _add_content(segments: list[Segment], text: str) -> None:
    """Appends content ``text``, joined to the content segment before it."""
    if not text:
        return
    if segments and segments[-1].name is None:
        segments[-1] = Segment(segments[-1].text + text)
    else:
        segments.append(Segment(text))
