"""How a step samples: the ``SamplingRequest`` built for its sampling rows and its
prompt-logprob positions, with each request's parameters, penalties and grammar mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from framework.layers.sampler import PenaltyHistory, SamplingBatchInfo, SamplingRequest
from framework.runtime.request import Req
from framework.runtime.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:
    from framework.constrained.manager import GrammarManager


@dataclass(frozen=True)
class SteadySamplingInfo:
    """A sampling info kept for the requests it was built for (held, so compared by identity)."""

    reqs: tuple[Req, ...]
    device: torch.device
    info: SamplingBatchInfo

    def serves(self, reqs: list[Req], device: torch.device) -> bool:
        """Whether ``reqs`` are exactly these requests, in this order, on ``device``."""
        return (device == self.device and len(reqs) == len(self.reqs)
                and all(a is b for a, b in zip(reqs, self.reqs)))


class SamplingPreparer:
    """Builds each step's ``SamplingRequest``."""

    def __init__(self, *, eos_token_ids: set[int], vocab_size: int, seed: int | None,
                 grammars: GrammarManager) -> None:
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.seed = seed
        self.grammars = grammars
        #: The last sampling info built for requests that all sample steadily.
        self._steady: SteadySamplingInfo | None = None

    def request(self, batch: ScheduledBatch, sampled: list[int], spans: list[range],
                device: torch.device) -> SamplingRequest:
        """How to sample this step: the ``sampled`` rows, and the prompt positions of
        ``spans`` (``ScheduledBatch.prompt_logprob_spans``)."""
        reqs = [batch.reqs[i] for i in sampled]
        info = self.info(reqs, device) if reqs else None
        targets = [t for req, span in zip(batch.reqs, spans)
                   for t in req.origin_input_ids[span.start:span.stop]]
        prompt_top = [req.top_logprobs_num for req, span in zip(batch.reqs, spans) for _ in span]
        return SamplingRequest(
            rows=sampled, info=info,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            return_logprob=any(r.return_logprob for r in reqs),
            prompt_targets=targets, prompt_top_nums=prompt_top)

    def info(self, reqs: list[Req], device: torch.device) -> SamplingBatchInfo:
        """The ``SamplingBatchInfo`` of ``reqs`` on ``device``, with their grammars' mask.

        When every request samples the same way at every step (``Req.steady_sampling``),
        the info built for these requests, in this order, is used again: decode steps of
        an unchanged batch then skip gathering each request's parameters (a few
        microseconds a request, per step).
        """
        steady = all(r.steady_sampling for r in reqs)
        kept = self._steady
        if steady and kept is not None and kept.serves(reqs, device):
            return kept.info
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs], self.eos_token_ids, self.vocab_size, device,
            self.seed, histories=[self.penalty_history(r, device) for r in reqs],
        )
        info.grammar_bitmask = self.grammars.bitmask([r.grammar for r in reqs], device)
        self._steady = SteadySamplingInfo(tuple(reqs), device, info) if steady else None
        return info

    def penalty_history(self, req: Req, device: torch.device) -> PenaltyHistory | None:
        """The request's ``PenaltyHistory`` brought up to date, or None without penalties."""
        params = req.sampling_params
        if not params.has_penalties:
            return None
        if req.penalty_history is None:
            req.penalty_history = PenaltyHistory(params, req.origin_input_ids, self.vocab_size,
                                                 device)
        history = req.penalty_history
        history.add_outputs(req.output_ids[history.num_outputs:])
        return history

