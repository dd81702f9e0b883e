"""What wraps every route handler: the route's path for logs, and each failure as an answer.

Bad input becomes a 400, an overloaded runtime a 503 with ``Retry-After``, a dead runtime
a 503, anything else a 500, all in OpenAI's error body; Starlette's own errors (no such
route, wrong method) get that body too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from framework.runtime.tokenizer_manager import OverloadedError, RequestError
from framework.server.disconnect import ClientGone
from framework.server.responses import ApiError, error_response

logger = logging.getLogger("framework.server")

Handler = Callable[[Request], Awaitable[Response]]
#: The path of the route being served, read by --log-requests.
current_route: ContextVar[str] = ContextVar("route", default="?")


def wrap_handler(fn: Handler) -> Handler:
    """Turn bad input into 400s and a dead runtime into 503s, with OpenAI's error body."""

    async def wrapped(request: Request) -> Response:
        # Read by --log-requests; streams run in a copy of this context, so they see it too.
        current_route.set(request.url.path)
        try:
            return await fn(request)
        except ClientGone:
            # Nobody reads it: 499 (client closed request) marks it in access logs.
            return Response(status_code=499)
        except ApiError as exc:
            return error_response(str(exc), exc.status, exc.param, exc.code)
        except (RequestError, ValueError) as exc:
            return error_response(str(exc), 400, getattr(exc, "param", None),
                                  getattr(exc, "code", None))
        except OverloadedError as exc:
            response = error_response(str(exc), 503, code="overloaded")
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
        except RuntimeError as exc:
            logger.exception("request failed")
            return error_response(str(exc), 503)
        except Exception as exc:
            logger.exception("request failed")
            return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    wrapped.__name__ = fn.__name__
    return wrapped


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's error body too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    if status == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif status == 405:
        detail = f"{request.url.path} does not take {request.method}"
    response = error_response(detail, status)
    response.headers.update(getattr(exc, "headers", None) or {})
    return response
