"""``framework bench soak``: a long run of mixed traffic against a server it starts itself.

Workers loop until ``--duration`` runs out, each request drawn at random from a
mix: completions (whole and streamed), streamed chat, ``/generate`` with
``n = 2``, a stream the client hangs up on half-way, and a request with a bad
field (its 400 is expected). Every ``--sample-interval`` seconds the resident
memory (RSS) of the server and of each of its child processes is read from
``/proc``. The run passes when, for every process, the RSS at the end is within
``--rss-tolerance`` of the RSS after the warm-up (the first tenth of the run),
no request failed (a 5xx, a transport error, a stream without ``[DONE]``, or an
unexpected status), and afterwards the Scheduler is idle with every KV and
request slot free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from framework.bench.environment import git_commit, machine_description
from framework.comm.zmq import free_tcp_port
from framework.libc import parent_death_signal

PROMPT_WORDS = ("the", "model", "serves", "requests", "in", "batches", "while", "cache",
                "keeps", "every", "prefix", "it", "has", "seen", "so", "that", "later",
                "prompts", "reuse", "and", "scheduler")


@dataclass
class SoakSettings:
    """One soak run."""

    duration_s: float = 600.0
    concurrency: int = 8
    sample_interval_s: float = 10.0
    rss_tolerance: float = 0.10
    seed: int = 0
    output: Path = Path("benchmarks/results/soak")
    serve_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse (``ValueError``) a run that could not show anything."""
        checks = [
            (self.duration_s > 0, f"--duration must be above 0 s, got {self.duration_s}"),
            (self.concurrency >= 1, f"--concurrency must be at least 1, got {self.concurrency}"),
            (self.sample_interval_s > 0,
             f"--sample-interval must be above 0 s, got {self.sample_interval_s}"),
            (self.rss_tolerance >= 0,
             f"--rss-tolerance must be at least 0, got {self.rss_tolerance}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class SoakCounts:
    """What the workers saw."""

    by_kind: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def count(self, kind: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid``, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its children (the components the launcher started)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces; the parent pid is the 2nd field after it.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return [pid, *sorted(children)]


def process_roles(pids: list[int], scheduler_pids: set[int]) -> dict[str, str]:
    """A name for each process of the tree: server, scheduler, or what its command line says."""
    roles = {}
    for index, pid in enumerate(pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if index == 0:
            role = "server (HTTP, TokenizerManager)"
        elif pid in scheduler_pids:
            role = "scheduler"
        elif b"resource_tracker" in cmdline:
            role = "multiprocessing resource tracker"
        else:
            role = "detokenizer"
        roles[str(pid)] = role
    return roles


def _scheduler_pids(info: dict[str, Any]) -> set[int]:
    replicas = info.get("replicas") or [info]
    return {int(r["pid"]) for r in replicas if "pid" in r}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randrange(4, 40)))


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                  hang_up_after: int | None = None) -> str | None:
    """Read a stream to ``[DONE]`` (None), or say what went wrong."""
    events = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return f"{path}: status {response.status_code}"
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return None
            if line.startswith("data: "):
                if "error" in json.loads(line[len("data: "):]):
                    return f"{path}: error event {line[:200]}"
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return None  # leaving the block hangs up mid-stream
    return f"{path}: the stream ended without [DONE]"


async def one_request(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, str | None]:
    """Send one request of a random kind; its kind and its error, if any."""
    kind = rng.choice(["completion", "completion_stream", "chat_stream", "generate_n2",
                       "hang_up", "bad_request"])
    tokens = rng.randrange(4, 48)
    prompt = _prompt(rng)
    if kind == "completion":
        response = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": tokens, "temperature": 0.7})
        ok = response.status_code == 200 and response.json()["choices"]
        return kind, None if ok else f"completion: status {response.status_code}"
    if kind == "completion_stream":
        return kind, await _stream(client, "/v1/completions", {
            "prompt": prompt, "max_tokens": tokens, "stream": True})
    if kind == "chat_stream":
        return kind, await _stream(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True})
    if kind == "generate_n2":
        response = await client.post("/generate", json={
            "text": prompt, "sampling_params": {"max_new_tokens": tokens, "n": 2}})
        ok = response.status_code == 200 and len(response.json()) == 2
        return kind, None if ok else f"generate: status {response.status_code}"
    if kind == "hang_up":
        return kind, await _stream(client, "/v1/completions", {
            "prompt": prompt, "max_tokens": 64, "stream": True}, hang_up_after=2)
    response = await client.post("/v1/completions", json={"prompt": prompt, "top_p": 7})
    return kind, None if response.status_code == 400 else (
        f"bad request: status {response.status_code}, not 400")


async def worker(client: httpx.AsyncClient, seed: int, deadline: float,
                 counts: SoakCounts) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            kind, error = await one_request(client, rng)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            kind, error = "transport", f"{type(exc).__name__}: {exc}"
        counts.count(kind)
        if error is not None:
            counts.errors.append(error)


async def sample_rss(pids: list[int], interval: float, deadline: float,
                     samples: list[dict[str, Any]], started: float) -> None:
    while True:
        samples.append({"t": round(time.monotonic() - started, 1),
                        "rss": {str(pid): rss_bytes(pid) for pid in pids}})
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0.0)))


async def wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base_url, timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                # Its own output (above) says why: a bad flag is a user error.
                raise ValueError(f"the server exited with {proc.returncode} while starting")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


async def final_info(client: httpx.AsyncClient, timeout: float = 60.0) -> dict[str, Any]:
    """The Scheduler's info once idle (or as it is at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        info = (await client.get("/get_server_info")).json()["scheduler"]
        if info.get("kv_cache_idle_and_free") or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.2)


def rss_growth(samples: list[dict[str, Any]], duration_s: float) -> dict[str, float]:
    """Per process: RSS at the end over RSS after the warm-up (the first tenth), minus 1."""
    warm = next((s for s in samples if s["t"] >= duration_s / 10), samples[0])
    last = samples[-1]
    growth = {}
    for pid, start in warm["rss"].items():
        end = last["rss"].get(pid)
        if start and end:
            growth[pid] = end / start - 1.0
    return growth


async def run_soak(settings: SoakSettings) -> dict[str, Any]:
    """Start a server, run the traffic, sample RSS, stop the server; the summary."""
    port = free_tcp_port("127.0.0.1")
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "framework.cli", "serve", "--port", str(port),
               "--log-level", "warning", *settings.serve_args]
    # SIGTERM to the server if this process dies outright: it drains and stops its children.
    proc = subprocess.Popen(command, preexec_fn=parent_death_signal(signal.SIGTERM))
    try:
        await wait_ready(base_url, proc, 300)
        pids = process_tree(proc.pid)
        counts = SoakCounts()
        async with httpx.AsyncClient(base_url=base_url, timeout=60, trust_env=False) as probe:
            first = (await probe.get("/get_server_info")).json()["scheduler"]
        roles = process_roles(pids, _scheduler_pids(first))
        samples: list[dict[str, Any]] = []
        started = time.monotonic()
        deadline = started + settings.duration_s
        limits = httpx.Limits(max_connections=settings.concurrency * 2)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, trust_env=False,
                                     limits=limits) as client:
            await asyncio.gather(
                sample_rss(pids, settings.sample_interval_s, deadline, samples, started),
                *(worker(client, settings.seed + i, deadline, counts)
                  for i in range(settings.concurrency)))
            info = await final_info(client)
    finally:
        proc.terminate()
        exit_code = proc.wait(60)
    growth = rss_growth(samples, settings.duration_s)
    leaked = not info.get("kv_cache_idle_and_free")
    passed = (not counts.errors and not leaked and exit_code == 0
              and all(g <= settings.rss_tolerance for g in growth.values()))
    return {
        "passed": passed, "duration_s": settings.duration_s,
        "concurrency": settings.concurrency, "requests": counts.by_kind,
        "total_requests": sum(counts.by_kind.values()), "errors": counts.errors[:20],
        "error_count": len(counts.errors), "kv_cache_idle_and_free": not leaked,
        "server_exit_code": exit_code, "rss_growth": growth, "process_roles": roles,
        "rss_tolerance": settings.rss_tolerance, "rss_samples": samples,
        "serve_args": settings.serve_args, "machine": machine_description(),
        "commit": git_commit(),
    }


def render_markdown(summary: dict[str, Any]) -> str:
    """The result as a short markdown report."""
    rows = "\n".join(f"| {kind} | {n} |" for kind, n in sorted(summary["requests"].items()))
    roles = summary["process_roles"]
    growth = "\n".join(f"| {roles.get(pid, pid)} | {g * 100:+.1f}% |"
                       for pid, g in summary["rss_growth"].items())
    verdict = "passed" if summary["passed"] else "FAILED"
    return (
        f"# Soak: {verdict}\n\n"
        f"Machine: {summary['machine']}; commit {summary['commit']}.\n\n"
        f"{summary['duration_s']:.0f} s of mixed traffic from {summary['concurrency']} "
        f"workers: {summary['total_requests']} requests, {summary['error_count']} errors; "
        f"afterwards idle with every KV and request slot free: "
        f"{summary['kv_cache_idle_and_free']}; server exit code "
        f"{summary['server_exit_code']}.\n\n"
        f"| request kind | count |\n| --- | ---: |\n{rows}\n\n"
        f"RSS at the end against RSS after the warm-up (first tenth), per process; "
        f"tolerance {summary['rss_tolerance'] * 100:.0f}%:\n\n"
        f"| process | RSS change |\n| --- | ---: |\n{growth}\n"
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``framework bench soak``."""
    defaults = SoakSettings()
    parser.add_argument("--duration", type=float, default=defaults.duration_s,
                        help="seconds of traffic (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency,
                        help="workers sending requests (default: %(default)s)")
    parser.add_argument("--sample-interval", type=float, default=defaults.sample_interval_s,
                        help="seconds between RSS samples (default: %(default)s)")
    parser.add_argument("--rss-tolerance", type=float, default=defaults.rss_tolerance,
                        help="largest RSS growth after the warm-up that passes "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=defaults.output,
                        help="where soak.json and soak.md go (default: %(default)s)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="after --, flags for `framework serve` (default model otherwise)")


def run_from_cli(args: argparse.Namespace) -> int:
    """Run, write ``soak.json`` and ``soak.md``, print the report; 0 when it passed."""
    serve_args = [a for a in args.serve_args if a != "--"]
    settings = SoakSettings(duration_s=args.duration, concurrency=args.concurrency,
                            sample_interval_s=args.sample_interval,
                            rss_tolerance=args.rss_tolerance, seed=args.seed,
                            output=args.output, serve_args=serve_args)
    summary = asyncio.run(run_soak(settings))
    settings.output.mkdir(parents=True, exist_ok=True)
    (settings.output / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    report = render_markdown(summary)
    (settings.output / "soak.md").write_text(report)
    print(report)
    return 0 if summary["passed"] else 1
