"""A randomised driver of the real Scheduler and a tiny real model.

Random arrivals, prompt lengths, aborts and sampling settings, with KV pools
from tiny to roomy and chunk sizes from 1 up: every request must end (finished
or with a reason), greedy outputs must equal those of a roomy pool without
chunking (by DESIGN's rule for comparing greedy outputs: equal up to the first
step where the reference's top-1 minus top-2 logprob is below 1e-3, logprobs
within 1e-4 before it), and the idle invariant must hold after each run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from framework.config import ServerArgs
from framework.messages import AbortReq
from framework.model_executor.model_runner import ModelRunner
from framework.runtime.scheduler import ModelRunnerWorker
from tests.fake_worker import SchedulerHarness
from tests.model_fixtures import make_tiny_checkpoint, single_threaded_torch

NEAR_TIE = 1e-3
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("random"), "llama", seed=11)


def real_harness(model_dir: Path, **args: Any) -> SchedulerHarness:
    """A harness around a real ModelRunner on ``model_dir`` (CPU, float32)."""
    args = {"transport": "inproc", "device": "cpu", "dtype": "float32", **args}
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), **args), str(model_dir))
    return SchedulerHarness(ModelRunnerWorker(runner), model_path=str(model_dir), **args)


def make_traffic(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Random requests; some share a prefix so the cache has something to reuse."""
    shared = [rng.randrange(3, 500) for _ in range(24)]
    traffic = []
    for i in range(count):
        own = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        ids = (shared[: rng.choice([0, 8, 24])] + own)[:40]
        greedy = rng.random() < 0.7
        traffic.append({
            "rid": f"r{i}",
            "input_ids": ids,
            "params": {"max_new_tokens": rng.randint(1, 14), "ignore_eos": rng.random() < 0.5,
                       **({"temperature": 0.0} if greedy else
                          {"temperature": 0.9, "top_p": 0.9, "seed": rng.randrange(1000)})},
            "greedy": greedy,
            "arrive": rng.randint(0, 8),
            "abort_at": rng.choice([None, None, None, rng.randint(0, 12)]),
        })
    return traffic


def drive(harness: SchedulerHarness, traffic: list[dict[str, Any]], *, with_aborts: bool
          ) -> dict[str, Any]:
    """Submit ``traffic`` at its arrival steps (aborting where asked) until all have ended."""
    for step in range(20_000):
        for req in traffic:
            if req["arrive"] == step:
                harness.submit(req["rid"], req["input_ids"], return_logprob=True,
                               top_logprobs_num=2, **req["params"])
            if with_aborts and req["abort_at"] is not None and (
                    req["arrive"] + req["abort_at"] == step):
                harness.send(AbortReq(rid=req["rid"], reason="random abort"))
        harness.step()
        if step > 8 and all(o.finished_reason is not None for o in harness.outcomes.values()):
            harness.scheduler.step()  # take in aborts of requests that had finished
            return harness.outcomes
    raise AssertionError("the random traffic did not finish")


def assert_same_greedy(got: Any, ref: Any, max_new: int, rid: str) -> None:
    """DESIGN's rule: equal until the reference's first near-tie, logprobs close before it."""
    ref_ids, ref_lps, ref_tops = ref.output_ids, ref.logprobs, ref.top_logprobs
    limit = min(max_new, len(ref_ids))
    for t in range(limit):
        top = ref_tops[t]
        if len(top) > 1 and top[0] - top[1] < NEAR_TIE:
            return  # a near-tie: the rest may legitimately differ
        assert t < len(got.output_ids), f"{rid}: ended after {t} tokens, reference {limit}"
        assert got.output_ids[t] == ref_ids[t], f"{rid}: token {t} differs"
        assert abs(got.logprobs[t] - ref_lps[t]) < LOGPROB_TOLERANCE, f"{rid}: logprob {t}"
    assert len(got.output_ids) == limit, f"{rid}: {len(got.output_ids)} tokens, expected {limit}"


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_on_a_real_model(model_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    traffic = make_traffic(rng, rng.randint(3, 9))
    pool = rng.choice([48, 64, 96, 160, 4096])
    chunk = rng.choice([1, 3, 8, 17, 64])
    settings = {"max_total_tokens": pool, "chunked_prefill_size": chunk,
                "max_running_requests": rng.randint(1, 6),
                "disable_radix_cache": rng.random() < 0.3,
                "schedule_policy": rng.choice(["fcfs", "lpm"]),
                "enable_mixed_chunk": seed % 2 == 1,
                # Overlap scheduling with and without mixed steps.
                "overlap_schedule": "on" if seed % 4 in (0, 3) else "off"}

    reference = real_harness(model_dir, max_total_tokens=4096, chunked_prefill_size=4096,
                             disable_radix_cache=True)
    try:
        ref = drive(reference, traffic, with_aborts=False)
        reference.assert_idle_invariant()
    finally:
        reference.close()

    harness = real_harness(model_dir, **settings)
    try:
        got = drive(harness, traffic, with_aborts=True)
        harness.assert_idle_invariant()
    finally:
        harness.close()

    for req in traffic:
        rid, outcome = req["rid"], got[req["rid"]]
        assert outcome.finished_reason is not None, rid
        if outcome.finished_reason.type == "abort":
            assert outcome.finished_reason.message == "random abort", settings
            continue
        if req["greedy"]:
            # Generation stops where the pool could not hold the request alone.
            max_new = min(req["params"]["max_new_tokens"], pool - len(req["input_ids"]))
            assert_same_greedy(outcome, ref[rid], max_new, f"{rid} with {settings}")


def test_retraction_on_a_real_model_keeps_greedy_outputs(model_dir: Path) -> None:
    rng = random.Random(99)
    traffic = [{"rid": f"r{i}", "input_ids": [rng.randrange(3, 500) for _ in range(10)],
                "params": {"max_new_tokens": 20, "ignore_eos": True, "temperature": 0.0},
                "greedy": True, "arrive": 0, "abort_at": None} for i in range(4)]
    reference = real_harness(model_dir, max_total_tokens=4096, disable_radix_cache=True)
    try:
        ref = drive(reference, traffic, with_aborts=False)
    finally:
        reference.close()
    harness = real_harness(model_dir, max_total_tokens=48, chunked_prefill_size=8)
    try:
        got = drive(harness, traffic, with_aborts=False)
        assert harness.scheduler.stats.retracted_requests > 0, "the pool was meant to run short"
        harness.assert_idle_invariant()
    finally:
        harness.close()
    for req in traffic:
        assert_same_greedy(got[req["rid"]], ref[req["rid"]], 20, req["rid"])
