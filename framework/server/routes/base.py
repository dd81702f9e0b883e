"""``RouteBase``: what the route families share, bound to one ``ServerState``.

The runtime front, the checks every generation route makes (the model asked for, the
model's kind, ``max_tokens`` against the context), and running checked requests, logged
with --log-requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request

from framework.runtime.request_output import RequestOutput
from framework.runtime.tokenizer_manager import (
    GenerateRequest,
    PreparedRequest,
    RequestError,
    gather_or_cancel,
)
from framework.sampling_params import SamplingParams
from framework.server.disconnect import unless_client_leaves
from framework.server.handler import current_route
from framework.server.responses import ApiError
from framework.server.state import ServerState

logger = logging.getLogger("framework.server")
_json = msgspec.json.Encoder()


class RouteBase:
    """The base of each family of route handlers: the state and the generation helpers."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tm = state.tokenizer_manager

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (``<adapter>`` or ``<served-model>:<adapter>``),
        None for the base model; 404 ``model_not_found`` (as OpenAI answers) for a model
        this server does not serve."""
        if model is None or model in (self.state.model_name, self.state.model_path):
            return None
        adapter = model.removeprefix(f"{self.state.model_name}:")
        if adapter in self.tm.lora_names:
            return adapter
        raise ApiError(f"The model `{model}` does not exist; this server serves "
                       f"`{self.state.model_name}`", 404, "model_not_found", "model")

    def _check_generation(self) -> None:
        if self.state.model.is_embedding:
            raise RequestError("this model is an embedding model; use /v1/embeddings")

    async def _prepare_all(self, prompts: list[tuple[str | None, list[int] | None]],
                           params: SamplingParams, stream: bool, logprobs: int | None,
                           prompt_logprobs: bool = False,
                           lora_path: str | None = None) -> list[PreparedRequest]:
        """One checked request per prompt and choice (``n``) of an OpenAI route.

        Every value is checked here, once for the whole API request (the prompts share
        ``params``). With ``prompt_logprobs`` (and ``logprobs``), the prompt's logprobs
        come back too. ``lora_path``: the LoRA adapter every prompt runs with.
        """
        return await self.tm.prepare_choices([GenerateRequest(
            text=text, input_ids=ids, sampling_params=params, stream=stream,
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            logprob_start_len=0 if prompt_logprobs and logprobs is not None else -1,
            lora_path=lora_path,
        ) for text, ids in prompts])

    def _check_context(self, reqs: list[PreparedRequest], field: str,
                       max_tokens: int | None) -> None:
        """Refuse (400 ``context_length_exceeded``) a ``max_tokens`` given as ``field`` that
        does not fit in the context after a prompt, as vLLM and SGLang do.

        Left unset, it is cut to what fits instead (by the Scheduler).
        """
        if max_tokens is None:
            return
        context = self.state.model.context_len
        for prepared in reqs:
            prompt = len(prepared.input_ids)
            if prompt + max_tokens > context:
                raise ApiError(
                    f"this model's context length is {context} tokens, but the prompt has "
                    f"{prompt} tokens and {field} asks for {max_tokens} more "
                    f"({prompt + max_tokens} in all); ask for at most {context - prompt}",
                    400, "context_length_exceeded", field)

    async def _first_outputs(self, request: Request, reqs: list[PreparedRequest]
                             ) -> list[RequestOutput]:
        """Run every (checked) part to completion; one that fails cancels the others, and
        so does the client leaving."""
        return await unless_client_leaves(
            request, gather_or_cancel([self._generate_one(r) for r in reqs]))

    def _generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """``TokenizerManager.generate``, logged when --log-requests is on."""
        if not self.state.server_args.log_requests:
            return self.tm.generate(prepared)
        return self._logged_generate(prepared)

    async def _generate_one(self, prepared: PreparedRequest) -> RequestOutput:
        """The final output of one request (``TokenizerManager.generate_one``, logged)."""
        if not self.state.server_args.log_requests:
            return await self.tm.generate_one(prepared)
        prepared.req.stream = False
        async with contextlib.aclosing(self._generate(prepared)) as outputs:
            async for out in outputs:
                return out
        raise RuntimeError("generation ended without an output")

    async def _logged_generate(self, prepared: PreparedRequest
                               ) -> AsyncIterator[RequestOutput]:
        """Log a request's start and its finish around ``TokenizerManager.generate``.

        The prompt's text is not logged: it may be long and private; its length is.
        """
        req, rid = prepared.req, prepared.rid
        logger.info("request %s %s: prompt_tokens=%d stream=%s sampling_params=%s", rid,
                    current_route.get(), len(prepared.input_ids), req.stream,
                    _json.encode(req.sampling_params).decode())
        finished = False
        try:
            async for out in self.tm.generate(prepared):
                meta = out.meta_info
                if meta["finish_reason"] is not None:
                    finished = True
                    logger.info("request %s finished: reason=%s prompt_tokens=%d "
                                "completion_tokens=%d cached_tokens=%d", rid,
                                _json.encode(meta["finish_reason"]).decode(),
                                meta["prompt_tokens"], meta["completion_tokens"],
                                meta["cached_tokens"])
                yield out
        finally:
            if not finished:
                logger.info("request %s ended unfinished (its client went away, or a part "
                            "of the same API request failed)", rid)
