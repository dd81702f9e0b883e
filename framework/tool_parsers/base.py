"""The tool-call parser interface: a model's output text split into content and calls.

A model asked to call tools writes its calls in its family's own format
(Hermes/Qwen's ``<tool_call>{...}</tool_call>``, Llama 3's JSON, Mistral's
``[TOOL_CALLS]``, a pythonic list). A ``ToolParser`` turns a whole output into
``ParsedOutput`` (the text outside calls stays content) and, for a stream, turns
each new piece of text into ``Delta``s as OpenAI streams them: a call's index, id
and name first, then fragments of its arguments. Parsers are found by name in
``framework.registry.TOOL_PARSERS`` (``--tool-call-parser``).

``CallFormat`` says how the parser's calls are written, so that ``tool_choice``
``"required"`` or a named tool can constrain the output to it (see
``framework/tool_parsers/grammar.py``).
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """A fresh tool-call id, as OpenAI spells them (``call_`` and 24 characters)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolSpec:
    """One tool of a request: a function's name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    description: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: its content (None when it is only calls) and its calls, in order."""

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class Delta:
    """One piece of a stream: ``content`` text, or a part of call number ``index``.

    The first piece of a call carries its ``name`` (and ``arguments`` may be empty);
    later pieces carry only fragments of its ``arguments``, which concatenate to the
    arguments a whole-output parse gives.
    """

    content: str | None = None
    index: int | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class CallFormat:
    """How a parser's calls are written, for a grammar that constrains output to them.

    The calls of one output are ``prefix`` + call (``separator`` call)* + ``suffix``,
    and one call is ``call_begin(name)`` + its arguments as a JSON object + ``call_end``.
    """

    prefix: str
    separator: str
    suffix: str
    call_begin_template: str  # with "{name}" where the function's name goes
    call_end: str

    def call_begin(self, name: str) -> str:
        """The text before the arguments of a call to ``name``."""
        return self.call_begin_template.replace("{name}", name)


class ToolParser(ABC):
    """Splits one output (one choice) into content and tool calls; one instance per choice.

    ``tools`` are the request's tools: a parser may keep a call to an unknown name as
    content. Text that is not a well-formed call is content, never an error.
    """

    #: How calls are written (None: output cannot be constrained to this format).
    call_format: CallFormat | None = None
    #: The format's marker strings. A tokenizer may hold one as a special token, which a
    #: decode that skips special tokens would drop: the server then keeps them.
    markers: tuple[str, ...] = ()

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = list(tools)

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a whole output."""

    @abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """The pieces that ``text`` (the output's next characters) completes.

        Text that may still turn out to start a call is held back until it is known;
        the pieces of a whole stream (``finish`` included) carry the same content
        and calls as ``parse`` of the whole text.
        """

    @abstractmethod
    def finish(self) -> list[Delta]:
        """The pieces still held back, at the end of the output."""
