"""Shared-memory transport: a byte ring in POSIX shared memory plus a FIFO for wake-ups.

Each pipe is one ring in a ``multiprocessing.shared_memory`` segment, created
by the receiver (which binds the address ``shm://<dir>/<name>``) under a name
hashed from the address. Beside it the receiver makes a FIFO at ``<dir>/<name>``
that carries nothing but wake-up bytes; ``close()`` removes both. RPC is two
pipes (``<name>.req`` and ``<name>.rep``) under the generic
``PipeRpcClient``/``PipeRpcServer``. The transport is local to one machine.

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

Waking the receiver: a receiver with nothing to read re-checks the ring for
up to 100 µs first (spinning pays only with a core to spare, so the spin
shrinks, down to none, while data keeps taking longer than that to come).
Then it sets its "asleep" bit, checks the ring once more, and waits on the
FIFO. After publishing, a sender writes one byte to the FIFO only when that
bit is set, and only once per sleep (the state word counts them), so a busy
receiver costs a sender no system call. The first wait of each sleep is short
(5 ms) as a safety net, and later ones double up to 250 ms: on x86 a store may
pass a later load, so in a narrow race the receiver's bit and the sender's new
write position can miss each other; once the bit has been visible for that
long, every later sender sees it.

A full ring makes a sender wait: it re-checks the read position briefly, then
sleeps in steps of up to 1 ms (``send_nowait`` blocks the calling thread, the
async ``send`` yields to the event loop) until there is room, and raises
``TransportError`` if the receiver closes or its process dies meanwhile. An
async send cancelled after its record began finishes the record first (half a
record would corrupt the stream), blocking until the receiver makes room.

One process sends on an address: its first sender attaches and takes an
exclusive ``flock`` on the FIFO, so that the write position can live in the
sending process and a send makes no system call; a sender in a second process
is refused with a ``TransportError`` until the first process's senders close.
Several senders (and threads) of one process share the attachment, and a lock
keeps their records whole. A sending process that dies halfway through a
record leaves the channel unusable.

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

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import platform
import select
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from framework.comm.codec import Buffer
from framework.comm.transport import (
    Frames,
    PipeReceiver,
    PipeRpcTransport,
    PipeSender,
    TransportError,
)

#: Data bytes of a ring unless the transport is told otherwise.
DEFAULT_RING_BYTES = 4 << 20
#: Seconds a sender waits on its first send for the receiver to bind.
DEFAULT_CONNECT_TIMEOUT = 30.0

_MAGIC = int.from_bytes(b"fwshmrg1", "little")
_MAGIC_AT, _CAPACITY_AT = 0, 8
_WRITE_AT, _READ_AT, _STATE_AT = 64, 128, 192
_DATA_AT = 256
_ASLEEP, _CLOSED = 1, 2  # receiver state bits; the bits above count the receiver's sleeps
_SLEEP_ONE = 4

_U64 = struct.Struct("=Q")  # a record's frame count; the segment's magic and capacity
# Frames at least this large come back as a writable bytearray, smaller ones as bytes.
_BYTEARRAY_MIN = 64 * 1024

# A receiver about to sleep may keep re-checking the ring up to this long first: waking a
# sleeping process costs tens of microseconds on both sides, so a sender that keeps sending
# should find its receiver awake. Spinning only pays when there is a core to spare, so the
# receiver keeps spinning while data tends to come within this time and backs off when not.
_RECEIVER_SPIN_S = 100e-6
_RECEIVER_SPIN_MIN_S = 2e-6
# Records up to this size are joined and copied into the ring in one piece.
_JOIN_MAX = 16 * 1024
# The receiver's first wait of each sleep, then the cap as the wait doubles.
_FIRST_WAKE_CHECK_S = 0.005
_LAST_WAKE_CHECK_S = 0.25
# A sender waiting for room (or for its turn) re-checks this many times without sleeping,
# then sleeps a little longer each time, up to the cap.
_SPIN_CHECKS = 64
_PAUSE_STEP_S = 20e-6
_PAUSE_MAX_S = 0.001
# While waiting for room, a sender pokes the FIFO this often: it wakes a receiver that
# missed a wake-up, and a BrokenPipeError tells that the receiver's process is gone.
_LIVENESS_EVERY = 100

_X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


def segment_name(address: str) -> str:
    """The shared memory segment name of ``address`` (a hash: names are short and flat)."""
    digest = hashlib.blake2b(address.encode(), digest_size=12).hexdigest()
    return f"fw-{digest}"


def _fifo_path(address: str) -> str:
    if not address.startswith("shm://"):
        raise TransportError(f"the shm transport serves shm:// addresses, not {address!r}")
    path = address[len("shm://") :]
    if not path:
        raise TransportError(f"{address!r} names no path")
    return path


def _pause_seconds(attempt: int) -> float:
    """How long a waiting sender sleeps on its ``attempt``-th check (0: just check again)."""
    if attempt < _SPIN_CHECKS:
        return 0.0
    return min(_PAUSE_MAX_S, _PAUSE_STEP_S * (attempt - _SPIN_CHECKS + 1))


@functools.lru_cache(maxsize=64)
def _u64s(count: int) -> struct.Struct:
    return struct.Struct(f"={count}Q")


# --------------------------------------------------------------------------- the segment

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


class _Ring:
    """One mapped segment: header words plus wrap-aware copies in and out of the data area."""

    def __init__(self, shm: shared_memory.SharedMemory, atomic_words: bool) -> None:
        self.shm = shm
        self.buf = shm.buf
        self.words = _AtomicWords(self.buf) if atomic_words else _PlainWords(self.buf)
        self.load = self.words.load
        self.store = self.words.store
        self.capacity = self.load(_CAPACITY_AT)

    @classmethod
    def create(cls, name: str, capacity: int, atomic_words: bool) -> _Ring:
        shm = shared_memory.SharedMemory(name=name, create=True, size=_DATA_AT + capacity)
        _U64.pack_into(shm.buf, _CAPACITY_AT, capacity)
        _U64.pack_into(shm.buf, _MAGIC_AT, _MAGIC)
        try:
            return cls(shm, atomic_words)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str, atomic_words: bool) -> _Ring:
        shm = _attach_untracked(name)
        if (
            shm.size < _DATA_AT
            or _U64.unpack_from(shm.buf, _MAGIC_AT)[0] != _MAGIC
            or shm.size < _DATA_AT + _U64.unpack_from(shm.buf, _CAPACITY_AT)[0]
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
        self.words.release()
        self.load = self.store = _closed_word
        self.buf = memoryview(b"")
        self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def _closed_word(*args: Any) -> Any:
    raise TransportError("the shm ring is closed")


def _default_atomic_words() -> bool:
    return platform.machine().lower() not in _X86


# --------------------------------------------------------------------------- receiver


class _PartialRecord:
    """A record longer than what has arrived so far: frames filled as chunks come."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.frames = [bytearray(n) for n in lengths]
        self.index = 0
        self.offset = 0

    def fill(self, ring: _Ring, pos: int, available: int) -> int:
        """Copy up to ``available`` bytes from ``pos``; returns how many were taken."""
        taken = 0
        while self.index < len(self.frames):
            frame = self.frames[self.index]
            n = min(len(frame) - self.offset, available - taken)
            ring.copy_into(pos + taken, memoryview(frame)[self.offset : self.offset + n])
            taken += n
            self.offset += n
            if self.offset < len(frame):
                break  # the rest of this frame has not come yet
            # Go on even with nothing left to take: empty frames after it are complete now.
            self.index += 1
            self.offset = 0
        return taken

    @property
    def complete(self) -> bool:
        return self.index == len(self.frames)


class ShmPipeReceiver(PipeReceiver):
    """Binds an ``shm://`` address: creates the ring segment and the wake-up FIFO.

    Frames come back as copies taken out of the ring before its space is handed
    back to senders: ``bytes``, or a writable ``bytearray`` for frames of
    64 KiB and more and for frames of a record that arrived in chunks.
    """

    def __init__(self, address: str, ring_bytes: int, atomic_words: bool) -> None:
        self.address = address
        self._fifo_path = _fifo_path(address)
        self._segment = segment_name(address)
        self._claim_fifo()
        try:
            self._ring: _Ring | None = _Ring.create(self._segment, ring_bytes, atomic_words)
        except BaseException as exc:
            os.unlink(self._fifo_path)
            if isinstance(exc, FileExistsError):
                raise TransportError(
                    f"shared memory segment {self._segment} of {address} already exists "
                    f"(bound elsewhere, or left behind: remove /dev/shm/{self._segment})"
                ) from None
            raise
        # Opening the read end tells senders that the ring is ready. Our own write end keeps
        # the FIFO from reporting end-of-file (which would wake an event loop forever)
        # whenever no sender is attached.
        self._wake_fd = os.open(self._fifo_path, os.O_RDONLY | os.O_NONBLOCK)
        self._keepalive_fd = os.open(self._fifo_path, os.O_WRONLY | os.O_NONBLOCK)
        self._poller = select.poll()  # not select.select: descriptors may exceed FD_SETSIZE
        self._poller.register(self._wake_fd, select.POLLIN)
        self._read = 0
        self._write_seen = 0
        self._partial: _PartialRecord | None = None
        self._sleeps = 0
        self._spin_s = _RECEIVER_SPIN_S
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def _claim_fifo(self) -> None:
        try:
            os.mkfifo(self._fifo_path, 0o600)
        except FileExistsError:
            raise TransportError(f"{self.address} is already bound") from None
        except OSError as exc:
            raise TransportError(f"cannot bind {self.address}: {exc}") from None

    # ---- taking records out of the ring

    def recv_frames_nowait(self) -> list[Buffer] | None:
        ring = self._open_ring()
        if self._partial is not None:
            return self._continue_partial(ring)
        if self._write_seen - self._read < 8:
            self._write_seen = ring.load(_WRITE_AT)
            if self._write_seen - self._read < 8:
                return None
        read = self._read
        (count,) = ring.unpack(_U64, read)
        header = 8 + 8 * count
        if header > ring.capacity:
            raise TransportError(f"corrupt record on {self.address}: {count} frames")
        if self._write_seen - read < header:
            self._write_seen = ring.load(_WRITE_AT)
            if self._write_seen - read < header:
                return None
        lengths = ring.unpack(_u64s(count), read + 8)
        end = read + header + sum(lengths)
        if self._write_seen < end:
            self._write_seen = ring.load(_WRITE_AT)
        if self._write_seen >= end:
            frames: list[Buffer] = []
            pos = read + header
            for n in lengths:
                frames.append(ring.take(pos, n))
                pos += n
            self._consume(ring, end)
            return frames
        self._partial = _PartialRecord(lengths)
        self._consume(ring, read + header)
        return self._continue_partial(ring)

    def _continue_partial(self, ring: _Ring) -> list[Buffer] | None:
        assert self._partial is not None  # internal invariant, not user input
        self._write_seen = ring.load(_WRITE_AT)
        taken = self._partial.fill(ring, self._read, self._write_seen - self._read)
        if taken:
            self._consume(ring, self._read + taken)
        if not self._partial.complete:
            return None
        frames: list[Buffer] = list(self._partial.frames)
        self._partial = None
        return frames

    def _consume(self, ring: _Ring, pos: int) -> None:
        """Hand the bytes before ``pos`` back to senders (they are copied out by now)."""
        self._read = pos
        ring.store(_READ_AT, pos)

    def _open_ring(self) -> _Ring:
        if self._ring is None:
            raise TransportError(f"receive on a closed shm receiver ({self.address})")
        return self._ring

    def _has_data(self, ring: _Ring) -> bool:
        self._write_seen = ring.load(_WRITE_AT)
        return self._write_seen != self._read

    # ---- sleeping until a sender wakes us

    def _set_asleep(self, ring: _Ring, asleep: bool) -> None:
        if asleep:
            self._sleeps += 1
        ring.store(_STATE_AT, self._sleeps * _SLEEP_ONE + (_ASLEEP if asleep else 0))

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_fd, 4096):
                pass

    def _learn_spin(self, idle_since: float) -> None:
        """Keep spinning while data comes within the spin time; halve the spin when not."""
        if time.perf_counter() - idle_since <= _RECEIVER_SPIN_S:
            self._spin_s = _RECEIVER_SPIN_S
        elif self._spin_s >= _RECEIVER_SPIN_MIN_S:
            self._spin_s /= 2
        else:
            self._spin_s = 0.0

    def wait(self, timeout: float) -> bool:
        """Sleep on the FIFO until a sender wakes us, data shows up, or ``timeout`` s pass."""
        ring = self._open_ring()
        if self._has_data(ring):
            return True
        idle_since = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            spin_until = idle_since + min(timeout, self._spin_s)
            while time.perf_counter() < spin_until:
                if self._has_data(ring):
                    return True
            return self._sleep(ring, deadline)
        finally:
            self._learn_spin(idle_since)

    def _sleep(self, ring: _Ring, deadline: float) -> bool:
        check = _FIRST_WAKE_CHECK_S
        self._set_asleep(ring, True)
        try:
            while not self._has_data(ring):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._poller.poll(1000 * min(check, remaining))
                self._open_ring()  # closed by another thread meanwhile: raise
                self._drain_wakeups()
                check = min(2 * check, _LAST_WAKE_CHECK_S)
            return True
        finally:
            if self._ring is not None:
                self._set_asleep(ring, False)

    async def recv_frames(self) -> list[Buffer]:
        frames = self.recv_frames_nowait()
        if frames is not None:
            return frames
        idle_since = time.perf_counter()
        try:
            spin_until = idle_since + self._spin_s
            while time.perf_counter() < spin_until:
                await asyncio.sleep(0)  # let other tasks run while we poll
                frames = self.recv_frames_nowait()
                if frames is not None:
                    return frames
            return await self._sleep_async(self._open_ring())
        finally:
            self._learn_spin(idle_since)

    async def _sleep_async(self, ring: _Ring) -> list[Buffer]:
        loop = asyncio.get_running_loop()
        check = _FIRST_WAKE_CHECK_S
        self._set_asleep(ring, True)
        try:
            while True:
                read = self._read
                frames = self.recv_frames_nowait()
                if frames is not None:
                    return frames
                if self._read != read:
                    # Part of a record came. A sender wakes each sleep once, and this one's
                    # wake-up may be spent: sleep anew (and check again) so the next chunk
                    # wakes us rather than the safety-net timer.
                    self._set_asleep(ring, True)
                    check = _FIRST_WAKE_CHECK_S
                    continue
                await self._readable(loop, check)
                self._open_ring()  # closed meanwhile: raise
                self._drain_wakeups()
                check = min(2 * check, _LAST_WAKE_CHECK_S)
        finally:
            if self._ring is not None:
                self._set_asleep(ring, False)

    async def _readable(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Wait until the FIFO has a wake-up byte or ``timeout`` s pass, without blocking."""
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self._wake_fd, _set_done, fut)
        timer = loop.call_later(timeout, _set_done, fut)
        self._waiter = (loop, fut)
        try:
            await fut
        finally:
            self._waiter = None
            timer.cancel()
            loop.remove_reader(self._wake_fd)  # harmless if close() closed it meanwhile

    def close(self) -> None:
        """Mark the ring closed for senders, then remove the FIFO and the segment."""
        if self._ring is None:
            return
        ring, self._ring = self._ring, None
        ring.store(_STATE_AT, _CLOSED)
        if self._waiter is not None:  # an async receive is waiting: it will raise
            loop, fut = self._waiter
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_done, fut)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._fifo_path)
        os.close(self._wake_fd)
        os.close(self._keepalive_fd)
        ring.close(unlink=True)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --------------------------------------------------------------------------- sender


class _Producer:
    """This process's attachment to one address: the mapped ring, the FIFO, the write lock.

    Every sender of this process on the address shares it, and a lock orders
    their records. Its exclusive ``flock`` on the FIFO keeps other processes
    from writing, so the write position lives here and the common send makes
    no system call.
    """

    def __init__(self, address: str, ring: _Ring, fifo_fd: int) -> None:
        self.address = address
        self.ring = ring
        self.fifo_fd = fifo_fd
        self.lock = threading.Lock()
        self.users = 1
        # A process that sent here before and closed may have left records behind.
        self.write = ring.load(_WRITE_AT)
        self.read_seen = ring.load(_READ_AT)
        self.woken = 0  # the receiver state last woken: one wake-up per sleep

    def write_now(self, frames: Frames) -> bool:
        """Write a small record if it fits now; False (nothing written): take the slow path."""
        lengths = [len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in frames]
        record = _u64s(len(lengths) + 1).pack(len(lengths), *lengths)
        if len(record) + sum(lengths) > _JOIN_MAX or not self.lock.acquire(blocking=False):
            return False
        try:
            record += b"".join(frames)
            if self.room(len(record)) < len(record):
                return False
            self.ring.put(self.write, record)
            self.publish(self.write + len(record))
            return True
        finally:
            self.lock.release()

    def room(self, need: int) -> int:
        """Free bytes after the write position, re-reading the read position if short of ``need``.

        The read position seen last is a safe guess (space only grows until we
        write), so the shared word is read only when that guess is too small.
        """
        room = self.ring.capacity - (self.write - self.read_seen)
        if room < need:
            read = self.ring.load(_READ_AT)
            if not self.read_seen <= read <= self.write:
                # Going on would overwrite bytes the receiver has not taken yet.
                raise TransportError(
                    f"the shm ring of {self.address} is corrupt: read position {read} "
                    f"outside {self.read_seen}..{self.write}"
                )
            self.read_seen = read
            room = self.ring.capacity - (self.write - self.read_seen)
        return room

    def publish(self, pos: int) -> None:
        """Make the bytes before ``pos`` visible, and wake the receiver if it sleeps."""
        self.write = pos
        self.ring.store(_WRITE_AT, pos)
        state = self.ring.load(_STATE_AT)
        if state & _CLOSED:
            raise TransportError(f"the shm receiver of {self.address} has closed")
        if state & _ASLEEP and state != self.woken:
            self.woken = state
            self.wake()

    def wake(self) -> None:
        try:
            os.write(self.fifo_fd, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full of wake-ups already
        except BrokenPipeError:
            raise TransportError(f"the shm receiver of {self.address} is gone") from None

    def check_receiver(self) -> None:
        if self.ring.load(_STATE_AT) & _CLOSED:
            raise TransportError(f"the shm receiver of {self.address} has closed")

    def close(self) -> None:
        self.ring.close(unlink=False)
        os.close(self.fifo_fd)  # also drops the flock


class _RecordWrite:
    """The slow path of one record: waits for its turn and for room, streams large frames."""

    def __init__(self, producer: _Producer, frames: Frames) -> None:
        self.producer = producer
        self.views = [f if isinstance(f, bytes) else _byte_view(f) for f in frames]
        self.started = False  # past this point, stopping would leave half a record

    def steps(self) -> Iterator[float]:
        """Write the record; yields a pause (seconds) each time it must wait."""
        producer, ring = self.producer, self.producer.ring
        lengths = [len(v) for v in self.views]
        header = _u64s(len(lengths) + 1).pack(len(lengths), *lengths)
        if len(header) > ring.capacity:
            raise TransportError(
                f"{len(lengths)} frames do not fit the record header of a "
                f"{ring.capacity}-byte ring ({producer.address})"
            )
        attempt = 0
        while not producer.lock.acquire(blocking=False):  # another sender of ours is writing
            yield _pause_seconds(attempt)
            attempt += 1
        try:
            producer.check_receiver()
            yield from self._room_steps(len(header))
            self.started = True
            ring.put(producer.write, header)
            producer.write += len(header)
            for view in self.views:
                yield from self._stream_steps(view)
            producer.publish(producer.write)
        finally:
            producer.lock.release()

    def _stream_steps(self, data: Buffer) -> Iterator[float]:
        """Copy ``data`` in, publishing and waiting whenever the ring fills."""
        producer = self.producer
        view = memoryview(data)
        while view:
            room = producer.room(len(view))
            if room == 0:
                producer.publish(producer.write)  # let the receiver take what is there
                room = yield from self._room_steps(1)
            n = min(room, len(view))
            producer.ring.put(producer.write, view[:n])
            producer.write += n
            view = view[n:]

    def _room_steps(self, need: int) -> Iterator[float]:
        """Wait until ``need`` bytes are free; returns the free bytes."""
        producer = self.producer
        attempt = 0
        while (room := producer.room(need)) < need:
            if attempt % _LIVENESS_EVERY == _LIVENESS_EVERY - 1:
                producer.wake()
            producer.check_receiver()
            yield _pause_seconds(attempt)
            attempt += 1
        return room


# This process's producers by address, shared by its senders.
_producers: dict[str, _Producer] = {}
_producers_lock = threading.Lock()


def _share_producer(address: str, atomic_words: bool) -> _Producer | None:
    """This process's producer for ``address``, attached now if the receiver is there."""
    with _producers_lock:
        producer = _producers.get(address)
        if producer is not None and not producer.ring.load(_STATE_AT) & _CLOSED:
            producer.users += 1
            return producer
        producer = _attach_producer(address, atomic_words)
        if producer is not None:
            _producers[address] = producer
        return producer


def _attach_producer(address: str, atomic_words: bool) -> _Producer | None:
    """Attach to the receiver of ``address``; None while it is not bound yet."""
    path = _fifo_path(address)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # the FIFO exists but its reader is not open yet
            return None
        raise TransportError(f"cannot connect to {address}: {exc}") from None
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise TransportError(f"{path} is not an shm channel")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TransportError(
                f"another process is sending to {address}: an shm channel takes the senders "
                "of one process (use one sender per process, or the zmq transport)"
            ) from None
        ring = _Ring.attach(segment_name(address), atomic_words)
    except FileNotFoundError:  # the receiver closed between the two steps
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return _Producer(address, ring, fd)


def _release_producer(producer: _Producer) -> None:
    with _producers_lock:
        producer.users -= 1
        if producer.users:
            return
        if _producers.get(producer.address) is producer:
            del _producers[producer.address]
    producer.close()


class ShmPipeSender(PipeSender):
    """Writes records into the ring of an ``shm://`` address.

    It attaches on its first send, waiting up to ``connect_timeout`` seconds for
    the receiver to bind. Senders of one process share the attachment; a sender
    in a second process is refused while the first process has one. See the
    module notes for what a full ring does.
    """

    def __init__(self, address: str, connect_timeout: float, atomic_words: bool) -> None:
        _fifo_path(address)  # refuse a malformed address now, not on the first send
        self.address = address
        self._connect_timeout = connect_timeout
        self._atomic_words = atomic_words
        self._producer: _Producer | None = None
        self._closed = False

    def send_frames_nowait(self, frames: Frames) -> None:
        """Write one record; blocks while the ring is full (see the module notes)."""
        producer = self._producer or self._attach_blocking()
        if producer.write_now(frames):
            return
        for pause in _RecordWrite(producer, frames).steps():
            if pause:
                time.sleep(pause)

    async def send_frames(self, frames: Frames) -> None:
        """Write one record, yielding to the event loop while the ring is full."""
        producer = self._producer or await self._attach_async()
        if producer.write_now(frames):
            return
        write = _RecordWrite(producer, frames)
        steps = write.steps()
        for pause in steps:
            try:
                await asyncio.sleep(pause)
            except asyncio.CancelledError:
                # Half a record would corrupt the stream, so a started record is finished.
                if write.started:
                    for rest in steps:
                        time.sleep(rest)
                else:
                    steps.close()
                raise

    def _attach_blocking(self) -> _Producer:
        for pause in self._attach_steps():
            time.sleep(pause)
        assert self._producer is not None  # internal invariant: _attach_steps sets it
        return self._producer

    async def _attach_async(self) -> _Producer:
        for pause in self._attach_steps():
            await asyncio.sleep(pause)
        assert self._producer is not None  # internal invariant: _attach_steps sets it
        return self._producer

    def _attach_steps(self) -> Iterator[float]:
        if self._closed:
            raise TransportError(f"send on a closed shm sender ({self.address})")
        deadline = time.monotonic() + self._connect_timeout
        pause = 0.001
        while (producer := _share_producer(self.address, self._atomic_words)) is None:
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"no shm receiver bound {self.address} within {self._connect_timeout} s"
                )
            yield pause
            pause = min(2 * pause, 0.05)
        if self._producer is None:
            self._producer = producer
        else:  # a concurrent first send of this sender attached meanwhile
            _release_producer(producer)

    def close(self) -> None:
        """Detach; the last sender of this process unmaps the ring and closes the FIFO."""
        self._closed = True
        if self._producer is not None:
            _release_producer(self._producer)
            self._producer = None


def _byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of a contiguous buffer, as the ring copies bytes."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# --------------------------------------------------------------------------- transport


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
