"""What the Scheduler sends: token-id batches to the Detokenizer, embeddings to the
TokenizerManager.

``OutputSender`` sends; the builders below it are pure functions of ``Req`` state.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np

from framework.comm.transport import Sender
from framework.messages import (
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishReason,
    PromptLogprobs,
    RequestConstants,
)
from framework.runtime.request import Req


class OutputSender:
    """Sends requests' new outputs: token ids onward to the Detokenizer, embeddings back to
    the TokenizerManager."""

    def __init__(self, to_detokenizer: Sender, to_tokenizer: Sender) -> None:
        self.to_detokenizer = to_detokenizer
        self.to_tokenizer = to_tokenizer

    def send(self, reqs: list[Req]) -> None:
        """Each request's output since the last one (an embedding request's: its end)."""
        embeddings = [r for r in reqs if r.is_embedding]
        if embeddings:
            self.to_tokenizer.send_nowait(embedding_output(embeddings))
        generated = [r for r in reqs if not r.is_embedding]
        if generated:
            self.to_detokenizer.send_nowait(token_id_output(generated))

    def send_embeddings(self, reqs: list[Req], vectors: np.ndarray) -> None:
        """The pooled embeddings of finished requests (row ``i`` for ``reqs[i]``)."""
        self.to_tokenizer.send_nowait(embedding_output(reqs, vectors))


def request_constants(req: Req) -> RequestConstants:
    """What the Detokenizer keeps for ``req``: sent with its first output only."""
    params = req.sampling_params
    return RequestConstants(
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        no_stop_trim=params.no_stop_trim,
        stop_strs=list(params.stop),
        context_ids=req.context_ids(),
        prompt_tokens=len(req.origin_input_ids),
        cached_tokens=req.cached_tokens,
        queue_seconds=req.queue_seconds,
    )


def prompt_logprobs(req: Req) -> PromptLogprobs:
    """The logprobs of ``req``'s prompt from its ``logprob_start_len`` (sent once)."""
    start = req.logprob_start_len
    head = 1 if start == 0 else 0  # position 0: no logprob, no alternatives
    return PromptLogprobs(
        start=start,
        token_ids=req.origin_input_ids[start:],
        values=[None] * head + req.input_logprobs,
        top_values=[[]] * head + req.input_top_logprobs_val,
        top_ids=[[]] * head + req.input_top_logprobs_idx,
    )


def _uniform(offsets: list[int]) -> bool:
    """Whether ``offsets`` (from 0, one more than requests) give each request as many ids."""
    if len(offsets) < 2:
        return False
    step = offsets[1]
    return all(end - start == step for start, end in pairwise(offsets))


def token_id_output(reqs: list[Req]) -> BatchTokenIDOutput:
    """Each request's ids since its last output (and marks them sent).

    The ids go out as one flat array with offsets, or without offsets when every
    request has as many new ids (the usual decode step); a request's constants go
    with its first output only, and finish reasons only for those that finished.
    Completion counts are not sent: the Detokenizer counts the ids.
    """
    logprobs, top_val, top_idx = (
        _logprobs(reqs) if any(r.return_logprob for r in reqs) else (None, [], []))
    ids: list[int] = []
    offsets = [0]
    new_indices: list[int] = []
    new_constants: list[RequestConstants] = []
    finished_indices: list[int] = []
    finished_reasons: list[FinishReason] = []
    prompt_indices: list[int] = []
    prompts: list[PromptLogprobs] = []
    for i, req in enumerate(reqs):
        if req.sent_len == 0:
            new_indices.append(i)
            new_constants.append(request_constants(req))
            if req.wants_prompt_logprobs:
                prompt_indices.append(i)
                prompts.append(prompt_logprobs(req))
        if req.finished_reason is not None:
            finished_indices.append(i)
            finished_reasons.append(req.finished_reason)
        ids += req.output_ids[req.sent_len:]
        offsets.append(len(ids))
        req.sent_len = len(req.output_ids)
    return BatchTokenIDOutput(
        # Handles, not rids: one small array instead of a string per request every step.
        handles=np.array([r.handle for r in reqs], dtype=np.int64),
        # int32 holds any token id (vocabularies are far below 2**31) and any count here.
        output_ids=np.array(ids, dtype=np.int32),
        # None: as many new ids for every request, the offsets say nothing.
        output_offsets=None if _uniform(offsets) else np.array(offsets, dtype=np.int32),
        finished_indices=finished_indices,
        finished_reasons=finished_reasons,
        new_indices=new_indices,
        new_constants=new_constants,
        output_token_logprobs=logprobs,
        output_top_logprobs_val=top_val,
        output_top_logprobs_idx=top_idx,
        prompt_logprob_indices=prompt_indices,
        prompt_logprobs=prompts,
        **_spec_counts(reqs),
    )


def _spec_counts(reqs: list[Req]) -> dict[str, list[int]]:
    """Each request's speculative-decoding counts, when any request of the batch has some."""
    if not any(r.spec_verify_ct for r in reqs):
        return {}
    return {"spec_verify_cts": [r.spec_verify_ct for r in reqs],
            "spec_accepted_tokens": [r.spec_accepted_tokens for r in reqs]}


def _logprobs(reqs: list[Req]) -> tuple[np.ndarray, list[list[float]], list[list[int]]]:
    """The unsent ids' logprobs and top logprobs, aligned with them (placeholders if not asked)."""
    values: list[float] = []
    top_val: list[list[float]] = []
    top_idx: list[list[int]] = []
    for req in reqs:
        start = req.sent_len
        if req.return_logprob:
            values += req.output_logprobs[start:]
            top_val += req.output_top_logprobs_val[start:]
            top_idx += req.output_top_logprobs_idx[start:]
        else:
            count = len(req.output_ids) - start
            values += [math.nan] * count
            top_val += [[] for _ in range(count)]
            top_idx += [[] for _ in range(count)]
    return np.array(values, dtype=np.float32), top_val, top_idx


def embedding_output(reqs: list[Req], vectors: np.ndarray | None = None) -> BatchEmbeddingOutput:
    """The embeddings of finished requests (``vectors`` row ``i`` for ``reqs[i]``).

    Without ``vectors`` (requests that ended without running) the array has no columns.
    """
    if vectors is None:
        vectors = np.zeros((len(reqs), 0), dtype=np.float32)
    return BatchEmbeddingOutput(
        rids=[r.rid for r in reqs],
        finished_reasons=[r.finished_reason for r in reqs],
        embeddings=vectors,
        prompt_tokens=[len(r.origin_input_ids) for r in reqs],
    )
