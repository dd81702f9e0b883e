"""`framework bench latency` and the output-path stamps it reads: a quick run splits the
client's time per token, the Detokenizer stamps its replies, the TokenizerManager sums them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from framework.bench.latency import (
    ROWS,
    Breakdown,
    Counters,
    LatencyBenchResult,
    LatencyBenchSettings,
    StreamTimer,
    run_benchmark,
    settings_from_args,
)
from framework.cli import build_parser
from framework.config import PortArgs, ServerArgs
from framework.default_model import default_model_path
from framework.messages import BatchStrOutput, BatchTokenIDOutput, RequestConstants
from framework.registry import create_transport
from framework.runtime.detokenizer import Detokenizer
from framework.runtime.hf_tokenizer import load_tokenizer
from framework.runtime.output_path import OutputPathStats
from framework.runtime.tokenizer_manager import TokenizerManager

#: The Engine's parts as threads, over inproc: quick to start.
THREADS = {"launch_mode": "thread", "transport": "inproc"}


@pytest.fixture(scope="module")
def quick_run(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
              ) -> LatencyBenchResult:
    """One short run on the tiny checkpoint."""
    settings = dataclasses.replace(LatencyBenchSettings.quick(),
                                   models=(str(tiny_checkpoint("llama", seed=4)),),
                                   output_len=17, repeats=1)
    return run_benchmark(settings, tmp_path_factory.mktemp("latency"), engine_args=THREADS)


def test_a_quick_run_splits_the_client_time_per_token(quick_run: LatencyBenchResult) -> None:
    (model,) = quick_run.models
    best = model.best
    assert len(model.runs) == 1 and best == model.runs[0]
    assert 0 < best.forward_ms < best.step_ms < 1e3
    assert best.scheduler_ms == pytest.approx(best.step_ms - best.forward_ms)
    assert best.between_steps_ms == pytest.approx(best.client_ms - best.step_ms)
    # The default --stream-interval is 2: a text output every other decode token.
    assert 0.25 <= best.outputs_per_token <= 0.75
    assert best.first_token_ms > 0


def test_a_stream_stamps_every_part_of_its_outputs_way(
        tiny_checkpoint: Callable[..., Path]) -> None:
    # Long enough that decode steps still run after the first chunk's counters are read
    # (with nine tokens a fast machine had finished them all by then).
    tokens = 33
    timer = StreamTimer(str(tiny_checkpoint("llama", seed=4)), 1, THREADS)
    try:
        times, counts, decode, whole = timer.stream(tokens)
    finally:
        timer.close()
    # The first token at once, then every 2 (the default --stream-interval), the last.
    assert counts == [0, 1, *range(3, tokens + 1, 2)] and times == sorted(times)
    assert (whole.outputs, whole.extend_steps, whole.decode_steps) == (17, 1, tokens - 1)
    # From the first chunk on: decode steps only (those that ran before the counters'
    # first read are left out, with their outputs).
    assert decode.extend_steps == 0 and 1 <= decode.decode_steps <= tokens - 1
    assert decode.outputs <= 16
    assert 0 < whole.forward_seconds < whole.step_seconds
    for seconds in (whole.scheduler_to_detokenizer_seconds, whole.detokenize_seconds,
                    whole.detokenizer_to_manager_seconds, whole.manager_seconds):
        assert seconds > 0


def test_a_quick_run_writes_the_breakdown_with_machine_and_commit(
        quick_run: LatencyBenchResult) -> None:
    assert sorted(p.name for p in quick_run.paths) == ["latency.json", "latency.md"]
    output_dir = quick_run.paths[0].parent
    report = (output_dir / "latency.md").read_text()
    assert "Machine:" in report and "commit" in report and "float32" in report
    for _, label in ROWS:
        assert label in report
    saved = json.loads((output_dir / "latency.json").read_text())
    assert saved["settings"]["output_len"] == 17 and saved["commit"]
    assert saved["models"][0]["best"]["client_ms"] == quick_run.models[0].best.client_ms


def test_per_token_figures_are_the_counters_growth_over_the_decode_steps() -> None:
    # Counters: step, forward seconds, decode, extend steps, outputs, then the four spans.
    before = Counters(1.0, 0.5, 10, 1, 3, 0.1, 0.2, 0.3, 0.4)
    after = Counters(1.5, 0.8, 20, 1, 8, 0.2, 0.3, 0.5, 0.45)
    # The whole request: 25 decode steps, 15 outputs, twice the output path's time.
    whole = Counters(2.0, 1.0, 25, 1, 15, 0.5, 0.5, 1.0, 0.25)
    run = Breakdown.of(12, 0.72, after - before, whole, 0.02)  # the client: 12 tokens, 60 ms
    assert run.client_ms == pytest.approx(60.0)
    assert (run.step_ms, run.forward_ms, run.scheduler_ms) == pytest.approx((50.0, 30.0, 20.0))
    assert run.between_steps_ms == pytest.approx(10.0)
    # The output path over the whole request's decode steps.
    assert (run.scheduler_to_detokenizer_ms, run.detokenize_ms, run.detokenizer_to_manager_ms,
            run.manager_ms) == pytest.approx((20.0, 20.0, 40.0, 10.0))
    assert run.outputs_per_token == pytest.approx(0.6)
    assert run.first_token_ms == pytest.approx(20.0)
    assert run.non_model_share == pytest.approx(0.5)


def test_the_detokenizer_stamps_its_reply_with_the_outputs_way() -> None:
    detokenizer = Detokenizer(load_tokenizer(default_model_path()))
    batch = BatchTokenIDOutput(handles=np.array([7], dtype=np.int64),
                               output_ids=np.array([65], dtype=np.int32),
                               new_indices=[0], new_constants=[RequestConstants()])
    reply = detokenizer.handle_batch(batch)
    assert reply.token_ids_created_at == batch.created_at
    assert batch.created_at <= reply.detokenizer_received_at <= reply.detokenizer_sent_at


def test_the_output_path_sums_the_spans_between_the_stamps() -> None:
    stats = OutputPathStats()
    msg = BatchStrOutput(handles=[], finished_reasons=[], output_strs=[], output_ids=[],
                         prompt_tokens=[], completion_tokens=[], cached_tokens=[],
                         token_ids_created_at=10.0, detokenizer_received_at=10.5,
                         detokenizer_sent_at=10.75)
    stats.add(msg, received=11.0, applied=11.125)
    unstamped = msgspec.structs.replace(msg, detokenizer_sent_at=0.0)
    stats.add(unstamped, received=20.0, applied=21.0)  # not the Detokenizer's: not counted
    assert stats.info() == {
        "output_path_outputs": 1,
        "output_path_scheduler_to_detokenizer_seconds": 0.5,
        "output_path_detokenize_seconds": 0.25,
        "output_path_detokenizer_to_manager_seconds": 0.25,
        "output_path_manager_seconds": 0.125,
    }


def test_the_tokenizer_manager_counts_each_stamped_text_output() -> None:
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="inproc"), port_args,
                          transport, tokenizer=None)
    try:
        detokenizer = Detokenizer(load_tokenizer(default_model_path()))
        batch = BatchTokenIDOutput(handles=np.array([3], dtype=np.int64),
                                   output_ids=np.array([65], dtype=np.int32),
                                   new_indices=[0], new_constants=[RequestConstants()])
        tm.handle_output(detokenizer.handle_batch(batch))
        assert tm.output_path.outputs == 1
        assert tm.output_path.detokenize_seconds > 0
    finally:
        for replica in tm.replicas:
            replica.close()
        port_args.cleanup()


def test_cli_flags_pick_models_and_engine_arguments() -> None:
    args = build_parser().parse_args(
        ["bench", "latency", "--quick", "--models", "default,/some/dir", "--output-len", "32",
         "--codec", "msgpack"])
    settings = settings_from_args(args)
    assert settings.models == ("default", "/some/dir")
    assert settings.output_len == 32 and settings.hidden == LatencyBenchSettings.quick().hidden
    assert args.codec == "msgpack"
    with pytest.raises(ValueError, match="output_len"):
        dataclasses.replace(settings, output_len=1).check()
