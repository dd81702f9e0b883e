"""``benchmarks/bench_startup.py`` runs as documented and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_start_of_the_default_model_is_timed_and_described(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_startup.py"),
                           "--runs", "1", "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "startup.json").read_text())
    [run] = result["runs"]
    assert run["start_s"] > 0 and run["stop_s"] > 0
    processes = result["summary"]["processes"]
    assert set(processes) == {"http", "scheduler", "detokenizer"}
    assert {role: facts["torch_loaded"] for role, facts in processes.items()} == {
        "http": False, "scheduler": True, "detokenizer": False}
    assert all(facts["rss_mib"] > 0 for facts in processes.values())
    table = (tmp_path / "startup.md").read_text()
    assert result["commit"] in table and "| start |" in table and "| stop |" in table
