"""Fan-in of streams: the outputs of an API request's parts, as one stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, tagging each item with its stream's index.

    If one fails, or the caller stops iterating, the others are cancelled, which
    aborts their requests.
    """

    async def merged() -> AsyncIterator[tuple[int, Any]]:
        queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[Any]) -> None:
            try:
                async for item in stream:
                    await queue.put((i, item, None))
                await queue.put((i, done, None))
            except Exception as exc:
                await queue.put((i, done, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item, error = await queue.get()
                if error is not None:
                    raise error
                if item is done:
                    remaining -= 1
                    continue
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return merged()
