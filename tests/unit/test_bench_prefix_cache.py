"""`framework bench prefix-cache`: a quick run writes its results, cache on and off."""

from __future__ import annotations

import csv
from pathlib import Path

from framework.bench.prefix_cache import PrefixBenchRow, PrefixBenchSettings, run_benchmark
from framework.cli import build_parser


def test_quick_run_writes_both_measurements_with_the_cache_on_and_off(tmp_path: Path) -> None:
    settings = PrefixBenchSettings.quick()
    paths = run_benchmark(settings, tmp_path,
                          engine_args={"launch_mode": "thread", "transport": "inproc"})
    assert sorted(p.name for p in paths) == ["prefix_cache.csv", "prefix_cache.md"]
    with (tmp_path / "prefix_cache.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(PrefixBenchRow.__dataclass_fields__)
    by_key = {(r["measurement"], r["radix_cache"]): r for r in rows}
    assert set(by_key) == {("ttft", "True"), ("ttft", "False"), ("throughput", "True"),
                           ("throughput", "False")}
    # With the cache the measured request reuses the whole shared prefix; without, nothing.
    assert int(by_key["ttft", "True"]["cached_tokens"]) == settings.prefix
    assert int(by_key["ttft", "False"]["cached_tokens"]) == 0
    shared_by_others = (settings.requests - 1) * settings.throughput_prefix
    assert int(by_key["throughput", "True"]["cached_tokens"]) >= shared_by_others
    assert int(by_key["throughput", "False"]["cached_tokens"]) == 0
    assert all(float(r["seconds"]) > 0 for r in rows)
    report = (tmp_path / "prefix_cache.md").read_text()
    assert "Machine:" in report and "commit" in report and "faster" in report


def test_cli_knows_the_benchmark() -> None:
    args = build_parser().parse_args(["bench", "prefix-cache", "--quick", "--output", "x"])
    assert args.quick and args.output == "x"
