"""The router's Starlette app: pass-through of the API routes, retries, and its own routes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from framework.router.args import RouterArgs
from framework.router.health import check_worker
from framework.router.metrics import RouterMetrics
from framework.router.policies import Choice, Policy
from framework.router.prompt_text import prompt_text
from framework.router.workers import Worker, WorkerSet
from framework.server.auth import ApiKeyMiddleware
from framework.server.responses import JSONResponse, error_response
from framework.server.sse import error_body

logger = logging.getLogger("framework.router")

# Routes whose prompt the policy routes on; /v1/models goes to any healthy worker.
ROUTED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate")
# Statuses of a worker that is going away or gone: the request is sent again elsewhere.
_RETRY_STATUSES = frozenset({502, 503})


class _Failed(Exception):
    """A worker failed a request before answering it."""


class Router:
    """Chooses a worker per request and relays the request to it and the answer back."""

    def __init__(self, args: RouterArgs, client: httpx.AsyncClient, workers: WorkerSet,
                 policy: Policy, metrics: RouterMetrics) -> None:
        self.args = args
        self.client = client
        self.workers = workers
        self.policy = policy
        self.metrics = metrics

    async def forward(self, request: Request) -> Response:
        """Send ``request`` to a worker; once more to another one if that worker fails."""
        route = request.url.path
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # the worker answers the malformed body with its own error
        text = prompt_text(route, body)
        stream = isinstance(body, dict) and bool(body.get("stream"))
        failed: Worker | None = None
        for attempt in range(2):
            choice = self._choose(route, text, exclude=failed)
            if choice is None:
                self.metrics.errors.labels(route, "no_worker").inc()
                return error_response("no healthy worker to send the request to", 503,
                                      code="no_healthy_worker")
            worker = choice.worker
            if attempt:
                self.metrics.retries.labels(route).inc()
            try:
                return await self._send(worker, request, raw, stream)
            except _Failed as exc:
                logger.warning("worker %s failed a request on %s: %s", worker.url, route, exc)
                failed = worker
            except httpx.TimeoutException:
                self.metrics.errors.labels(route, "timeout").inc()
                return error_response(f"the worker did not answer within "
                                      f"{self.args.request_timeout:g} s", 504)
        self.metrics.errors.labels(route, "worker_failed").inc()
        return error_response("the workers failed the request", 502, code="worker_failed")

    def _choose(self, route: str, text: str, exclude: Worker | None) -> Choice | None:
        candidates = self.workers.healthy(exclude)
        if not candidates:
            return None
        if route in ROUTED:
            choice = self.policy.choose(candidates, text)
            self.metrics.routed(route, choice, len(text))
        else:
            choice = Choice(min(candidates, key=lambda w: w.load))
        return choice

    async def _send(self, worker: Worker, request: Request, raw: bytes,
                    stream: bool) -> Response:
        """The worker's answer; ``_Failed`` when it fails before answering."""
        upstream = self.client.build_request(
            request.method, f"{worker.url}{request.url.path}", content=raw,
            headers=self._headers(request), params=request.query_params)
        self.workers.acquire(worker)
        relayed = False
        try:
            response = await self.client.send(upstream, stream=True)
            if stream and response.status_code == 200:
                relayed = True  # the relay releases the worker when the stream ends
                return StreamingResponse(_relay(response, self.workers, worker),
                                         media_type=response.headers.get("content-type"))
            content = await response.aread()
            await response.aclose()
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as exc:
            worker.healthy = False  # until its next health check passes
            raise _Failed(repr(exc)) from None
        finally:
            if not relayed:
                self.workers.release(worker)
        if response.status_code in _RETRY_STATUSES:
            raise _Failed(f"HTTP {response.status_code}")
        return Response(content, response.status_code,
                        media_type=response.headers.get("content-type"))

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if self.args.forward_api_key and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        elif self.args.worker_api_key:
            headers["authorization"] = f"Bearer {self.args.worker_api_key}"
        return headers


async def _relay(response: httpx.Response, workers: WorkerSet,
                 worker: Worker) -> AsyncIterator[bytes]:
    """The worker's SSE events, whole; a cut stream ends with an error event and [DONE]."""
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            pending += chunk
            events, sep, pending = pending.rpartition(b"\n\n")
            if sep:
                yield events + sep
    except httpx.HTTPError as exc:
        # The partial event is dropped: the client gets only whole events.
        logger.warning("stream from worker %s cut: %r", worker.url, exc)
        body = error_body(f"the worker's stream broke off: {exc!r}", 502)
        yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await response.aclose()
        workers.release(worker)


def build_app(router: Router) -> Starlette:
    """The app: the API routes relayed, and the router's own routes."""

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok",
                             "healthy_workers": len(router.workers.healthy())})

    async def list_workers(_: Request) -> Response:
        return JSONResponse({"policy": router.args.policy,
                             "workers": router.workers.describe()})

    async def add_worker(request: Request) -> Response:
        url = request.query_params.get("url")
        if not url:
            return error_response("name the worker: /add_worker?url=URL", 400, param="url")
        worker = router.workers.add(url)
        await check_worker(router.client, worker, timeout=5.0)
        return JSONResponse(worker.describe())

    async def remove_worker(request: Request) -> Response:
        url = request.query_params.get("url", "")
        worker = router.workers.remove(url) if url else None
        if worker is None:
            return error_response(f"no worker {url!r} in the pool", 404, param="url")
        router.policy.forget(worker.url)
        return JSONResponse(worker.describe())

    async def metrics(_: Request) -> Response:
        return Response(router.metrics.render(router.workers),
                        media_type="text/plain; version=0.0.4")

    routes = [Route(path, router.forward, methods=["POST"]) for path in ROUTED]
    routes += [
        Route("/v1/models", router.forward, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/list_workers", list_workers, methods=["GET"]),
        Route("/add_worker", add_worker, methods=["POST"]),
        Route("/remove_worker", remove_worker, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    if router.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=router.args.api_key)
    return app
