"""The transport benchmark harness: sample messages, measured rows, written files, the CLI path."""

from __future__ import annotations

import csv
import multiprocessing
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from framework.bench import transport as bench
from framework.bench.messages import SAMPLE_MESSAGES, build_sample
from framework.cli import main as cli_main
from framework.comm.codec import Buffer, MsgpackCodec
from framework.messages import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    Message,
    TokenizedGenerateReqInput,
)
from framework.registry import Registry, create_codec
from tests.message_strategies import same

REPO_ROOT = Path(__file__).resolve().parents[2]


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


# --------------------------------------------------------------------------- sample messages


@pytest.mark.parametrize("name,batch", [("token_ids@1", 1), ("token_ids@64", 64),
                                        ("token_ids@256", 256)])
def test_token_id_batches_look_like_a_decode_step(name: str, batch: int) -> None:
    msg = build_sample(name)
    assert isinstance(msg, BatchTokenIDOutput)
    # Requests are named by handle (a TokenizerManager's counter), not by rid strings.
    assert msg.handles.dtype == np.int64 and len(msg.handles) == batch
    assert all(h >= 1 for h in msg.handles.tolist()) and len(set(msg.handles.tolist())) == batch
    assert msg.output_ids.dtype == np.int32 and len(msg.output_ids) == batch
    assert msg.output_offsets is None  # one new token each: no offsets needed
    assert msg.id_lists() == [[i] for i in msg.output_ids.tolist()]
    busy = batch >= 64  # one request finishes and another sends its first output
    assert len(msg.finished_indices) == len(msg.finished_reasons) == int(busy)
    assert len(msg.new_indices) == len(msg.new_constants) == int(busy)
    for constants in msg.new_constants:
        assert 100 <= constants.prompt_tokens < 1000
        assert 0 <= constants.cached_tokens <= constants.prompt_tokens
        assert len(constants.context_ids) == 5
    assert set(msg.finished_indices).isdisjoint(msg.new_indices)
    assert msg.output_token_logprobs is None


def test_generate_request_has_8192_tokens_and_matching_text() -> None:
    msg = build_sample("generate_req@8192")
    assert isinstance(msg, TokenizedGenerateReqInput)
    assert len(msg.input_ids) == 8192
    assert len(msg.input_text.split()) == 8192
    assert re.fullmatch(r"[0-9a-f]{32}", msg.rid)


def test_embedding_batch_is_256_unit_float32_rows() -> None:
    msg = build_sample("embedding@256x1024")
    assert isinstance(msg, BatchEmbeddingOutput)
    assert len(msg.embeddings) == len(msg.rids) == len(msg.prompt_tokens) == 256
    rows = msg.embeddings
    assert rows.dtype == np.float32 and rows.shape == (256, 1024)
    np.testing.assert_allclose(np.linalg.norm(rows.astype(np.float64), axis=1), 1.0, rtol=1e-5)


def test_samples_are_reproducible() -> None:
    for name in SAMPLE_MESSAGES:
        assert same(build_sample(name), build_sample(name)), name


@pytest.mark.parametrize("codec_name", ["pickle", "msgpack", "json"])
def test_every_sample_round_trips_through_every_codec(codec_name: str) -> None:
    codec = create_codec(codec_name)
    for name in SAMPLE_MESSAGES:
        msg = build_sample(name)
        assert same(codec.decode(codec.encode(msg)), msg), name


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown message 'token_ids@3'.*token_ids@1"):
        bench.BenchSettings.create(messages=["token_ids@3"])
    with pytest.raises(ValueError, match=r"unknown codec 'yaml'.*raw"):
        bench.BenchSettings.create(codecs=["yaml"])
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        bench.BenchSettings.create(transports=["carrier-pigeon"])
    with pytest.raises(ValueError, match="--seconds must be > 0"):
        bench.BenchSettings.create(seconds=0)
    assert cli_main(["bench", "transport", "--messages", "nope"]) == 2


# --------------------------------------------------------------------------- measuring


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Temporary directories of the run go here, so the test sees what is left behind.

    A short path of its own under the system's temporary directory, not under
    ``tmp_path``: the run's ipc:// socket paths must fit in 107 bytes, and
    ``tmp_path`` can be long (under pytest-xdist, for one).
    """
    tmp = Path(tempfile.mkdtemp(prefix="fw-bench-"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_run_measures_every_pair_and_cleans_up(tmp_path: Path, private_tmp: Path) -> None:
    settings = bench.BenchSettings.create(transports=["zmq", "inproc"], codecs=["msgpack", "raw"],
                                          messages=["token_ids@1"], seconds=0.05, quick=True)
    lines: list[str] = []
    out = tmp_path / "out"
    results = bench.run_benchmark(settings, out, progress=lines.append)

    assert results.failed == [] and results.skipped == []
    header, rows = _read_csv(out / "transport.csv")
    assert header == ["transport", "codec", "message", "msgs_per_s", "mb_per_s", "p50_us",
                      "p99_us"]
    assert [(r["transport"], r["codec"], r["message"]) for r in rows] == [
        ("zmq", "msgpack", "token_ids@1"), ("zmq", "raw", "token_ids@1"),
        ("inproc", "msgpack", "token_ids@1"), ("inproc", "raw", "token_ids@1"),
    ]
    encoded_bytes = sum(len(f) for f in MsgpackCodec().encode(build_sample("token_ids@1")))
    for row in rows:
        rate, mb, p50, p99 = (float(row[c]) for c in ("msgs_per_s", "mb_per_s", "p50_us",
                                                      "p99_us"))
        assert rate > 0 and p50 > 0 and p99 >= p50, row
        # Raw rows send the msgpack frames, so both carry the same bytes per message.
        assert mb == pytest.approx(rate * encoded_bytes / 1e6, rel=1e-2, abs=2e-3), row

    header, codec_rows = _read_csv(out / "codec.csv")
    assert header == ["codec", "message", "encode_us", "decode_us", "bytes"]
    assert [(r["codec"], r["message"], int(r["bytes"])) for r in codec_rows] == [
        ("msgpack", "token_ids@1", encoded_bytes)]
    assert float(codec_rows[0]["encode_us"]) > 0 and float(codec_rows[0]["decode_us"]) > 0

    table = (out / "transport.md").read_text(encoding="utf-8")
    assert "Machine:" in table and "commit" in table
    assert "| zmq | raw | token_ids@1 |" in table and "| msgpack | token_ids@1 |" in table
    assert (out / "transport.png").read_bytes().startswith(b"\x89PNG")
    assert len(lines) == 1 + 4  # one codec row, four transport rows

    assert multiprocessing.active_children() == []
    assert not any(t.name.startswith("bench-receiver") for t in threading.enumerate())
    assert list(private_tmp.glob("framework-bench-*")) == []


def test_a_transport_that_cannot_load_is_skipped(
    tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    transports: Registry[object] = Registry("transport", "framework.tests.no-such-group")
    transports.register("missing", "framework.comm.no_such_module:MissingTransport")
    transports.register("inproc", "framework.comm.inproc:InprocTransport")
    monkeypatch.setattr(bench, "TRANSPORTS", transports)
    settings = bench.BenchSettings.create(codecs=["raw"], messages=["token_ids@1"], seconds=0.02)

    results = bench.run_benchmark(settings, tmp_path / "out", progress=lambda line: None)

    assert [s.split(":")[0] for s in results.skipped] == ["missing"]
    assert [(r.transport, r.codec) for r in results.transport_rows] == [("inproc", "raw")]
    assert "skipping transport 'missing'" in capsys.readouterr().err


class _FailsInReceiverCodec(MsgpackCodec):
    """msgpack that cannot decode off the main thread: the inproc receiver dies on a message."""

    name = "fails-in-receiver"

    def decode(self, frames: Sequence[Buffer]) -> Message:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("decoding refused in the receiver")
        return super().decode(frames)


def test_a_receiver_that_dies_fails_its_transport_without_hanging(
    tmp_path: Path, private_tmp: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    codecs: Registry[object] = Registry("codec", "framework.tests.no-such-group")
    codecs.register("fails-in-receiver", _FailsInReceiverCodec)
    codecs.register("msgpack", MsgpackCodec)  # the raw rows' frames
    monkeypatch.setattr(bench, "CODECS", codecs)
    monkeypatch.setattr(bench, "create_codec", lambda name: codecs.get(name)())
    settings = bench.BenchSettings.create(transports=["inproc"], codecs=["fails-in-receiver"],
                                          messages=["token_ids@1"], seconds=0.02)

    results = bench.run_benchmark(settings, tmp_path / "out", progress=lambda line: None)

    assert len(results.failed) == 1 and results.failed[0].startswith("inproc:")
    assert results.transport_rows == []
    assert [r.codec for r in results.codec_rows] == ["fails-in-receiver"]
    _, rows = _read_csv(tmp_path / "out" / "transport.csv")
    assert rows == []
    assert list(private_tmp.glob("framework-bench-*")) == []


def test_cli_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "framework.cli", "bench", "transport", "--quick", "--transports",
         "inproc", "--codecs", "msgpack", "--messages", "token_ids@1", "--output", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _, rows = _read_csv(out / "transport.csv")
    assert [(r["transport"], r["codec"], r["message"]) for r in rows] == [
        ("inproc", "msgpack", "token_ids@1")]
    assert float(rows[0]["msgs_per_s"]) > 0
    assert re.search(r"inproc\s+msgpack\s+token_ids@1\s+[\d,]+ msg/s", done.stdout)
    assert {p.name for p in out.iterdir()} == {"transport.csv", "transport.md", "codec.csv",
                                               "transport.png"}
