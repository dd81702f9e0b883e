"""Speculative verification: greedy parity, and rejection sampling keeping the target's
distribution (checked by chi-square against plain sampling, with fixed seeds)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.speculative import NgramProposer, accept_greedy, verify_sampled
from framework.speculative.ngram import DRAFT_LENGTH_FLOOR, DraftLength

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_999 = {3: 16.27, 4: 18.47}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against ``probs`` (cells with p > 0)."""
    expected = probs * counts.sum()
    keep = probs > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_accepts_the_leading_run_that_matches_the_target() -> None:
    targets = [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], targets) == [5, 6, 7, 8]
    assert accept_greedy([5, 9, 7], targets) == [5, 6]
    assert accept_greedy([1, 6, 7], targets) == [5]
    # Every row's output is the target's own greedy continuation.
    assert accept_greedy([5, 6], targets[:3]) == [5, 6, 7]
    assert accept_greedy([], [5]) == [5]


def _trials(target: torch.Tensor, draft_probs: torch.Tensor | None, draws: torch.Tensor,
            n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``n`` one-row verifications; counts of the first and of the second emitted token
    (the latter among trials that emitted two)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.shape[-1]
    targets = target.expand(n, -1, -1)
    uniforms = torch.rand(n, draws.shape[1], generator=generator)
    verdict = verify_sampled(targets, draws, torch.full((n,), draws.shape[1]), uniforms,
                             generator=generator,
                             draft_probs=None if draft_probs is None
                             else draft_probs.expand(n, -1, -1))
    first = torch.bincount(verdict.tokens[:, 0], minlength=vocab).float()
    second_rows = verdict.accepted >= 1
    second = torch.bincount(verdict.tokens[second_rows, 1], minlength=vocab).float()
    return first, second


P = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05],
                  [0.3, 0.1, 0.3, 0.2, 0.1],
                  [0.2, 0.2, 0.2, 0.2, 0.2]]).unsqueeze(0)  # [1, k + 1 = 3, V = 5]


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_s() -> None:
    q = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1], [0.1, 0.6, 0.1, 0.1, 0.1]]).unsqueeze(0)
    generator = torch.Generator().manual_seed(1)
    n = 40_000
    draws = torch.multinomial(q[0], n, replacement=True, generator=generator).T.contiguous()
    first, _ = _trials(P, q, draws, n, seed=2)
    assert chi_square(first, P[0, 0]) < CHI2_999[4]


def test_rejection_sampling_with_a_deterministic_draft_keeps_the_target_s() -> None:
    n = 40_000
    draws = torch.tensor([[1, 0]]).expand(n, -1)
    first, second = _trials(P, None, draws, n, seed=3)
    assert chi_square(first, P[0, 0]) < CHI2_999[4]
    # Given the first draft was accepted, the second token follows P[1].
    assert chi_square(second, P[0, 1]) < CHI2_999[4]
    # The first draft (token 1, p = 0.4 at position 0) is accepted that often.
    assert second.sum() == pytest.approx(n * 0.4, rel=0.05)


def test_accepting_every_draft_breaks_the_target_s_distribution() -> None:
    """The statistical check can tell: a verifier that accepts every draft is caught."""
    n = 40_000
    draws = torch.tensor([[1, 0]]).expand(n, -1)
    always = torch.zeros(n, 2)  # u = 0 accepts any draft with p > 0
    generator = torch.Generator().manual_seed(4)
    verdict = verify_sampled(P.expand(n, -1, -1), draws, torch.full((n,), 2), always,
                             generator=generator)
    first = torch.bincount(verdict.tokens[:, 0], minlength=5).float()
    assert chi_square(first, P[0, 0]) > CHI2_999[4]


def test_ngram_drafts_what_followed_the_latest_match_longest_first() -> None:
    proposer = NgramProposer(num_draft_tokens=3, max_ngram=3)
    # The tail (7, 8) occurred twice; the latest earlier occurrence is followed by 1, 2, 3.
    assert proposer.propose([7, 8, 9, 9, 7, 8, 1, 2, 3, 4, 7, 8]) == [1, 2, 3]
    # A longer match wins over a later shorter one: (5, 7, 8) occurred once.
    assert proposer.propose([5, 7, 8, 4, 4, 6, 7, 8, 0, 5, 7, 8]) == [4, 4, 6]
    assert proposer.propose([1, 2, 3]) == []
    assert proposer.propose([1, 2, 1], limit=2) == [2, 1]
    assert proposer.propose([4, 4], limit=0) == []
    # A match that runs into the tail continues the run's period through the draft.
    assert proposer.propose([9, 4, 5, 4, 5]) == [4, 5, 4]
    assert proposer.propose([3, 3]) == [3, 3, 3]


def _lookup_reference(seq: list[int], k: int, max_ngram: int, min_ngram: int,
                      limit: int | None) -> list[int]:
    """Prompt lookup by its definition: for the longest tail first, the latest earlier
    window equal to it, and the tokens after that window, copied one at a time onto the
    end of the sequence (so that a copy reaching the end reads what it has copied)."""
    budget = k if limit is None else min(limit, k)
    if budget <= 0:
        return []
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for start in reversed(range(len(seq) - n)):
            if seq[start:start + n] == seq[len(seq) - n:]:
                extended = list(seq)
                for i in range(start + n, start + n + budget):
                    extended.append(extended[i])
                return extended[len(seq):]
    return []


@settings(max_examples=400, deadline=None)
@given(seq=st.lists(st.integers(0, 3), max_size=24), k=st.integers(1, 5),
       max_ngram=st.integers(1, 5), min_ngram=st.integers(1, 5),
       limit=st.one_of(st.none(), st.integers(0, 6)))
def test_ngram_drafts_as_the_lookup_s_definition_says(seq: list[int], k: int, max_ngram: int,
                                                      min_ngram: int, limit: int | None) -> None:
    min_ngram = min(min_ngram, max_ngram)
    proposer = NgramProposer(num_draft_tokens=k, max_ngram=max_ngram, min_ngram=min_ngram)
    assert proposer.propose(seq, limit) == _lookup_reference(seq, k, max_ngram, min_ngram,
                                                             limit)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), max_size=12),
       chunks=st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=8),
       max_ngram=st.integers(1, 4))
def test_an_index_kept_up_to_date_drafts_as_one_made_anew(
        prompt: list[int], chunks: list[list[int]], max_ngram: int) -> None:
    proposer = NgramProposer(num_draft_tokens=3, max_ngram=max_ngram)
    index = proposer.index()
    output: list[int] = []
    for chunk in chunks:
        output.extend(chunk)  # a step's accepted tokens
        index.sync(prompt, output)
        assert index.tokens == prompt + output
        assert proposer.draft(index) == proposer.propose(prompt + output)
    index.sync(prompt[:1], [])  # another, shorter sequence: indexed anew
    assert index.tokens == prompt[:1] and proposer.draft(index) == []


def test_ngram_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="num_draft_tokens"):
        NgramProposer(num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(num_draft_tokens=2, min_ngram=3, max_ngram=2)


def test_a_draft_length_doubles_when_kept_whole_and_shrinks_to_what_was_kept() -> None:
    length = DraftLength(most=12)
    assert length.current == DRAFT_LENGTH_FLOOR == 4
    length.update(drafted=4, accepted=4)
    assert length.current == 8
    length.update(drafted=8, accepted=8)
    assert length.current == 12  # at most `most`
    length.update(drafted=12, accepted=9)
    assert length.current == 10  # one more than the part kept
    length.update(drafted=10, accepted=0)
    assert length.current == DRAFT_LENGTH_FLOOR  # never under the floor
    length.update(drafted=1, accepted=1)  # a draft cut short by the room left
    assert length.current == DRAFT_LENGTH_FLOOR
    assert DraftLength(most=2).current == 2
