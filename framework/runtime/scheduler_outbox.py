"""The one way out to the Scheduler: requests and aborts leave in the order handed over.

Everything the TokenizerManager sends to the Scheduler goes through one
``SchedulerOutbox``, so that requests and aborts keep their order, and an abort
(which comes from code that cannot await) never makes the event loop wait for
room in a full channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from framework.comm.transport import TransportError
from framework.messages import Message

logger = logging.getLogger("framework.tokenizer_manager")

# On close, how long messages still queued for the Scheduler may take to go out. The
# Scheduler is normally stopped by then, which makes a send fail at once; this bounds the
# case of a live Scheduler that does not read.
CLOSE_FLUSH_S = 1.0


class SchedulerOutbox:
    """Sends messages to the Scheduler one at a time, in the order they were handed over.

    A send may have to wait for room (a full shm ring), so one task of the event
    loop does the sending and awaits the async send. Callers of ``send`` wait for
    their message to be sent (and get its error); ``put_nowait`` is for code that
    cannot await, such as the ``finally`` of a task cancelled when its client
    disconnected: its message goes out as soon as everything before it has.
    """

    def __init__(self, send: Callable[[Message], Awaitable[None]],
                 send_nowait: Callable[[Message], None]) -> None:
        self._send = send
        # The way out for ``put_nowait`` in a thread without an event loop.
        self._send_nowait = send_nowait
        # Each message with the future its caller waits on (None: nobody waits).
        self._queue: deque[tuple[Message, asyncio.Future[None] | None]] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sending = False
        self._closed = False

    @property
    def pending(self) -> int:
        """Messages handed over and not sent yet (the one being sent included)."""
        return len(self._queue) + self._sending

    def start(self) -> None:
        """Start the sending task on the running event loop (again if it ended)."""
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="scheduler-outbox")

    async def send(self, msg: Message) -> None:
        """Send ``msg`` after everything handed over before it; raise what the send raised.

        A caller cancelled before its message went out withdraws it; once it is
        going out, it is finished (half a message would corrupt the channel).
        """
        if self._closed:
            raise TransportError("the channel to the Scheduler is closed")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((msg, done))
        self._kick()
        await done

    def put_nowait(self, msg: Message) -> None:
        """Queue ``msg`` and return at once; it goes out in order, when there is room.

        In a thread without an event loop, ``msg`` is sent right away instead.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # No event loop in this thread, so nothing to hold up: send right here.
            self._send_nowait(msg)
            return
        if self._closed:
            # Shutting down: the Scheduler is stopping too, and takes its requests with it.
            logger.debug("%s not sent: the channel to the Scheduler is closed",
                         type(msg).__name__)
            return
        self._queue.append((msg, None))
        self._kick()

    def _kick(self) -> None:
        self.start()  # a manager used before start() still sends
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                msg, done = self._queue.popleft()
                if done is not None and done.done():
                    continue  # withdrawn: its caller was cancelled before it went out
                await self._send_one(msg, done)

    async def _send_one(self, msg: Message, done: asyncio.Future[None] | None) -> None:
        self._sending = True
        try:
            await self._send(msg)
        except asyncio.CancelledError:  # close() gave up on it
            if done is None:
                logger.warning("%s for the Scheduler was dropped on close", type(msg).__name__)
            _fail(done, TransportError("the channel to the Scheduler closed while sending"))
            raise
        except Exception as exc:
            if done is None:
                logger.error("could not send %s to the Scheduler: %s", type(msg).__name__, exc)
            _fail(done, exc)
        else:
            if done is not None and not done.done():
                done.set_result(None)
        finally:
            self._sending = False

    async def close(self, timeout: float = CLOSE_FLUSH_S) -> None:
        """Let queued messages go out for up to ``timeout`` s, then stop the task.

        Callers still waiting get a ``TransportError``; aborts that could not go
        out are logged (the Scheduler is normally stopped by now).
        """
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            self._fail_queued()
            return
        deadline = asyncio.get_running_loop().time() + timeout
        # Polling is fine here: it runs once, at shutdown, for at most ``timeout``.
        while self.pending and not task.done() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self._fail_queued()

    def _fail_queued(self) -> None:
        dropped = 0
        while self._queue:
            _, done = self._queue.popleft()
            if done is None:
                dropped += 1
            _fail(done, TransportError("the channel to the Scheduler closed"))
        if dropped:
            logger.warning("%d aborts for the Scheduler were dropped on close", dropped)


def _fail(done: asyncio.Future[None] | None, exc: BaseException) -> None:
    """Hand ``exc`` to the caller waiting on ``done``, if one still waits."""
    if done is not None and not done.done():
        done.set_exception(exc)
