"""The sending end of an shm channel: this process's attachment, and records written in.

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
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator

from framework.comm.codec import Buffer
from framework.comm.shm.ring import (
    ASLEEP,
    CLOSED,
    READ_AT,
    STATE_AT,
    WRITE_AT,
    Ring,
    fifo_path,
    segment_name,
    u64s,
)
from framework.comm.transport import Frames, PipeSender, TransportError

# Records up to this size are joined and copied into the ring in one piece.
_JOIN_MAX = 16 * 1024
# A sender waiting for room (or for its turn) re-checks this many times without sleeping,
# then sleeps a little longer each time, up to the cap.
_SPIN_CHECKS = 64
_PAUSE_STEP_S = 20e-6
_PAUSE_MAX_S = 0.001
# While waiting for room, a sender pokes the FIFO this often: it wakes a receiver that
# missed a wake-up, and a BrokenPipeError tells that the receiver's process is gone.
_LIVENESS_EVERY = 100


def _pause_seconds(attempt: int) -> float:
    """How long a waiting sender sleeps on its ``attempt``-th check (0: just check again)."""
    if attempt < _SPIN_CHECKS:
        return 0.0
    return min(_PAUSE_MAX_S, _PAUSE_STEP_S * (attempt - _SPIN_CHECKS + 1))


class _Producer:
    """This process's attachment to one address: the mapped ring, the FIFO, the write lock.

    Every sender of this process on the address shares it, and a lock orders
    their records. Its exclusive ``flock`` on the FIFO keeps other processes
    from writing, so the write position lives here and the common send makes
    no system call.
    """

    def __init__(self, address: str, ring: Ring, fifo_fd: int) -> None:
        self.address = address
        self.ring = ring
        self.fifo_fd = fifo_fd
        self.lock = threading.Lock()
        self.users = 1
        # A process that sent here before and closed may have left records behind.
        self.write = ring.load(WRITE_AT)
        self.read_seen = ring.load(READ_AT)
        self.woken = 0  # the receiver state last woken: one wake-up per sleep

    def write_now(self, frames: Frames) -> bool:
        """Write a small record if it fits now; False (nothing written): take the slow path."""
        lengths = [len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in frames]
        record = u64s(len(lengths) + 1).pack(len(lengths), *lengths)
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
            read = self.ring.load(READ_AT)
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
        self.ring.store(WRITE_AT, pos)
        state = self.ring.load(STATE_AT)
        if state & CLOSED:
            raise TransportError(f"the shm receiver of {self.address} has closed")
        if state & ASLEEP and state != self.woken:
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
        if self.ring.load(STATE_AT) & CLOSED:
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
        header = u64s(len(lengths) + 1).pack(len(lengths), *lengths)
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
        if producer is not None and not producer.ring.load(STATE_AT) & CLOSED:
            producer.users += 1
            return producer
        producer = _attach_producer(address, atomic_words)
        if producer is not None:
            _producers[address] = producer
        return producer


def _attach_producer(address: str, atomic_words: bool) -> _Producer | None:
    """Attach to the receiver of ``address``; None while it is not bound yet."""
    path = fifo_path(address)
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
        ring = Ring.attach(segment_name(address), atomic_words)
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
        fifo_path(address)  # refuse a malformed address now, not on the first send
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

