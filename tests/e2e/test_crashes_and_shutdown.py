"""Crashes and shutdown with streams in flight.

- Killing the Scheduler or the Detokenizer mid-stream ends every in-flight stream with
  an error event naming the component and its exit code, and the server exits
  non-zero, leaving no child process and no socket file.
- SIGTERM lets in-flight streams finish within ``--graceful-shutdown-timeout``, and
  aborts what is still running when it runs out; the server exits 0 either way.

Time limits are generous liveness bounds, not performance claims.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from framework.bench.soak import process_tree
from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import ServerProcess, start_server, still_running

LONG = 6000  # more tokens than a test ever waits for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", seed=8,
                                max_position_embeddings=8192)


@pytest.fixture
def started() -> Iterator[list[ServerProcess]]:
    """Servers a test starts; any still running at its end (it failed early) is killed."""
    servers: list[ServerProcess] = []
    yield servers
    for server in servers:
        server.stop(signal.SIGKILL)


def body(new_tokens: int) -> dict[str, Any]:
    return {"prompt": "hello there", "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


class Stream:
    """A streamed completion read on a thread: its events, and when its first one came."""

    def __init__(self, base_url: str, new_tokens: int) -> None:
        self.events: list[Any] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(base_url, new_tokens),
                                       daemon=True)
        self.thread.start()

    def _read(self, base_url: str, new_tokens: int) -> None:
        try:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body(new_tokens),
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as exc:  # kept for the test to show
            self.error = exc
        finally:
            self.first.set()

    def join(self) -> list[Any]:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream never ended"
        return self.events


# The one line a server prints when a signal finds requests in flight.
DRAINING = ("framework: draining: {count} request(s) in flight may finish within {seconds} s "
            "(--graceful-shutdown-timeout); press Ctrl-C again to abort them now")


def wait_for_line(server: ServerProcess, line: str) -> None:
    deadline = time.monotonic() + 60  # a liveness bound: the line comes at once
    while line not in server.log().splitlines():
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
        time.sleep(0.05)


def component_pid(server: ServerProcess, component: str) -> int:
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
    if component == "scheduler":
        return int(info["scheduler"]["pid"])
    # The other child started by the launcher (multiprocessing's resource tracker is one too).
    others = [pid for pid in server.children() if pid != info["scheduler"]["pid"]
              and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(others) == 1, others
    return others[0]


@pytest.mark.parametrize("component", ["scheduler", "detokenizer"])
def test_killing_a_component_mid_stream_ends_streams_with_an_error(
        checkpoint: Path, tmp_path: Path, component: str, started: list[ServerProcess],
        tmp_env: dict[str, str]) -> None:
    env = tmp_env
    server = start_server(checkpoint, tmp_path, env=env)
    started.append(server)
    children = server.children()
    streams = [Stream(server.base_url, LONG) for _ in range(3)]
    for stream in streams:
        assert stream.first.wait(60) and stream.events, stream.error
    victim = component_pid(server, component)
    assert victim in children
    os.kill(victim, signal.SIGKILL)
    code = server.proc.wait(timeout=60)
    assert code != 0
    log = server.log()
    assert f"the {component} process exited unexpectedly with code -9 (killed by SIGKILL)" \
        in log, log
    for stream in streams:
        events = stream.join()
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors, events[-3:]
        assert f"{component} process exited unexpectedly" in errors[-1]["error"]["message"]
        assert events[-1] == "[DONE]"
    assert still_running(children) == []
    assert os.listdir(env["TMPDIR"]) == []


def test_sigterm_lets_streams_in_flight_finish(checkpoint: Path, tmp_path: Path,
                                               started: list[ServerProcess],
                                               tmp_env: dict[str, str]) -> None:
    env = tmp_env
    server = start_server(checkpoint, tmp_path, "--graceful-shutdown-timeout", "120", env=env)
    started.append(server)
    children = server.children()
    assert len(children) >= 2
    assert os.listdir(env["TMPDIR"]), "the server keeps its sockets under TMPDIR"
    stream = Stream(server.base_url, 300)
    assert stream.first.wait(60), stream.error
    server.proc.send_signal(signal.SIGTERM)
    wait_for_line(server, DRAINING.format(count=1, seconds=120))
    events = stream.join()
    assert server.proc.wait(timeout=120) == 0, server.log()
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] == "length", events[-3:]
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text  # the whole output arrived after the signal
    assert still_running(children) == []
    assert os.listdir(env["TMPDIR"]) == []
    # No named semaphore left for Python's resource tracker to find and warn about.
    assert "leaked" not in server.log()


def test_a_second_signal_ends_the_drain_at_once(checkpoint: Path, tmp_path: Path,
                                               started: list[ServerProcess]) -> None:
    server = start_server(checkpoint, tmp_path, "--graceful-shutdown-timeout", "600")
    started.append(server)
    stream = Stream(server.base_url, LONG)
    assert stream.first.wait(60), stream.error
    server.proc.send_signal(signal.SIGTERM)
    wait_for_line(server, DRAINING.format(count=1, seconds=600))
    server.proc.send_signal(signal.SIGINT)  # Ctrl-C, a second time
    # Long before the drain's 600 s: the second signal aborted what was in flight.
    assert server.proc.wait(timeout=60) == 0, server.log()
    stream.join()
    finishes = [e["choices"][0]["finish_reason"] for e in stream.events
                if isinstance(e, dict) and e.get("choices")]
    assert finishes[-1] == "abort" and stream.events[-1] == "[DONE]", stream.events[-3:]
    assert "framework: aborting the requests in flight" in server.log()


def test_sigterm_aborts_what_outlives_the_timeout(checkpoint: Path, tmp_path: Path,
                                                  started: list[ServerProcess],
                                                  tmp_env: dict[str, str]) -> None:
    env = tmp_env
    server = start_server(checkpoint, tmp_path, "--graceful-shutdown-timeout", "1", env=env)
    started.append(server)
    children = server.children()
    stream = Stream(server.base_url, LONG)
    assert stream.first.wait(60), stream.error
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()
    stream.join()
    finishes = [e["choices"][0]["finish_reason"] for e in stream.events
                if isinstance(e, dict) and e.get("choices")]
    # Aborted at the timeout, the stream ends as an aborted request does.
    assert finishes[-1] == "abort" and stream.events[-1] == "[DONE]", stream.events[-3:]
    assert still_running(children) == []
    assert os.listdir(env["TMPDIR"]) == []



def test_sigterm_during_start_up_removes_everything(checkpoint: Path, tmp_path: Path,
                                                    tmp_env: dict[str, str]) -> None:
    """Stopped while its components start, the server ends with 143 (SIGTERM) and leaves
    no process, socket file or channel directory behind."""
    env = tmp_env
    command = [sys.executable, "-m", "framework.cli", "serve", "--model-path", str(checkpoint),
               "--port", "0", "--log-level", "warning"]
    with (tmp_path / "server.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 60  # a liveness bound: the children appear in seconds
        while not (children := process_tree(proc.pid)[1:]) and proc.poll() is None:
            assert time.monotonic() < deadline, "the server started no component"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    log_text = (tmp_path / "server.log").read_text()
    assert code == 128 + signal.SIGTERM, log_text
    assert "Traceback" not in log_text, log_text
    assert still_running(children) == []
    assert os.listdir(env["TMPDIR"]) == []
