"""The tool part of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the calls and results in the history.

``ChatTools.of(body, parser)`` checks the request's tool fields against each other
and against the server's ``--tool-call-parser`` and says what the answer does:
whether the output is parsed for calls, and, for ``tool_choice`` ``"required"`` or
a named function, the grammar that constrains the output to calls in the parser's
format, their arguments valid against the tools' parameter schemas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from framework.constrained.base import InvalidConstraintError
from framework.constrained.json_schema import check_schema
from framework.registry import REASONING_PARSERS, TOOL_PARSERS
from framework.sampling_params import CONSTRAINT_FIELDS, FieldError, SamplingParams
from framework.tool_parsers.base import ToolParser, ToolSpec

TOOL_CHOICES = ("none", "auto", "required")


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function a tool offers: its name, description and parameters' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    """One entry of a request's ``tools``."""

    function: FunctionDef
    type: str = "function"


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function of a call an assistant message made: its name and its arguments."""

    name: str
    # OpenAI's API sends the arguments as JSON text; an object is taken as well.
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(msgspec.Struct, kw_only=True):
    """One entry of an assistant message's ``tool_calls``."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments as an object where they parse
        as one (templates write them with ``tojson``), else as the text given."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        call = {"type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


def tool_specs(tools: list[ToolDef]) -> list[ToolSpec]:
    """The request's tools as parsers and grammars take them (types and names checked)."""
    specs = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise FieldError(f"tools[{i}].type", f"tools[{i}].type must be 'function', "
                             f"got {tool.type!r}")
        if not tool.function.name:
            raise FieldError(f"tools[{i}].function.name",
                             f"tools[{i}].function.name must not be empty")
        specs.append(ToolSpec(name=tool.function.name,
                              parameters=tool.function.parameters or {"type": "object"},
                              description=tool.function.description))
    return specs


def tools_for_template(tools: list[ToolDef]) -> list[dict[str, Any]]:
    """``tools`` as chat templates read them (OpenAI's shape, ``None`` fields left out)."""
    return [{"type": tool.type, "function": msgspec.to_builtins(tool.function)}
            for tool in tools]


def named_choice(tool_choice: Any) -> str | None:
    """The function a ``{"type": "function", "function": {"name": ...}}`` choice names."""
    if not isinstance(tool_choice, dict):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError("tool_choice", "tool_choice must be none, auto, required or "
                         '{"type": "function", "function": {"name": NAME}}')
    return name


@dataclass(frozen=True)
class ChatTools:
    """What a chat request's tool fields ask of its answer."""

    specs: list[ToolSpec]
    #: The tools' definitions for the chat template (None: no tools given).
    template_tools: list[dict[str, Any]] | None
    #: The parser's registered name when the output is parsed for calls, else None.
    parser: str | None
    #: The EBNF grammar the output must follow (``required`` or a named tool), else None.
    grammar: str | None

    @classmethod
    def of(cls, tools: list[ToolDef] | None, tool_choice: Any, parallel: bool,
           parser: str | None) -> ChatTools:
        """Check the tool fields of a request (400 naming the field) and resolve them."""
        choice = "auto" if tool_choice is None and tools else tool_choice or "none"
        name = named_choice(choice)
        if name is None and choice not in TOOL_CHOICES:
            raise FieldError("tool_choice", f"tool_choice must be one of "
                             f"{', '.join(TOOL_CHOICES)} or a named function, got {choice!r}")
        if not tools:
            if choice != "none":
                raise FieldError("tool_choice", "tool_choice needs tools")
            return cls([], None, None, None)
        specs = tool_specs(tools)
        template_tools = tools_for_template(tools)
        if choice == "none":
            return cls(specs, template_tools, None, None)
        if parser is None:
            raise FieldError("tools", "tool calls need the server started with "
                             "--tool-call-parser NAME (the model's call format)")
        if name is None and choice == "auto":
            return cls(specs, template_tools, parser, None)
        if name is not None:
            chosen = [spec for spec in specs if spec.name == name]
            if not chosen:
                raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not "
                                 "among tools")
            return cls(specs, template_tools, parser,
                       _calls_grammar(parser, chosen, specs, parallel=False))
        return cls(specs, template_tools, parser,
                   _calls_grammar(parser, specs, specs, parallel=parallel))

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker strings of the calls' format, when the output is parsed for calls."""
        return TOOL_PARSERS.get(self.parser).markers if self.parser is not None else ()

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one choice's output (None: the output is not parsed)."""
        if self.parser is None:
            return None
        return TOOL_PARSERS.get(self.parser)(self.specs)


def _calls_grammar(parser: str, chosen: list[ToolSpec], specs: list[ToolSpec], *,
                   parallel: bool) -> str:
    """The grammar of calls to ``chosen`` in ``parser``'s format; a parameters schema that
    cannot be enforced is refused naming its tool."""
    from framework.tool_parsers.grammar import tool_calls_ebnf

    fmt = TOOL_PARSERS.get(parser).call_format
    if fmt is None:
        raise FieldError("tool_choice", f"the {parser} tool-call format cannot be enforced: "
                         "use tool_choice auto with this server")
    for spec in chosen:
        field = f"tools[{specs.index(spec)}].function.parameters"
        try:
            check_schema(json.dumps(spec.parameters))
        except InvalidConstraintError as exc:
            raise InvalidConstraintError(field, str(exc).removeprefix(
                f"invalid {exc.param}: "), exc.code) from None
    return tool_calls_ebnf(fmt, chosen, parallel=parallel)


# apply_chat_template's own arguments: the server sets them, a request's template kwargs not.
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``: variables for the template, none of which may
    be one of ``apply_chat_template``'s own arguments."""
    kwargs = kwargs or {}
    clash = sorted(_TEMPLATE_CALL_ARGS.intersection(kwargs))
    if clash:
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set "
                         f"{', '.join(clash)}: the server sets them")
    return kwargs


def thinking_on(template_kwargs: dict[str, Any]) -> bool:
    """Whether the chat template lets the model think: off when the request turns it off
    with ``enable_thinking`` (Qwen 3) or ``thinking`` (DeepSeek) set to false."""
    return not any(template_kwargs.get(key) is False for key in ("enable_thinking", "thinking"))


def constrain(params: SamplingParams, tools: ChatTools, reasoning_parser: str | None,
              response_format: bool) -> None:
    """Put the tools' grammar into ``params``, and start an OpenAI-level constraint after
    the reasoning.

    A grammar of calls (``tool_choice`` required or named) excludes the request's own
    constraint. With a reasoning parser (None: none, or thinking is off), the model
    first reasons freely;
    the tools' grammar or the ``response_format`` (``response_format`` true: it is the
    request's constraint) applies from the end of its reasoning. SGLang's own fields
    (``regex``, ``ebnf``, ``json_schema``) constrain the whole output, as given.
    """
    if tools.grammar is not None:
        own = params.constraint()
        if own is not None:
            raise FieldError("tool_choice", f"give either tool_choice required or a named "
                             f"function, or {own[0]}, not both")
        params.ebnf = tools.grammar
    constraint = params.constraint()
    after_reasoning = tools.grammar is not None or response_format
    if constraint is None or reasoning_parser is None or not after_reasoning:
        return
    from framework.tool_parsers.grammar import after_reasoning_ebnf

    parser = REASONING_PARSERS.get(reasoning_parser)
    kind, value = constraint
    ebnf = after_reasoning_ebnf(kind, value, end=parser.end,
                                starts_in_reasoning=parser.starts_in_reasoning,
                                start=parser.start)
    for field in CONSTRAINT_FIELDS:
        setattr(params, field, None)
    params.ebnf = ebnf


def reasoning_markers(reasoning_parser: str | None) -> tuple[str, ...]:
    """The markers around the reasoning of ``reasoning_parser``'s models (none: None)."""
    if reasoning_parser is None:
        return ()
    parser = REASONING_PARSERS.get(reasoning_parser)
    return parser.start, parser.end


def special_token_texts(tokenizer: Any) -> set[str]:
    """The texts of ``tokenizer``'s special tokens: those a decode skipping them drops."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {*getattr(tokenizer, "all_special_tokens", ()),
            *(token.content for token in added.values() if getattr(token, "special", False))}


def keep_markers(params: SamplingParams, markers: tuple[str, ...], tokenizer: Any) -> None:
    """Keep special tokens in the output's text when one of a parser's ``markers`` is one
    (Mistral's ``[TOOL_CALLS]``, say): skipped, the parser would never see the call."""
    if markers and not set(markers).isdisjoint(special_token_texts(tokenizer)):
        params.skip_special_tokens = False
