"""The offline Engine: the server's runtime without HTTP, driven from Python.

It starts the same TokenizerManager, Scheduler and Detokenizer classes as the
server, through the same start-up path (``framework.runtime.launch``): the
Scheduler and the Detokenizer run in their own processes over the server's
default transport (zmq), so a script gets continuous batching with a plain
call. ``launch_mode="thread"`` runs them as threads of the caller's process
instead, over the ``inproc`` transport unless another is named (for tests and
debugging).

The TokenizerManager lives on the Engine's own event loop, in a background
thread (``engine_loop.py``): every call, sync or async, is bridged to it, so the
Engine works the same from a plain script, from inside ``asyncio.run(...)`` and
from several threads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from framework.config import ServerArgs
from framework.runtime.engine_loop import EngineLoop
from framework.runtime.fan_out import merge_streams
from framework.runtime.launch import ComponentTree, start_runtime
from framework.runtime.request_output import RequestOutput
from framework.runtime.tokenizer_manager import (
    GenerateRequest,
    PreparedRequest,
    TokenizerManager,
    gather_or_cancel,
)
from framework.sampling_params import SamplingParams

logger = logging.getLogger("framework.engine")
# One set of sampling parameters for every prompt, or a list of one set per prompt.
ParamsArg = dict[str, Any] | SamplingParams | list[dict[str, Any] | SamplingParams] | None

_WATCHER_JOIN_S = 5.0
# How long shutdown() waits for the manager to close.
_MANAGER_CLOSE_S = 10.0


class Engine:
    """Generate text or embeddings from Python: ``Engine(model_path=...).generate(prompts)``.

    Keyword arguments are ``ServerArgs`` fields. Use as a context manager, or
    call ``shutdown()`` when done. The Scheduler and the Detokenizer are
    spawned processes, so a script that makes an Engine at import time must
    do so under ``if __name__ == "__main__":``. If one of them dies, waiting
    and later calls raise ``RuntimeError`` naming it.

    ``generate`` blocks; ``async_generate`` is its awaitable twin for code
    running in an event loop. Both take ``stream=True`` to get the output as it
    is made. They are safe to call from any thread or loop: the runtime's
    TokenizerManager runs on the Engine's own loop in a background thread, and
    each call is bridged to it (see the module docstring).
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("launch_mode") == "thread":
            kwargs.setdefault("transport", "inproc")
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError("node_rank above 0 runs scheduler ranks only: start that node "
                             "with `framework serve`, and the Engine on node 0")
        # Checks the launch settings (a ValueError) before anything is made.
        self.components = ComponentTree(self.server_args)
        self.transport = self.components.transport
        self.port_args = self.components.port_args
        self._loop = EngineLoop()
        self._watcher: threading.Thread | None = None
        self.tokenizer_manager: TokenizerManager | None = None
        # An Engine never shut down is shut down at exit, before the interpreter kills the
        # loop thread (and, in thread mode, a Scheduler thread in the middle of a step).
        atexit.register(self.shutdown)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        self.tokenizer_manager = self._loop.run(start_runtime(self.components))
        self._watcher = threading.Thread(target=self._watch, name="engine-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Wait for a component to die; then fail every waiting request and stop the rest."""
        reason = self.components.wait_for_death()
        if reason is None:
            return  # shut down on purpose
        logger.error("%s; the engine stops", reason)
        self._loop.call_soon(self._on_death, reason)
        # Like the server, the runtime goes down with any of its parts: no orphans.
        self.components.stop()

    def _on_death(self, reason: str) -> None:
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.fail_all(reason)
        self._loop.fail(reason)

    # ------------------------------------------------------------------ API

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: ParamsArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list of prompts (a list back).

        Each result has ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
        ``completion_tokens``, ``cached_tokens``, ``finish_reason``, logprobs when asked).
        All prompts of one call run together in the continuous batch.
        ``sampling_params`` is one dict (or ``SamplingParams``) for every prompt, or a
        list of one per prompt. With ``n`` above 1, each choice of a prompt is its own
        request (choice ``c`` samples with ``seed + c``) and the results are a flat list,
        prompt-major, even for one prompt, as ``/generate`` answers. With
        ``return_logprob`` and ``logprob_start_len >= 0``, ``meta_info`` also has the
        prompt's logprobs from that position on (``input_token_logprobs``, and
        ``input_top_logprobs`` with ``top_logprobs_num``). Each logprob entry is a
        ``[logprob, token_id, text]`` triple, ``text`` being the token decoded alone with
        ``return_text_in_logprobs`` and ``None`` without.

        With ``stream=True`` it returns an iterator of chunks as they are made: each
        chunk's ``text`` and ``output_ids`` are the *new* text and ids (so the chunks
        concatenate to the full output), its ``meta_info`` is as of that chunk (the
        last one has the ``finish_reason``); with a list of prompts, chunks of all
        of them interleave and each has the ``index`` of its prompt (of its place in
        the flat list, with ``n`` above 1). ``lora_path`` names the LoRA adapter to run
        with (one for every prompt, or a list of one per prompt, None for the base
        model). Every value is
        checked before this returns (a ``ValueError``); leaving the iteration early
        (``break``, ``close()``) aborts the requests and frees their KV slots.
        """
        prepared, single = self._loop.run(self._prepare(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream,
            logprob_start_len, return_text_in_logprobs, lora_path))
        if stream:
            return self._loop.sync_stream(self._stream(prepared, single))
        results = self._loop.run(
            gather_or_cancel([self._manager.generate_one(p) for p in prepared]))
        return _final(results, single)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: ParamsArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` for code in an event loop: same arguments, same results, awaited.

        With ``stream=True`` the await checks every value (a ``ValueError``) and
        returns an async iterator of the same chunks as ``generate``'s stream;
        leaving it early (``break`` then ``await stream.aclose()``, or
        ``contextlib.aclosing``) aborts the requests and frees their KV slots.
        Cancelling the awaiting task aborts the requests too.
        """
        prepared, single = await self._loop.arun(self._prepare(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, stream,
            logprob_start_len, return_text_in_logprobs, lora_path))
        if stream:
            return self._loop.async_stream(self._stream(prepared, single))
        results = await self._loop.arun(
            gather_or_cancel([self._manager.generate_one(p) for p in prepared]))
        return _final(results, single)

    def encode(self, texts: str | list[str]) -> Any:
        """Embeddings (numpy float32) of one text or a list of texts.

        On a generation model it raises ``ValueError``; so does a text the runtime
        cannot embed (the Scheduler's reason in the message).
        """
        # Refused before anything is sent, as /v1/embeddings answers 400.
        self._manager.check_serves(embedding=True)
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        results = self._loop.run(gather_or_cancel([self._manager.embed(text=t) for t in items]))
        embeddings = [r.embedding for r in results]
        return embeddings[0] if single else embeddings

    def flush_cache(self) -> Any:
        """Flush the prefix cache (when idle)."""
        return self._loop.run(self._manager.flush_cache())

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto",
                                 abort_all_requests: bool = False) -> Any:
        """Load new weights of the same architecture (requests in flight go on with them,
        or end with ``abort`` with ``abort_all_requests``)."""
        return self._loop.run(self._manager.update_weights_from_disk(model_path, load_format,
                                                                abort_all_requests))

    def get_server_info(self) -> dict[str, Any]:
        """The Scheduler's state, including whether every KV slot is free when idle."""
        return self._loop.run(self._manager.get_scheduler_info())

    def shutdown(self) -> None:
        """Stop the components, close every channel and remove the channels' directory."""
        atexit.unregister(self.shutdown)
        self.components.stop()
        if self._watcher is not None:
            self._watcher.join(_WATCHER_JOIN_S)
        if self.tokenizer_manager is not None:
            self._loop.finish(self.tokenizer_manager.close(), _MANAGER_CLOSE_S)
        self._loop.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ bridging

    @property
    def _manager(self) -> TokenizerManager:
        if self.tokenizer_manager is None or not self._loop.is_open:
            raise RuntimeError("the engine is shut down")
        return self.tokenizer_manager

    # ------------------------------------------------------------------ on the Engine's loop

    async def _prepare(
        self,
        prompt: str | list[str] | None,
        sampling_params: ParamsArg,
        input_ids: list[int] | list[list[int]] | None,
        return_logprob: bool,
        top_logprobs_num: int,
        stream: bool,
        logprob_start_len: int,
        return_text_in_logprobs: bool,
        lora_path: str | list[str | None] | None = None,
    ) -> tuple[list[PreparedRequest], bool]:
        """Check and tokenize every request and choice (``n``) before any is sent (the HTTP
        layer's checks)."""
        single, requests = self._requests(prompt, input_ids, sampling_params)
        for req, adapter in zip(requests, _per_prompt(lora_path, len(requests), "lora_path"),
                                strict=True):
            req.lora_path = adapter
        for req in requests:
            req.return_logprob = return_logprob
            req.top_logprobs_num = top_logprobs_num
            req.logprob_start_len = logprob_start_len
            req.return_text_in_logprobs = return_text_in_logprobs
            req.stream = stream
        prepared = await self._manager.prepare_choices(requests)
        # As from /generate: n > 1 answers a flat list (prompt-major), even for one prompt.
        return prepared, single and len(prepared) == 1

    async def _stream(self, prepared: list[PreparedRequest], single: bool
                      ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of every request as they come; closing it aborts the unfinished ones."""
        parts = merge_streams([self._manager.generate(p) for p in prepared])
        ids_len: dict[int, int] = {}
        # Closed at once when this stream is: the parts still running are cancelled, which
        # aborts their requests.
        async with contextlib.aclosing(parts):
            async for index, out in parts:
                yield _new_part(out, ids_len.get(index, 0), None if single else index)
                ids_len[index] = len(out.output_ids)

    @staticmethod
    def _requests(
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: ParamsArg,
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
        for req, params in zip(reqs, _params_per_prompt(sampling_params, len(reqs))):
            req.sampling_params = _to_params(params)
        return single, reqs


def _per_prompt(value: Any, prompts: int, name: str) -> list[Any]:
    """``value`` as one entry per prompt: one for all, or a list of one each."""
    if not isinstance(value, (list, tuple)):
        return [value] * prompts
    if len(value) != prompts:
        raise ValueError(f"{len(value)} {name} values for {prompts} prompts")
    return list(value)


def _params_per_prompt(sampling_params: Any, prompts: int) -> list[Any]:
    """``sampling_params`` as one entry per prompt: one set for all, or a list of one each."""
    if sampling_params is None or isinstance(sampling_params, (dict, SamplingParams)):
        return [sampling_params] * prompts
    # Only a list or tuple is a list of sets: a string or a mapping-like value is a mistake.
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(f"sampling_params must be a dict, a SamplingParams or a list of "
                         f"them (one per prompt), got {type(sampling_params).__name__}")
    if len(sampling_params) != prompts:
        raise ValueError(f"{len(sampling_params)} sampling_params for {prompts} prompts")
    return list(sampling_params)


def _to_params(params: Any) -> SamplingParams:
    """One prompt's ``SamplingParams`` from a dict, a ``SamplingParams`` or None (defaults)."""
    if isinstance(params, SamplingParams):
        return params
    if params is None or isinstance(params, dict):
        return SamplingParams.from_dict(params)
    raise ValueError(f"each sampling_params entry must be a dict or a SamplingParams, "
                     f"got {type(params).__name__}")


def _final(results: list[RequestOutput], single: bool) -> dict[str, Any] | list[dict[str, Any]]:
    """The non-streaming outputs, as SGLang's dicts."""
    outputs = [r.to_dict() for r in results]
    return outputs[0] if single else outputs


def _new_part(out: RequestOutput, ids_before: int, index: int | None) -> dict[str, Any]:
    """A stream chunk from the manager's output: only what is new since the last one."""
    chunk = {"text": out.delta, "output_ids": out.output_ids[ids_before:],
             "meta_info": out.meta_info}
    if index is not None:
        chunk["index"] = index
    return chunk
