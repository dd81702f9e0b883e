"""The OpenAPI 3.1 document of the HTTP API (``GET /openapi.json``).

It is generated, not written: the request bodies are the JSON Schemas of the same
``msgspec`` structs that parse the requests, and the paths are the app's route table,
so that a route or a field added to the code shows up here without a second edit.

The structs carry no ``msgspec.Meta`` bounds, on purpose: decoding would then refuse an
out-of-range value with msgspec's words before ``SamplingParams.verify()`` could name
the field and its range. The ranges are added to the generated schema instead, made
from the same ``Range`` declarations that ``verify()`` checks (``SAMPLING_RANGES`` and
``REQUEST_RANGES`` in ``framework.sampling_params``).

A field that a route reads ``null`` for (as its default) admits ``null`` here too: the
request structs type such fields ``X | None``, and ``SamplingParams``, which
``/generate`` builds from a dict, gets ``null`` added to each of its fields.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from framework.sampling_params import (
    REQUEST_RANGES,
    SAMPLING_RANGES,
    Range,
    SamplingParams,
)
from framework.server import openai as oai

REF = "#/components/schemas/{name}"
ERROR_REF = {"$ref": REF.format(name="ErrorResponse")}

_ERROR_TEXT = {
    400: "Bad input: the message names the field and its range",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "The model is not served here (`code: model_not_found`)",
    500: "Unexpected failure",
    503: "The runtime lost a component",
}


@dataclass(frozen=True)
class RouteSpec:
    """One row of the app's route table, with what the OpenAPI document says of it.

    ``body`` is the struct that parses the request body (None: no body);
    ``errors`` the statuses answered with OpenAI's error body; ``media`` the
    content types of a 200 answer (``text/event-stream`` for routes that stream).
    """

    path: str
    handler: Callable[..., Awaitable[Any]]
    methods: tuple[str, ...]
    summary: str
    body: type[msgspec.Struct] | None = None
    errors: tuple[int, ...] = (400, 500, 503)
    media: tuple[str, ...] = ("application/json",)


# ------------------------------------------------------------------------ ranges


def range_schema(allowed: Range) -> dict[str, Any]:
    """``allowed`` as JSON Schema keywords: its ends, and each special value as a ``const``."""
    bounds = {("exclusiveMinimum" if allowed.low_open else "minimum"): allowed.low,
              ("exclusiveMaximum" if allowed.high_open else "maximum"): allowed.high}
    if not allowed.special:
        return bounds
    return {"anyOf": [*({"const": value} for value, _ in allowed.special), bounds]}


def field_ranges() -> dict[str, dict[str, Range]]:
    """Per component schema, the ``Range`` of each of its numeric fields.

    Read from the tables at each call. The OpenAI routes spell some ``SamplingParams``
    fields their own way (``max_tokens``, ``min_tokens``, ``logprobs``, ...).
    """
    most, least = SAMPLING_RANGES["max_new_tokens"], SAMPLING_RANGES["min_new_tokens"]
    top_logprobs = REQUEST_RANGES["top_logprobs_num"]
    return {
        "CompletionRequest": {**SAMPLING_RANGES, "max_tokens": most, "min_tokens": least,
                              "logprobs": top_logprobs},
        "ChatCompletionRequest": {**SAMPLING_RANGES, "max_tokens": most,
                                  "max_completion_tokens": most, "min_tokens": least,
                                  "top_logprobs": top_logprobs},
        "SamplingParams": dict(SAMPLING_RANGES),
        "GenerateRequestBody": dict(REQUEST_RANGES),
    }


def add_bounds(components: dict[str, Any]) -> None:
    """Merge the ranges of ``field_ranges()`` into the properties of the generated
    component schemas (a field a component does not have is skipped).

    Numeric keywords only constrain numbers, so a ``null`` of an optional field
    still validates.
    """
    for name, fields in field_ranges().items():
        properties = components.get(name, {}).get("properties", {})
        for field, allowed in fields.items():
            if field in properties:
                properties[field].update(range_schema(allowed))


# ------------------------------------------------------------------------ document


def _admit_null(properties: dict[str, Any]) -> None:
    """Let every property schema in ``properties`` admit ``null`` too (in place).

    A ``type`` becomes a list with ``"null"``, so that the keywords next to it (the
    ranges of ``add_bounds``) stay where they are: they only constrain numbers. The
    others (``X | None`` fields) are ``anyOf`` lists that hold null already.
    """
    for schema in properties.values():
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]


def _components(bodies: Iterable[type[msgspec.Struct]]) -> dict[str, Any]:
    """JSON Schemas of the request structs, the error body and ``SamplingParams``."""
    types = [*dict.fromkeys(bodies), SamplingParams, oai.ErrorResponse]
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    # /generate parses ``sampling_params`` as a dict and builds ``SamplingParams`` from it.
    generate = components.get("GenerateRequestBody")
    if generate is not None:
        generate["properties"]["sampling_params"] = {
            "anyOf": [{"$ref": REF.format(name="SamplingParams")}, {"type": "null"}],
            "default": None}
    add_bounds(components)
    # ``SamplingParams.from_dict`` reads a null field as its default.
    _admit_null(components["SamplingParams"]["properties"])
    return components


def openapi_path(path: str) -> tuple[str, list[str]]:
    """Starlette's path (``/v1/models/{model:path}``) as OpenAPI's, with its parameters."""
    params = re.findall(r"{(\w+)(?::\w+)?}", path)
    return re.sub(r"{(\w+)(?::\w+)?}", r"{\1}", path), params


def _operation(spec: RouteSpec, method: str, params: list[str],
               guarded: bool) -> dict[str, Any]:
    """One OpenAPI operation: body by reference, the 200 answer and the error answers."""
    name = spec.handler.__name__
    op: dict[str, Any] = {
        "summary": spec.summary,
        # Operation ids are unique in a document: a route of several methods has one each.
        "operationId": name if len(spec.methods) == 1 else f"{name}_{method.lower()}",
        "responses": {"200": {"description": "OK"}},
    }
    if spec.media:
        op["responses"]["200"]["content"] = {media: {} for media in spec.media}
    if spec.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(name=spec.body.__name__)}}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True,
                             "schema": {"type": "string"}} for p in params]
    errors = [*spec.errors, 401] if guarded else list(spec.errors)
    for status in sorted(errors):
        op["responses"][str(status)] = {
            "description": _ERROR_TEXT.get(status, "Error"),
            "content": {"application/json": {"schema": ERROR_REF}}}
    if not guarded:
        op["security"] = []  # open even with --api-key
    return op


def build_openapi(specs: Iterable[RouteSpec], *, api_key: bool, open_paths: Iterable[str],
                  title: str = "framework", version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document for the routes ``specs``.

    With ``api_key`` every route outside ``open_paths`` requires the bearer scheme
    and may answer 401.
    """
    specs = list(specs)
    open_set = frozenset(open_paths)
    paths: dict[str, dict[str, Any]] = {}
    for spec in specs:
        path, params = openapi_path(spec.path)
        guarded = api_key and spec.path not in open_set
        for method in spec.methods:
            paths.setdefault(path, {})[method.lower()] = _operation(spec, method, params,
                                                                     guarded)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible and SGLang-native routes; see docs/api.md."},
        "paths": paths,
        "components": {"schemas": _components(s.body for s in specs if s.body is not None)},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


__all__ = ["RouteSpec", "add_bounds", "build_openapi", "field_ranges", "openapi_path",
           "range_schema"]
