"""The router's policies: prefix affinity, the imbalance fallback, round robin, shortest queue."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from framework.router.policies import (
    CacheAware,
    CacheAwareSettings,
    RoundRobin,
    ShortestQueue,
    make_policy,
)
from framework.router.prompt_text import prompt_text

SHARED = "You are a helpful assistant. " * 20  # a long system prompt many requests share


@dataclass
class FakeWorker:
    url: str
    load: int = 0


def workers(*loads: int) -> list[FakeWorker]:
    return [FakeWorker(f"http://w{i}", load) for i, load in enumerate(loads)]


def cache_aware(**overrides: float) -> CacheAware:
    settings = {"cache_threshold": 0.5, "balance_abs_threshold": 4,
                "balance_rel_threshold": 2.0, "max_tree_chars": 100_000, **overrides}
    return CacheAware(CacheAwareSettings(**settings))  # type: ignore[arg-type]


def test_requests_sharing_a_prefix_go_to_the_worker_that_saw_it() -> None:
    policy, pool = cache_aware(), workers(0, 0, 0)
    first = policy.choose(pool, SHARED + "question 0")
    assert first.reason == "smallest_tree"
    # The other trees are empty, hence smaller, yet the prefix wins.
    for i in range(1, 6):
        choice = policy.choose(pool, SHARED + f"question {i}")
        assert choice.worker is first.worker and choice.reason == "prefix"
        assert choice.matched_chars >= len(SHARED)


def test_unrelated_prompts_spread_to_the_smallest_trees() -> None:
    policy, pool = cache_aware(), workers(0, 0, 0)
    chosen = {policy.choose(pool, f"{i} unrelated prompt number {i}").worker.url
              for i in range(3)}
    assert chosen == {w.url for w in pool}


def test_a_match_below_the_cache_threshold_does_not_count() -> None:
    policy, pool = cache_aware(cache_threshold=0.9), workers(0, 0)
    owner = policy.choose(pool, SHARED).worker
    # Half of this prompt matches owner's tree: under 0.9, so the empty tree wins.
    choice = policy.choose(pool, SHARED + "x" * len(SHARED))
    assert choice.worker is not owner and choice.reason == "smallest_tree"


def test_imbalance_sends_to_the_least_loaded_worker_despite_the_prefix() -> None:
    policy, pool = cache_aware(), workers(0, 0, 0)
    owner = policy.choose(pool, SHARED).worker
    owner.load = 10  # 10 - 0 > 4 and 10 > 2 x 0
    choice = policy.choose(pool, SHARED + "more")
    assert choice.worker is not owner and choice.reason == "balance"
    assert choice.worker.load == 0
    # The winner's tree now holds the prompt too: balanced again, it matches there.
    owner.load = 0
    again = policy.choose([w for w in pool if w is not owner], SHARED + "more")
    assert again.worker is choice.worker and again.reason == "prefix"


def test_a_small_load_gap_keeps_the_affinity() -> None:
    policy, pool = cache_aware(), workers(0, 0)
    owner = policy.choose(pool, SHARED).worker
    owner.load = 4  # not more than the absolute threshold
    assert policy.choose(pool, SHARED + "more").worker is owner


def test_forget_drops_a_worker_tree() -> None:
    policy, pool = cache_aware(), workers(0, 0)
    owner = policy.choose(pool, SHARED).worker
    policy.forget(owner.url)
    assert policy.tree_chars(owner.url) == 0


def test_round_robin_takes_each_worker_in_turn() -> None:
    policy, pool = RoundRobin(), workers(5, 0, 9)
    assert [policy.choose(pool, "p").worker.url for _ in range(6)] == [
        "http://w0", "http://w1", "http://w2"] * 2


def test_shortest_queue_takes_the_least_loaded_worker() -> None:
    policy = ShortestQueue()
    assert policy.choose(workers(3, 1, 2), "p").worker.url == "http://w1"
    assert policy.choose(workers(2, 5, 2), "p").worker.url == "http://w0"  # first on a tie


def test_make_policy_names() -> None:
    settings = CacheAwareSettings()
    assert isinstance(make_policy("round_robin", settings), RoundRobin)
    assert isinstance(make_policy("cache_aware", settings), CacheAware)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random", settings)


def test_prompt_text_of_each_route() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text("/v1/chat/completions", chat) == "system:be brief\nuser:hi\n"
    assert prompt_text("/v1/completions", {"prompt": "once upon"}) == "once upon"
    assert prompt_text("/generate", {"text": "abc"}) == "abc"
    assert prompt_text("/generate", {"input_ids": [1, 2, 3]}) == "1 2 3"
    assert prompt_text("/v1/embeddings", {"input": ["a", "b"]}) == "a b"
    assert prompt_text("/v1/completions", "not an object") == ""
