"""Start the real server as a subprocess on a free port, and talk to it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from framework.bench.soak import process_tree


@dataclass
class ServerProcess:
    """A running ``framework serve`` and its base URL."""

    proc: subprocess.Popen[str]
    base_url: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """PIDs of the server's child processes (the Scheduler, the Detokenizer)."""
        return child_pids(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, read from /proc."""
    return process_tree(pid)[1:]


# The line ``framework serve`` prints once it serves, naming the port it bound.
SERVING_LINE = re.compile(r"framework is serving .* at (http://\S+) \(")


def start_server(model_dir: Path | None, log_dir: Path, *extra: str, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``framework serve --port 0`` and wait until ``/health`` answers 200.

    The server binds a free port itself and names it in its "framework is serving"
    line, read back from its output (no port is chosen here and then raced for).
    """
    args = [sys.executable, "-m", "framework.cli", "serve", "--port", "0",
            "--log-level", "warning"]
    if model_dir is not None:
        args += ["--model-path", str(model_dir)]
    args += list(extra)
    log_path = Path(tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)[1])
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    server = ServerProcess(proc, "", log_path, args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        if not server.base_url:
            found = SERVING_LINE.search(server.log())
            server.base_url = found.group(1) if found else ""
        if server.base_url and _healthy(server.base_url):
            return server
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def serving(model_dir: Path | None, log_dir: Path, *extra: str, **options: Any
            ) -> Iterator[ServerProcess]:
    """A started server, for a fixture to ``yield from``; it must then stop with status 0."""
    proc = start_server(model_dir, log_dir, *extra, **options)
    yield proc
    assert proc.stop() == 0, proc.log()


def http_client(server: ServerProcess, timeout: float = 60) -> Iterator[httpx.Client]:
    """An HTTP client of ``server``, for a fixture to ``yield from``."""
    with httpx.Client(base_url=server.base_url, timeout=timeout) as client:
        yield client


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """Parsed ``data:`` payloads of an SSE response; ``[DONE]`` is yielded as the string."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def stream_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming request and collect every event."""
    with client.stream("POST", path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(response))


def scheduler_info(client: httpx.Client) -> dict[str, Any]:
    """The Scheduler's part of ``/get_server_info``."""
    return client.get("/get_server_info").json()["scheduler"]


def wait_until_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """The Scheduler's info once nothing is in flight and every KV slot is free.

    At the deadline (a liveness bound, not a timing) the last info is returned
    as it is, for the caller's assertion to show.
    """
    deadline = time.monotonic() + timeout
    while True:
        info = scheduler_info(client)
        if info["kv_cache_idle_and_free"] or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def still_running(pids: list[int], wait: float = 10.0) -> list[int]:
    """The pids still running after up to ``wait`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + wait
    while True:
        running = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@contextlib.contextmanager
def private_tmp() -> Iterator[dict[str, str]]:
    """An environment whose TMPDIR is a fresh directory, to see what a server leaves there.

    Made in the system's temporary directory, not under pytest's (whose paths, with a
    worker's folder, make ipc:// socket paths longer than a socket address holds).
    """
    tmp = tempfile.mkdtemp(prefix="fw-")
    try:
        yield {"TMPDIR": tmp}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def own_children() -> set[int]:
    """Child processes of this test process, but Python's resource tracker (one per process)."""
    pids = set()
    for pid in child_pids(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.add(pid)
    return pids


class SharedPool:
    """Servers and Engines shared by every test that asks for the same one.

    Keyed by what makes them (checkpoint, flags, environment); at most ``capacity``
    alive at once, so that the suite fits in memory: a new one first closes the least
    recently used of those no fixture holds. A server must stop with status 0; one
    that does not is reported when the session ends.
    """

    def __init__(self, log_dir: Path, capacity: int = 3) -> None:
        self.log_dir = log_dir
        self.capacity = capacity
        # key -> (the server or Engine, how to close it, how many fixtures hold it)
        self._alive: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self.failures: list[str] = []

    @contextlib.contextmanager
    def server(self, model_dir: Path | None, *flags: str,
               env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
        """Hold the server of ``model_dir`` and ``flags`` (started, or started before)."""
        key = ("server", str(model_dir), flags, tuple(sorted((env or {}).items())))
        with self._hold(key, lambda: start_server(model_dir, self.log_dir, *flags, env=env),
                        self._stop_server) as server:
            if server.proc.poll() is not None:
                raise RuntimeError(f"a shared server exited:\n{server.log()}")
            yield server

    @contextlib.contextmanager
    def engine(self, **kwargs: Any) -> Iterator[Any]:
        """Hold the Engine made with ``kwargs`` (``ServerArgs`` fields)."""
        from framework import Engine

        key = ("engine", tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        with self._hold(key, lambda: Engine(**kwargs), lambda e: e.shutdown()) as engine:
            yield engine

    @contextlib.contextmanager
    def _hold(self, key: Hashable, make: Callable[[], Any],
              close: Callable[[Any], None]) -> Iterator[Any]:
        entry = self._alive.get(key)
        if entry is None:
            self._make_room()
            entry = self._alive[key] = [make(), close, 0]
        self._alive.move_to_end(key)
        entry[2] += 1
        try:
            yield entry[0]
        finally:
            entry[2] -= 1

    def _make_room(self) -> None:
        idle = [key for key, entry in self._alive.items() if entry[2] == 0]
        while len(self._alive) >= self.capacity and idle:
            self._close(idle.pop(0))

    def _close(self, key: Hashable) -> None:
        obj, close, _ = self._alive.pop(key)
        close(obj)

    def _stop_server(self, server: ServerProcess) -> None:
        status = server.stop()
        if status != 0:
            self.failures.append(f"{' '.join(server.args)} exited with {status}:\n"
                                 f"{server.log()}")

    def close(self) -> None:
        """Close everything still alive."""
        for key in list(self._alive):
            self._close(key)
