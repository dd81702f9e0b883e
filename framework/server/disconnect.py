"""A client that leaves: ``unless_client_leaves`` cancels the work done for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _disconnect(request: Request) -> None:
    """Return when the client closes the connection.

    Only once the body is read: what the server receives after it is the disconnect.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client leaves first, ``work`` is cancelled (which aborts
    its requests, freeing their KV slots) and ``ClientGone`` is raised.

    A server does not cancel a handler whose client went away, so a long non-streamed
    answer would otherwise run to its end for nobody.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()
