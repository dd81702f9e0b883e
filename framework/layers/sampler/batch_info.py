"""``SamplingBatchInfo``: a batch's sampling parameters and token histories as per-row
tensors, and how they are built from the batch's requests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from framework.layers.sampler.penalties import PenaltyHistory, check_token_ids
from framework.sampling_params import SamplingParams


def _rows_and_tokens(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into parallel (row index, token id) tensors."""
    rows = [row for row, token_ids in enumerate(token_lists) for _ in token_ids]
    tokens = [token for token_ids in token_lists for token in token_ids]
    check_token_ids(tokens, vocab_size, what)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _token_mask(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device, what: str
) -> torch.Tensor:
    """``[B, vocab]`` bool: True where the token occurs in the row's list."""
    mask = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=device)
    rows, tokens = _rows_and_tokens(token_lists, vocab_size, device, what)
    if tokens.numel():
        mask[rows, tokens] = True
    return mask


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """``[B, 1]`` float32 tensor, shaped to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _logit_bias(params: Sequence[SamplingParams], vocab_size: int, device: torch.device
                ) -> torch.Tensor | None:
    """``[B, vocab]`` biases to add to the logits, or None when no row has any."""
    biases = [request.logit_bias_by_id() for request in params]
    if not any(biases):
        return None
    rows = [row for row, bias in enumerate(biases) for _ in bias]
    tokens = [token for bias in biases for token in bias]
    check_token_ids(tokens, vocab_size, "logit_bias")
    out = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    out[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = torch.tensor(
        [value for bias in biases for value in bias.values()], device=device)
    return out


def _min_new_tokens_bans(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: set[int],
    vocab_size: int,
) -> list[list[int]]:
    """Per row, the token ids banned because the row has fewer than ``min_new_tokens`` outputs.

    Those are the tokens that would end the request: its ``stop_token_ids`` and, unless
    ``ignore_eos`` (then EOS does not end it), the model's EOS ids. Ids at or past the
    vocabulary size can never be sampled and are left out.
    """
    bans: list[list[int]] = []
    for request, output in zip(params, output_ids, strict=True):
        if len(output) >= request.min_new_tokens:
            bans.append([])
            continue
        ending = set(request.stop_token_ids)
        if not request.ignore_eos:
            ending |= eos_token_ids
        bans.append(sorted(t for t in ending if 0 <= t < vocab_size))
    return bans


def _stacked(rows: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """``[B, vocab]``: the given rows, zeros where a row has none."""
    zeros = torch.zeros_like(like)
    return torch.stack([zeros if row is None else row for row in rows])


@dataclass
class SamplingBatchInfo:
    """Everything the sampler needs about one batch, as per-row tensors on ``device``.

    Built once per step by :meth:`from_requests`. Tensors that no row needs (the penalty
    state, the ban mask) are ``None`` so that a plain batch pays nothing for them.
    """

    vocab_size: int
    device: torch.device
    default_seed: int
    is_greedy: list[bool]
    seeds: list[int | None]
    steps: list[int]  # output tokens per row so far: the position in a seeded row's stream
    sampled_rows: list[int]  # rows that are not greedy, in batch order
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows (never used there)
    top_ks: torch.Tensor  # [B] int64; vocab_size where top-k is off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    repetition_penalties: torch.Tensor | None = None  # [B, 1] float32
    repetition_mask: torch.Tensor | None = None  # [B, vocab] bool: token in prompt + output
    frequency_penalties: torch.Tensor | None = None  # [B, 1] float32
    presence_penalties: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, vocab] float32: occurrences in the output
    banned_mask: torch.Tensor | None = None  # [B, vocab] bool: banned by min_new_tokens
    logit_bias: torch.Tensor | None = None  # [B, vocab] float32: added to the logits
    # [B, ceil(vocab / 32)] int32, packed: bit t % 32 of word t // 32 set = token t allowed
    # by the row's grammar (all bits set on rows without one). Set by the caller.
    grammar_bitmask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Number of rows (requests) in the batch."""
        return len(self.is_greedy)

    def to(self, device: torch.device) -> SamplingBatchInfo:
        """The same information with every tensor on ``device`` (for another rank); this
        very object when it is there already (every step of one rank)."""
        if device == self.device:
            return self
        changes = {f.name: value.to(device) for f in dataclasses.fields(self)
                   if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, device=device, **changes)

    @property
    def all_greedy(self) -> bool:
        """True when every row takes the argmax, so no noise or filtering is needed."""
        return not self.sampled_rows

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        eos_token_ids: set[int],
        vocab_size: int,
        device: torch.device,
        default_seed: int = 0,
        histories: Sequence[PenaltyHistory | None] | None = None,
    ) -> SamplingBatchInfo:
        """Gather the per-row parameters and token histories of a batch into tensors.

        ``output_ids[i]`` are the tokens row ``i`` generated so far and ``prompt_ids[i]`` its
        prompt; both feed the penalties, and ``len(output_ids[i])`` also decides the
        ``min_new_tokens`` ban and the position in a seeded row's random stream.
        ``histories``, when given, are the rows' penalty histories kept across steps
        (already holding those tokens); otherwise they are built from the lists.
        """
        batch_size = len(params)
        if len(output_ids) != batch_size or len(prompt_ids) != batch_size:
            raise ValueError(
                f"params, output_ids and prompt_ids must have one entry per row, got "
                f"{batch_size}, {len(output_ids)} and {len(prompt_ids)}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        is_greedy = [request.is_greedy for request in params]
        # top_k == -1 (off) and top_k >= vocab_size both keep every token.
        top_ks = [
            request.top_k if 0 < request.top_k < vocab_size else vocab_size for request in params
        ]
        info = cls(
            vocab_size=vocab_size,
            device=device,
            default_seed=default_seed,
            is_greedy=is_greedy,
            seeds=[request.seed for request in params],
            steps=[len(output) for output in output_ids],
            sampled_rows=[row for row, greedy in enumerate(is_greedy) if not greedy],
            temperatures=_column(
                [
                    1.0 if greedy else r.temperature
                    for r, greedy in zip(params, is_greedy, strict=True)
                ],
                device,
            ),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=torch.tensor([r.top_p for r in params], dtype=torch.float32, device=device),
            min_ps=torch.tensor([r.min_p for r in params], dtype=torch.float32, device=device),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(r.top_p < 1.0 for r in params),
            need_min_p=any(r.min_p > 0.0 for r in params),
        )
        if histories is None:
            histories = [_history_from_lists(r, prompt, output, vocab_size, device)
                         for r, prompt, output in zip(params, prompt_ids, output_ids, strict=True)]
        info._add_penalties(params, histories)
        info.logit_bias = _logit_bias(params, vocab_size, device)
        bans = _min_new_tokens_bans(params, output_ids, eos_token_ids, vocab_size)
        if any(bans):
            info.banned_mask = _token_mask(bans, vocab_size, device, "banned tokens")
        return info

    def _add_penalties(
        self, params: Sequence[SamplingParams], histories: Sequence[PenaltyHistory | None]
    ) -> None:
        """Stack the penalty state of the rows that need it (nothing when no row does)."""
        seen = [h.seen if h is not None else None for h in histories]
        counts = [h.counts if h is not None else None for h in histories]
        first_seen = next((row for row in seen if row is not None), None)
        if first_seen is not None:
            self.repetition_penalties = _column([r.repetition_penalty for r in params],
                                                self.device)
            self.repetition_mask = _stacked(seen, first_seen)
        first_counts = next((row for row in counts if row is not None), None)
        if first_counts is not None:
            self.frequency_penalties = _column([r.frequency_penalty for r in params], self.device)
            self.presence_penalties = _column([r.presence_penalty for r in params], self.device)
            self.output_counts = _stacked(counts, first_counts)


def _history_from_lists(params: SamplingParams, prompt_ids: Sequence[int],
                        output_ids: Sequence[int], vocab_size: int, device: torch.device
                        ) -> PenaltyHistory | None:
    """A one-off penalty history of a row, or None when its penalties are off."""
    history = PenaltyHistory(params, prompt_ids, vocab_size, device)
    if not history.active:
        return None
    history.add_outputs(output_ids)
    return history
