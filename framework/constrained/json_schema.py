"""The JSON Schema keywords structured outputs enforce, and the check that refuses the rest.

xgrammar turns a schema into a grammar from part of JSON Schema and drops the rest
without a word (``uniqueItems``, ``not``, ``if``/``then``, ``dependentRequired``, a
lookahead in ``pattern``, every keyword beside ``$ref``, ``enum`` or ``anyOf``, ...), so
an output that finished with ``stop`` could break its schema. ``check_schema`` walks a
schema and refuses every keyword the grammar would not enforce, naming it and its JSON
Pointer; annotations, which constrain nothing, are accepted. It returns the schema
normalized where xgrammar would refuse a valid schema it can enforce (its objects are
closed unless they say otherwise: ``minProperties`` beyond the named properties, or a
required name missing from ``properties``, opens or names what they need).

``SUPPORTED`` is the list docs/structured_outputs.md gives; a test checks that the page
names each keyword.
"""

from __future__ import annotations

import copy
import json
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from framework.constrained.base import InvalidConstraintError
from framework.constrained.patterns import unsupported_feature

#: The OpenAI error ``code`` of a keyword refused.
UNSUPPORTED = "unsupported_schema_keyword"
#: Keywords that constrain nothing: accepted anywhere, and ignored.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
#: ``format`` values enforced exactly. The others xgrammar knows it writes too loosely
#: (a ``date`` of February 30, an ``ipv4`` with leading zeros) or not at all.
FORMATS = ("email", "uuid")
#: The largest ``multipleOf`` xgrammar enforces (integers only).
MAX_MULTIPLE_OF = 1024
#: Fraction digits of a bounded number as xgrammar writes it.
NUMBER_PLACES = 6
_STRING = frozenset({"string"})
_NUMERIC = frozenset({"integer", "number"})
_ARRAY = frozenset({"array"})
_OBJECT = frozenset({"object"})
#: Keywords that constrain values of some types, and those types.
TYPE_KEYWORDS: dict[str, frozenset[str]] = {
    "minLength": _STRING, "maxLength": _STRING, "pattern": _STRING, "format": _STRING,
    "minimum": _NUMERIC, "maximum": _NUMERIC, "exclusiveMinimum": _NUMERIC,
    "exclusiveMaximum": _NUMERIC, "multipleOf": _NUMERIC,
    "items": _ARRAY, "prefixItems": _ARRAY, "minItems": _ARRAY, "maxItems": _ARRAY,
    "uniqueItems": _ARRAY,
    "properties": _OBJECT, "required": _OBJECT, "additionalProperties": _OBJECT,
    "minProperties": _OBJECT, "maxProperties": _OBJECT,
}
#: Keywords xgrammar reads alone, in its order: it drops every other beside them.
EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
#: Keywords that hold schemas for ``$ref`` to point at.
DEFINITIONS = ("$defs", "definitions")
#: Every keyword enforced (with the limits above), for the documentation's list.
SUPPORTED = ("type", *EXCLUSIVE, *DEFINITIONS, *TYPE_KEYWORDS)
# Keywords without a type that xgrammar reads as one: the type it takes them for.
_IMPLIED_TYPE = {"properties": "object", "additionalProperties": "object",
                 "items": "array", "prefixItems": "array"}
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class SchemaKeywordError(InvalidConstraintError):
    """A keyword refused: ``keyword`` and ``pointer`` (its JSON Pointer) name it."""

    def __init__(self, keyword: str, pointer: str, problem: str,
                 code: str | None = UNSUPPORTED) -> None:
        super().__init__("json_schema", f"'{keyword}' at {pointer or '/'} {problem}", code)
        self.keyword, self.pointer = keyword, pointer


def escape(name: str) -> str:
    """``name`` as one reference token of a JSON Pointer (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def check_schema(text: str) -> str:
    """The schema ``text`` normalized for xgrammar; ``SchemaKeywordError`` if it cannot be.

    Not JSON at all passes through: the backend's parser says what is wrong with it.
    """
    try:
        schema = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return text
    schema = copy.deepcopy(schema)  # normalized in place: never the caller's objects
    _Walk(schema).schema(schema, "")
    return json.dumps(schema)


def _not_json(constant: str) -> Any:
    """Refuse Python's extensions to JSON (``NaN``, ``Infinity``): xgrammar's parser does."""
    raise ValueError(f"{constant} is not JSON")


def json_type_of(value: Any) -> set[str]:
    """The JSON Schema types ``value`` has (an integral number is both kinds)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


class _Walk:
    """One schema's check: every subschema once, ``$ref`` targets where they are."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.seen: set[str] = set()

    def schema(self, node: Any, pointer: str) -> None:
        """Check (and normalize) the subschema ``node`` at ``pointer``."""
        if pointer in self.seen or isinstance(node, bool):
            return
        self.seen.add(pointer)
        if not isinstance(node, dict):
            raise InvalidConstraintError("json_schema", f"the schema at {pointer or '/'} must "
                                         "be an object or a boolean")
        for name in DEFINITIONS:
            if name in node:
                self.members(node, name, pointer)
        exclusive = next((k for k in EXCLUSIVE if k in node), None)
        if exclusive is None:
            self.typed(node, pointer)
        else:
            self.alone(node, pointer, exclusive)

    def members(self, node: dict[str, Any], name: str, pointer: str) -> None:
        """Check each schema of the map ``node[name]`` (``properties``, ``$defs``)."""
        value = node[name]
        if not isinstance(value, dict):
            raise SchemaKeywordError(name, f"{pointer}/{name}",
                                     "must map names to schemas", code=None)
        for key, sub in value.items():
            self.schema(sub, f"{pointer}/{name}/{escape(key)}")

    def items(self, node: dict[str, Any], name: str, pointer: str) -> None:
        """Check each schema of the non-empty list ``node[name]`` (``anyOf``, ...)."""
        value = node[name]
        if not isinstance(value, list) or not value:
            raise SchemaKeywordError(name, f"{pointer}/{name}",
                                     "must be a non-empty list of schemas", code=None)
        for i, sub in enumerate(value):
            self.schema(sub, f"{pointer}/{name}/{i}")

    # ------------------------------------------------------------------ alone

    def alone(self, node: dict[str, Any], pointer: str, exclusive: str) -> None:
        """A schema with ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf`` or ``allOf``."""
        beside = {exclusive, *DEFINITIONS, *ANNOTATIONS}
        if exclusive in ("const", "enum"):
            beside.add("type")  # when every value has it, the values enforce it
        for key in node:
            if key not in beside:
                raise SchemaKeywordError(key, f"{pointer}/{escape(key)}",
                                         f"is not enforced beside '{exclusive}' (the grammar "
                                         f"reads '{exclusive}' alone)")
        check = {"$ref": self._ref, "const": self._const, "enum": self._enum,
                 "anyOf": self._anyof, "oneOf": self._oneof, "allOf": self._allof}[exclusive]
        check(node, pointer)

    def _ref(self, node: dict[str, Any], pointer: str) -> None:
        ref = node["$ref"]
        target = self.resolve(ref) if isinstance(ref, str) else None
        if target is None:
            raise SchemaKeywordError("$ref", f"{pointer}/$ref", "must be a JSON Pointer that "
                                     f"resolves in this schema ('#', '#/$defs/...'), got "
                                     f"{json.dumps(ref)}")
        self.schema(target[1], target[0])

    def resolve(self, ref: str) -> tuple[str, Any] | None:
        """``(pointer, value)`` that the local reference ``ref`` names, or None."""
        if ref != "#" and not ref.startswith("#/"):
            return None
        node = self.root
        for token in ref[2:].split("/") if ref != "#" else []:
            key = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                return None
        return ref[1:], node

    def _const(self, node: dict[str, Any], pointer: str) -> None:
        self.values_have_type(node, pointer, [node["const"]])

    def _enum(self, node: dict[str, Any], pointer: str) -> None:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaKeywordError("enum", f"{pointer}/enum", "must be a non-empty list",
                                     code=None)
        self.values_have_type(node, pointer, values)

    def values_have_type(self, node: dict[str, Any], pointer: str, values: list[Any]) -> None:
        """Refuse a ``type`` beside ``const``/``enum`` that some value does not have."""
        if "type" not in node:
            return
        types = self.types(node, pointer)
        for value in values:
            if not json_type_of(value) & types:
                raise SchemaKeywordError("type", f"{pointer}/type", f"is not enforced: the "
                                         f"value {json.dumps(value)} is not of that type")

    def _anyof(self, node: dict[str, Any], pointer: str) -> None:
        self.items(node, "anyOf", pointer)

    def _oneof(self, node: dict[str, Any], pointer: str) -> None:
        self.items(node, "oneOf", pointer)
        seen: set[str] = set()
        for i, branch in enumerate(node["oneOf"]):
            # xgrammar may write oneOf as anyOf: exact only when no value fits two branches.
            types = self.types(branch, f"{pointer}/oneOf/{i}") if (
                isinstance(branch, dict) and "type" in branch
                and not any(k in branch for k in EXCLUSIVE)) else None
            if types is not None and types & _NUMERIC:
                types |= _NUMERIC  # an integral number is of both types
            if types is None or types & seen:
                raise SchemaKeywordError("oneOf", f"{pointer}/oneOf", "is enforced only when "
                                         "each branch names its type and no two share one "
                                         "(integer and number overlap); use anyOf")
            seen |= types

    def _allof(self, node: dict[str, Any], pointer: str) -> None:
        if isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
            raise SchemaKeywordError("allOf", f"{pointer}/allOf", "is enforced with one "
                                     "schema only; merge the schemas into one")
        self.items(node, "allOf", pointer)

    # ------------------------------------------------------------------ typed

    def types(self, node: dict[str, Any], pointer: str) -> set[str]:
        """The set of types ``node['type']`` names (a name, or a list of distinct names)."""
        value = node["type"]
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(n, str) and n in TYPES for n in names) \
                or len(set(names)) != len(names):
            raise SchemaKeywordError("type", f"{pointer}/type", f"must be one of "
                                     f"{', '.join(TYPES)}, or a list of distinct ones",
                                     code=None)
        return set(names)

    def typed(self, node: dict[str, Any], pointer: str) -> None:
        """A schema without an exclusive keyword: ``type`` and the keywords of its types."""
        if "type" in node:
            types: set[str] | None = self.types(node, pointer)
        else:
            implied = [_IMPLIED_TYPE[k] for k in _IMPLIED_TYPE if k in node]
            types = {implied[0]} if implied else None
        for key in node:
            if key in ANNOTATIONS or key in DEFINITIONS or key == "type":
                continue
            if key not in TYPE_KEYWORDS:
                raise SchemaKeywordError(key, f"{pointer}/{escape(key)}", _why_not(key))
            if types is None:
                raise SchemaKeywordError(key, f"{pointer}/{escape(key)}", "is enforced only "
                                         "where the schema names its 'type'")
            if TYPE_KEYWORDS[key] & types:
                self.keyword(node, key, pointer, types)
        if types is not None and "string" in types:
            _one_string_rule(node, pointer)
        if types is not None and "number" in types:
            _check_number_range(node, pointer)
        if types is not None and "object" in types:
            _open_object(node, pointer)
        if types is not None and "array" in types:
            _open_array(node)

    def keyword(self, node: dict[str, Any], key: str, pointer: str, types: set[str]) -> None:
        """Check one keyword that applies to some of ``types``."""
        value, at = node[key], f"{pointer}/{key}"
        if key in _COUNTS:
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     key, at, "must be a non-negative integer")
        elif key in _BOUNDS:
            _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                     key, at, "must be a number (the draft-4 boolean form is not supported)")
        elif key == "multipleOf":
            _check_multiple_of(value, at, types)
        elif key == "pattern":
            _check_pattern(value, at)
        elif key == "format":
            _require(value in FORMATS, key, at, f"is not enforced for {json.dumps(value)} "
                     f"(enforced formats: {', '.join(FORMATS)})", code=UNSUPPORTED)
        elif key == "uniqueItems":
            _require(value is False, key, at, "is not enforced when true (outputs could "
                     "repeat an item)", code=UNSUPPORTED)
        elif key == "items":
            _require(isinstance(value, (dict, bool)), key, at, "must be a schema (for a tuple, "
                     "use prefixItems)")
            self.schema(value, at)
        elif key == "prefixItems":
            self.items(node, key, pointer)
        elif key == "properties":
            self.members(node, key, pointer)
        elif key == "additionalProperties":
            self.schema(value, at)
        elif key == "required":
            _require(isinstance(value, list) and all(isinstance(n, str) for n in value)
                     and len(set(value)) == len(value), key, at,
                     "must be a list of distinct names")


def _require(ok: bool, key: str, at: str, problem: str, code: str | None = None) -> None:
    if not ok:
        raise SchemaKeywordError(key, at, problem, code=code)


def _check_multiple_of(value: Any, at: str, types: set[str]) -> None:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
             "multipleOf", at, "must be a number above 0")
    _require("number" not in types, "multipleOf", at, "is enforced for type integer only",
             code=UNSUPPORTED)
    _require(float(value).is_integer() and value <= MAX_MULTIPLE_OF, "multipleOf", at,
             f"is enforced for whole numbers up to {MAX_MULTIPLE_OF} only", code=UNSUPPORTED)


def _check_pattern(value: Any, at: str) -> None:
    _require(isinstance(value, str), "pattern", at, "must be a string")
    problem = unsupported_feature(value)
    _require(problem is None, "pattern", at, f"uses {problem}, which a grammar cannot "
             "enforce", code=UNSUPPORTED)


def _one_string_rule(node: dict[str, Any], pointer: str) -> None:
    """Refuse what xgrammar drops from a string schema: it follows one rule, the first of
    ``format``, ``pattern``, then ``minLength``/``maxLength``."""
    for leader, dropped in (("format", ("pattern", "minLength", "maxLength")),
                            ("pattern", ("minLength", "maxLength"))):
        for key in dropped:
            if leader in node and key in node:
                raise SchemaKeywordError(key, f"{pointer}/{key}", f"is not enforced beside "
                                         f"'{leader}' (write the length into the pattern)")


def _check_number_range(node: dict[str, Any], pointer: str) -> None:
    """Refuse bounds between which no number has ``NUMBER_PLACES`` fraction digits or fewer.

    xgrammar writes a bounded number with at most that many; with none in range its
    grammar is empty, and an empty output would finish with ``stop``.
    """
    lower = _bound(node, "minimum", "exclusiveMinimum", max)
    upper = _bound(node, "maximum", "exclusiveMaximum", min)
    if lower is None or upper is None:
        return
    step = Decimal(1).scaleb(-NUMBER_PLACES)
    first = (lower[0] / step).to_integral_value(ROUND_CEILING)
    first += 1 if lower[1] and first * step == lower[0] else 0
    last = (upper[0] / step).to_integral_value(ROUND_FLOOR)
    last -= 1 if upper[1] and last * step == upper[0] else 0
    if first > last:
        key = "exclusiveMaximum" if upper[1] else "maximum"
        raise SchemaKeywordError(key, f"{pointer}/{key}", f"leaves no number with at most "
                                 f"{NUMBER_PLACES} decimal places in range (the grammar "
                                 "writes numbers with that many)")


def _bound(node: dict[str, Any], inclusive: str, exclusive: str,
           tighter: Any) -> tuple[Decimal, bool] | None:
    """``(value, exclusive)`` of the tighter of a side's two bounds (a tie: the exclusive)."""
    found = [(Decimal(repr(node[k])), k == exclusive) for k in (inclusive, exclusive)
             if k in node]
    if not found:
        return None
    value = tighter(v for v, _ in found)
    return value, any(excl for v, excl in found if v == value)


def _open_object(node: dict[str, Any], pointer: str) -> None:
    """Make an object schema that xgrammar would close too tightly say what it allows.

    JSON Schema leaves objects open (``additionalProperties`` absent allows any other
    key); xgrammar closes them. A required name missing from ``properties`` is named
    there, with the schema ``additionalProperties`` gives it; ``minProperties`` past the
    named properties opens the object again.
    """
    missing = [n for n in node.get("required", []) if n not in node.get("properties", {})]
    if missing:
        extra = node.get("additionalProperties", True)
        _require(extra is not False, "required", f"{pointer}/required", f"names "
                 f"{json.dumps(missing[0])}, which is not in properties while "
                 "additionalProperties is false: no output can have it")
        node.setdefault("properties", {}).update(dict.fromkeys(missing, extra))
    if (node.get("minProperties", 0) > len(node.get("properties", {}))
            and "additionalProperties" not in node):
        node["additionalProperties"] = True


def _open_array(node: dict[str, Any]) -> None:
    """As ``_open_object`` for arrays: ``minItems`` past ``prefixItems`` opens ``items``."""
    if "items" not in node and node.get("minItems", 0) > len(node.get("prefixItems", [])):
        node["items"] = True


# Keywords of JSON Schema that are not enforced, and why (others: not a keyword known here).
_NOT_ENFORCED = {
    "not": "(a grammar cannot exclude a sub-language)",
    "if": "(conditional schemas)", "then": "(conditional schemas)",
    "else": "(conditional schemas)",
    "dependentRequired": "(conditional schemas)", "dependentSchemas": "(conditional schemas)",
    "dependencies": "(conditional schemas)",
    "contains": "(outputs could lack the item)", "minContains": "(outputs could lack the item)",
    "maxContains": "(outputs could lack the item)",
    "patternProperties": "", "propertyNames": "", "unevaluatedProperties": "",
    "unevaluatedItems": "", "additionalItems": "(for tuples, use prefixItems and items)",
}


def _why_not(key: str) -> str:
    if key in _NOT_ENFORCED:
        return f"is not enforced {_NOT_ENFORCED[key]}".rstrip()
    return "is not a keyword structured outputs enforce"
