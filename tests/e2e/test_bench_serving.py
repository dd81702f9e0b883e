"""``framework bench serving`` against a real server on a tiny model, and its summary math.

The runs check that every value is consistent (token counts, TTFT within the
request, one record per request), never how fast anything was.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from framework.bench.serving import (
    RequestRecord,
    ServingBenchSettings,
    TokenCalibration,
    build_prompts,
    chunk_token_counts,
    finish_record,
    percentile,
    run_benchmark,
    summarize,
)
from framework.cli import main
from framework.comm.zmq import free_tcp_port
from tests.server_harness import ServerProcess

RECORD_FIELDS = {
    "index", "group", "input_len", "output_len", "success", "error", "prompt_tokens",
    "completion_tokens", "cached_tokens", "sent_at_s", "ttft_s", "e2e_s", "tpot_s",
    "chunk_times_s", "chunk_tokens", "itl_s",
}


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_consistent(records: list[dict[str, Any]], summary: dict[str, Any], n: int) -> None:
    """Every request succeeded and the records and the summary agree with each other."""
    assert [r["index"] for r in records] == list(range(n))
    assert summary["requests"] == summary["completed"] == n and summary["failed"] == 0
    for r in records:
        assert set(r) == RECORD_FIELDS
        assert r["success"] and r["error"] is None, r
        assert r["completion_tokens"] == r["output_len"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
        assert sum(r["chunk_tokens"]) == r["completion_tokens"]
        assert len(r["itl_s"]) == len(r["chunk_times_s"]) - 1
        assert r["prompt_tokens"] > 0
    assert summary["input_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert summary["output_tokens"] == sum(r["completion_tokens"] for r in records)
    assert summary["target_output_tokens"] == summary["output_tokens"]
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        stats = summary[metric]
        assert stats["p50"] <= stats["p90"] <= stats["p99"], metric


def test_poisson_arrivals_under_a_concurrency_bound(server: ServerProcess, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "serving", "--base-url", server.base_url, "--num-prompts", "8",
                   "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
                   "--request-rate", "50", "--max-concurrency", "4", "--output", str(tmp_path),
                   "--run-name", "rate", "--plot", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert {p.name for p in tmp_path.iterdir()} == {
        "rate.jsonl", "rate.json", "rate.md", "rate.png"}
    summary = json.loads((tmp_path / "rate.json").read_text())
    check_consistent(read_records(tmp_path / "rate.jsonl"), summary, 8)
    assert summary["model"] == "tiny" and summary["stream_interval"] == 2
    split = summary["scheduler_time"]  # read from the server's /get_server_info
    assert 0 < split["forward_s"] < split["step_s"]
    assert 1 <= summary["max_in_flight"] <= 4
    assert summary["settings"]["request_rate"] == 50
    assert "8 completed, 0 failed" in out and "TTFT" in out
    markdown = (tmp_path / "rate.md").read_text()
    assert "Client machine:" in markdown and "commit" in markdown


def test_shared_prefix_groups(server: ServerProcess, tmp_path: Path) -> None:
    settings = ServingBenchSettings(
        base_url=f"{server.base_url}/v1", num_prompts=8, input_len=16, output_len=8,
        shared_prefix_groups=2, shared_prefix_len=48, max_concurrency=4, output=str(tmp_path),
        progress=False)
    summary, written = run_benchmark(settings)
    assert [p.name for p in written] == ["serving.jsonl", "serving.json", "serving.md"]
    records = read_records(tmp_path / "serving.jsonl")
    check_consistent(records, json.loads((tmp_path / "serving.json").read_text()), 8)
    assert [r["group"] for r in records] == [0, 1] * 4
    assert all(r["input_len"] == 16 + 48 for r in records)
    assert summary["settings"]["request_rate"] == math.inf  # all at once


def test_a_run_limit_counts_the_requests_it_cut_off(server: ServerProcess,
                                                    tmp_path: Path) -> None:
    # One request a second and 0.3 s for the run: the later ones are never sent.
    status = main(["bench", "serving", "--base-url", server.base_url, "--num-prompts", "4",
                   "--input-len", "8", "--output-len", "4", "--request-rate", "1",
                   "--max-duration", "0.3", "--output", str(tmp_path), "--no-progress"])
    assert status == 1
    summary = json.loads((tmp_path / "serving.json").read_text())
    records = read_records(tmp_path / "serving.jsonl")
    assert len(records) == 4 and summary["hit_run_limit"] is True
    assert summary["completed"] + summary["failed"] == 4 and summary["failed"] >= 1
    failed = [r for r in records if not r["success"]]
    assert all("run limit of 0.3 s" in r["error"] for r in failed)
    assert sum(summary["errors"].values()) == summary["failed"]


def test_an_unreachable_url_is_a_clear_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    port = free_tcp_port()  # nothing listens there
    status = main(["bench", "serving", "--base-url", f"http://127.0.0.1:{port}",
                   "--output", str(tmp_path), "--no-progress"])
    assert status == 2
    assert f"cannot reach http://127.0.0.1:{port}/v1/models" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.timeout(60)  # a liveness bound: the error must come, not a hang
def test_a_server_that_never_answers_times_out(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listener:  # connections queue in the backlog, nobody reads them
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        status = main(["bench", "serving", "--base-url", f"http://127.0.0.1:{port}",
                       "--request-timeout", "0.5", "--output", str(tmp_path), "--no-progress"])
    assert status == 2
    assert "did not answer within 0.5 s" in capsys.readouterr().err


def made_up_record(index: int, chunks: list[float], tokens: int, e2e: float,
                   prompt_tokens: int = 10) -> RequestRecord:
    record = RequestRecord(index, None, input_len=prompt_tokens, output_len=tokens,
                           prompt_tokens=prompt_tokens, completion_tokens=tokens,
                           cached_tokens=1, chunk_times_s=chunks, e2e_s=e2e)
    finish_record(record, interval=2)
    return record


def test_percentiles_and_summary_of_made_up_records() -> None:
    values = [0.4, 0.1, 0.3, 0.2, 1.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5

    assert chunk_token_counts(4, 7, 2) == [1, 2, 2, 2]  # the first token alone
    assert chunk_token_counts(4, 6, 2) == [1, 2, 2, 1]
    assert chunk_token_counts(4, 8, 2) == [2, 2, 2, 2]  # interval tokens from the start
    assert chunk_token_counts(3, 10, 2) == [4, 3, 3]  # neither pattern: spread

    # The first token at 0.1 s, then chunks of 2 tokens at 0.3, 0.7 and 0.8 s.
    a = made_up_record(0, [0.1, 0.3, 0.7, 0.8], tokens=7, e2e=1.0)
    assert a.success and a.chunk_tokens == [1, 2, 2, 2]
    assert a.ttft_s == 0.1 and a.tpot_s == pytest.approx(0.9 / 6)
    assert a.itl_s == pytest.approx([0.1, 0.2, 0.05])
    b = made_up_record(1, [0.2, 0.4], tokens=4, e2e=0.5, prompt_tokens=20)
    assert b.itl_s == pytest.approx([0.1])
    no_usage = RequestRecord(2, None, input_len=5, output_len=4, chunk_times_s=[0.1], e2e_s=0.2)
    finish_record(no_usage, interval=2)
    refused = RequestRecord(3, None, input_len=5, output_len=4, error="HTTP 400: too long")
    finish_record(refused, interval=2)

    summary = summarize([a, b, no_usage, refused], duration_s=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert summary["errors"] == {
        "no usage in the stream (stream_options.include_usage unsupported?)": 1,
        "HTTP 400: too long": 1}
    assert (summary["input_tokens"], summary["output_tokens"]) == (30, 11)
    assert summary["cached_tokens"] == 2 and summary["short_outputs"] == 0
    assert summary["request_throughput"] == 1.0
    assert summary["input_throughput"] == 15.0 and summary["output_throughput"] == 5.5
    assert summary["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert summary["e2e_ms"]["p90"] == pytest.approx(950.0)
    # ITL per token: 0.1 s for 2 + 2 tokens, 0.2 s for 2 tokens, 0.05 s for 2 tokens.
    assert summary["itl_ms"]["mean"] == pytest.approx(1000 * (0.1 * 4 + 0.2 * 2 + 0.05 * 2) / 8)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(1000 * (0.9 / 6 + 0.3 / 3) / 2)

    empty = summarize([refused], duration_s=1.0)
    assert empty["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_prompts_share_their_group_prefix_and_repeat_with_the_seed() -> None:
    settings = ServingBenchSettings(num_prompts=6, input_len=20, range_ratio=0.5,
                                    shared_prefix_groups=3, shared_prefix_len=40)
    calibration = TokenCalibration(tokens_per_word=2.0, extra_tokens=1.0)
    prompts = build_prompts(settings, calibration)
    assert prompts == build_prompts(settings, calibration)
    prefix_words = 20  # 40 tokens at 2 tokens a word
    prefixes = [" ".join(p.text.split()[:prefix_words]) for p in prompts]
    assert prefixes[:3] == prefixes[3:] and len(set(prefixes)) == 3
    assert [p.group for p in prompts] == [0, 1, 2, 0, 1, 2]
    for p in prompts:
        assert 40 + 10 <= p.input_len <= 40 + 20
        # The words make the target length, the server's added token included.
        assert abs(1 + 2 * len(p.text.split()) - p.input_len) <= 2
