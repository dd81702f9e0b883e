"""In-process transport: threads and asyncio tasks of one process, no copies beyond the codec's.

Channels live in a hub owned by the transport instance, so ends made by the
same ``InprocTransport`` object meet by address and nothing is global.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Any

from framework.comm.codec import Buffer
from framework.comm.transport import (
    Frames,
    PipeReceiver,
    PipeRpcTransport,
    PipeSender,
    TransportError,
)


class InprocChannel:
    """A thread-safe FIFO of frame lists that wakes both threads and event loops."""

    def __init__(self) -> None:
        self._items: deque[list[Buffer]] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.closed = False
        self.bound = False

    def put(self, frames: list[Buffer]) -> None:
        with self._lock:
            if self.closed:
                raise TransportError("send on a closed inproc channel")
            self._items.append(frames)
            waiters, self._waiters = self._waiters, []
            self._ready.notify()
        _wake_all(waiters)

    def get_nowait(self) -> list[Buffer] | None:
        # deque.popleft is atomic; no lock on the hot path.
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def wait(self, timeout: float | None = None) -> bool:
        with self._ready:
            return bool(self._ready.wait_for(lambda: self._items or self.closed, timeout))

    async def get(self) -> list[Buffer]:
        loop = asyncio.get_running_loop()
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if self.closed:
                    raise TransportError("receive on a closed inproc channel")
                if self._items:
                    continue
                self._waiters.append((loop, fut))
            try:
                await fut
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, fut))

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._items.clear()
            waiters, self._waiters = self._waiters, []
            self._ready.notify_all()
        _wake_all(waiters)


def _wake_all(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
    for loop, fut in waiters:
        # A waiter whose loop has ended (its thread stopped) has nobody to wake.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_wake, fut)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class InprocPipeSender(PipeSender):
    """Puts frame lists on a hub channel."""

    def __init__(self, channel: InprocChannel) -> None:
        self._channel = channel

    def send_frames_nowait(self, frames: Frames) -> None:
        self._channel.put(list(frames))

    def close(self) -> None:
        """Senders own nothing; the receiver closes the channel."""


class InprocPipeReceiver(PipeReceiver):
    """Takes frame lists from a hub channel; closing removes the channel from the hub."""

    def __init__(self, hub: InprocHub, address: str) -> None:
        self._hub = hub
        self._address = address
        self._channel = hub.bind(address)

    def recv_frames_nowait(self) -> list[Buffer] | None:
        return self._channel.get_nowait()

    async def recv_frames(self) -> list[Buffer]:
        return await self._channel.get()

    def wait(self, timeout: float) -> bool:
        return self._channel.wait(timeout)

    def close(self) -> None:
        self._hub.unbind(self._address)


class InprocHub:
    """The channels of one ``InprocTransport``, by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, InprocChannel] = {}

    def channel(self, address: str) -> InprocChannel:
        """The channel at ``address``, made if no end has asked for it yet."""
        with self._lock:
            return self._channels.setdefault(address, InprocChannel())

    def bind(self, address: str) -> InprocChannel:
        with self._lock:
            existing = self._channels.get(address)
            if existing is not None and existing.bound:
                raise TransportError(f"{address} is already bound")
            channel = existing or InprocChannel()
            channel.bound = True
            self._channels[address] = channel
            return channel

    def unbind(self, address: str) -> None:
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def addresses(self) -> list[str]:
        """Addresses with a channel (for leak checks)."""
        with self._lock:
            return list(self._channels)


class InprocTransport(PipeRpcTransport):
    """Channels between threads and tasks of one process, kept in this instance's hub."""

    name = "inproc"
    schemes = ("inproc",)

    def __init__(self, *, allow_insecure_pickle: bool = False) -> None:
        super().__init__(allow_insecure_pickle=allow_insecure_pickle)
        self.hub = InprocHub()

    def pipe_sender(self, address: str) -> InprocPipeSender:
        return InprocPipeSender(self.hub.channel(address))

    def pipe_receiver(self, address: str) -> InprocPipeReceiver:
        return InprocPipeReceiver(self.hub, address)

    def make_address(self, workdir: str, name: str, tcp_host: str | None = None) -> str:
        if tcp_host is not None:
            raise TransportError("the inproc transport cannot use tcp")
        return f"inproc://{workdir}/{name}"

    def __getstate__(self) -> dict[str, Any]:
        raise TransportError("the inproc transport cannot cross a process boundary")
