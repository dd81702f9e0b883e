"""Turn next-token logits into tokens, one row per request, each row with its own parameters.

The order of operations on a row's logits is fixed:

1. logprobs are taken from the RAW logits (``log_softmax``), so that what a client sees does
   not depend on how the token was picked;
2. penalties: repetition (HF/CTRL: tokens of prompt + output; positive logits divided, negative
   ones multiplied), then frequency and presence (OpenAI: counts of the output tokens only),
   then ``logit_bias`` (added to the logits of the named tokens);
3. the ``min_new_tokens`` ban: tokens that would end the request get ``-inf`` until enough
   output exists, and tokens a row's grammar forbids (structured outputs) get ``-inf``;
4. greedy rows (``temperature == 0`` or ``top_k == 1``) take the argmax; the others divide by
   their temperature, take the softmax, keep the top-k, then the nucleus (top-p, measured on
   what top-k kept), then drop tokens under ``min_p`` times the largest probability, and draw
   by an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token, which picks token
   ``i`` with probability ``p_i / sum(p)`` and needs no renormalisation.

Randomness: a row with a seed draws its noise from a generator seeded by ``(seed, number of
output tokens so far)`` alone, so its tokens do not depend on what else is in the batch. Rows
without a seed share one generator seeded by ``(default_seed, call number)``: a run is
reproducible, and every tensor-parallel rank, calling its own sampler in step, samples alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from framework.layers.sampler.batch_info import SamplingBatchInfo
from framework.layers.sampler.logprobs import token_logprobs

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """One SplitMix64 step: a cheap 64-bit hash whose outputs are well spread."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def derive_seed(seed: int, counter: int) -> int:
    """The generator seed for draw number ``counter`` of the random stream named by ``seed``.

    Hashing (rather than ``seed + counter``) keeps the streams of nearby seeds apart.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``-inf`` wherever the packed ``bitmask`` has a clear bit.

    One batched operation for the whole batch: the int32 words ``[B, W]`` are unpacked
    into ``[B, 32 W]`` booleans; columns past ``32 W`` (a vocabulary padded beyond the
    mask) are disallowed.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


@dataclass
class SampleOutput:
    """The sampler's answer for one batch."""

    next_token_ids: torch.Tensor  # [B] int64
    # [B] float32: log_softmax of the RAW logits at the chosen token (None: not asked for)
    logprobs: torch.Tensor | None
    top_logprobs_val: list[list[float]]  # per row, top-N of the raw log_softmax (N may be 0)
    top_logprobs_idx: list[list[int]]


def filter_probs(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    info: SamplingBatchInfo,
) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p and min-p drop; one sort serves top-k and top-p.

    The largest probability always survives (rank 0, exclusive mass 0 < top_p, and it is
    the reference of min_p), so every row keeps at least one token.
    """
    if info.need_top_k or info.need_top_p:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        dropped = ranks.unsqueeze(0) >= top_ks.unsqueeze(1)
        if info.need_top_p:
            kept = sorted_probs.masked_fill(dropped, 0.0)
            cumulative = kept.cumsum(dim=-1)
            # Nucleus over what top-k kept: a token stays while the mass strictly above it
            # is still short of top_p. top_p == 1 keeps all (no float rounding can bite).
            mass_above = (cumulative - kept) / cumulative[:, -1:]
            dropped |= (mass_above >= top_ps.unsqueeze(1)) & (top_ps.unsqueeze(1) < 1.0)
        probs = probs.masked_fill(torch.zeros_like(dropped).scatter(1, sorted_ids, dropped), 0.0)
    if info.need_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


class Sampler:
    """Picks the next token of every row of a batch (see the module docstring for the rules).

    Holds the call counter that advances the random stream of unseeded rows, and one reusable
    generator per device. Subclasses may override :meth:`process_logits` or
    :meth:`exponential_noise`. ``argmax_rows``, when given, takes contiguous CPU logits
    ``[B, vocab]`` to each row's argmax exactly as ``max(dim=-1).indices`` would (the
    native CPU kernel, bound by the ``ModelRunner``).
    """

    def __init__(self, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        self._calls = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self.argmax_rows = argmax_rows

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        top_logprobs_nums: list[int] | None = None,
        return_logprob: bool = True,
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` ``[B, vocab]``; ``top_logprobs_nums[i]`` is N.

        Without ``return_logprob`` (no row asked for logprobs) they are not computed:
        ``logprobs`` is None and the top lists are empty.
        """
        if logits.dim() != 2 or tuple(logits.shape) != (info.batch_size, info.vocab_size):
            raise ValueError(
                f"logits must be [{info.batch_size}, {info.vocab_size}] to match the batch, "
                f"got {list(logits.shape)}"
            )
        if top_logprobs_nums is None:
            top_logprobs_nums = [0] * info.batch_size
        if len(top_logprobs_nums) != info.batch_size or min(top_logprobs_nums, default=0) < 0:
            raise ValueError("top_logprobs_nums must hold one non-negative count per row")

        logits = logits.float()
        processed = self.process_logits(logits, info)
        next_token_ids = self.argmax(processed)
        if not info.all_greedy:
            self._sample_rows(processed, info, next_token_ids)
        self._calls += 1

        if not return_logprob:
            return SampleOutput(next_token_ids=next_token_ids, logprobs=None,
                                top_logprobs_val=[[] for _ in top_logprobs_nums],
                                top_logprobs_idx=[[] for _ in top_logprobs_nums])
        chosen, top_values, top_ids = token_logprobs(logits, next_token_ids, top_logprobs_nums)
        return SampleOutput(
            next_token_ids=next_token_ids,
            logprobs=chosen,
            top_logprobs_val=top_values,
            top_logprobs_idx=top_ids,
        )

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (its first NaN's, if any): the greedy token."""
        if self.argmax_rows is not None and logits.device.type == "cpu" \
                and logits.is_contiguous() and logits.shape[-1] > 0:
            return self.argmax_rows(logits)
        # max(dim) returns the first largest index, as argmax does, several times faster.
        return logits.max(dim=-1).indices

    def process_logits(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Penalties, then the ``min_new_tokens`` ban; returns a new tensor (input untouched)."""
        if info.repetition_mask is not None and info.repetition_penalties is not None:
            penalty = info.repetition_penalties
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(info.repetition_mask, penalized, logits)
        if (
            info.output_counts is not None
            and info.frequency_penalties is not None
            and info.presence_penalties is not None
        ):
            counts = info.output_counts
            logits = (
                logits
                - info.frequency_penalties * counts
                - info.presence_penalties * (counts > 0).float()
            )
        if info.logit_bias is not None:
            logits = logits + info.logit_bias
        if info.banned_mask is not None:
            logits = logits.masked_fill(info.banned_mask, float("-inf"))
        if info.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, info.grammar_bitmask)
        return logits

    def _sample_rows(
        self, processed: torch.Tensor, info: SamplingBatchInfo, next_token_ids: torch.Tensor
    ) -> None:
        """Draw the tokens of the non-greedy rows into ``next_token_ids`` (in place)."""
        rows = torch.tensor(info.sampled_rows, dtype=torch.int64, device=processed.device)
        probs = torch.softmax(processed[rows] / info.temperatures[rows], dim=-1)
        probs = filter_probs(probs, info.top_ks[rows], info.top_ps[rows], info.min_ps[rows], info)
        noise = self.exponential_noise(info, processed.device)
        next_token_ids[rows] = (probs / noise).argmax(dim=-1)

    def exponential_noise(self, info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
        """``[len(sampled_rows), vocab]`` Exp(1) noise: per-row streams for seeded rows.

        Each seeded row reseeds the generator from ``(seed, step)`` and draws a full vocabulary
        row, so its noise is the same whichever batch it is in. Unseeded rows take one block
        from the ``(default_seed, call number)`` stream.
        """
        generator = self._generator(device)
        noise = torch.empty(len(info.sampled_rows), info.vocab_size, device=device)
        unseeded = [i for i, row in enumerate(info.sampled_rows) if info.seeds[row] is None]
        if unseeded:
            generator.manual_seed(derive_seed(info.default_seed, self._calls))
            block = torch.empty(len(unseeded), info.vocab_size, device=device)
            block.exponential_(generator=generator)
            if len(unseeded) == len(info.sampled_rows):
                noise = block  # the common case: no scatter needed
            else:
                noise[torch.tensor(unseeded, dtype=torch.int64, device=device)] = block
        for i, row in enumerate(info.sampled_rows):
            seed = info.seeds[row]
            if seed is not None:
                generator.manual_seed(derive_seed(seed, info.steps[row]))
                noise[i].exponential_(generator=generator)
        # An exact zero would turn a dropped token's 0 / 0 into NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        """The generator for ``device``, made on first use and reseeded before every draw."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]
