"""Penalty state: each request's tokens as the repetition, frequency and presence penalties
see them, kept across steps."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from framework.sampling_params import SamplingParams


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise ``ValueError`` if a token id cannot index a row of ``vocab_size`` logits."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise ValueError(f"{what} holds token ids outside [0, {vocab_size})")


class PenaltyHistory:
    """One request's tokens as its penalties see them, kept up to date token by token.

    ``seen`` (``[vocab]`` bool, prompt and output tokens) feeds the repetition
    penalty, ``counts`` (``[vocab]`` float32, output tokens) the frequency and
    presence penalties; each is ``None`` when its penalty is off. Kept on the
    request across steps, so that a step stacks rows instead of rebuilding them
    from every token of every prompt.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        #: How many output tokens have been added.
        self.num_outputs = 0
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._mark_seen(prompt_ids, "prompt_ids")
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    @property
    def active(self) -> bool:
        """Whether any penalty needs this history."""
        return self.seen is not None or self.counts is not None

    def add_outputs(self, token_ids: Sequence[int]) -> None:
        """Count newly generated tokens."""
        self.num_outputs += len(token_ids)
        if not token_ids:
            return
        self._mark_seen(token_ids, "output_ids")
        if self.counts is not None:
            check_token_ids(token_ids, self.vocab_size, "output_ids")
            tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.counts.device)
            self.counts.index_put_((tokens,), torch.ones_like(tokens, dtype=torch.float32),
                                   accumulate=True)

    def _mark_seen(self, token_ids: Sequence[int], what: str) -> None:
        if self.seen is not None and token_ids:
            check_token_ids(token_ids, self.vocab_size, what)
            self.seen[torch.tensor(token_ids, dtype=torch.int64, device=self.seen.device)] = True
