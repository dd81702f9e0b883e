"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings`` and ``/v1/models``."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from framework.registry import REASONING_PARSERS
from framework.runtime.fan_out import merge_streams
from framework.runtime.incremental_decoder import DecodeFn
from framework.runtime.request_output import RequestOutput
from framework.runtime.tokenizer_manager import PreparedRequest, RequestError, gather_or_cancel
from framework.sampling_params import FieldError, SamplingParams
from framework.server import openai as oai
from framework.server import openai_responses as oai_out
from framework.server.chat_output import ChoiceOutput
from framework.server.chat_tools import (
    ChatTools,
    constrain,
    keep_markers,
    reasoning_markers,
    template_kwargs,
    thinking_on,
)
from framework.server.disconnect import unless_client_leaves
from framework.server.handler import current_route
from framework.server.request_body import parse_body
from framework.server.responses import JSONResponse
from framework.server.routes.base import RouteBase
from framework.server.sse import sse_response
from framework.server.state import ServerState
from framework.server.token_text import TextOffsets, TokenText

logger = logging.getLogger("framework.server")


class OpenAIRoutes(RouteBase):
    """OpenAI's completions, chat completions, embeddings and models."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self._token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        """The tokens' bytes and strings of logprobs answers (read on first use)."""
        if self._token_text is None:
            self._token_text = TokenText(self.tm.tokenizer)
        return self._token_text

    def _decode_fn(self, params: SamplingParams) -> DecodeFn:
        """The decode of an output with ``params``, as the Detokenizer does it."""
        return self.token_text.decode_fn(params.skip_special_tokens,
                                         params.spaces_between_special_tokens)

    def _output_offsets(self, prepared: PreparedRequest, start: int) -> TextOffsets:
        """Offsets of an output's tokens in a text where the output starts at ``start``."""
        return TextOffsets(self._decode_fn(prepared.req.sampling_params),
                           prepared.decode_context, start)

    def _prompt_offsets(self, prepared: PreparedRequest) -> TextOffsets:
        """Offsets of a prompt's tokens in its echo (see ``_prompt_text``)."""
        return TextOffsets(self._echo_decode_fn(prepared))

    def _echo_decode_fn(self, prepared: PreparedRequest) -> DecodeFn:
        # A text prompt is echoed as given: the special tokens the tokenizer added are not
        # in it. Token ids are echoed decoded, special tokens included.
        return self.token_text.decode_fn(skip_special_tokens=prepared.req.text is not None)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: OpenAI's legacy completions, streamed or not."""
        body = await parse_body(request, oai.CompletionRequest)
        adapter = self._check_model(body.model)
        body.check_unsupported()
        body.check_stream_options()
        self._check_generation()
        field, max_tokens = body.requested_max_tokens()
        params = body.sampling_params(max_tokens, 16, field)
        prompts = oai.split_prompts(body.prompt, "prompt", self.state.model.vocab_size)
        with body.naming_fields(field):
            reqs = await self._prepare_all(prompts, params, body.stream,
                                           body.top_logprobs_num(), prompt_logprobs=body.echo,
                                           lora_path=adapter)
        self._check_context(reqs, field, max_tokens)
        prefix = [self._prompt_text(r) for r in reqs[::params.n]] if body.echo else None
        if body.stream:
            return self._stream_completions(body, reqs, prefix, params.n)
        outputs = await self._first_outputs(request, reqs)
        choices = []
        for i, out in enumerate(outputs):
            meta = out.meta_info
            echoed = prefix[i // params.n] if prefix else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = oai_out.completion_logprobs(
                    meta, self.token_text, self._output_offsets(reqs[i], len(echoed)), 0)
                if prefix:
                    logprobs = oai_out.join_logprobs(oai_out.prompt_logprobs(
                        meta, self.token_text, self._prompt_offsets(reqs[i])), logprobs)
            choices.append({
                "index": i, "text": echoed + out.text, "logprobs": logprobs,
                "finish_reason": oai_out.finish_reason_name(meta),
            })
        return JSONResponse({
            "id": oai_out.new_id("cmpl"), "object": "text_completion", "created": oai_out.now(),
            "model": self.state.model_name, "choices": choices,
            "usage": self._usage(outputs, params.n),
        })

    def _prompt_text(self, prepared: PreparedRequest) -> str:
        """The prompt as ``echo`` shows it: its text, or its token ids decoded."""
        req = prepared.req
        return req.text if req.text is not None else self._echo_decode_fn(prepared)(
            prepared.input_ids)

    def _usage(self, outputs: list[RequestOutput], n: int) -> dict[str, Any]:
        metas = [o.meta_info for o in outputs]
        prompt = sum(m["prompt_tokens"] for m in metas[::n])
        completion = sum(m["completion_tokens"] for m in metas)
        cached = sum(m["cached_tokens"] for m in metas[::n])
        return oai_out.usage(prompt, completion, cached)

    def _stream_completions(self, body: oai.CompletionRequest, reqs: list[PreparedRequest],
                            prefix: list[str] | None, n: int) -> Response:
        chunks = oai_out.StreamChunks(oai_out.new_id("cmpl"), "text_completion",
                                      self.state.model_name, body.include_usage)

        def chunk(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
            return chunks.choice({"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": finish})

        # With logprobs, a choice's echo waits for its first output, which brings the
        # prompt's logprobs; without, every echo goes out at once.
        echo_at_once = bool(prefix) and body.logprobs is None

        async def events() -> AsyncIterator[dict[str, Any]]:
            last: dict[int, RequestOutput] = {}
            sent_tokens: dict[int, int] = {}
            offsets: dict[int, TextOffsets] = {}
            for i in range(len(reqs)):
                if prefix and echo_at_once:
                    yield chunk(i, prefix[i // n], None, None)
            async for i, out in merge_streams([self._generate(r) for r in reqs]):
                meta = out.meta_info
                if i not in offsets:
                    echoed = prefix[i // n] if prefix else ""
                    offsets[i] = self._output_offsets(reqs[i], len(echoed))
                    if prefix and not echo_at_once:
                        yield chunk(i, echoed, oai_out.prompt_logprobs(
                            meta, self.token_text, self._prompt_offsets(reqs[i])), None)
                logprobs = oai_out.completion_logprobs(meta, self.token_text, offsets[i],
                                                       sent_tokens.get(i, 0))
                sent_tokens[i] = meta["completion_tokens"]
                last[i] = out
                yield chunk(i, out.delta, logprobs, oai_out.finish_reason_name(meta))
            if chunks.include_usage:
                yield chunks.usage(self._usage([last[i] for i in sorted(last)], n))

        return sse_response(events())

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: a chat, rendered by the model's template."""
        body = await parse_body(request, oai.ChatCompletionRequest)
        self._check_model(body.model)
        body.check_unsupported()
        body.check_stream_options()
        self._check_generation()
        reqs, shapes = await self._chat_requests(body)
        if body.stream:
            return self._stream_chat(body, reqs, shapes)
        outputs = await self._first_outputs(request, reqs)
        decode = self._decode_fn(reqs[0].req.sampling_params)
        choices = [{
            "index": i,
            "message": shapes[i].message(out.text),
            "logprobs": oai_out.chat_logprobs(out.meta_info, self.token_text, decode, 0),
            "finish_reason": shapes[i].finish_reason(oai_out.finish_reason_name(out.meta_info)),
        } for i, out in enumerate(outputs)]
        return JSONResponse({
            "id": oai_out.new_id("chatcmpl"), "object": "chat.completion", "created": oai_out.now(),
            "model": self.state.model_name, "choices": choices,
            "usage": self._usage(outputs, len(outputs)),
        })

    async def _chat_requests(self, body: oai.ChatCompletionRequest
                             ) -> tuple[list[PreparedRequest], list[ChoiceOutput]]:
        """A chat's prepared requests (one per choice: its template rendered with the tools,
        its constraint set) and the shaper of each choice's answer."""
        tools = ChatTools.of(body.tools, body.tool_choice, bool(body.parallel_tool_calls),
                             self.state.server_args.tool_call_parser)
        kwargs = template_kwargs(body.chat_template_kwargs)
        prompt = await self.tm.chat_prompt_ids(oai.chat_conversation(body.messages),
                                               tools.template_tools, kwargs)
        field, max_tokens = body.requested_max_tokens()
        params = body.sampling_params(max_tokens, self.state.model.context_len, field)
        thinking = thinking_on(kwargs)
        reasoning = self.state.server_args.reasoning_parser if thinking else None
        constrain(params, tools, reasoning, body.response_format is not None)
        keep_markers(params, tools.markers + reasoning_markers(reasoning), self.tm.tokenizer)
        with body.naming_fields(field):
            reqs = await self._prepare_all([(None, prompt)], params, body.stream,
                                           body.top_logprobs_num(),
                                           lora_path=self._check_model(body.model))
        self._check_context(reqs, field, max_tokens)
        return reqs, [self._choice_output(tools, thinking) for _ in reqs]

    def _choice_output(self, tools: ChatTools, thinking: bool) -> ChoiceOutput:
        """The shaper of one choice's answer, with fresh parsers for its output."""
        name = self.state.server_args.reasoning_parser
        reasoning = REASONING_PARSERS.get(name)(thinking) if name is not None else None
        return ChoiceOutput(reasoning, tools.new_parser())

    def _stream_chat(self, body: oai.ChatCompletionRequest, reqs: list[PreparedRequest],
                     shapes: list[ChoiceOutput]) -> Response:
        n = len(reqs)  # one prompt: each request is one of its choices
        chunks = oai_out.StreamChunks(oai_out.new_id("chatcmpl"), "chat.completion.chunk",
                                      self.state.model_name, body.include_usage)
        decode = self._decode_fn(reqs[0].req.sampling_params)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any,
                  finish: str | None) -> dict[str, Any]:
            return chunks.choice({"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish})

        async def events() -> AsyncIterator[dict[str, Any]]:
            last: dict[int, RequestOutput] = {}
            sent_tokens: dict[int, int] = {}
            for i in range(len(reqs)):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for i, out in merge_streams([self._generate(r) for r in reqs]):
                meta = out.meta_info
                logprobs = oai_out.chat_logprobs(meta, self.token_text, decode,
                                                 sent_tokens.get(i, 0))
                sent_tokens[i] = meta["completion_tokens"]
                last[i] = out
                finish = oai_out.finish_reason_name(meta)
                yield chunk(i, shapes[i].feed(out.delta, final=finish is not None), logprobs,
                            shapes[i].finish_reason(finish))
            if chunks.include_usage:
                yield chunks.usage(self._usage([last[i] for i in sorted(last)], n))

        return sse_response(events())

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: one embedding per input (embedding models only)."""
        body = await parse_body(request, oai.EmbeddingRequest)
        self._check_model(body.model)
        if not self.state.model.is_embedding:
            raise RequestError("this model is a generation model; it does not serve embeddings")
        if body.encoding_format not in ("float", "base64"):
            raise FieldError("encoding_format", "encoding_format must be 'float' or "
                                 f"'base64', got {body.encoding_format!r}")
        size = self.state.model.hidden_size
        if body.dimensions is not None and body.dimensions != size:
            raise FieldError("dimensions", f"dimensions must be this model's embedding "
                                 f"size, {size}, or left out (embeddings are not shortened), "
                                 f"got {body.dimensions}")
        items = oai.split_prompts(body.input, "input", self.state.model.vocab_size)
        if any(text == "" for text, _ in items):
            # As OpenAI's API: an empty text has no embedding (a tokenizer would still
            # give its special tokens one).
            raise FieldError("input", "input must not hold an empty string")
        results = await unless_client_leaves(request, gather_or_cancel(
            [self.tm.embed(text=t, input_ids=ids) for t, ids in items]))
        data = []
        for i, res in enumerate(results):
            vector = np.asarray(res.embedding, dtype=np.float32)
            value: Any = (base64.b64encode(vector.tobytes()).decode()
                          if body.encoding_format == "base64" else vector.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        if self.state.server_args.log_requests:
            for res in results:
                logger.info("request %s %s: prompt_tokens=%d, embedded", res.meta_info["id"],
                            current_route.get(), res.meta_info["prompt_tokens"])
        prompt_tokens = sum(r.meta_info["prompt_tokens"] for r in results)
        return JSONResponse({
            "object": "list", "data": data, "model": self.state.model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.model_name, "object": "model", "created": self.state.created,
            "owned_by": "framework", "root": self.state.model_path,
            "max_model_len": self.state.model.context_len,
        }

    def _adapter_card(self, name: str) -> dict[str, Any]:
        """A LoRA adapter's entry, its ``parent`` the base model (as vLLM lists them)."""
        return {"id": name, "object": "model", "created": self.state.created,
                "owned_by": "framework", "root": name, "parent": self.state.model_name,
                "max_model_len": self.state.model.context_len}

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the served model, then its LoRA adapters."""
        return JSONResponse({"object": "list", "data": [self._model_card()] + [
            self._adapter_card(name) for name in sorted(self.tm.lora_names)]})

    async def retrieve_model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the served model or one of its adapters, or 404."""
        adapter = self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card() if adapter is None
                            else self._adapter_card(adapter))
