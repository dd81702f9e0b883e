"""Size limits on a constraint, checked at the edge before anything compiles.

A grammar's compile time grows faster than its size (a 50,000-entry enum parses in half a
second and compiles for minutes), so the sizes that drive it are bounded where the
request enters, each refusal a 400 naming the limit. What slips past them is bounded by
``--grammar-compile-timeout`` in the Scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from framework.constrained.base import InvalidConstraintError
from framework.constrained.json_schema import escape

#: The OpenAI error ``code`` of a constraint past one of the limits.
TOO_LARGE = "constraint_too_large"


@dataclass(frozen=True)
class ConstraintLimits:
    """The largest constraint accepted (OpenAI's structured outputs have similar bounds)."""

    #: Entries of all the ``enum`` lists of one JSON schema together.
    enum_entries: int = 1000
    #: Characters of a ``regex`` constraint, or of one ``pattern`` in a JSON schema.
    pattern_length: int = 2048
    #: Nesting of objects and arrays in a JSON schema document.
    schema_depth: int = 64


LIMITS = ConstraintLimits()


def check_size(kind: str, value: str, limits: ConstraintLimits = LIMITS) -> None:
    """Raise ``InvalidConstraintError`` (code ``constraint_too_large``) past a limit.

    Needs no backend: the check is the same whichever backend compiles.
    """
    if kind == "regex":
        _check_pattern(kind, value, "", limits)
    elif kind == "json_schema":
        _check_schema(value, limits)


def _check_pattern(kind: str, pattern: str, pointer: str, limits: ConstraintLimits) -> None:
    if len(pattern) > limits.pattern_length:
        where = f" (at {pointer})" if pointer else ""
        raise InvalidConstraintError(
            kind, f"a pattern{where} has {len(pattern)} characters; the limit is "
            f"{limits.pattern_length} (pattern length)", code=TOO_LARGE)


def _check_schema(text: str, limits: ConstraintLimits) -> None:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidConstraintError(
            "json_schema", f"the schema is nested deeper than the limit of "
            f"{limits.schema_depth} (schema depth)", code=TOO_LARGE) from None
    except ValueError:
        return  # not JSON: the backend's check says so, with the parser's message
    entries = 0
    for pointer, depth, key, value in _walk(schema):
        if depth > limits.schema_depth:
            raise InvalidConstraintError(
                "json_schema", f"the schema is nested deeper than the limit of "
                f"{limits.schema_depth} at {pointer} (schema depth)", code=TOO_LARGE)
        if key == "enum" and isinstance(value, list):
            entries += len(value)
        elif key == "pattern" and isinstance(value, str):
            _check_pattern("json_schema", value, pointer, limits)
        elif key == "patternProperties" and isinstance(value, dict):
            for name in value:
                _check_pattern("json_schema", name, f"{pointer}/{escape(name)}", limits)
    if entries > limits.enum_entries:
        raise InvalidConstraintError(
            "json_schema", f"the schema's enums have {entries} entries in all; the limit is "
            f"{limits.enum_entries} (enum entries)", code=TOO_LARGE)


def _walk(root: Any) -> Iterator[tuple[str, int, str, Any]]:
    """``(JSON pointer, depth, key, value)`` of ``root`` (depth 1) and everything in it.

    Iterative, so that a deep document cannot exhaust the stack.
    """
    stack: list[tuple[str, int, str, Any]] = [("", 1, "", root)]
    while stack:
        pointer, depth, key, value = stack.pop()
        yield pointer, depth, key, value
        if isinstance(value, dict):
            stack.extend((f"{pointer}/{escape(k)}", depth + 1, k, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{pointer}/{i}", depth + 1, "", v) for i, v in enumerate(value))
