"""One API request fanned out into several: its prompts and the ``n`` choices of each,
and their outputs merged back into one stream (``merge_streams``, for the HTTP routes
and the Engine alike).

Every part is prepared before any is sent, and the parts run together: one
that fails cancels the others (whose ``finally`` aborts them in the
Scheduler), so no sibling keeps generating for an answer that will never be
sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from framework.runtime.request_input import GenerateRequest, PreparedRequest

T = TypeVar("T")


def choice(req: GenerateRequest, index: int) -> GenerateRequest:
    """Choice ``index`` of ``req``: a copy with that choice's sampling parameters."""
    return dataclasses.replace(req, sampling_params=req.sampling_params.for_choice(index))


async def prepare_each_choice(
    reqs: list[GenerateRequest],
    prepare: Callable[[GenerateRequest], Awaitable[PreparedRequest]],
) -> list[PreparedRequest]:
    """One prepared request per request of ``reqs`` and choice of its ``n``, prompt-major.

    ``prepare`` runs once per request, on its choice 0, and the other choices
    share its prompt's token ids; with the same ``n`` for every request,
    request ``p``'s choice ``c`` is at ``p * n + c``.
    """
    firsts = await gather_or_cancel([prepare(choice(r, 0)) for r in reqs])
    out: list[PreparedRequest] = []
    for req, first in zip(reqs, firsts):
        out.append(first)
        out.extend(PreparedRequest(choice(req, index), first.input_ids)
                   for index in range(1, req.sampling_params.n))
    return out


async def gather_or_cancel(coros: list[Awaitable[T]]) -> list[T]:
    """Await every part of a fanned-out request; if one fails, cancel the others first.

    A cancelled part's ``finally`` aborts its request in the Scheduler, so no sibling
    keeps generating (and holding KV slots) for an answer that will never be sent.
    Cancelling this call (the client went away) cancels every part the same way.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # exception() marks every failure as retrieved, so none is logged as lost (also
        # when this call itself is cancelled and raises from here).
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    first = next((exc for exc in failures if exc is not None), None)
    if first is not None:
        raise first
    return [t.result() for t in tasks]


def merge_streams(streams: list[AsyncIterator[Any]]
                  ) -> AsyncGenerator[tuple[int, Any], None]:
    """Interleave several async iterators, tagging each item with its stream's index.

    If one fails, or the caller stops iterating, the others are cancelled, which
    aborts their requests.
    """

    async def merged() -> AsyncGenerator[tuple[int, Any], None]:
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
