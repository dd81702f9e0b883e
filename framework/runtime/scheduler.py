"""The Scheduler: continuous batching over the ModelRunner, one step at a time.

Each step it takes every request waiting on its channels (without blocking),
answers RPCs, picks a batch (a prefill of waiting requests, chunked to a token
budget, or a decode step of the running ones), runs the model, samples,
checks stop conditions and sends new token ids to the Detokenizer every
``stream_interval`` tokens (and always when a request finishes).

The parts live next door: ``schedule_policy`` (queue order, admission,
retraction), ``schedule_batch`` (one step's requests and tensors),
``scheduler_output`` (messages and metrics), and the prefix cache in
``framework.mem_cache``, which the Scheduler owns.

One request's failure is contained: whatever raises while a step runs ends
only the request that caused it (the step is retried request by request to
find it), with an error reason its client sees; the others carry on.

Subclass it and override ``get_next_batch_to_run``, ``select_prefill_requests``
or ``check_finished`` to change how batches are chosen and when requests end.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from framework.comm.transport import Receiver, RpcServer, Sender, Transport
from framework.config import PortArgs, ServerArgs
from framework.constrained.manager import GrammarManager
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.sampler import (
    SamplingBatchInfo,
    SamplingRequest,
    StepSample,
    sample_step,
)
from framework.mem_cache.accounting import slot_accounting_problem
from framework.mem_cache.prefix_cache import ChunkCache, PrefixCache
from framework.messages import (
    AbortReq,
    ErrorReply,
    FinishReason,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInfoReqInput,
    GetInfoReqOutput,
    Message,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from framework.registry import create_codec
from framework.runtime.heap import HeapTrimmer
from framework.runtime.request import Req
from framework.runtime.schedule_batch import ScheduledBatch
from framework.runtime.schedule_policy import (
    Admission,
    PrefillAdder,
    SchedulePolicy,
    retraction_order,
)
from framework.runtime.scheduler_output import (
    SchedulerStats,
    context_ids,
    embedding_output,
    token_id_output,
)
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.scheduler")

_IDLE_WAIT_S = 0.05
# With nothing to run but grammars compiling, wait this long on them before polling again.
_GRAMMAR_WAIT_S = 0.01
_METRICS_INTERVAL_S = 1.0
_EMBEDDING_PARAMS = SamplingParams(max_new_tokens=0)


@dataclass
class StepResult:
    """What one model step produced, before any request's state changes."""

    embeddings: torch.Tensor | None = None  # [B, hidden] for embedding batches
    sampled: list[int] | None = None  # rows that completed their prefill (or decoded)
    next_ids: list[int] | None = None  # one per sampled row
    logprobs: list[float] | None = None
    top_logprobs_val: list[list[float]] | None = None
    top_logprobs_idx: list[list[int]] | None = None
    #: Per request of the batch: logprobs of the prompt positions the step computed.
    prompt_logprobs: list[PromptLogprobChunk] | None = None


@dataclass
class PromptLogprobChunk:
    """The logprobs of some prompt positions of one request, with their top alternatives."""

    values: list[float]
    top_values: list[list[float]]
    top_ids: list[list[int]]


@dataclass(frozen=True)
class SteadySamplingInfo:
    """A sampling info kept for the requests it was built for (held, so compared by identity)."""

    reqs: tuple[Req, ...]
    device: torch.device
    info: SamplingBatchInfo

    def serves(self, reqs: list[Req], device: torch.device) -> bool:
        """Whether ``reqs`` are exactly these requests, in this order, on ``device``."""
        return (device == self.device and len(reqs) == len(self.reqs)
                and all(a is b for a, b in zip(reqs, self.reqs)))


class Scheduler:
    """Receives tokenized requests, batches them, runs the model and streams token ids."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        transport: Transport,
        model_runner: Any | None = None,
    ) -> None:
        self.server_args = server_args
        #: Where the weights being served came from: ``(model_path, load_format)``.
        self.weights_source = (server_args.model_path or "", server_args.load_format)
        if model_runner is None:
            from framework.model_executor.model_runner import ModelRunner

            self.weights_source = (server_args.resolved_model_path(), server_args.load_format)
            model_runner = ModelRunner(server_args, self.weights_source[0])
        self.model_runner = model_runner
        self.model_config = model_runner.model_config
        self.req_to_token_pool = model_runner.pools.req_to_token_pool
        self.allocator = model_runner.pools.allocator
        self.tree_cache = self.build_prefix_cache()
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache)
        #: The tokenizer, as a future; ``tokenizer_class``: its class (``"module:Name"``).
        self.tokenizer_future, self.tokenizer_class = self._start_loading_tokenizer()
        self.context_len = self.model_config.context_len
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_ids)
        self.grammars = GrammarManager(
            server_args.grammar_backend, self.tokenizer_future, self.model_config.vocab_size,
            sorted(self.eos_token_ids), compile_timeout=server_args.grammar_compile_timeout,
            cache_bytes=server_args.grammar_cache_mb * 2**20)

        codec = server_args.codec
        self.recv_from_tokenizer: Receiver = transport.receiver(
            port_args.scheduler_input, create_codec(codec))
        self.rpc_server: RpcServer = transport.server(port_args.rpc, create_codec(codec))
        self.send_to_detokenizer: Sender = transport.sender(
            port_args.detokenizer_input, create_codec(codec))
        self.send_to_tokenizer: Sender = transport.sender(
            port_args.embedding_output, create_codec(codec))
        self.send_metrics: Sender = transport.sender(port_args.metrics, create_codec(codec))

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        #: The request being prefilled in chunks; it holds KV slots between steps.
        self.chunked_req: Req | None = None
        self._stop = threading.Event()
        self.stats = SchedulerStats()
        self.heap_trimmer = HeapTrimmer()
        self.steps = {mode.name.lower(): 0 for mode in ForwardMode}
        #: The last sampling info built for requests that all sample steadily.
        self._steady_sampling: SteadySamplingInfo | None = None

    def build_prefix_cache(self) -> PrefixCache:
        """The radix cache, or the no-reuse cache when disabled or for embedding models.

        Embedding models attend both ways, so a prefix's KV depends on what follows it.
        """
        pool, allocator = self.req_to_token_pool, self.allocator
        if self.server_args.disable_radix_cache or self.model_config.is_embedding:
            return ChunkCache(pool, allocator)
        from framework.mem_cache.radix_cache import RadixCache

        return RadixCache(pool, allocator)

    # ------------------------------------------------------------------ loop

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
        self.handle_rpc()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.run_batch(batch)
            self.stats.step_seconds += time.perf_counter() - started
        elif self.grammars.compiling():
            self.grammars.wait(_GRAMMAR_WAIT_S)  # rather than spinning until one is ready
        self.maybe_send_metrics()
        self.heap_trimmer.maybe_trim()
        return batch is not None or bool(self.waiting)

    def close(self) -> None:
        """Close every channel end."""
        for end in (self.recv_from_tokenizer, self.rpc_server, self.send_to_detokenizer,
                    self.send_to_tokenizer, self.send_metrics):
            end.close()
        self.grammars.close()

    # ------------------------------------------------------------------ input

    def handle_request(self, msg: Message) -> None:
        """Queue a new request or apply an abort."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_generate_request(msg)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self.add_request(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids),
                                 sampling_params=_EMBEDDING_PARAMS, is_embedding=True))
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        else:
            logger.warning("scheduler ignored an unexpected %s", type(msg).__name__)

    def add_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Turn a tokenized request into a ``Req`` and queue it (or reject it at once)."""
        params = msg.sampling_params
        req = Req(
            rid=msg.rid, handle=msg.handle, origin_input_ids=list(msg.input_ids),
            sampling_params=params, stream=msg.stream, return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len,
            stream_interval=params.stream_interval or self.server_args.stream_interval,
        )
        self.add_request(req)  # checked with the max_new_tokens asked for
        if req.finished_reason is not None:
            return
        room = self.capacity - len(req.origin_input_ids)
        if params.max_new_tokens > room:
            # As the OpenAI API does, generation stops at the context length (or at what the
            # KV cache can hold for a request alone).
            params.max_new_tokens = room
            params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        self.grammars.prefetch(req)  # compiles while the request waits

    @property
    def capacity(self) -> int:
        """The most tokens one request can hold: the context length or the whole KV pool."""
        return min(self.context_len, self.allocator.size)

    def add_request(self, req: Req) -> None:
        """Queue ``req`` unless it can never run; then finish it with the reason."""
        problem = self.validate(req)
        if problem is not None:
            req.finished_reason = FinishReason("abort", message=problem)
            self.send_outputs([req])
            return
        req.queued_at = time.monotonic()
        self.waiting.append(req)

    def validate(self, req: Req) -> str | None:
        """Why ``req`` cannot run, or None (the edge checks first; this is the last line)."""
        n = len(req.origin_input_ids)
        if req.is_embedding != self.model_config.is_embedding:
            served = "embeddings" if self.model_config.is_embedding else "text generation"
            return f"this model serves {served} only"
        if n == 0:
            return "the prompt is empty"
        if n > self.context_len:
            return f"the input has {n} tokens, more than the context length {self.context_len}"
        # Embeddings and prompts only scored (max_new_tokens 0) generate nothing after it.
        generates = not req.is_embedding and req.sampling_params.max_new_tokens != 0
        if n == self.context_len and generates:
            return (f"the prompt has {n} tokens, but the model's context length is "
                    f"{self.context_len}: no room is left for a new token")
        if n + 1 > self.allocator.size:
            # Admission keeps a slot for the token after any prompt (``PrefillAdder``).
            return (f"the prompt has {n} tokens, but the KV cache holds only "
                    f"{self.allocator.size} (the prompt and one new token must fit)")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.origin_input_ids):
            return f"token ids must be in [0, {vocab})"
        if req.logprob_start_len >= n:
            return f"logprob_start_len must be below the prompt's length {n}"
        return None

    def abort(self, msg: AbortReq) -> None:
        """End the named request (or all) with an abort reason the client sees."""
        reason = FinishReason("abort", message=msg.reason)
        for req in self.all_requests():
            if msg.abort_all or req.rid == msg.rid:
                self.stats.aborted_requests += 1
                self.end_request(req, reason)

    def all_requests(self) -> list[Req]:
        """Every unfinished request: waiting, partly prefilled and running."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return [*self.waiting, *chunked, *self.running]

    # ------------------------------------------------------------------ RPC

    def handle_rpc(self) -> None:
        """Answer every waiting RPC request."""
        while (got := self.rpc_server.recv_nowait()) is not None:
            token, msg = got
            try:
                reply = self.handle_rpc_request(msg)
            except Exception as exc:  # a failed RPC must not take the scheduler down
                logger.exception("RPC %s failed", type(msg).__name__)
                reply = ErrorReply(message=f"{type(exc).__name__}: {exc}")
            self.rpc_server.reply(token, reply)

    def handle_rpc_request(self, msg: Message) -> Message:
        """The reply to one RPC request."""
        if isinstance(msg, FlushCacheReqInput):
            return self.flush_cache()
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            return self.update_weights_from_disk(msg)
        if isinstance(msg, GetInfoReqInput):
            return GetInfoReqOutput(info=self.get_info())
        return ErrorReply(message=f"unknown RPC request {type(msg).__name__}")

    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop every cached prefix; refused while requests are in flight."""
        busy = len(self.all_requests())
        if busy:
            return FlushCacheReqOutput(
                success=False,
                message=f"{busy} requests are in flight and hold cached prefixes; "
                        "flush when idle")
        freed = self.tree_cache.evictable_size()
        self.tree_cache.flush()
        return FlushCacheReqOutput(success=True, message=f"cache flushed ({freed} tokens freed)")

    def update_weights_from_disk(
        self, msg: UpdateWeightsFromDiskReqInput
    ) -> UpdateWeightsFromDiskReqOutput:
        """Swap weights between steps; in-flight requests are aborted if asked, else kept.

        Kept requests are retracted before the swap, so that they recompute their KV
        with the new weights (their output so far is kept), and the cache is flushed:
        no KV computed with the old weights is ever reused.
        """
        paused = len(self.all_requests())
        if msg.abort_all_requests:
            self.abort(AbortReq(abort_all=True, reason="weights are being updated"))
        # Reading another model type's config imports transformers: not while the
        # tokenizer's load (which imports it too) may still be going on, on its thread.
        wait([self.tokenizer_future])
        ok, message = self.model_runner.update_weights_from_disk(msg.model_path, msg.load_format)
        previous = self.weights_source
        if ok:
            self.weights_source = (msg.model_path, msg.load_format)
            for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
                self.retract(req)
            self.tree_cache.flush()
        return UpdateWeightsFromDiskReqOutput(
            success=ok, message=message, num_paused_requests=paused,
            previous_model_path=previous[0], previous_load_format=previous[1])

    def get_info(self) -> dict[str, str | int | float | bool | None]:
        """State for ``/get_server_info`` and for KV-leak checks.

        With a runner that reports them (``ranks_info``), each rank's pid and bytes of
        parameters, of all its weights and of KV cache too: ``pid_rank_K``,
        ``param_bytes_rank_K``, ``weight_bytes_rank_K``, ``kv_cache_bytes_rank_K``.
        """
        ranks_info = getattr(self.model_runner, "ranks_info", dict)
        return {
            **ranks_info(),
            "tp_size": self.server_args.tp_size,
            "pp_size": self.server_args.pp_size,
            # Micro-batches of the pipeline's steps so far (rank 0's; 0 without stages).
            "pp_micro_batches": getattr(self.model_runner, "micro_batches", 0),
            "pid": os.getpid(),
            "scheduler_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "aborted_requests": self.stats.aborted_requests,
            "failed_requests": self.stats.failed_requests,
            "retracted_requests": self.stats.retracted_requests,
            "extend_steps": self.steps["extend"],
            "decode_steps": self.steps["decode"],
            # Wall time of the steps that ran a batch, and of their model forwards; the
            # rest (scheduling, sampling, outputs) is the runtime's own overhead.
            "step_seconds": self.stats.step_seconds,
            "forward_seconds": self.stats.forward_seconds,
            "non_model_fraction": self.stats.non_model_fraction,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "max_total_tokens": self.allocator.size,
            "available_kv_tokens": self.allocator.available_size(),
            "evictable_kv_tokens": self.tree_cache.evictable_size(),
            "protected_kv_tokens": self.tree_cache.protected_size(),
            "cache_hit_rate": self.stats.cache_hit_rate,
            "radix_cache": not isinstance(self.tree_cache, ChunkCache),
            "schedule_policy": self.policy.policy,
            "max_running_requests": self.server_args.max_running_requests,
            "available_req_slots": self.req_to_token_pool.available_size(),
            "req_slots": self.req_to_token_pool.size,
            "context_length": self.context_len,
            "kv_cache_idle_and_free": self.memory_is_free(),
            "attention_backend": self.model_runner.attention_backend,
            "linear_backend": self.model_runner.linear_backend,
            "device": str(self.model_runner.device),
            "dtype": str(self.model_runner.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
        }

    def memory_is_free(self) -> bool:
        """The idle invariant: nothing in flight, nothing locked, and every KV slot either
        free or held by the prefix cache, once (the sets compared, not their sizes)."""
        return (not self.all_requests() and self.tree_cache.protected_size() == 0
                and self.slot_accounting_problem() is None)

    def slot_accounting_problem(self) -> str | None:
        """What is wrong with where the KV slots and request rows are (``None``: nothing):
        each must be free, cached, or owned by exactly one live request."""
        holders = [r for r in self.all_requests() if r.req_pool_idx is not None]
        table = self.req_to_token_pool.req_to_token
        # A request owns its slots past the cached prefix it locked.
        owned = [table[r.req_pool_idx, r.cache_protected_len:r.kv_len] for r in holders]
        return slot_accounting_problem(self.allocator, self.tree_cache, self.req_to_token_pool,
                                       owned, [r.req_pool_idx for r in holders])

    # ------------------------------------------------------------------ batching

    def get_next_batch_to_run(self) -> ScheduledBatch | None:
        """Prefill first (new requests start sooner), otherwise decode the running batch.

        With ``--enable-mixed-chunk`` the running requests decode in the prefill's step
        too, after its requests, instead of waiting for it.
        """
        batch = self.select_prefill_requests()
        if batch is not None:
            if self.server_args.enable_mixed_chunk and self.running:
                return batch.mixed_with(list(self.running))
            return batch
        if not self.running:
            return None
        self.make_room_for_decode()
        if not self.running:
            return None
        return ScheduledBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def select_prefill_requests(self) -> ScheduledBatch | None:
        """The partly prefilled request first, then waiting requests in the policy's order."""
        if self.chunked_req is None and not self.waiting:
            return None
        self.policy.order(self.waiting)
        budget = self.server_args.chunked_prefill_size
        if self.server_args.enable_mixed_chunk:
            budget -= len(self.running)  # the step's decode tokens count against it too
        adder = PrefillAdder(
            cache=self.tree_cache, req_to_token_pool=self.req_to_token_pool,
            token_budget=budget, num_running=len(self.running),
            max_running_requests=self.server_args.max_running_requests,
        )
        if self.chunked_req is not None and not adder.add_chunked(self.chunked_req):
            return None  # it goes first; wait until running requests free KV
        deferred: list[Req] = []
        while self.waiting:
            req = self.waiting.popleft()
            if not self.grammar_ready(req):
                if not req.finished:
                    deferred.append(req)  # its grammar is compiling; the others go on
                continue
            first = not req.admitted
            admission = adder.add(req)
            if admission is Admission.FULL:
                self.waiting.appendleft(req)
                break
            if admission is Admission.DEFERRED:
                deferred.append(req)
            elif first:
                self.stats.count_admission(len(req.origin_input_ids), req.cached_tokens)
        self.waiting.extendleft(reversed(deferred))
        self.chunked_req = adder.chunked
        return adder.batch()

    def grammar_ready(self, req: Req) -> bool:
        """Whether ``req``'s grammar (if any) is compiled; one that fails to compile ends it."""
        try:
            return self.grammars.ready(req)
        except Exception as exc:  # the edge validates first; this is the last line
            self.end_request(req, FinishReason("abort", message=str(exc)))
            return False

    def make_room_for_decode(self) -> None:
        """Retract requests, least progress first, until every running one gets a KV slot.

        The partly prefilled request is a candidate too: its slots count as much.
        """
        while self.tree_cache.available_size() < len(self.running):
            # A lone running request always fits: its length is capped by the pool.
            victims = [r for r in retraction_order(self.all_requests()[len(self.waiting):])
                       if r is self.chunked_req or len(self.running) > 1]
            if not victims:
                for req in list(self.running):  # cannot happen by construction; never crash
                    self.end_request(req, FinishReason(
                        "abort", message="internal error: no KV slot left for decoding"))
                return
            self.retract(victims[0])
            logger.info("retracted %s to free KV cache", victims[0].rid)

    def retract(self, req: Req) -> None:
        """Give back the KV and request slot of an unfinished request and queue it again.

        Its KV goes into the prefix cache, so a readmission reuses whatever is not
        evicted by then; its output so far is kept.
        """
        self._release(req)
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self.waiting.appendleft(req)
        self.stats.retracted_requests += 1

    # ------------------------------------------------------------------ model step

    def run_batch(self, batch: ScheduledBatch) -> None:
        """Run one model step for ``batch``; a failure ends only the request that caused it."""
        self.steps[batch.mode.name.lower()] += 1
        try:
            result = self.execute(batch)
        except Exception as exc:
            if len(batch.reqs) == 1:
                self.fail_request(batch.reqs[0], exc)
                self.send_outputs(batch.reqs)
                return
            logger.warning("a %s step of %d requests failed (%r); retrying them one by one",
                           batch.mode.name.lower(), len(batch.reqs), exc)
            for i in range(len(batch.reqs)):
                self.run_batch(batch.subset(i))
            return
        self.process_result(batch, result)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Allocate the step's KV slots, run the model and sample; no request changes yet.

        On failure the step's slots are given back, so the step can be retried.
        """
        out_cache_loc = self.tree_cache.alloc(batch.num_tokens)
        if out_cache_loc is None:
            raise RuntimeError(f"no KV slot left for a step of {batch.num_tokens} tokens")
        try:
            forward_batch = batch.to_forward_batch(
                self.req_to_token_pool.req_to_token, out_cache_loc, self.model_runner.device)
            # Requests whose prompt is then fully in the cache sample a token; a partial
            # chunk does not (its logits are for a token in the middle of the prompt).
            sampled = [i for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens))
                       if req.kv_len + n == req.seq_len]
            if self.model_config.is_embedding:
                return StepResult(embeddings=self.timed_forward(forward_batch).embeddings)
            # With pipeline parallelism the last stage samples: the request goes with the
            # step (built on the CPU) and the sample comes back instead of the logits.
            remote = getattr(self.model_runner, "samples_at_last_stage", False)
            sampling = self.sampling_request(
                batch, sampled, torch.device("cpu") if remote else self.model_runner.device)
            output = self.timed_forward(forward_batch, sampling if remote else None)
            sample = output.sample or sample_step(
                self.model_runner.sample, output.next_token_logits, output.prompt_logits,
                sampling)
            result = StepResult(sampled=sampled)
            self.take_sample(batch, sample, result)
            return result
        except BaseException:
            self.allocator.free(out_cache_loc)
            raise

    def timed_forward(self, forward_batch: ForwardBatch, sampling: Any = None) -> Any:
        """``model_runner.forward``, its wall time added to the stats (device work included)."""
        started = time.perf_counter()
        output = (self.model_runner.forward(forward_batch) if sampling is None else
                  self.model_runner.forward(forward_batch, sampling))
        if self.model_runner.device.type == "cuda":
            torch.cuda.synchronize(self.model_runner.device)  # the sampler would wait anyway
        self.stats.forward_seconds += time.perf_counter() - started
        return output

    def sampling_info(self, reqs: list[Req], device: torch.device) -> SamplingBatchInfo:
        """The ``SamplingBatchInfo`` of ``reqs`` on ``device``, with their grammars' mask.

        When every request samples the same way at every step (``Req.steady_sampling``),
        the info built for these requests, in this order, is used again: decode steps of
        an unchanged batch then skip gathering each request's parameters (a few
        microseconds a request, per step).
        """
        steady = all(r.steady_sampling for r in reqs)
        kept = self._steady_sampling
        if steady and kept is not None and kept.serves(reqs, device):
            return kept.info
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs], self.eos_token_ids,
            self.model_config.vocab_size, device, self.server_args.random_seed,
            histories=[self.penalty_history(r, device) for r in reqs],
        )
        info.grammar_bitmask = self.grammars.bitmask([r.grammar for r in reqs], device)
        self._steady_sampling = SteadySamplingInfo(tuple(reqs), device, info) if steady else None
        return info

    def sampling_request(self, batch: ScheduledBatch, sampled: list[int],
                         device: torch.device) -> SamplingRequest:
        """How to sample this step: the ``sampled`` rows, and its prompt-logprob rows."""
        reqs = [batch.reqs[i] for i in sampled]
        info = self.sampling_info(reqs, device) if reqs else None
        _, targets, prompt_top = self.prompt_targets(batch)
        return SamplingRequest(
            rows=sampled, info=info,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            return_logprob=any(r.return_logprob for r in reqs),
            prompt_targets=targets, prompt_top_nums=prompt_top)

    def take_sample(self, batch: ScheduledBatch, sample: StepSample, result: StepResult) -> None:
        """Put a step's ``StepSample`` (its tokens and logprobs) into ``result``."""
        result.next_ids = sample.next_ids
        result.logprobs = sample.logprobs
        result.top_logprobs_val = sample.top_logprobs_val
        result.top_logprobs_idx = sample.top_logprobs_idx
        if sample.prompt_values:
            spans, _, _ = self.prompt_targets(batch)
            result.prompt_logprobs = prompt_chunks(spans, sample.prompt_values,
                                                   sample.prompt_top_values,
                                                   sample.prompt_top_ids)

    @staticmethod
    def prompt_targets(batch: ScheduledBatch) -> tuple[list[range], list[int], list[int]]:
        """The step's prompt-logprob spans, the prompt token at each, and each one's top count."""
        spans = batch.prompt_logprob_spans()
        targets = [t for req, span in zip(batch.reqs, spans)
                   for t in req.origin_input_ids[span.start:span.stop]]
        top_n = [req.top_logprobs_num for req, span in zip(batch.reqs, spans) for _ in span]
        return spans, targets, top_n

    def penalty_history(self, req: Req, device: torch.device) -> Any:
        """The request's ``PenaltyHistory`` brought up to date, or None without penalties."""
        from framework.layers.sampler import PenaltyHistory

        params = req.sampling_params
        if not params.has_penalties:
            return None
        if req.penalty_history is None:
            req.penalty_history = PenaltyHistory(params, req.origin_input_ids,
                                                 self.model_config.vocab_size, device)
        history = req.penalty_history
        history.add_outputs(req.output_ids[history.num_outputs:])
        return history

    def process_result(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Apply a successful step to its requests, then send outputs and move requests on."""
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        for req, chunk in zip(batch.reqs, result.prompt_logprobs or []):
            req.input_logprobs += chunk.values
            req.input_top_logprobs_val += chunk.top_values
            req.input_top_logprobs_idx += chunk.top_ids
        if result.embeddings is not None:
            self.finish_embeddings(batch, result.embeddings)
            return
        for k, i in enumerate(result.sampled or []):
            req = batch.reqs[i]
            try:
                self.append_token(req, result, k)
            except Exception as exc:  # e.g. a tokenizer error while matching stop strings
                self.fail_request(req, exc)
        due = [r for r in batch.reqs if r.output_due()]
        if due:
            self.send_outputs(due)
        if batch.mode.is_extend():
            sampled = set(result.sampled or [])
            for i, req in enumerate(batch.reqs):
                if req.finished or batch.decodes(i):  # a decode token: it runs already
                    continue
                # What the prefill computed is shared at once, before the request ends.
                self.tree_cache.cache_unfinished_req(req)
                if i in sampled:
                    self.running.append(req)

    def append_token(self, req: Req, result: StepResult, k: int) -> None:
        """Add the ``k``-th sampled token to ``req`` and check whether it ends it."""
        if req.sampling_params.max_new_tokens == 0:
            self._finish(req, FinishReason("length", length=0))
            return
        assert result.next_ids is not None and result.logprobs is not None  # set by sample()
        token = result.next_ids[k]
        if req.grammar is not None and not req.grammar.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_logprobs.append(result.logprobs[k])
            req.output_top_logprobs_val.append((result.top_logprobs_val or [])[k])
            req.output_top_logprobs_idx.append((result.top_logprobs_idx or [])[k])
        self.stats.generated_since_report += 1
        reason = self.check_finished(req)
        if reason is not None:
            self._finish(req, reason)

    def check_finished(self, req: Req) -> FinishReason | None:
        """Why the last token ends the request, or None."""
        params = req.sampling_params
        last = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason("stop", matched=last)  # the output is complete
        if (not params.ignore_eos and last in self.eos_token_ids) or (
            last in params.stop_token_ids
        ):
            return FinishReason("stop", matched=last)
        if params.stop and (matched := self.match_stop_string(req)) is not None:
            return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_len:
            # The limit reached: max_new_tokens, or fewer where the context ends.
            return FinishReason("length", length=len(req.output_ids))
        return None

    def match_stop_string(self, req: Req) -> str | None:
        """The stop string the client's text now contains, if any (decoded incrementally)."""
        from framework.runtime.incremental_decoder import StopStringMatcher, make_decode_fn

        if req.stop_matcher is None:
            params = req.sampling_params
            decode = make_decode_fn(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
            req.stop_matcher = StopStringMatcher(decode, params.stop, context_ids(req))
        return req.stop_matcher.append(req.output_ids[req.stop_matcher.num_output_ids:])

    def finish_embeddings(self, batch: ScheduledBatch, embeddings: torch.Tensor) -> None:
        """Send pooled embeddings to the TokenizerManager and free the requests."""
        vectors = embeddings.float().cpu().numpy()  # [batch, hidden]
        for req in batch.reqs:
            req.finished_reason = FinishReason("stop")
            self._release(req)
        self.send_to_tokenizer.send_nowait(embedding_output(batch.reqs, vectors))

    # ------------------------------------------------------------------ ending

    def fail_request(self, req: Req, exc: BaseException) -> None:
        """Finish ``req`` because handling it raised; its last output carries the error."""
        logger.error("request %s failed and was ended: %r", req.rid, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
        self.stats.failed_requests += 1
        # Its own KV past the cached prefix may be what went wrong: do not cache it.
        self._discard_own_kv(req)
        self._finish(req, FinishReason(
            "abort", message=f"internal error while serving this request: "
                             f"{type(exc).__name__}: {exc}"))

    def end_request(self, req: Req, reason: FinishReason) -> None:
        """Finish ``req`` wherever it is and send its last output."""
        self._finish(req, reason)
        self.send_outputs([req])

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Set the finish reason, free the slots and take ``req`` out of every queue."""
        req.finished_reason = reason
        self.grammars.release(req)  # a compile it alone waited for is abandoned
        req.grammar = None
        self._release(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def send_outputs(self, reqs: list[Req]) -> None:
        """Send each request's new output: embeddings to the TokenizerManager, ids onward."""
        embeddings = [r for r in reqs if r.is_embedding]
        if embeddings:
            self.send_to_tokenizer.send_nowait(embedding_output(embeddings))
        generated = [r for r in reqs if not r.is_embedding]
        if generated:
            self.send_to_detokenizer.send_nowait(token_id_output(generated))

    def _release(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache and free its request slot."""
        if req.req_pool_idx is None:
            return
        self.tree_cache.cache_finished_req(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def _discard_own_kv(self, req: Req) -> None:
        """Free the KV slots the request owns past its cached prefix, without caching them."""
        if req.req_pool_idx is None or req.kv_len <= req.cache_protected_len:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.allocator.free(row[req.cache_protected_len:req.kv_len].clone())
        req.kv_len = req.cache_protected_len

    # ------------------------------------------------------------------ metrics

    def maybe_send_metrics(self) -> None:
        """Send a ``SchedulerMetrics`` report about once a second."""
        if self.stats.since_last_report() < _METRICS_INTERVAL_S:
            return
        used = self.allocator.size - self.tree_cache.available_size()
        self.send_metrics.send_nowait(self.stats.report(
            num_running=len(self.running), num_waiting=len(self.waiting),
            used_tokens=used, max_total_tokens=self.allocator.size,
        ))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (waiting for a load that is still going on)."""
        return self.tokenizer_future.result()

    def _start_loading_tokenizer(self) -> tuple[Future[Any], str]:
        """The tokenizer, as a future, and its class.

        A class picked before for the same files (``tokenizer_choice``) is what
        the launcher hands out already; in a process of its own, the Scheduler then
        loads it on a thread while it starts serving, as only stop strings and
        grammars need it (and the load is mostly transformers' import, about a
        second). Otherwise the load runs now, to report the class it picks.
        """
        from framework.runtime.hf_tokenizer import at_once, in_background, tokenizer_class_path
        from framework.runtime.tokenizer_choice import remembered_tokenizer_class

        remembered = remembered_tokenizer_class(self.server_args.resolved_tokenizer_path())
        if remembered is not None and self.server_args.launch_mode == "process":
            # Started once the model is built: nothing else here imports transformers then.
            return in_background(self._load_tokenizer), remembered
        loaded = at_once(self._load_tokenizer)
        return loaded, tokenizer_class_path(loaded.result())

    def _load_tokenizer(self) -> Any:
        from framework.runtime.hf_tokenizer import load_tokenizer

        return load_tokenizer(self.server_args.resolved_tokenizer_path())


def prompt_chunks(spans: list[range], values: list[float], top_values: list[list[float]],
                  top_ids: list[list[int]]) -> list[PromptLogprobChunk]:
    """The step's prompt logprobs (one per position of ``spans``, in order), per request."""
    chunks, start = [], 0
    for span in spans:
        end = start + len(span)
        chunks.append(PromptLogprobChunk(values[start:end], top_values[start:end],
                                         top_ids[start:end]))
        start = end
    return chunks
