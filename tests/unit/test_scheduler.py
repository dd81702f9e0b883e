"""The Scheduler on a fake model runner: admission, chunking, retraction, aborts, stops, failures.

Every output is compared with the fake model's own greedy continuation
(``reference_output``), which the Scheduler can only reproduce if every KV slot
it hands the model holds the right token.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework.layers.sampler import SamplingBatchInfo
from framework.messages import (
    AbortReq,
    FinishReason,
    FlushCacheReqInput,
    GetInfoReqInput,
    RequestConstants,
    UpdateWeightsFromDiskReqInput,
)
from framework.registry import SCHEDULE_POLICIES
from framework.runtime.request import Req
from framework.runtime.scheduler import Scheduler
from framework.runtime.scheduler.batch import ScheduledBatch
from framework.runtime.scheduler.output import token_id_output
from framework.runtime.scheduler.policy import SchedulePolicy
from framework.sampling_params import SamplingParams
from tests.fake_worker import (
    FakeModelProposer,
    FakeModelWorker,
    SchedulerHarness,
    prompt,
    reference_output,
)
from tests.model_fixtures import EOS_TOKEN_ID, make_tiny_tokenizer

GREEDY = {"temperature": 0.0}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_batched_requests_match_the_reference(harness_factory, overlap: str) -> None:
    h = harness_factory(overlap_schedule=overlap)
    prompts = {f"r{i}": prompt(i, 5 + 7 * i) for i in range(6)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=12, **GREEDY)
    outcomes = h.run()
    for rid, ids in prompts.items():
        assert outcomes[rid].output_ids == reference_output(ids, 12), rid
    h.assert_idle_invariant()


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_speculative_steps_match_the_reference_and_free_rejected_drafts(
        harness_factory, algorithm: str) -> None:
    """Drafts right for two tokens, then wrong: every step accepts and rejects some. The
    planner drafts (``ngram``), or sizes the drafts and the worker fills them (``draft``)."""
    h = harness_factory(speculative_algorithm=algorithm, speculative_num_draft_tokens=4,
                        speculative_draft_model_path="fake" if algorithm == "draft" else None)
    proposer = FakeModelProposer(right=2, wrong=8)
    if algorithm == "ngram":
        h.scheduler.drafter.proposer = proposer
    else:
        assert h.scheduler.drafter.proposer is None
        h.worker.drafter = proposer
    prompts = {f"r{i}": prompt(i, 5 + 3 * i) for i in range(4)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=10, **GREEDY)
    outcomes = h.run()
    for rid, ids in prompts.items():
        assert outcomes[rid].output_ids == reference_output(ids, 10), rid
    stats = h.scheduler.stats
    assert h.scheduler.steps["verify"] > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    h.assert_idle_invariant()


def test_prompt_lookup_drafts_double_while_accepted_whole_and_shrink_after_a_rejection(
        harness_factory) -> None:
    """A request's n-gram drafts start at the floor (4 tokens), double after a step that
    accepted the whole draft, and fall to one more than the part kept after one that did
    not: here drafts right for six tokens run 4 (all kept), 8 (six kept), then 7."""
    h = harness_factory(speculative_algorithm="ngram", speculative_num_draft_tokens=12)
    h.scheduler.drafter.proposer = FakeModelProposer(right=6, wrong=10)
    ids = prompt(0, 5)
    h.submit("r0", ids, max_new_tokens=40, ignore_eos=True, **GREEDY)
    outcomes = h.run()
    assert outcomes["r0"].output_ids == reference_output(ids, 40, True)
    drafted = [call.extend_lens[0] - 1 for call in h.worker.calls[1:]]
    assert drafted[:4] == [4, 8, 7, 7]
    h.assert_idle_invariant()


def test_no_step_drafts_while_more_requests_run_than_the_batch_size_limit(
        harness_factory) -> None:
    h = harness_factory(speculative_algorithm="ngram", speculative_num_draft_tokens=3,
                        speculative_disable_by_batch_size=2)
    h.scheduler.drafter.proposer = FakeModelProposer(right=2, wrong=8)
    verified_with: list[int] = []
    verify = ScheduledBatch.verify

    def counting(running: list, drafts: list) -> ScheduledBatch:
        verified_with.append(len(running))
        return verify(running, drafts)

    prompts = {f"r{i}": prompt(i, 6) for i in range(3)}
    for i, (rid, ids) in enumerate(prompts.items()):
        h.submit(rid, ids, max_new_tokens=4 if i == 0 else 12, ignore_eos=True, **GREEDY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ScheduledBatch, "verify", staticmethod(counting))
        outcomes = h.run()
    for i, (rid, ids) in enumerate(prompts.items()):
        assert outcomes[rid].output_ids == reference_output(ids, 4 if i == 0 else 12, True)
    assert h.scheduler.steps["decode"] >= 3  # three requests: no drafts
    assert verified_with and max(verified_with) <= 2
    h.assert_idle_invariant()


def test_unloading_a_lora_adapter_in_use_is_refused_with_the_reason(harness_factory) -> None:
    h = harness_factory(lora_paths=("a=/adapters/a",))
    h.submit("r0", prompt(0, 6), max_new_tokens=20, lora_name="a", **GREEDY)
    h.step()
    reply = h.scheduler.control.unload_lora_adapter("a")
    assert reply.success is False and "in use by 1 requests" in reply.message
    h.run()
    h.assert_idle_invariant()


def test_a_step_runs_at_most_max_loras_per_batch_adapters(harness_factory) -> None:
    h = harness_factory(lora_paths=("a=/a", "b=/b", "c=/c"), max_loras_per_batch=2)
    prompts = {f"{name}{i}": (name, prompt(3 * i + len(str(name)), 5 + i))
               for name in ("a", "b", "c", None) for i in range(2)}
    for rid, (name, ids) in prompts.items():
        h.submit(rid, ids, max_new_tokens=6, ignore_eos=True, lora_name=name, **GREEDY)
    outcomes = h.run()
    for rid, (_, ids) in prompts.items():
        assert outcomes[rid].output_ids == reference_output(ids, 6, ignore_eos=True), rid
    per_step = [{n for n in call.lora_names if n is not None}
                for call in h.worker.calls if call.lora_names]
    assert max(map(len, per_step)) == 2  # the limit binds: three adapters never step together
    assert {"a", "b", "c"} == set().union(*per_step)
    h.assert_idle_invariant()


def test_a_request_for_an_adapter_not_served_is_refused_on_arrival(harness_factory) -> None:
    h = harness_factory(lora_paths=("a=/adapters/a",))
    assert h.scheduler.control.unload_lora_adapter("a").success
    h.submit("gone", prompt(0, 6), max_new_tokens=4, lora_name="a", **GREEDY)
    h.submit("never", prompt(1, 6), max_new_tokens=4, lora_name="b", **GREEDY)
    assert h.scheduler.control.load_lora_adapter("b", "/adapters/b").success
    outcomes = h.run()
    gone = outcomes["gone"].finished_reason
    assert gone.type == "abort" and "LoRA adapter 'a' is not loaded" in gone.message
    assert outcomes["never"].output_ids == reference_output(prompt(1, 6), 4)
    h.assert_idle_invariant()


def test_mixed_steps_decode_the_running_requests_with_a_prefill(harness_factory) -> None:
    h = harness_factory(enable_mixed_chunk=True, chunked_prefill_size=16)
    h.submit("early", prompt(1, 6), max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.step()  # its prefill
    h.step()  # a decode step
    h.submit("late", prompt(2, 20), max_new_tokens=6, ignore_eos=True, **GREEDY)
    outcomes = h.run()
    extends = [c for c in h.worker.calls if c.mode == "extend"]
    # The late prompt in two chunks (16 tokens, one of them the early request's decode
    # token), each with the early request decoding one token after it.
    assert [c.extend_lens for c in extends[1:]] == [[15, 1], [5, 1]]
    assert [c.prefix_lens for c in extends[1:]] == [[0, 7], [15, 8]]
    assert outcomes["early"].output_ids == reference_output(prompt(1, 6), 10, True)
    assert outcomes["late"].output_ids == reference_output(prompt(2, 20), 6, True)
    assert len(h.scheduler.running) == 0
    h.assert_idle_invariant()


def test_admission_respects_max_running_requests(harness_factory) -> None:
    h = harness_factory(max_running_requests=2)
    for i in range(5):
        h.submit(f"r{i}", prompt(i, 6), max_new_tokens=8, ignore_eos=True, **GREEDY)
    peak = 0
    for _ in range(1000):  # far more steps than five short requests take
        if all(o.finished_reason is not None for o in h.outcomes.values()):
            break
        h.step()
        in_flight = len(h.scheduler.running) + (h.scheduler.chunked_req is not None)
        peak = max(peak, in_flight)
    assert peak == 2
    for i in range(5):
        assert h.outcomes[f"r{i}"].output_ids == reference_output(prompt(i, 6), 8, True)
    h.assert_idle_invariant()


def test_chunked_prefill_splits_a_long_prompt_and_resumes_it(harness_factory) -> None:
    h = harness_factory(chunked_prefill_size=4, disable_radix_cache=True)
    ids = prompt(1, 10)
    h.submit("long", ids, max_new_tokens=3, ignore_eos=True, **GREEDY)
    h.run()
    extends = [c for c in h.worker.calls if c.mode == "extend"]
    assert [c.extend_lens for c in extends] == [[4], [4], [2]]
    assert [c.prefix_lens for c in extends] == [[0], [4], [8]]
    assert h.outcomes["long"].output_ids == reference_output(ids, 3, True)
    h.assert_idle_invariant()


def test_kv_pressure_that_used_to_crash_finishes_every_request(harness_factory) -> None:
    # The report: a 64-token pool, 8-token chunks, prompts of 2 and 41 tokens.
    worker = FakeModelWorker(max_total_tokens=64)
    h = harness_factory(worker, chunked_prefill_size=8)
    h.submit("short", prompt(1, 2), max_new_tokens=40, ignore_eos=True, **GREEDY)
    h.submit("long", prompt(2, 41), max_new_tokens=20, ignore_eos=True, **GREEDY)
    outcomes = h.run()
    assert outcomes["short"].output_ids == reference_output(prompt(1, 2), 40, True)
    assert outcomes["long"].output_ids == reference_output(prompt(2, 41), 20, True)
    h.assert_idle_invariant()


def test_decode_short_of_kv_retracts_and_the_retracted_request_continues(harness_factory) -> None:
    worker = FakeModelWorker(max_total_tokens=48)
    h = harness_factory(worker)
    prompts = {f"r{i}": prompt(i, 8) for i in range(3)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=14, ignore_eos=True, **GREEDY)
    h.run()
    assert h.scheduler.stats.retracted_requests > 0, "the pool was meant to run short"
    for rid, ids in prompts.items():
        assert h.outcomes[rid].output_ids == reference_output(ids, 14, True), rid
    h.assert_idle_invariant()


def test_a_prompt_that_can_never_fit_is_refused_with_a_reason(harness_factory) -> None:
    h = harness_factory(FakeModelWorker(max_total_tokens=16))
    h.submit("huge", prompt(1, 16), max_new_tokens=4, **GREEDY)
    h.submit("fits", prompt(2, 5), max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    reason = h.outcomes["huge"].finished_reason
    assert reason.type == "abort" and "KV cache holds only 16" in reason.message
    assert h.outcomes["fits"].output_ids == reference_output(prompt(2, 5), 4, True)
    h.assert_idle_invariant()


def test_a_prompt_may_fill_the_context_only_to_be_scored(harness_factory) -> None:
    """A prompt of the whole context runs with max_new_tokens 0 (scored, its logprobs
    back) and is refused when a token must follow it: there is no room for one."""
    h = harness_factory(FakeModelWorker(context_len=32, max_total_tokens=64))
    h.submit("scored", prompt(1, 32), max_new_tokens=0, return_logprob=True,
             logprob_start_len=0)
    h.submit("generates", prompt(2, 32), max_new_tokens=1, **GREEDY)
    h.submit("too long", prompt(3, 33), max_new_tokens=0)
    h.run()
    scored = h.outcomes["scored"]
    assert scored.finished_reason.type == "length" and scored.output_ids == []
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs.values) == 32
    refused = h.outcomes["generates"].finished_reason
    assert refused.type == "abort" and "no room is left for a new token" in refused.message
    too_long = h.outcomes["too long"].finished_reason
    assert too_long.type == "abort" and "more than the context length 32" in too_long.message
    h.assert_idle_invariant()


def test_abort_at_every_stage_frees_everything(harness_factory) -> None:
    h = harness_factory(chunked_prefill_size=4, max_running_requests=2)
    h.submit("running", prompt(1, 3), max_new_tokens=50, ignore_eos=True, **GREEDY)
    h.step()
    h.step()
    assert [r.rid for r in h.scheduler.running] == ["running"]
    h.submit("chunked", prompt(2, 30), max_new_tokens=5, **GREEDY)
    h.submit("waiting", prompt(3, 4), max_new_tokens=5, **GREEDY)
    h.step()
    assert h.scheduler.chunked_req is not None and h.scheduler.chunked_req.rid == "chunked"
    assert [r.rid for r in h.scheduler.waiting] == ["waiting"]
    for rid in ("waiting", "chunked", "running"):
        h.send(AbortReq(rid=rid, reason=f"stop {rid}"))
    h.step()
    for rid in ("waiting", "chunked", "running"):
        reason = h.outcomes[rid].finished_reason
        assert reason is not None and reason.type == "abort" and reason.message == f"stop {rid}"
    assert h.scheduler.stats.aborted_requests == 3
    h.assert_idle_invariant()


def test_abort_all_ends_every_request(harness_factory) -> None:
    h = harness_factory()
    for i in range(3):
        h.submit(f"r{i}", prompt(i, 6), max_new_tokens=40, ignore_eos=True, **GREEDY)
    h.step()
    h.send(AbortReq(abort_all=True))
    h.step()
    assert all(o.finished_reason.type == "abort" for o in h.outcomes.values())
    h.assert_idle_invariant()


def test_finish_by_length_and_by_eos(harness_factory) -> None:
    # Find a prompt whose continuation reaches EOS within 40 tokens.
    seed = next(s for s in range(500)
                if EOS_TOKEN_ID in reference_output(prompt(s, 6), 40)[:-1] or
                reference_output(prompt(s, 6), 40)[-1] == EOS_TOKEN_ID)
    ids = prompt(seed, 6)
    expected = reference_output(ids, 40)
    h = harness_factory()
    h.submit("eos", ids, max_new_tokens=40, **GREEDY)
    h.submit("length", ids, max_new_tokens=40, ignore_eos=True, **GREEDY)
    h.run()
    assert h.outcomes["eos"].output_ids == expected
    assert h.outcomes["eos"].finished_reason.type == "stop"
    assert h.outcomes["eos"].finished_reason.matched == EOS_TOKEN_ID
    assert len(h.outcomes["length"].output_ids) == 40
    assert h.outcomes["length"].finished_reason.type == "length"


def test_finish_by_stop_token_id(harness_factory) -> None:
    ids = prompt(4, 6)
    expected = reference_output(ids, 20, True)
    stop_at = expected[5]
    first = expected.index(stop_at)
    h = harness_factory()
    h.submit("r", ids, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_at], **GREEDY)
    h.run()
    assert h.outcomes["r"].output_ids == expected[:first + 1]
    assert h.outcomes["r"].finished_reason.matched == stop_at


def test_finish_by_stop_string_on_the_decoded_text(harness_factory) -> None:
    tokenizer = make_tiny_tokenizer()
    ids = prompt(5, 6)
    expected = reference_output(ids, 30, True)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    # A stop string that only appears once several tokens are decoded together.
    cut = len(tokenizer.decode(expected[:12], skip_special_tokens=True))
    stop = text[cut - 3:cut + 2]
    assert len(stop) == 5 and stop.strip(), "pick a stop string made of real characters"
    h = harness_factory()
    h.submit("r", ids, max_new_tokens=30, ignore_eos=True, stop=[stop], **GREEDY)
    h.run()
    out = h.outcomes["r"]
    assert out.finished_reason.type == "stop" and out.finished_reason.matched == stop
    produced = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    assert stop in produced
    assert stop not in tokenizer.decode(out.output_ids[:-1], skip_special_tokens=True)


def test_a_failing_request_ends_alone_and_the_others_are_unchanged(harness_factory) -> None:
    marker = 499

    def fails(tokens: list[int]) -> bool:
        return len(tokens) > 8 and tokens[0] == marker  # fails in decode, after some output

    prompts = {f"r{i}": prompt(i, 6) for i in range(4)}
    bad = [marker, 4, 5, 6, 7]
    h = harness_factory(FakeModelWorker(fail_if=fails))
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.submit("bad", bad, max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.run()
    reason = h.outcomes["bad"].finished_reason
    assert reason.type == "abort" and "internal error" in reason.message
    assert "the fake model failed" in reason.message
    for rid, ids in prompts.items():
        assert h.outcomes[rid].output_ids == reference_output(ids, 10, True), rid
    assert h.scheduler.stats.failed_requests == 1
    h.assert_idle_invariant()
    # The Scheduler keeps serving.
    h.submit("after", prompt(9, 5), max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    assert h.outcomes["after"].output_ids == reference_output(prompt(9, 5), 4, True)


def test_a_bad_value_that_slipped_past_the_edge_fails_only_its_request(harness_factory) -> None:
    h = harness_factory()
    h.submit("good", prompt(1, 6), max_new_tokens=6, ignore_eos=True, **GREEDY)
    h.submit("bad", prompt(2, 6), max_new_tokens=6, return_logprob=True, top_logprobs_num=-1,
             **GREEDY)
    h.run()
    assert h.outcomes["bad"].finished_reason.type == "abort"
    assert h.outcomes["good"].output_ids == reference_output(prompt(1, 6), 6, True)
    h.assert_idle_invariant()


def test_a_shared_prefix_is_reused_and_reported(harness_factory) -> None:
    h = harness_factory()
    shared = prompt(7, 40)
    h.submit("first", [*shared, 11, 12], max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    calls_before = len(h.worker.calls)
    h.scheduler.stats.last_report = -1e9  # a report now starts a new window...
    h.scheduler.maybe_send_metrics()
    h.scheduler.stats.last_report = float("inf")  # ...and no other report is due until asked
    second = [*shared, 21, 22, 23]
    h.submit("second", second, max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    cached = h.outcomes["second"].cached_tokens
    assert cached >= len(second) // 2
    extend = next(c for c in h.worker.calls[calls_before:] if c.mode == "extend")
    assert extend.prefix_lens == [cached]
    assert extend.extend_lens == [len(second) - cached]
    assert h.outcomes["second"].output_ids == reference_output(second, 4, True)
    info = h.scheduler.get_info()
    assert info["cache_hit_rate"] > 0 and info["evictable_kv_tokens"] > 0
    h.scheduler.stats.last_report = -1e9
    h.scheduler.maybe_send_metrics()
    metrics = h.metrics.drain()[-1]
    # Cached over admitted prompt tokens of the window: the second request alone.
    assert metrics.cache_hit_rate == pytest.approx(cached / len(second))
    h.assert_idle_invariant()

    assert h.scheduler.handle_rpc_request(FlushCacheReqInput()).success
    assert h.scheduler.tree_cache.evictable_size() == 0
    h.submit("third", second, max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    assert h.outcomes["third"].cached_tokens == 0


def test_requests_sent_together_share_their_prefix(harness_factory) -> None:
    h = harness_factory()
    shared = prompt(8, 48)
    for i in range(3):
        h.submit(f"r{i}", [*shared, 100 + i], max_new_tokens=3, ignore_eos=True, **GREEDY)
    h.submit("other", prompt(9, 12), max_new_tokens=3, ignore_eos=True, **GREEDY)
    h.step()
    # The first one computes the prefix; the others wait one step and reuse it.
    assert [r.rid for r in h.scheduler.running] == ["r0", "other"]
    h.run()
    assert h.outcomes["r0"].cached_tokens == 0
    assert h.outcomes["r1"].cached_tokens == h.outcomes["r2"].cached_tokens == len(shared)
    for i in range(3):
        assert h.outcomes[f"r{i}"].output_ids == reference_output([*shared, 100 + i], 3, True)
    h.assert_idle_invariant()


def test_a_running_request_shares_its_prompt_before_it_ends(harness_factory) -> None:
    h = harness_factory()
    ids = prompt(10, 40)
    h.submit("long", ids, max_new_tokens=30, ignore_eos=True, **GREEDY)
    h.step()
    h.submit("later", [*ids, 7], max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.step()
    assert h.outcomes["later"].finished_reason is None
    assert any(r.rid == "later" for r in h.scheduler.running)
    h.run()
    assert h.outcomes["later"].cached_tokens == len(ids)
    h.assert_idle_invariant()


def test_flush_is_refused_while_requests_run(harness_factory) -> None:
    h = harness_factory()
    h.submit("r", prompt(1, 6), max_new_tokens=30, ignore_eos=True, **GREEDY)
    h.step()
    reply = h.scheduler.handle_rpc_request(FlushCacheReqInput())
    assert not reply.success and "in flight" in reply.message
    h.run()
    assert h.scheduler.handle_rpc_request(FlushCacheReqInput()).success
    h.assert_idle_invariant()


def test_radix_cache_on_and_off_give_the_same_outputs(harness_factory) -> None:
    prompts = {f"r{i}": [*prompt(0, 20), *prompt(i + 1, 3 + i)] for i in range(6)}
    results = []
    for disable in (False, True):
        h = harness_factory(FakeModelWorker(max_total_tokens=96), disable_radix_cache=disable,
                            chunked_prefill_size=16)
        for rid, ids in prompts.items():
            h.submit(rid, ids, max_new_tokens=10, ignore_eos=True, **GREEDY)
        h.run()
        results.append({rid: o.output_ids for rid, o in h.outcomes.items()})
        h.assert_idle_invariant()
    assert results[0] == results[1]
    assert results[0] == {rid: reference_output(ids, 10, True) for rid, ids in prompts.items()}


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(harness_factory, policy: str) -> None:
    h = harness_factory(schedule_policy=policy, max_running_requests=1)
    shared = prompt(3, 30)
    h.submit("warm", [*shared, 5], max_new_tokens=1, **GREEDY)
    h.run()
    h.submit("cold", prompt(8, 12), max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.submit("warm2", [*shared, 9, 9], max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.step()
    first = h.scheduler.running[0].rid
    assert first == ("warm2" if policy == "lpm" else "cold")
    h.run()
    h.assert_idle_invariant()


class ShortestPromptFirst(SchedulePolicy):
    """A plugin policy: the shortest prompt first."""

    def order(self, waiting: deque[Req]) -> None:
        ordered = sorted(waiting, key=lambda r: len(r.origin_input_ids))
        waiting.clear()
        waiting.extend(ordered)


def test_a_registered_schedule_policy_orders_admission(
        harness_factory, request: pytest.FixtureRequest) -> None:
    SCHEDULE_POLICIES.register("shortest-prompt-test", ShortestPromptFirst, source="tests")
    request.addfinalizer(lambda: SCHEDULE_POLICIES.unregister("shortest-prompt-test"))
    h = harness_factory(schedule_policy="shortest-prompt-test", max_running_requests=1)
    assert isinstance(h.scheduler.policy, ShortestPromptFirst)
    h.submit("long", prompt(8, 20), max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.submit("short", prompt(3, 5), max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.step()
    assert [r.rid for r in h.scheduler.running] == ["short"]  # fcfs would admit "long"
    h.run()
    h.assert_idle_invariant()


def test_weight_update_recomputes_running_requests_and_flushes(harness_factory) -> None:
    h = harness_factory()
    ids = prompt(6, 10)
    h.submit("r", ids, max_new_tokens=12, ignore_eos=True, **GREEDY)
    for _ in range(4):
        h.step()
    reply = h.scheduler.handle_rpc_request(UpdateWeightsFromDiskReqInput(model_path="x"))
    assert reply.success and reply.num_paused_requests == 1
    assert h.scheduler.tree_cache.evictable_size() == 0  # no KV from the old weights is kept
    h.run()
    assert h.outcomes["r"].output_ids == reference_output(ids, 12, True)
    h.assert_idle_invariant()


def test_get_info_splits_step_time_into_model_and_the_rest(harness_factory) -> None:
    h = harness_factory()
    h.submit("r", prompt(1, 6), max_new_tokens=5, ignore_eos=True, **GREEDY)
    h.run()
    info = h.scheduler.get_info()
    assert 0 < info["forward_seconds"] < info["step_seconds"]
    assert info["non_model_fraction"] == pytest.approx(
        1 - info["forward_seconds"] / info["step_seconds"])


def test_get_info_reports_the_idle_invariant(harness_factory) -> None:
    h = harness_factory()
    h.submit("r", prompt(1, 6), max_new_tokens=30, ignore_eos=True, **GREEDY)
    h.step()
    assert h.scheduler.handle_rpc_request(GetInfoReqInput()).info[
        "kv_cache_idle_and_free"] is False
    h.run()
    assert h.scheduler.handle_rpc_request(GetInfoReqInput()).info[
        "kv_cache_idle_and_free"] is True


def test_subclass_hooks_still_choose_batches(harness_factory) -> None:
    class ShortestFirst(Scheduler):
        def select_prefill_requests(self):  # type: ignore[no-untyped-def]
            ordered = sorted(self.waiting, key=lambda r: len(r.origin_input_ids))
            self.waiting.clear()
            self.waiting.extend(ordered)
            return super().select_prefill_requests()

    h = harness_factory(scheduler_class=ShortestFirst, max_running_requests=1)
    h.submit("long", prompt(1, 20), max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.submit("short", prompt(2, 3), max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.step()
    assert h.scheduler.running[0].rid == "short"
    h.run()


# --------------------------------------------------------------------------- randomised


request_strategy = st.fixed_dictionaries({
    "length": st.integers(1, 40),
    "shared": st.integers(0, 2),  # which of three prefixes it starts with
    "max_new": st.integers(0, 16),
    "ignore_eos": st.booleans(),
    "arrive": st.integers(0, 6),  # the step at which it is submitted
    "abort_at": st.one_of(st.none(), st.integers(0, 20)),
    "sampled": st.booleans(),
})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    pool=st.integers(42, 300),
    chunk=st.integers(1, 64),
    max_running=st.integers(1, 6),
    radix=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm"]),
    decoding=st.sampled_from(["plain", "overlap", "speculative", "draft"]),
)
def test_random_traffic_never_crashes_leaks_or_changes_greedy_outputs(
    requests: list[dict], pool: int, chunk: int, max_running: int, radix: bool, policy: str,
    decoding: str,
) -> None:
    prefixes = [prompt(100, 24), prompt(101, 10), []]
    modes = {"plain": {"overlap_schedule": "off"}, "overlap": {"overlap_schedule": "on"},
             "speculative": {"overlap_schedule": "off", "speculative_algorithm": "ngram",
                             "speculative_num_draft_tokens": 3, "speculative_ngram_max": 2},
             # The fake worker drafts, as the draft model's worker does.
             "draft": {"overlap_schedule": "off", "speculative_algorithm": "draft",
                       "speculative_draft_model_path": "fake",
                       "speculative_num_draft_tokens": 3}}
    h = SchedulerHarness(FakeModelWorker(max_total_tokens=pool, context_len=128),
                         chunked_prefill_size=chunk, max_running_requests=max_running,
                         disable_radix_cache=not radix, schedule_policy=policy,
                         **modes[decoding])
    if h.scheduler.drafter is not None and h.scheduler.drafter.proposer is not None:
        h.scheduler.drafter.proposer = FakeModelProposer(right=1, wrong=1)
    try:
        prompts = {}
        for i, spec in enumerate(requests):
            prompts[f"r{i}"] = (prefixes[spec["shared"]] + prompt(i, spec["length"]))[:41]
        for step in range(10_000):
            for i, spec in enumerate(requests):
                rid = f"r{i}"
                if spec["arrive"] == step:
                    params = {"temperature": 0.8, "seed": i} if spec["sampled"] else GREEDY
                    h.submit(rid, prompts[rid], max_new_tokens=spec["max_new"],
                             ignore_eos=spec["ignore_eos"], **params)
                if spec["abort_at"] is not None and spec["arrive"] + spec["abort_at"] == step:
                    h.send(AbortReq(rid=rid))
            h.step()
            h.assert_slots_accounted()
            if step > 6 and all(o.finished_reason is not None for o in h.outcomes.values()):
                break
        else:
            raise AssertionError("requests did not finish")
        h.scheduler.step()  # take in aborts that arrived for finished requests
        for i, spec in enumerate(requests):
            out = h.outcomes[f"r{i}"]
            assert out.finished_reason is not None
            if out.finished_reason.type == "abort":
                continue
            # Generation stops where the pool could not hold the request alone.
            max_new = min(spec["max_new"], pool - len(prompts[f"r{i}"]))
            expected = reference_output(prompts[f"r{i}"], max_new, spec["ignore_eos"])
            assert out.output_ids == expected, (f"r{i}", spec)
        h.assert_idle_invariant()
    finally:
        h.close()



# --------------------------------------------------------------------------- sampling info


def _count_sampling_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ``SamplingBatchInfo.from_requests`` to record each build's batch size."""
    builds: list[int] = []
    build = SamplingBatchInfo.from_requests

    def counting(cls: type, params: list, *args: object, **kwargs: object) -> object:
        builds.append(len(params))
        return build(params, *args, **kwargs)

    monkeypatch.setattr(SamplingBatchInfo, "from_requests", classmethod(counting))
    return builds


@pytest.mark.parametrize(("params", "steady"), [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "seed": 3}, True),  # greedy: the seed is never read
    ({"temperature": 0.8}, True),  # unseeded noise follows the sampler's calls, not the row
    ({"temperature": 0.8, "seed": 3}, False),  # its stream is read at the step's position
    ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
    ({"temperature": 0.0, "min_new_tokens": 2}, False),
    ({"temperature": 0.0, "regex": "[ab]+"}, False),
    ({"temperature": 0.0, "logit_bias": {"5": 3.0}}, True),  # the same bias every step
])
def test_steady_sampling_names_the_requests_whose_sampling_never_changes(
        params: dict[str, object], steady: bool) -> None:
    assert _req("r", 4, **params).steady_sampling is steady


def test_decode_steps_of_an_unchanged_batch_reuse_its_sampling_info(
        harness_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = _count_sampling_builds(monkeypatch)
    h = harness_factory()
    prompts = {f"r{i}": prompt(i, 6) for i in range(3)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.run()
    decodes = [c for c in h.worker.calls if c.mode == "decode"]
    assert len(decodes) == 9
    assert builds == [3]  # the prefill's serves all nine decode steps of the same requests
    for rid, ids in prompts.items():
        assert h.outcomes[rid].output_ids == reference_output(ids, 10, True), rid
    h.assert_idle_invariant()


@pytest.mark.parametrize(("other", "expected"), [
    # A penalty reads the tokens so far: the batch's info is built for every step.
    ({"max_new_tokens": 10, "repetition_penalty": 1.1}, [2] * 10),
    # A request that ends after two decode steps: one info while it runs, one after.
    ({"max_new_tokens": 3}, [2, 1]),
])
def test_the_sampling_info_is_built_again_where_it_would_change(
        harness_factory, monkeypatch: pytest.MonkeyPatch, other: dict[str, object],
        expected: list[int]) -> None:
    builds = _count_sampling_builds(monkeypatch)
    h = harness_factory()
    h.submit("steady", prompt(1, 6), max_new_tokens=10, ignore_eos=True, **GREEDY)
    h.submit("other", prompt(2, 6), ignore_eos=True, **other, **GREEDY)
    h.run()
    assert builds == expected
    assert h.outcomes["steady"].output_ids == reference_output(prompt(1, 6), 10, True)
    h.assert_idle_invariant()


# --------------------------------------------------------------------------- token_id_output


def _req(rid: str, prompt_len: int, **params: object) -> Req:
    return Req(rid=rid, handle=len(rid), origin_input_ids=prompt(len(rid), prompt_len),
               sampling_params=SamplingParams(**params))  # type: ignore[arg-type]


def test_token_id_output_sends_constants_once_and_ids_flat() -> None:
    a = _req("a", 8, stop=["\n"], skip_special_tokens=False)
    b = _req("bb", 3, no_stop_trim=True)
    a.cached_tokens = 4
    a.output_ids, b.output_ids = [11, 12], [21]
    first = token_id_output([a, b])
    assert first.handles.dtype == np.int64 and first.handles.tolist() == [a.handle, b.handle]
    assert first.output_ids.dtype == np.int32 and first.output_offsets.dtype == np.int32
    assert first.output_offsets.tolist() == [0, 2, 3]  # 2 ids and 1: offsets needed
    assert first.id_lists() == [[11, 12], [21]]
    assert [first.ids_of(0), first.ids_of(1)] == [[11, 12], [21]]
    assert first.new_indices == [0, 1]
    assert first.new_constants == [
        RequestConstants(skip_special_tokens=False, stop_strs=["\n"],
                         context_ids=a.origin_input_ids[-5:], prompt_tokens=8, cached_tokens=4),
        RequestConstants(no_stop_trim=True, context_ids=b.origin_input_ids, prompt_tokens=3),
    ]
    assert first.finished_indices == [] and first.output_token_logprobs is None
    # The next output of each carries only what is new; a newcomer brings its constants.
    c = _req("c", 2)
    a.output_ids += [13]
    b.output_ids += [22, 23]
    b.finished_reason = FinishReason("length")
    later = token_id_output([b, c, a])
    assert later.id_lists() == [[22, 23], [], [13]]
    assert later.output_offsets.tolist() == [0, 2, 2, 3]
    assert later.new_indices == [1] and later.new_constants[0].prompt_tokens == 2
    assert later.finished_indices == [0] and later.finished_reasons == [FinishReason("length")]
    assert later.finished_reason_list() == [FinishReason("length"), None, None]
    assert token_id_output([a]).id_lists() == [[]]  # nothing unsent: nothing sent twice
    # As many new ids for every request (the usual decode step): no offsets.
    a.output_ids += [14]
    c.output_ids += [31]
    uniform = token_id_output([a, c])
    assert uniform.output_offsets is None
    assert uniform.id_lists() == [[14], [31]] and uniform.ids_of(1) == [31]


def test_token_id_output_aligns_logprobs_with_the_ids() -> None:
    asked = _req("asked", 4)
    asked.return_logprob = True
    plain = _req("plain", 4)
    asked.output_ids, plain.output_ids = [5, 6], [7]
    asked.output_logprobs = [-0.5, -1.25]
    asked.output_top_logprobs_val = [[-0.5, -2.0], [-1.25, -3.0]]
    asked.output_top_logprobs_idx = [[5, 9], [6, 9]]
    out = token_id_output([plain, asked])
    assert out.output_token_logprobs is not None
    assert out.output_token_logprobs.dtype == np.float32
    assert np.isnan(out.output_token_logprobs[0])  # "plain" did not ask
    assert out.logprobs_of(0) == [] and out.top_logprobs_of(0) == ([], [])
    assert out.logprobs_of(1) == [-0.5, -1.25]
    assert out.top_logprobs_of(1) == ([[-0.5, -2.0], [-1.25, -3.0]], [[5, 9], [6, 9]])
    asked.output_ids.append(8)
    asked.output_logprobs.append(-0.75)
    asked.output_top_logprobs_val.append([-0.75])
    asked.output_top_logprobs_idx.append([8])
    later = token_id_output([asked])
    assert later.logprobs_of(0) == [-0.75] and later.top_logprobs_of(0) == ([[-0.75]], [[8]])


def test_queue_time_runs_from_intake_to_first_admission(harness_factory, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    h = harness_factory(max_running_requests=1)
    h.submit("first", prompt(1, 6), max_new_tokens=3, ignore_eos=True, **GREEDY)
    h.submit("second", prompt(2, 6), max_new_tokens=3, ignore_eos=True, **GREEDY)
    h.step()  # both taken in; only the first admitted
    now[0] += 5.0
    h.run()
    assert h.outcomes["first"].queue_seconds == 0.0
    assert h.outcomes["second"].queue_seconds == 5.0
    h.assert_idle_invariant()


def test_the_idle_check_compares_the_slots_not_their_counts(harness_factory) -> None:
    h = harness_factory()
    h.submit("r", prompt(3, 12), max_new_tokens=4, ignore_eos=True, **GREEDY)
    h.run()
    scheduler = h.scheduler
    assert scheduler.memory_is_free()
    held = scheduler.tree_cache.held_indices()
    assert held.numel() > 0, "the prefix cache keeps the finished request's slots"
    # One cached slot also on the free list, one free slot lost: every count still adds up.
    free = scheduler.allocator.free_indices()
    scheduler.allocator._free_slots = torch.cat([free[1:], held[:1]])
    scheduler.allocator._freed = []
    assert scheduler.allocator.available_size() == free.numel()
    assert not scheduler.memory_is_free()
    assert "1 accounted for nowhere, 1 accounted for more than once" in (
        scheduler.slot_accounting_problem() or "")
