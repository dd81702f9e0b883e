"""Transports: the channel ends every component talks through.

A transport makes four kinds of raw end for an address, each moving lists of
frames (buffers): a pipe sender and receiver (PUSH/PULL: many messages one
way) and an RPC client and server (request/reply). ``Sender``, ``Receiver``,
``RpcClient`` and ``RpcServer`` put a codec on top of a raw end, so every
transport carries every codec, and a benchmark can also drive the raw ends.

Every end has an async face for the asyncio side (``await send``/``recv``)
and a non-blocking one for the scheduler's poll loop (``send_nowait``,
``recv_nowait`` returning ``None`` when nothing is waiting). Receivers and RPC
servers bind their address; senders and RPC clients connect to it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

from framework.comm.codec import Buffer, Codec, CodecError
from framework.messages import Message

Frames = Sequence[Buffer]
Token = TypeVar("Token")


class TransportError(Exception):
    """A channel could not be made or used (bad address, closed end, peer gone)."""


class InsecureChannelError(TransportError, ValueError):
    """A codec that can run code on decode (pickle) was asked to cross a network."""


# --------------------------------------------------------------------------- raw ends


class PipeSender(ABC):
    """The sending end of a one-way pipe of frame lists."""

    @abstractmethod
    def send_frames_nowait(self, frames: Frames) -> None:
        """Queue frames for the receiver without waiting for it to take them."""

    async def send_frames(self, frames: Frames) -> None:
        """Async face of ``send_frames_nowait``; ends whose queue can fill override it."""
        self.send_frames_nowait(frames)

    @abstractmethod
    def close(self) -> None:
        """Release the end; it cannot be used afterwards."""


class PipeReceiver(ABC):
    """The receiving end of a one-way pipe of frame lists; it binds the address."""

    @abstractmethod
    def recv_frames_nowait(self) -> list[Buffer] | None:
        """The next frame list, or ``None`` when nothing is waiting."""

    @abstractmethod
    async def recv_frames(self) -> list[Buffer]:
        """Wait for the next frame list."""

    def wait(self, timeout: float) -> bool:
        """Block the calling thread until frames may be waiting or ``timeout`` s pass.

        An idle poll loop sleeps here instead of spinning. May return early
        (the caller polls again), so it returns whether something is likely
        waiting. Ends with a native wake-up (a socket poll, a condition)
        override this fallback, which just sleeps a little.
        """
        time.sleep(min(timeout, 0.001))
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the end and whatever it created (socket files, shared memory)."""


class RawRpcClient(ABC):
    """Sends a request frame list and waits for the matching reply."""

    @abstractmethod
    async def call_frames(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        """Send a request and wait for its reply."""

    @abstractmethod
    def call_frames_blocking(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        """Send a request and block the calling thread until its reply."""

    @abstractmethod
    def close(self) -> None:
        """Release the end."""


class RawRpcServer(ABC, Generic[Token]):
    """Receives requests, each with a token that routes its reply back."""

    @abstractmethod
    def recv_request_nowait(self) -> tuple[Token, list[Buffer]] | None:
        """The next request and its reply token, or ``None``."""

    @abstractmethod
    async def recv_request(self) -> tuple[Token, list[Buffer]]:
        """Wait for the next request."""

    @abstractmethod
    def reply_frames(self, token: Token, frames: Frames) -> None:
        """Send the reply to the request that came with ``token``."""

    @abstractmethod
    def close(self) -> None:
        """Release the end and whatever it created."""


# --------------------------------------------------------------------------- typed ends


class Sender:
    """Sends messages: a codec on a raw pipe sender."""

    def __init__(self, raw: PipeSender, codec: Codec) -> None:
        self.raw = raw
        self.codec = codec

    def send_nowait(self, msg: Message) -> None:
        """Encode and queue ``msg`` without waiting for the receiver."""
        self.raw.send_frames_nowait(self.codec.encode(msg))

    async def send(self, msg: Message) -> None:
        """Encode and send ``msg``."""
        await self.raw.send_frames(self.codec.encode(msg))

    def close(self) -> None:
        """Release the end."""
        self.raw.close()


class Receiver:
    """Receives messages: a codec on a raw pipe receiver.

    A frame list that does not decode raises ``CodecError``; it has been
    consumed, and the next call receives the next message.
    """

    def __init__(self, raw: PipeReceiver, codec: Codec) -> None:
        self.raw = raw
        self.codec = codec

    def recv_nowait(self) -> Message | None:
        """The next message, or ``None`` when nothing is waiting."""
        frames = self.raw.recv_frames_nowait()
        return None if frames is None else self.codec.decode(frames)

    async def recv(self) -> Message:
        """Wait for the next message."""
        return self.codec.decode(await self.raw.recv_frames())

    async def recv_valid(self) -> Message:
        """Wait for the next message that decodes; garbled frames are logged and skipped.

        The async counterpart of ``drain()``, for a component's receive loop.
        """
        while True:
            try:
                return await self.recv()
            except CodecError as exc:
                _log_dropped(exc)

    def wait(self, timeout: float) -> bool:
        """Block until a message may be waiting or ``timeout`` s pass (see ``PipeReceiver``)."""
        return self.raw.wait(timeout)

    def drain(self, limit: int = 1 << 30) -> list[Message]:
        """Every message waiting now (up to ``limit``), skipping garbled ones.

        This is what a poll loop calls once per step; a garbled frame is
        dropped with a log line instead of stopping the loop.
        """
        out: list[Message] = []
        while len(out) < limit:
            try:
                msg = self.recv_nowait()
            except CodecError as exc:
                _log_dropped(exc)
                continue
            if msg is None:
                break
            out.append(msg)
        return out

    def close(self) -> None:
        """Release the end and whatever it created."""
        self.raw.close()


class RpcClient:
    """Calls an RPC server with messages."""

    def __init__(self, raw: RawRpcClient, codec: Codec) -> None:
        self.raw = raw
        self.codec = codec

    async def call(self, msg: Message, timeout: float | None = None) -> Message:
        """Send ``msg`` and wait for the reply."""
        return self.codec.decode(await self.raw.call_frames(self.codec.encode(msg), timeout))

    def call_blocking(self, msg: Message, timeout: float | None = None) -> Message:
        """Send ``msg`` and block until the reply (for synchronous callers)."""
        frames = self.raw.call_frames_blocking(self.codec.encode(msg), timeout)
        return self.codec.decode(frames)

    def close(self) -> None:
        """Release the end."""
        self.raw.close()


class RpcServer:
    """Answers RPC calls with messages."""

    def __init__(self, raw: RawRpcServer[Any], codec: Codec) -> None:
        self.raw = raw
        self.codec = codec

    def recv_nowait(self) -> tuple[Any, Message] | None:
        """The next ``(token, request)``, or ``None``; a garbled request is dropped."""
        while True:
            got = self.raw.recv_request_nowait()
            if got is None:
                return None
            try:
                return got[0], self.codec.decode(got[1])
            except CodecError as exc:
                _log_dropped(exc)

    async def recv(self) -> tuple[Any, Message]:
        """Wait for the next ``(token, request)``."""
        while True:
            token, frames = await self.raw.recv_request()
            try:
                return token, self.codec.decode(frames)
            except CodecError as exc:
                _log_dropped(exc)

    def reply(self, token: Any, msg: Message) -> None:
        """Answer the request that came with ``token``."""
        self.raw.reply_frames(token, self.codec.encode(msg))

    def close(self) -> None:
        """Release the end and whatever it created."""
        self.raw.close()


def _log_dropped(exc: CodecError) -> None:
    import logging

    logging.getLogger("framework.comm").warning("dropped a frame that did not decode: %s", exc)


# --------------------------------------------------------------------------- transports


class Transport(ABC):
    """Makes channel ends for addresses of the schemes it knows.

    ``allow_insecure_pickle`` lets a ``local_only`` codec (pickle) run over a
    network address; without it such a channel is refused.
    """

    name: ClassVar[str]
    schemes: ClassVar[tuple[str, ...]]

    def __init__(self, *, allow_insecure_pickle: bool = False) -> None:
        self.allow_insecure_pickle = allow_insecure_pickle

    # Raw ends: what a transport implements.
    @abstractmethod
    def pipe_sender(self, address: str) -> PipeSender:
        """Connect a raw sender to ``address``."""

    @abstractmethod
    def pipe_receiver(self, address: str) -> PipeReceiver:
        """Bind a raw receiver at ``address``."""

    @abstractmethod
    def rpc_client(self, address: str) -> RawRpcClient:
        """Connect a raw RPC client to ``address``."""

    @abstractmethod
    def rpc_server(self, address: str) -> RawRpcServer[Any]:
        """Bind a raw RPC server at ``address``."""

    @abstractmethod
    def make_address(self, workdir: str, name: str, tcp_host: str | None = None) -> str:
        """An address for the channel ``name``: under ``workdir``, or on ``tcp_host``."""

    # Reversed raw ends (optional): the same ends with the other side bound, for a channel
    # whose usual binder is on a machine the other side cannot name (a replica's ranks on
    # another node connect to the front's machine).
    def bound_pipe_sender(self, address: str) -> PipeSender:
        """Bind a raw sender at ``address``."""
        raise TransportError(f"the {self.name} transport cannot bind a sender")

    def connected_pipe_receiver(self, address: str) -> PipeReceiver:
        """Connect a raw receiver to ``address``."""
        raise TransportError(f"the {self.name} transport cannot connect a receiver")

    def bound_rpc_client(self, address: str) -> RawRpcClient:
        """Bind a raw RPC client at ``address``."""
        raise TransportError(f"the {self.name} transport cannot bind an RPC client")

    def connected_rpc_server(self, address: str) -> RawRpcServer[Any]:
        """Connect a raw RPC server to ``address``."""
        raise TransportError(f"the {self.name} transport cannot connect an RPC server")

    # Typed ends: a codec on a raw end.
    def sender(self, address: str, codec: Codec, *, bind: bool = False) -> Sender:
        """A message sender connected to ``address`` (bound there with ``bind``)."""
        self.check_codec(address, codec)
        return Sender(self.bound_pipe_sender(address) if bind else self.pipe_sender(address),
                      codec)

    def receiver(self, address: str, codec: Codec, *, bind: bool = True) -> Receiver:
        """A message receiver bound at ``address`` (connected to it without ``bind``)."""
        self.check_codec(address, codec)
        raw = self.pipe_receiver(address) if bind else self.connected_pipe_receiver(address)
        return Receiver(raw, codec)

    def client(self, address: str, codec: Codec, *, bind: bool = False) -> RpcClient:
        """A message RPC client connected to ``address`` (bound there with ``bind``)."""
        self.check_codec(address, codec)
        return RpcClient(self.bound_rpc_client(address) if bind else self.rpc_client(address),
                         codec)

    def server(self, address: str, codec: Codec, *, bind: bool = True) -> RpcServer:
        """A message RPC server bound at ``address`` (connected to it without ``bind``)."""
        self.check_codec(address, codec)
        raw = self.rpc_server(address) if bind else self.connected_rpc_server(address)
        return RpcServer(raw, codec)

    def check_codec(self, address: str, codec: Codec) -> None:
        """Refuse a local-only codec on a network address unless explicitly allowed."""
        scheme = address.split("://", 1)[0]
        if scheme not in self.schemes:
            raise TransportError(
                f"the {self.name} transport does not serve {scheme}:// addresses "
                f"(it serves {', '.join(s + '://' for s in self.schemes)})"
            )
        if scheme == "tcp" and codec.local_only and not self.allow_insecure_pickle:
            raise InsecureChannelError(
                f"refusing the {codec.name} codec on {address}: decoding it can run "
                "arbitrary code, so it is for channels local to this machine. Use another "
                "codec (msgpack) or pass --allow-insecure-pickle if every peer is trusted."
            )


# --------------------------------------------------------------------------- RPC over pipes


class PipeRpcTransport(Transport):
    """A transport without a native request/reply socket: RPC over two of its own pipes.

    The server binds the request pipe at ``address.req``, the client the reply pipe at
    ``address.rep``.
    """

    def rpc_client(self, address: str) -> PipeRpcClient:
        return PipeRpcClient(self.pipe_sender(f"{address}.req"),
                             self.pipe_receiver(f"{address}.rep"))

    def rpc_server(self, address: str) -> PipeRpcServer:
        return PipeRpcServer(self.pipe_receiver(f"{address}.req"),
                             self.pipe_sender(f"{address}.rep"))


class PipeRpcClient(RawRpcClient):
    """RPC built from two pipes, for transports without a native request/reply socket.

    Frame 0 of each request and reply is an 8-byte call id; the client's reply
    pipe address travels in the request so the server knows where to answer.
    One client per server.
    """

    def __init__(self, requests: PipeSender, replies: PipeReceiver) -> None:
        self._requests = requests
        self._replies = replies
        self._ids = itertools.count(1)

    async def call_frames(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        call_id = next(self._ids)
        await self._requests.send_frames([call_id.to_bytes(8, "little"), *frames])
        while True:
            reply = await asyncio.wait_for(self._replies.recv_frames(), timeout)
            if int.from_bytes(reply[0], "little") == call_id:
                return reply[1:]

    def call_frames_blocking(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        return _run_blocking(self.call_frames(frames, timeout))

    def close(self) -> None:
        self._requests.close()
        self._replies.close()


class PipeRpcServer(RawRpcServer[bytes]):
    """The server side of ``PipeRpcClient``: the reply token is the call id."""

    def __init__(self, requests: PipeReceiver, replies: PipeSender) -> None:
        self._requests = requests
        self._replies = replies

    def recv_request_nowait(self) -> tuple[bytes, list[Buffer]] | None:
        frames = self._requests.recv_frames_nowait()
        return None if frames is None else (bytes(frames[0]), frames[1:])

    async def recv_request(self) -> tuple[bytes, list[Buffer]]:
        frames = await self._requests.recv_frames()
        return bytes(frames[0]), frames[1:]

    def reply_frames(self, token: bytes, frames: Frames) -> None:
        self._replies.send_frames_nowait([token, *frames])

    def close(self) -> None:
        self._requests.close()
        self._replies.close()


def _run_blocking(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code (no loop running here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise TransportError("call_blocking cannot be used inside a running event loop; await call()")
