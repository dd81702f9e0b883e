"""Which drafted tokens the target model accepts, and the token it adds after them.

The target scores a request's last token and its ``k`` drafted tokens in one forward, which
gives ``k + 1`` next-token distributions: position ``i`` predicts the token after draft
``i - 1``. Verification walks the drafts in order:

- greedy rows accept draft ``i`` while it equals the target's argmax at position ``i``, then
  emit the target's own token at the first mismatch (or after the last draft), so the output
  is exactly what plain greedy decoding gives;
- sampled rows accept draft ``x`` at position ``i`` with probability ``min(1, p(x) / q(x))``
  (``p`` the target's processed distribution, ``q`` the proposer's) and, at the first
  rejection, draw from ``max(0, p - q)`` renormalised; after ``k`` acceptances they draw
  the bonus token from ``p`` at position ``k``. Every emitted token is then distributed as
  the target alone would sample it (Leviathan et al., 2023; Chen et al., 2023). A proposer
  that drafts deterministically (n-gram lookup) has ``q`` one-hot on its draft.

Rows carry different numbers of drafts; ``draft_lens`` says how many of a row's ``k`` are
real, and positions past them are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Per row: how many drafts were accepted and the tokens to append (accepted + one)."""

    accepted: torch.Tensor  # [B] int64, 0..draft_lens
    tokens: torch.Tensor  # [B, k + 1] int64; row b's first accepted[b] + 1 are its output

    def row_tokens(self, row: int) -> list[int]:
        """The tokens row ``row`` appends: its accepted drafts, then the target's token."""
        return self.tokens[row, : int(self.accepted[row]) + 1].tolist()


def _accepted_prefix(matches: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """Per row, the length of the leading run of True in ``matches`` ``[B, k]``, capped at
    the row's draft length."""
    k = matches.shape[1]
    real = torch.arange(k, device=matches.device).unsqueeze(0) < draft_lens.unsqueeze(1)
    run = (matches & real).to(torch.int64).cumprod(dim=1)
    return run.sum(dim=1)


def accept_greedy(drafted: Sequence[int], targets: Sequence[int]) -> list[int]:
    """Greedy verification of one request: the drafts up to the first that differs from
    the model's argmax at its position, then the model's token there. ``targets`` holds
    the argmax at every fed position, one more than ``drafted``."""
    for j, token in enumerate(drafted):
        if token != targets[j]:
            return [*drafted[:j], targets[j]]
    return [*drafted, targets[len(drafted)]]


def verify_sampled(target_probs: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor,
                   uniforms: torch.Tensor, generator: torch.Generator | None = None,
                   draft_probs: torch.Tensor | None = None) -> Verdict:
    """Rejection sampling against the target's processed distributions.

    Args:
        target_probs: ``[B, k + 1, V]``, each row a distribution (temperature, top-k/p, min-p
            already applied).
        drafts: ``[B, k]`` drafted tokens.
        draft_lens: ``[B]`` real drafts per row.
        uniforms: ``[B, k]`` U(0, 1) draws deciding acceptance.
        generator: drives the draws of the replacement and bonus tokens.
        draft_probs: ``[B, k, V]`` the proposer's distributions; None for a deterministic
            proposer (one-hot on the draft).
    """
    batch, k = drafts.shape
    positions = torch.arange(k, device=drafts.device)
    rows = torch.arange(batch, device=drafts.device).unsqueeze(1)
    p_draft = target_probs[rows, positions.unsqueeze(0), drafts]  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs[rows, positions.unsqueeze(0), drafts]
    # u < p / q, written as u * q < p so that q == 0 (never drafted) cannot divide.
    accepted = _accepted_prefix(uniforms * q_draft < p_draft, draft_lens)

    # The distribution of the token after the accepted drafts: the residual at the first
    # rejected position, or the target's own at position k when every real draft passed.
    stop = accepted  # position of that token, per row
    p_stop = target_probs[torch.arange(batch), stop]  # [B, V]
    rejected = accepted < draft_lens
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop)
        q_stop[torch.arange(batch), drafts.gather(1, stop.clamp(max=k - 1).unsqueeze(1))
               .squeeze(1)] = 1.0
    else:
        q_stop = draft_probs[torch.arange(batch), stop.clamp(max=k - 1)]
    residual = (p_stop - q_stop).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A residual with no mass (p <= q everywhere, so p == q) cannot occur after a rejection
    # except by rounding; p itself is then the right distribution.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_stop)
    final = torch.where(rejected.unsqueeze(1), residual, p_stop)
    extra = torch.multinomial(final, 1, generator=generator).squeeze(1)

    tokens = torch.zeros(batch, k + 1, dtype=torch.int64, device=drafts.device)
    tokens[:, :k] = drafts
    tokens[torch.arange(batch), stop] = extra
    return Verdict(accepted=accepted, tokens=tokens)
