"""A verify step's tokens: the drafted tokens the target accepts, per sampling row.

The step's forward returns, for a row with ``d`` drafts, the logits at its last token
and at each draft (the draft rows of the batch's extra logits, request after request,
then its next-token row). Rows without drafts keep the plain sampler's token. Drafts are
made only for requests whose sampler sees every position alike (no penalties,
``min_new_tokens`` ban, grammar or seed: ``Req.steady_sampling``), so a position's
distribution is its logits plus ``logit_bias``, through temperature, top-k, top-p and min-p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from framework.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    SamplingRequest,
    StepSample,
    derive_seed,
    filter_probs,
    token_logprobs,
)
from framework.runtime.scheduler.worker import StepResult
from framework.speculative.verify import accept_greedy, verify_sampled


class DraftVerifier:
    """Turns a verify step's logits into each sampling row's accepted tokens.

    Holds the random stream of rejection sampling: seeded by ``(default seed, call
    number)``, as the plain sampler's unseeded rows are, so a run is reproducible.
    ``argmax`` gives each row's greedy token as the plain sampler picks it (``Sampler.argmax``:
    the runner's passes its native kernel, a third of torch's time on a verify step's rows).
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._calls = 0
        self._generator: torch.Generator | None = None
        self._argmax = argmax or Sampler().argmax

    def result(self, next_logits: torch.Tensor, draft_logits: torch.Tensor | None,
               sampling: SamplingRequest, drafts: Sequence[Sequence[int]],
               plain: StepSample, forward_seconds: float) -> StepResult:
        """The step's ``StepResult``: rows without drafts take ``plain``'s token."""
        result = StepResult.one_token_each(plain, forward_seconds)
        info = sampling.info
        if info is None or draft_logits is None:
            return result
        next_rows = next_logits
        if len(sampling.rows) != next_logits.shape[0]:
            next_rows = next_logits[torch.tensor(sampling.rows, device=next_logits.device)]
        starts = [0]
        for drafted in drafts:
            starts.append(starts[-1] + len(drafted))
        greedy_targets = self._greedy_targets(draft_logits, info, drafts, self._argmax)
        for k, drafted in enumerate(drafts):
            if not drafted:
                continue
            if info.is_greedy[k]:
                # The model's argmax at each draft's position, then its own next token.
                targets = [*greedy_targets[starts[k]:starts[k + 1]], plain.next_ids[k]]
                tokens = accept_greedy(drafted, targets)
            else:
                rows = torch.cat([draft_logits[starts[k]:starts[k + 1]], next_rows[k:k + 1]])
                tokens = self._sampled_tokens(rows.float(), info, k, drafted)
            result.next_ids[k] = tokens
            if sampling.return_logprob:
                rows = torch.cat([draft_logits[starts[k]:starts[k + 1]], next_rows[k:k + 1]])
                self._set_logprobs(result, k, rows.float(), tokens, sampling)
        self._calls += 1
        return result

    @staticmethod
    def _greedy_targets(draft_logits: torch.Tensor, info: SamplingBatchInfo,
                        drafts: Sequence[Sequence[int]],
                        argmax: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        """The argmax at every draft row (with each row's ``logit_bias``), in one call."""
        logits = draft_logits.float()
        if info.logit_bias is not None:
            owner = torch.tensor([k for k, drafted in enumerate(drafts) for _ in drafted],
                                 device=logits.device)
            logits = logits + info.logit_bias[owner]
        return argmax(logits.contiguous()).tolist()

    def _sampled_tokens(self, logits: torch.Tensor, info: SamplingBatchInfo, k: int,
                        drafted: Sequence[int]) -> list[int]:
        """Row ``k``'s accepted drafts and the token after them, by rejection sampling."""
        if info.logit_bias is not None:
            logits = logits + info.logit_bias[k]
        n = logits.shape[0]
        probs = torch.softmax(logits / info.temperatures[k], dim=-1)
        probs = filter_probs(probs, info.top_ks[k].expand(n), info.top_ps[k].expand(n),
                             info.min_ps[k].expand(n), info)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        draft = torch.tensor([list(drafted)], dtype=torch.int64, device=logits.device)
        lens = torch.tensor([len(drafted)], device=logits.device)
        generator = self._stream(info, logits.device)
        uniforms = torch.rand(1, len(drafted), generator=generator, device=logits.device)
        return verify_sampled(probs.unsqueeze(0), draft, lens, uniforms, generator).row_tokens(0)

    def _stream(self, info: SamplingBatchInfo, device: torch.device) -> torch.Generator:
        """The generator, reseeded for this call the first time a row of it samples."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(derive_seed(info.default_seed ^ 0x5EC, self._calls))
        return self._generator

    @staticmethod
    def _set_logprobs(result: StepResult, k: int, logits: torch.Tensor, tokens: list[int],
                      sampling: SamplingRequest) -> None:
        """Row ``k``'s logprobs of ``tokens``, of the raw logits at each token's position."""
        n = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        chosen, top_values, top_ids = token_logprobs(
            logits[:n], ids, [sampling.top_logprobs_nums[k]] * n)
        result.logprobs[k] = chosen.tolist()
        result.top_logprobs_val[k] = top_values
        result.top_logprobs_idx[k] = top_ids

