"""Reading a request's body: the size limit, then JSON decoding into a request struct."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from starlette.requests import Request

from framework.runtime.tokenizer_manager import RequestError
from framework.server.responses import ApiError

S = TypeVar("S", bound=msgspec.Struct)


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 once it passes ``--max-request-bytes``.

    A declared ``Content-Length`` past the limit is refused before anything is read;
    a body sent in chunks is read only up to the limit.
    """
    limit = request.app.state.server.server_args.max_request_bytes
    too_large = ApiError(f"the request body is larger than the {limit} bytes this server "
                         f"accepts", 413, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _invalid_field(message: str) -> str | None:
    """The field a msgspec validation message names (``... - at `$.messages[0].role```,
    ``Object missing required field `prompt```), as OpenAI's ``param`` gives it."""
    at = re.search(r" - at `\$\.?([^`]*)`$", message)
    path = at.group(1) if at else ""
    named = re.search(r"(?:missing required|unknown) field `([^`]+)`", message)
    if named:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


async def parse_body(request: Request, schema: type[S]) -> S:
    """Decode and validate the JSON body; a bad body is a ``RequestError`` (400)."""
    body = await read_body(request)
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}", param=_invalid_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None
