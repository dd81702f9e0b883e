"""Sampling a whole step: what the Scheduler asks for (``SamplingRequest``), what comes
back (``StepSample``), and ``sample_step``, which runs it on a step's logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from framework.layers.sampler.batch_info import SamplingBatchInfo
from framework.layers.sampler.logprobs import token_logprobs
from framework.layers.sampler.sampler import SampleOutput


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
