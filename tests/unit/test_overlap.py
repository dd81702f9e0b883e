"""Overlap scheduling on the fake model worker: the next step is built while the model
computes this one, and every way a request can end stays correct.

Each output is compared with the fake model's own greedy continuation, which the
Scheduler reproduces only if every placeholder resolved to the token its step sampled
and every KV slot holds the right token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from framework.messages import AbortReq, FlushCacheReqInput
from framework.runtime.scheduler import StepResult, WorkerBatch
from framework.runtime.scheduler.overlap import OverlapWorker
from tests.fake_worker import FakeModelWorker, prompt, reference_output
from tests.model_fixtures import EOS_TOKEN_ID

GREEDY = {"temperature": 0.0}
OVERLAP = {"overlap_schedule": "on"}
DEADLINE_S = 30.0


class GatedWorker(FakeModelWorker):
    """A fake worker whose steps each wait until the test lets one through."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate = threading.Semaphore(0)
        self.started = 0
        self.finished = 0

    def forward_step(self, batch: WorkerBatch) -> StepResult:
        self.started += 1
        assert self.gate.acquire(timeout=DEADLINE_S), "the test never let the step through"
        result = super().forward_step(batch)
        self.finished += 1
        return result


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.001)


def test_the_next_step_is_built_before_this_one_returns(harness_factory) -> None:
    worker = GatedWorker()
    h = harness_factory(worker, **OVERLAP)
    ids = prompt(1, 6)
    h.submit("r", ids, max_new_tokens=5, ignore_eos=True, **GREEDY)
    stepping = threading.Thread(target=lambda: [h.scheduler.step() for _ in range(2)])
    stepping.start()
    try:
        # The first step (the prefill) is with the worker and held there; meanwhile the
        # Scheduler has built and launched the decode step that follows it.
        def decode_launched() -> bool:
            flight = h.scheduler.in_flight
            return flight is not None and flight.step.batch.mode.is_decode()

        wait_for(decode_launched, "the decode step is launched")
        # The worker's thread takes the prefill up on its own time: wait for it to hold it.
        wait_for(lambda: worker.started == 1, "the prefill reaches the worker")
        assert worker.finished == 0
        decode = h.scheduler.in_flight
        # Its input is the placeholder of the token the prefill has not sampled yet (the
        # first token the Scheduler numbered).
        assert decode.step.work.forward_batch.input_ids.tolist() == [
            OverlapWorker.placeholder(0)]
    finally:
        for _ in range(64):
            worker.gate.release()
        stepping.join(DEADLINE_S)
    h.run()
    assert h.outcomes["r"].output_ids == reference_output(ids, 5, True)
    h.assert_idle_invariant()


def test_without_overlap_a_step_returns_before_the_next_is_built(harness_factory) -> None:
    worker = GatedWorker()
    h = harness_factory(worker, overlap_schedule="off")
    h.submit("r", prompt(1, 6), max_new_tokens=5, ignore_eos=True, **GREEDY)
    stepping = threading.Thread(target=h.scheduler.step)
    stepping.start()
    wait_for(lambda: worker.started == 1, "the prefill reaches the worker")
    assert h.scheduler.steps["decode"] == 0 and h.scheduler.overlap is None
    worker.gate.release()
    stepping.join(DEADLINE_S)
    for _ in range(64):
        worker.gate.release()
    h.run()


def test_a_request_that_stops_while_its_next_step_runs_takes_nothing_from_it(
        harness_factory) -> None:
    # EOS ends the request in the result of one step, while the step after it (built
    # before that result) is computing a token it will never see.
    seeds = [i for i in range(200) if EOS_TOKEN_ID in reference_output(prompt(i, 6), 20)]
    h = harness_factory(**OVERLAP)
    for i in seeds[:4]:
        h.submit(f"r{i}", prompt(i, 6), max_new_tokens=20, **GREEDY)
    h.run()
    for i in seeds[:4]:
        out = h.outcomes[f"r{i}"]
        assert out.output_ids == reference_output(prompt(i, 6), 20)
        assert out.finished_reason.type == "stop"
    h.assert_idle_invariant()


def test_an_abort_of_a_request_in_flight_keeps_its_slots_until_the_step_returns(
        harness_factory) -> None:
    worker = GatedWorker()
    h = harness_factory(worker, **OVERLAP)
    h.submit("victim", prompt(1, 6), max_new_tokens=30, ignore_eos=True, **GREEDY)
    h.submit("other", prompt(2, 6), max_new_tokens=8, ignore_eos=True, **GREEDY)
    worker.gate.release()  # the prefill may run; the decode after it waits
    h.step()  # the prefill launched
    h.step()  # a decode launched, the prefill applied
    first_decode = h.scheduler.in_flight
    h.send(AbortReq(rid="victim", reason="client left"))
    # The next step takes the abort in, launches the next decode and waits for the one
    # in flight, which still holds the victim: its slots wait for that step.
    stepping = threading.Thread(target=h.scheduler.step)
    stepping.start()
    try:
        wait_for(lambda: h.scheduler.in_flight is not first_decode,
                 "the next decode is launched (the step then waits for the first)")
        assert [req.rid for req, _ in h.scheduler.queues.retiring] == ["victim"]
        assert "victim" not in [req.rid for req in h.scheduler.all_requests()]
        h.assert_slots_accounted()
    finally:
        for _ in range(64):
            worker.gate.release()
        stepping.join(DEADLINE_S)
    h.run()
    assert h.outcomes["victim"].finished_reason.type == "abort"
    assert h.outcomes["other"].output_ids == reference_output(prompt(2, 6), 8, True)
    assert h.scheduler.queues.retiring == []
    h.assert_idle_invariant()


def test_a_failing_request_ends_alone_with_overlap(harness_factory) -> None:
    marker = 499

    def fails(tokens: list[int]) -> bool:
        return len(tokens) > 8 and tokens[0] == marker  # fails in decode, after some output

    prompts = {f"r{i}": prompt(i, 6) for i in range(4)}
    h = harness_factory(FakeModelWorker(fail_if=fails), **OVERLAP)
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.submit("bad", [marker, 4, 5, 6, 7], max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.run()
    reason = h.outcomes["bad"].finished_reason
    assert reason.type == "abort" and "the fake model failed" in reason.message
    for rid, ids in prompts.items():
        assert h.outcomes[rid].output_ids == reference_output(ids, 10, True), rid
    assert h.scheduler.stats.failed_requests == 1
    h.assert_idle_invariant()


@pytest.mark.parametrize("params", [
    {"temperature": 0.0, "frequency_penalty": 0.5},
    {"temperature": 0.0, "min_new_tokens": 6},
    {"temperature": 0.7, "seed": 11},
], ids=["penalty", "min_new_tokens", "seeded"])
def test_sampling_that_reads_the_output_so_far_is_the_same_with_overlap(
        harness_factory, params: dict) -> None:
    outputs = []
    for overlap in ("off", "on"):
        h = harness_factory(overlap_schedule=overlap)
        for i in range(3):
            h.submit(f"r{i}", prompt(i, 7), max_new_tokens=10, **params)
        h.run()
        outputs.append({rid: o.output_ids for rid, o in h.outcomes.items()})
        h.assert_idle_invariant()
    assert outputs[0] == outputs[1]


def test_prompt_logprobs_and_chunks_are_the_same_with_overlap(harness_factory) -> None:
    outcomes = []
    for overlap in ("off", "on"):
        h = harness_factory(FakeModelWorker(max_total_tokens=96), chunked_prefill_size=5,
                            overlap_schedule=overlap)
        h.submit("scored", prompt(3, 17), max_new_tokens=4, return_logprob=True,
                 logprob_start_len=2, ignore_eos=True, **GREEDY)
        h.submit("plain", prompt(4, 13), max_new_tokens=6, ignore_eos=True, **GREEDY)
        h.run()
        outcomes.append(h.outcomes)
        h.assert_idle_invariant()
    off, on = outcomes
    assert on["scored"].prompt_logprobs == off["scored"].prompt_logprobs
    assert on["scored"].logprobs == off["scored"].logprobs
    assert {r: o.output_ids for r, o in on.items()} == {r: o.output_ids for r, o in off.items()}


def test_an_rpc_sees_the_state_after_the_step_in_flight(harness_factory) -> None:
    h = harness_factory(**OVERLAP)
    h.submit("r", prompt(1, 6), max_new_tokens=1, **GREEDY)
    h.step()  # the prefill launched; its result (the only token) not applied yet
    assert h.scheduler.in_flight is not None
    reply = h.scheduler.handle_rpc_request(FlushCacheReqInput())
    assert reply.success, reply.message  # the request ended with the step applied first
    assert h.scheduler.in_flight is None
    h.collect()
    assert h.outcomes["r"].output_ids == reference_output(prompt(1, 6), 1)
    h.assert_idle_invariant()


def test_retraction_under_overlap_keeps_the_outputs(harness_factory) -> None:
    h = harness_factory(FakeModelWorker(max_total_tokens=48), **OVERLAP)
    prompts = {f"r{i}": prompt(i, 8) for i in range(3)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=14, ignore_eos=True, **GREEDY)
    outcomes = h.run()
    assert h.scheduler.stats.retracted_requests > 0, "the pool was meant to run short"
    for rid, ids in prompts.items():
        assert outcomes[rid].output_ids == reference_output(ids, 14, True), rid
    h.assert_idle_invariant()


def test_overlap_is_off_on_cpus_unless_asked(harness_factory) -> None:
    assert harness_factory().scheduler.overlap is None
    assert harness_factory(**OVERLAP).scheduler.overlap is not None
    assert harness_factory(disable_overlap_schedule=True).scheduler.overlap is None
