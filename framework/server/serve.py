"""`framework serve`: the process tree, the TokenizerManager and the app on Hypercorn."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from framework.config import ServerArgs
from framework.runtime.hf_tokenizer import load_tokenizer
from framework.runtime.launch import ProcessTree
from framework.server.app import ServerState, build_app

logger = logging.getLogger("framework.serve")


def run_server(server_args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until a child process dies (exit 1)."""
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(server_args))


async def _serve(server_args: ServerArgs) -> int:
    model_path = server_args.resolved_model_path()
    tokenizer = load_tokenizer(server_args.resolved_tokenizer_path())
    tree = ProcessTree(server_args)
    manager = None
    try:
        # The TokenizerManager binds its receivers before the children connect to them.
        manager = tree.classes.tokenizer_manager(server_args, tree.port_args, tree.transport,
                                                 tokenizer)
        await asyncio.to_thread(tree.start)
        info = tree.scheduler_info
        manager.context_len = info["context_len"]
        manager.start()
        state = ServerState(
            tokenizer_manager=manager, server_args=server_args,
            model_name=server_args.served_model_name or model_path, model_path=model_path,
            context_len=info["context_len"], is_embedding=info["is_embedding"],
        )
        return await _run_http(server_args, state, tree)
    finally:
        tree.stop()
        if manager is not None:
            await manager.close()


async def _run_http(server_args: ServerArgs, state: ServerState, tree: ProcessTree) -> int:
    loop = asyncio.get_running_loop()
    shutdown = asyncio.Event()
    exit_code = 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)

    async def watch_children() -> None:
        nonlocal exit_code
        reason = await asyncio.to_thread(tree.wait_for_death)
        if shutdown.is_set():
            return
        logger.error("%s; shutting down", reason)
        state.tokenizer_manager.fail_all(reason)
        exit_code = 1
        shutdown.set()

    watcher = asyncio.create_task(watch_children())
    config = HypercornConfig()
    config.bind = [f"{_host(server_args.host)}:{server_args.port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    config.loglevel = "WARNING"
    base = f"http://{_host(server_args.host)}:{server_args.port}"
    print(_startup_banner(server_args, state, base), flush=True)
    try:
        await hypercorn_serve(build_app(state), config, shutdown_trigger=shutdown.wait)
    finally:
        shutdown.set()
        watcher.cancel()
    return exit_code


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _startup_banner(args: ServerArgs, state: ServerState, base: str) -> str:
    example: dict[str, Any] = {"model": state.model_name, "prompt": "def fibonacci(n):",
                               "max_tokens": 32}
    import json

    return (
        f"framework is serving {state.model_name} at {base} "
        f"(transport {args.transport}, codec {args.codec}, "
        f"attention backend {args.attention_backend})\n"
        f"  try: curl {base}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{json.dumps(example)}'"
    )
