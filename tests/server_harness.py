"""Start the real server as a subprocess on a free port, and talk to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from framework.bench.soak import process_tree
from framework.comm.zmq import free_tcp_port


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


def start_server(model_dir: Path, log_dir: Path, *extra: str, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``framework serve`` and wait until ``/health`` answers 200."""
    port = free_tcp_port()
    args = [sys.executable, "-m", "framework.cli", "serve", "--port", str(port),
            "--log-level", "warning"]
    if model_dir is not None:
        args += ["--model-path", str(model_dir)]
    args += list(extra)
    log_path = log_dir / f"server-{port}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def serving(model_dir: Path, log_dir: Path, *extra: str, **options: Any
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


def private_tmp(tmp_path: Path) -> dict[str, str]:
    """An environment whose TMPDIR is a fresh directory, to see what a server leaves there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return {"TMPDIR": str(tmp)}


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
