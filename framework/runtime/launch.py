"""The process tree: start the Scheduler and the Detokenizer, wait for them, watch them, stop them.

The main process binds its receivers first (through the TokenizerManager),
then spawns one process per component. Each child binds its own receivers,
connects its senders and reports ``ready`` (or the error that stopped it) on
a pipe. A child dies with its parent (``PR_SET_PDEATHSIG`` plus a watchdog),
and the parent learns of a dead child through its process sentinel.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from framework.config import PortArgs, ServerArgs
from framework.registry import create_transport, import_dotted

logger = logging.getLogger("framework.launch")

_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ComponentClasses:
    """The classes to run: the built-ins or the user's subclasses named in ServerArgs."""

    scheduler: type
    tokenizer_manager: type
    detokenizer: type


def component_classes(server_args: ServerArgs) -> ComponentClasses:
    """Resolve ``--scheduler-class`` and friends, checking each is a subclass of the built-in."""
    from framework.runtime.detokenizer import Detokenizer
    from framework.runtime.scheduler import Scheduler
    from framework.runtime.tokenizer_manager import TokenizerManager

    def pick(path: str | None, base: type) -> type:
        if path is None:
            return base
        cls = import_dotted(path)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{path} is not a subclass of {base.__name__}")
        return cls

    return ComponentClasses(
        scheduler=pick(server_args.scheduler_class, Scheduler),
        tokenizer_manager=pick(server_args.tokenizer_manager_class, TokenizerManager),
        detokenizer=pick(server_args.detokenizer_class, Detokenizer),
    )


# --------------------------------------------------------------------------- children


def die_with_parent() -> None:
    """Make sure this child never outlives the process that started it."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _child_setup(server_args: ServerArgs) -> None:
    die_with_parent()
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s %(processName)s] %(levelname)s %(message)s")
    # The parent handles Ctrl-C and stops its children; a child just follows SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _report_start_failure(ready: Connection, name: str, exc: Exception) -> NoReturn:
    """Tell the parent why this child could not start, then exit."""
    if isinstance(exc, ValueError):
        message = str(exc)  # a user error (bad model directory, bad flag): its message says it
    else:
        logger.exception("the %s failed to start", name)
        message = f"{type(exc).__name__}: {exc}"
    ready.send(("error", message))
    sys.exit(1)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, transport: Any,
                          ready: Connection) -> None:
    """Body of the Scheduler process."""
    _child_setup(server_args)
    try:
        scheduler = component_classes(server_args).scheduler(server_args, port_args, transport)
    except Exception as exc:
        _report_start_failure(ready, "scheduler", exc)
    signal.signal(signal.SIGTERM, lambda *_: scheduler.stop())
    ready.send(("ready", {"context_len": scheduler.context_len,
                          "is_embedding": scheduler.model_config.is_embedding}))
    try:
        scheduler.event_loop()
    finally:
        scheduler.close()


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, transport: Any,
                            ready: Connection) -> None:
    """Body of the Detokenizer process."""
    _child_setup(server_args)
    try:
        detokenizer = component_classes(server_args).detokenizer.from_server_args(
            server_args, port_args, transport)
    except Exception as exc:
        _report_start_failure(ready, "detokenizer", exc)
    signal.signal(signal.SIGTERM, lambda *_: detokenizer.stop())
    ready.send(("ready", {}))
    try:
        asyncio.run(detokenizer.serve())
    finally:
        detokenizer.close()


# --------------------------------------------------------------------------- parent


class ComponentError(RuntimeError):
    """A child process failed to start or died."""


class ProcessTree:
    """The running children of one server, and the channels' directory."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.transport = create_transport(server_args.transport,
                                          allow_insecure_pickle=server_args.allow_insecure_pickle)
        self.port_args = PortArgs.create(self.transport,
                                         tcp_host="127.0.0.1" if server_args.use_tcp else None)
        self.classes = component_classes(server_args)
        self.processes: dict[str, mp.process.BaseProcess] = {}
        self.scheduler_info: dict[str, Any] = {}
        self._stopping = False

    def start(self) -> None:
        """Spawn the Scheduler and the Detokenizer and wait until both are ready."""
        ctx = mp.get_context("spawn")
        pipes: dict[str, Connection] = {}
        for name, target in (("scheduler", run_scheduler_process),
                             ("detokenizer", run_detokenizer_process)):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, name=name, daemon=True,
                               args=(self.server_args, self.port_args, self.transport, writer))
            proc.start()
            writer.close()
            self.processes[name] = proc
            pipes[name] = reader
        for name, reader in pipes.items():
            status, payload = self._wait_ready(name, reader)
            if status != "ready":
                raise ComponentError(f"the {name} failed to start: {payload}")
            if name == "scheduler":
                self.scheduler_info = payload

    def _wait_ready(self, name: str, reader: Connection) -> tuple[str, Any]:
        proc = self.processes[name]
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if reader.poll(0.2):
                try:
                    return reader.recv()
                except EOFError:
                    break
            if not proc.is_alive():
                break
        if proc.is_alive():
            return "error", f"not ready within {_READY_TIMEOUT_S:.0f} s"
        return "error", f"the process exited with code {proc.exitcode}"

    def wait_for_death(self) -> str:
        """Block until a child exits; return which one and how (for the server's log)."""
        sentinels = {p.sentinel: name for name, p in self.processes.items()}
        ready = wait(list(sentinels))
        name = sentinels[ready[0]]
        return f"the {name} process exited unexpectedly with code {self.processes[name].exitcode}"

    def stop(self) -> None:
        """Terminate every child (SIGTERM, then SIGKILL) and remove the channel directory."""
        if self._stopping:
            return
        self._stopping = True
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.port_args.cleanup()
