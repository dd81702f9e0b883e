"""The offline Engine: the server's runtime in one process, without HTTP.

It runs the same TokenizerManager, Scheduler and Detokenizer classes as the
server, the Scheduler and the Detokenizer in threads, over the ``inproc``
transport by default, so a script gets continuous batching with a plain call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from framework.config import PortArgs, ServerArgs
from framework.registry import create_transport
from framework.runtime.tokenizer_manager import GenerateRequest, TokenizerManager
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.engine")

_START_TIMEOUT_S = 600.0


class ComponentThread(threading.Thread):
    """Runs one component in a daemon thread and reports readiness or failure."""

    def __init__(self, name: str, build: Callable[[], Any], run: Callable[[Any], None],
                 on_error: Callable[[str], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._build = build
        self._run = run
        self._on_error = on_error
        self.component: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            self.component = self._build()
        except BaseException as exc:  # reported to the caller of wait_ready
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            self._run(self.component)
        except BaseException as exc:
            self.error = exc
            logger.exception("%s stopped with an error", self.name)
            self._on_error(f"the {self.name} failed: {exc!r}")

    def wait_ready(self, timeout: float) -> Any:
        """The built component; re-raises the error if building it failed."""
        if not self.ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.component


class Engine:
    """Generate text or embeddings from Python: ``Engine(model_path=...).generate(prompts)``.

    Keyword arguments are ``ServerArgs`` fields. Use as a context manager, or
    call ``shutdown()`` when done.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("transport", "inproc")
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        from framework.runtime.launch import component_classes

        classes = component_classes(self.server_args)
        self.transport = create_transport(
            self.server_args.transport,
            allow_insecure_pickle=self.server_args.allow_insecure_pickle,
        )
        self.port_args = PortArgs.create(self.transport)
        self._loop = asyncio.new_event_loop()
        self._threads: list[ComponentThread] = []
        self.tokenizer_manager: TokenizerManager | None = None
        try:
            self._start(classes)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, classes: Any) -> None:
        from framework.runtime.hf_tokenizer import load_tokenizer

        args, port_args, transport = self.server_args, self.port_args, self.transport
        tokenizer = load_tokenizer(args.resolved_tokenizer_path())
        # The TokenizerManager binds its receivers before the others connect to them.
        self.tokenizer_manager = classes.tokenizer_manager(args, port_args, transport, tokenizer)
        scheduler = ComponentThread(
            "scheduler", lambda: classes.scheduler(args, port_args, transport),
            lambda s: s.event_loop(), self._fail_all,
        )
        detokenizer = ComponentThread(
            "detokenizer",
            lambda: classes.detokenizer.from_server_args(args, port_args, transport),
            lambda d: asyncio.run(d.serve()), self._fail_all,
        )
        self._threads = [scheduler, detokenizer]
        for thread in self._threads:
            thread.start()
        for thread in self._threads:
            thread.wait_ready(_START_TIMEOUT_S)
        self.scheduler = scheduler.component
        self.tokenizer_manager.context_len = self.scheduler.context_len
        self._loop.run_until_complete(self._start_manager())

    def _fail_all(self, reason: str) -> None:
        """Wake every waiting request with the failure (called from a component's thread)."""
        manager = self.tokenizer_manager
        if manager is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(manager.fail_all, reason)

    async def _start_manager(self) -> None:
        assert self.tokenizer_manager is not None
        self.tokenizer_manager.start()

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
        results = self._run(self._gather([self._manager.generate_one(r) for r in requests]))
        outputs = [{k: v for k, v in r.items() if k != "delta"} for r in results]
        return outputs[0] if single else outputs

    def encode(self, texts: str | list[str]) -> Any:
        """Embeddings (numpy float32) of one text or a list of texts."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        results = self._run(self._gather([self._manager.embed(text=t) for t in items]))
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
        """Stop the components and remove every channel."""
        for thread in self._threads:
            component = thread.component
            if component is not None:
                component.stop()
        for thread in self._threads:
            thread.join(timeout=30)
        for thread in self._threads:
            if thread.component is not None:
                thread.component.close()
        if self.tokenizer_manager is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self.tokenizer_manager.close())
        if not self._loop.is_closed():
            self._loop.close()
        self._threads = []
        self.port_args.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ helpers

    @property
    def _manager(self) -> TokenizerManager:
        if self.tokenizer_manager is None:
            raise RuntimeError("the engine is shut down")
        return self.tokenizer_manager

    def _run(self, coro: Any) -> Any:
        for thread in self._threads:
            if thread.error is not None:
                coro.close()
                raise RuntimeError(f"the {thread.name} failed: {thread.error!r}")
        return self._loop.run_until_complete(coro)

    @staticmethod
    async def _gather(coros: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*coros))

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
