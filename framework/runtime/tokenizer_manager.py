"""The TokenizerManager: the asyncio front of the runtime, in the HTTP (or Engine) process.

It tokenizes requests (in a worker thread when they are large), sends them to
the Scheduler, keeps one state per request and wakes the waiting caller
each time the Detokenizer (text) or the Scheduler (embeddings) answers. A
caller that stops listening (a client that disconnected) aborts its request
in the Scheduler, which frees its KV slots.

The class composes one part per concept: the checks before sending
(``request_checks``), tokenizing and chat templates (``prompt_input``), the
``SchedulerOutbox`` every request and abort leaves through
(``scheduler_outbox``), the states of the requests in flight and how outputs
update them (``request_state``), the typed outputs (``request_output``), the
fan-out of one API request into parts (``fan_out``), the RPCs to the
Schedulers (``scheduler_rpc``) and the loops that receive what comes back
(``receive_loops``). The request types and errors it takes and raises
(``request_input``) are importable from here too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

from framework.comm.transport import Transport
from framework.config import PortArgs, ServerArgs
from framework.constrained.validation import check_constraint
from framework.lora.names import parse_lora_paths
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    LoraAdapterReqOutput,
    Message,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
)
from framework.model_facts import ModelFacts
from framework.runtime.data_parallel import (
    DataParallelRouter,
    ReplicaChannels,
    make_load_balancer,
    replica_port_args,
)
from framework.runtime.fan_out import gather_or_cancel, prepare_each_choice
from framework.runtime.metrics import make_metrics
from framework.runtime.output_path import OutputPathStats
from framework.runtime.prompt_input import (
    Chat,
    TemplateKwargs,
    Tools,
    chat_size,
    chat_template_ids,
    off_loop_if_long,
)
from framework.runtime.receive_loops import start_receive_loops, stop_receive_loops
from framework.runtime.request_checks import (
    check_lora,
    check_model_kind,
    check_prompt_ids,
    check_prompt_room,
    check_queue_room,
    check_values,
)
from framework.runtime.request_input import (
    GenerateRequest,
    OverloadedError,
    PreparedRequest,
    RequestError,
    new_request_id,
)
from framework.runtime.request_output import (
    EmbeddingOutput,
    RequestOutput,
    request_meta_info,
)
from framework.runtime.request_state import Chunk, ReqState, RequestTable, raise_if_died
from framework.runtime.scheduler_outbox import CLOSE_FLUSH_S, SchedulerOutbox
from framework.runtime.scheduler_rpc import SchedulerRpc

__all__ = [
    "GenerateRequest",
    "OverloadedError",
    "PreparedRequest",
    "RequestError",
    "TokenizerManager",
    "gather_or_cancel",
]

logger = logging.getLogger("framework.tokenizer_manager")


class TokenizerManager:
    """Tokenizes, dispatches and tracks requests; one instance per server or Engine."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs | Sequence[PortArgs],
        transport: Transport,
        tokenizer: Any,
        model: ModelFacts | None = None,
    ) -> None:
        # The tokenizer, or a future of it (``start_loading_tokenizer``), resolved at first
        # use: the channels are bound without waiting for it.
        self._tokenizer = tokenizer
        self.server_args = server_args
        #: The LoRA adapters requests may name (``--lora-paths``, then loaded at run time).
        #: The LoRA adapters served, and the directory each loads from.
        self.lora_paths: dict[str, str] = parse_lora_paths(server_args.lora_paths)
        #: The served model (``start`` takes it from the Scheduler's ready message); until
        #: then None, and the checks that need it let requests through to the Scheduler's.
        self.model = model
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
        self.last_metrics: SchedulerMetrics | None = None
        # Prometheus metrics (no-ops unless --enable-metrics), measured from our own timestamps.
        self.metrics = make_metrics(server_args.enable_metrics)
        # The states in flight, by rid (aborts, embeddings) and by handle (text outputs).
        self.requests = RequestTable(self.metrics, self.abort_nowait, self.router.forget)
        self.rid_to_state = self.requests.rid_to_state
        self.handle_to_state = self.requests.handle_to_state
        #: The text outputs' time between the Scheduler and here (``get_scheduler_info``).
        self.output_path = OutputPathStats()
        # Requests and aborts leave through it in order, without ever blocking the loop.
        self.outbox = SchedulerOutbox(self._send_to_scheduler, self.router.send_nowait)
        self.scheduler_rpc = SchedulerRpc(self.router, server_args.load_balance_method,
                                          self._check_alive)
        self._tasks: list[asyncio.Task[None]] = []
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

    def start(self, model: ModelFacts | None = None) -> None:
        """Start the receive loops on the running event loop; ``model``: the served model's
        facts from the Scheduler's ready message."""
        if model is not None:
            self.model = model
        self._tasks = start_receive_loops(self.replicas, self.handle_output,
                                          self.handle_replica_metrics)
        self.outbox.start()

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(f"the runtime is down: {self.dead_reason}")

    def fail_all(self, reason: str) -> None:
        """Finish every request in flight with an abort (a component died)."""
        self.dead_reason = reason
        self.requests.abort_all(reason)

    async def close(self) -> None:
        """Flush (briefly) what is queued for the Scheduler, stop the loops, close every end."""
        await self.outbox.close(CLOSE_FLUSH_S)
        await stop_receive_loops(self._tasks)
        for replica in self.replicas:
            replica.close()

    def make_router(self, replicas: list[ReplicaChannels]) -> DataParallelRouter:
        """The router of messages to the replicas (override to balance load another way)."""
        return DataParallelRouter(replicas,
                                  make_load_balancer(self.server_args.load_balance_method))

    # ------------------------------------------------------------------ preparing requests

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; large texts are encoded off the event loop."""
        return await off_loop_if_long(self.encode, text, len(text))

    def encode(self, text: str) -> list[int]:
        """The tokenizer call (override to change tokenization)."""
        return list(self.tokenizer.encode(text))

    async def chat_prompt_ids(self, conversation: Chat, tools: Tools = None,
                              template_kwargs: TemplateKwargs = None) -> list[int]:
        """Token ids of a chat (``tools`` offered, ``template_kwargs`` set) through the
        template; long chats are templated off the event loop, as long texts tokenized."""
        return await off_loop_if_long(
            lambda chat: self.apply_chat_template(chat, tools, template_kwargs),
            conversation, chat_size(conversation))

    def apply_chat_template(self, conversation: Chat, tools: Tools = None,
                            template_kwargs: TemplateKwargs = None) -> list[int]:
        """The chat template call, ending in the assistant's turn (override to change it)."""
        return chat_template_ids(self.tokenizer, conversation, tools, template_kwargs)

    async def _input_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of a text prompt and input_ids")
        ids = await self.tokenize(text) if text is not None else list(input_ids or [])
        check_prompt_ids(ids, input_ids is not None, self.model)
        return ids

    def token_text(self, token_id: int) -> str:
        """Token ``token_id`` decoded alone (remembered: the answers repeat tokens)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_serves(self, embedding: bool) -> None:
        """Refuse (``RequestError``) an embedding request to a generation model, or the reverse."""
        check_model_kind(self.model, embedding)

    def check_requests(self, reqs: Sequence[GenerateRequest]) -> None:
        """Refuse (``RequestError``) the first value out of range in ``reqs``, the parts of
        one API request (or a request alone); no tokenizing (``check_values``)."""
        check_values(reqs, self.model)
        check_lora(reqs, self.lora_paths)

    def check_capacity(self) -> None:
        """Refuse (``OverloadedError``) a new request when the queue allowed is full; counted
        here, where every request passes, so the refusal is immediate."""
        check_queue_room(self.server_args, len(self.rid_to_state))

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
        check_prompt_room(req, ids, self.model)
        return PreparedRequest(req, ids)

    async def prepare_choices(self, reqs: list[GenerateRequest]) -> list[PreparedRequest]:
        """One prepared request per request of ``reqs`` and choice of its ``n``
        (``prepare_each_choice``), the parts of one API request, checked here once.

        Every part is checked (and each prompt tokenized, once for all its choices)
        before any is sent, so that one refused part refuses them all while none runs.
        """
        self.check_requests(reqs)
        return await prepare_each_choice(reqs, self._prepare_checked)

    # ------------------------------------------------------------------ requests

    async def generate(self, req: GenerateRequest | PreparedRequest
                       ) -> AsyncIterator[RequestOutput]:
        """Send ``req`` and yield a ``RequestOutput`` each time new text arrives (once if not
        streaming).

        Leaving the iteration early (the client disconnected) aborts the request;
        so does a send that fails, and the request's state is gone either way.
        """
        self._check_alive()
        prepared = req if isinstance(req, PreparedRequest) else await self.prepare(req)
        req = prepared.req
        rid = prepared.rid
        async with self.requests.in_flight(
                rid, len(prepared.input_ids),
                lambda state: self.outbox.send(prepared.message(state.handle))) as state:
            state.text_in_logprobs = req.return_text_in_logprobs
            while True:
                await state.event.wait()
                state.event.clear()
                while state.chunks:
                    chunk = state.chunks.popleft()
                    raise_if_died(chunk, self.dead_reason)
                    if req.stream or chunk.finished_reason is not None:
                        yield RequestOutput.of(state, chunk, self.meta_info(rid, state, chunk))
                    if chunk.finished_reason is not None:
                        return

    async def generate_one(self, req: GenerateRequest | PreparedRequest) -> RequestOutput:
        """The final output of a non-streaming request."""
        (req.req if isinstance(req, PreparedRequest) else req).stream = False
        async for out in self.generate(req):
            return out
        raise RuntimeError("generation ended without an output")

    async def embed(self, text: str | None = None,
                    input_ids: list[int] | None = None) -> EmbeddingOutput:
        """The embedding of one input.

        An input the Scheduler aborts (it cannot run it) raises ``RequestError`` with
        the Scheduler's reason: an aborted request has no embedding to return.
        """
        self._check_alive()
        self.check_serves(embedding=True)
        self.check_capacity()
        ids = await self._input_ids(text, input_ids)
        rid = new_request_id()
        msg = TokenizedEmbeddingReqInput(rid=rid, input_text=text or "", input_ids=ids)
        async with self.requests.in_flight(rid, len(ids),
                                           lambda state: self.outbox.send(msg)) as state:
            while not state.finished:
                await state.event.wait()
                state.event.clear()
        last = state.chunks[-1] if state.chunks else None
        if last is not None:
            raise_if_died(last, self.dead_reason)
        return EmbeddingOutput.of(state, self.meta_info(rid, state, last))

    async def dispatch(self, msg: Message) -> None:
        """Send ``msg`` to the Scheduler after every request and abort handed over before it."""
        await self.outbox.send(msg)

    def abort_nowait(self, rid: str, reason: str = "aborted by the client") -> None:
        """Ask the Scheduler to abort ``rid`` and free its slots; returns at once.

        Never awaits nor waits for room in the channel, so it also works from a ``finally``
        of a cancelled task (a client that disconnected): the abort is queued behind what
        was handed over before it and goes out as soon as the channel takes it.
        """
        self.outbox.put_nowait(AbortReq(rid=rid, reason=reason))

    async def _send_to_scheduler(self, msg: Message) -> None:
        """The outbox's one way out (override to observe or reroute what is sent)."""
        await self.router.send(msg)

    # ------------------------------------------------------------------ outputs

    def handle_output(self, msg: Message) -> None:
        """Apply one batch from the Detokenizer or the Scheduler to the waiting states."""
        if isinstance(msg, BatchStrOutput):
            received = time.monotonic()
            self.requests.apply_text(msg)
            self.output_path.add(msg, received, time.monotonic())
        elif isinstance(msg, BatchEmbeddingOutput):
            self.requests.apply_embeddings(msg)
        elif isinstance(msg, SchedulerMetrics):
            self.last_metrics = msg
            self.metrics.scheduler_metrics(msg)
        else:
            logger.warning("tokenizer manager ignored an unexpected %s", type(msg).__name__)

    def meta_info(self, rid: str, state: ReqState, chunk: Chunk | None) -> dict[str, Any]:
        """SGLang's ``meta_info`` object for a request, as of ``chunk`` (override to add to it)."""
        return request_meta_info(rid, state, chunk, self.token_text)

    def handle_replica_metrics(self, index: int, msg: Message) -> None:
        """Keep replica ``index``'s load report; the server's metrics are the sum of all."""
        if isinstance(msg, SchedulerMetrics):
            if len(self.replicas) > 1:
                self.metrics.replica_metrics(index, msg)
            msg = self.router.record_metrics(index, msg)
        self.handle_output(msg)

    # ------------------------------------------------------------------ RPC

    async def flush_cache(self) -> Any:
        """Ask the Scheduler to flush its prefix cache."""
        return await self.scheduler_rpc.flush_cache()

    @property
    def lora_names(self) -> Collection[str]:
        """The names of the LoRA adapters served."""
        return self.lora_paths.keys()

    async def load_lora_adapter(self, name: str, path: str) -> Any:
        """Load LoRA adapter ``name`` (``SchedulerRpc.load_lora_adapter``); requests may name
        it once it is loaded."""
        if name in self.lora_paths:
            return LoraAdapterReqOutput(success=False,
                                        message=f"LoRA adapter {name!r} is already loaded")
        reply = await self.scheduler_rpc.load_lora_adapter(name, path)
        if reply.success:
            self.lora_paths[name] = path
        return reply

    async def unload_lora_adapter(self, name: str) -> Any:
        """Unload LoRA adapter ``name``; new requests may no longer name it."""
        if name not in self.lora_paths:
            return LoraAdapterReqOutput(success=False,
                                        message=f"LoRA adapter {name!r} is not loaded")
        reply = await self.scheduler_rpc.unload_lora_adapter(name, self.lora_paths[name])
        if reply.success:
            del self.lora_paths[name]
        return reply

    async def update_weights_from_disk(self, model_path: str, load_format: str = "auto",
                                       abort_all_requests: bool = False) -> Any:
        """Ask the Scheduler to load new weights (``SchedulerRpc.update_weights_from_disk``)."""
        return await self.scheduler_rpc.update_weights_from_disk(model_path, load_format,
                                                                 abort_all_requests)

    async def get_scheduler_info(self) -> dict[str, Any]:
        """The Scheduler's state (``SchedulerRpc.scheduler_info``), and the text outputs'
        time on their way here (``OutputPathStats.info``)."""
        return {**await self.scheduler_rpc.scheduler_info(), **self.output_path.info()}
