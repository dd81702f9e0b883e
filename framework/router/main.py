"""``run(args)``: serve the router with Hypercorn until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import httpx

from framework.router.args import RouterArgs
from framework.router.health import check_all, health_loop
from framework.router.metrics import RouterMetrics
from framework.router.policies import make_policy
from framework.router.proxy import Router, build_app
from framework.router.workers import WorkerSet
from framework.server.serve import listening_socket

# Connections the kernel queues for the router to accept: many clients connect at once.
_LISTEN_BACKLOG = 2048
# Seconds a worker may take to accept a connection; a slower one counts as failed.
_CONNECT_TIMEOUT_S = 5.0


def run(args: RouterArgs) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(args))


def _client(args: RouterArgs) -> httpx.AsyncClient:
    # No pool limit: the router holds as many connections as it has requests in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeout = httpx.Timeout(args.request_timeout, connect=_CONNECT_TIMEOUT_S)
    return httpx.AsyncClient(limits=limits, timeout=timeout)


async def _serve(args: RouterArgs) -> int:
    listener = listening_socket(args.host, args.port)
    try:
        return await _serve_on(args, listener)
    finally:
        listener.close()  # a no-op once Hypercorn has it


async def _serve_on(args: RouterArgs, listener: socket.socket) -> int:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    workers = WorkerSet(args.worker_urls)
    async with _client(args) as client:
        router = Router(args, client, workers, make_policy(args.policy, args.cache_aware()),
                        RouterMetrics())
        # The first check before serving: a worker down at start gets no request.
        await check_all(client, workers, timeout=_CONNECT_TIMEOUT_S)
        checker = asyncio.create_task(health_loop(client, workers, args.health_check_interval))
        shutdown = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, shutdown.set)
        port = listener.getsockname()[1]
        config = HypercornConfig()
        config.bind = [f"fd://{listener.detach()}"]
        config.accesslog = None
        config.backlog = _LISTEN_BACKLOG
        # Hypercorn stops listening on the signal and lets requests in flight finish.
        config.graceful_timeout = args.graceful_shutdown_timeout
        config.loglevel = "WARNING"
        healthy = len(workers.healthy())
        print(f"framework router is serving at http://{_host(args.host)}:{port} (policy "
              f"{args.policy}, {healthy} of {len(workers.active())} workers healthy)",
              flush=True)
        try:
            await hypercorn_serve(build_app(router), config, shutdown_trigger=shutdown.wait)
        finally:
            checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checker
    return 0


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
