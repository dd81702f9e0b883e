"""``framework bench soak``: its verdict rules, and a short run against a tiny model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.bench.soak import add_cli_args, render_markdown, rss_growth, run_from_cli
from tests.model_fixtures import make_tiny_checkpoint


def test_rss_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    samples = [{"t": 0.0, "rss": {"1": 100, "2": 50}},
               {"t": 10.0, "rss": {"1": 200, "2": 100}},  # the warm-up ends at 10% of 100 s
               {"t": 100.0, "rss": {"1": 210, "2": 150}}]
    growth = rss_growth(samples, duration_s=100.0)
    assert growth == {"1": 210 / 200 - 1, "2": 150 / 100 - 1}


def test_a_short_soak_passes_and_writes_its_report(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "llama", seed=1)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--duration", "2", "--concurrency", "2", "--sample-interval",
                              "0.5", "--rss-tolerance", "10", "--output", str(tmp_path / "out"),
                              "--", "--model-path", str(model)])
    assert run_from_cli(args) == 0
    summary = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert summary["passed"] and summary["error_count"] == 0
    assert summary["kv_cache_idle_and_free"] is True and summary["server_exit_code"] == 0
    assert summary["total_requests"] > 0
    assert "scheduler" in summary["process_roles"].values()
    assert len(summary["rss_samples"]) >= 2
    assert (tmp_path / "out" / "soak.md").read_text() == render_markdown(summary)


@pytest.mark.parametrize(("flags", "words"), [
    (["--duration", "-1"], "--duration must be above 0 s"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--sample-interval", "0"], "--sample-interval must be above 0 s"),
    (["--rss-tolerance", "-1"], "--rss-tolerance must be at least 0"),
    (["--duration", "1", "--", "--port", "70000"], "the server exited with 2 while starting"),
])
def test_a_soak_that_could_show_nothing_is_a_one_line_error(flags: list[str],
                                                            words: str) -> None:
    result = subprocess.run([sys.executable, "-m", "framework.cli", "bench", "soak", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"framework: error: {words}")
    assert "Traceback" not in result.stderr
