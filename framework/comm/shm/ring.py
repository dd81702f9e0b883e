"""The ring of one shm channel: the segment's layout, its header words, the wrap-aware copies.

Segment layout (byte offsets; each hot word on its own cache line)::

    0    magic          8    capacity
    64   write position (bytes ever written; the sending process owns it)
    128  read position  (bytes ever consumed; the receiver owns it)
    192  receiver state (bit 0: asleep on the FIFO, bit 1: closed, above: sleeps so far)
    256  data: ``capacity`` bytes, used as a circular byte stream

A message is a record in that stream: a u64 frame count, one u64 length per
frame, then the frames' bytes, any of which may wrap past the end of the data
area. Messages of any size travel: a record that does not fit in the free space
is streamed through the ring in chunks (the sender publishes what fits, waits
for the receiver to consume it, and goes on; the receiver assembles the frames
as the chunks come), so the ring size bounds only what is in flight. Only the
record header must fit in the ring, which limits a message to
``capacity / 8 - 1`` frames. The receiver copies every frame out of the ring
before handing its space back, so received frames are the caller's to keep.

Memory ordering: on x86-64 (total store order) plain loads and stores keep the
order the ring needs (data before the write position is published, the read
position published only after the data is copied out). Each word moves in one
aligned 8-byte access, through a memoryview of 64-bit items: ``struct.pack_into``
would not do, as it clears the bytes before writing the value, and the other
process may read the word in between. On other CPUs the position and state
words go through libatomic's sequentially consistent loads and stores instead,
which are slower (a ctypes call each).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import platform
import struct
import sys
import threading
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from framework.comm.codec import Buffer
from framework.comm.transport import TransportError

_MAGIC = int.from_bytes(b"fwshmrg1", "little")
_MAGIC_AT, _CAPACITY_AT = 0, 8
WRITE_AT, READ_AT, STATE_AT = 64, 128, 192
_DATA_AT = 256
ASLEEP, CLOSED = 1, 2  # receiver state bits; the bits above count the receiver's sleeps
SLEEP_ONE = 4

U64 = struct.Struct("=Q")  # a record's frame count; the segment's magic and capacity
# Frames at least this large come back as a writable bytearray, smaller ones as bytes.
_BYTEARRAY_MIN = 64 * 1024


def segment_name(address: str) -> str:
    """The shared memory segment name of ``address`` (a hash: names are short and flat)."""
    digest = hashlib.blake2b(address.encode(), digest_size=12).hexdigest()
    return f"fw-{digest}"


def fifo_path(address: str) -> str:
    """The FIFO path an ``shm://`` address names; ``TransportError`` for any other address."""
    if not address.startswith("shm://"):
        raise TransportError(f"the shm transport serves shm:// addresses, not {address!r}")
    path = address[len("shm://") :]
    if not path:
        raise TransportError(f"{address!r} names no path")
    return path


@functools.lru_cache(maxsize=64)
def u64s(count: int) -> struct.Struct:
    """The layout of ``count`` u64 words (a record header)."""
    return struct.Struct(f"={count}Q")


_attach_lock = threading.Lock()


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without registering it with the resource tracker.

    A parent and its spawned children share one tracker, which keeps a set of
    names: registering the creator's segment here and unregistering it again
    would erase the creator's registration (its crash would leak the segment)
    and make the tracker print a KeyError when the creator unlinks it. Python
    3.13 can skip the registration; before that it is switched off around the
    constructor.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _attach_lock:
        register = resource_tracker.register
        resource_tracker.register = _skip_registration
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _skip_registration(name: str, rtype: str) -> None:
    """Stands in for ``resource_tracker.register`` while a segment is attached."""


class _PlainWords:
    """Header words read and written with plain aligned 8-byte loads and stores (x86).

    Items of a ``"Q"`` memoryview are copied in one piece. ``struct.pack_into``
    first clears the bytes and then writes the value, so another process could
    read a word as 0 in between: a sender that sees the read position at 0
    reckons more room than the ring has and overwrites bytes not yet taken.
    """

    def __init__(self, buf: memoryview) -> None:
        self._words = buf[:_DATA_AT].cast("Q")

    def load(self, offset: int) -> int:
        return self._words[offset >> 3]

    def store(self, offset: int, value: int) -> None:
        self._words[offset >> 3] = value

    def release(self) -> None:
        self._words.release()  # the view pins the mapping: it must go before the segment closes


class _AtomicWords:
    """Header words through libatomic's sequentially consistent loads and stores."""

    _SEQ_CST = 5

    def __init__(self, buf: memoryview) -> None:
        try:
            lib = ctypes.CDLL("libatomic.so.1")
        except OSError as exc:
            raise TransportError(
                f"the shm transport needs libatomic on {platform.machine()}: {exc}"
            ) from None
        self._load = lib["__atomic_load_8"]
        self._load.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._load.restype = ctypes.c_uint64
        self._store = lib["__atomic_store_8"]
        self._store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        self._store.restype = None
        # The anchor exports the buffer; release() drops it so the segment can be unmapped.
        self._anchor: Any = ctypes.c_char.from_buffer(buf)
        self._base = ctypes.addressof(self._anchor)

    def load(self, offset: int) -> int:
        return self._load(self._base + offset, self._SEQ_CST)

    def store(self, offset: int, value: int) -> None:
        self._store(self._base + offset, value, self._SEQ_CST)

    def release(self) -> None:
        self._anchor = None


class Ring:
    """One mapped segment: header words plus wrap-aware copies in and out of the data area."""

    def __init__(self, shm: shared_memory.SharedMemory, atomic_words: bool) -> None:
        self.shm = shm
        self.buf = shm.buf
        self.words = _AtomicWords(self.buf) if atomic_words else _PlainWords(self.buf)
        self.load = self.words.load
        self.store = self.words.store
        self.capacity = self.load(_CAPACITY_AT)

    @classmethod
    def create(cls, name: str, capacity: int, atomic_words: bool) -> Ring:
        """Create the segment ``name`` with ``capacity`` data bytes (the receiver does)."""
        shm = shared_memory.SharedMemory(name=name, create=True, size=_DATA_AT + capacity)
        U64.pack_into(shm.buf, _CAPACITY_AT, capacity)
        U64.pack_into(shm.buf, _MAGIC_AT, _MAGIC)
        try:
            return cls(shm, atomic_words)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str, atomic_words: bool) -> Ring:
        """Map the existing segment ``name``; ``TransportError`` if it is not a ring."""
        shm = _attach_untracked(name)
        if (
            shm.size < _DATA_AT
            or U64.unpack_from(shm.buf, _MAGIC_AT)[0] != _MAGIC
            or shm.size < _DATA_AT + U64.unpack_from(shm.buf, _CAPACITY_AT)[0]
        ):
            shm.close()
            raise TransportError(f"shared memory segment {name} is not a framework ring")
        try:
            return cls(shm, atomic_words)
        except BaseException:
            shm.close()
            raise

    def put(self, pos: int, data: Buffer) -> None:
        """Copy ``data`` (at most ``capacity`` bytes) into the stream at ``pos``."""
        n = len(data)
        at = pos % self.capacity
        first = self.capacity - at
        if n <= first:
            self.buf[_DATA_AT + at : _DATA_AT + at + n] = data
        else:
            view = memoryview(data)
            self.buf[_DATA_AT + at : _DATA_AT + self.capacity] = view[:first]
            self.buf[_DATA_AT : _DATA_AT + n - first] = view[first:]

    def take(self, pos: int, n: int) -> bytes | bytearray:
        """A copy of the ``n`` stream bytes at ``pos`` (bytearray when large)."""
        at = pos % self.capacity
        kind = bytearray if n >= _BYTEARRAY_MIN else bytes
        if at + n <= self.capacity:
            return kind(self.buf[_DATA_AT + at : _DATA_AT + at + n])
        out = bytearray(n)
        self.copy_into(pos, memoryview(out))
        return out if kind is bytearray else bytes(out)

    def copy_into(self, pos: int, dest: memoryview) -> None:
        """Fill ``dest`` with the stream bytes at ``pos``."""
        n = len(dest)
        at = pos % self.capacity
        first = self.capacity - at
        if n <= first:
            dest[:] = self.buf[_DATA_AT + at : _DATA_AT + at + n]
        else:
            dest[:first] = self.buf[_DATA_AT + at : _DATA_AT + self.capacity]
            dest[first:] = self.buf[_DATA_AT : _DATA_AT + n - first]

    def unpack(self, layout: struct.Struct, pos: int) -> tuple[int, ...]:
        """Unpack ``layout`` from the stream at ``pos``, across the wrap if need be."""
        at = pos % self.capacity
        if at + layout.size <= self.capacity:
            return layout.unpack_from(self.buf, _DATA_AT + at)
        return layout.unpack(self.take(pos, layout.size))

    def close(self, unlink: bool) -> None:
        """Unmap the segment (every later word access raises); ``unlink`` also removes it."""
        self.words.release()
        self.load = self.store = _closed_word
        self.buf = memoryview(b"")
        self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _closed_word(*args: Any) -> Any:
    raise TransportError("the shm ring is closed")

