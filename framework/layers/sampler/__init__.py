"""The sampler: next-token logits in, one token (and its logprobs) per request out.

``sampler.py`` holds the ``Sampler`` and the rules it follows, ``batch_info.py``
the per-row parameters it reads (``SamplingBatchInfo``), ``penalties.py`` the
penalty state a request keeps across steps, ``logprobs.py`` the logprobs of
chosen tokens, ``step.py`` the sampling of a whole scheduled step.
"""

from framework.layers.sampler.batch_info import SamplingBatchInfo
from framework.layers.sampler.logprobs import token_logprobs
from framework.layers.sampler.penalties import PenaltyHistory
from framework.layers.sampler.sampler import (
    SampleOutput,
    Sampler,
    apply_token_bitmask,
    derive_seed,
    filter_probs,
)
from framework.layers.sampler.step import SamplingRequest, StepSample, sample_step

__all__ = [
    "PenaltyHistory",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingRequest",
    "StepSample",
    "apply_token_bitmask",
    "derive_seed",
    "filter_probs",
    "sample_step",
    "token_logprobs",
]
