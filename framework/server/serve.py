"""`framework serve`: the components (through the launcher), the TokenizerManager and the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from framework.config import ServerArgs
from framework.messages import AbortReq
from framework.runtime.launch import (
    ComponentTree,
    run_ranks_only,
    set_torch_threads,
    start_runtime,
)

if TYPE_CHECKING:
    from framework.server.state import ServerState

logger = logging.getLogger("framework.serve")
# Connections the kernel queues for the server to accept (see _run_http).
_LISTEN_BACKLOG = 2048
# On shutdown, seconds past --graceful-shutdown-timeout for the requests aborted then to send
# their last event before Hypercorn closes what is still open.
_ABORTED_GRACE_S = 2.0


def run_server(server_args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until a component dies (exit 1)."""
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if server_args.node_rank > 0:
        return run_ranks_only(server_args)  # only node 0 serves HTTP
    # The HTTP process does no heavy torch work; its cores belong to the schedulers.
    set_torch_threads(1, own_process=True, needs_torch=False)
    return asyncio.run(_serve(server_args))


async def _serve(server_args: ServerArgs) -> int:
    # Bound before anything loads: a port in use is one line at once, not after the load;
    # and before the components pick their free tcp ports, so that none of them is this one.
    listener = listening_socket(server_args.host, server_args.port)
    components: ComponentTree | None = None
    manager = None
    try:
        # It refuses impossible launch settings before anything loads.
        components = ComponentTree(server_args)
        model_path = server_args.resolved_model_path()
        # The app and Hypercorn (a third of a second of imports) load while the components
        # start, not before: the import below then finds them loaded, or waits for them.
        threading.Thread(target=_import_http_stack, name="import-http", daemon=True).start()
        manager = await start_runtime(components)
        from framework.server.state import ServerState

        state = ServerState(
            tokenizer_manager=manager, server_args=server_args,
            model_name=server_args.served_model_name or model_path, model_path=model_path,
            model=manager.model,
        )
        return await _run_http(server_args, state, components, listener)
    finally:
        listener.close()  # a no-op once Hypercorn has it
        if components is not None:
            components.stop()
        if manager is not None:
            await manager.close()


def _import_http_stack() -> None:
    import hypercorn.asyncio  # noqa: F401

    import framework.server.app  # noqa: F401


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for Hypercorn, which listens on it (``fd://``).

    Set up as Hypercorn sets up its own; an address that cannot be bound is an ``OSError``
    naming it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise OSError(f"cannot listen on {_host(host)}:{port}: {reason}") from None
    return sock


async def _run_http(server_args: ServerArgs, state: ServerState,
                    components: ComponentTree, listener: socket.socket) -> int:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    from framework.server.app import build_app

    loop = asyncio.get_running_loop()
    drain = Drain(server_args.graceful_shutdown_timeout,
                  lambda: len(state.tokenizer_manager.rid_to_state))
    shutdown = drain.started
    exit_code = 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain.on_signal)

    async def watch_components() -> None:
        nonlocal exit_code
        reason = await asyncio.to_thread(components.wait_for_death)
        if reason is None or shutdown.is_set():
            return
        logger.error("%s; shutting down", reason)
        state.tokenizer_manager.fail_all(reason)
        exit_code = 1
        shutdown.set()

    async def abort_what_outlives_the_timeout() -> None:
        await drain.wait_until_over()
        # Each stream still running then ends with finish_reason "abort" and [DONE].
        with contextlib.suppress(Exception):  # a dead runtime has failed them already
            await state.tokenizer_manager.dispatch(
                AbortReq(abort_all=True, reason="the server is shutting down"))

    watcher = asyncio.create_task(watch_components())
    aborter = asyncio.create_task(abort_what_outlives_the_timeout())
    # The bound port: the one asked for, or the free one --port 0 got.
    base = f"http://{_host(server_args.host)}:{listener.getsockname()[1]}"
    config = HypercornConfig()
    config.bind = [f"fd://{listener.detach()}"]  # Hypercorn owns the socket from here
    config.accesslog = None
    # Hypercorn's default listen backlog (100) overflows when hundreds of clients connect at
    # once; the kernel then drops or resets connections before the server sees them.
    config.backlog = _LISTEN_BACKLOG
    # On shutdown Hypercorn stops listening at once and waits this long for the requests in
    # flight; the components run until it returns, so those requests can finish (or end
    # aborted, with their last event, at --graceful-shutdown-timeout).
    config.graceful_timeout = server_args.graceful_shutdown_timeout + _ABORTED_GRACE_S
    config.loglevel = "WARNING"
    backend = components.scheduler_info["attention_backend"]
    print(_startup_banner(server_args, state, base, backend), flush=True)
    try:
        await hypercorn_serve(build_app(state), config, shutdown_trigger=shutdown.wait)
    finally:
        shutdown.set()
        watcher.cancel()
        aborter.cancel()
    return exit_code


class Drain:
    """Shutdown in two steps, as SIGINT or SIGTERM asks.

    The first signal stops the server taking requests and lets those in flight finish
    for ``timeout`` seconds, saying so in one line; the timeout, or a second signal,
    ends the drain (the server then aborts what is left).
    """

    def __init__(self, timeout: float, in_flight: Callable[[], int]) -> None:
        self.timeout = timeout
        self.in_flight = in_flight
        self.started = asyncio.Event()
        self._cut_short = asyncio.Event()

    def on_signal(self) -> None:
        """SIGINT or SIGTERM: begin the drain, or end it at once if it has begun."""
        if not self.started.is_set():
            count = self.in_flight()
            if count and self.timeout > 0:
                _say(f"draining: {count} request(s) in flight may finish within "
                     f"{self.timeout:g} s (--graceful-shutdown-timeout); press Ctrl-C again "
                     "to abort them now")
            self.started.set()
        elif not self._cut_short.is_set():
            _say("aborting the requests in flight")
            self._cut_short.set()

    async def wait_until_over(self) -> None:
        """Return once the drain has begun and then timed out or been cut short."""
        await self.started.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._cut_short.wait(), self.timeout)


def _say(line: str) -> None:
    print(f"framework: {line}", file=sys.stderr, flush=True)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _startup_banner(args: ServerArgs, state: ServerState, base: str,
                    attention_backend: str) -> str:
    import json

    route = "/v1/embeddings" if state.model.is_embedding else "/v1/completions"
    example: dict[str, Any] = (
        {"model": state.model_name, "input": "a sentence to embed"} if state.model.is_embedding
        else {"model": state.model_name, "prompt": "def fibonacci(n):", "max_tokens": 32})

    # The key itself is never printed: the example names the variable holding it.
    auth = " -H \"Authorization: Bearer $API_KEY\"" if args.api_key else ""
    return (
        f"framework is serving {state.model_name} at {base} "
        f"(transport {args.transport}, codec {args.codec}, "
        f"attention backend {attention_backend})\n"
        f"  try: curl {base}{route} -H 'Content-Type: application/json'{auth} "
        f"-d '{json.dumps(example)}'"
    )
