"""Where a benchmark ran: the machine and the commit, written next to every result."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

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
