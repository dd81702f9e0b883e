"""The one start-up path of the runtime, for ``framework serve`` and ``framework.Engine``.

``ComponentTree`` starts the components behind the TokenizerManager (one
Scheduler per scheduler rank, and the Detokenizer), waits until every one is
ready, watches them and stops them:

1. ``ComponentTree(server_args)`` checks the launch arguments and makes the
   transport and the channel addresses (``PortArgs``);
2. the caller builds its TokenizerManager on them, which binds its receivers
   first (``start_runtime`` does steps 2 and 3 for both callers);
3. ``start()`` starts the components, gathers the ready message of each (the
   first failure stops them all and raises ``ComponentError``) and returns
   scheduler rank 0's. A Scheduler's ready message names the tokenizer class
   that AutoTokenizer picked there, which the tree hands to each Detokenizer
   (waiting for it) and to the caller's tokenizer load
   (``start_loading_tokenizer``): only the Schedulers import torch;
4. ``wait_for_death()`` blocks until a component ends; ``stop()`` ends them
   all and removes the channels' directory.

With ``--launch-mode process`` (the default) each component is a spawned
process; a child dies with its parent (``PR_SET_PDEATHSIG`` plus a watchdog)
and the parent learns of a dead child through its process sentinel. With
``--launch-mode thread`` (for tests and debugging) they are daemon threads of
the calling process, which the ``inproc`` transport needs.

With ``--dp-size N`` there are N replicas, each with its own scheduler
rank(s) (``--tp-size`` × ``--pp-size`` of them, in process groups of their
own), its own Detokenizer and its own channels (one ``PortArgs`` per replica,
see ``framework/runtime/data_parallel.py``); they are named "scheduler replica
k [rank j]" and "detokenizer replica k" in logs and errors. With ``--nnodes``
the ranks of every replica are spread over the nodes in order; a replica whose
rank 0 runs on another node reaches node 0's front over ``tcp://``
(``replica_channels``).

How many components, and the torch threads of each, are planned in
``component_plan.py``; ``component_build.py`` builds a component where it runs
and ``component_handles.py`` runs it in a process or a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from framework.config import LAUNCH_MODES, PortArgs, ServerArgs
from framework.distributed.config import ParallelConfig, split_host_port
from framework.model_executor.model_dir import check_model_dir
from framework.registry import create_transport
from framework.runtime.component_handles import (
    UNGUARDED_MAIN_MESSAGE,
    ProcessHandle,
    ThreadHandle,
    die_with_parent,
    leave_if_importing_main,
    send_tokenizer_class,
)
from framework.runtime.component_plan import (
    ComponentSpec,
    check_component_classes,
    component_class,
    plan_components,
    set_torch_threads,
    torch_threads_per_rank,
    usable_cores,
)
from framework.runtime.hf_tokenizer import start_loading_tokenizer
from framework.runtime.tokenizer_choice import remembered_tokenizer_class

if TYPE_CHECKING:
    from framework.runtime.tokenizer_manager import TokenizerManager

# The start-up path's names, with those of its parts that callers import from here.
__all__ = [
    "UNGUARDED_MAIN_MESSAGE",
    "ComponentError",
    "ComponentTree",
    "check_launch_args",
    "die_with_parent",
    "plan_components",
    "run_ranks_only",
    "set_torch_threads",
    "torch_threads_per_rank",
    "transport_options",
    "usable_cores",
]

logger = logging.getLogger("framework.launch")

_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 10.0


def check_launch_args(server_args: ServerArgs) -> None:
    """Refuse launch settings that cannot work, with the field's name (a ``ValueError``)."""
    if server_args.launch_mode not in LAUNCH_MODES:
        raise ValueError(f"launch_mode must be one of {', '.join(LAUNCH_MODES)}, "
                         f"got {server_args.launch_mode!r}")
    if server_args.dp_size < 1:
        raise ValueError(f"dp_size must be at least 1, got {server_args.dp_size}")
    _check_parallel_args(server_args)
    if server_args.max_queued_requests is not None and server_args.max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be at least 0, "
                         f"got {server_args.max_queued_requests}")
    # Imported here: a child may import this module (through the caller's script) before it
    # sets its thread counts, and the router's messages bring numpy.
    from framework.runtime.data_parallel import make_load_balancer

    make_load_balancer(server_args.load_balance_method)  # a ValueError naming the field


def _check_parallel_args(server_args: ServerArgs) -> None:
    parallel = ParallelConfig.from_server_args(server_args)
    parallel.check()
    if not parallel.uses_distributed:
        return
    if server_args.launch_mode != "process":
        raise ValueError("tp_size or pp_size above 1, or nnodes above 1, needs launch_mode "
                         "'process': each rank is a process of its own")
    if remote_replicas(parallel) and (server_args.transport != "zmq"
                                      or server_args.curve_key_dir is None):
        raise ValueError("replicas on nodes other than 0 need the zmq transport and "
                         "curve_key_dir (the same CURVE keys on every node): their channels "
                         "cross machines over tcp://")


def remote_replicas(parallel: ParallelConfig) -> list[int]:
    """The replicas whose rank 0 (the one with channels) runs on a node other than 0."""
    return [r for r in range(parallel.dp_size) if parallel.node_of(parallel.global_rank(r, 0))]


def replica_channels(server_args: ServerArgs, transport: Any) -> list[PortArgs]:
    """Each replica's channel addresses, the same on every node.

    A replica served from node 0 gets fresh private ones (``ipc://``, or
    ``tcp://`` on the loopback with ``use_tcp``); one served from another node
    gets ``tcp://`` ports on node 0's host after ``dist_init_addr``'s
    (``PortArgs.on_node_0``), which every node computes alike.
    """
    parallel = ParallelConfig.from_server_args(server_args)
    remote = remote_replicas(parallel)
    tcp_host = "127.0.0.1" if server_args.use_tcp else None
    out = []
    for replica in range(server_args.dp_size):
        if replica in remote:
            host, port = split_host_port(server_args.dist_init_addr or "")
            out.append(PortArgs.on_node_0(host, port + 1 + replica * len(PortArgs.CHANNELS)))
        else:
            out.append(PortArgs.create(transport, tcp_host=tcp_host))
    return out


def _check_crosses_processes(transport: Any, name: str) -> None:
    # A transport travels to each child by pickling; one that refuses (inproc) lives in a
    # single process.
    try:
        pickle.dumps(transport)
    except Exception:
        raise ValueError(
            f"the {name} transport cannot cross a process boundary: use launch mode 'thread' "
            "(--launch-mode thread, for tests) or another transport such as zmq"
        ) from None


def transport_options(server_args: ServerArgs) -> dict[str, Any]:
    """The constructor options of the chosen transport; key files go to zmq only."""
    options: dict[str, Any] = {"allow_insecure_pickle": server_args.allow_insecure_pickle}
    if server_args.curve_key_dir is not None:
        if server_args.transport != "zmq":
            raise ValueError(f"curve_key_dir is for the zmq transport, not "
                             f"{server_args.transport!r}")
        options["curve_key_dir"] = server_args.curve_key_dir
    return options


class _StopRequested(Exception):
    """SIGINT or SIGTERM reached a node that runs scheduler ranks only."""


def run_ranks_only(server_args: ServerArgs) -> int:
    """Run this node's scheduler ranks (``--node-rank`` above 0) until stopped or one ends.

    A node other than 0 serves no HTTP and runs no TokenizerManager or
    Detokenizer: its ranks follow the steps of their replica's rank 0, and a
    replica's rank 0 that runs here talks to node 0's front. Returns 0
    after SIGINT or SIGTERM, 1 when a rank ended (node 0's going down ends them).
    """
    set_torch_threads(1, own_process=True, needs_torch=False)
    tree = ComponentTree(server_args)
    signals = (signal.SIGINT, signal.SIGTERM)

    def request_stop(*_: Any) -> None:
        for sig in signals:  # once: a second signal must not interrupt the stopping
            signal.signal(sig, signal.SIG_IGN)
        raise _StopRequested

    for sig in signals:
        signal.signal(sig, request_stop)
    reason: str | None = None
    try:
        tree.start()
        logger.info("node %d runs %s", server_args.node_rank,
                    ", ".join(spec.name for spec in tree.specs))
        reason = tree.wait_for_death()
    except _StopRequested:
        pass
    finally:
        tree.stop()
    if reason is None:
        return 0
    logger.error("%s; shutting down", reason)
    return 1


class ComponentError(RuntimeError):
    """A component failed to start or died."""


class ComponentTree:
    """The components of one server or Engine: every scheduler rank and the Detokenizer.

    They run as spawned processes, or as threads of this process with
    ``launch_mode="thread"``. The caller builds its TokenizerManager, an instance
    of ``tokenizer_manager_class``, on ``transport`` and ``port_args`` before
    ``start()``.
    """

    def __init__(self, server_args: ServerArgs, num_ranks: int | None = None) -> None:
        leave_if_importing_main()
        check_launch_args(server_args)
        # Named as the user gave it, before its tokenizer is looked for in it.
        check_model_dir(server_args.resolved_model_path())
        self.server_args = server_args
        check_component_classes(server_args)
        self.tokenizer_manager_class = component_class(server_args, "tokenizer_manager")
        self.transport = create_transport(server_args.transport,
                                          **transport_options(server_args))
        if server_args.launch_mode == "process":
            _check_crosses_processes(self.transport, server_args.transport)
        self.specs = plan_components(server_args, num_ranks)
        if ParallelConfig.from_server_args(server_args).uses_distributed \
                and server_args.dist_init_addr is None:
            # One node: the ranks meet on a port of the loopback interface.
            from framework.comm.zmq import free_tcp_port

            server_args = server_args.replace(dist_init_addr=f"127.0.0.1:{free_tcp_port()}")
            self.server_args = server_args
        # Each replica has channels of its own: no address has two senders.
        self.replica_port_args = replica_channels(server_args, self.transport)
        self.port_args = self.replica_port_args[0]
        self.handles: list[ProcessHandle | ThreadHandle] = []
        # Each scheduler's ready message, by (replica, rank).
        self.scheduler_infos: dict[tuple[int, int], dict[str, Any]] = {}
        # The class AutoTokenizer picked in the first Scheduler that is ready: the
        # Detokenizers and this process load it directly, without importing torch. With
        # processes, one picked before for the same files is known at once. (Threads
        # wait: transformers' lazy module is not safe to import from two at once.)
        self.tokenizer_class: concurrent.futures.Future[str] = concurrent.futures.Future()
        if server_args.launch_mode == "process":
            remembered = remembered_tokenizer_class(server_args.resolved_tokenizer_path())
            if remembered is not None:
                self.tokenizer_class.set_result(remembered)
        self._wake_reader, self._wake_writer = mp.Pipe(duplex=False)
        self._stop_lock = threading.Lock()
        self._stopping = False  # set first, so that wait_for_death reads a stop as no death
        self._stopped = False

    @property
    def scheduler_info(self) -> dict[str, Any]:
        """Scheduler rank 0's ready message: ``model`` (its ``ModelFacts``),
        ``attention_backend``, ``torch_threads``, ..."""
        return self.scheduler_infos.get((0, 0), {})

    @property
    def tokenizer_port_args(self) -> PortArgs | list[PortArgs]:
        """What the TokenizerManager is built on: the channels, or each replica's."""
        return self.port_args if len(self.replica_port_args) == 1 else self.replica_port_args

    def start(self) -> dict[str, Any]:
        """Start every component and wait until all are ready; return rank 0's ready message.

        Raises ``ComponentError`` naming the first component that failed, after
        stopping the others.
        """
        def args(spec: ComponentSpec) -> tuple[Any, ...]:
            return self.server_args, self.replica_port_args[spec.replica], self.transport

        if self.server_args.launch_mode == "process":
            ctx = mp.get_context("spawn")
            self.handles = [ProcessHandle(ctx, spec, args(spec)) for spec in self.specs]
        else:
            self.handles = [ThreadHandle(spec, args(spec)) for spec in self.specs]
        try:
            for handle in self.handles:
                self._start_unless_stopping(handle)
            if self.tokenizer_class.done():
                self._send_class_to_detokenizers(self.tokenizer_class.result())
            self._gather_ready()
        except BaseException:
            self.stop()
            raise
        return self.scheduler_info

    def _start_unless_stopping(self, handle: ProcessHandle | ThreadHandle) -> None:
        # Under stop()'s lock: a stop from another thread (a cancelled start-up) leaves
        # nothing started after it.
        with self._stop_lock:
            if self._stopping:
                raise ComponentError("the components were stopped while starting")
            handle.start()

    def _gather_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        pending = list(self.handles)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(h.spec.name for h in pending)
                raise ComponentError(f"the {names} did not start within {_READY_TIMEOUT_S:.0f} s")
            wait([h.ready for h in pending] + [h.sentinel for h in pending], min(remaining, 1.0))
            for handle in list(pending):
                if self._take_ready(handle):
                    pending.remove(handle)

    def _take_ready(self, handle: ProcessHandle | ThreadHandle) -> bool:
        """Whether ``handle`` reported ready; raises if it failed or ended instead."""
        message: tuple[str, Any] | None = None
        if handle.ready.poll():
            # EOF, or a reset where the child died with something it was sent unread (a
            # Detokenizer's tokenizer class): either way it ended without a word.
            with contextlib.suppress(EOFError, ConnectionResetError):
                message = handle.ready.recv()
        elif handle.is_alive():
            return False
        if message is None:
            raise ComponentError(handle.not_ready_message())
        status, payload = message
        if status != "ready":
            raise ComponentError(f"the {handle.spec.name} failed to start: {payload}")
        if handle.spec.kind == "scheduler":
            self.scheduler_infos[handle.spec.replica, handle.spec.rank] = payload
            if "tokenizer_class" in payload and not self.tokenizer_class.done():
                self._hand_out_tokenizer_class(payload["tokenizer_class"])
        return True

    def _hand_out_tokenizer_class(self, name: str) -> None:
        self.tokenizer_class.set_result(name)
        self._send_class_to_detokenizers(name)

    def _send_class_to_detokenizers(self, name: str) -> None:
        for handle in self.handles:
            if handle.spec.kind == "detokenizer":
                send_tokenizer_class(handle, name)

    def start_loading_tokenizer(self) -> concurrent.futures.Future[Any]:
        """The caller's tokenizer (``start_loading_tokenizer``), to ask for before ``start()``.

        With processes it loads, on a thread, the class the first Scheduler
        reports, once it does: this process then never imports torch. With
        threads, which import transformers themselves, it loads first, here.
        """
        args = self.server_args
        known = self.tokenizer_class if args.launch_mode == "process" else None
        return start_loading_tokenizer(args.resolved_tokenizer_path(), args.chat_template, known)

    def wait_for_death(self) -> str | None:
        """Block until a component ends; say which and how. ``None`` once ``stop()`` began."""
        sentinels = {h.sentinel: h for h in self.handles}
        ended = wait([*sentinels, self._wake_reader])
        if self._stopping:
            return None
        for obj in ended:
            if obj in sentinels:
                return sentinels[obj].death_message()
        return None

    def stop(self) -> None:
        """End every component (SIGTERM, then SIGKILL) and remove the channels' directory.

        Idempotent and thread-safe: the Engine's watchdog and its caller may both call it,
        and a second caller returns only once the first is done.
        """
        self._stopping = True
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            if not self.tokenizer_class.done():  # ends a load still waiting for the class
                self.tokenizer_class.set_exception(
                    ComponentError("the components stopped before a Scheduler was ready"))
            self._wake_writer.close()  # wakes wait_for_death
            for handle in self.handles:
                handle.request_stop()
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for handle in self.handles:
                handle.join(max(0.0, deadline - time.monotonic()))
                if handle.is_alive():
                    handle.force_stop()
            for handle in self.handles:
                handle.close()
            for port_args in self.replica_port_args:
                port_args.cleanup()


async def start_runtime(components: ComponentTree) -> TokenizerManager:
    """Start the runtime of ``components`` and its TokenizerManager on the running loop.

    The one start-up of ``framework serve`` and the Engine: the manager binds its
    receivers first (the components connect to them), the tokenizer loads while
    the components start, and the manager starts with the model facts of the
    Scheduler's ready message. A component or a tokenizer that fails ends
    start-up with its error; the manager is then closed, and the caller stops
    ``components``.
    """
    args = components.server_args
    tokenizer = components.start_loading_tokenizer()
    manager = components.tokenizer_manager_class(args, components.tokenizer_port_args,
                                                 components.transport, tokenizer)
    try:
        info = await asyncio.to_thread(components.start)
        await asyncio.wrap_future(tokenizer)
        manager.start(info["model"])
    except BaseException:
        await manager.close()
        raise
    return manager
