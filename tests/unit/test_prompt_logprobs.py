"""Prompt logprobs in the Scheduler, on the fake model: positions, chunking, cache and retraction.

The fake model's logits at a position are one-hot at ``next_token`` of the tokens
it reads back from the KV cache up to there, so the top-1 alternative of every
prompt position says exactly which logits row (and which cached tokens) the
Scheduler used for it.
"""

from __future__ import annotations

import pytest

from tests.fake_worker import FakeModelWorker, Outcome, next_token, prompt

GREEDY = {"temperature": 0.0}
# The fake's logits: +30 at its choice, -30 elsewhere; log_softmax gives ~0 and ~-60.
CHOSEN, OTHER = 0.0, -60.0


def assert_prompt_logprobs(outcome: Outcome, ids: list[int], start: int) -> None:
    """Every position from ``start`` carries the fake model's view of the prompt before it."""
    got = outcome.prompt_logprobs
    assert got is not None, "the prompt's logprobs never came"
    assert got.start == start
    assert got.token_ids == ids[start:]
    assert len(got.values) == len(got.top_ids) == len(ids) - start
    for k, position in enumerate(range(start, len(ids))):
        if position == 0:
            assert got.values[k] is None and got.top_ids[k] == []
            continue
        expected = next_token(ids[:position])
        assert got.top_ids[k] == [expected], position
        want = CHOSEN if ids[position] == expected else OTHER
        assert got.values[k] == pytest.approx(want, abs=1e-3), position


def test_chunked_prefill_gives_every_position_once(harness_factory) -> None:
    h = harness_factory(chunked_prefill_size=4, disable_radix_cache=True)
    ids = prompt(1, 10)
    ids[5] = next_token(ids[:5])  # one position the model predicts: logprob ~0, not ~-60
    h.submit("r", ids, max_new_tokens=3, ignore_eos=True, return_logprob=True,
             top_logprobs_num=1, logprob_start_len=0, **GREEDY)
    outcome = h.run()["r"]
    extends = [c for c in h.worker.calls if c.mode == "extend"]
    assert [c.extend_lens for c in extends] == [[4], [4], [2]]
    assert_prompt_logprobs(outcome, ids, 0)
    assert outcome.prompt_logprobs.values[5] == pytest.approx(CHOSEN, abs=1e-3)
    assert len(outcome.logprobs) == 3  # the output's own logprobs still come
    h.assert_idle_invariant()


def test_max_new_tokens_zero_returns_only_the_prompt(harness_factory) -> None:
    h = harness_factory()
    ids = prompt(2, 12)
    h.submit("r", ids, max_new_tokens=0, return_logprob=True, top_logprobs_num=1,
             logprob_start_len=3, **GREEDY)
    outcome = h.run()["r"]
    assert outcome.output_ids == [] and outcome.finished_reason.type == "length"
    assert_prompt_logprobs(outcome, ids, 3)
    h.assert_idle_invariant()


def test_a_cached_prefix_is_reused_only_up_to_the_first_position_asked(harness_factory) -> None:
    h = harness_factory()
    shared = prompt(7, 40)
    h.submit("warm", [*shared, 11], max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.run()
    # Position p needs the logits at p - 1: only [0, p - 1) may come from the cache.
    # (start, tokens expected from the cache; from the second case on, the whole
    # prompt is cached.)
    cases = {"from20": (20, 19), "from0": (0, 0), "from1": (1, 0), "from42": (42, 41)}
    for rid, (start, cached) in cases.items():
        h.submit(rid, [*shared, 21, 22, 23], max_new_tokens=2, ignore_eos=True,
                 return_logprob=True, top_logprobs_num=1, logprob_start_len=start, **GREEDY)
        h.run()
        outcome = h.outcomes[rid]
        assert outcome.cached_tokens == cached, rid
        assert_prompt_logprobs(outcome, [*shared, 21, 22, 23], start)
    h.assert_idle_invariant()


def test_without_prompt_logprobs_nothing_is_sent_or_recomputed(harness_factory) -> None:
    h = harness_factory()
    shared = prompt(3, 30)
    h.submit("warm", [*shared, 5], max_new_tokens=2, ignore_eos=True, **GREEDY)
    h.run()
    h.submit("outputs_only", [*shared, 6], max_new_tokens=2, ignore_eos=True,
             return_logprob=True, **GREEDY)
    outcomes = h.run()
    assert outcomes["outputs_only"].prompt_logprobs is None
    assert outcomes["outputs_only"].cached_tokens == len(shared)
    assert len(outcomes["outputs_only"].logprobs) == 2


def test_retraction_keeps_the_positions_already_computed(harness_factory) -> None:
    worker = FakeModelWorker(max_total_tokens=64)
    h = harness_factory(worker, chunked_prefill_size=8)
    prompts = {f"r{i}": prompt(i, 14 + 5 * i) for i in range(4)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, max_new_tokens=16, ignore_eos=True, return_logprob=True,
                 top_logprobs_num=1, logprob_start_len=0, **GREEDY)
    h.run()
    assert h.scheduler.stats.retracted_requests > 0, "the pool was meant to run short"
    for rid, ids in prompts.items():
        assert_prompt_logprobs(h.outcomes[rid], ids, 0)
    h.assert_idle_invariant()


def test_a_start_past_the_prompt_is_refused_by_the_scheduler_too(harness_factory) -> None:
    h = harness_factory()
    h.submit("r", prompt(4, 6), max_new_tokens=2, return_logprob=True, logprob_start_len=6,
             **GREEDY)
    reason = h.run()["r"].finished_reason
    assert reason.type == "abort" and "logprob_start_len" in reason.message
    h.assert_idle_invariant()
