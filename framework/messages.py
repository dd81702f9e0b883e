"""Everything that crosses a process boundary, and nothing else.

Each message is a tagged ``msgspec.Struct`` so that every codec can carry it:
pickle pickles it, msgpack and json encode it by its tag. Batch outputs are
indexed like their ``handles`` (``rids`` for embeddings). Names follow SGLang's,
so readers of SGLang find the same vocabulary. Arrays (``numpy.ndarray``)
travel as out-of-band frames where the codec supports it; ``BatchTokenIDOutput``
keeps its per-token numbers in arrays and sends per-request constants once.

Per-step outputs (``BatchTokenIDOutput``, ``BatchStrOutput``) name their
requests by ``handle``, a small integer the TokenizerManager gives each request
for its life (unique among the requests of one TokenizerManager, across every
data-parallel replica), not by the ``rid`` string: the handles of a batch are
one int64 array, where 256 rids would be 256 strings to encode and decode every
step. The rid travels once, in the request; aborts still name it.
"""

from __future__ import annotations

import time
from itertools import pairwise
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
    #: With ``length``: how many tokens were generated when the limit was reached.
    length: int | None = None

    def to_json(self) -> dict:
        """The SGLang ``finish_reason`` object, omitting what is unset."""
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.length is not None:
            out["length"] = self.length
        return out


# --------------------------------------------------------------------------- requests


class TokenizedGenerateReqInput(Message):
    """A generation request after tokenization: TokenizerManager → Scheduler.

    ``handle`` names the request in every output (``BatchTokenIDOutput.handles``,
    ``BatchStrOutput.handles``); ``rid`` names it in aborts and logs.
    """

    rid: str
    handle: int
    input_text: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    #: The LoRA adapter to run with (None: the base model).
    lora_name: str | None = None


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


#: Prompt ids sent as decoding context with a request's first output, so that its first
#: token decodes with the spacing it has after the prompt. The Scheduler's stop-string
#: matcher decodes with the same context, so both see the same text.
CONTEXT_IDS = 5


def decode_context(prompt_ids: list[int]) -> list[int]:
    """The prompt ids an output is decoded after (the last ``CONTEXT_IDS`` of them)."""
    return prompt_ids[-CONTEXT_IDS:]


class RequestConstants(msgspec.Struct, array_like=True):
    """What stays fixed for a request's whole life, sent with its first output only.

    The Detokenizer keeps it with the request's decode state. The stop strings
    keep a stream from showing part of one; the last prompt ids let the first
    output token decode with the spacing it has after the prompt. Defaults
    are ``SamplingParams``'s.
    """

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_strs: list[str] = msgspec.field(default_factory=list)
    context_ids: list[int] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Seconds from the Scheduler's intake to the request's first admission.
    queue_seconds: float = 0.0


class PromptLogprobs(msgspec.Struct, array_like=True):
    """The logprobs of a request's prompt tokens from position ``start`` on.

    ``token_ids[k]`` is the prompt's token at ``start + k`` and ``values[k]`` its
    logprob given the tokens before it (``None`` at position 0, which has none);
    ``top_values[k]`` / ``top_ids[k]`` are that position's top alternatives
    (empty at position 0, or when none were asked for).
    """

    start: int
    token_ids: list[int]
    values: list[float | None]
    top_values: list[list[float]]
    top_ids: list[list[int]]


class BatchTokenIDOutput(Message):
    """New token ids of a batch of requests: Scheduler → Detokenizer.

    Request ``i`` is ``handles[i]`` (int64, the handle its ``TokenizedGenerateReqInput``
    carried; no rid strings travel per step). Its ids since its last output are
    ``output_ids[output_offsets[i]:output_offsets[i + 1]]`` (``ids_of(i)``):
    all the batch's new ids travel as one int32 array, so a decode step costs a
    few arrays rather than a Python object per request. ``output_offsets`` is
    ``None`` when every request has as many new ids (the usual decode step):
    request ``i`` then has ``output_ids[i * k:(i + 1) * k]`` with
    ``k = len(output_ids) // len(handles)``. Every id is sent exactly once and in
    order, so a request's completion count is not sent: the Detokenizer counts
    the ids it receives.

    Sparse fields, since most requests of a step neither start nor end:

    * ``finished_indices[k]`` finished for ``finished_reasons[k]``;
    * ``new_indices[k]`` has its first output here, and ``new_constants[k]``
      holds what the Detokenizer keeps for it until it finishes;
    * ``prompt_logprob_indices[k]`` asked for its prompt's logprobs, which come
      with its first output as ``prompt_logprobs[k]``.

    Logprobs, when some request of the batch asked for them (else ``None`` and
    empty lists), are aligned with ``output_ids``: ``output_token_logprobs``
    (float32) holds each new id's logprob, NaN for the ids of requests that did
    not ask; ``output_top_logprobs_val`` / ``_idx`` hold each new id's top
    alternatives as lists (the rare path: their width varies per request), an
    empty list for ids of requests that did not ask.

    ``created_at`` is ``time.monotonic()`` when the message was made (the Scheduler
    makes it just before sending it): the start of the output's way to the client,
    which the Detokenizer passes on in its ``BatchStrOutput``.
    """

    handles: np.ndarray
    output_ids: np.ndarray
    output_offsets: np.ndarray | None = None
    finished_indices: list[int] = msgspec.field(default_factory=list)
    finished_reasons: list[FinishReason] = msgspec.field(default_factory=list)
    new_indices: list[int] = msgspec.field(default_factory=list)
    new_constants: list[RequestConstants] = msgspec.field(default_factory=list)
    #: Speculative decoding (empty without): per request, its verify steps so far and the
    #: drafts they accepted.
    spec_verify_cts: list[int] = msgspec.field(default_factory=list)
    spec_accepted_tokens: list[int] = msgspec.field(default_factory=list)
    output_token_logprobs: np.ndarray | None = None
    output_top_logprobs_val: list[list[float]] = msgspec.field(default_factory=list)
    output_top_logprobs_idx: list[list[int]] = msgspec.field(default_factory=list)
    prompt_logprob_indices: list[int] = msgspec.field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)
    created_at: float = msgspec.field(default_factory=time.monotonic)

    def span_of(self, i: int) -> tuple[int, int]:
        """Where request ``i``'s new ids are in ``output_ids``: ``(start, end)``."""
        if self.output_offsets is None:
            per_request = len(self.output_ids) // len(self.handles)
            return i * per_request, (i + 1) * per_request
        return int(self.output_offsets[i]), int(self.output_offsets[i + 1])

    def ids_of(self, i: int) -> list[int]:
        """Request ``i``'s new ids."""
        start, end = self.span_of(i)
        return self.output_ids[start:end].tolist()

    def id_lists(self) -> list[list[int]]:
        """Every request's new ids, in ``handles`` order (one conversion for the whole batch)."""
        if self.output_offsets is None:
            size = len(self.handles)
            if not size:
                return []
            return self.output_ids.reshape(size, len(self.output_ids) // size).tolist()
        counts = np.diff(self.output_offsets)
        if len(counts) and bool((counts == counts[0]).all()):
            # A decode step's usual shape, as many new ids for each request: numpy makes
            # the lists itself, several times faster than slicing one list per request.
            return self.output_ids.reshape(len(counts), int(counts[0])).tolist()
        ids = self.output_ids.tolist()
        offsets = self.output_offsets.tolist()
        return [ids[start:end] for start, end in pairwise(offsets)]

    def finished_reason_list(self) -> list[FinishReason | None]:
        """A finish reason per request, ``None`` for the ones still running."""
        reasons: list[FinishReason | None] = [None] * len(self.handles)
        for i, reason in zip(self.finished_indices, self.finished_reasons):
            reasons[i] = reason
        return reasons

    def new_constants_by_index(self) -> dict[int, RequestConstants]:
        """The constants of the requests whose first output this is, by request index."""
        return dict(zip(self.new_indices, self.new_constants))

    def logprobs_of(self, i: int) -> list[float]:
        """Request ``i``'s logprobs of its new ids; empty when it did not ask for them."""
        if self.output_token_logprobs is None:
            return []
        start, end = self.span_of(i)
        values = self.output_token_logprobs[start:end]
        # A request that did not ask has NaN for every one of its ids.
        if end == start or np.isnan(values[0]):
            return []
        return values.tolist()

    def top_logprobs_of(self, i: int) -> tuple[list[list[float]], list[list[int]]]:
        """Request ``i``'s top logprobs (values, ids), one list per new id; empty if not asked."""
        if not self.logprobs_of(i):
            return [], []
        start, end = self.span_of(i)
        return self.output_top_logprobs_val[start:end], self.output_top_logprobs_idx[start:end]


class BatchStrOutput(Message):
    """New text of a batch of requests: Detokenizer → TokenizerManager.

    Request ``i`` is ``handles[i]``, the ``BatchTokenIDOutput``'s handles as a list
    (the Detokenizer and the TokenizerManager both key dicts by them, so they need
    Python ints; a list also costs less than an array under pickle, and about the
    same under msgpack). ``prompt_logprob_indices`` / ``prompt_logprobs`` are passed on from
    ``BatchTokenIDOutput`` as they came.

    Three ``time.monotonic()`` stamps (one clock for every process of the machine)
    time the output's way, for the TokenizerManager's ``OutputPathStats``: the
    ``BatchTokenIDOutput`` was made (``token_ids_created_at``, its ``created_at``),
    the Detokenizer took it in (``detokenizer_received_at``) and sent this
    (``detokenizer_sent_at``). All 0.0: a message the Detokenizer did not make.
    """

    handles: list[int]
    finished_reasons: list[FinishReason | None]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    queue_seconds: list[float] = msgspec.field(default_factory=list)
    spec_verify_cts: list[int] = msgspec.field(default_factory=list)
    spec_accepted_tokens: list[int] = msgspec.field(default_factory=list)
    output_token_logprobs_val: list[list[float]] = msgspec.field(default_factory=list)
    output_token_logprobs_idx: list[list[int]] = msgspec.field(default_factory=list)
    output_top_logprobs_val: list[list[list[float]]] = msgspec.field(default_factory=list)
    output_top_logprobs_idx: list[list[list[int]]] = msgspec.field(default_factory=list)
    prompt_logprob_indices: list[int] = msgspec.field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)
    token_ids_created_at: float = 0.0
    detokenizer_received_at: float = 0.0
    detokenizer_sent_at: float = 0.0


class BatchEmbeddingOutput(Message):
    """Embeddings of a batch of requests: Scheduler → TokenizerManager.

    ``embeddings`` is one float32 array of shape ``[len(rids), hidden]`` (row
    ``i`` for request ``i``), so the whole batch travels as a single zero-copy
    frame; it has zero columns when every request of the batch was aborted. Sent
    once per request (when it ends), it names requests by ``rid``.
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
    """Whether the weights were replaced; on failure the old weights keep serving.

    ``previous_model_path`` and ``previous_load_format`` say where the weights
    served before came from: with several replicas, one that loaded new weights
    while another could not is sent back to them.
    """

    success: bool
    message: str = ""
    num_paused_requests: int = 0
    previous_model_path: str = ""
    previous_load_format: str = "auto"


class LoadLoraAdapterReqInput(Message):
    """Load a LoRA adapter (a PEFT directory) under a name requests may use."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterReqInput(Message):
    """Unload a LoRA adapter; refused while requests use it."""

    lora_name: str


class LoraAdapterReqOutput(Message):
    """Whether a LoRA adapter was loaded (or unloaded), and why not."""

    success: bool
    message: str = ""


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
    #: Speculative decoding since start: tokens a request gains per verify step, and
    #: accepted over drafted tokens (0.0 without speculation).
    spec_accept_length: float = 0.0
    spec_acceptance_rate: float = 0.0


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
