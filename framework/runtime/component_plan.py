"""Which components a node starts, the class each runs and the torch threads each gets.

Each scheduler rank runs torch on ``--torch-threads`` threads, by default
``max(1, (usable cores - 1) // ranks of this node)`` (the ranks of every
replica it runs): one core is left to the HTTP process and the Detokenizers,
which use one torch thread each, so that the processes of one machine do not
oversubscribe its cores.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from framework.config import ServerArgs
from framework.distributed.config import ParallelConfig
from framework.registry import import_dotted

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


@dataclass(frozen=True)
class ComponentSpec:
    """One component to start: its kind, its rank among the components of that kind, its name."""

    kind: str  # "scheduler" or "detokenizer"
    # In messages and logs: "scheduler", "scheduler rank 1", "detokenizer",
    # "scheduler replica 1", "detokenizer replica 1"
    name: str
    rank: int  # among its replica's ranks
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


def plan_components(server_args: ServerArgs, num_ranks: int | None = None,
                    cores: int | None = None) -> list[ComponentSpec]:
    """The components this node starts: its scheduler ranks, replica by replica, each
    replica's Detokenizer (on node 0) after its ranks.

    ``num_ranks`` stands for the ranks of one replica (default: tp_size × pp_size).
    """
    parallel = ParallelConfig.from_server_args(server_args)
    if num_ranks is not None:
        parallel = dataclasses.replace(parallel, tp_size=num_ranks, pp_size=1)
    mine = [parallel.place(g) for g in parallel.local_ranks()]
    threads = server_args.torch_threads
    if threads is None:
        threads = torch_threads_per_rank(usable_cores() if cores is None else cores, len(mine))
    one_name = parallel.world_size == parallel.nnodes == 1
    specs = []
    for replica in range(parallel.dp_size):
        suffix = "" if parallel.dp_size == 1 else f" replica {replica}"
        specs += [ComponentSpec("scheduler", f"scheduler{suffix}" if one_name
                                else f"scheduler{suffix} rank {rank}", rank, threads, replica)
                  for r, rank in mine if r == replica]
        if server_args.node_rank > 0:
            continue  # only node 0 turns token ids into text
        # A Detokenizer does no heavy torch work: one thread keeps it off the schedulers'
        # cores.
        specs.append(ComponentSpec("detokenizer", f"detokenizer{suffix}", 0, 1, replica))
    return specs


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
