"""The receiving end of an shm channel: it binds the address, takes records out, sleeps.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import time

from framework.comm.codec import Buffer
from framework.comm.shm.ring import (
    ASLEEP,
    CLOSED,
    READ_AT,
    SLEEP_ONE,
    STATE_AT,
    U64,
    WRITE_AT,
    Ring,
    fifo_path,
    segment_name,
    u64s,
)
from framework.comm.transport import PipeReceiver, TransportError

# A receiver about to sleep may keep re-checking the ring up to this long first: waking a
# sleeping process costs tens of microseconds on both sides, so a sender that keeps sending
# should find its receiver awake. Spinning only pays when there is a core to spare, so the
# receiver keeps spinning while data tends to come within this time and backs off when not.
_RECEIVER_SPIN_S = 100e-6
_RECEIVER_SPIN_MIN_S = 2e-6
# The receiver's first wait of each sleep, then the cap as the wait doubles.
_FIRST_WAKE_CHECK_S = 0.005
_LAST_WAKE_CHECK_S = 0.25


class _PartialRecord:
    """A record longer than what has arrived so far: frames filled as chunks come."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.frames = [bytearray(n) for n in lengths]
        self.index = 0
        self.offset = 0

    def fill(self, ring: Ring, pos: int, available: int) -> int:
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
        self._fifo_path = fifo_path(address)
        self._segment = segment_name(address)
        self._claim_fifo()
        try:
            self._ring: Ring | None = Ring.create(self._segment, ring_bytes, atomic_words)
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
            self._write_seen = ring.load(WRITE_AT)
            if self._write_seen - self._read < 8:
                return None
        read = self._read
        (count,) = ring.unpack(U64, read)
        header = 8 + 8 * count
        if header > ring.capacity:
            raise TransportError(f"corrupt record on {self.address}: {count} frames")
        if self._write_seen - read < header:
            self._write_seen = ring.load(WRITE_AT)
            if self._write_seen - read < header:
                return None
        lengths = ring.unpack(u64s(count), read + 8)
        end = read + header + sum(lengths)
        if self._write_seen < end:
            self._write_seen = ring.load(WRITE_AT)
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

    def _continue_partial(self, ring: Ring) -> list[Buffer] | None:
        assert self._partial is not None  # internal invariant, not user input
        self._write_seen = ring.load(WRITE_AT)
        taken = self._partial.fill(ring, self._read, self._write_seen - self._read)
        if taken:
            self._consume(ring, self._read + taken)
        if not self._partial.complete:
            return None
        frames: list[Buffer] = list(self._partial.frames)
        self._partial = None
        return frames

    def _consume(self, ring: Ring, pos: int) -> None:
        """Hand the bytes before ``pos`` back to senders (they are copied out by now)."""
        self._read = pos
        ring.store(READ_AT, pos)

    def _open_ring(self) -> Ring:
        if self._ring is None:
            raise TransportError(f"receive on a closed shm receiver ({self.address})")
        return self._ring

    def _has_data(self, ring: Ring) -> bool:
        self._write_seen = ring.load(WRITE_AT)
        return self._write_seen != self._read

    # ---- sleeping until a sender wakes us

    def _set_asleep(self, ring: Ring, asleep: bool) -> None:
        if asleep:
            self._sleeps += 1
        ring.store(STATE_AT, self._sleeps * SLEEP_ONE + (ASLEEP if asleep else 0))

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

    def _sleep(self, ring: Ring, deadline: float) -> bool:
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

    async def _sleep_async(self, ring: Ring) -> list[Buffer]:
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
        ring.store(STATE_AT, CLOSED)
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

