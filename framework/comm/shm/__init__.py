"""Shared-memory transport: a byte ring in POSIX shared memory plus a FIFO for wake-ups.

Each pipe is one ring in a ``multiprocessing.shared_memory`` segment, created
by the receiver (which binds the address ``shm://<dir>/<name>``) under a name
hashed from the address. Beside it the receiver makes a FIFO at ``<dir>/<name>``
that carries nothing but wake-up bytes; ``close()`` removes both. RPC is two
pipes (``<name>.req`` and ``<name>.rep``) under the generic
``PipeRpcClient``/``PipeRpcServer``. The transport is local to one machine.

``ring.py`` holds the segment's layout and the record format, ``receiver.py``
the receiving end and how it sleeps, ``sender.py`` the sending end and what a
full ring does, ``transport.py`` the transport that makes both.
"""

from framework.comm.shm.receiver import ShmPipeReceiver
from framework.comm.shm.ring import segment_name
from framework.comm.shm.sender import ShmPipeSender
from framework.comm.shm.transport import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RING_BYTES,
    ShmTransport,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_RING_BYTES",
    "ShmPipeReceiver",
    "ShmPipeSender",
    "ShmTransport",
    "segment_name",
]
