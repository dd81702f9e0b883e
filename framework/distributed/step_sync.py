"""Keep every scheduler rank on the same steps: the driver announces, the others follow.

Only global rank 0 runs a Scheduler: it receives the requests, chooses each
batch and samples. Before each model step it broadcasts what the step is
(``announce_forward``), over the control group, so that every other rank runs
that very batch on its share of the model: the ``ForwardBatch`` (moved to
the CPU) and the rows of ``req_to_token`` the batch reads, which the
followers copy into their own request pool before running it. Weight updates
are announced the same way, and are all or nothing: every rank checks the
new checkpoint, then loads its share, and after each phase the ranks share
their outcomes (``gather_failures``), so that if any rank fails, every rank
keeps (or goes back to) its previous weights, and every rank's answer says
which ranks failed and why. A ``Follower`` is the loop of a rank other than 0.

A model step that fails on any rank ends that rank (``RankStepFailed``): the
others are inside the step's collectives, or will wait on them, and can
neither finish the step nor start the next one without it. The launcher sees
the rank end and brings the whole server down, naming it, at once rather than
when a collective times out.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import torch

from framework.distributed.parallel_state import GroupCoordinator
from framework.forward_batch import ForwardBatch

logger = logging.getLogger("framework.distributed")


class FollowedRunner(Protocol):
    """What a follower drives: the ``ModelRunner`` of its rank."""

    device: torch.device

    def forward(self, batch: ForwardBatch, sampling: Any = None) -> Any:
        """Run one step (a follower's runner announces nothing)."""

    def update_weights_from_disk(self, model_path: str, load_format: str) -> tuple[bool, str]:
        """Load new weights."""


class RankStepFailed(SystemExit):
    """A model step failed on one rank of several: the rank ends, and the server with it.

    A ``SystemExit``, so that it passes the Scheduler's per-request containment
    (retrying the batch request by request would wait forever on the other ranks).
    """

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"scheduler rank {rank}: a model step failed ({error!r}); the other "
                         "ranks cannot finish it without this one, so the server stops")


@dataclasses.dataclass
class ForwardStep:
    """One model step: the batch, the ``req_to_token`` rows it reads and how to sample it."""

    batch: ForwardBatch
    rows: torch.Tensor  # [B, max seq_len] int64, rows batch.req_pool_indices of req_to_token
    sampling: Any = None  # a SamplingRequest: the last pipeline stage samples the step


@dataclasses.dataclass
class WeightUpdate:
    """Load new weights from ``model_path``."""

    model_path: str
    load_format: str


def gather_failures(control: GroupCoordinator | None, error: str | None) -> dict[int, str]:
    """Every rank's error in one phase of a weight update, by global rank (empty: none).

    Each rank passes its own outcome (None: it succeeded). With several ranks
    this is a collective over the control group, so that every rank learns
    every outcome and all take the same next step; without a group (one
    rank) it is this rank's alone.
    """
    outcomes = [error] if control is None else control.all_gather_object(error)
    return {rank: failure for rank, failure in enumerate(outcomes) if failure is not None}


def describe_failures(failures: dict[int, str], world_size: int) -> str:
    """``failures`` in one line: the error alone on one rank; else naming the ranks."""
    messages = set(failures.values())
    if world_size == 1:
        return next(iter(messages))
    if len(failures) == world_size and len(messages) == 1:
        return f"on every rank: {next(iter(messages))}"
    return "; ".join(f"rank {rank}: {failure}" for rank, failure in sorted(failures.items()))


def batch_to(batch: ForwardBatch, device: torch.device, *, compact: bool = False
             ) -> ForwardBatch:
    """A copy of ``batch`` with every tensor on ``device``; with ``compact``, each tensor
    that is a view of a larger one (the scheduler packs a step's index tensors into one)
    copied out on its own, since a pickled view carries its whole storage."""
    changes = {f.name: _compacted(value.to(device)) if compact else value.to(device)
               for f in dataclasses.fields(batch)
               if isinstance(value := getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **changes)


def _compacted(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it when its storage holds more than its elements."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def announce_forward(control: GroupCoordinator, batch: ForwardBatch,
                     req_to_token: torch.Tensor, sampling: Any = None) -> None:
    """Tell the other ranks to run ``batch`` (and sample it as ``sampling`` says)."""
    longest = int(batch.seq_lens.max()) if batch.batch_size else 0
    rows = req_to_token[batch.req_pool_indices, :longest]
    _announce(control, ForwardStep(batch_to(batch, torch.device("cpu"), compact=True), rows.cpu(),
                                   sampling))


def announce_weight_update(control: GroupCoordinator, model_path: str, load_format: str) -> None:
    """Tell the other ranks to load new weights (driver side)."""
    _announce(control, WeightUpdate(model_path, load_format))


def _announce(control: GroupCoordinator, command: ForwardStep | WeightUpdate) -> None:
    try:
        control.broadcast_object(command)
    except RuntimeError as exc:
        # Another rank is gone (on another node, the launcher here cannot see it): no step
        # can run any more. SystemExit passes the Scheduler's per-request containment, so
        # that this rank ends and the server goes down with the reason.
        raise SystemExit(f"rank 0 lost contact with the other scheduler ranks: {exc}") from exc


class Follower:
    """The loop of a rank other than 0: run whatever the driver announces, forever.

    It ends when the process is terminated, with ``SystemExit`` when the
    driver's connection breaks (the driver died), and with ``RankStepFailed``
    (from the runner) when a step fails here.
    """

    def __init__(self, control: GroupCoordinator, runner: FollowedRunner,
                 req_to_token: torch.Tensor) -> None:
        self.control = control
        self.runner = runner
        self.req_to_token = req_to_token  # the runner's request pool, filled as the driver's

    def run(self) -> None:
        """Follow the driver's steps until the process ends."""
        while True:
            try:
                command = self.control.broadcast_object()
            except RuntimeError as exc:
                rank = self.control.rank
                raise SystemExit(f"rank {rank} lost contact with rank 0: {exc}") from exc
            self.follow_one(command)

    def follow_one(self, command: Any) -> None:
        """Carry out one announced command."""
        if isinstance(command, ForwardStep):
            batch = batch_to(command.batch, self.runner.device)
            rows = command.rows.to(self.runner.device)
            self.req_to_token[batch.req_pool_indices, :rows.shape[1]] = rows
            self.runner.forward(batch, command.sampling)
        elif isinstance(command, WeightUpdate):
            # The runner shares its outcome with the other ranks; rank 0 answers for all.
            ok, message = self.runner.update_weights_from_disk(command.model_path,
                                                               command.load_format)
            if not ok:
                logger.warning("rank %d: %s", self.control.rank, message)
        else:
            raise RuntimeError(f"unknown command from rank 0: {type(command).__name__}")
