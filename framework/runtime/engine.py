"""The offline Engine: the server's runtime without HTTP, driven from Python.

It starts the same TokenizerManager, Scheduler and Detokenizer classes as the
server, through the same start-up path (``framework.runtime.launch``): the
Scheduler and the Detokenizer run in their own processes over the server's
default transport (zmq), so a script gets continuous batching with a plain
call. ``launch_mode="thread"`` runs them as threads of the caller's process
instead, over the ``inproc`` transport unless another is named (for tests and
debugging).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from framework.config import ServerArgs
from framework.runtime.launch import ComponentTree, apply_scheduler_info
from framework.runtime.tokenizer_manager import (
    GenerateRequest,
    TokenizerManager,
    gather_or_cancel,
)
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.engine")

_WATCHER_JOIN_S = 5.0


class Engine:
    """Generate text or embeddings from Python: ``Engine(model_path=...).generate(prompts)``.

    Keyword arguments are ``ServerArgs`` fields. Use as a context manager, or
    call ``shutdown()`` when done. The Scheduler and the Detokenizer are
    spawned processes, so a script that makes an Engine at import time must
    do so under ``if __name__ == "__main__":``. If one of them dies, waiting
    and later calls raise ``RuntimeError`` naming it.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("launch_mode") == "thread":
            kwargs.setdefault("transport", "inproc")
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        # Checks the launch settings (a ValueError) before anything is made.
        self.components = ComponentTree(self.server_args)
        self.transport = self.components.transport
        self.port_args = self.components.port_args
        self._loop = asyncio.new_event_loop()
        # Done (with the reason) once a component has died.
        self._death: asyncio.Future[str] = self._loop.create_future()
        self._watcher: threading.Thread | None = None
        self.tokenizer_manager: TokenizerManager | None = None
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        from framework.runtime.hf_tokenizer import load_tokenizer

        args, components = self.server_args, self.components
        tokenizer = load_tokenizer(args.resolved_tokenizer_path())
        # The TokenizerManager binds its receivers before the components connect to them.
        manager = components.classes.tokenizer_manager(args, components.port_args,
                                                       components.transport, tokenizer)
        self.tokenizer_manager = manager
        apply_scheduler_info(manager, components.start())
        self._loop.run_until_complete(self._start_manager(manager))
        self._watcher = threading.Thread(target=self._watch, name="engine-watcher", daemon=True)
        self._watcher.start()

    @staticmethod
    async def _start_manager(manager: TokenizerManager) -> None:
        manager.start()  # its receive loops need a running event loop

    def _watch(self) -> None:
        """Wait for a component to die; then fail every waiting request and stop the rest."""
        reason = self.components.wait_for_death()
        if reason is None:
            return  # shut down on purpose
        logger.error("%s; the engine stops", reason)
        with contextlib.suppress(RuntimeError):  # the loop is closed: shutdown() is done
            self._loop.call_soon_threadsafe(self._on_death, reason)
        # Like the server, the runtime goes down with any of its parts: no orphans.
        self.components.stop()

    def _on_death(self, reason: str) -> None:
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.fail_all(reason)
        if not self._death.done():
            self._death.set_result(reason)

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list of prompts (a list back).

        Each result has ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
        ``completion_tokens``, ``cached_tokens``, ``finish_reason``, logprobs when asked).
        All prompts of one call run together in the continuous batch.
        """
        single, requests = self._requests(prompt, input_ids, sampling_params)
        for req in requests:
            req.return_logprob = return_logprob
            req.top_logprobs_num = top_logprobs_num
        results = self._run(self._generate_all(requests))
        outputs = [{k: v for k, v in r.items() if k != "delta"} for r in results]
        return outputs[0] if single else outputs

    def encode(self, texts: str | list[str]) -> Any:
        """Embeddings (numpy float32) of one text or a list of texts."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        results = self._run(gather_or_cancel([self._manager.embed(text=t) for t in items]))
        embeddings = [r["embedding"] for r in results]
        return embeddings[0] if single else embeddings

    def flush_cache(self) -> Any:
        """Flush the prefix cache (when idle)."""
        return self._run(self._manager.flush_cache())

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto") -> Any:
        """Load new weights of the same architecture."""
        return self._run(self._manager.update_weights_from_disk(model_path, load_format))

    def get_server_info(self) -> dict[str, Any]:
        """The Scheduler's state, including whether every KV slot is free when idle."""
        return self._run(self._manager.get_scheduler_info())

    def shutdown(self) -> None:
        """Stop the components, close every channel and remove the channels' directory."""
        self.components.stop()
        if self._watcher is not None:
            self._watcher.join(_WATCHER_JOIN_S)
        if self.tokenizer_manager is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self.tokenizer_manager.close())
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers

    @property
    def _manager(self) -> TokenizerManager:
        if self.tokenizer_manager is None or self._loop.is_closed():
            raise RuntimeError("the engine is shut down")
        return self.tokenizer_manager

    def _run(self, coro: Any) -> Any:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the engine is shut down")
        return self._loop.run_until_complete(self._unless_dead(coro))

    async def _unless_dead(self, coro: Any) -> Any:
        """``coro``'s result, or a ``RuntimeError`` naming the component that died meanwhile."""
        task = asyncio.ensure_future(coro)
        await asyncio.wait({task, self._death}, return_when=asyncio.FIRST_COMPLETED)
        if not self._death.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RuntimeError(f"the runtime is down: {self._death.result()}")

    async def _generate_all(self, requests: list[GenerateRequest]) -> list[dict[str, Any]]:
        """Check every request before sending any; if one fails, abort the others."""
        manager = self._manager
        prepared = await gather_or_cancel([manager.prepare(r) for r in requests])
        return await gather_or_cancel([manager.generate_one(p) for p in prepared])

    @staticmethod
    def _requests(
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    ) -> tuple[bool, list[GenerateRequest]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            reqs = [GenerateRequest(text=p) for p in prompts]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            id_lists = [input_ids] if single else list(input_ids)
            reqs = [GenerateRequest(input_ids=list(ids)) for ids in id_lists]
        if sampling_params is None or isinstance(sampling_params, dict):
            params_list = [sampling_params] * len(reqs)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(reqs):
                raise ValueError(f"{len(params_list)} sampling_params for {len(reqs)} prompts")
        for req, params in zip(reqs, params_list):
            req.sampling_params = SamplingParams.from_dict(params)
        return single, reqs
