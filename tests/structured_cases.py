"""Constraints for the structured-output tests, and independent checks of their outputs.

JSON outputs are checked with ``jsonschema``, regex outputs with Python's ``re``, and
EBNF outputs with a ``lark`` grammar written separately for the same language, so
that a test never trusts the grammar backend to check itself.
"""

from __future__ import annotations

import json
import re
from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required fields, bounded strings and integers
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    {  # enums and booleans
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
    },
    {  # an array of objects, with bounds on its length
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tag": {"type": "string", "maxLength": 5},
            },
            "required": ["id", "tag"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # bounded numbers in a bounded array, and an optional field
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                  "maximum": 5},
                       "minItems": 1, "maxItems": 4},
            "note": {"type": "string", "maxLength": 6},
        },
        "required": ["scores"],
    },
]

REGEXES: list[str] = [
    r"[a-z]{3}-\d{2,4}",
    r"(red|green|blue)( (small|large))?",
    r"\d{1,3}(\.\d{1,3}){3}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
]

# A bracketed list of one to three key=value items, as xgrammar's EBNF ...
EBNF = r'''
root ::= "[" item ("," item)? ("," item)? "]"
item ::= key "=" value
key ::= [a-z] [a-z]? [a-z]?
value ::= [0-9] [0-9]? | "true" | "false"
'''
# ... and the same language written for lark, independently.
LARK = r'''
start: "[" item ("," item)~0..2 "]"
item: KEY "=" value
value: NUMBER | TRUE | FALSE
KEY: /[a-z]{1,3}/
NUMBER: /[0-9]{1,2}/
TRUE: "true"
FALSE: "false"
'''


def check_json(text: str, schema: dict[str, Any]) -> None:
    """Raise unless ``text`` is one JSON document valid under ``schema`` (strict parsing)."""
    import jsonschema

    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str) -> None:
    """Raise unless ``pattern`` matches all of ``text``."""
    assert re.fullmatch(pattern, text), (pattern, text)


def lark_parser() -> Any:
    """A parser of ``LARK``'s language."""
    import lark

    return lark.Lark(LARK, start="start")


def constraint_cases() -> list[tuple[str, str, Any]]:
    """``(field, constraint text, checker(text))`` for every schema, regex and the EBNF."""
    parser = lark_parser()
    cases: list[tuple[str, str, Any]] = [
        ("json_schema", json.dumps(s), lambda t, s=s: check_json(t, s)) for s in SCHEMAS]
    cases += [("regex", r, lambda t, r=r: check_regex(t, r)) for r in REGEXES]
    cases.append(("ebnf", EBNF, parser.parse))
    return cases
