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


# Each keyword (or use of one) the grammar would not enforce: (schema, keyword, its pointer).
UNSUPPORTED_KEYWORDS: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, "not", "/not"),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
     "uniqueItems", "/uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/dependentRequired"),
    ({"type": "object", "properties": {"a": {"type": "boolean"}},
      "if": {"required": ["a"]}, "then": {"properties": {"a": {"const": True}}}}, "if", "/if"),
    ({"type": "object", "properties": {"w": {"type": "string",
                                             "pattern": "^(?=x)[a-z]{3}$"}}},
     "pattern", "/properties/w/pattern"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern", "/pattern"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
     "contains", "/contains"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
     "patternProperties", "/patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames", "/propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties",
     "/unevaluatedProperties"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas",
     "/dependentSchemas"),
    ({"type": "string", "format": "date"}, "format", "/format"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "/multipleOf"),
    ({"type": "integer", "multipleOf": 4096}, "multipleOf", "/multipleOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "/maxLength"),
    ({"type": "number", "minimum": 0.1234561, "maximum": 0.1234567}, "maximum", "/maximum"),
    ({"maxLength": 3}, "maxLength", "/maxLength"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, "maxLength", "/maxLength"),
    ({"const": 1, "type": "string"}, "type", "/type"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3},
     "maximum", "/maximum"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "string"}, "type", "/type"),
    ({"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]},
     "oneOf", "/oneOf"),
    ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, "allOf", "/allOf"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "/$ref"),
    ({"type": "object", "properties": {"a/b": {"type": "array", "items": {"type": "string"},
                                               "maxContains": 1}}},
     "maxContains", "/properties/a~1b/maxContains"),
    ({"type": "string", "nullable": True}, "nullable", "/nullable"),
]


def check_json(text: str, schema: dict[str, Any]) -> None:
    """Raise unless ``text`` is one JSON document valid under ``schema`` (strict parsing).

    ``format`` is checked too (JSON Schema makes it optional; structured outputs enforce
    the formats they accept).
    """
    import jsonschema

    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


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


# ---------------------------------------------------------------- generated schemas


def supported_schemas() -> Any:
    """A hypothesis strategy of JSON schemas from the supported set (docs/structured_outputs.md).

    Most of their languages are finite or nearly so (bounded strings, numbers, arrays and
    closed objects), so that a model with random weights, steered by the grammar alone,
    mostly reaches the end; open objects, whose keys are free strings, are rarer.
    """
    from hypothesis import strategies as st

    leaves = st.one_of(
        st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
        _integers(st), _numbers(st), _strings(st), _enums(st),
    ).flatmap(lambda s: _annotated(st, s))
    tree = st.recursive(leaves, lambda children: st.one_of(
        _arrays(st, children), _objects(st, children), _combined(st, children),
    ).flatmap(lambda s: _annotated(st, s)), max_leaves=5)
    # References resolve from the root: the definitions live there.
    return st.one_of(tree, tree.map(lambda s: {"$defs": {"it": s}, "$ref": "#/$defs/it"}))


_NAMES = ["a", "b", "id", "tag", "x/y", "n~m"]
_PATTERNS = ["^[a-c]{1,3}$", "^(red|green|blue)$", "[0-9]{2}", "^x(?:y|z)?$", "^\\d{3}-[a-z]$"]


def _annotated(st: Any, schema: dict[str, Any]) -> Any:
    """``schema`` with some annotations, which constrain nothing."""
    notes = st.fixed_dictionaries({}, optional={
        "title": st.just("T"), "description": st.just("what it is"), "default": st.none(),
        "examples": st.just([]), "$comment": st.just("a comment")})
    return notes.map(lambda extra: {**schema, **extra})


def _integers(st: Any) -> Any:
    def build(low: int, span: int, step: int | None, exclusive: bool) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer"}
        if exclusive:
            schema.update(exclusiveMinimum=low - 1, exclusiveMaximum=low + span + 1)
        else:
            schema.update(minimum=low, maximum=low + span)
        if step is not None and any(v % step == 0 for v in range(low, low + span + 1)):
            schema["multipleOf"] = step
        return schema
    return st.builds(build, st.integers(-60, 60), st.integers(0, 80),
                     st.sampled_from([None, 2, 7]), st.booleans())


def _numbers(st: Any) -> Any:
    def build(low: int, span: int, exclusive: bool) -> dict[str, Any]:
        if exclusive:
            return {"type": "number", "exclusiveMinimum": low / 4, "maximum": (low + span) / 4}
        return {"type": "number", "minimum": low / 8, "exclusiveMaximum": (low + span) / 8}
    return st.builds(build, st.integers(-40, 40), st.integers(1, 40), st.booleans())


def _strings(st: Any) -> Any:
    def bounded(low: int, extra: int) -> dict[str, Any]:
        return {"type": "string", "minLength": low, "maxLength": low + extra}
    return st.one_of(
        st.builds(bounded, st.integers(0, 2), st.integers(0, 3)),
        st.sampled_from(_PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.sampled_from([{"type": "string", "format": "uuid"},
                         {"type": ["string", "null"], "maxLength": 2}]),
    )


def _enums(st: Any) -> Any:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-9, 99),
                        st.sampled_from(["red", "a b", "x\"y", "é"]))
    values = st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps)
    return st.one_of(
        values.map(lambda v: {"enum": v}),
        st.lists(st.sampled_from(["S", "M", "L"]), min_size=1, max_size=3, unique=True)
        .map(lambda v: {"type": "string", "enum": v}),
        st.sampled_from([{"const": 3}, {"const": {"k": [1, None]}}, {"const": "fixed"}]),
    )


def _arrays(st: Any, children: Any) -> Any:
    def listed(item: Any, low: int, extra: int) -> dict[str, Any]:
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + extra}

    def tuple_(first: Any, second: Any, rest: Any) -> dict[str, Any]:
        schema = {"type": "array", "prefixItems": [first, second], "maxItems": 3}
        return schema if rest is None else {**schema, "items": rest}
    return st.one_of(
        st.builds(listed, children, st.integers(0, 2), st.integers(0, 1)),
        st.builds(tuple_, children, children, st.one_of(st.none(), st.just(False), children)),
    )


def _objects(st: Any, children: Any) -> Any:
    def closed(properties: dict[str, Any], required: list[str], extra: Any) -> dict[str, Any]:
        schema = {"type": "object", "properties": properties,
                  "required": [n for n in required if n in properties]}
        return schema if extra is None else {**schema, "additionalProperties": extra}

    def named_by_required(name: str, value: Any) -> dict[str, Any]:
        # A required name that properties lack: any value, or additionalProperties'.
        return {"type": "object", "required": [name], "additionalProperties": value}

    def open_(value: Any, low: int) -> dict[str, Any]:
        return {"type": "object", "minProperties": low, "maxProperties": low,
                "additionalProperties": value}
    names = st.sampled_from(_NAMES)
    return st.one_of(
        st.builds(closed, st.dictionaries(names, children, min_size=1, max_size=3),
                  st.lists(names, max_size=3, unique=True), st.sampled_from([None, False])),
        st.builds(named_by_required, names, children),
        st.builds(open_, st.sampled_from([{"type": "null"}, {"type": "boolean"}]),
                  st.integers(1, 2)),
    )


def _combined(st: Any, children: Any) -> Any:
    distinct = st.lists(st.sampled_from([
        {"type": "null"}, {"type": "boolean"}, {"type": "string", "maxLength": 2},
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "array", "maxItems": 1}]),
        min_size=2, max_size=3, unique_by=lambda s: s["type"])
    return st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda b: {"anyOf": b}),
        distinct.map(lambda b: {"oneOf": b}),
        children.map(lambda c: {"allOf": [c]}),
    )
