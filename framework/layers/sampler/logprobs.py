"""Log-probabilities of chosen tokens under the raw logits, and each row's top alternatives."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _top_logprobs(
    logprobs: torch.Tensor, top_logprobs_nums: Sequence[int]
) -> tuple[list[list[float]], list[list[int]]]:
    """Per row, the ``N`` largest log-probabilities and their token ids (one ``topk`` for all)."""
    largest = min(max(top_logprobs_nums, default=0), logprobs.shape[-1])
    if largest == 0:
        return [[] for _ in top_logprobs_nums], [[] for _ in top_logprobs_nums]
    values, ids = logprobs.topk(largest, dim=-1)
    value_rows, id_rows = values.tolist(), ids.tolist()
    return (
        [row[:n] for row, n in zip(value_rows, top_logprobs_nums, strict=True)],
        [row[:n] for row, n in zip(id_rows, top_logprobs_nums, strict=True)],
    )


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_logprobs_nums: Sequence[int]
) -> tuple[torch.Tensor, list[list[float]], list[list[int]]]:
    """Log-probabilities of ``token_ids[i]`` under row ``i`` of the raw ``logits``.

    Returns the chosen tokens' logprobs ``[rows]`` (float32) and, per row, the
    ``top_logprobs_nums[i]`` largest logprobs with their token ids. Used for the
    sampled tokens and for the prompt's own tokens (prompt logprobs) alike.
    """
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw_logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    top_values, top_ids = _top_logprobs(raw_logprobs, top_logprobs_nums)
    return chosen, top_values, top_ids
