"""The API key: ``ApiKeyMiddleware`` and the paths open without it (``OPEN_PATHS``)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from framework.server.responses import error_response

# Paths open without the API key: probes of load balancers and Prometheus scrapers, and the
# API's description (it holds no secret, and client generators fetch it before any key).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/openapi.json"})


class ApiKeyMiddleware:
    """Answer 401 unless a request carries ``Authorization: Bearer <api key>``.

    Plain ASGI (not ``BaseHTTPMiddleware``) so that SSE responses pass through
    untouched; it guards every route, also ones added to the table later.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            "Incorrect API key provided. Send it as `Authorization: Bearer <key>`.",
            401, code="invalid_api_key")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # Constant time, so that the answer's timing does not reveal how much matched.
        return hmac.compare_digest(given, self.expected)
