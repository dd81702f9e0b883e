"""JSON answers and the API's errors: ``JSONResponse``, ``error_response``, ``ApiError``."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from framework.server.sse import error_body

_json = msgspec.json.Encoder()


class JSONResponse(Response):
    """A JSON response encoded by msgspec (numpy arrays already converted)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body with ``status``; ``code`` replaces the numeric code."""
    body = error_body(message, status, param)
    if code is not None:
        body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


class ApiError(Exception):
    """An error answered with its own status and OpenAI ``code`` (404 model_not_found, ...)."""

    def __init__(self, message: str, status: int, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
