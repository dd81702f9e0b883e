"""Server-sent events: one ``data:`` line per event, ``data: [DONE]`` at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

_encoder = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def sse_stream(events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Encode every payload of ``events`` as an SSE event, then send ``[DONE]``.

    An error raised while streaming becomes an OpenAI-style error event before
    ``[DONE]``, since the status line has already gone out: bad input (``ValueError``)
    as a 400, a runtime that went down (``RuntimeError``) as a 503.
    """
    try:
        async for payload in events:
            yield sse_event(payload)
    except ValueError as exc:
        yield sse_event(error_body(str(exc), 400))
    except RuntimeError as exc:
        yield sse_event(error_body(str(exc), 503))
    yield DONE


def sse_response(events: AsyncIterator[Any]) -> StreamingResponse:
    """The streamed answer of a route: ``events`` as SSE (see ``sse_stream``)."""
    return StreamingResponse(sse_stream(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def error_body(message: str, status: int, param: str | None = None,
               kind: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
