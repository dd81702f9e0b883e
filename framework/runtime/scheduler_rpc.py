"""The TokenizerManager's calls to the Schedulers: flush cache, update weights, LoRA
adapters, get info.

Each call goes to every replica's Scheduler (through the ``DataParallelRouter``)
and one exchange runs at a time; the replies of several replicas are merged
into one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from framework.messages import (
    FlushCacheReqInput,
    GetInfoReqInput,
    GetInfoReqOutput,
    LoadLoraAdapterReqInput,
    Message,
    UnloadLoraAdapterReqInput,
    UpdateWeightsFromDiskReqInput,
)
from framework.runtime.data_parallel import DataParallelRouter, check_replies, merge_replies


class SchedulerRpc:
    """The RPCs to the Schedulers behind ``router``, one exchange at a time.

    ``check_alive`` raises when the runtime is down, before any call waits for its turn.
    """

    def __init__(self, router: DataParallelRouter, load_balance_method: str,
                 check_alive: Callable[[], None]) -> None:
        self.router = router
        self.load_balance_method = load_balance_method
        self._check_alive = check_alive
        # Made at first use, on the event loop that uses it.
        self._lock: asyncio.Lock | None = None

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """One exchange of RPCs with the Schedulers at a time."""
        self._check_alive()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            yield

    async def call_all(self, msg: Message, timeout: float = 600.0) -> list[Message]:
        """``msg`` to every replica's Scheduler; their replies, in replica order."""
        async with self._turn():
            replies = await self.router.call_all(msg, timeout)
        check_replies(replies)  # an ErrorReply becomes a RuntimeError naming its replica
        return replies

    async def call(self, msg: Message, timeout: float = 600.0) -> Message:
        """``msg`` to every replica; one reply that names each replica's answer."""
        return merge_replies(await self.call_all(msg, timeout))

    async def flush_cache(self) -> Any:
        """Ask the Scheduler to flush its prefix cache."""
        return await self.call(FlushCacheReqInput())

    async def update_weights_from_disk(self, model_path: str, load_format: str = "auto",
                                       abort_all_requests: bool = False) -> Any:
        """Ask the Scheduler to load new weights; in-flight requests keep running (they
        continue on the new weights), or end with ``abort`` with ``abort_all_requests``.

        With several replicas, all or nothing (``DataParallelRouter.update_weights``):
        the update and any rollback form one turn, so that no other RPC comes between.
        """
        msg = UpdateWeightsFromDiskReqInput(model_path=model_path, load_format=load_format,
                                            abort_all_requests=abort_all_requests)
        async with self._turn():
            return await self.router.update_weights(msg, timeout=600.0)

    async def load_lora_adapter(self, name: str, path: str) -> Any:
        """Load LoRA adapter ``name`` from ``path`` in every replica, or in none: where
        some replica fails, those that loaded it unload it again."""
        return await self._lora_everywhere(LoadLoraAdapterReqInput(lora_name=name, lora_path=path),
                                           UnloadLoraAdapterReqInput(lora_name=name))

    async def unload_lora_adapter(self, name: str, path: str) -> Any:
        """Unload LoRA adapter ``name`` from every replica, or from none (refused while in
        use): where some replica refuses, those that unloaded it load it from ``path``."""
        return await self._lora_everywhere(UnloadLoraAdapterReqInput(lora_name=name),
                                           LoadLoraAdapterReqInput(lora_name=name, lora_path=path))

    async def _lora_everywhere(self, msg: Message, undo: Message) -> Message:
        """``msg`` to every replica, then ``undo`` to those where it succeeded unless it
        succeeded everywhere, in one turn; the merged reply."""
        async with self._turn():
            replies = await self.router.call_all(msg, timeout=600.0)
            done = [i for i, reply in enumerate(replies) if getattr(reply, "success", False)]
            if len(done) < len(replies):
                await self.router.call_each(dict.fromkeys(done, undo), timeout=600.0)
        check_replies(replies)
        merged = merge_replies(replies)
        if done and len(done) < len(replies):
            merged.message += "; undone where it succeeded"  # type: ignore[attr-defined]
        return merged

    async def scheduler_info(self) -> dict[str, Any]:
        """The Scheduler's state (memory, queues, configuration).

        With several replicas: each one's state and load under ``replicas``, and
        the whole server's (``kv_cache_idle_and_free`` of all, summed queues) on top.
        """
        replies = await self.call_all(GetInfoReqInput(), timeout=60.0)
        for reply in replies:
            if not isinstance(reply, GetInfoReqOutput):
                raise RuntimeError(f"unexpected reply {type(reply).__name__}")
        infos = [dict(reply.info) for reply in replies]  # type: ignore[attr-defined]
        return infos[0] if len(infos) == 1 else self.router.merged_info(
            infos, self.load_balance_method)
