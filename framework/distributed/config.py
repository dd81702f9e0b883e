"""``ParallelConfig``: how many scheduler ranks serve the model, and where they meet.

Kept free of torch, so that the launcher can plan its processes before any
of them sets its thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes and where those processes meet."""

    tp_size: int = 1
    pp_size: int = 1
    # Replicas of the whole model, each of tp_size × pp_size ranks.
    dp_size: int = 1
    # 1, or tp_size: the tensor-parallel ranks split the MoE layers' experts.
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # rank 0's host:port, for the rendezvous

    @classmethod
    def from_server_args(cls, server_args: Any) -> ParallelConfig:
        """The parallel settings of ``ServerArgs``."""
        return cls(tp_size=server_args.tp_size, pp_size=server_args.pp_size,
                   dp_size=server_args.dp_size, ep_size=server_args.ep_size,
                   nnodes=server_args.nnodes, node_rank=server_args.node_rank,
                   dist_init_addr=server_args.dist_init_addr)

    @property
    def world_size(self) -> int:
        """Scheduler ranks of one replica: the ranks one copy of the model is split over."""
        return self.tp_size * self.pp_size

    @property
    def total_ranks(self) -> int:
        """Scheduler ranks of every replica, over every node."""
        return self.dp_size * self.world_size

    @property
    def is_parallel(self) -> bool:
        """Whether more than one rank serves one copy of the model."""
        return self.world_size > 1

    @property
    def uses_distributed(self) -> bool:
        """Whether the ranks join torch.distributed: a replica split over ranks, or ranks on
        several nodes (which watch each other through it and learn their channels from it)."""
        return self.is_parallel or self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        """Scheduler ranks each node runs (of every replica)."""
        return self.total_ranks // self.nnodes

    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    def global_rank(self, replica: int, rank: int) -> int:
        """The global rank of ``rank`` of ``replica``: replica after replica."""
        return replica * self.world_size + rank

    def place(self, global_rank: int) -> tuple[int, int]:
        """``(replica, rank in the replica)`` of a global rank."""
        return divmod(global_rank, self.world_size)

    def node_of(self, global_rank: int) -> int:
        """The node that runs ``global_rank``."""
        return global_rank // self.ranks_per_node

    def check(self) -> None:
        """Refuse settings that cannot work, naming the field (a ``ValueError``)."""
        for name in ("tp_size", "pp_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size must be 1 or equal tp_size ({self.tp_size}), "
                             f"got {self.ep_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.total_ranks % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide dp_size × tp_size × pp_size "
                             f"({self.total_ranks})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (rank 0's host:port) is required with nnodes > 1")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; a ``ValueError`` if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` pipeline stage ``pp_rank`` of ``pp_size`` holds.

    The layers are split as evenly as they go, the first stages taking one
    more when they do not divide; every stage holds at least one layer.
    """
    if pp_size > num_layers:
        raise ValueError(f"pp_size ({pp_size}) is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
