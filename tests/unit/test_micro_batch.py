"""Pipeline micro-batches: planned by tokens and kept from step to step, logits put back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework.distributed.micro_batch import (
    MicroBatchPlanner,
    balanced_parts,
    merge_logits,
    split_micro_batches,
)
from framework.forward_batch import ForwardBatch, ForwardMode


def mixed_batch() -> ForwardBatch:
    """Three prefills (3, 4 and 2 new tokens) and one decode token (a mixed step)."""
    return ForwardBatch(
        ForwardMode.EXTEND, 4, input_ids=torch.arange(10) + 50, positions=torch.arange(10),
        req_pool_indices=torch.tensor([3, 4, 5, 6]), seq_lens=torch.tensor([3, 4, 2, 5]),
        out_cache_loc=torch.arange(100, 110), extend_prefix_lens=torch.tensor([0, 0, 0, 4]),
        extend_seq_lens=torch.tensor([3, 4, 2, 1]), prompt_logprob_rows=torch.tensor([1, 4, 5]),
        decode_tail=1)


def decode_batch(rows: list[int]) -> ForwardBatch:
    """One decode token for each request on ``rows``."""
    n = len(rows)
    return ForwardBatch(ForwardMode.DECODE, n, input_ids=torch.arange(n) + 7,
                        positions=torch.arange(n) + 5, req_pool_indices=torch.tensor(rows),
                        seq_lens=torch.arange(n) + 6, out_cache_loc=torch.arange(n) + 11)


def test_requests_split_as_planned_with_their_tokens_and_prompt_rows() -> None:
    planned = dataclasses.replace(mixed_batch(), micro_batch_plan=[1, 0, 1, 0])
    first, second = split_micro_batches(planned)
    assert (first.batch.micro_batch, second.batch.micro_batch) == (0, 1)
    assert first.batch.req_pool_indices_cpu == [4, 6]
    assert second.batch.req_pool_indices_cpu == [3, 5]
    assert first.batch.input_ids.tolist() == [53, 54, 55, 56, 59]
    assert first.batch.out_cache_loc.tolist() == [103, 104, 105, 106, 109]
    assert first.batch.extend_seq_lens_cpu == [4, 1]
    assert first.batch.extend_prefix_lens_cpu == [0, 4]
    assert first.batch.seq_lens_cpu == [4, 5] and first.batch.decode_tail == 1
    assert second.batch.decode_tail == 0 and second.batch.positions.tolist() == [0, 1, 2, 7, 8]
    # Prompt rows 4 and 5 (request 4's) are its rows 1 and 2; row 1 (request 3's) second's 1.
    assert first.batch.prompt_logprob_rows is not None
    assert second.batch.prompt_logprob_rows is not None
    assert first.batch.prompt_logprob_rows.tolist() == [1, 2]
    assert second.batch.prompt_logprob_rows.tolist() == [1]
    assert first.logits_rows == [1, 3, 5, 6] and second.logits_rows == [0, 2, 4]


def test_each_micro_batch_logits_go_back_to_their_rows() -> None:
    parts = split_micro_batches(MicroBatchPlanner().plan(mixed_batch()))
    assert len(parts) == 2
    whole = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)  # 4 last-token + 3 prompt rows
    pieces = [(part, whole[torch.tensor(part.logits_rows)]) for part in parts]
    assert torch.equal(merge_logits(pieces, 7), whole)


def test_one_request_is_one_micro_batch() -> None:
    (part,) = split_micro_batches(MicroBatchPlanner().plan(decode_batch([4])))
    assert part.logits_rows == [0] and part.batch.input_ids.tolist() == [7]


def test_requests_on_rows_of_one_parity_still_run_as_two_micro_batches() -> None:
    """Two requests decoding on rows 0 and 2 (one micro-batch each step when the split
    was by row parity): two micro-batches at every step, each request in the same one."""
    planner = MicroBatchPlanner()
    steps = [split_micro_batches(planner.plan(decode_batch([0, 2]))) for _ in range(39)]
    assert sum(len(parts) for parts in steps) == 78
    homes = {tuple(part.batch.req_pool_indices_cpu or []): part.batch.micro_batch
             for parts in steps for part in parts}
    assert homes in ({(0,): 0, (2,): 1}, {(0,): 1, (2,): 0})


def test_prefills_are_balanced_by_tokens_not_by_count() -> None:
    parts = balanced_parts([100, 3, 50, 40], [None] * 4)
    load = [sum(t for t, p in zip([100, 3, 50, 40], parts, strict=True) if p == part)
            for part in (0, 1)]
    assert sorted(load) == [93, 100]
    assert parts[0] != parts[2]  # the two largest apart


def test_a_request_keeps_its_micro_batch_unless_the_balance_needs_a_move() -> None:
    planner = MicroBatchPlanner()
    first = planner.plan(decode_batch([0, 1, 2, 3])).micro_batch_plan
    assert first is not None and sorted(first) == [0, 0, 1, 1]
    # Rows joining in a mixed step go to the lighter micro-batch; the decoding ones stay.
    mixed = dataclasses.replace(mixed_batch(), req_pool_indices=torch.tensor([7, 8, 9, 0]),
                                req_pool_indices_cpu=None)
    plan = planner.plan(mixed).micro_batch_plan
    assert plan is not None and plan[3] == first[0]
    kept = planner.plan(decode_batch([0, 1, 2, 3])).micro_batch_plan
    assert kept == first
    # The requests of one micro-batch finished: one of the others moves, then stays.
    alone = [row for row, part in zip([0, 1, 2, 3], first, strict=True) if part == first[0]]
    moved = planner.plan(decode_batch(alone)).micro_batch_plan
    assert moved is not None and sorted(moved) == [0, 1]
    assert planner.plan(decode_batch(alone)).micro_batch_plan == moved


def test_the_split_needs_rank_0_s_plan() -> None:
    with pytest.raises(ValueError, match="micro_batch_plan"):
        split_micro_batches(decode_batch([0, 1]))
