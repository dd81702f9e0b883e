"""The TokenizerManager: the asyncio front of the runtime, in the HTTP (or Engine) process.

It tokenizes requests (in a worker thread when they are large), sends them to
the Scheduler, keeps one state per request and wakes the waiting caller
each time the Detokenizer (text) or the Scheduler (embeddings) answers. Each
request gets a handle, a number unique for the manager's life, besides its rid:
text outputs name requests by handle (a rid string per request and step would
cost more to send than the new tokens), embeddings and aborts by rid. A
caller that stops listening (a client that disconnected) aborts its request
in the Scheduler, which frees its KV slots.

Everything bound for the Scheduler goes through one ``SchedulerOutbox``, so
requests and aborts leave in the order they were handed over, and an abort
(which comes from code that cannot await) never makes the event loop wait for
room in a full channel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from framework.comm.codec import CodecError
from framework.comm.transport import Receiver, Transport, TransportError
from framework.config import PortArgs, ServerArgs
from framework.constrained.validation import check_constraint
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FinishReason,
    FlushCacheReqInput,
    GetInfoReqInput,
    GetInfoReqOutput,
    Message,
    PromptLogprobs,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
)
from framework.runtime.data_parallel import (
    DataParallelRouter,
    ReplicaChannels,
    check_replies,
    make_load_balancer,
    merge_replies,
    replica_port_args,
)
from framework.runtime.metrics import make_metrics
from framework.runtime.output_path import OutputPathStats
from framework.sampling_params import (
    REQUEST_RANGES,
    FieldError,
    SamplingParams,
    check_token_ids,
    check_top_logprobs_num,
)

logger = logging.getLogger("framework.tokenizer_manager")
T = TypeVar("T")

# Texts longer than this are tokenized in a worker thread so the event loop stays free.
_INLINE_TOKENIZE_CHARS = 2048
# On close, how long messages still queued for the Scheduler may take to go out. The
# Scheduler is normally stopped by then, which makes a send fail at once; this bounds the
# case of a live Scheduler that does not read.
_CLOSE_FLUSH_S = 1.0
# What an abort tells the Scheduler when a request's caller went away before its end.
_GONE = "the client disconnected"


class RequestError(ValueError):
    """A request the runtime cannot serve (bad input); the API answers 400 with its message.

    ``param`` names the refused field where there is one; ``code`` is OpenAI's error code
    (``context_length_exceeded``) where one applies.
    """

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class OverloadedError(RuntimeError):
    """The runtime holds as many requests as ``--max-queued-requests`` allows (HTTP 503).

    ``retry_after`` is a hint, in seconds, of when to try again.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class GenerateRequest:
    """A generation request as the API (or the Engine) hands it over."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    #: With ``return_logprob``: the first prompt position whose logprob is returned
    #: (-1: none of the prompt's).
    logprob_start_len: int = -1
    #: With ``return_logprob``: each logprob entry's third element is its token's text
    #: (otherwise ``None``), as SGLang's ``[logprob, token_id, text]`` triples.
    return_text_in_logprobs: bool = False
    rid: str | None = None


@dataclass
class PreparedRequest:
    """A ``GenerateRequest`` that passed every check, with its prompt's token ids.

    ``TokenizerManager.prepare`` makes one; a caller that fans one API request out
    into several prepares them all before sending any, so that one bad part
    refuses the whole request while nothing is running yet.
    """

    req: GenerateRequest
    input_ids: list[int]


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


def _no_text(token_id: int) -> None:
    return None


def logprob_entries(pairs: Iterable[tuple[float | None, int]],
                    text_of: Callable[[int], str | None] = _no_text) -> list[list[Any]]:
    """SGLang's ``[logprob, token_id, text]`` triples (``text`` None unless asked for)."""
    return [[value, tid, text_of(tid)] for value, tid in pairs]


def prompt_logprob_meta(prompt: PromptLogprobs,
                        text_of: Callable[[int], str | None] = _no_text) -> dict[str, list[Any]]:
    """SGLang's ``input_token_logprobs`` (a ``[logprob, id, text]`` triple per prompt position
    from the start asked for; no logprob at position 0) and ``input_top_logprobs`` (None there)."""
    tops: list[Any] = [
        None if value is None else logprob_entries(zip(vals, ids), text_of)
        for value, vals, ids in zip(prompt.values, prompt.top_values, prompt.top_ids)]
    return {
        "input_token_logprobs": logprob_entries(zip(prompt.values, prompt.token_ids), text_of),
        "input_top_logprobs": tops,
    }


class SchedulerOutbox:
    """Sends messages to the Scheduler one at a time, in the order they were handed over.

    A send may have to wait for room (a full shm ring), so one task of the event
    loop does the sending and awaits the async send. Callers of ``send`` wait for
    their message to be sent (and get its error); ``put_nowait`` is for code that
    cannot await, such as the ``finally`` of a task cancelled when its client
    disconnected: its message goes out as soon as everything before it has.
    """

    def __init__(self, send: Callable[[Message], Awaitable[None]]) -> None:
        self._send = send
        # Each message with the future its caller waits on (None: nobody waits).
        self._queue: deque[tuple[Message, asyncio.Future[None] | None]] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sending = False
        self._closed = False

    @property
    def pending(self) -> int:
        """Messages handed over and not sent yet (the one being sent included)."""
        return len(self._queue) + self._sending

    def start(self) -> None:
        """Start the sending task on the running event loop (again if it ended)."""
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="scheduler-outbox")

    async def send(self, msg: Message) -> None:
        """Send ``msg`` after everything handed over before it; raise what the send raised.

        A caller cancelled before its message went out withdraws it; once it is
        going out, it is finished (half a message would corrupt the channel).
        """
        if self._closed:
            raise TransportError("the channel to the Scheduler is closed")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((msg, done))
        self._kick()
        await done

    def put_nowait(self, msg: Message) -> None:
        """Queue ``msg`` and return at once; it goes out in order, when there is room."""
        if self._closed:
            # Shutting down: the Scheduler is stopping too, and takes its requests with it.
            logger.debug("%s not sent: the channel to the Scheduler is closed",
                         type(msg).__name__)
            return
        self._queue.append((msg, None))
        self._kick()

    def _kick(self) -> None:
        self.start()  # a manager used before start() still sends
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                msg, done = self._queue.popleft()
                if done is not None and done.done():
                    continue  # withdrawn: its caller was cancelled before it went out
                await self._send_one(msg, done)

    async def _send_one(self, msg: Message, done: asyncio.Future[None] | None) -> None:
        self._sending = True
        try:
            await self._send(msg)
        except asyncio.CancelledError:  # close() gave up on it
            if done is None:
                logger.warning("%s for the Scheduler was dropped on close", type(msg).__name__)
            _fail(done, TransportError("the channel to the Scheduler closed while sending"))
            raise
        except Exception as exc:
            if done is None:
                logger.error("could not send %s to the Scheduler: %s", type(msg).__name__, exc)
            _fail(done, exc)
        else:
            if done is not None and not done.done():
                done.set_result(None)
        finally:
            self._sending = False

    async def close(self, timeout: float = _CLOSE_FLUSH_S) -> None:
        """Let queued messages go out for up to ``timeout`` s, then stop the task.

        Callers still waiting get a ``TransportError``; aborts that could not go
        out are logged (the Scheduler is normally stopped by now).
        """
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            self._fail_queued()
            return
        deadline = asyncio.get_running_loop().time() + timeout
        # Polling is fine here: it runs once, at shutdown, for at most ``timeout``.
        while self.pending and not task.done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._fail_queued()

    def _fail_queued(self) -> None:
        dropped = 0
        while self._queue:
            _, done = self._queue.popleft()
            if done is None:
                dropped += 1
            _fail(done, TransportError("the channel to the Scheduler closed"))
        if dropped:
            logger.warning("%d aborts for the Scheduler were dropped on close", dropped)


def _fail(done: asyncio.Future[None] | None, exc: BaseException) -> None:
    """Hand ``exc`` to the caller waiting on ``done``, if one still waits."""
    if done is not None and not done.done():
        done.set_exception(exc)


class TokenizerManager:
    """Tokenizes, dispatches and tracks requests; one instance per server or Engine."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs | Sequence[PortArgs],
        transport: Transport,
        tokenizer: Any,
        context_len: int | None = None,
    ) -> None:
        # The tokenizer, or a future of it (``start_loading_tokenizer``), resolved at first
        # use: the channels are bound without waiting for it.
        self._tokenizer = tokenizer
        self.server_args = server_args
        self.context_len = context_len
        # Set at start-up from the Scheduler's ready info; bounds token ids at the edge.
        self.vocab_size: int | None = None
        # Also set at start-up: what the model serves, so that a request of the other kind
        # is refused here rather than sent and aborted. None (unknown) refuses neither.
        self.is_embedding: bool | None = None
        # Bind first: the Schedulers and the Detokenizers connect to these. With --dp-size
        # N, ``port_args`` holds one PortArgs per replica, each replica its own channels.
        self.replicas = [ReplicaChannels.open(i, transport, p, server_args.codec)
                         for i, p in enumerate(replica_port_args(port_args))]
        self.router = self.make_router(self.replicas)
        # Replica 0's ends (with one replica, the only ones), for code that sends directly.
        first = self.replicas[0]
        self.recv_from_detokenizer = first.recv_from_detokenizer
        self.recv_from_scheduler = first.recv_from_scheduler
        self.recv_metrics = first.recv_metrics
        self.send_to_scheduler = first.send_to_scheduler
        self.rpc = first.rpc
        self.rid_to_state: dict[str, ReqState] = {}
        # The same states by handle, the number each request's outputs carry. Handles
        # come from one counter for every replica, so they are unique across replicas.
        self.handle_to_state: dict[int, ReqState] = {}
        self._next_handle = itertools.count(1)
        self.last_metrics: SchedulerMetrics | None = None
        # Prometheus metrics (no-ops unless --enable-metrics), measured from our own timestamps.
        self.metrics = make_metrics(server_args.enable_metrics)
        #: The text outputs' time between the Scheduler and here (``get_scheduler_info``).
        self.output_path = OutputPathStats()
        # Requests and aborts leave through it in order, without ever blocking the loop.
        self.outbox = SchedulerOutbox(self._send_to_scheduler)
        self._tasks: list[asyncio.Task[None]] = []
        self._rpc_lock: asyncio.Lock | None = None
        self.dead_reason: str | None = None
        # Each token's text alone, for logprob entries that carry it (``token_text``).
        self._token_texts: dict[int, str] = {}

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (waiting for it the first time, if it was handed over as a future)."""
        if isinstance(self._tokenizer, concurrent.futures.Future):
            self._tokenizer = self._tokenizer.result()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_texts = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the receive loops on the running event loop."""
        handlers: list[tuple[Receiver, Callable[[Message], None]]] = []
        for replica in self.replicas:
            handlers += [
                (replica.recv_from_detokenizer, self.handle_output),
                (replica.recv_from_scheduler, self.handle_output),
                (replica.recv_metrics, functools.partial(self.handle_replica_metrics,
                                                         replica.index)),
            ]
        self._tasks = [asyncio.create_task(self._receive_loop(r, h)) for r, h in handlers]
        self.outbox.start()

    async def _receive_loop(self, receiver: Receiver, handle: Callable[[Message], None]) -> None:
        while True:
            try:
                msg = await receiver.recv_valid()
            except TransportError:
                return  # closed during shutdown
            try:
                handle(msg)
            except Exception:  # a malformed message must not end the loop that serves all
                logger.exception("tokenizer manager dropped a malformed %s", type(msg).__name__)

    def _raise_if_died(self, chunk: Chunk) -> None:
        """A request ended because a component died is an error (503), not an output."""
        reason = chunk.finished_reason
        if reason is not None and self.dead_reason is not None and reason.type == "abort":
            raise RuntimeError(f"the runtime is down: {self.dead_reason}")

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
        """Flush (briefly) what is queued for the Scheduler, stop the loops, close every end."""
        await self.outbox.close(_CLOSE_FLUSH_S)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas:
            replica.close()

    def make_router(self, replicas: list[ReplicaChannels]) -> DataParallelRouter:
        """The router of messages to the replicas (override to balance load another way)."""
        return DataParallelRouter(replicas,
                                  make_load_balancer(self.server_args.load_balance_method))

    # ------------------------------------------------------------------ requests

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; large texts are encoded off the event loop."""
        if len(text) > _INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.encode, text)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """The tokenizer call (override to change tokenization)."""
        return list(self.tokenizer.encode(text))

    async def chat_prompt_ids(self, conversation: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat through the tokenizer's template; long chats are templated
        off the event loop, as long texts are tokenized."""
        size = sum(len(str(message.get("content") or "")) for message in conversation)
        if size > _INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.apply_chat_template, conversation)
        return self.apply_chat_template(conversation)

    def apply_chat_template(self, conversation: list[dict[str, Any]]) -> list[int]:
        """The chat template call, ending in the assistant's turn (override to change it)."""
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; start the "
                               "server with --chat-template FILE, or use /v1/completions")
        try:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as exc:  # templates raise their own errors for bad roles
            raise RequestError(f"cannot apply the chat template: {exc}") from None
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

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
            except FieldError as exc:
                raise RequestError(str(exc), param=exc.param) from None
        if self.context_len is not None and len(ids) > self.context_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but the model's context length is "
                f"{self.context_len}", code="context_length_exceeded")
        return ids

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(f"the runtime is down: {self.dead_reason}")

    def check_serves(self, embedding: bool) -> None:
        """Refuse (``RequestError``) an embedding request to a generation model, or the reverse."""
        if self.is_embedding is None or self.is_embedding == embedding:
            return
        if self.is_embedding:
            raise RequestError("this model is an embedding model; it serves embeddings, "
                               "not text generation")
        raise RequestError("this model is a generation model; it does not serve embeddings")

    def check_requests(self, reqs: Sequence[GenerateRequest]) -> None:
        """Refuse (``RequestError``) the first value out of range in ``reqs``, the parts of
        one API request (or a request alone); no tokenizing.

        The whole check of the parts' values: first their sampling parameters, verified
        once per object (the prompts of one OpenAI request share theirs), then each part's
        logprob options. ``n`` is checked on the part itself: its choices
        (``SamplingParams.for_choice``) differ from it only in ``n`` and ``seed`` and are
        not checked again.
        """
        for params in {id(req.sampling_params): req.sampling_params for req in reqs}.values():
            try:
                params.verify(self.vocab_size)
            except FieldError as exc:
                raise RequestError(str(exc), param=exc.param) from None
        for req in reqs:
            _check_logprob_options(req)

    def check_capacity(self) -> None:
        """Refuse (``OverloadedError``) a new request when the queue allowed is full.

        The queue is what is in flight beyond the running batches (``max_running_requests``
        per replica): counted here, where every request passes, so the refusal is immediate.
        """
        limit = self.server_args.max_queued_requests
        if limit is None:
            return
        running = self.server_args.max_running_requests * self.server_args.dp_size
        if len(self.rid_to_state) >= running + limit:
            raise OverloadedError(
                f"the server is overloaded: {len(self.rid_to_state)} requests are in flight "
                f"({running} running at most, {limit} queued); try again later")

    async def prepare(self, req: GenerateRequest) -> PreparedRequest:
        """Check ``req``, one sequence (``n`` 1), and tokenize its prompt; every refusal
        happens here, before sending."""
        self.check_requests([req])
        if req.sampling_params.n != 1:
            # One request is one sequence: ``prepare_choices`` fans n out into n requests.
            raise RequestError("a request with n > 1 must be fanned out into its choices "
                               "(prepare_choices) before it is sent")
        return await self._prepare_checked(req)

    async def _prepare_checked(self, req: GenerateRequest) -> PreparedRequest:
        """Tokenize the prompt of ``req``, whose values ``check_requests`` accepted; refuse
        it if the runtime cannot take it now or its prompt does not fit."""
        self._check_alive()
        self.check_serves(embedding=False)
        self.check_capacity()
        if req.rid is not None and req.rid in self.rid_to_state:
            # Checked again when it is registered; here it is refused before any part is sent.
            raise RequestError(f"request id {req.rid!r} is already in use")
        if req.sampling_params.constraint() is not None:
            # Parsing a schema or grammar may take a while: off the event loop.
            await asyncio.to_thread(check_constraint, req.sampling_params,
                                    self.server_args.grammar_backend)
        ids = await self._input_ids(req.text, req.input_ids)
        if (self.context_len is not None and len(ids) == self.context_len
                and req.sampling_params.max_new_tokens != 0):
            # A prompt may fill the context only to be scored (max_new_tokens 0).
            raise RequestError(
                f"the prompt has {len(ids)} tokens, but the model's context length is "
                f"{self.context_len}: no room is left for a new token (max_new_tokens 0 "
                f"scores the prompt alone)",
                code="context_length_exceeded")
        if req.logprob_start_len >= len(ids):
            raise RequestError(f"logprob_start_len must be below the prompt's length "
                               f"{len(ids)}, got {req.logprob_start_len}")
        return PreparedRequest(req, ids)

    async def prepare_choices(self, reqs: list[GenerateRequest]) -> list[PreparedRequest]:
        """One prepared request per request of ``reqs`` and choice of its ``n``.

        ``reqs`` are the parts of one API request, checked here once
        (``check_requests``). Choice ``c`` of a request is the request with
        ``SamplingParams.for_choice(c)`` (n=1, the seed plus ``c``). The order is
        prompt-major: with the same ``n`` for every request, request ``p``'s choice ``c``
        is at ``p * n + c``. Every part is checked (and each prompt tokenized, once for
        all its choices) before any is sent, so that one refused part refuses them all
        while none of them runs.
        """
        self.check_requests(reqs)
        firsts = await gather_or_cancel([self._prepare_checked(_choice(r, 0)) for r in reqs])
        out = []
        for req, first in zip(reqs, firsts):
            out.append(first)
            out.extend(PreparedRequest(_choice(req, index), first.input_ids)
                       for index in range(1, req.sampling_params.n))
        return out

    async def generate(self, req: GenerateRequest | PreparedRequest
                       ) -> AsyncIterator[dict[str, Any]]:
        """Send ``req`` and yield an output dict each time new text arrives (once if not streaming).

        Leaving the iteration early (the client disconnected) aborts the request;
        so does a send that fails, and the request's state is gone either way.
        """
        self._check_alive()
        prepared = req if isinstance(req, PreparedRequest) else await self.prepare(req)
        req = prepared.req
        rid = req.rid or uuid.uuid4().hex
        state = self._register(rid, len(prepared.input_ids))
        state.text_in_logprobs = req.return_text_in_logprobs
        reached = True  # whether the Scheduler may hold the request (then it must be aborted)
        try:
            try:
                await self.outbox.send(TokenizedGenerateReqInput(
                    rid=rid, handle=state.handle, input_text=req.text or "",
                    input_ids=prepared.input_ids,
                    sampling_params=req.sampling_params, stream=req.stream,
                    return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                    logprob_start_len=req.logprob_start_len,
                ))
            except CodecError:
                reached = False  # it failed to encode: nothing was written
                raise
            while True:
                await state.event.wait()
                state.event.clear()
                while state.chunks:
                    chunk = state.chunks.popleft()
                    self._raise_if_died(chunk)
                    if req.stream or chunk.finished_reason is not None:
                        yield self.output_dict(rid, state, chunk)
                    if chunk.finished_reason is not None:
                        return
        finally:
            self._release(rid, state, reached)

    async def generate_one(self, req: GenerateRequest | PreparedRequest) -> dict[str, Any]:
        """The final output of a non-streaming request."""
        (req.req if isinstance(req, PreparedRequest) else req).stream = False
        async for out in self.generate(req):
            return out
        raise RuntimeError("generation ended without an output")

    async def embed(self, text: str | None = None,
                    input_ids: list[int] | None = None) -> dict[str, Any]:
        """The embedding of one input.

        An input the Scheduler aborts (it cannot run it) raises ``RequestError`` with
        the Scheduler's reason: an aborted request has no embedding to return.
        """
        self._check_alive()
        self.check_serves(embedding=True)
        self.check_capacity()
        ids = await self._input_ids(text, input_ids)
        rid = uuid.uuid4().hex
        state = self._register(rid, len(ids))
        reached = True
        try:
            try:
                await self.outbox.send(
                    TokenizedEmbeddingReqInput(rid=rid, input_text=text or "", input_ids=ids))
            except CodecError:
                reached = False
                raise
            while not state.finished:
                await state.event.wait()
                state.event.clear()
        finally:
            self._release(rid, state, reached)
        last = state.chunks[-1] if state.chunks else None
        if last is not None:
            self._raise_if_died(last)
        reason = state.finished_reason
        if reason is not None and reason.type == "abort":
            raise RequestError(f"the embedding request was aborted: {reason.message}")
        return {"embedding": state.embedding, "meta_info": self.meta_info(rid, state, last)}

    def _register(self, rid: str, prompt_tokens: int) -> ReqState:
        """A new state for ``rid``, with a new handle; everything after this must end in
        ``_release``."""
        if rid in self.rid_to_state:
            raise RequestError(f"request id {rid!r} is already in use")
        state = ReqState(prompt_tokens=prompt_tokens, rid=rid, handle=next(self._next_handle))
        self.rid_to_state[rid] = state
        self.handle_to_state[state.handle] = state
        self.metrics.request_started(rid, prompt_tokens)
        return state

    def _release(self, rid: str, state: ReqState, reached: bool) -> None:
        """Forget ``rid``; abort it in the Scheduler if it may be there and is not finished."""
        self.handle_to_state.pop(state.handle, None)
        if self.rid_to_state.get(rid) is state:
            del self.rid_to_state[rid]
            self.metrics.request_released(rid)
        if reached and not state.finished:
            self.abort_nowait(rid, _GONE)  # routed to its replica, which it then leaves
        else:
            self.router.forget(rid)

    async def dispatch(self, msg: Message) -> None:
        """Send ``msg`` to the Scheduler after every request and abort handed over before it."""
        await self.outbox.send(msg)

    def abort_nowait(self, rid: str, reason: str = "aborted by the client") -> None:
        """Ask the Scheduler to abort ``rid`` and free its slots; returns at once.

        Never awaits nor waits for room in the channel, so it also works from a
        ``finally`` of a cancelled task (a client that disconnected): the abort
        is queued behind what was handed over before it and goes out as soon as
        the channel takes it.
        """
        msg = AbortReq(rid=rid, reason=reason)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # No event loop in this thread, so nothing to hold up: send right here.
            self.router.send_nowait(msg)
            return
        self.outbox.put_nowait(msg)

    async def _send_to_scheduler(self, msg: Message) -> None:
        """The outbox's one way out (override to observe or reroute what is sent)."""
        await self.router.send(msg)

    # ------------------------------------------------------------------ outputs

    def handle_output(self, msg: Message) -> None:
        """Apply one batch from the Detokenizer or the Scheduler to the waiting states."""
        if isinstance(msg, BatchStrOutput):
            received = time.monotonic()
            self._apply_text(msg)
            self.output_path.add(msg, received, time.monotonic())
        elif isinstance(msg, BatchEmbeddingOutput):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                state.embedding = msg.embeddings[i] if msg.embeddings.shape[1] else None
                state.finished_reason = msg.finished_reasons[i] or FinishReason("stop")
                state.chunks.append(Chunk("", 0, 0, 0, 0, 0, state.finished_reason))
                self.metrics.output(rid, 0, 0, state.finished_reason.type)
                state.event.set()
        elif isinstance(msg, SchedulerMetrics):
            self.last_metrics = msg
            self.metrics.scheduler_metrics(msg)
        else:
            logger.warning("tokenizer manager ignored an unexpected %s", type(msg).__name__)

    def handle_replica_metrics(self, index: int, msg: Message) -> None:
        """Keep replica ``index``'s load report; the server's metrics are the sum of all."""
        if isinstance(msg, SchedulerMetrics):
            if len(self.replicas) > 1:
                self.metrics.replica_metrics(index, msg)
            msg = self.router.record_metrics(index, msg)
        self.handle_output(msg)

    def _apply_text(self, msg: BatchStrOutput) -> None:
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
            ))
            reason = msg.finished_reasons[i]
            self.metrics.output(state.rid, msg.completion_tokens[i], msg.cached_tokens[i],
                                reason.type if reason else None,
                                msg.queue_seconds[i] if msg.queue_seconds else None)
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
        text_of = self.token_text if state.text_in_logprobs else _no_text
        if state.prompt_logprobs is not None:
            meta.update(prompt_logprob_meta(state.prompt_logprobs, text_of))
        if chunk and chunk.logprobs_len:
            end = chunk.logprobs_len
            meta["output_token_logprobs"] = logprob_entries(state.logprobs[:end], text_of)
            meta["output_top_logprobs"] = [
                logprob_entries(row, text_of) for row in state.top_logprobs[:end]]
        return meta

    def token_text(self, token_id: int) -> str:
        """Token ``token_id`` decoded alone (remembered: the answers repeat tokens)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def output_dict(self, rid: str, state: ReqState, chunk: Chunk) -> dict[str, Any]:
        """One output: the text so far, the new text, the ids so far and ``meta_info``."""
        return {
            "text": state.text[:chunk.text_len],
            "delta": chunk.delta,
            "output_ids": state.output_ids[:chunk.ids_len],
            "meta_info": self.meta_info(rid, state, chunk),
        }

    # ------------------------------------------------------------------ RPC

    @contextlib.asynccontextmanager
    async def _rpc_turn(self) -> AsyncIterator[None]:
        """One exchange of RPCs with the Schedulers at a time."""
        self._check_alive()
        if self._rpc_lock is None:
            self._rpc_lock = asyncio.Lock()
        async with self._rpc_lock:
            yield

    async def _call_all(self, msg: Message, timeout: float = 600.0) -> list[Message]:
        """``msg`` to every replica's Scheduler; their replies, in replica order."""
        async with self._rpc_turn():
            replies = await self.router.call_all(msg, timeout)
        check_replies(replies)  # an ErrorReply becomes a RuntimeError naming its replica
        return replies

    async def _call(self, msg: Message, timeout: float = 600.0) -> Message:
        """``msg`` to every replica; one reply that names each replica's answer."""
        return merge_replies(await self._call_all(msg, timeout))

    async def flush_cache(self) -> Any:
        """Ask the Scheduler to flush its prefix cache."""
        return await self._call(FlushCacheReqInput())

    async def update_weights_from_disk(self, model_path: str, load_format: str = "auto",
                                       abort_all_requests: bool = False) -> Any:
        """Ask the Scheduler to load new weights; in-flight requests keep running (they
        continue on the new weights), or end with ``abort`` with ``abort_all_requests``.

        With several replicas, all or nothing (``DataParallelRouter.update_weights``):
        the update and any rollback form one turn, so that no other RPC comes between.
        """
        msg = UpdateWeightsFromDiskReqInput(model_path=model_path, load_format=load_format,
                                            abort_all_requests=abort_all_requests)
        async with self._rpc_turn():
            return await self.router.update_weights(msg, timeout=600.0)

    async def get_scheduler_info(self) -> dict[str, Any]:
        """The Scheduler's state (memory, queues, configuration), and the text outputs'
        time on their way here (``OutputPathStats.info``).

        With several replicas: each one's state and load under ``replicas``, and
        the whole server's (``kv_cache_idle_and_free`` of all, summed queues) on top.
        """
        replies = await self._call_all(GetInfoReqInput(), timeout=60.0)
        for reply in replies:
            if not isinstance(reply, GetInfoReqOutput):
                raise RuntimeError(f"unexpected reply {type(reply).__name__}")
        infos = [dict(reply.info) for reply in replies]  # type: ignore[attr-defined]
        info = infos[0] if len(infos) == 1 else self.router.merged_info(
            infos, self.server_args.load_balance_method)
        return {**info, **self.output_path.info()}


def _check_logprob_options(req: GenerateRequest) -> None:
    """Refuse (``RequestError``) logprob options of ``req`` that are out of range."""
    try:
        check_top_logprobs_num(req.top_logprobs_num)
    except FieldError as exc:
        raise RequestError(str(exc), param=exc.param) from None
    if not isinstance(req.return_logprob, bool):
        raise RequestError(f"return_logprob must be true or false, got {req.return_logprob!r}")
    start = req.logprob_start_len
    # Only the bottom of its range: the top that matters, the prompt's length, is checked
    # once the prompt is tokenized.
    if type(start) is not int or start < REQUEST_RANGES["logprob_start_len"].low:
        raise RequestError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt "
                           f"position >= 0, got {start!r}")
    if start >= 0 and not req.return_logprob:
        raise RequestError("logprob_start_len needs return_logprob set to true")
    if not isinstance(req.return_text_in_logprobs, bool):
        raise RequestError(f"return_text_in_logprobs must be true or false, "
                           f"got {req.return_text_in_logprobs!r}")


def _choice(req: GenerateRequest, index: int) -> GenerateRequest:
    """Choice ``index`` of ``req``: a copy with that choice's sampling parameters."""
    return dataclasses.replace(req, sampling_params=req.sampling_params.for_choice(index))


async def gather_or_cancel(coros: list[Awaitable[T]]) -> list[T]:
    """Await every part of a fanned-out request; if one fails, cancel the others first.

    A cancelled part's ``finally`` aborts its request in the Scheduler, so no sibling
    keeps generating (and holding KV slots) for an answer that will never be sent.
    Cancelling this call (the client went away) cancels every part the same way.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # exception() marks every failure as retrieved, so none is logged as lost (also
        # when this call itself is cancelled and raises from here).
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    first = next((exc for exc in failures if exc is not None), None)
    if first is not None:
        raise first
    return [t.result() for t in tasks]
