"""Time ``framework serve`` from launch to its first healthy answer, and from SIGTERM to exit.

Starts the server on the embedded default model (or ``--model-path``) ``--runs``
times, one after the other, and reports for each process of the server (the
HTTP process, the Scheduler, the Detokenizer) its resident memory once healthy
and whether it loaded torch. Writes ``startup.json`` and ``startup.md``
(machine, commit) to ``--output`` (default ``benchmarks/results/startup``)::

    python benchmarks/bench_startup.py
    python benchmarks/bench_startup.py --runs 3 --output /tmp/startup

Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from framework.bench.environment import git_commit, machine_description
from framework.bench.soak import process_tree, rss_bytes

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, but Python's resource tracker."""
    return [child for child in process_tree(pid)[1:]
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()]


def process_facts(pid: int) -> dict[str, Any]:
    """Resident memory (MiB) and whether torch's library is mapped."""
    return {"rss_mib": round((rss_bytes(pid) or 0) / 2**20, 1),
            "torch_loaded": "libtorch" in Path(f"/proc/{pid}/maps").read_text()}


def one_run(model_args: list[str]) -> dict[str, Any]:
    """Start a server, wait for /health, note its processes, stop it; the times in seconds."""
    port = free_port()
    command = [sys.executable, "-m", "framework.cli", "serve", "--port", str(port),
               "--log-level", "warning", *model_args]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        start_s = time.monotonic() - started
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
        scheduler = info["scheduler"]["pid"]
        roles = {proc.pid: "http"}
        for pid in children(proc.pid):
            roles[pid] = "scheduler" if pid == scheduler else "detokenizer"
        processes = {role: process_facts(pid) for pid, role in roles.items()}
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stop_s = time.monotonic() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        raise RuntimeError(f"the server exited with {code} after SIGTERM")
    return {"start_s": round(start_s, 3), "stop_s": round(stop_s, 3), "processes": processes}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    starts = [run["start_s"] for run in runs]
    stops = [run["stop_s"] for run in runs]
    return {"start_median_s": round(statistics.median(starts), 3),
            "start_min_s": min(starts), "stop_median_s": round(statistics.median(stops), 3),
            "processes": runs[-1]["processes"]}


def markdown(result: dict[str, Any]) -> str:
    stats = result["summary"]
    lines = [
        "# Server start-up and shutdown",
        "",
        f"- Machine: {result['machine']}",
        f"- Python {result['python']}, commit {result['commit']}",
        f"- Run: {result['date']}",
        f"- `framework serve` on {result['model']}, {len(result['runs'])} runs one after "
        "the other; start = launch to the first 200 from `/health`, stop = SIGTERM to exit",
        "",
        "| | median s | best s | runs (s) |",
        "|---|---:|---:|---|",
        f"| start | {stats['start_median_s']:.2f} | {stats['start_min_s']:.2f} | "
        + ", ".join(f"{run['start_s']:.2f}" for run in result["runs"]) + " |",
        f"| stop | {stats['stop_median_s']:.2f} | "
        f"{min(run['stop_s'] for run in result['runs']):.2f} | "
        + ", ".join(f"{run['stop_s']:.2f}" for run in result["runs"]) + " |",
        "",
        "| process | resident MiB (healthy, idle) | torch loaded |",
        "|---|---:|---|",
    ]
    for role, facts in stats["processes"].items():
        lines.append(f"| {role} | {facts['rss_mib']:.0f} | "
                     f"{'yes' if facts['torch_loaded'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="model directory (default: the embedded model)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/startup")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    model_args = ["--model-path", args.model_path] if args.model_path else []
    runs = []
    for index in range(args.runs):
        runs.append(one_run(model_args))
        print(f"run {index + 1}/{args.runs}: start {runs[-1]['start_s']:.2f} s, "
              f"stop {runs[-1]['stop_s']:.2f} s", flush=True)
    result = {
        "machine": machine_description(), "python": platform.python_version(),
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model_path or "the embedded default model", "runs": runs,
        "summary": summary(runs),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.output / "startup.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
