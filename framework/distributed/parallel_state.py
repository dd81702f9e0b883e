"""Process groups for tensor and pipeline parallelism, over ``torch.distributed``.

Every scheduler rank of a server is one process. ``ParallelConfig`` says how
many there are and where they meet (``--tp-size``, ``--pp-size``,
``--nnodes``, ``--node-rank``, ``--dist-init-addr``); ``init_parallel`` joins
this process to them and returns a ``ParallelContext`` holding its groups,
which is handed explicitly to the ``ModelRunner`` and its layers (there is no
module-level state here).

Rank layout: a replica's rank ``pp_rank * tp_size + tp_rank``, and global rank
``replica * tp_size * pp_size`` plus that (``--dp-size`` replicas, one after
another). The ranks of one pipeline stage of a replica form a tensor-parallel
group; its ranks with the same ``tp_rank`` across stages form a pipeline
group; all its ranks form its control group. Node ``k`` runs the global ranks
``[k * per_node, (k + 1) * per_node)``.

The device groups use NCCL on CUDA and gloo on CPU; control messages
(what each step runs) always travel over a gloo group of all ranks, whose
collectives may wait as long as the server is idle.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from framework.distributed.config import ParallelConfig, split_host_port

logger = logging.getLogger("framework.distributed")

# Joining the group and the tensor collectives of a step: a rank that takes longer is
# broken (a dead rank is seen at once by the launcher's watchdog, not by this timeout).
_INIT_TIMEOUT = timedelta(minutes=10)
# Ranks other than the first wait on the control group for the next step, as long as the
# server is idle.
_CONTROL_TIMEOUT = timedelta(days=3650)
#: How often the ranks of several nodes check on each other, and how long a beat may wait.
HEARTBEAT_INTERVAL_S = 1.0
_HEARTBEAT_TIMEOUT = timedelta(minutes=5)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


class GroupCoordinator:
    """One process group and this rank's place in it, with the collectives the model uses.

    ``ranks`` are global ranks; ``rank`` is this process's index among them.
    A group of one does no communication.
    """

    def __init__(self, group: Any, ranks: list[int], global_rank: int) -> None:
        self.group = group
        self.ranks = ranks
        self.rank = ranks.index(global_rank)
        self.size = len(ranks)

    @property
    def is_first(self) -> bool:
        """Whether this rank is the group's first."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank is the group's last."""
        return self.rank == self.size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks (in place; returns ``x``)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all_single(self, x: torch.Tensor, send_counts: list[int],
                          recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sent out (``send_counts[r]`` of them, in order, to the group rank
        ``r``); returns the rows received (``recv_counts[r]`` from rank ``r``), in rank order.

        Every rank's ``send_counts`` must match the others' ``recv_counts`` (exchange the
        counts first, with counts of one).
        """
        if self.size == 1:
            return x
        out = torch.empty(sum(recv_counts), *x.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return out

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """The group rank ``src``'s ``obj`` (pickled), returned on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank of the group gets here."""
        if self.size > 1:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order."""
        if self.size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to the group rank ``dst`` (which receives it with ``recv``)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             src: int) -> torch.Tensor:
        """A tensor of ``shape`` sent by the group rank ``src``."""
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[src], group=self.group)
        return out

    def send_object(self, obj: Any, dst: int, device: torch.device) -> None:
        """Send a picklable ``obj`` to the group rank ``dst`` (``recv_object`` there).

        Its size goes first, then its bytes, as tensors on ``device`` (NCCL groups
        carry device tensors only).
        """
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst)
        self.send(payload.to(device), dst)

    def recv_object(self, src: int, device: torch.device) -> Any:
        """The object the group rank ``src`` sent with ``send_object``."""
        size = int(self.recv((1,), torch.int64, device, src).item())
        payload = self.recv((size,), torch.uint8, device, src).cpu()
        return pickle.loads(payload.numpy().tobytes())


@dataclass
class ParallelContext:
    """This process's place among the scheduler ranks, and its groups.

    ``rank`` is global (over every replica). ``tp``: the ranks of this
    pipeline stage (all-reduce, all-gather of logits, the all-to-all of
    expert parallelism); ``pp``: the stages this rank's slice passes through
    (send/recv); ``control``: every rank of this replica, over gloo (what each
    step runs); ``heartbeat``: every rank of every replica, over gloo, with
    ``--nnodes`` above 1 (see ``start_heartbeat``).
    """

    config: ParallelConfig
    rank: int
    device: torch.device
    tp: GroupCoordinator
    pp: GroupCoordinator
    control: GroupCoordinator
    heartbeat: GroupCoordinator | None = None

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.tp.rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.pp.rank

    @property
    def replica_rank(self) -> int:
        """This rank's index among its replica's ranks."""
        return self.control.rank

    @property
    def is_driver(self) -> bool:
        """Whether this is its replica's rank 0, the one whose Scheduler owns the sockets."""
        return self.control.is_first


def init_parallel(config: ParallelConfig, rank: int, device: torch.device) -> ParallelContext:
    """Join global rank ``rank`` to the others at ``config.dist_init_addr``; build its groups.

    Every rank of every replica joins one world; each replica's tensor,
    pipeline and control groups hold its own ranks only. Blocks until every
    rank has joined. Every rank creates every group, in the same order, as
    ``torch.distributed.new_group`` requires.
    """
    config.check()
    if config.dist_init_addr is None:
        raise ValueError("dist_init_addr is needed to join the other ranks")
    host, port = split_host_port(config.dist_init_addr)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=f"tcp://{_format_host(host)}:{port}",
                            world_size=config.total_ranks, rank=rank, timeout=_INIT_TIMEOUT)
    tp_size, pp_size, size = config.tp_size, config.pp_size, config.world_size
    replicas = [list(range(config.global_rank(r, 0), config.global_rank(r, size)))
                for r in range(config.dp_size)]
    tp = _pick_group([ranks[stage * tp_size:(stage + 1) * tp_size] for ranks in replicas
                      for stage in range(pp_size)], rank, backend, _INIT_TIMEOUT)
    pp = _pick_group([ranks[tp_rank::tp_size] for ranks in replicas
                      for tp_rank in range(tp_size)], rank, backend, _INIT_TIMEOUT)
    control = _pick_group(replicas, rank, "gloo", _CONTROL_TIMEOUT)
    heartbeat = None
    if config.nnodes > 1:  # one node's launcher sees every rank's process itself
        everyone = list(range(config.total_ranks))
        heartbeat = GroupCoordinator(
            dist.new_group(everyone, backend="gloo", timeout=_HEARTBEAT_TIMEOUT), everyone, rank)
    replica, _ = config.place(rank)
    logger.info("rank %d of %d joined (replica %d of %d, tp rank %d of %d, pp stage %d of %d, "
                "%s)", rank, config.total_ranks, replica, config.dp_size, tp.rank, tp.size,
                pp.rank, pp.size, backend)
    return ParallelContext(config, rank, device, tp, pp, control, heartbeat)


def start_heartbeat(group: GroupCoordinator, on_lost: Callable[[str], None],
                    interval_s: float = HEARTBEAT_INTERVAL_S) -> threading.Thread:
    """Exchange a beat with every rank every ``interval_s``; call ``on_lost`` when one fails.

    The watchdog of ranks on several nodes: no launcher sees them all, and an
    idle rank 0 waits on no collective that would fail when another node's
    rank dies. A daemon thread, on a group of its own.
    """
    def beat() -> None:
        pulse = torch.zeros(1)
        while True:
            if group.is_first:
                time.sleep(interval_s)  # the others wait in the collective
            try:
                group.all_reduce(pulse)
            except RuntimeError as exc:
                on_lost(f"rank {group.ranks[group.rank]} lost contact with the other "
                        f"scheduler ranks: {exc}")
                return

    thread = threading.Thread(target=beat, name="rank-heartbeat", daemon=True)
    thread.start()
    return thread


def _pick_group(all_ranks: list[list[int]], rank: int, backend: str,
                timeout: timedelta) -> GroupCoordinator:
    mine: GroupCoordinator | None = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine = GroupCoordinator(group, ranks, rank)
    assert mine is not None  # every rank is in one group of each kind
    return mine


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def destroy_parallel() -> None:
    """Leave the process groups (a no-op when none were joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
