"""Where a benchmark ran (the machine and the commit, written next to every result), how
it writes its results, and the throughput of greedy requests through an Engine."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from framework.cpuinfo import cpuinfo_fields


def machine_description() -> str:
    """Platform, CPU model and logical CPU count of this machine."""
    model = cpuinfo_fields("model name").get("model name") or platform.processor() \
        or platform.machine()
    return f"{platform.platform()}, {model}, {os.cpu_count()} logical CPUs"


def git_commit() -> str:
    """The commit of the checkout this package runs from (``-dirty`` if changed), or ``unknown``.

    Changes under ``benchmarks/results/`` do not count: a run rewrites its own kept
    results before it names the commit.
    """
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                  "--untracked-files=no", "--", ".",
                                  ":(exclude)benchmarks/results"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if changed else commit


def run_stamp() -> dict[str, str]:
    """The machine, the commit and the time (UTC) of a run starting now."""
    started = datetime.datetime.now(datetime.timezone.utc)
    return {"machine": machine_description(), "commit": git_commit(),
            "started_at": started.strftime("%Y-%m-%d %H:%M:%S UTC")}


def write_results(output: str | Path, stem: str, record: dict[str, Any],
                  markdown: str) -> list[Path]:
    """``stem.json`` (``record``) and ``stem.md`` (``markdown``) in ``output``, made if
    needed; returns both paths."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(record, indent=2) + "\n")
    paths[1].write_text(markdown)
    return paths


def greedy_tokens_per_second(engine: Any, prompts: list[str], streams: int,
                             output_len: int) -> float:
    """Output tokens/s of greedy ``prompts`` through ``engine``, ``streams`` at a time."""
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    started = time.perf_counter()
    tokens = 0
    for first in range(0, len(prompts), streams):
        outputs = engine.generate(prompts[first:first + streams], params)
        tokens += sum(len(out["output_ids"]) for out in outputs)
    return tokens / (time.perf_counter() - started)
