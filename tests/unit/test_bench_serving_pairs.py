"""The transport × codec serving summary (benchmarks/run_serving_pairs.sh), from fake results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.bench.serving_pairs import (
    SUMMARY_NAME,
    load_pairs,
    load_skipped,
    main,
    offline_engine_throughput,
    split_pair_name,
    summarize_dir,
)


def fake_summary(output_tps: float, request_tps: float, ttft_p50: float) -> dict[str, object]:
    """The fields of a `framework bench serving` NAME.json that the summary reads."""
    return {
        "output_throughput": output_tps, "request_throughput": request_tps,
        "ttft_ms": {"mean": ttft_p50, "p50": ttft_p50, "p90": ttft_p50 * 2,
                    "p99": ttft_p50 * 3},
        "tpot_ms": {"mean": 20.0, "p50": 19.5, "p90": 25.0, "p99": 30.0},
        "completed": 64, "requests": 64, "machine": "test machine, 2 logical CPUs",
        "commit": "abc1234", "started_at": "2026-12-01 06:00:00 UTC",
        "settings": {"num_prompts": 64, "input_len": 92, "output_len": 48,
                     "max_concurrency": 64},
    }


def write_json(path: Path, data: object) -> None:
    """``data`` as JSON at ``path``."""
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A results directory: three pairs (one in threads), one skipped, and stray files."""
    write_json(tmp_path / "shm-json.json", fake_summary(1500.0, 30.0, 400.0))
    write_json(tmp_path / "zmq-pickle.json", fake_summary(2000.0, 40.0, 300.0))
    write_json(tmp_path / "zmq-pickle.server.json", {"transport": "zmq", "codec": "pickle",
                                                     "launch_mode": "process"})
    write_json(tmp_path / "inproc-msgpack.json", fake_summary(1000.0, 20.0, 500.0))
    write_json(tmp_path / "inproc-msgpack.server.json",
               {"transport": "inproc", "codec": "msgpack", "launch_mode": "thread"})
    (tmp_path / "zmq-pickle.jsonl").write_text("{}\n", encoding="utf-8")
    (tmp_path / "shm-pickle.skipped.txt").write_text("ValueError: no shm here\n",
                                                     encoding="utf-8")
    return tmp_path


def test_split_pair_name() -> None:
    assert split_pair_name("zmq-pickle") == ("zmq", "pickle")
    with pytest.raises(ValueError):
        split_pair_name("serving")


def test_pairs_are_read_in_the_script_order(results: Path) -> None:
    pairs = load_pairs(results)
    assert [(p.transport, p.codec) for p in pairs] == [
        ("zmq", "pickle"), ("shm", "json"), ("inproc", "msgpack")]
    assert pairs[0].output_throughput == 2000.0
    assert pairs[0].ttft_p99_ms == 900.0
    assert pairs[2].launch_mode == "thread"
    assert load_skipped(results) == {("shm", "pickle"): "ValueError: no shm here"}


def test_offline_engine_row(tmp_path: Path) -> None:
    csv_path = tmp_path / "offline.csv"
    assert offline_engine_throughput(csv_path) is None
    csv_path.write_text("side,output_tokens_per_s,best_seconds\n"
                        "transformers,1000.0,3.0\nengine,2500.0,1.2\n", encoding="utf-8")
    assert offline_engine_throughput(csv_path) == 2500.0


def test_summary_table_with_offline_share(results: Path, tmp_path_factory: pytest.TempPathFactory
                                          ) -> None:
    csv_path = tmp_path_factory.mktemp("offline") / "offline.csv"
    csv_path.write_text("side,output_tokens_per_s\nengine,2500.0\n", encoding="utf-8")
    text = summarize_dir(results, csv_path).read_text(encoding="utf-8")
    assert "test machine, 2 logical CPUs" in text and "abc1234" in text
    assert "2,500.0 output tokens/s" in text
    assert "| transport | codec | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) " \
           "| TPOT p50 (ms) | completed | % of offline Engine |" in text
    assert "| zmq | pickle | 2,000.0 | 40.00 | 300.0 | 900.0 | 19.5 | 64/64 | 80% |" in text
    assert "| inproc (threads) | msgpack | 1,000.0 | 20.00 | 500.0 | 1,500.0 | 19.5 | 64/64 " \
           "| 40% |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| zmq", "| shm", "| inproc (threads)"]
    assert "- shm × pickle: ValueError: no shm here" in text


def test_summary_without_offline_csv(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", str(results), "--offline-csv", str(results / "missing.csv")]) == 0
    text = (results / SUMMARY_NAME).read_text(encoding="utf-8")
    assert capsys.readouterr().out == text
    assert "% of offline" not in text and "Offline Engine" not in text
    assert "| shm | json | 1,500.0 | 30.00 | 400.0 | 1,200.0 | 19.5 | 64/64 |" in text
