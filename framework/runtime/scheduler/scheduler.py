"""The Scheduler: continuous batching over a model worker, one step at a time.

Each step it takes every request waiting on its channels (without blocking),
answers RPCs, picks a batch (a prefill of waiting requests, chunked to a token
budget, or a decode step of the running ones), has the worker run and sample it,
checks stop conditions and sends new token ids to the Detokenizer every
``stream_interval`` tokens (and always when a request finishes).

The class composes the parts of this package, each in the file named for it:
``intake`` (messages in), ``queues`` (where requests are, and every way out),
``admission`` with ``policy`` (which requests join a prefill, which are retracted),
``batch`` (one step's requests and tensors), ``sampling`` (how a step samples),
``step`` (a step run on the worker, failures contained), ``results`` with ``stops``
(a step's tokens applied), ``output`` (what is sent), ``control`` (RPCs, info,
metrics) and ``worker`` (the seam to the model). The prefix cache in
``framework.mem_cache`` is the Scheduler's own.

Subclass it and override ``get_next_batch_to_run``, ``select_prefill_requests``,
``make_room_for_decode``, ``check_finished``, ``build_prefix_cache``,
``handle_request`` or ``handle_rpc_request`` to change how batches are chosen,
when requests end, or what the channels carry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from framework.comm.transport import Receiver, RpcServer, Sender, Transport
from framework.config import PortArgs, ServerArgs
from framework.constrained.manager import GrammarManager
from framework.mem_cache.prefix_cache import ChunkCache, PrefixCache
from framework.messages import FinishReason, Message
from framework.registry import SCHEDULE_POLICIES, create_codec
from framework.runtime.heap import HeapTrimmer
from framework.runtime.hf_tokenizer import load_tokenizer, start_loading_model_tokenizer
from framework.runtime.request import Req
from framework.runtime.scheduler.admission import Admitter
from framework.runtime.scheduler.batch import ScheduledBatch
from framework.runtime.scheduler.control import SchedulerControl
from framework.runtime.scheduler.intake import Intake
from framework.runtime.scheduler.output import OutputSender
from framework.runtime.scheduler.overlap import OverlapWorker, overlap_enabled
from framework.runtime.scheduler.policy import SchedulePolicy
from framework.runtime.scheduler.queues import RequestQueues
from framework.runtime.scheduler.results import ResultProcessor
from framework.runtime.scheduler.sampling import SamplingPreparer
from framework.runtime.scheduler.speculation import DraftPlanner
from framework.runtime.scheduler.stats import SchedulerStats
from framework.runtime.scheduler.step import InFlightStep, StepExecutor
from framework.runtime.scheduler.stops import StopChecker
from framework.runtime.scheduler.worker import ModelRunnerWorker, ModelWorker

logger = logging.getLogger("framework.scheduler")

_IDLE_WAIT_S = 0.05
# With nothing to run but grammars compiling, wait this long on them before polling again.
_GRAMMAR_WAIT_S = 0.01


class Scheduler:
    """Receives tokenized requests, batches them, runs them on a model worker and streams
    token ids.

    ``model_worker``: the worker to run steps on; by default a ``ModelRunnerWorker`` over
    a ``ModelRunner`` of ``server_args``'s model, built here.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        transport: Transport,
        model_worker: ModelWorker | None = None,
    ) -> None:
        self.server_args = server_args
        #: Where the weights being served came from: ``(model_path, load_format)``.
        self.weights_source = (server_args.model_path or "", server_args.load_format)
        if model_worker is None:
            from framework.model_executor.model_runner import ModelRunner

            self.weights_source = (server_args.resolved_model_path(), server_args.load_format)
            if server_args.speculative_algorithm == "draft":
                from framework.speculative.draft_worker import DraftModelWorker

                model_worker = DraftModelWorker.build(server_args, self.weights_source[0])
            else:
                model_worker = ModelRunnerWorker(ModelRunner(server_args, self.weights_source[0]))
        self.model_config = model_worker.model_config
        #: The worker's steps run on a thread of their own while the Scheduler builds the
        #: next one (``overlap.py``); None: one step at a time.
        self.overlap: OverlapWorker | None = None
        if overlap_enabled(server_args, model_worker.device, self.model_config.is_embedding):
            self.overlap = model_worker = OverlapWorker(
                model_worker, ring_size=4 * model_worker.pools.req_to_token_pool.size)
        self.worker = model_worker
        #: The step launched and not applied yet (overlap scheduling only).
        self.in_flight: InFlightStep | None = None
        self.req_to_token_pool = model_worker.pools.req_to_token_pool
        self.allocator = model_worker.pools.allocator
        self.tree_cache = self.build_prefix_cache()
        self.policy: SchedulePolicy = SCHEDULE_POLICIES.get(server_args.schedule_policy)(
            self.tree_cache)
        #: The tokenizer, as a future; ``tokenizer_class``: its class (``"module:Name"``).
        # Started once the model is built: nothing else here imports transformers then.
        self.tokenizer_future, self.tokenizer_class = start_loading_model_tokenizer(
            server_args.resolved_tokenizer_path(), self.load_tokenizer,
            may_defer=server_args.launch_mode == "process")
        self.context_len = self.model_config.context_len
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_ids)
        self.grammars = GrammarManager(
            server_args.grammar_backend, self.tokenizer_future, self.model_config.vocab_size,
            sorted(self.eos_token_ids), compile_timeout=server_args.grammar_compile_timeout,
            cache_bytes=server_args.grammar_cache_mb * 2**20)
        self._open_channels(transport, port_args)
        self._stop = threading.Event()
        self.stats = SchedulerStats()
        self.heap_trimmer = HeapTrimmer()
        self._compose()

    def _open_channels(self, transport: Transport, port_args: PortArgs) -> None:
        codec = self.server_args.codec
        # A replica on another node connects to the front's machine (``front_binds``).
        binds = not port_args.front_binds
        self.recv_from_tokenizer: Receiver = transport.receiver(
            port_args.scheduler_input, create_codec(codec), bind=binds)
        self.rpc_server: RpcServer = transport.server(port_args.rpc, create_codec(codec),
                                                      bind=binds)
        self.send_to_detokenizer: Sender = transport.sender(
            port_args.detokenizer_input, create_codec(codec))
        self.send_to_tokenizer: Sender = transport.sender(
            port_args.embedding_output, create_codec(codec))
        self.send_metrics: Sender = transport.sender(port_args.metrics, create_codec(codec))

    def _compose(self) -> None:
        """Build the parts; each is handed what it uses, and none knows the others' insides."""
        config = self.model_config
        self.outputs = OutputSender(self.send_to_detokenizer, self.send_to_tokenizer)
        self.queues = RequestQueues(
            tree_cache=self.tree_cache, req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator, grammars=self.grammars, stats=self.stats,
            outputs=self.outputs)
        self.intake = Intake(
            server_args=self.server_args, queues=self.queues, grammars=self.grammars,
            context_len=self.context_len, kv_slots=self.allocator.size,
            vocab_size=config.vocab_size, is_embedding=config.is_embedding)
        self.admitter = Admitter(
            server_args=self.server_args, queues=self.queues, policy=self.policy,
            tree_cache=self.tree_cache, req_to_token_pool=self.req_to_token_pool,
            grammars=self.grammars, stats=self.stats)
        self.stops = StopChecker(eos_token_ids=self.eos_token_ids,
                                 context_len=self.context_len, tokenizer=self.tokenizer_future)
        self.results = ResultProcessor(
            queues=self.queues, tree_cache=self.tree_cache, outputs=self.outputs,
            stats=self.stats, check_finished=self.check_finished)
        self.executor = StepExecutor(
            worker=self.worker, tree_cache=self.tree_cache,
            req_to_token_pool=self.req_to_token_pool, allocator=self.allocator,
            sampling=SamplingPreparer(eos_token_ids=self.eos_token_ids,
                                      vocab_size=config.vocab_size,
                                      seed=self.server_args.random_seed,
                                      grammars=self.grammars),
            results=self.results, queues=self.queues, stats=self.stats,
            is_embedding=config.is_embedding, overlap=self.overlap)
        self.control = SchedulerControl(self)
        self.drafter = DraftPlanner.create(self.server_args, self.tree_cache, self.context_len)

    def build_prefix_cache(self) -> PrefixCache:
        """The radix cache, or the no-reuse cache when disabled or for embedding models.

        Embedding models attend both ways, so a prefix's KV depends on what follows it.
        """
        pool, allocator = self.req_to_token_pool, self.allocator
        if self.server_args.disable_radix_cache or self.model_config.is_embedding:
            return ChunkCache(pool, allocator)
        from framework.mem_cache.radix_cache import RadixCache

        return RadixCache(pool, allocator)

    # ------------------------------------------------------------------ the loop

    def event_loop(self) -> None:
        """Run steps until ``stop()``; sleep on the request channel while idle."""
        while not self._stop.is_set():
            if not self.step():
                self.recv_from_tokenizer.wait(_IDLE_WAIT_S)

    def stop(self) -> None:
        """Ask ``event_loop`` to return after the current step (thread-safe)."""
        self._stop.set()

    def step(self) -> bool:
        """One scheduling step; returns whether there was any work."""
        started = time.perf_counter()
        for msg in self.recv_from_tokenizer.drain():
            try:
                self.handle_request(msg)
            except Exception:  # a malformed message is dropped; the loop serves everyone
                logger.exception("scheduler dropped a malformed %s", type(msg).__name__)
        self.control.handle_rpcs(before_reply=self.settle)
        if self.in_flight is not None and self._next_step_needs_the_last():
            self.settle()
        batch = self.get_next_batch_to_run()
        ran = False  # whether a step launched before was applied
        if self.overlap is not None:
            ran = self._overlap_step(batch)
        elif batch is not None:
            self.executor.run(batch)
        if batch is not None:
            self.stats.step_seconds += time.perf_counter() - started
        elif self.in_flight is None and self.grammars.compiling():
            self.grammars.wait(_GRAMMAR_WAIT_S)  # rather than spinning until one is ready
        self.maybe_send_metrics()
        self.heap_trimmer.maybe_trim()
        return batch is not None or ran or bool(self.waiting)

    def _overlap_step(self, batch: ScheduledBatch | None) -> bool:
        """Launch ``batch`` (if any), then apply the step launched before it; returns
        whether a step was applied."""
        if batch is None:
            return self.settle()
        try:
            step = self.executor.prepare(batch)
        except Exception as exc:
            if self.in_flight is None:
                self.executor.contain(batch, exc)
            else:
                self.settle()  # and build again from what it leaves
            return True
        launched = self.executor.launch(step)
        previous, self.in_flight = self.in_flight, launched
        if previous is not None and not self.executor.land(previous, after=launched):
            self.in_flight = None  # it was built on a step that failed: dropped
        return True

    def settle(self) -> bool:
        """Apply the step in flight, if any (overlap scheduling); returns whether there
        was one."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return False
        self.executor.land(flight, after=None)
        return True

    def _prefills_in_flight(self) -> list[Req]:
        """The requests the step in flight prefills (their prompts are not cached yet)."""
        if self.in_flight is None:
            return []
        batch = self.in_flight.step.batch
        return [req for i, req in enumerate(batch.reqs) if not batch.decodes(i)]

    def _next_step_needs_the_last(self) -> bool:
        """Whether the next step cannot be built before the one in flight is applied: a
        request of it samples from what it has output so far, wants its prompt's
        logprobs, or the next decode step may have to retract requests."""
        assert self.in_flight is not None
        reqs = self.in_flight.step.batch.reqs
        return (any(not r.steady_sampling or r.wants_prompt_logprobs for r in reqs)
                or self.tree_cache.available_size() < len(self.running))

    def close(self) -> None:
        """Close every channel end, the grammar compiler and the worker."""
        for end in (self.recv_from_tokenizer, self.rpc_server, self.send_to_detokenizer,
                    self.send_to_tokenizer, self.send_metrics):
            end.close()
        self.grammars.close()
        self.worker.close()

    # ------------------------------------------------------------------ what to override

    def handle_request(self, msg: Message) -> None:
        """Queue a new request or apply an abort."""
        self.intake.handle(msg)

    def handle_rpc_request(self, msg: Message) -> Message:
        """The reply to one RPC request (after the step in flight is applied)."""
        self.settle()
        return self.control.reply(msg)

    def get_next_batch_to_run(self) -> ScheduledBatch | None:
        """Prefill first (new requests start sooner), otherwise decode the running batch.

        With ``--enable-mixed-chunk`` the running requests decode in the prefill's step
        too, after its requests, instead of waiting for it.
        """
        batch = self.select_prefill_requests()
        if batch is not None:
            decoding = [r for r in self.running if not r.ends_by_length(self.context_len)]
            if self.server_args.enable_mixed_chunk and decoding:
                return batch.mixed_with(decoding)
            return batch
        if not self.running:
            return None
        self.make_room_for_decode()
        # With overlap scheduling a request may already have all the tokens it can take
        # (counted before they are applied): it ends when they are.
        decoding = [r for r in self.running if not r.ends_by_length(self.context_len)]
        if not decoding:
            return None
        if self.drafter is not None:
            return self.drafter.decode_step(decoding)
        return ScheduledBatch.decode(decoding)

    def select_prefill_requests(self) -> ScheduledBatch | None:
        """The partly prefilled request first, then waiting requests in the policy's order."""
        return self.admitter.select_prefill(uncached=self._prefills_in_flight())

    def make_room_for_decode(self) -> None:
        """Retract requests, least progress first, until every running one gets a KV slot."""
        self.admitter.make_room_for_decode()

    def check_finished(self, req: Req) -> FinishReason | None:
        """Why the last token ends the request, or None."""
        return self.stops.reason(req)

    # ------------------------------------------------------------------ state

    @property
    def waiting(self) -> deque[Req]:
        """Requests waiting for admission (they hold no KV)."""
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        """Requests decoding together."""
        return self.queues.running

    @property
    def chunked_req(self) -> Req | None:
        """The request being prefilled in chunks (it holds KV slots between steps)."""
        return self.queues.chunked_req

    @property
    def steps(self) -> dict[str, int]:
        """Steps run so far, by kind (``extend``, ``decode``)."""
        return self.executor.steps

    def all_requests(self) -> list[Req]:
        """Every unfinished request: waiting, partly prefilled and running."""
        return self.queues.all()

    def get_info(self) -> dict[str, Any]:
        """State for ``/get_server_info`` and for KV-leak checks (``SchedulerControl.info``)."""
        return self.control.info()

    def memory_is_free(self) -> bool:
        """The idle invariant: nothing in flight, nothing locked, every KV slot free or
        cached, once."""
        return self.control.memory_is_free()

    def slot_accounting_problem(self) -> str | None:
        """What is wrong with where the KV slots and request rows are (``None``: nothing)."""
        return self.control.slot_accounting_problem()

    def maybe_send_metrics(self) -> None:
        """Send a ``SchedulerMetrics`` report about once a second."""
        self.control.maybe_send_metrics()

    # ------------------------------------------------------------------ the tokenizer

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (waiting for a load that is still going on)."""
        return self.tokenizer_future.result()

    def load_tokenizer(self) -> Any:
        """The tokenizer, from the model's files; override to serve another."""
        return load_tokenizer(self.server_args.resolved_tokenizer_path())
