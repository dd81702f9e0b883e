"""Grammars that constrain an output to tool calls, or to a constraint after the reasoning.

Both give EBNF text, sent to the grammar backend as an ``ebnf`` constraint.

``tool_calls_ebnf`` serves ``tool_choice`` ``"required"`` or a named tool: the output is
only calls, written in the tool-call parser's ``CallFormat``, each to one of the
request's tools with arguments valid against that tool's parameters schema.

``after_reasoning_ebnf`` serves a constrained request to a reasoning model: the
reasoning is free text up to the first end marker (``</think>``), and only the answer
after it is constrained.

Grammars are combined with xgrammar's ``concat``/``union``, which rename the rules of
the parts so that they do not clash; where a combination cannot be written that way
(a repetition), the combined text gets a new ``root`` that refers to the old one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import xgrammar as xgr

from framework.constrained.base import Constraint, InvalidConstraintError, clean_error
from framework.constrained.json_schema import check_schema
from framework.constrained.xgrammar_backend import constraint_grammar, json_schema_ebnf
from framework.tool_parsers.base import CallFormat, ToolSpec

# Characters that mean something inside an EBNF string literal or character class.
_SPECIAL = frozenset('"\\[]^-')
#: Whitespace allowed between the reasoning's end marker and the constrained answer.
_WHITESPACE = r"[ \t\n\r]*"
# The tokens of EBNF text that may hold a rule's name: string literals and character
# classes are matched whole so that a name inside them is not taken for a reference.
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_.-]*')


def _escape(char: str) -> str:
    """``char`` as it may stand in an EBNF string literal or character class."""
    if " " <= char <= "~" and char not in _SPECIAL:
        return char
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _literal(text: str) -> str:
    """An EBNF string literal that matches exactly ``text``."""
    return '"' + "".join(_escape(c) for c in text) + '"'


def _literal_grammar(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {_literal(text)}")


def _rule_names(ebnf: str) -> list[str]:
    """Every name in ``ebnf`` that can refer to a rule, in order, definitions included."""
    return [t for t in (m.group() for m in _EBNF_TOKEN.finditer(ebnf)) if t[0] not in '"[']


def _fresh_name(ebnf: str, base: str) -> str:
    """A rule name not used in ``ebnf``."""
    used = set(_rule_names(ebnf))
    name, n = base, 0
    while name in used:
        n += 1
        name = f"{base}_{n}"
    return name


def _rename_root(ebnf: str, name: str) -> str:
    """``ebnf`` with its ``root`` rule named ``name``, so that a new root can refer to it.

    Sound only when no rule refers to ``root`` (true of a grammar that xgrammar's
    ``concat``/``union`` wrote: the parts' roots are renamed): checked.
    """
    if _rule_names(ebnf).count("root") != 1:
        raise ValueError("the grammar's root rule is referred to by a rule")
    renamed, count = re.subn(r"^root ::=", f"{name} ::=", ebnf, flags=re.MULTILINE)
    if count != 1:
        raise ValueError("the grammar has no root rule at the start of a line")
    return renamed


def _sequence(*parts: str) -> str:
    """The EBNF sequence of ``parts`` (literals and references), empty literals left out."""
    return " ".join(p for p in parts if p not in ("", '""'))


def _call_grammar(fmt: CallFormat, tool: ToolSpec, index: int) -> xgr.Grammar:
    """One call to ``tool``: its begin text, its arguments' JSON, the end text."""
    param = f"tools[{index}].function.parameters"
    try:
        schema = check_schema(json.dumps(tool.parameters))
        arguments = xgr.Grammar.from_ebnf(json_schema_ebnf(schema))
    except InvalidConstraintError as exc:
        problem = str(exc).removeprefix(f"invalid {exc.param}: ")
        raise InvalidConstraintError(param, problem, exc.code) from None
    except Exception as exc:  # xgrammar raises RuntimeError and its own kinds
        raise InvalidConstraintError(param, clean_error(exc)) from None
    parts = [_literal_grammar(fmt.call_begin(tool.name)), arguments]
    if fmt.call_end:
        parts.append(_literal_grammar(fmt.call_end))
    return xgr.Grammar.concat(*parts)


def tool_calls_ebnf(fmt: CallFormat, tools: Sequence[ToolSpec], *, parallel: bool) -> str:
    """The EBNF text of outputs made of calls to ``tools``, written as ``fmt`` says.

    One call, or with ``parallel`` one or more separated by ``fmt.separator``, between
    ``fmt.prefix`` and ``fmt.suffix``. ``InvalidConstraintError`` (its param naming the
    tool) if a tool's parameters schema cannot be enforced.
    """
    if not tools:
        raise ValueError("tool calls need at least one tool")
    calls = xgr.Grammar.union(*(_call_grammar(fmt, tool, i) for i, tool in enumerate(tools)))
    ebnf = str(calls)
    call = _fresh_name(ebnf, "tool_call")
    more = f"({_sequence(_literal(fmt.separator), call)})*" if parallel else ""
    root = _sequence(_literal(fmt.prefix), call, more, _literal(fmt.suffix))
    return f"{_rename_root(ebnf, call)}root ::= {root}\n"


def _next_state(end: str, matched: int, char: str) -> int:
    """How much of ``end`` is matched after ``char``, with ``matched`` characters before it.

    The longest start of ``end`` that ends the text read: ``end``'s own overlaps (as in
    ``aab`` after ``aa``) keep a partial match alive.
    """
    text = end[:matched] + char
    for size in range(min(len(text), len(end)), 0, -1):
        if text.endswith(end[:size]):
            return size
    return 0


def _until_rules(end: str, name: str) -> list[str]:
    """Rules ``{name}_{k}``: text that first contains ``end`` at its end, from ``k`` matched.

    A rule per state of the automaton that matches ``end``: each character that keeps
    a partial match goes to its state (or ends the text, when it completes ``end``);
    every other character goes back to nothing matched.
    """
    rules = []
    for matched in range(len(end)):
        alternatives, advancing = [], []
        for char in sorted(set(end)):
            state = _next_state(end, matched, char)
            if state == 0:
                continue
            advancing.append(_escape(char))
            target = f" {name}_{state}" if state < len(end) else ""
            alternatives.append(f"({_literal(char)}{target})")
        alternatives.append(f"([^{''.join(advancing)}] {name}_0)")
        rules.append(f"{name}_{matched} ::= {' | '.join(alternatives)}")
    return rules


def _reasoning_grammar(end: str, starts_in_reasoning: bool, start: str) -> xgr.Grammar:
    """The reasoning (``start`` first unless the prompt opened it) through the first ``end``,
    then optional whitespace."""
    opening = "" if starts_in_reasoning else start
    state = 0
    for char in opening:
        state = _next_state(end, state, char)
        if state == len(end):
            raise ValueError(f"the reasoning's start {start!r} contains its end {end!r}")
    rules = _until_rules(end, "reasoning")
    root = _sequence(_literal(opening), f"reasoning_{state}", _WHITESPACE)
    return xgr.Grammar.from_ebnf("\n".join([f"root ::= {root}", *rules]))


def after_reasoning_ebnf(constraint_kind: str, constraint_value: str, end: str = "</think>",
                         starts_in_reasoning: bool = True, start: str = "<think>") -> str:
    """The EBNF text of a reasoning through its first ``end``, then an answer that follows
    the constraint (``kind`` one of ``json_schema``, ``regex``, ``ebnf``).

    The reasoning opens with ``start`` unless ``starts_in_reasoning`` (the prompt opened
    it); optional whitespace separates ``end`` from the answer.
    ``InvalidConstraintError`` if the constraint cannot be enforced.
    """
    if not end:
        raise ValueError("the reasoning's end marker must not be empty")
    constraint = Constraint(constraint_kind, constraint_value)
    try:
        answer = constraint_grammar(constraint)
    except InvalidConstraintError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError and its own kinds
        raise InvalidConstraintError(constraint.kind, clean_error(exc)) from None
    reasoning = _reasoning_grammar(end, starts_in_reasoning, start)
    return str(xgr.Grammar.concat(reasoning, answer))
