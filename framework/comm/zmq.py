"""The reference transport: ZMQ PUSH/PULL pipes and DEALER/ROUTER RPC over ipc:// or tcp://.

``ipc://`` channels rely on their private 0700 socket directory. ``tcp://``
channels are authenticated with ZMQ CURVE: every binder (a PULL receiver, the
ROUTER RPC server) is a CURVE server that admits only the client public key
of its own transport, checked by a ZAP authenticator thread; every connector
(a PUSH sender, the DEALER RPC client) must present that key and know the
server's. The keys are made when the transport is made, in the parent
process, and travel to each child inside the pickled transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

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

logger = logging.getLogger(__name__)

# Frames at least this large are received as zero-copy zmq.Frame buffers; smaller ones are
# copied into bytes, which is cheaper than a Frame object.
_ZERO_COPY_MIN = 64 * 1024
# The ZAP domain of our CURVE servers; the authenticator answers for this domain only.
_ZAP_DOMAIN = "framework"
_CALL_ID_BYTES = 8

RpcToken = tuple[bytes, bytes]  # the caller's routing identity and its call id


class CurveError(TransportError, ValueError):
    """``tcp://`` channels cannot be authenticated (no CURVE in libzmq, unreadable keys).

    A ``ValueError`` too, so that the command line shows it as one line.
    """


def curve_available() -> bool:
    """Whether the libzmq in use can do CURVE (it needs libsodium or its own tweetnacl)."""
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class CurveKeys:
    """The Z85 CURVE keypairs of one server's tcp channels: one for binders, one for connectors."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        """Two fresh keypairs; they live in memory only."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    @classmethod
    def from_dir(cls, key_dir: str | os.PathLike[str]) -> CurveKeys:
        """Read ``server.key_secret`` and ``client.key_secret`` from ``key_dir``.

        These are the files ``zmq.auth.create_certificates(key_dir, name)`` writes,
        so that several nodes can share keys made once.
        """
        pairs = []
        for name in ("server", "client"):
            path = Path(key_dir) / f"{name}.key_secret"
            try:
                public, secret = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                raise CurveError(f"cannot read the CURVE key {path}: {exc}") from None
            if secret is None:
                raise CurveError(f"{path} holds no secret key")
            pairs += [public, secret]
        return cls(*pairs)


class _AllowedClientKeys:
    """The authenticator's credentials provider: admits the transport's client key only."""

    def __init__(self, *keys: bytes) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            logger.debug("refused a tcp peer with an unknown CURVE key (domain %s)", domain)
        return allowed


def _ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class _ZmqEnd:
    """A configured, bound or connected sync zmq socket with a lazily made asyncio shadow."""

    def __init__(self, sock: zmq.Socket, address: str, bind: bool) -> None:
        self.address = address
        self.sock = sock
        self._bound_path = _ipc_path(address) if bind else None
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

    def __init__(self, end: _ZmqEnd) -> None:
        self._end = end

    def send_frames_nowait(self, frames: Frames) -> None:
        self._end.sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._end.close()


class ZmqPipeReceiver(PipeReceiver):
    """PULL socket, bound at the address (or connected); a bound one removes its ipc socket
    file on close."""

    def __init__(self, end: _ZmqEnd) -> None:
        self._end = end

    def recv_frames_nowait(self) -> list[Buffer] | None:
        return self._end.recv_nowait()

    async def recv_frames(self) -> list[Buffer]:
        return await self._end.recv()

    def wait(self, timeout: float) -> bool:
        return bool(self._end.sock.poll(int(timeout * 1000)))

    def close(self) -> None:
        self._end.close()


class ZmqRpcClient(RawRpcClient):
    """DEALER socket: a request is ``["", call id, *frames]``; the reply echoes the call id.

    One call is in flight at a time: async callers queue on an asyncio lock,
    blocking callers on a thread lock. A reply whose id is not the awaited
    call's (the late answer to a call that timed out) is dropped, so a
    timeout never shifts later replies onto the wrong calls. A client serves
    either one event loop or synchronous threads, not both at once, as a zmq
    socket belongs to one thread at a time.
    """

    def __init__(self, end: _ZmqEnd) -> None:
        self._end = end
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._blocking_lock = threading.Lock()

    def _request(self, frames: Frames) -> tuple[bytes, list[Any]]:
        call_id = next(self._ids).to_bytes(_CALL_ID_BYTES, "little")
        return call_id, [b"", call_id, *frames]

    def _answer(self, call_id: bytes, reply: list[Buffer]) -> list[Buffer] | None:
        """The reply's frames if it answers ``call_id``; ``None`` (dropped) otherwise."""
        if len(reply) >= 2 and bytes(reply[1]) == call_id:
            return reply[2:]
        got = bytes(reply[1]).hex() if len(reply) >= 2 else "none"
        logger.debug("dropped an RPC reply for call %s while waiting for call %s on %s",
                     got, call_id.hex(), self._end.address)
        return None

    async def call_frames(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        async with self._lock:
            call_id, request = self._request(frames)
            await self._end.async_sock.send_multipart(request, copy=False)
            return await asyncio.wait_for(self._await_answer(call_id), timeout)

    async def _await_answer(self, call_id: bytes) -> list[Buffer]:
        while (answer := self._answer(call_id, await self._end.recv())) is None:
            pass
        return answer

    def call_frames_blocking(self, frames: Frames, timeout: float | None = None) -> list[Buffer]:
        with self._blocking_lock:
            call_id, request = self._request(frames)
            sock = self._end.sock
            sock.send_multipart(request, copy=False)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not sock.poll(None if left is None else int(left * 1000)):
                    raise TimeoutError(f"no reply from {self._end.address} within {timeout} s")
                answer = self._answer(call_id, _buffers(sock.recv_multipart(copy=False)))
                if answer is not None:
                    return answer

    def close(self) -> None:
        self._end.close()


class ZmqRpcServer(RawRpcServer[RpcToken]):
    """ROUTER socket; the reply token is the caller's routing identity and call id."""

    def __init__(self, end: _ZmqEnd) -> None:
        self._end = end

    def recv_request_nowait(self) -> tuple[RpcToken, list[Buffer]] | None:
        while (parts := self._end.recv_nowait()) is not None:
            request = self._parse(parts)
            if request is not None:
                return request
        return None

    async def recv_request(self) -> tuple[RpcToken, list[Buffer]]:
        while (request := self._parse(await self._end.recv())) is None:
            pass
        return request

    def _parse(self, parts: list[Buffer]) -> tuple[RpcToken, list[Buffer]] | None:
        """``((identity, call id), frames)``, or ``None`` for a request not shaped as ours."""
        if len(parts) < 3 or len(parts[1]) != 0 or len(parts[2]) != _CALL_ID_BYTES:
            logger.warning("dropped a malformed RPC request on %s", self._end.address)
            return None
        return (bytes(parts[0]), bytes(parts[2])), parts[3:]

    def reply_frames(self, token: RpcToken, frames: Frames) -> None:
        identity, call_id = token
        self._end.sock.send_multipart([identity, b"", call_id, *frames], copy=False)

    def close(self) -> None:
        self._end.close()


class ZmqTransport(Transport):
    """ZMQ over ``ipc://`` (socket files) or ``tcp://`` (CURVE); one zmq context per transport.

    ``curve_key_dir`` names a directory with ``server.key_secret`` and
    ``client.key_secret`` (see ``CurveKeys.from_dir``); without it, fresh
    keys are made here when libzmq has CURVE. Without CURVE, ``ipc://``
    works and ``tcp://`` is refused with ``CurveError``.
    """

    name = "zmq"
    schemes = ("ipc", "tcp")

    def __init__(self, *, allow_insecure_pickle: bool = False, io_threads: int = 1,
                 curve_key_dir: str | None = None) -> None:
        super().__init__(allow_insecure_pickle=allow_insecure_pickle)
        self._io_threads = io_threads
        self.curve_keys: CurveKeys | None = None
        if curve_key_dir is not None:
            self._require_curve_library()
            self.curve_keys = CurveKeys.from_dir(curve_key_dir)
        elif curve_available():
            self.curve_keys = CurveKeys.generate()
        self._init_process_state()

    def _init_process_state(self) -> None:
        # What belongs to one process and is made there on first use: contexts and
        # threads do not survive pickling or fork.
        self._context: zmq.Context | None = None
        self._authenticator: ThreadAuthenticator | None = None
        self._lock = threading.Lock()

    @property
    def context(self) -> zmq.Context:
        """This process's zmq context of the transport."""
        with self._lock:
            if self._context is None:
                self._context = zmq.Context(self._io_threads)
            return self._context

    def pipe_sender(self, address: str) -> ZmqPipeSender:
        return ZmqPipeSender(self._open(zmq.PUSH, address, bind=False))

    def pipe_receiver(self, address: str) -> ZmqPipeReceiver:
        return ZmqPipeReceiver(self._open(zmq.PULL, address, bind=True))

    def rpc_client(self, address: str) -> ZmqRpcClient:
        return ZmqRpcClient(self._open(zmq.DEALER, address, bind=False))

    def rpc_server(self, address: str) -> ZmqRpcServer:
        return ZmqRpcServer(self._open(zmq.ROUTER, address, bind=True))

    def bound_pipe_sender(self, address: str) -> ZmqPipeSender:
        return ZmqPipeSender(self._open(zmq.PUSH, address, bind=True))

    def connected_pipe_receiver(self, address: str) -> ZmqPipeReceiver:
        return ZmqPipeReceiver(self._open(zmq.PULL, address, bind=False))

    def bound_rpc_client(self, address: str) -> ZmqRpcClient:
        return ZmqRpcClient(self._open(zmq.DEALER, address, bind=True))

    def connected_rpc_server(self, address: str) -> ZmqRpcServer:
        return ZmqRpcServer(self._open(zmq.ROUTER, address, bind=False))

    def make_address(self, workdir: str, name: str, tcp_host: str | None = None) -> str:
        if tcp_host is not None:
            self._require_curve()  # refuse at start-up, in the parent, before any child
            return f"tcp://{_format_host(tcp_host)}:{free_tcp_port(tcp_host)}"
        return f"ipc://{os.path.join(workdir, name)}"

    def _open(self, kind: int, address: str, bind: bool) -> _ZmqEnd:
        """A socket of ``kind``, secured when on tcp, bound or connected at ``address``."""
        sock = self.context.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Unbounded queues, as a blocked scheduler step is worse than memory growth.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if address.startswith("tcp://"):
                self._secure(sock, bind)
            if bind:
                sock.bind(address)
            else:
                sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close()
            action = "bind" if bind else "connect"
            raise TransportError(f"zmq cannot {action} {address}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return _ZmqEnd(sock, address, bind)

    def _secure(self, sock: zmq.Socket, bind: bool) -> None:
        """Make ``sock`` a CURVE server (a binder) or client (a connector)."""
        keys = self._require_curve()
        if not bind:
            sock.curve_secretkey = keys.client_secret
            sock.curve_publickey = keys.client_public
            sock.curve_serverkey = keys.server_public
            return
        self._start_authenticator(keys)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        sock.zap_domain = _ZAP_DOMAIN.encode()
        # Fail closed: with the domain enforced, a handshake that finds no ZAP handler is
        # refused instead of admitted. Older libzmq builds lack the option; the
        # authenticator is running before any bind either way.
        with contextlib.suppress(AttributeError, zmq.ZMQError):
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def _start_authenticator(self, keys: CurveKeys) -> None:
        """Start this process's ZAP handler for the context, once, before the first bind."""
        context = self.context
        with self._lock:
            if self._authenticator is not None:
                return
            auth = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.auth"))
            auth.configure_curve_callback(_ZAP_DOMAIN, _AllowedClientKeys(keys.client_public))
            auth.start()
            self._authenticator = auth

    def _require_curve(self) -> CurveKeys:
        self._require_curve_library()
        if self.curve_keys is None:  # unpickled in a process whose libzmq differs
            raise CurveError("this zmq transport has no CURVE keys for tcp:// channels")
        return self.curve_keys

    @staticmethod
    def _require_curve_library() -> None:
        if not curve_available():
            raise CurveError(
                f"tcp:// channels need ZMQ CURVE authentication, which this libzmq "
                f"({zmq.zmq_version()}) lacks; use ipc:// (drop --use-tcp) or install a "
                "pyzmq whose libzmq has CURVE")

    def __getstate__(self) -> dict[str, Any]:
        # A transport travels to spawned children by pickle, keys included (the pipe to a
        # spawned child is local to this machine); the context, the authenticator thread
        # and the lock stay behind.
        state = dict(self.__dict__)
        for name in ("_context", "_authenticator", "_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()


# Every port free_tcp_port has handed out in this process: the kernel may offer a port again
# once its probe socket is closed, and two channels bound to one port would collide.
_HANDED_OUT: set[int] = set()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, never the same one twice."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
