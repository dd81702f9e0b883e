"""The TokenizerManager's receive loops: one task per channel into it, from each replica.

A replica's Detokenizer sends text outputs, its Scheduler embeddings and its
metrics, each on a channel of its own; each channel gets a task that hands
every message to its handler. A malformed message is logged and dropped: the
loop serves every request, so no one message may end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from framework.comm.transport import Receiver, TransportError
from framework.messages import Message
from framework.runtime.data_parallel import ReplicaChannels

logger = logging.getLogger("framework.tokenizer_manager")


def start_receive_loops(
    replicas: list[ReplicaChannels],
    handle_output: Callable[[Message], None],
    handle_replica_metrics: Callable[[int, Message], None],
) -> list[asyncio.Task[None]]:
    """Start, on the running event loop, a task per channel in from each of ``replicas``:
    outputs go to ``handle_output``, metrics to ``handle_replica_metrics`` with the
    replica's index."""
    handlers: list[tuple[Receiver, Callable[[Message], None]]] = []
    for replica in replicas:
        handlers += [
            (replica.recv_from_detokenizer, handle_output),
            (replica.recv_from_scheduler, handle_output),
            (replica.recv_metrics, functools.partial(handle_replica_metrics, replica.index)),
        ]
    return [asyncio.create_task(receive_loop(r, h)) for r, h in handlers]


async def receive_loop(receiver: Receiver, handle: Callable[[Message], None]) -> None:
    """Hand each message of ``receiver`` to ``handle`` until the channel closes."""
    while True:
        try:
            msg = await receiver.recv_valid()
        except TransportError:
            return  # closed during shutdown
        try:
            handle(msg)
        except Exception:  # a malformed message must not end the loop that serves all
            logger.exception("tokenizer manager dropped a malformed %s", type(msg).__name__)


async def stop_receive_loops(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the loops' ``tasks`` and wait for each to end."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
