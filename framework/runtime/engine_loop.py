"""The Engine's own event loop, in a background thread, and the bridge to it.

The TokenizerManager needs a running event loop for its whole life, and the
Engine's callers may be plain scripts, code inside ``asyncio.run(...)`` or
several threads. So the manager lives on a loop of its own ("engine-loop"), and
every call hands a coroutine to it with ``asyncio.run_coroutine_threadsafe``:
a sync call waits on the returned future (``run``), an async call awaits it on
the caller's loop through ``asyncio.wrap_future`` (``arun``). The caller's loop
never runs (or blocks) the manager's receive loops.

Once the runtime is down (``fail``), every call still waiting and every later
one raises ``RuntimeError`` naming why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
# How long stop() waits for the loop thread to end.
_LOOP_STOP_S = 10.0
# What a stream's step returns once the stream has ended (StopAsyncIteration does not
# cross a future cleanly).
_END = object()


class EngineLoop:
    """An event loop running in a daemon thread, and calls bridged to it from anywhere."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        # Done (with the reason) once the runtime is down.
        self._death: asyncio.Future[str] = self.loop.create_future()
        self._closing: set[asyncio.Future[None]] = set()
        # Daemon: a script that forgets to shut its Engine down still exits.
        self.thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self.thread.start()

    @property
    def is_open(self) -> bool:
        """Whether calls can still run on the loop."""
        return not self.loop.is_closed() and self.thread.is_alive()

    def _run_loop(self) -> None:
        """The loop thread: run the loop until stop(), then clean up as asyncio.run does."""
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(_cancel_leftovers())

    def fail(self, reason: str) -> None:
        """The runtime is down: calls waiting and later ones raise ``RuntimeError(reason)``.

        Call on the loop (``call_soon``).
        """
        if not self._death.done():
            self._death.set_result(reason)

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Run ``callback(*args)`` on the loop, from any thread; nothing once it is closed."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)

    def finish(self, coro: Coroutine[Any, Any, Any], timeout: float) -> None:
        """Run ``coro`` on the loop even with the runtime down (a clean-up), waiting at most
        ``timeout`` seconds."""
        if not self.is_open:
            coro.close()
            return
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            future.result(timeout)

    def stop(self) -> None:
        """Stop the loop (cancelling what still runs on it) and close it."""
        if self.loop.is_closed():
            return
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(_LOOP_STOP_S)
        if not self.thread.is_alive():
            self.loop.close()

    # ------------------------------------------------------------------ calls

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop, unless the runtime goes down first."""
        if not self.is_open:
            coro.close()
            raise RuntimeError("the engine is shut down")
        return asyncio.run_coroutine_threadsafe(self._unless_dead(coro), self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Block until ``coro`` is done on the loop; cancel it if the wait is cut short."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt: the requests are aborted, not left running
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro``, run on the loop, from the caller's loop.

        Cancelling the caller cancels the wrapped future, which cancels the task
        on the loop: its requests are aborted as a disconnect would.
        """
        return await asyncio.wrap_future(self.submit(coro))

    async def _unless_dead(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, or a ``RuntimeError`` naming why the runtime went down meanwhile."""
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({task, self._death}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        if not self._death.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RuntimeError(f"the runtime is down: {self._death.result()}")

    # ------------------------------------------------------------------ streams

    def sync_stream(self, chunks: AsyncIterator[T]) -> Iterator[T]:
        """Iterate ``chunks`` (which live on the loop) from a plain thread."""
        try:
            while (chunk := self.run(_next(chunks))) is not _END:
                yield chunk
        finally:
            self._close_stream(chunks)

    async def async_stream(self, chunks: AsyncIterator[T]) -> AsyncIterator[T]:
        """Iterate ``chunks`` (which live on the loop) from the caller's loop."""
        try:
            while (chunk := await self.arun(_next(chunks))) is not _END:
                yield chunk
        finally:
            # Closing runs the stream's cleanup, which aborts an unfinished request.
            with contextlib.suppress(RuntimeError):  # the engine is shut down
                await self.arun(_aclose(chunks))

    def _close_stream(self, chunks: AsyncIterator[Any]) -> None:
        if threading.current_thread() is self.thread:
            # Dropped by a garbage collection on the loop's own thread: waiting would deadlock.
            task = asyncio.ensure_future(_aclose(chunks))
            self._closing.add(task)  # a task nobody references may vanish before it runs
            task.add_done_callback(self._closing.discard)
            return
        # RuntimeError: shut down, or still being cancelled (which aborts it too).
        with contextlib.suppress(RuntimeError):
            self.run(_aclose(chunks))


async def _next(chunks: AsyncIterator[Any]) -> Any:
    """The next chunk, or ``_END``."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return _END


async def _aclose(chunks: AsyncIterator[Any]) -> None:
    await chunks.aclose()  # type: ignore[attr-defined]


async def _cancel_leftovers() -> None:
    """Cancel the tasks still on the loop and close its async generators (streams left open)."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
