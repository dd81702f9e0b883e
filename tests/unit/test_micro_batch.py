"""Pipeline micro-batches: a step's requests split by request-pool row, logits put back."""

from __future__ import annotations

import torch

from framework.distributed.micro_batch import merge_logits, split_micro_batches
from framework.forward_batch import ForwardBatch, ForwardMode


def mixed_batch() -> ForwardBatch:
    """Three prefills (3, 4 and 2 new tokens) and one decode token (a mixed step)."""
    return ForwardBatch(
        ForwardMode.EXTEND, 4, input_ids=torch.arange(10) + 50, positions=torch.arange(10),
        req_pool_indices=torch.tensor([3, 4, 5, 6]), seq_lens=torch.tensor([3, 4, 2, 5]),
        out_cache_loc=torch.arange(100, 110), extend_prefix_lens=torch.tensor([0, 0, 0, 4]),
        extend_seq_lens=torch.tensor([3, 4, 2, 1]), prompt_logprob_rows=torch.tensor([1, 4, 5]),
        decode_tail=1)


def test_requests_split_by_pool_row_with_their_tokens_and_prompt_rows() -> None:
    even, odd = split_micro_batches(mixed_batch())
    assert (even.batch.micro_batch, odd.batch.micro_batch) == (0, 1)
    assert even.batch.req_pool_indices_cpu == [4, 6] and odd.batch.req_pool_indices_cpu == [3, 5]
    assert even.batch.input_ids.tolist() == [53, 54, 55, 56, 59]
    assert even.batch.out_cache_loc.tolist() == [103, 104, 105, 106, 109]
    assert even.batch.extend_seq_lens_cpu == [4, 1] and even.batch.extend_prefix_lens_cpu == [0, 4]
    assert even.batch.seq_lens_cpu == [4, 5] and even.batch.decode_tail == 1
    assert odd.batch.decode_tail == 0 and odd.batch.positions.tolist() == [0, 1, 2, 7, 8]
    # Prompt rows 4 and 5 (request 4's) are its rows 1 and 2; row 1 (request 3's) odd's 1.
    assert even.batch.prompt_logprob_rows is not None and odd.batch.prompt_logprob_rows is not None
    assert even.batch.prompt_logprob_rows.tolist() == [1, 2]
    assert odd.batch.prompt_logprob_rows.tolist() == [1]
    assert even.logits_rows == [1, 3, 5, 6] and odd.logits_rows == [0, 2, 4]


def test_each_micro_batch_logits_go_back_to_their_rows() -> None:
    parts = split_micro_batches(mixed_batch())
    whole = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)  # 4 last-token + 3 prompt rows
    pieces = [(part, whole[torch.tensor(part.logits_rows)]) for part in parts]
    assert torch.equal(merge_logits(pieces, 7), whole)


def test_a_batch_in_one_micro_batch_stays_whole() -> None:
    batch = ForwardBatch(ForwardMode.DECODE, 2, input_ids=torch.tensor([7, 8]),
                         positions=torch.tensor([5, 9]), req_pool_indices=torch.tensor([2, 4]),
                         seq_lens=torch.tensor([6, 10]), out_cache_loc=torch.tensor([11, 12]))
    (part,) = split_micro_batches(batch)
    assert part.batch.micro_batch == 0 and part.logits_rows == [0, 1]
    assert part.batch.input_ids.tolist() == [7, 8] and part.batch.decode_tail == 0

