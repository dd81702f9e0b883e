"""Everything that crosses a process boundary, and nothing else.

Each message is a tagged ``msgspec.Struct`` so that every codec can carry it:
pickle pickles it, msgpack and json encode it by its tag. Batch outputs are
parallel lists indexed like ``rids``. Names follow SGLang's, so readers of
SGLang find the same vocabulary. Arrays (``numpy.ndarray``) travel as
out-of-band frames where the codec supports it.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

from framework.sampling_params import SamplingParams


class Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=False):
    """Base of every message; the tag is the class name."""


class FinishReason(msgspec.Struct, array_like=True):
    """Why a request ended: ``stop`` (EOS, stop string or id), ``length`` or ``abort``."""

    type: str
    matched: int | str | None = None
    message: str | None = None

    def to_json(self) -> dict:
        """The OpenAI/SGLang ``finish_reason`` object, omitting what is unset."""
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


# --------------------------------------------------------------------------- requests


class TokenizedGenerateReqInput(Message):
    """A generation request after tokenization: TokenizerManager → Scheduler."""

    rid: str
    input_text: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1


class TokenizedEmbeddingReqInput(Message):
    """An embedding request after tokenization: TokenizerManager → Scheduler."""

    rid: str
    input_text: str
    input_ids: list[int]


class AbortReq(Message):
    """Abort one request (``rid``) or every request (``abort_all``)."""

    rid: str = ""
    abort_all: bool = False
    reason: str = "aborted"


# --------------------------------------------------------------------------- outputs


class BatchTokenIDOutput(Message):
    """New token ids of a batch of requests: Scheduler → Detokenizer.

    ``output_ids[i]`` are the ids request ``i`` produced since its last output;
    the Detokenizer keeps each request's text state, so nothing is sent twice.
    """

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    output_ids: list[list[int]]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[float]] = msgspec.field(default_factory=list)
    output_token_logprobs_idx: list[list[int]] = msgspec.field(default_factory=list)
    output_top_logprobs_val: list[list[list[float]]] = msgspec.field(default_factory=list)
    output_top_logprobs_idx: list[list[list[int]]] = msgspec.field(default_factory=list)
    #: Sent with a request's first output only (else empty lists; both lists are empty when
    #: no request of the batch is new): its stop strings, so that a stream never shows part
    #: of one, and the last prompt ids, so that the first output token decodes with the
    #: spacing it has after the prompt.
    stop_strs: list[list[str]] = msgspec.field(default_factory=list)
    context_ids: list[list[int]] = msgspec.field(default_factory=list)


class BatchStrOutput(Message):
    """New text of a batch of requests: Detokenizer → TokenizerManager."""

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[float]] = msgspec.field(default_factory=list)
    output_token_logprobs_idx: list[list[int]] = msgspec.field(default_factory=list)
    output_top_logprobs_val: list[list[list[float]]] = msgspec.field(default_factory=list)
    output_top_logprobs_idx: list[list[list[int]]] = msgspec.field(default_factory=list)


class BatchEmbeddingOutput(Message):
    """Embeddings of a batch of requests: Scheduler → TokenizerManager.

    ``embeddings`` is one float32 array of shape ``[len(rids), hidden]`` (row
    ``i`` for request ``i``), so the whole batch travels as a single zero-copy
    frame; it has zero columns when every request of the batch was aborted.
    """

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    embeddings: np.ndarray
    prompt_tokens: list[int]


# --------------------------------------------------------------------------- RPC


class FlushCacheReqInput(Message):
    """Ask the Scheduler to drop its prefix cache (refused while requests run)."""


class FlushCacheReqOutput(Message):
    """Whether the cache was flushed."""

    success: bool
    message: str = ""


class UpdateWeightsFromDiskReqInput(Message):
    """Load new weights of the same architecture from a model directory."""

    model_path: str
    load_format: str = "auto"
    abort_all_requests: bool = False


class UpdateWeightsFromDiskReqOutput(Message):
    """Whether the weights were replaced; on failure the old weights keep serving."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0


class GetInfoReqInput(Message):
    """Ask the Scheduler for its state (memory, running requests, configuration)."""


class GetInfoReqOutput(Message):
    """The Scheduler's answer to ``GetInfoReqInput``."""

    info: dict[str, str | int | float | bool | None]


class ErrorReply(Message):
    """An RPC server's answer when it could not handle a request."""

    message: str


# --------------------------------------------------------------------------- metrics


class SchedulerMetrics(Message):
    """Periodic load report: Scheduler → main process."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    timestamp: float


# --------------------------------------------------------------------------- catalogue

MESSAGE_TYPES: tuple[type[Message], ...] = (
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    AbortReq,
    BatchTokenIDOutput,
    BatchStrOutput,
    BatchEmbeddingOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
    GetInfoReqInput,
    GetInfoReqOutput,
    ErrorReply,
    SchedulerMetrics,
)

AnyMessage = Union[MESSAGE_TYPES]  # noqa: UP007 - a runtime Union over the catalogue
