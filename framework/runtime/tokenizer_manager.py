"""The TokenizerManager: the asyncio front of the runtime, in the HTTP (or Engine) process.

It tokenizes requests (in a worker thread when they are large), sends them to
the Scheduler, keeps one state per request id and wakes the waiting caller
each time the Detokenizer (text) or the Scheduler (embeddings) answers. A
caller that stops listening (a client that disconnected) aborts its request
in the Scheduler, which frees its KV slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from framework.comm.transport import Receiver, Transport, TransportError
from framework.config import PortArgs, ServerArgs
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    ErrorReply,
    FinishReason,
    FlushCacheReqInput,
    GetInfoReqInput,
    GetInfoReqOutput,
    Message,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
)
from framework.registry import create_codec
from framework.sampling_params import SamplingParams, check_token_ids, check_top_logprobs_num

logger = logging.getLogger("framework.tokenizer_manager")

# Texts longer than this are tokenized in a worker thread so the event loop stays free.
_INLINE_TOKENIZE_CHARS = 2048


class RequestError(ValueError):
    """A request the runtime cannot serve (bad input); the API answers 400 with its message."""


@dataclass
class GenerateRequest:
    """A generation request as the API (or the Engine) hands it over."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | None = None


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


@dataclass
class ReqState:
    """What the TokenizerManager knows about one request in flight.

    Each output from the Detokenizer becomes one ``Chunk``, so a streaming
    caller sees exactly one event per output even if it reads them late.
    """

    prompt_tokens: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    embedding: Any = None
    logprobs: list[tuple[float, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    chunks: deque[Chunk] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.finished_reason is not None


class TokenizerManager:
    """Tokenizes, dispatches and tracks requests; one instance per server or Engine."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        transport: Transport,
        tokenizer: Any,
        context_len: int | None = None,
    ) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.context_len = context_len
        # Set at start-up from the Scheduler's ready info; bounds token ids at the edge.
        self.vocab_size: int | None = None
        codec = server_args.codec
        # Bind first: the Scheduler and the Detokenizer connect to these.
        self.recv_from_detokenizer = transport.receiver(port_args.tokenizer_input,
                                                        create_codec(codec))
        self.recv_from_scheduler = transport.receiver(port_args.embedding_output,
                                                      create_codec(codec))
        self.recv_metrics = transport.receiver(port_args.metrics, create_codec(codec))
        self.send_to_scheduler = transport.sender(port_args.scheduler_input, create_codec(codec))
        self.rpc = transport.client(port_args.rpc, create_codec(codec))
        self.rid_to_state: dict[str, ReqState] = {}
        self.last_metrics: SchedulerMetrics | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._rpc_lock: asyncio.Lock | None = None
        self.dead_reason: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the receive loops on the running event loop."""
        handlers: list[tuple[Receiver, Callable[[Message], None]]] = [
            (self.recv_from_detokenizer, self.handle_output),
            (self.recv_from_scheduler, self.handle_output),
            (self.recv_metrics, self.handle_output),
        ]
        self._tasks = [asyncio.create_task(self._receive_loop(r, h)) for r, h in handlers]

    async def _receive_loop(self, receiver: Receiver, handle: Callable[[Message], None]) -> None:
        while True:
            try:
                msg = await receiver.recv_valid()
            except TransportError:
                return  # closed during shutdown
            handle(msg)

    def fail_all(self, reason: str) -> None:
        """Finish every request in flight with an abort (a component died)."""
        self.dead_reason = reason
        for state in self.rid_to_state.values():
            if not state.finished:
                state.finished_reason = FinishReason("abort", message=reason)
                state.chunks.append(Chunk("", len(state.text), len(state.output_ids),
                                          len(state.logprobs), len(state.output_ids), 0,
                                          state.finished_reason))
                state.event.set()

    async def close(self) -> None:
        """Stop the receive loops and close every channel end."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for end in (self.recv_from_detokenizer, self.recv_from_scheduler, self.recv_metrics,
                    self.send_to_scheduler, self.rpc):
            end.close()

    # ------------------------------------------------------------------ requests

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; large texts are encoded off the event loop."""
        if len(text) > _INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.encode, text)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """The tokenizer call (override to change tokenization)."""
        return list(self.tokenizer.encode(text))

    async def _input_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of a text prompt and input_ids")
        ids = await self.tokenize(text) if text is not None else list(input_ids or [])
        if not ids:
            raise RequestError("the prompt is empty")
        if input_ids is not None:
            # The tokenizer's own ids need no check; the Scheduler checks them all again.
            try:
                check_token_ids(ids, self.vocab_size, "input_ids")
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        if self.context_len is not None and len(ids) >= self.context_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but the model's context length is "
                f"{self.context_len}"
            )
        return ids

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(f"the runtime is down: {self.dead_reason}")

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Send ``req`` and yield an output dict each time new text arrives (once if not streaming).

        Leaving the iteration early (the client disconnected) aborts the request.
        """
        self._check_alive()
        try:
            req.sampling_params.verify(self.vocab_size)
            check_top_logprobs_num(req.top_logprobs_num)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if not isinstance(req.return_logprob, bool):
            raise RequestError(f"return_logprob must be true or false, got {req.return_logprob!r}")
        if req.sampling_params.n != 1:
            # The OpenAI routes fan n out into n requests; one request is one sequence.
            raise RequestError("n > 1 is served by /v1/completions and /v1/chat/completions; "
                               "send n requests (with different seeds) instead")
        input_ids = await self._input_ids(req.text, req.input_ids)
        rid = req.rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"request id {rid!r} is already in use")
        state = ReqState(prompt_tokens=len(input_ids))
        self.rid_to_state[rid] = state
        await self.send_to_scheduler.send(TokenizedGenerateReqInput(
            rid=rid, input_text=req.text or "", input_ids=input_ids,
            sampling_params=req.sampling_params, stream=req.stream,
            return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
        ))
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                while state.chunks:
                    chunk = state.chunks.popleft()
                    if req.stream or chunk.finished_reason is not None:
                        yield self.output_dict(rid, state, chunk)
                    if chunk.finished_reason is not None:
                        return
        finally:
            self.rid_to_state.pop(rid, None)
            if not state.finished:
                self.abort_nowait(rid, "the client disconnected")

    async def generate_one(self, req: GenerateRequest) -> dict[str, Any]:
        """The final output of a non-streaming request."""
        req.stream = False
        async for out in self.generate(req):
            return out
        raise RuntimeError("generation ended without an output")

    async def embed(self, text: str | None = None,
                    input_ids: list[int] | None = None) -> dict[str, Any]:
        """The embedding of one input."""
        self._check_alive()
        ids = await self._input_ids(text, input_ids)
        rid = uuid.uuid4().hex
        state = ReqState(prompt_tokens=len(ids))
        self.rid_to_state[rid] = state
        try:
            await self.send_to_scheduler.send(
                TokenizedEmbeddingReqInput(rid=rid, input_text=text or "", input_ids=ids))
            while not state.finished:
                await state.event.wait()
                state.event.clear()
        finally:
            self.rid_to_state.pop(rid, None)
            if not state.finished:
                self.abort_nowait(rid, "the client disconnected")
        meta = self.meta_info(rid, state, state.chunks[-1] if state.chunks else None)
        return {"embedding": state.embedding, "meta_info": meta}

    def abort_nowait(self, rid: str, reason: str = "aborted by the client") -> None:
        """Ask the Scheduler to abort ``rid`` and free its slots.

        Never awaits, so it also works from a ``finally`` of a cancelled task
        (a client that disconnected).
        """
        self.send_to_scheduler.send_nowait(AbortReq(rid=rid, reason=reason))

    # ------------------------------------------------------------------ outputs

    def handle_output(self, msg: Message) -> None:
        """Apply one batch from the Detokenizer or the Scheduler to the waiting states."""
        if isinstance(msg, BatchStrOutput):
            self._apply_text(msg)
        elif isinstance(msg, BatchEmbeddingOutput):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                state.embedding = msg.embeddings[i] if msg.embeddings.shape[1] else None
                state.finished_reason = msg.finished_reasons[i] or FinishReason("stop")
                state.chunks.append(Chunk("", 0, 0, 0, 0, 0, state.finished_reason))
                state.event.set()
        elif isinstance(msg, SchedulerMetrics):
            self.last_metrics = msg
        else:
            logger.warning("tokenizer manager ignored an unexpected %s", type(msg).__name__)

    def _apply_text(self, msg: BatchStrOutput) -> None:
        logprobs = bool(msg.output_token_logprobs_val)
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
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
            ))
            state.event.set()

    def meta_info(self, rid: str, state: ReqState, chunk: Chunk | None) -> dict[str, Any]:
        """SGLang's ``meta_info`` object for a request, as of ``chunk``."""
        reason = chunk.finished_reason if chunk else state.finished_reason
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": chunk.completion_tokens if chunk else 0,
            "cached_tokens": chunk.cached_tokens if chunk else 0,
            "finish_reason": reason.to_json() if reason else None,
        }
        if chunk and chunk.logprobs_len:
            end = chunk.logprobs_len
            meta["output_token_logprobs"] = [list(p) for p in state.logprobs[:end]]
            meta["output_top_logprobs"] = [
                [list(p) for p in row] for row in state.top_logprobs[:end]]
        return meta

    def output_dict(self, rid: str, state: ReqState, chunk: Chunk) -> dict[str, Any]:
        """One output: the text so far, the new text, the ids so far and ``meta_info``."""
        return {
            "text": state.text[:chunk.text_len],
            "delta": chunk.delta,
            "output_ids": state.output_ids[:chunk.ids_len],
            "meta_info": self.meta_info(rid, state, chunk),
        }

    # ------------------------------------------------------------------ RPC

    async def _call(self, msg: Message, timeout: float = 600.0) -> Message:
        self._check_alive()
        if self._rpc_lock is None:
            self._rpc_lock = asyncio.Lock()
        async with self._rpc_lock:
            reply = await self.rpc.call(msg, timeout)
        if isinstance(reply, ErrorReply):
            raise RuntimeError(reply.message)
        return reply

    async def flush_cache(self) -> Any:
        """Ask the Scheduler to flush its prefix cache."""
        return await self._call(FlushCacheReqInput())

    async def update_weights_from_disk(self, model_path: str, load_format: str = "auto") -> Any:
        """Ask the Scheduler to load new weights; in-flight requests keep running."""
        return await self._call(UpdateWeightsFromDiskReqInput(model_path=model_path,
                                                              load_format=load_format))

    async def get_scheduler_info(self) -> dict[str, Any]:
        """The Scheduler's state (memory, queues, configuration)."""
        reply = await self._call(GetInfoReqInput(), timeout=60.0)
        if not isinstance(reply, GetInfoReqOutput):
            raise RuntimeError(f"unexpected reply {type(reply).__name__}")
        return dict(reply.info)
