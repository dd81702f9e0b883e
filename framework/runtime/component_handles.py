"""How the ComponentTree runs each component: in a spawned process (the child's set-up, its
body, its exit) or in a daemon thread, behind one handle interface for both."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from framework.config import PortArgs, ServerArgs
from framework.libc import linux_libc
from framework.runtime.component_build import (
    RunningComponent,
    StoppedBeforeStart,
    build_component,
)
from framework.runtime.component_plan import ComponentSpec, set_torch_threads, usable_cores
from framework.runtime.heap import hold_freed_memory

logger = logging.getLogger("framework.launch")

_JOIN_TIMEOUT_S = 5.0
# Each spawned child imports the caller's main module again. A script that starts the runtime
# at its top level, not under ``if __name__ == "__main__":``, would start it again in every
# child; the child exits with this code instead, silently, and the parent says why, once.
_UNGUARDED_MAIN_EXIT = 3
UNGUARDED_MAIN_MESSAGE = (
    "the script starts the runtime when it is imported, and each process the runtime spawns "
    "imports it again: put the code that starts it under `if __name__ == \"__main__\":`"
)


def _start_failure_message(name: str, exc: Exception) -> str:
    if isinstance(exc, ValueError):
        return str(exc)  # a user error (bad model directory, bad flag): its message says it
    logger.exception("the %s failed to start", name)
    return f"{type(exc).__name__}: {exc}"


def _use_torch_threads(spec: ComponentSpec, *, own_process: bool) -> None:
    set_torch_threads(spec.torch_threads, own_process=own_process,
                      needs_torch=spec.kind == "scheduler")
    logger.info("the %s runs torch on %d thread(s) (%d usable cores)", spec.name,
                spec.torch_threads, usable_cores())


def die_with_parent() -> None:
    """Make sure this child never outlives the process that started it."""
    # The launcher's pid as multiprocessing knows it: the parent may have died already, and
    # then os.getppid() names whoever adopted this process.
    launcher = mp.parent_process()
    parent = launcher.pid if launcher is not None and launcher.pid else os.getppid()
    libc = linux_libc()
    if libc is not None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)  # it died before the signal was asked for: nothing would send it

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
    # tqdm's default lock (for the weight loader's progress bar) is a multiprocessing RLock:
    # a named semaphore, which a child ending with ``os._exit`` never unlinks (the resource
    # tracker then warns of a leak). This process's bars are its own: a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _report_start_failure(ready: Connection, name: str, exc: Exception) -> NoReturn:
    """Tell the parent why this child could not start, then exit."""
    ready.send(("error", _start_failure_message(name, exc)))
    sys.exit(1)


def run_component_process(spec: ComponentSpec, server_args: ServerArgs, port_args: PortArgs,
                          transport: Any, ready: Connection) -> None:
    """Body of one component's process: build it, report ready, run it until SIGTERM."""
    _child_setup(server_args)
    _use_torch_threads(spec, own_process=True)
    # A process of its own: its steps' tensors reuse freed memory instead of new pages.
    held = spec.kind == "scheduler" and hold_freed_memory()
    try:
        component = build_component(spec, server_args, port_args, transport, ready)
    except Exception as exc:
        _report_start_failure(ready, spec.name, exc)
    component.info["holds_freed_memory"] = held
    if component.exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGTERM, lambda *_: component.stop())
    ready.send(("ready", component.info))
    try:
        component.run()
    finally:
        component.close()
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End the process once a component has closed everything it holds.

    Without the interpreter's teardown of torch and every other module (half a
    second or more), so the runtime stops sooner; only the output streams and
    the log handlers have anything left to write.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def leave_if_importing_main() -> None:
    """In a spawned child still importing the parent's main module, exit (see
    ``_UNGUARDED_MAIN_EXIT``): multiprocessing marks that phase ``_inheriting``."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.exit(_UNGUARDED_MAIN_EXIT)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"with code {code} (killed by {signal.Signals(-code).name})"
    return f"with code {code}"


def send_tokenizer_class(handle: ProcessHandle | ThreadHandle, name: str | None) -> None:
    """Hand a Detokenizer its tokenizer class (``None``: stop waiting for one)."""
    with contextlib.suppress(OSError):  # a component that died is reported by its sentinel
        handle.ready.send(name)


class ProcessHandle:
    """One component in a spawned process."""

    def __init__(self, ctx: Any, spec: ComponentSpec, args: tuple[Any, ...]) -> None:
        self.spec = spec
        # Both ways: the child reports on it; the tree sends a Detokenizer its tokenizer class.
        self.ready, self._child_end = ctx.Pipe()
        self.process = ctx.Process(target=run_component_process, name=spec.name.replace(" ", "-"),
                                   args=(spec, *args, self._child_end), daemon=True)

    def start(self) -> None:
        self.process.start()
        self._child_end.close()  # the child holds the other copy: EOF once it exits

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_code(self) -> int | None:
        # The sentinel fires as the child exits, a moment before it can be reaped: join
        # first, or the code still reads None.
        self.process.join(_JOIN_TIMEOUT_S)
        return self.process.exitcode

    def not_ready_message(self) -> str:
        code = self.exit_code()
        if code == _UNGUARDED_MAIN_EXIT:
            return UNGUARDED_MAIN_MESSAGE
        # It died before its body ran (an import error, a crash); the child printed why.
        return (f"the {self.spec.name} failed to start: the process exited "
                f"{_describe_exit(code)} before reporting (see its output above)")

    def death_message(self) -> str:
        return (f"the {self.spec.name} process exited unexpectedly "
                f"{_describe_exit(self.exit_code())}")

    def request_stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self, timeout: float) -> None:
        if self.process.pid is not None:
            self.process.join(timeout)

    def force_stop(self) -> None:
        self.process.kill()
        self.process.join(_JOIN_TIMEOUT_S)

    def close(self) -> None:
        self.ready.close()
        self._child_end.close()  # still open if the process never started


class ThreadHandle:
    """One component in a daemon thread of this process (``--launch-mode thread``)."""

    def __init__(self, spec: ComponentSpec, args: tuple[Any, ...]) -> None:
        self.spec = spec
        self._args = args
        self.ready, self._child_end = mp.Pipe()
        # Closed when the thread ends, so that its end can be waited on like a process's.
        self._done_reader, self._done_writer = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._body, name=spec.name, daemon=True)
        self._lock = threading.Lock()
        self._component: RunningComponent | None = None
        self._stop_requested = False
        self.error: BaseException | None = None

    def _body(self) -> None:
        try:
            self._build_and_run()
        finally:
            self._child_end.close()
            self._done_writer.close()

    def _build_and_run(self) -> None:
        _use_torch_threads(self.spec, own_process=False)
        try:
            component = build_component(self.spec, *self._args, self._child_end)
        except StoppedBeforeStart:
            return
        except Exception as exc:
            with contextlib.suppress(OSError):  # the tree may have stopped and closed its end
                self._child_end.send(("error", _start_failure_message(self.spec.name, exc)))
            return
        with self._lock:
            if self._stop_requested:
                component.close()
                return
            self._component = component
        self._child_end.send(("ready", component.info))
        try:
            component.run()
        except Exception as exc:
            self.error = exc
            logger.exception("the %s thread failed", self.spec.name)
        finally:
            component.close()

    def start(self) -> None:
        self._thread.start()

    @property
    def sentinel(self) -> Connection:
        return self._done_reader

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def not_ready_message(self) -> str:
        return f"the {self.spec.name} failed to start: the thread ended without reporting"

    def death_message(self) -> str:
        detail = f": {self.error!r}" if self.error is not None else ""
        return f"the {self.spec.name} thread stopped unexpectedly{detail}"

    def request_stop(self) -> None:
        with self._lock:
            self._stop_requested = True
            component = self._component
        if component is not None:
            component.stop()
        elif self.spec.kind == "detokenizer":
            send_tokenizer_class(self, None)  # it may still wait for its class: stop that

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def force_stop(self) -> None:
        # A thread cannot be killed; a daemon thread ends with the process.
        logger.warning("the %s thread did not stop in time; it ends with the process",
                       self.spec.name)

    def close(self) -> None:
        self.ready.close()  # the thread closes its own ends when it returns
