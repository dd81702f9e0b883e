"""The reference transport: ZMQ PUSH/PULL pipes and DEALER/ROUTER RPC over ipc:// or tcp://."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import zmq
import zmq.asyncio

from framework.comm.codec import Buffer
from framework.comm.transport import (
    Frames,
    PipeReceiver,
    PipeSender,
    RawRpcClient,
    RawRpcServer,
    Transport,
    TransportError,
)

# Frames at least this large are received as zero-copy zmq.Frame buffers; smaller ones are
# copied into bytes, which is cheaper than a Frame object.
_ZERO_COPY_MIN = 64 * 1024


def _ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class _ZmqEnd:
    """A sync zmq socket with a lazily made asyncio shadow of the same socket."""

    def __init__(self, context: zmq.Context, kind: int, address: str, bind: bool) -> None:
        self.address = address
        self._bound_path = _ipc_path(address) if bind else None
        self.sock = context.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Unbounded queues, as a blocked scheduler step is worse than memory growth.
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        try:
            if bind:
                self.sock.bind(address)
            else:
                self.sock.connect(address)
        except zmq.ZMQError as exc:
            self.sock.close()
            action = "bind" if bind else "connect"
            raise TransportError(f"zmq cannot {action} {address}: {exc}") from None
        self._async: zmq.asyncio.Socket | None = None

    @property
    def async_sock(self) -> zmq.asyncio.Socket:
        if self._async is None:
            self._async = zmq.asyncio.Socket.from_socket(self.sock)
        return self._async

    def recv_nowait(self) -> list[Buffer] | None:
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return _buffers(parts)

    async def recv(self) -> list[Buffer]:
        return _buffers(await self.async_sock.recv_multipart(copy=False))

    def close(self) -> None:
        if self._async is not None:
            # The shadow shares the socket; closing it with linger 0 closes both.
            self._async.close(linger=0)
            self._async = None
        if not self.sock.closed:
            self.sock.close(linger=0)
        if self._bound_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bound_path)


def _buffers(parts: list[zmq.Frame]) -> list[Buffer]:
    return [p.buffer if len(p) >= _ZERO_COPY_MIN else p.bytes for p in parts]


class ZmqPipeSender(PipeSender):
    """PUSH socket; zero-copy multipart send of large frames."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._end = _ZmqEnd(context, zmq.PUSH, address, bind=False)

    def send_frames_nowait(self, frames: Frames) -> None:
        self._end.sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._end.close()


class ZmqPipeReceiver(PipeReceiver):
    """PULL socket bound at the address; removes its ipc socket file on close."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._end = _ZmqEnd(context, zmq.PULL, address, bind=True)

    def recv_frames_nowait(self) -> list[Buffer] | None:
        return self._end.recv_nowait()

    async def recv_frames(self) -> list[Buffer]:
        return await self._end.recv()

    def wait(self, timeout: float) -> bool:
        return bool(self._end.sock.poll(int(timeout * 1000)))

    def close(self) -> None:
        self._end.close()


class ZmqRpcClient(RawRpcClient):
    """DEALER socket: requests carry an empty delimiter frame, as REQ would send."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._end = _ZmqEnd(context, zmq.DEALER, address, bind=False)
        self._lock = asyncio.Lock()

    async def call_frames(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        async with self._lock:  # one call in flight: replies come back in order
            await self._end.async_sock.send_multipart([b"", *frames], copy=False)
            reply = await asyncio.wait_for(self._end.recv(), timeout)
        return reply[1:]

    def call_frames_blocking(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        sock = self._end.sock
        sock.send_multipart([b"", *frames], copy=False)
        if not sock.poll(None if timeout is None else int(timeout * 1000)):
            raise TimeoutError(f"no reply from {self._end.address} within {timeout} s")
        return _buffers(sock.recv_multipart(copy=False))[1:]

    def close(self) -> None:
        self._end.close()


class ZmqRpcServer(RawRpcServer[bytes]):
    """ROUTER socket; the reply token is the caller's routing identity."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._end = _ZmqEnd(context, zmq.ROUTER, address, bind=True)

    def recv_request_nowait(self) -> tuple[bytes, list[Buffer]] | None:
        parts = self._end.recv_nowait()
        return None if parts is None else (bytes(parts[0]), parts[2:])

    async def recv_request(self) -> tuple[bytes, list[Buffer]]:
        parts = await self._end.recv()
        return bytes(parts[0]), parts[2:]

    def reply_frames(self, token: bytes, frames: Frames) -> None:
        self._end.sock.send_multipart([token, b"", *frames], copy=False)

    def close(self) -> None:
        self._end.close()


class ZmqTransport(Transport):
    """ZMQ over ``ipc://`` (socket files) or ``tcp://``; one zmq context per transport."""

    name = "zmq"
    schemes = ("ipc", "tcp")

    def __init__(self, *, allow_insecure_pickle: bool = False, io_threads: int = 1) -> None:
        super().__init__(allow_insecure_pickle=allow_insecure_pickle)
        self._context: zmq.Context | None = None
        self._io_threads = io_threads

    @property
    def context(self) -> zmq.Context:
        # Made on first use, in the process that uses it (contexts do not survive fork).
        if self._context is None:
            self._context = zmq.Context(self._io_threads)
        return self._context

    def pipe_sender(self, address: str) -> ZmqPipeSender:
        return ZmqPipeSender(self.context, address)

    def pipe_receiver(self, address: str) -> ZmqPipeReceiver:
        return ZmqPipeReceiver(self.context, address)

    def rpc_client(self, address: str) -> ZmqRpcClient:
        return ZmqRpcClient(self.context, address)

    def rpc_server(self, address: str) -> ZmqRpcServer:
        return ZmqRpcServer(self.context, address)

    def make_address(self, workdir: str, name: str, tcp_host: str | None = None) -> str:
        if tcp_host is not None:
            return f"tcp://{_format_host(tcp_host)}:{free_tcp_port(tcp_host)}"
        return f"ipc://{os.path.join(workdir, name)}"

    def __getstate__(self) -> dict[str, Any]:
        # A transport travels to spawned children by pickle; the context stays behind.
        return {**self.__dict__, "_context": None}


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
