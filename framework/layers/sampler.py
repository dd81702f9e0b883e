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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from framework.sampling_params import SamplingParams

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


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raise ``ValueError`` if a token id cannot index a row of ``vocab_size`` logits."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise ValueError(f"{what} holds token ids outside [0, {vocab_size})")


def _rows_and_tokens(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into parallel (row index, token id) tensors."""
    rows = [row for row, token_ids in enumerate(token_lists) for _ in token_ids]
    tokens = [token for token_ids in token_lists for token in token_ids]
    _check_token_ids(tokens, vocab_size, what)
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
    _check_token_ids(tokens, vocab_size, "logit_bias")
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
            _check_token_ids(token_ids, self.vocab_size, "output_ids")
            tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.counts.device)
            self.counts.index_put_((tokens,), torch.ones_like(tokens, dtype=torch.float32),
                                   accumulate=True)

    def _mark_seen(self, token_ids: Sequence[int], what: str) -> None:
        if self.seen is not None and token_ids:
            _check_token_ids(token_ids, self.vocab_size, what)
            self.seen[torch.tensor(token_ids, dtype=torch.int64, device=self.seen.device)] = True


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


@dataclass
class SampleOutput:
    """The sampler's answer for one batch."""

    next_token_ids: torch.Tensor  # [B] int64
    # [B] float32: log_softmax of the RAW logits at the chosen token (None: not asked for)
    logprobs: torch.Tensor | None
    top_logprobs_val: list[list[float]]  # per row, top-N of the raw log_softmax (N may be 0)
    top_logprobs_idx: list[list[int]]


def _filter_probs(
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
        next_token_ids = self._argmax(processed)
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

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (its first NaN's, if any)."""
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
        probs = _filter_probs(probs, info.top_ks[rows], info.top_ps[rows], info.min_ps[rows], info)
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


@dataclass
class SamplingRequest:
    """How to sample a step (``sample_step``), built by the Scheduler before the step.

    The batch rows that sample, their ``SamplingBatchInfo``, each row's number of
    top logprobs and whether any row wants logprobs; and, per prompt-logprob row
    of the batch, the prompt's own token there and its number of top logprobs.
    With pipeline parallelism it travels with the step (its info on the CPU) to
    the last stage, which samples where the logits are.
    """

    rows: list[int]
    info: SamplingBatchInfo | None
    top_logprobs_nums: list[int]
    return_logprob: bool
    prompt_targets: list[int]
    prompt_top_nums: list[int]


@dataclass
class StepSample:
    """A step's sampled tokens and logprobs (``sample_step``'s answer)."""

    next_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # empty unless a row asked
    top_logprobs_val: list[list[float]] = field(default_factory=list)
    top_logprobs_idx: list[list[int]] = field(default_factory=list)
    # The prompt-logprob rows': the prompt token's logprob, and the top alternatives.
    prompt_values: list[float] = field(default_factory=list)
    prompt_top_values: list[list[float]] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    #: Why the last stage could not sample (then nothing else is set); None: it did.
    error: str | None = None

    def checked(self) -> StepSample:
        """This sample; raises ``RuntimeError`` when the last stage failed to sample."""
        if self.error is not None:
            raise RuntimeError(f"the last pipeline stage failed to sample: {self.error}")
        return self


def sample_step(sample: Callable[..., SampleOutput], next_logits: torch.Tensor | None,
                prompt_logits: torch.Tensor | None, sampling: SamplingRequest) -> StepSample:
    """Sample a step as ``sampling`` says, from its next-token and prompt-logprob logits.

    ``sample`` is the runner's sampler call (``ModelRunner.sample``). The Scheduler
    runs this on the logits it gets; with pipeline parallelism, the last stage runs
    it on its own and sends the result back.
    """
    step = StepSample()
    if sampling.rows and sampling.info is not None and next_logits is not None:
        if len(sampling.rows) != next_logits.shape[0]:
            next_logits = next_logits[torch.tensor(sampling.rows, device=next_logits.device)]
        out = sample(next_logits, sampling.info.to(next_logits.device),
                     sampling.top_logprobs_nums, sampling.return_logprob)
        step.next_ids = out.next_token_ids.tolist()
        step.logprobs = [] if out.logprobs is None else out.logprobs.tolist()
        step.top_logprobs_val = out.top_logprobs_val
        step.top_logprobs_idx = out.top_logprobs_idx
    if sampling.prompt_targets and prompt_logits is not None:
        targets = torch.tensor(sampling.prompt_targets, device=prompt_logits.device)
        chosen, top_values, top_ids = token_logprobs(prompt_logits, targets,
                                                     sampling.prompt_top_nums)
        step.prompt_values = chosen.tolist()
        step.prompt_top_values, step.prompt_top_ids = top_values, top_ids
    return step
