"""The shm transport: pipes through shared memory rings between processes of one machine."""

from __future__ import annotations

import os
import platform

from framework.comm.shm.receiver import ShmPipeReceiver
from framework.comm.shm.sender import ShmPipeSender
from framework.comm.transport import PipeRpcTransport, TransportError

#: Data bytes of a ring unless the transport is told otherwise.
DEFAULT_RING_BYTES = 4 << 20
#: Seconds a sender waits on its first send for the receiver to bind.
DEFAULT_CONNECT_TIMEOUT = 30.0

_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


def _default_atomic_words() -> bool:
    return platform.machine().lower() not in _X86


class ShmTransport(PipeRpcTransport):
    """Pipes through shared memory rings between processes of one machine.

    ``ring_bytes`` is the data size of each ring a receiver creates (messages
    larger than it still travel, in chunks). ``connect_timeout`` bounds how
    long a sender's first send waits for its receiver to bind.
    ``atomic_words`` forces libatomic for the ring's position words (the
    default uses it only on CPUs other than x86).
    """

    name = "shm"
    schemes = ("shm",)

    def __init__(
        self,
        *,
        allow_insecure_pickle: bool = False,
        ring_bytes: int = DEFAULT_RING_BYTES,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        atomic_words: bool | None = None,
    ) -> None:
        super().__init__(allow_insecure_pickle=allow_insecure_pickle)
        if ring_bytes < 64:
            raise ValueError(f"ring_bytes must be at least 64, got {ring_bytes}")
        if connect_timeout < 0:
            raise ValueError(f"connect_timeout must be >= 0, got {connect_timeout}")
        self.ring_bytes = ring_bytes
        self.connect_timeout = connect_timeout
        self.atomic_words = _default_atomic_words() if atomic_words is None else atomic_words

    def pipe_sender(self, address: str) -> ShmPipeSender:
        return ShmPipeSender(address, self.connect_timeout, self.atomic_words)

    def pipe_receiver(self, address: str) -> ShmPipeReceiver:
        return ShmPipeReceiver(address, self.ring_bytes, self.atomic_words)

    def make_address(self, workdir: str, name: str, tcp_host: str | None = None) -> str:
        if tcp_host is not None:
            raise TransportError("the shm transport is local to one machine: it cannot use tcp")
        return f"shm://{os.path.join(workdir, name)}"
