"""The one start-up path of the runtime, for ``framework serve`` and ``framework.Engine``.

``ComponentTree`` starts the components behind the TokenizerManager (one
Scheduler per scheduler rank, and the Detokenizer), waits until every one is
ready, watches them and stops them:

1. ``ComponentTree(server_args)`` checks the launch arguments and makes the
   transport and the channel addresses (``PortArgs``);
2. the caller builds its TokenizerManager on them, which binds its receivers
   first;
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
rank(s), its own Detokenizer and its own channels (one ``PortArgs`` per
replica, see ``framework/runtime/data_parallel.py``); they are named
"scheduler replica k" and "detokenizer replica k" in logs and errors.

Each scheduler rank runs torch on ``--torch-threads`` threads, by default
``max(1, (usable cores - 1) // (ranks × replicas))``: one core is left to the
HTTP process and the Detokenizers, which use one torch thread each, so that
the processes of one machine do not oversubscribe its cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from framework.config import PortArgs, ServerArgs
from framework.distributed.config import ParallelConfig
from framework.libc import linux_libc
from framework.model_executor.model_dir import check_model_dir
from framework.registry import create_transport, import_dotted
from framework.runtime.heap import hold_freed_memory
from framework.runtime.hf_tokenizer import import_transformers, start_loading_tokenizer
from framework.runtime.tokenizer_choice import remembered_tokenizer_class

logger = logging.getLogger("framework.launch")

_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 10.0
_JOIN_TIMEOUT_S = 5.0
LAUNCH_MODES = ("process", "thread")
# Each spawned child imports the caller's main module again. A script that starts the runtime
# at its top level, not under ``if __name__ == "__main__":``, would start it again in every
# child; the child exits with this code instead, silently, and the parent says why, once.
_UNGUARDED_MAIN_EXIT = 3
UNGUARDED_MAIN_MESSAGE = (
    "the script starts the runtime when it is imported, and each process the runtime spawns "
    "imports it again: put the code that starts it under `if __name__ == \"__main__\":`"
)


# Each kind of component, and the built-in class that ``--<kind>-class`` must subclass.
_BUILT_IN_CLASSES = {
    "scheduler": "framework.runtime.scheduler.Scheduler",
    "tokenizer_manager": "framework.runtime.tokenizer_manager.TokenizerManager",
    "detokenizer": "framework.runtime.detokenizer.Detokenizer",
}


def component_class(server_args: ServerArgs, kind: str) -> type:
    """The class to run for ``kind``: the built-in, or the subclass ``--<kind>-class`` names.

    Only that kind's modules are imported: the Scheduler's bring torch, which a
    process that runs no Scheduler (the HTTP process, the Detokenizer) does not
    pay for.
    """
    base = import_dotted(_BUILT_IN_CLASSES[kind])
    path = getattr(server_args, f"{kind}_class")
    if path is None:
        return base
    cls = import_dotted(path)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{path} is not a subclass of {base.__name__}")
    return cls


def check_component_classes(server_args: ServerArgs) -> None:
    """Refuse, before anything starts, a ``--<kind>-class`` that is no subclass of its built-in."""
    for kind in _BUILT_IN_CLASSES:
        if getattr(server_args, f"{kind}_class") is not None:
            component_class(server_args, kind)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ComponentSpec:
    """One component to start: its kind, its rank among the components of that kind, its name."""

    kind: str  # "scheduler" or "detokenizer"
    # In messages and logs: "scheduler", "scheduler rank 1", "detokenizer",
    # "scheduler replica 1", "detokenizer replica 1"
    name: str
    rank: int
    torch_threads: int
    replica: int = 0  # which data-parallel replica (whose channels) it belongs to


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def torch_threads_per_rank(cores: int, num_ranks: int) -> int:
    """Torch threads for each of ``num_ranks`` scheduler processes sharing ``cores`` cores.

    The ranks share the cores minus one, which is left to the HTTP process and
    the Detokenizer; each gets at least one thread.
    """
    if num_ranks < 1:
        raise ValueError(f"the number of scheduler ranks must be at least 1, got {num_ranks}")
    return max(1, (cores - 1) // num_ranks)


def num_scheduler_ranks(server_args: ServerArgs) -> int:
    """How many scheduler processes this node starts: its share of the TP×PP ranks."""
    return ParallelConfig.from_server_args(server_args).ranks_per_node


def plan_components(server_args: ServerArgs, num_ranks: int | None = None,
                    cores: int | None = None) -> list[ComponentSpec]:
    """The components to start: for each replica, every scheduler rank, then its Detokenizer."""
    ranks = num_scheduler_ranks(server_args) if num_ranks is None else num_ranks
    replicas = server_args.dp_size
    threads = server_args.torch_threads
    if threads is None:
        threads = torch_threads_per_rank(usable_cores() if cores is None else cores,
                                         ranks * replicas)
    specs = []
    # Ranks are global: node k runs the k-th run of ``ranks`` consecutive ones.
    first = server_args.node_rank * ranks
    for replica in range(replicas):
        suffix = "" if replicas == 1 else f" replica {replica}"
        specs += [
            ComponentSpec("scheduler", f"scheduler{suffix}" if ranks == server_args.nnodes == 1
                          else f"scheduler{suffix} rank {rank}", rank, threads, replica)
            for rank in range(first, first + ranks)
        ]
        if server_args.node_rank > 0:
            continue  # only node 0 turns token ids into text
        # A Detokenizer does no heavy torch work: one thread keeps it off the schedulers'
        # cores.
        specs.append(ComponentSpec("detokenizer", f"detokenizer{suffix}", 0, 1, replica))
    return specs


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
    # Imported here: a child imports this module before it sets its thread counts, and the
    # router's messages bring numpy.
    from framework.runtime.data_parallel import make_load_balancer

    make_load_balancer(server_args.load_balance_method)  # a ValueError naming the field


def _check_parallel_args(server_args: ServerArgs) -> None:
    parallel = ParallelConfig.from_server_args(server_args)
    parallel.check()
    if not parallel.is_parallel:
        return
    if server_args.launch_mode != "process":
        raise ValueError("tp_size or pp_size above 1 needs launch_mode 'process': each rank "
                         "is a process of its own")
    if server_args.dp_size > 1:
        raise ValueError("dp_size above 1 cannot be combined with tp_size or pp_size above 1")


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


def set_torch_threads(count: int, *, own_process: bool, needs_torch: bool) -> None:
    """Run this process's (or, in a thread, this thread's) torch work on ``count`` threads.

    ``own_process``: the caller owns the whole process (a child, or the
    ``framework serve`` main process), so a torch imported later also starts
    with ``count`` threads. Otherwise only ``torch.set_num_threads`` is called,
    which with torch's OpenMP backend (the CPU build) sets the count of the
    calling thread alone. Torch is imported only when ``needs_torch``.

    A process of its own also gets a smaller oneDNN primitive cache (128 instead of
    1024 entries, unless the environment sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``):
    the cache keeps a primitive and its buffers per tensor shape, and a Scheduler
    sees new shapes all the time, so the full cache kept growing resident memory
    (about 100 MB on the default model over ten minutes of mixed traffic). No
    cache at all costs a third of the serving throughput; 128 entries cost
    nothing measurable (``framework bench soak``, 60 s runs).
    """
    if own_process:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(count)
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    if needs_torch or "torch" in sys.modules:
        import torch

        torch.set_num_threads(count)


def transport_options(server_args: ServerArgs) -> dict[str, Any]:
    """The constructor options of the chosen transport; key files go to zmq only."""
    options: dict[str, Any] = {"allow_insecure_pickle": server_args.allow_insecure_pickle}
    if server_args.curve_key_dir is not None:
        if server_args.transport != "zmq":
            raise ValueError(f"curve_key_dir is for the zmq transport, not "
                             f"{server_args.transport!r}")
        options["curve_key_dir"] = server_args.curve_key_dir
    return options


def apply_scheduler_info(manager: Any, info: Mapping[str, Any]) -> None:
    """Tell the TokenizerManager what the Scheduler found: context length, vocabulary size
    and whether the model serves embeddings."""
    manager.context_len = info["context_len"]
    manager.vocab_size = info["vocab_size"]
    manager.is_embedding = info["is_embedding"]


class _StoppedBeforeStart(Exception):
    """A thread component was told to stop while it waited for what it starts with."""


class _StopRequested(Exception):
    """SIGINT or SIGTERM reached a node that runs scheduler ranks only."""


def run_ranks_only(server_args: ServerArgs) -> int:
    """Run this node's scheduler ranks (``--node-rank`` above 0) until stopped or one ends.

    A node other than 0 serves no HTTP and runs no TokenizerManager or
    Detokenizer: its ranks follow the steps of rank 0, on node 0. Returns 0
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
        logger.info("node %d: scheduler ranks %s are following node 0", server_args.node_rank,
                    ", ".join(str(spec.rank) for spec in tree.specs))
        reason = tree.wait_for_death()
    except _StopRequested:
        pass
    finally:
        tree.stop()
    if reason is None:
        return 0
    logger.error("%s; shutting down", reason)
    return 1


# --------------------------------------------------------------------------- components


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
            raise _StoppedBeforeStart
        detokenizer = component_class(server_args, "detokenizer").from_server_args(
            server_args, port_args, transport, tokenizer_class=tokenizer_class)
        return RunningComponent({}, lambda: asyncio.run(detokenizer.serve()), detokenizer.stop,
                                detokenizer.close)
    raise ValueError(f"unknown component kind {spec.kind!r}")


def _build_scheduler(cls: type, spec: ComponentSpec, server_args: ServerArgs,
                     port_args: PortArgs, transport: Any) -> RunningComponent:
    parallel = ParallelConfig.from_server_args(server_args)
    if parallel.is_parallel:
        return _build_parallel_rank(cls, spec, parallel, server_args, port_args, transport)
    scheduler = cls(server_args, port_args, transport)
    return _scheduler_component(scheduler, spec)


def _scheduler_component(scheduler: Any, spec: ComponentSpec) -> RunningComponent:
    import torch

    info = {
        "tokenizer_class": scheduler.tokenizer_class,
        "context_len": scheduler.context_len,
        "is_embedding": scheduler.model_config.is_embedding,
        "vocab_size": scheduler.model_config.vocab_size,
        "hidden_size": scheduler.model_config.hidden_size,
        "attention_backend": scheduler.worker.info()["attention_backend"],
        "rank": spec.rank,
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
    }
    return RunningComponent(info, scheduler.event_loop, scheduler.stop, scheduler.close)


def _build_parallel_rank(cls: type, spec: ComponentSpec, parallel: ParallelConfig,
                         server_args: ServerArgs, port_args: PortArgs,
                         transport: Any) -> RunningComponent:
    """Join the other ranks; global rank 0 runs the Scheduler, the others follow its steps."""
    import torch

    from framework.distributed.parallel_state import (
        destroy_parallel,
        init_parallel,
        start_heartbeat,
    )
    from framework.distributed.step_sync import Follower
    from framework.model_executor.model_runner import ModelRunner, resolve_device

    local_index = spec.rank - parallel.local_ranks().start  # the GPU of this rank on its node
    device = resolve_device(server_args.device, local_index)
    if device.type == "cuda" and torch.cuda.device_count() < parallel.ranks_per_node:
        # NCCL refuses two ranks on one GPU.
        raise ValueError(f"{parallel.ranks_per_node} scheduler ranks per node need as many "
                         f"GPUs; this node has {torch.cuda.device_count()}")
    context = init_parallel(parallel, spec.rank, device)
    runner = ModelRunner(server_args, server_args.resolved_model_path(), parallel=context)
    if context.heartbeat is not None:
        start_heartbeat(context.heartbeat, _exit_on_lost_rank)
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
        return component
    follower = Follower(context.control, runner, runner.pools.req_to_token_pool.req_to_token)
    info = {"rank": spec.rank, "pid": os.getpid(), "torch_threads": torch.get_num_threads()}
    return RunningComponent(info, follower.run, lambda: None, destroy_parallel,
                            exit_on_sigterm=True)


def _exit_on_lost_rank(reason: str) -> NoReturn:
    # Called from the heartbeat thread: the whole process goes, so that this node's
    # launcher sees it and takes the rest down.
    logger.error("%s; exiting", reason)
    logging.shutdown()
    os._exit(1)


def _start_failure_message(name: str, exc: Exception) -> str:
    if isinstance(exc, ValueError):
        return str(exc)  # a user error (bad model directory, bad flag): its message says it
    logger.exception("the %s failed to start", name)
    return f"{type(exc).__name__}: {exc}"


def _use_torch_threads(spec: ComponentSpec, *, own_process: bool) -> None:
    set_torch_threads(spec.torch_threads, own_process=own_process,
                      needs_torch=spec.kind == "scheduler")
    logger.info("the %s runs torch on %d thread(s) (%d usable cores)", spec.name,
                spec.torch_threads, usable_cores())


# --------------------------------------------------------------------------- child processes


def die_with_parent() -> None:
    """Make sure this child never outlives the process that started it."""
    # The launcher's pid as multiprocessing knows it: the parent may have died already, and
    # then os.getppid() names whoever adopted this process.
    launcher = mp.parent_process()
    parent = launcher.pid if launcher is not None and launcher.pid else os.getppid()
    libc = linux_libc()
    if libc is not None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)  # it died before the signal was asked for: nothing would send it

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _child_setup(server_args: ServerArgs) -> None:
    die_with_parent()
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s %(processName)s] %(levelname)s %(message)s")
    # The parent handles Ctrl-C and stops its children; a child just follows SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock (for the weight loader's progress bar) is a multiprocessing RLock:
    # a named semaphore, which a child ending with ``os._exit`` never unlinks (the resource
    # tracker then warns of a leak). This process's bars are its own: a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _report_start_failure(ready: Connection, name: str, exc: Exception) -> NoReturn:
    """Tell the parent why this child could not start, then exit."""
    ready.send(("error", _start_failure_message(name, exc)))
    sys.exit(1)


def run_component_process(spec: ComponentSpec, server_args: ServerArgs, port_args: PortArgs,
                          transport: Any, ready: Connection) -> None:
    """Body of one component's process: build it, report ready, run it until SIGTERM."""
    _child_setup(server_args)
    _use_torch_threads(spec, own_process=True)
    # A process of its own: its steps' tensors reuse freed memory instead of new pages.
    held = spec.kind == "scheduler" and hold_freed_memory()
    try:
        component = build_component(spec, server_args, port_args, transport, ready)
    except Exception as exc:
        _report_start_failure(ready, spec.name, exc)
    component.info["holds_freed_memory"] = held
    if component.exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGTERM, lambda *_: component.stop())
    ready.send(("ready", component.info))
    try:
        component.run()
    finally:
        component.close()
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End the process once a component has closed everything it holds.

    Without the interpreter's teardown of torch and every other module (half a
    second or more), so the runtime stops sooner; only the output streams and
    the log handlers have anything left to write.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _leave_if_importing_main() -> None:
    """In a spawned child still importing the parent's main module, exit (see
    ``_UNGUARDED_MAIN_EXIT``): multiprocessing marks that phase ``_inheriting``."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.exit(_UNGUARDED_MAIN_EXIT)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"with code {code} (killed by {signal.Signals(-code).name})"
    return f"with code {code}"


def _send_tokenizer_class(handle: _ProcessHandle | _ThreadHandle, name: str | None) -> None:
    """Hand a Detokenizer its tokenizer class (``None``: stop waiting for one)."""
    with contextlib.suppress(OSError):  # a component that died is reported by its sentinel
        handle.ready.send(name)


class _ProcessHandle:
    """One component in a spawned process."""

    def __init__(self, ctx: Any, spec: ComponentSpec, args: tuple[Any, ...]) -> None:
        self.spec = spec
        # Both ways: the child reports on it; the tree sends a Detokenizer its tokenizer class.
        self.ready, self._child_end = ctx.Pipe()
        self.process = ctx.Process(target=run_component_process, name=spec.name.replace(" ", "-"),
                                   args=(spec, *args, self._child_end), daemon=True)

    def start(self) -> None:
        self.process.start()
        self._child_end.close()  # the child holds the other copy: EOF once it exits

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_code(self) -> int | None:
        # The sentinel fires as the child exits, a moment before it can be reaped: join
        # first, or the code still reads None.
        self.process.join(_JOIN_TIMEOUT_S)
        return self.process.exitcode

    def not_ready_message(self) -> str:
        code = self.exit_code()
        if code == _UNGUARDED_MAIN_EXIT:
            return UNGUARDED_MAIN_MESSAGE
        # It died before its body ran (an import error, a crash); the child printed why.
        return (f"the {self.spec.name} failed to start: the process exited "
                f"{_describe_exit(code)} before reporting (see its output above)")

    def death_message(self) -> str:
        return (f"the {self.spec.name} process exited unexpectedly "
                f"{_describe_exit(self.exit_code())}")

    def request_stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self, timeout: float) -> None:
        if self.process.pid is not None:
            self.process.join(timeout)

    def force_stop(self) -> None:
        self.process.kill()
        self.process.join(_JOIN_TIMEOUT_S)

    def close(self) -> None:
        self.ready.close()
        self._child_end.close()  # still open if the process never started


class _ThreadHandle:
    """One component in a daemon thread of this process (``--launch-mode thread``)."""

    def __init__(self, spec: ComponentSpec, args: tuple[Any, ...]) -> None:
        self.spec = spec
        self._args = args
        self.ready, self._child_end = mp.Pipe()
        # Closed when the thread ends, so that its end can be waited on like a process's.
        self._done_reader, self._done_writer = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._body, name=spec.name, daemon=True)
        self._lock = threading.Lock()
        self._component: RunningComponent | None = None
        self._stop_requested = False
        self.error: BaseException | None = None

    def _body(self) -> None:
        try:
            self._build_and_run()
        finally:
            self._child_end.close()
            self._done_writer.close()

    def _build_and_run(self) -> None:
        _use_torch_threads(self.spec, own_process=False)
        try:
            component = build_component(self.spec, *self._args, self._child_end)
        except _StoppedBeforeStart:
            return
        except Exception as exc:
            with contextlib.suppress(OSError):  # the tree may have stopped and closed its end
                self._child_end.send(("error", _start_failure_message(self.spec.name, exc)))
            return
        with self._lock:
            if self._stop_requested:
                component.close()
                return
            self._component = component
        self._child_end.send(("ready", component.info))
        try:
            component.run()
        except Exception as exc:
            self.error = exc
            logger.exception("the %s thread failed", self.spec.name)
        finally:
            component.close()

    def start(self) -> None:
        self._thread.start()

    @property
    def sentinel(self) -> Connection:
        return self._done_reader

    @property
    def pid(self) -> int | None:
        return os.getpid()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def not_ready_message(self) -> str:
        return f"the {self.spec.name} failed to start: the thread ended without reporting"

    def death_message(self) -> str:
        detail = f": {self.error!r}" if self.error is not None else ""
        return f"the {self.spec.name} thread stopped unexpectedly{detail}"

    def request_stop(self) -> None:
        with self._lock:
            self._stop_requested = True
            component = self._component
        if component is not None:
            component.stop()
        elif self.spec.kind == "detokenizer":
            _send_tokenizer_class(self, None)  # it may still wait for its class: stop that

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def force_stop(self) -> None:
        # A thread cannot be killed; a daemon thread ends with the process.
        logger.warning("the %s thread did not stop in time; it ends with the process",
                       self.spec.name)

    def close(self) -> None:
        self.ready.close()  # the thread closes its own ends when it returns


# --------------------------------------------------------------------------- the tree


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
        _leave_if_importing_main()
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
        if ParallelConfig.from_server_args(server_args).is_parallel \
                and server_args.dist_init_addr is None:
            # One node: the ranks meet on a port of the loopback interface.
            from framework.comm.zmq import free_tcp_port

            server_args = server_args.replace(dist_init_addr=f"127.0.0.1:{free_tcp_port()}")
            self.server_args = server_args
        tcp_host = "127.0.0.1" if server_args.use_tcp else None
        # Each replica has channels of its own: no address has two senders.
        self.replica_port_args = [PortArgs.create(self.transport, tcp_host=tcp_host)
                                  for _ in range(server_args.dp_size)]
        self.port_args = self.replica_port_args[0]
        self.handles: list[_ProcessHandle | _ThreadHandle] = []
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
        """Scheduler rank 0's ready message: ``context_len``, ``is_embedding``, ``vocab_size``,
        ``hidden_size``, ..."""
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
            self.handles = [_ProcessHandle(ctx, spec, args(spec)) for spec in self.specs]
        else:
            self.handles = [_ThreadHandle(spec, args(spec)) for spec in self.specs]
        try:
            for handle in self.handles:
                handle.start()
            if self.tokenizer_class.done():
                self._send_class_to_detokenizers(self.tokenizer_class.result())
            self._gather_ready()
        except BaseException:
            self.stop()
            raise
        return self.scheduler_info

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

    def _take_ready(self, handle: _ProcessHandle | _ThreadHandle) -> bool:
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
                _send_tokenizer_class(handle, name)

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
