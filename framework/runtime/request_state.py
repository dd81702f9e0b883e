"""What the TokenizerManager knows of each request in flight, and how outputs update it.

Each request gets a ``ReqState`` and a handle, a number unique for the
table's life, besides its rid: text outputs name requests by handle (a rid
string per request and step would cost more to send than the new tokens),
embeddings and aborts by rid. Each output batch from the Detokenizer (text)
or the Scheduler (embeddings) appends one ``Chunk`` to each of its requests'
states and wakes their callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from framework.comm.codec import CodecError
from framework.messages import BatchEmbeddingOutput, BatchStrOutput, FinishReason, PromptLogprobs
from framework.runtime.metrics import NoMetrics, RequestMetrics
from framework.runtime.request_input import RequestError

# What an abort tells the Scheduler when a request's caller went away before its end.
GONE = "the client disconnected"


@dataclass
class Chunk:
    """One output of a request as it arrived: the new text and what it ends at."""

    delta: str
    text_len: int
    ids_len: int
    logprobs_len: int
    completion_tokens: int
    cached_tokens: int
    finished_reason: FinishReason | None
    #: Speculative decoding: the request's verify steps so far and the drafts accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class ReqState:
    """What the TokenizerManager knows about one request in flight.

    Each output from the Detokenizer becomes one ``Chunk``, so a streaming
    caller sees exactly one event per output even if it reads them late.
    ``handle`` is the number its outputs carry instead of ``rid``.
    """

    prompt_tokens: int
    rid: str = ""
    handle: int = -1
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    embedding: Any = None
    logprobs: list[tuple[float, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    #: Whether the logprob entries of ``meta_info`` carry their tokens' texts.
    text_in_logprobs: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    chunks: deque[Chunk] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.finished_reason is not None


def raise_if_died(chunk: Chunk, dead_reason: str | None) -> None:
    """A request ended because a component died (``dead_reason``) is an error (503), not
    an output."""
    reason = chunk.finished_reason
    if reason is not None and dead_reason is not None and reason.type == "abort":
        raise RuntimeError(f"the runtime is down: {dead_reason}")


class RequestTable:
    """The states of the requests in flight, by rid and by handle.

    Handles come from one counter for every replica, so they are unique across
    replicas. ``metrics`` hears of each request's start, outputs and release.
    A request released before its end is aborted in the Scheduler through
    ``abort(rid, reason)``; one that ended, or never reached the Scheduler, is
    ``forget``-ten by the router.
    """

    def __init__(self, metrics: RequestMetrics | NoMetrics, abort: Callable[[str, str], None],
                 forget: Callable[[str], None]) -> None:
        self.metrics = metrics
        self._abort = abort
        self._forget = forget
        self.rid_to_state: dict[str, ReqState] = {}
        self.handle_to_state: dict[int, ReqState] = {}
        self._next_handle = itertools.count(1)

    def register(self, rid: str, prompt_tokens: int) -> ReqState:
        """A new state for ``rid``, with a new handle; everything after this must end in
        ``release``."""
        if rid in self.rid_to_state:
            raise RequestError(f"request id {rid!r} is already in use")
        state = ReqState(prompt_tokens=prompt_tokens, rid=rid, handle=next(self._next_handle))
        self.rid_to_state[rid] = state
        self.handle_to_state[state.handle] = state
        self.metrics.request_started(rid, prompt_tokens)
        return state

    def release(self, rid: str, state: ReqState, reached: bool) -> None:
        """Forget ``rid``; abort it in the Scheduler if it may be there and is not finished."""
        self.handle_to_state.pop(state.handle, None)
        if self.rid_to_state.get(rid) is state:
            del self.rid_to_state[rid]
            self.metrics.request_released(rid)
        if reached and not state.finished:
            self._abort(rid, GONE)  # routed to its replica, which it then leaves
        else:
            self._forget(rid)

    @contextlib.asynccontextmanager
    async def in_flight(self, rid: str, prompt_tokens: int,
                        send: Callable[[ReqState], Awaitable[None]]) -> AsyncIterator[ReqState]:
        """Register ``rid``, ``send`` its request and yield its state; however the caller's
        wait ends, the request is released."""
        state = self.register(rid, prompt_tokens)
        reached = True  # whether the Scheduler may hold the request (then it must be aborted)
        try:
            try:
                await send(state)
            except CodecError:
                reached = False  # it failed to encode: nothing was written
                raise
            yield state
        finally:
            self.release(rid, state, reached)

    def apply_text(self, msg: BatchStrOutput) -> None:
        """Append each request's new text (and logprobs) in ``msg`` to its state."""
        logprobs = bool(msg.output_token_logprobs_val)
        states = self.handle_to_state
        for i, prompt in zip(msg.prompt_logprob_indices, msg.prompt_logprobs):
            if (state := states.get(msg.handles[i])) is not None:
                state.prompt_logprobs = prompt
        for i, handle in enumerate(msg.handles):
            state = states.get(handle)
            if state is None:
                continue  # aborted by its caller; late outputs are dropped
            state.text += msg.output_strs[i]
            state.output_ids.extend(msg.output_ids[i])
            state.finished_reason = msg.finished_reasons[i]
            if logprobs:
                state.logprobs.extend(zip(msg.output_token_logprobs_val[i],
                                          msg.output_token_logprobs_idx[i]))
                state.top_logprobs.extend(
                    list(zip(vals, idxs)) for vals, idxs in zip(
                        msg.output_top_logprobs_val[i], msg.output_top_logprobs_idx[i]))
            state.chunks.append(Chunk(
                delta=msg.output_strs[i], text_len=len(state.text),
                ids_len=len(state.output_ids), logprobs_len=len(state.logprobs),
                completion_tokens=msg.completion_tokens[i], cached_tokens=msg.cached_tokens[i],
                finished_reason=msg.finished_reasons[i],
                spec_verify_ct=msg.spec_verify_cts[i] if msg.spec_verify_cts else 0,
                spec_accepted_tokens=(msg.spec_accepted_tokens[i] if msg.spec_accepted_tokens
                                      else 0),
            ))
            reason = msg.finished_reasons[i]
            self.metrics.output(state.rid, msg.completion_tokens[i], msg.cached_tokens[i],
                                reason.type if reason else None,
                                msg.queue_seconds[i] if msg.queue_seconds else None)
            state.event.set()

    def apply_embeddings(self, msg: BatchEmbeddingOutput) -> None:
        """Finish each request of ``msg`` with its embedding (None if it was aborted)."""
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue
            state.embedding = msg.embeddings[i] if msg.embeddings.shape[1] else None
            state.finished_reason = msg.finished_reasons[i] or FinishReason("stop")
            state.chunks.append(Chunk("", 0, 0, 0, 0, 0, state.finished_reason))
            self.metrics.output(rid, 0, 0, state.finished_reason.type)
            state.event.set()

    def abort_all(self, reason: str) -> None:
        """Finish every request in flight with an abort that says ``reason``."""
        for state in self.rid_to_state.values():
            if not state.finished:
                state.finished_reason = FinishReason("abort", message=reason)
                state.chunks.append(Chunk("", len(state.text), len(state.output_ids),
                                          len(state.logprobs), len(state.output_ids), 0,
                                          state.finished_reason))
                state.event.set()
