"""Data parallelism: ``--dp-size N`` scheduler replicas behind one TokenizerManager.

Each replica is a whole copy of the model: its own Scheduler (its own KV cache
and prefix cache) and its own Detokenizer, on channels of its own (one
``PortArgs`` per replica). No address is shared between replicas, so a
transport that allows one sending process per address (the shm ring) works
as it does with one replica.

The routing lives in the TokenizerManager's process, so a request takes no
extra hop: ``DataParallelRouter`` picks the replica of each new request with a
``LoadBalancer`` (``--load-balance-method``), remembers which replica holds
each request id so that its abort goes there, and sends everything else
(``abort_all``, RPCs such as a cache flush or a weight update) to every
replica. With one replica it routes everything to that one.

A weight update is all or nothing over the replicas
(``DataParallelRouter.update_weights``): when some replicas load the new
weights and others cannot, those that did are sent back to their previous
weights, so that every replica serves the same ones, and the answer names
each replica's outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from framework.comm.transport import Receiver, RpcClient, Sender, Transport
from framework.config import PortArgs
from framework.messages import (
    AbortReq,
    ErrorReply,
    FlushCacheReqOutput,
    LoraAdapterReqOutput,
    Message,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from framework.registry import LOAD_BALANCERS, UnknownPluginError, create_codec

_NewRequest = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
# Scheduler info fields that are totals over replicas in ``get_server_info``.
_SUMMED_INFO = ("num_running_reqs", "num_waiting_reqs", "max_total_tokens",
                "available_kv_tokens", "evictable_kv_tokens", "aborted_requests",
                "failed_requests", "retracted_requests", "extend_steps", "decode_steps",
                "step_seconds", "forward_seconds")


def replica_name(index: int) -> str:
    """How logs, errors and ``/get_server_info`` name replica ``index``."""
    return f"replica {index}"


@dataclass
class ReplicaChannels:
    """The TokenizerManager's ends of one replica's channels (bound or connected at once)."""

    index: int
    send_to_scheduler: Sender
    rpc: RpcClient
    recv_from_detokenizer: Receiver
    recv_from_scheduler: Receiver
    recv_metrics: Receiver

    @classmethod
    def open(cls, index: int, transport: Transport, port_args: PortArgs,
             codec: str) -> ReplicaChannels:
        """Bind the receivers (the replica's components connect to them) and connect the rest
        (bind them too for a replica on another node: ``PortArgs.front_binds``)."""
        binds = port_args.front_binds
        recv_from_detokenizer = transport.receiver(port_args.tokenizer_input, create_codec(codec))
        recv_from_scheduler = transport.receiver(port_args.embedding_output, create_codec(codec))
        recv_metrics = transport.receiver(port_args.metrics, create_codec(codec))
        return cls(
            index=index,
            send_to_scheduler=transport.sender(port_args.scheduler_input, create_codec(codec),
                                               bind=binds),
            rpc=transport.client(port_args.rpc, create_codec(codec), bind=binds),
            recv_from_detokenizer=recv_from_detokenizer,
            recv_from_scheduler=recv_from_scheduler,
            recv_metrics=recv_metrics,
        )

    def close(self) -> None:
        """Close every end."""
        for end in (self.recv_from_detokenizer, self.recv_from_scheduler, self.recv_metrics,
                    self.send_to_scheduler, self.rpc):
            end.close()


@dataclass
class ReplicaLoad:
    """What the front knows of one replica's load.

    ``in_flight_tokens`` counts, for every request routed there and not ended,
    its prompt plus its ``max_new_tokens``: the tokens it waits to run or runs
    with, as of now. ``metrics`` is the replica's own last report (about once
    a second).
    """

    index: int
    routed_requests: int = 0
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    metrics: SchedulerMetrics | None = None

    def as_dict(self) -> dict[str, Any]:
        """The load as ``/get_server_info`` shows it."""
        reported = None
        if self.metrics is not None:
            reported = {f: getattr(self.metrics, f) for f in self.metrics.__struct_fields__}
        return {"routed_requests": self.routed_requests,
                "in_flight_requests": self.in_flight_requests,
                "in_flight_tokens": self.in_flight_tokens, "metrics": reported}


def request_tokens(msg: _NewRequest) -> int:
    """The load a new request brings: its prompt plus the most tokens it may generate."""
    if isinstance(msg, TokenizedGenerateReqInput):
        return len(msg.input_ids) + msg.sampling_params.max_new_tokens
    return len(msg.input_ids)


class LoadBalancer:
    """Picks the replica of each new request; subclass and override ``choose``.

    A balancer is registered by name in ``framework.registry.LOAD_BALANCERS``
    (entry-point group ``framework.load_balancers``) and chosen with
    ``--load-balance-method``. The front builds it once as ``cls()`` (no
    arguments) and calls ``choose`` for each new request, in the event loop of
    the TokenizerManager: it must answer at once, from ``loads`` and its own
    state. With one replica it is never asked.
    """

    def choose(self, loads: Sequence[ReplicaLoad], msg: _NewRequest) -> int:
        """The index (into ``loads``) of the replica that gets ``msg``."""
        raise NotImplementedError


class RoundRobin(LoadBalancer):
    """Each replica in turn."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[ReplicaLoad], msg: _NewRequest) -> int:
        """The replica after the previous pick."""
        index = self._next % len(loads)
        self._next = index + 1
        return index


class ShortestQueue(LoadBalancer):
    """The replica with the fewest tokens in flight (waiting plus running).

    The count is the front's own (``ReplicaLoad.in_flight_tokens``), exact at
    the moment of the choice: the replicas' metrics come about once a second,
    and a burst of requests between two reports would otherwise all go to
    the replica that looked idle. Ties go to the replicas in turn, so an idle
    server still spreads its requests.
    """

    def __init__(self) -> None:
        self._start = 0

    def choose(self, loads: Sequence[ReplicaLoad], msg: _NewRequest) -> int:
        """The least loaded replica, the first in turn among equals."""
        count = len(loads)
        order = [(self._start + step) % count for step in range(count)]
        best = min(order, key=lambda i: loads[i].in_flight_tokens)
        self._start = (best + 1) % count
        return best


def make_load_balancer(method: str) -> LoadBalancer:
    """The balancer registered as ``method`` (``--load-balance-method``).

    Raises:
        ValueError: no balancer has that name (the message names the flag and lists the
            known ones), or its plugin cannot be imported.
    """
    try:
        balancer_class = LOAD_BALANCERS.get(method)
    except UnknownPluginError as exc:
        raise ValueError(f"--load-balance-method: {exc}") from None
    balancer: LoadBalancer = balancer_class()
    return balancer


@dataclass
class _Placement:
    replica: int
    tokens: int


@dataclass
class DataParallelRouter:
    """Sends each message bound for the Schedulers to the replica(s) it concerns.

    New requests go where ``balancer`` says, and their replica is remembered
    until ``forget`` (the request ended) or their abort; an abort of a known
    request goes to its replica only; anything else (``abort_all``, an abort
    of an unknown id, RPCs) goes to every replica.
    """

    replicas: list[ReplicaChannels]
    balancer: LoadBalancer
    loads: list[ReplicaLoad] = field(init=False)
    _placements: dict[str, _Placement] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("a router needs at least one replica")
        self.loads = [ReplicaLoad(r.index) for r in self.replicas]

    def targets(self, msg: Message) -> list[int]:
        """The replicas ``msg`` goes to (and the bookkeeping of sending it there)."""
        if isinstance(msg, (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput)):
            return [self._place(msg)]
        if isinstance(msg, AbortReq) and not msg.abort_all:
            placement = self._release(msg.rid)
            if placement is not None:
                return [placement.replica]
        return list(range(len(self.replicas)))

    def replica_of(self, rid: str) -> int | None:
        """The replica that holds ``rid``, while it is in flight."""
        placement = self._placements.get(rid)
        return None if placement is None else placement.replica

    def _place(self, msg: _NewRequest) -> int:
        # One replica needs no choice (and no balancer state).
        index = 0 if len(self.replicas) == 1 else self.balancer.choose(self.loads, msg)
        self._release(msg.rid)  # a stale entry of a reused id
        placement = _Placement(index, request_tokens(msg))
        self._placements[msg.rid] = placement
        load = self.loads[index]
        load.routed_requests += 1
        load.in_flight_requests += 1
        load.in_flight_tokens += placement.tokens
        return index

    def _release(self, rid: str) -> _Placement | None:
        placement = self._placements.pop(rid, None)
        if placement is not None:
            load = self.loads[placement.replica]
            load.in_flight_requests -= 1
            load.in_flight_tokens -= placement.tokens
        return placement

    def forget(self, rid: str) -> None:
        """``rid`` ended (or never reached a replica): it no longer counts as load."""
        self._release(rid)

    async def send(self, msg: Message) -> None:
        """Send ``msg`` to its replica(s), waiting for room in each channel."""
        for index in self.targets(msg):
            await self.replicas[index].send_to_scheduler.send(msg)

    def send_nowait(self, msg: Message) -> None:
        """Send ``msg`` to its replica(s) without waiting (callers without an event loop)."""
        for index in self.targets(msg):
            self.replicas[index].send_to_scheduler.send_nowait(msg)

    async def call_all(self, msg: Message, timeout: float) -> list[Message]:
        """``msg`` to every replica's Scheduler at once; the replies in replica order."""
        return list(await asyncio.gather(*(r.rpc.call(msg, timeout) for r in self.replicas)))

    async def call_each(self, messages: dict[int, Message], timeout: float
                        ) -> dict[int, Message]:
        """Each replica named in ``messages`` its own message, at once; replies by replica."""
        replies = await asyncio.gather(*(self.replicas[index].rpc.call(msg, timeout)
                                         for index, msg in messages.items()))
        return dict(zip(messages, replies, strict=True))

    async def update_weights(self, msg: UpdateWeightsFromDiskReqInput, timeout: float
                             ) -> Message:
        """``msg`` to every replica, all or nothing; one reply naming each replica's outcome.

        When some replicas loaded the new weights and others could not, each one
        that did is sent back to the weights it served before (its reply's
        ``previous_model_path``), so that no replica serves other weights than the
        rest. (Between the two, it ran with the new ones, as the requests in flight
        of any update do.) A replica that answers with an error has failed.

        Raises:
            RuntimeError: the one replica there is answered with an error.
        """
        replies = await self.call_all(msg, timeout)
        if len(replies) == 1:
            check_replies(replies)
            return replies[0]
        outcomes = [_weight_update_outcome(reply) for reply in replies]
        made = [i for i, r in enumerate(outcomes) if r.success]
        undo: dict[int, Message] = {}
        if len(made) < len(outcomes):
            undo = {i: UpdateWeightsFromDiskReqInput(
                model_path=outcomes[i].previous_model_path,
                load_format=outcomes[i].previous_load_format) for i in made}
        return merge_weight_updates(outcomes, await self.call_each(undo, timeout))

    def record_metrics(self, index: int, metrics: SchedulerMetrics) -> SchedulerMetrics:
        """Keep replica ``index``'s report; return the whole server's (the sum over replicas)."""
        self.loads[index].metrics = metrics
        reports = [load.metrics for load in self.loads if load.metrics is not None]
        return metrics if len(self.loads) == 1 else total_metrics(reports)

    def merged_info(self, infos: Sequence[dict[str, Any]], method: str) -> dict[str, Any]:
        """``get_server_info``'s Scheduler part for several replicas.

        Each replica's own answer (with its load) is under ``replicas``; the
        top level holds what is true of the whole server.
        """
        replicas = [{"replica": i, **info, "load": self.loads[i].as_dict()}
                    for i, info in enumerate(infos)]

        def total(key: str) -> int | float:
            return sum(value for info in infos
                       if isinstance(value := info.get(key), (int, float)))

        merged: dict[str, Any] = {
            "dp_size": len(infos),
            "load_balance_method": method,
            "kv_cache_idle_and_free": all(info.get("kv_cache_idle_and_free") for info in infos),
            "context_length": infos[0].get("context_length"),
        }
        # Counts and seconds add up over replicas (the seconds are summed, not wall time).
        merged.update({key: total(key) for key in _SUMMED_INFO})
        merged["replicas"] = replicas
        return merged


def total_metrics(reports: Sequence[SchedulerMetrics]) -> SchedulerMetrics:
    """One report for several replicas: counts and throughputs add up, usage is pooled."""
    used = sum(m.num_used_tokens for m in reports)
    capacity = sum(m.max_total_tokens for m in reports)
    return SchedulerMetrics(
        num_running_reqs=sum(m.num_running_reqs for m in reports),
        num_waiting_reqs=sum(m.num_waiting_reqs for m in reports),
        num_used_tokens=used, max_total_tokens=capacity,
        token_usage=used / max(capacity, 1),
        gen_throughput=sum(m.gen_throughput for m in reports),
        # Each report's window rate; their mean is as good a summary as one window allows.
        cache_hit_rate=sum(m.cache_hit_rate for m in reports) / max(len(reports), 1),
        timestamp=max((m.timestamp for m in reports), default=0.0),
        spec_accept_length=sum(m.spec_accept_length for m in reports) / max(len(reports), 1),
        spec_acceptance_rate=sum(m.spec_acceptance_rate for m in reports)
        / max(len(reports), 1),
    )


def merge_replies(replies: Sequence[Message]) -> Message:
    """One reply for an RPC every replica answered: success only if every one succeeded.

    The message names each replica's own answer. One reply is returned as it is.
    """
    if len(replies) == 1:
        return replies[0]
    first = replies[0]
    if isinstance(first, (FlushCacheReqOutput, LoraAdapterReqOutput)):
        success = all(getattr(r, "success", False) for r in replies)
        message = "; ".join(f"{replica_name(i)}: {getattr(r, 'message', '') or 'ok'}"
                            for i, r in enumerate(replies))
        return type(first)(success=success, message=message)
    return first


def _weight_update_outcome(reply: Message) -> UpdateWeightsFromDiskReqOutput:
    """A replica's answer to a weight update; an error it answered with is a failure."""
    if isinstance(reply, UpdateWeightsFromDiskReqOutput):
        return reply
    return UpdateWeightsFromDiskReqOutput(
        success=False, message=getattr(reply, "message", "") or type(reply).__name__)


def merge_weight_updates(replies: Sequence[UpdateWeightsFromDiskReqOutput],
                         undone: dict[int, Message]) -> UpdateWeightsFromDiskReqOutput:
    """One answer for a weight update of every replica, ``undone`` the rollbacks' replies.

    It names each replica's outcome, and, when the update failed somewhere,
    which replicas (if any) still serve the new weights: those whose rollback
    failed too.
    """
    parts = []
    stuck = []
    for index, reply in enumerate(replies):
        part = f"{replica_name(index)}: {reply.message or 'ok'}"
        if index in undone:
            back = undone[index]
            if isinstance(back, UpdateWeightsFromDiskReqOutput) and back.success:
                part += (f"; another replica failed, so it went back to the weights from "
                         f"{reply.previous_model_path}")
            else:
                part += ("; another replica failed, and going back to the previous weights "
                         f"failed too ({getattr(back, 'message', '')})")
                stuck.append(replica_name(index))
        parts.append(part)
    success = all(reply.success for reply in replies)
    if not success:
        parts.append("no replica serves the new weights" if not stuck else
                     f"the new weights are still served by {', '.join(stuck)}")
    return UpdateWeightsFromDiskReqOutput(
        success=success, message="; ".join(parts),
        num_paused_requests=sum(reply.num_paused_requests for reply in replies),
        previous_model_path=replies[0].previous_model_path,
        previous_load_format=replies[0].previous_load_format)


def check_replies(replies: Sequence[Message]) -> None:
    """Raise ``RuntimeError`` with the message of a replica that answered with an error."""
    for index, reply in enumerate(replies):
        if isinstance(reply, ErrorReply):
            if len(replies) == 1:
                raise RuntimeError(reply.message)
            raise RuntimeError(f"{replica_name(index)}: {reply.message}")


def replica_port_args(port_args: PortArgs | Sequence[PortArgs]) -> list[PortArgs]:
    """The channels of each replica: one ``PortArgs``, or one per replica."""
    return [port_args] if isinstance(port_args, PortArgs) else list(port_args)
