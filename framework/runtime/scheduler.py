"""The Scheduler: continuous batching over the ModelRunner, one step at a time.

Each step it takes every request waiting on its channels (without blocking),
picks a batch (a prefill of waiting requests, chunked to a token budget, or a
decode step of the running ones), runs the model, samples, checks stop
conditions and sends new token ids to the Detokenizer every
``stream_interval`` tokens (and always when a request finishes).

Subclass it and override ``get_next_batch_to_run`` or
``select_prefill_requests`` to change how batches are chosen.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from framework.comm.transport import Receiver, RpcServer, Sender, Transport
from framework.config import PortArgs, ServerArgs
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    ErrorReply,
    FinishReason,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInfoReqInput,
    GetInfoReqOutput,
    Message,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from framework.registry import create_codec
from framework.runtime.request import Req
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.scheduler")

_IDLE_WAIT_S = 0.05
_METRICS_INTERVAL_S = 1.0
_EMBEDDING_PARAMS = SamplingParams(max_new_tokens=0)
# Prompt ids sent as decoding context with a request's first output.
_CONTEXT_IDS = 5


@dataclass
class ScheduledBatch:
    """The requests of one step and what the step does for each."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request (1 each for DECODE)

    def completes_prefill(self, i: int) -> bool:
        """Whether request ``i`` samples a token after this step (false for a partial chunk)."""
        req = self.reqs[i]
        return req.kv_len == req.seq_len


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
        if model_runner is None:
            from framework.model_executor.model_runner import ModelRunner

            model_runner = ModelRunner(server_args, server_args.resolved_model_path())
        self.model_runner = model_runner
        self.model_config = model_runner.model_config
        self.tokenizer = self._load_tokenizer()
        self.context_len = self.model_config.context_len
        self.eos_token_ids: set[int] = set(self.model_config.eos_token_ids)

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
        self._stop = threading.Event()
        self._last_metrics = 0.0
        self._generated_since_metrics = 0
        self.aborted_requests = 0
        self.steps = {mode.name.lower(): 0 for mode in ForwardMode}

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
        for msg in self.recv_from_tokenizer.drain():
            self.handle_request(msg)
        self.handle_rpc()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.run_batch(batch)
        self.maybe_send_metrics()
        return batch is not None or bool(self.waiting)

    def close(self) -> None:
        """Close every channel end."""
        for end in (self.recv_from_tokenizer, self.rpc_server, self.send_to_detokenizer,
                    self.send_to_tokenizer, self.send_metrics):
            end.close()

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
            rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=params,
            stream=msg.stream, return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            stream_interval=params.stream_interval or self.server_args.stream_interval,
        )
        capacity = min(self.context_len, self.model_runner.token_to_kv_allocator.size)
        room = capacity - len(req.origin_input_ids)
        if params.max_new_tokens > room:
            # As the OpenAI API does, generation stops at the context length (or at what the
            # KV cache can hold for a request alone).
            params.max_new_tokens = max(room, 0)
            params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        self.add_request(req)

    def add_request(self, req: Req) -> None:
        """Queue ``req`` unless it can never run; then finish it with the reason."""
        problem = self.validate(req)
        if problem is not None:
            self.finish(req, FinishReason("abort", message=problem))
            self.send_outputs([req])
            return
        self.waiting.append(req)

    def validate(self, req: Req) -> str | None:
        """Why ``req`` cannot run, or None."""
        n = len(req.origin_input_ids)
        if req.is_embedding != self.model_config.is_embedding:
            served = "embeddings" if self.model_config.is_embedding else "text generation"
            return f"this model serves {served} only"
        if n == 0:
            return "the prompt is empty"
        if n >= self.context_len and not req.is_embedding:
            return (f"the prompt has {n} tokens, but the model's context length is "
                    f"{self.context_len}")
        if n > self.context_len:
            return f"the input has {n} tokens, more than the context length {self.context_len}"
        if n + 1 > self.model_runner.token_to_kv_allocator.size:
            return (f"the prompt has {n} tokens, more than the KV cache holds "
                    f"({self.model_runner.token_to_kv_allocator.size})")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.origin_input_ids):
            return f"token ids must be in [0, {vocab})"
        return None

    def abort(self, msg: AbortReq) -> None:
        """Finish the named request (or all) with an abort reason the client sees."""
        def matches(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        reason = FinishReason("abort", message=msg.reason)
        for req in [r for r in self.waiting if matches(r)]:
            self.waiting.remove(req)
            self.finish(req, reason)
            self.send_outputs([req])
            self.aborted_requests += 1
        aborted = [r for r in self.running if matches(r) and not r.finished]
        for req in aborted:
            self.finish(req, reason)
        self.aborted_requests += len(aborted)
        if aborted:
            self.send_outputs(aborted)
            self.running = [r for r in self.running if not r.finished]

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
        """Drop cached prefixes; refused while requests are in flight."""
        if self.running or self.waiting:
            return FlushCacheReqOutput(success=False,
                                       message="requests are running; flush when idle")
        return FlushCacheReqOutput(success=True, message="cache flushed")

    def update_weights_from_disk(
        self, msg: UpdateWeightsFromDiskReqInput
    ) -> UpdateWeightsFromDiskReqOutput:
        """Swap weights between steps; running requests are aborted if asked, else kept."""
        paused = len(self.running) + len(self.waiting)
        if msg.abort_all_requests:
            self.abort(AbortReq(abort_all=True, reason="weights are being updated"))
        ok, message = self.model_runner.update_weights_from_disk(msg.model_path, msg.load_format)
        if ok:
            self.flush_cache()
        return UpdateWeightsFromDiskReqOutput(success=ok, message=message,
                                              num_paused_requests=paused)

    def get_info(self) -> dict[str, str | int | float | bool | None]:
        """State for ``/get_server_info`` and for KV-leak checks."""
        allocator = self.model_runner.token_to_kv_allocator
        req_pool = self.model_runner.req_to_token_pool
        return {
            "pid": os.getpid(),
            "scheduler_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "aborted_requests": self.aborted_requests,
            "extend_steps": self.steps["extend"],
            "decode_steps": self.steps["decode"],
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "max_total_tokens": allocator.size,
            "available_kv_tokens": allocator.available_size(),
            "max_running_requests": self.server_args.max_running_requests,
            "available_req_slots": req_pool.available_size(),
            "req_slots": req_pool.size,
            "context_length": self.context_len,
            "kv_cache_idle_and_free": self.memory_is_free(),
            "attention_backend": self.server_args.attention_backend,
            "device": str(self.model_runner.device),
            "dtype": str(self.model_runner.dtype).removeprefix("torch."),
        }

    def memory_is_free(self) -> bool:
        """True when idle and every KV slot and request slot is free."""
        allocator = self.model_runner.token_to_kv_allocator
        req_pool = self.model_runner.req_to_token_pool
        return (
            not self.running and not self.waiting
            and allocator.available_size() == allocator.size
            and req_pool.available_size() == req_pool.size
        )

    # ------------------------------------------------------------------ batching

    def get_next_batch_to_run(self) -> ScheduledBatch | None:
        """Prefill first (new requests start sooner), otherwise decode the running batch."""
        batch = self.select_prefill_requests()
        if batch is not None:
            return batch
        if not self.running:
            return None
        self.make_room_for_decode()
        return ScheduledBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def select_prefill_requests(self) -> ScheduledBatch | None:
        """Take waiting requests in order while the token budget, slots and KV allow."""
        budget = self.server_args.chunked_prefill_size
        allocator = self.model_runner.token_to_kv_allocator
        # Keep one KV slot per running request for its next decode step, and one for each
        # admitted request too: a request admitted without room to decode would be retracted
        # at once and admitted again, forever.
        free_kv = allocator.available_size() - len(self.running)
        reqs: list[Req] = []
        lens: list[int] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.req_pool_idx is None and (
                len(self.running) + len(reqs) >= self.server_args.max_running_requests
            ):
                break
            chunk = req.extend_remaining if req.is_embedding else min(req.extend_remaining,
                                                                       budget)
            if chunk + 1 > free_kv or (req.is_embedding and chunk > budget and reqs):
                break
            if req.req_pool_idx is None:
                slots = self.model_runner.req_to_token_pool.alloc(1)
                if slots is None:
                    break
                req.req_pool_idx = slots[0]
            self.waiting.popleft()
            reqs.append(req)
            lens.append(chunk)
            budget -= chunk
            free_kv -= chunk + 1
            if chunk < req.extend_remaining:
                break  # a chunked request ends the batch; it continues next step
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)

    def make_room_for_decode(self) -> None:
        """Retract the newest running requests until every other one has a KV slot."""
        allocator = self.model_runner.token_to_kv_allocator
        while len(self.running) > 1 and allocator.available_size() < len(self.running):
            req = self.running.pop()
            self.release(req)
            req.kv_len = 0
            self.waiting.appendleft(req)
            logger.info("retracted %s to free KV cache", req.rid)

    # ------------------------------------------------------------------ model step

    def run_batch(self, batch: ScheduledBatch) -> None:
        """Run one model step for ``batch`` and process its results."""
        self.steps[batch.mode.name.lower()] += 1
        forward_batch = self.build_forward_batch(batch)
        output = self.model_runner.forward(forward_batch)
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.kv_len += n
        if output.embeddings is not None:
            self.process_embeddings(batch, output.embeddings)
            return
        # Requests whose prompt is now fully in the cache sample a token; a partial chunk
        # does not (its logits are for a token in the middle of the prompt).
        sampled = [i for i in range(len(batch.reqs)) if batch.completes_prefill(i)]
        if sampled:
            self.sample_and_append(batch, output.next_token_logits, sampled)
        self.after_step(batch, set(sampled))

    def build_forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        """Allocate KV slots for the new tokens and pack them (no padding)."""
        runner = self.model_runner
        device = runner.device
        input_ids: list[int] = []
        positions: list[int] = []
        prefix_lens: list[int] = []
        seq_lens: list[int] = []
        total = sum(batch.extend_lens)
        out_cache_loc = runner.token_to_kv_allocator.alloc(total)
        if out_cache_loc is None:
            raise RuntimeError("KV cache exhausted after admission control (a bug)")
        offset = 0
        for req, n in zip(batch.reqs, batch.extend_lens):
            start = req.kv_len
            ids = req.fill_ids[start:start + n] if batch.mode.is_extend() else req.output_ids[-1:]
            input_ids.extend(ids)
            positions.extend(range(start, start + n))
            runner.req_to_token_pool.req_to_token[req.req_pool_idx, start:start + n] = (
                out_cache_loc[offset:offset + n])
            offset += n
            prefix_lens.append(start)
            seq_lens.append(start + n)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        extend = batch.mode.is_extend()
        return ForwardBatch(
            forward_mode=batch.mode,
            batch_size=len(batch.reqs),
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            req_pool_indices=tensor([r.req_pool_idx for r in batch.reqs]),
            seq_lens=tensor(seq_lens),
            out_cache_loc=out_cache_loc.to(device),
            extend_prefix_lens=tensor(prefix_lens) if extend else None,
            extend_seq_lens=tensor(batch.extend_lens) if extend else None,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens if extend else None,
            extend_seq_lens_cpu=list(batch.extend_lens) if extend else None,
        )

    def sample_and_append(self, batch: ScheduledBatch, logits: torch.Tensor,
                          rows: list[int]) -> None:
        """Sample the next token of each request in ``rows`` and check its stop conditions."""
        from framework.layers.sampler import SamplingBatchInfo

        reqs = [batch.reqs[i] for i in rows]
        if len(rows) != len(batch.reqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs], self.eos_token_ids,
            self.model_config.vocab_size, logits.device, self.server_args.random_seed,
        )
        top_n = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        out = self.model_runner.sample(logits, info, top_n)
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist()
        for k, req in enumerate(reqs):
            if req.sampling_params.max_new_tokens == 0:
                self.finish(req, FinishReason("length"))
                continue
            req.output_ids.append(next_ids[k])
            if req.return_logprob:
                req.output_logprobs.append(logprobs[k])
                req.output_top_logprobs_val.append(out.top_logprobs_val[k])
                req.output_top_logprobs_idx.append(out.top_logprobs_idx[k])
            self.check_finished(req)
        self._generated_since_metrics += len(reqs)

    def check_finished(self, req: Req) -> None:
        """Set the finish reason if the last token ends the request."""
        params = req.sampling_params
        last = req.output_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or (
            last in params.stop_token_ids
        ):
            self.finish(req, FinishReason("stop", matched=last))
        elif params.stop and (matched := self.match_stop_string(req)) is not None:
            self.finish(req, FinishReason("stop", matched=matched))
        elif len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_len:
            self.finish(req, FinishReason("length"))

    def match_stop_string(self, req: Req) -> str | None:
        """The first stop string that the end of the output now contains, if any."""
        stops = req.sampling_params.stop
        # Enough trailing tokens to hold the longest stop string, plus one for a boundary.
        window = max(len(s) for s in stops) + 1
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        found = [(tail.find(s), s) for s in stops if s in tail]
        return min(found)[1] if found else None

    def after_step(self, batch: ScheduledBatch, sampled: set[int]) -> None:
        """Send due outputs, free finished requests, move prefilled ones to running."""
        due = [r for r in batch.reqs if r.output_due()]
        if due:
            self.send_outputs(due)
        running_ids = {id(r) for r in self.running}
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            if i not in sampled:
                self.waiting.appendleft(req)  # a chunk remains; continue next step
            elif id(req) not in running_ids:
                self.running.append(req)
        self.running = [r for r in self.running if not r.finished]

    def process_embeddings(self, batch: ScheduledBatch, embeddings: torch.Tensor) -> None:
        """Send pooled embeddings to the TokenizerManager and free the requests."""
        vectors = embeddings.float().cpu().numpy()  # [batch, hidden]
        for req in batch.reqs:
            self.finish(req, FinishReason("stop"))
        self.send_to_tokenizer.send_nowait(BatchEmbeddingOutput(
            rids=[r.rid for r in batch.reqs],
            finished_reasons=[r.finished_reason for r in batch.reqs],
            embeddings=vectors,
            prompt_tokens=[len(r.origin_input_ids) for r in batch.reqs],
        ))

    # ------------------------------------------------------------------ output

    def finish(self, req: Req, reason: FinishReason) -> None:
        """Mark ``req`` finished and give back its KV and request slots."""
        req.finished_reason = reason
        self.release(req)

    def release(self, req: Req) -> None:
        """Free the KV slots and the request slot that ``req`` holds."""
        if req.req_pool_idx is None:
            return
        runner = self.model_runner
        if req.kv_len:
            slots = runner.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_len]
            runner.token_to_kv_allocator.free(slots.clone())
        runner.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def send_outputs(self, reqs: list[Req]) -> None:
        """Send each request's ids since its last output to the Detokenizer."""
        embedding = [r for r in reqs if r.is_embedding]
        if embedding:
            self.send_to_tokenizer.send_nowait(BatchEmbeddingOutput(
                rids=[r.rid for r in embedding],
                finished_reasons=[r.finished_reason for r in embedding],
                embeddings=np.zeros((len(embedding), 0), dtype=np.float32),
                prompt_tokens=[len(r.origin_input_ids) for r in embedding],
            ))
            reqs = [r for r in reqs if not r.is_embedding]
            if not reqs:
                return
        out = BatchTokenIDOutput(
            rids=[], finished_reasons=[], output_ids=[], skip_special_tokens=[],
            spaces_between_special_tokens=[], no_stop_trim=[], prompt_tokens=[],
            completion_tokens=[], cached_tokens=[],
        )
        # Optional lists stay empty (not one empty list per request) when nobody needs them.
        with_logprobs = any(r.return_logprob for r in reqs)
        with_first = any(r.sent_len == 0 for r in reqs)
        for req in reqs:
            start = req.sent_len
            params = req.sampling_params
            out.rids.append(req.rid)
            out.finished_reasons.append(req.finished_reason)
            out.output_ids.append(req.output_ids[start:])
            out.skip_special_tokens.append(params.skip_special_tokens)
            out.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
            out.no_stop_trim.append(params.no_stop_trim)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            if with_logprobs:
                out.output_token_logprobs_val.append(req.output_logprobs[start:])
                out.output_token_logprobs_idx.append(
                    req.output_ids[start:] if req.return_logprob else [])
                out.output_top_logprobs_val.append(req.output_top_logprobs_val[start:])
                out.output_top_logprobs_idx.append(req.output_top_logprobs_idx[start:])
            if with_first:
                first = req.sent_len == 0
                out.stop_strs.append(list(params.stop) if first else [])
                out.context_ids.append(
                    req.origin_input_ids[-_CONTEXT_IDS:] if first else [])
            req.sent_len = len(req.output_ids)
        self.send_to_detokenizer.send_nowait(out)

    def maybe_send_metrics(self) -> None:
        """Send a ``SchedulerMetrics`` report about once a second."""
        now = time.monotonic()
        elapsed = now - self._last_metrics
        if elapsed < _METRICS_INTERVAL_S:
            return
        allocator = self.model_runner.token_to_kv_allocator
        used = allocator.size - allocator.available_size()
        self.send_metrics.send_nowait(SchedulerMetrics(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_used_tokens=used, max_total_tokens=allocator.size,
            token_usage=used / max(allocator.size, 1),
            gen_throughput=self._generated_since_metrics / elapsed if self._last_metrics else 0.0,
            cache_hit_rate=0.0, timestamp=time.time(),
        ))
        self._last_metrics = now
        self._generated_since_metrics = 0

    def _load_tokenizer(self) -> Any:
        from framework.runtime.hf_tokenizer import load_tokenizer

        return load_tokenizer(self.server_args.resolved_tokenizer_path())

