"""``--dp-size 2`` through the Engine: two scheduler replicas behind one TokenizerManager.

Both balance methods must give the greedy tokens of one replica and hand
requests to both replicas; the shm transport gets one ring per replica; a
replica that dies takes the Engine down with its name and leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from framework import Engine
from framework.model_executor import model_runner
from framework.runtime.launch import torch_threads_per_rank, usable_cores
from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import own_children

PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(20)]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
QUIET = {"log_level": "warning"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dp"), "llama", seed=11)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """One replica's greedy tokens for every prompt."""
    with Engine(model_path=str(model_dir), launch_mode="thread", **QUIET) as engine:
        return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def run_dp(model_dir: Path, prompts: list[str], **kwargs: Any) -> dict[str, Any]:
    """Outputs, server info and ready messages of a two-replica Engine."""
    with Engine(model_path=str(model_dir), dp_size=2, **QUIET, **kwargs) as engine:
        outputs = engine.generate(prompts, GREEDY)
        return {"outputs": [o["output_ids"] for o in outputs],
                "info": engine.get_server_info(),
                "ready": dict(engine.components.scheduler_infos),
                "addresses": [p.scheduler_input for p in engine.components.replica_port_args]}


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue"])
def test_two_replicas_give_one_replica_s_tokens_and_both_serve(
    model_dir: Path, reference: list[list[int]], method: str,
) -> None:
    run = run_dp(model_dir, PROMPTS, load_balance_method=method)
    assert run["outputs"] == reference
    info = run["info"]
    assert info["dp_size"] == 2 and info["load_balance_method"] == method
    assert info["kv_cache_idle_and_free"] is True, info
    replicas = info["replicas"]
    assert [r["replica"] for r in replicas] == [0, 1]
    assert replicas[0]["pid"] != replicas[1]["pid"]  # two scheduler processes
    for replica in replicas:
        assert replica["load"]["routed_requests"] > 0, replicas
        assert replica["extend_steps"] > 0, replicas  # it ran prefills itself
        assert replica["load"]["in_flight_requests"] == 0
        assert replica["kv_cache_idle_and_free"] is True
    assert sum(r["load"]["routed_requests"] for r in replicas) == len(PROMPTS)
    if method == "round_robin":
        assert [r["load"]["routed_requests"] for r in replicas] == [10, 10]
    # The cores are shared by every scheduler process of every replica.
    threads = torch_threads_per_rank(usable_cores(), 2)
    assert [run["ready"][k]["torch_threads"] for k in sorted(run["ready"])] == [threads] * 2


def test_thread_mode_over_inproc(model_dir: Path, reference: list[list[int]]) -> None:
    run = run_dp(model_dir, PROMPTS[:4], launch_mode="thread")
    assert run["outputs"] == reference[:4]
    assert [r["load"]["routed_requests"] for r in run["info"]["replicas"]] == [2, 2]


def test_shm_gives_each_replica_its_own_rings(model_dir: Path,
                                              reference: list[list[int]]) -> None:
    run = run_dp(model_dir, PROMPTS[:4], transport="shm")
    assert run["outputs"] == reference[:4]
    assert len(set(run["addresses"])) == 2  # a ring has one producer: never shared


def _fails_in_thread(thread_name: str, path: Path,
                     load: Callable[..., None]) -> Callable[..., None]:
    """``load`` (``load_weights(model, model_path, ...)``), except that the thread
    ``thread_name`` fails to read the weights at ``path``."""
    def maybe_load(model: Any, model_path: str, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == thread_name and model_path == str(path):
            raise OSError("this replica's disk failed on purpose")
        load(model, model_path, *args, **kwargs)

    return maybe_load


def test_flush_and_weight_updates_reach_every_replica(model_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    other = make_tiny_checkpoint(tmp_path, "llama", seed=12)  # same shapes, other weights
    with Engine(model_path=str(other), launch_mode="thread", **QUIET) as engine:
        other_reference = [o["output_ids"] for o in engine.generate(PROMPTS[:4], GREEDY)]
    with Engine(model_path=str(model_dir), dp_size=2, launch_mode="thread", **QUIET) as engine:
        engine.generate(PROMPTS[:2], GREEDY)
        cached = [r["evictable_kv_tokens"] for r in engine.get_server_info()["replicas"]]
        assert all(c > 0 for c in cached), cached  # each replica cached its prompt
        flushed = engine.flush_cache()
        assert flushed.success
        assert "replica 0:" in flushed.message and "replica 1:" in flushed.message
        assert [r["evictable_kv_tokens"] for r in engine.get_server_info()["replicas"]] == [0, 0]
        updated = engine.update_weights_from_disk(str(other))
        assert updated.success, updated.message
        assert "replica 0:" in updated.message and "replica 1:" in updated.message
        # Round robin: two prompts each; both replicas now answer with the new weights.
        outputs = engine.generate(PROMPTS[:4], GREEDY)
        assert [o["output_ids"] for o in outputs] == other_reference
        # All or nothing: replica 1 cannot load the first weights back, so replica 0, which
        # did, goes back to the second ones; both keep answering with them.
        monkeypatch.setattr(model_runner, "load_weights", _fails_in_thread(
            "scheduler replica 1", model_dir, model_runner.load_weights))
        mixed = engine.update_weights_from_disk(str(model_dir))
        outputs = engine.generate(PROMPTS[:4], GREEDY)
        assert not mixed.success
        assert [o["output_ids"] for o in outputs] == other_reference
        assert "replica 1: loading weights from" in mixed.message, mixed.message
        assert "replica 0: weights updated from" in mixed.message
        assert mixed.message.endswith("no replica serves the new weights"), mixed.message


def test_embeddings_are_routed_and_answered_by_both_replicas(tmp_path: Path) -> None:
    bert = make_tiny_checkpoint(tmp_path, "bert")
    texts = PROMPTS[:4]
    with Engine(model_path=str(bert), launch_mode="thread", **QUIET) as engine:
        expected = engine.encode(texts)
    with Engine(model_path=str(bert), dp_size=2, launch_mode="thread", **QUIET) as engine:
        got = engine.encode(texts)
        routed = [r["load"]["routed_requests"] for r in engine.get_server_info()["replicas"]]
    assert routed == [2, 2]
    for vector, reference_vector in zip(got, expected, strict=True):
        assert vector.tolist() == pytest.approx(reference_vector.tolist(), abs=1e-5)


@pytest.mark.timeout(180)  # a liveness bound: the failure must come, not hang
def test_a_killed_replica_takes_the_engine_down_by_name(model_dir: Path) -> None:
    before = own_children()
    engine = Engine(model_path=str(model_dir), dp_size=2, **QUIET)
    workdirs = [p.workdir for p in engine.components.replica_port_args]
    try:
        victim = engine.get_server_info()["replicas"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        error = None
        while error is None and time.monotonic() < deadline:
            try:
                engine.generate(PROMPTS[0], GREEDY)  # replica 0 may answer until it is noticed
            except RuntimeError as exc:
                error = str(exc)
        assert error is not None
        assert "the scheduler replica 1 process exited unexpectedly" in error
        assert "killed by SIGKILL" in error
    finally:
        engine.shutdown()
    assert own_children() <= before  # replica 0 and both detokenizers went down too
    assert not any(os.path.exists(w) for w in workdirs)
