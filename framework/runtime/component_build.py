"""Building a component where it runs (its process or thread): a Scheduler rank or a
Detokenizer on its channels, as a ``RunningComponent`` to report, run, stop and close."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from framework.config import PortArgs, ServerArgs
from framework.distributed.config import ParallelConfig
from framework.model_facts import ModelFacts
from framework.runtime.component_plan import ComponentSpec, component_class
from framework.runtime.hf_tokenizer import import_transformers

logger = logging.getLogger("framework.launch")


class StoppedBeforeStart(Exception):
    """A thread component was told to stop while it waited for what it starts with."""


@dataclass
class RunningComponent:
    """A built component: what it reports as ready, and how to run, stop and close it."""

    info: dict[str, Any]
    run: Callable[[], None]
    stop: Callable[[], None]  # thread-safe, and safe in a signal handler
    close: Callable[[], None]
    # A rank that follows rank 0 waits inside collectives, where no Python signal handler
    # runs: SIGTERM ends its process at once (it holds no sockets or files to clean up).
    exit_on_sigterm: bool = False


def build_component(spec: ComponentSpec, server_args: ServerArgs, port_args: PortArgs,
                    transport: Any, launcher: Connection) -> RunningComponent:
    """Build the component of ``spec`` on its channels (in the process or thread that runs it).

    ``launcher`` is this component's end of its pipe to the ComponentTree: a
    Detokenizer first receives on it the tokenizer class the first Scheduler
    loaded (``ComponentTree.tokenizer_class``), so that it need not import
    torch to find it.
    """
    if spec.kind == "scheduler":
        return _build_scheduler(component_class(server_args, "scheduler"), spec, server_args,
                                port_args, transport)
    if spec.kind == "detokenizer":
        import_transformers()  # while the Scheduler starts
        tokenizer_class = launcher.recv()
        if tokenizer_class is None:
            raise StoppedBeforeStart
        detokenizer = component_class(server_args, "detokenizer").from_server_args(
            server_args, port_args, transport, tokenizer_class=tokenizer_class)
        return RunningComponent({}, lambda: asyncio.run(detokenizer.serve()), detokenizer.stop,
                                detokenizer.close)
    raise ValueError(f"unknown component kind {spec.kind!r}")


def _build_scheduler(cls: type, spec: ComponentSpec, server_args: ServerArgs,
                     port_args: PortArgs, transport: Any) -> RunningComponent:
    parallel = ParallelConfig.from_server_args(server_args)
    if parallel.uses_distributed:
        return _build_parallel_rank(cls, spec, parallel, server_args, port_args, transport)
    scheduler = cls(server_args, port_args, transport)
    return _scheduler_component(scheduler, spec)


def _scheduler_component(scheduler: Any, spec: ComponentSpec) -> RunningComponent:
    import torch

    info = {
        "tokenizer_class": scheduler.tokenizer_class,
        "model": ModelFacts(context_len=scheduler.context_len,
                            vocab_size=scheduler.model_config.vocab_size,
                            is_embedding=scheduler.model_config.is_embedding,
                            hidden_size=scheduler.model_config.hidden_size),
        "attention_backend": scheduler.worker.info()["attention_backend"],
        "rank": spec.rank,
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
    }
    return RunningComponent(info, scheduler.event_loop, scheduler.stop, scheduler.close)


def _build_parallel_rank(cls: type, spec: ComponentSpec, parallel: ParallelConfig,
                         server_args: ServerArgs, port_args: PortArgs,
                         transport: Any) -> RunningComponent:
    """Join the other ranks; each replica's rank 0 runs its Scheduler, the replica's other
    ranks follow its steps."""
    import torch

    from framework.distributed.parallel_state import (
        destroy_parallel,
        init_parallel,
        start_heartbeat,
    )
    from framework.distributed.step_sync import Follower
    from framework.model_executor.model_runner import ModelRunner, resolve_device

    rank = parallel.global_rank(spec.replica, spec.rank)
    local_index = rank - parallel.local_ranks().start  # the GPU of this rank on its node
    device = resolve_device(server_args.device, local_index)
    if device.type == "cuda" and torch.cuda.device_count() < parallel.ranks_per_node:
        # NCCL refuses two ranks on one GPU.
        raise ValueError(f"{parallel.ranks_per_node} scheduler ranks per node need as many "
                         f"GPUs; this node has {torch.cuda.device_count()}")
    context = init_parallel(parallel, rank, device)
    runner = ModelRunner(server_args, server_args.resolved_model_path(), parallel=context)
    if context.is_driver:
        from framework.runtime.scheduler.worker import ModelRunnerWorker

        scheduler = cls(server_args, port_args, transport,
                        model_worker=ModelRunnerWorker(runner))
        component = _scheduler_component(scheduler, spec)
        close = component.close

        def close_all() -> None:
            close()
            destroy_parallel()

        component.close = close_all
    else:
        follower = Follower(context.control, runner,
                            runner.pools.req_to_token_pool.req_to_token)
        info = {"rank": spec.rank, "pid": os.getpid(), "torch_threads": torch.get_num_threads()}
        component = RunningComponent(info, follower.run, lambda: None, destroy_parallel,
                                     exit_on_sigterm=True)
    if context.heartbeat is not None:
        # Every replica's Scheduler has its channels before any node reports ready: node 0's
        # front then never sends to a replica of another node that has not connected.
        context.heartbeat.barrier()
        start_heartbeat(context.heartbeat, _exit_on_lost_rank)
    return component


def _exit_on_lost_rank(reason: str) -> NoReturn:
    # Called from the heartbeat thread: the whole process goes, so that this node's
    # launcher sees it and takes the rest down.
    logger.error("%s; exiting", reason)
    logging.shutdown()
    os._exit(1)
