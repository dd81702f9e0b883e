"""SGLang's native routes: ``/generate``, ``/tokenize``, ``/detokenize``, ``/get_model_info``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from framework.runtime.fan_out import merge_streams
from framework.runtime.tokenizer_manager import GenerateRequest, RequestError
from framework.sampling_params import SamplingParams, check_token_ids
from framework.server import openai as oai
from framework.server.request_body import parse_body
from framework.server.responses import JSONResponse
from framework.server.routes.base import RouteBase
from framework.server.sse import sse_response


class NativeRoutes(RouteBase):
    """SGLang's native generation, and the tokenizer and model facts it serves."""

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: the token ids the server would see for a text prompt."""
        body = await parse_body(request, oai.TokenizeBody)
        tokens = await self.tm.tokenize(body.the_text())
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": self.state.model.context_len})

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: the text of token ids, each checked against the vocabulary."""
        body = await parse_body(request, oai.DetokenizeBody)
        check_token_ids(body.tokens, self.state.model.vocab_size, "tokens")
        # Decoding is fast, but a long list is still kept off the event loop.
        if len(body.tokens) > 4096:
            text = await asyncio.to_thread(self.tm.tokenizer.decode, body.tokens)
        else:
            text = self.tm.tokenizer.decode(body.tokens)
        return JSONResponse({"text": text})

    async def generate(self, request: Request) -> Response:
        """``POST /generate``: SGLang's native generation, one prompt or a batch."""
        body = await parse_body(request, oai.GenerateRequestBody)
        body.check_unsupported()
        self._check_generation()
        if body.text is not None and body.input_ids is not None:
            raise RequestError("give either text or input_ids, not both")
        if body.text is None and body.input_ids is None:
            raise RequestError("give text or input_ids")
        batched = isinstance(body.text, list) or (
            bool(body.input_ids) and isinstance(body.input_ids[0], list))
        if body.text is not None:
            prompts = oai.split_prompts(body.text, "text")
        else:
            prompts = oai.split_prompts(body.input_ids or [], "input_ids",
                                        self.state.model.vocab_size)
        # Every value is checked by the TokenizerManager, before any part is sent.
        params = [SamplingParams.from_dict(p) for p in
                  body.per_prompt("sampling_params", len(prompts))]
        # As in SGLang, a batch or n > 1 answers a flat list, prompt-major.
        as_list = batched or any(each.n > 1 for each in params)
        # A rid names one request: a single one is kept for a single request, one per
        # prompt for each prompt without choices (n = 1).
        if isinstance(body.rid, list):
            rids = body.per_prompt("rid", len(prompts))
        else:
            rids = [None if as_list else body.rid] * len(prompts)
        # Every prompt and choice is checked before any is sent: one bad part refuses all.
        reqs = await self.tm.prepare_choices([GenerateRequest(
            text=text, input_ids=ids, sampling_params=each, stream=body.stream,
            return_logprob=logprob, top_logprobs_num=top, logprob_start_len=start,
            return_text_in_logprobs=body.return_text_in_logprobs,
            rid=rid if each.n == 1 else None, lora_path=lora,
        ) for (text, ids), each, logprob, top, start, rid, lora in zip(
            prompts, params, body.per_prompt("return_logprob", len(prompts)),
            body.per_prompt("top_logprobs_num", len(prompts)),
            body.per_prompt("logprob_start_len", len(prompts)), rids,
            body.per_prompt("lora_path", len(prompts)), strict=True)])
        if body.stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                async for i, out in merge_streams([self._generate(r) for r in reqs]):
                    yield {**out.to_dict(), "index": i}
            return sse_response(events())
        outputs = [o.to_dict() for o in await self._first_outputs(request, reqs)]
        return JSONResponse(outputs if as_list else outputs[0])

    async def get_model_info(self, request: Request) -> Response:
        """``GET /get_model_info``: the served model's path, name and kind."""
        return JSONResponse({
            "model_path": self.state.model_path,
            "tokenizer_path": self.state.server_args.tokenizer_path or self.state.model_path,
            "is_generation": not self.state.model.is_embedding,
            "served_model_name": self.state.model_name,
            "context_length": self.state.model.context_len,
        })

