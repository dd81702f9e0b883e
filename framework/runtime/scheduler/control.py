"""The Scheduler's control side: RPCs (flush the cache, update weights, get info), the
state ``/get_server_info`` shows, the idle invariant, and the periodic metrics."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any

import torch

from framework.mem_cache.accounting import slot_accounting_problem
from framework.mem_cache.prefix_cache import ChunkCache
from framework.messages import (
    AbortReq,
    ErrorReply,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInfoReqInput,
    GetInfoReqOutput,
    LoadLoraAdapterReqInput,
    LoraAdapterReqOutput,
    Message,
    UnloadLoraAdapterReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)

if TYPE_CHECKING:
    from framework.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger("framework.scheduler")

_METRICS_INTERVAL_S = 1.0


class SchedulerControl:
    """Answers the Scheduler's RPCs and reports its state (it reads the whole Scheduler)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def handle_rpcs(self, before_reply: Callable[[], object]) -> None:
        """Answer every waiting RPC request, each after ``before_reply()`` (which applies
        the step in flight: an RPC sees, and may change, the state between steps)."""
        server = self.scheduler.rpc_server
        while (got := server.recv_nowait()) is not None:
            token, msg = got
            before_reply()
            try:
                reply = self.scheduler.handle_rpc_request(msg)
            except Exception as exc:  # a failed RPC must not take the scheduler down
                logger.exception("RPC %s failed", type(msg).__name__)
                reply = ErrorReply(message=f"{type(exc).__name__}: {exc}")
            server.reply(token, reply)

    def reply(self, msg: Message) -> Message:
        """The reply to one RPC request (``Scheduler.handle_rpc_request``'s default)."""
        if isinstance(msg, FlushCacheReqInput):
            return self.flush_cache()
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            return self.update_weights_from_disk(msg)
        if isinstance(msg, GetInfoReqInput):
            return GetInfoReqOutput(info=self.scheduler.get_info())
        if isinstance(msg, LoadLoraAdapterReqInput):
            return self.load_lora_adapter(msg.lora_name, msg.lora_path)
        if isinstance(msg, UnloadLoraAdapterReqInput):
            return self.unload_lora_adapter(msg.lora_name)
        return ErrorReply(message=f"unknown RPC request {type(msg).__name__}")

    def load_lora_adapter(self, name: str, path: str) -> LoraAdapterReqOutput:
        """Load adapter ``name`` from ``path``; requests may name it from then on."""
        ok, message = self.scheduler.worker.load_lora_adapter(name, path)
        if ok:
            self.scheduler.intake.lora_names.add(name)
        return LoraAdapterReqOutput(success=ok, message=message)

    def unload_lora_adapter(self, name: str) -> LoraAdapterReqOutput:
        """Unload adapter ``name``; refused while requests use it. Its prefix-cache key
        space is retired, so that an adapter loaded later under the name reuses no KV."""
        scheduler = self.scheduler
        users = sum(req.lora_name == name for req in scheduler.queues.all())
        if users:
            return LoraAdapterReqOutput(
                success=False, message=f"LoRA adapter {name!r} is in use by {users} "
                                       "requests; unload it when they end")
        ok, message = scheduler.worker.unload_lora_adapter(name)
        if ok:
            scheduler.intake.retire_lora(name)
        return LoraAdapterReqOutput(success=ok, message=message)

    def flush_cache(self) -> FlushCacheReqOutput:
        """Drop every cached prefix; refused while requests are in flight."""
        scheduler = self.scheduler
        busy = len(scheduler.all_requests())
        if busy:
            return FlushCacheReqOutput(
                success=False,
                message=f"{busy} requests are in flight and hold cached prefixes; "
                        "flush when idle")
        freed = scheduler.tree_cache.evictable_size()
        scheduler.tree_cache.flush()
        return FlushCacheReqOutput(success=True, message=f"cache flushed ({freed} tokens freed)")

    def update_weights_from_disk(
        self, msg: UpdateWeightsFromDiskReqInput
    ) -> UpdateWeightsFromDiskReqOutput:
        """Swap weights between steps; in-flight requests are aborted if asked, else kept.

        Kept requests are retracted before the swap, so that they recompute their KV
        with the new weights (their output so far is kept), and the cache is flushed:
        no KV computed with the old weights is ever reused.
        """
        scheduler = self.scheduler
        queues = scheduler.queues
        paused = len(queues.all())
        if msg.abort_all_requests:
            queues.abort(AbortReq(abort_all=True, reason="weights are being updated"))
        # Reading another model type's config imports transformers: not while the
        # tokenizer's load (which imports it too) may still be going on, on its thread.
        wait([scheduler.tokenizer_future])
        ok, message = scheduler.worker.update_weights_from_disk(msg.model_path, msg.load_format)
        previous = scheduler.weights_source
        if ok:
            scheduler.weights_source = (msg.model_path, msg.load_format)
            for req in [*queues.running, *([queues.chunked_req] if queues.chunked_req else [])]:
                queues.retract(req)
            scheduler.tree_cache.flush()
        return UpdateWeightsFromDiskReqOutput(
            success=ok, message=message, num_paused_requests=paused,
            previous_model_path=previous[0], previous_load_format=previous[1])

    def info(self) -> dict[str, Any]:
        """State for ``/get_server_info`` and for KV-leak checks.

        The worker adds its own (``ModelWorker.info``): the backends, device and dtype,
        and with the ``ModelRunner`` each rank's pid and bytes of parameters, of all its
        weights and of KV cache (``pid_rank_K``, ``param_bytes_rank_K``,
        ``weight_bytes_rank_K``, ``kv_cache_bytes_rank_K``).
        """
        scheduler = self.scheduler
        server_args, stats, cache = scheduler.server_args, scheduler.stats, scheduler.tree_cache
        allocator, pool = scheduler.allocator, scheduler.req_to_token_pool
        return {
            **scheduler.worker.info(),
            "tp_size": server_args.tp_size,
            "pp_size": server_args.pp_size,
            "pid": os.getpid(),
            "scheduler_class": f"{type(scheduler).__module__}.{type(scheduler).__qualname__}",
            "aborted_requests": stats.aborted_requests,
            "failed_requests": stats.failed_requests,
            "retracted_requests": stats.retracted_requests,
            "extend_steps": scheduler.steps["extend"],
            "decode_steps": scheduler.steps["decode"],
            "verify_steps": scheduler.steps["verify"],
            # Wall time of the steps that ran a batch, and of their model forwards; the
            # rest (scheduling, sampling, outputs) is the runtime's own overhead.
            "step_seconds": stats.step_seconds,
            "forward_seconds": stats.forward_seconds,
            "non_model_fraction": stats.non_model_fraction,
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "max_total_tokens": allocator.size,
            "available_kv_tokens": allocator.available_size(),
            "evictable_kv_tokens": cache.evictable_size(),
            "protected_kv_tokens": cache.protected_size(),
            "cache_hit_rate": stats.cache_hit_rate,
            "speculative_algorithm": server_args.speculative_algorithm,
            "spec_verifications": stats.spec_verifications,
            "spec_drafted_tokens": stats.spec_drafted_tokens,
            "spec_accepted_tokens": stats.spec_accepted_tokens,
            "spec_accept_length": stats.spec_accept_length,
            "spec_acceptance_rate": stats.spec_acceptance_rate,
            "radix_cache": not isinstance(cache, ChunkCache),
            "schedule_policy": server_args.schedule_policy,
            "overlap_schedule": scheduler.overlap is not None,
            "max_running_requests": server_args.max_running_requests,
            "available_req_slots": pool.available_size(),
            "req_slots": pool.size,
            "context_length": scheduler.context_len,
            "kv_cache_idle_and_free": self.memory_is_free(),
            "torch_threads": torch.get_num_threads(),
        }

    def memory_is_free(self) -> bool:
        """The idle invariant: nothing in flight, nothing locked, and every KV slot either
        free or held by the prefix cache, once (the sets compared, not their sizes)."""
        scheduler = self.scheduler
        return (not scheduler.queues.holders() and scheduler.tree_cache.protected_size() == 0
                and self.slot_accounting_problem() is None)

    def slot_accounting_problem(self) -> str | None:
        """What is wrong with where the KV slots and request rows are (``None``: nothing):
        each must be free, cached, or owned by exactly one live request."""
        scheduler = self.scheduler
        holders = [r for r in scheduler.queues.holders() if r.req_pool_idx is not None]
        table = scheduler.req_to_token_pool.req_to_token
        # A request owns its slots past the cached prefix it locked.
        owned = [table[r.req_pool_idx, r.cache_protected_len:r.kv_len] for r in holders]
        return slot_accounting_problem(scheduler.allocator, scheduler.tree_cache,
                                       scheduler.req_to_token_pool, owned,
                                       [r.req_pool_idx for r in holders])

    def maybe_send_metrics(self) -> None:
        """Send a ``SchedulerMetrics`` report about once a second."""
        scheduler = self.scheduler
        if scheduler.stats.since_last_report() < _METRICS_INTERVAL_S:
            return
        used = scheduler.allocator.size - scheduler.tree_cache.available_size()
        scheduler.send_metrics.send_nowait(scheduler.stats.report(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            used_tokens=used, max_total_tokens=scheduler.allocator.size,
        ))
