"""The Starlette app: OpenAI-compatible and SGLang-native routes over the TokenizerManager."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from framework.config import ServerArgs
from framework.messages import AbortReq
from framework.runtime.incremental_decoder import DecodeFn
from framework.runtime.request import CONTEXT_IDS
from framework.runtime.tokenizer_manager import (
    GenerateRequest,
    OverloadedError,
    PreparedRequest,
    RequestError,
    TokenizerManager,
    gather_or_cancel,
)
from framework.sampling_params import FieldError, SamplingParams, check_token_ids
from framework.server import openai as oai
from framework.server.openapi_schema import RouteSpec, build_openapi
from framework.server.sse import error_body, sse_event, sse_stream
from framework.server.token_text import TextOffsets, TokenText

logger = logging.getLogger("framework.server")

S = TypeVar("S", bound=msgspec.Struct)
T = TypeVar("T")
_json = msgspec.json.Encoder()


@dataclass
class ServerState:
    """What the routes need: the runtime front and facts about the model."""

    tokenizer_manager: TokenizerManager
    server_args: ServerArgs
    model_name: str
    model_path: str
    context_len: int
    is_embedding: bool
    #: The length of the model's embeddings (its hidden size).
    embedding_size: int | None = None
    #: The model's ``created`` time in /v1/models: when the server started.
    created: int = dataclasses.field(default_factory=oai.now)


class JSONResponse(Response):
    """A JSON response encoded by msgspec (numpy arrays already converted)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)


def error_response(message: str, status: int = 400, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body with ``status``; ``code`` replaces the numeric code."""
    body = error_body(message, status, param)
    if code is not None:
        body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


class ApiError(Exception):
    """An error answered with its own status and OpenAI ``code`` (404 model_not_found, ...)."""

    def __init__(self, message: str, status: int, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


# Paths open without the API key: probes of load balancers and Prometheus scrapers, and the
# API's description (it holds no secret, and client generators fetch it before any key).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/openapi.json"})


class ApiKeyMiddleware:
    """Answer 401 unless a request carries ``Authorization: Bearer <api key>``.

    Plain ASGI (not ``BaseHTTPMiddleware``) so that SSE responses pass through
    untouched; it guards every route, also ones added to the table later.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(
            "Incorrect API key provided. Send it as `Authorization: Bearer <key>`.",
            401, code="invalid_api_key")
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # Constant time, so that the answer's timing does not reveal how much matched.
        return hmac.compare_digest(given, self.expected)


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 once it passes ``--max-request-bytes``.

    A declared ``Content-Length`` past the limit is refused before anything is read;
    a body sent in chunks is read only up to the limit.
    """
    limit = request.app.state.server.server_args.max_request_bytes
    too_large = ApiError(f"the request body is larger than the {limit} bytes this server "
                         f"accepts", 413, "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _invalid_field(message: str) -> str | None:
    """The field a msgspec validation message names (``... - at `$.messages[0].role```,
    ``Object missing required field `prompt```), as OpenAI's ``param`` gives it."""
    at = re.search(r" - at `\$\.?([^`]*)`$", message)
    path = at.group(1) if at else ""
    named = re.search(r"(?:missing required|unknown) field `([^`]+)`", message)
    if named:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


async def parse_body(request: Request, schema: type[S]) -> S:
    """Decode and validate the JSON body; a bad body is a ``RequestError`` (400)."""
    body = await read_body(request)
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}", param=_invalid_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}") from None


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


Handler = Callable[[Request], Awaitable[Response]]
_route: ContextVar[str] = ContextVar("route", default="?")


@dataclasses.dataclass
class StreamChunks:
    """The chunks of one streamed OpenAI answer: one id, object and creation time for all."""

    id: str
    object: str  # "text_completion" or "chat.completion.chunk"
    model: str
    include_usage: bool  # stream_options.include_usage: the last chunk carries usage
    created: int = dataclasses.field(default_factory=oai.now)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices}

    def choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk with one choice's news; with ``include_usage``, ``usage`` is null on it."""
        out = self._chunk([choice])
        if self.include_usage:
            out["usage"] = None
        return out

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of an ``include_usage`` stream: no choices, the request's usage."""
        return {**self._chunk([]), "usage": usage}


def _handler(fn: Handler) -> Handler:
    """Turn bad input into 400s and a dead runtime into 503s, with OpenAI's error body."""

    async def wrapped(request: Request) -> Response:
        # Read by --log-requests; streams run in a copy of this context, so they see it too.
        _route.set(request.url.path)
        try:
            return await fn(request)
        except ClientGone:
            # Nobody reads it: 499 (client closed request) marks it in access logs.
            return Response(status_code=499)
        except ApiError as exc:
            return error_response(str(exc), exc.status, exc.param, exc.code)
        except (RequestError, ValueError) as exc:
            return error_response(str(exc), 400, getattr(exc, "param", None),
                                  getattr(exc, "code", None))
        except OverloadedError as exc:
            response = error_response(str(exc), 503, code="overloaded")
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
        except RuntimeError as exc:
            logger.exception("request failed")
            return error_response(str(exc), 503)
        except Exception as exc:
            logger.exception("request failed")
            return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    wrapped.__name__ = fn.__name__
    return wrapped


def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
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


class Routes:
    """The route handlers, bound to one ``ServerState``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tm = state.tokenizer_manager
        # Set by ``build_app`` once the route table is known.
        self.openapi_doc: dict[str, Any] = {}
        self._token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        """The tokens' bytes and strings of logprobs answers (read on first use)."""
        if self._token_text is None:
            self._token_text = TokenText(self.tm.tokenizer)
        return self._token_text

    # ------------------------------------------------------------------ helpers

    async def _prepare_all(self, prompts: list[tuple[str | None, list[int] | None]],
                           params: SamplingParams, stream: bool, logprobs: int | None,
                           prompt_logprobs: bool = False) -> list[PreparedRequest]:
        """One checked request per prompt and choice (``n``) of an OpenAI route.

        Every value is checked here, once for the whole API request (the prompts share
        ``params``). With ``prompt_logprobs`` (and ``logprobs``), the prompt's logprobs
        come back too.
        """
        return await self.tm.prepare_choices([GenerateRequest(
            text=text, input_ids=ids, sampling_params=params, stream=stream,
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            logprob_start_len=0 if prompt_logprobs and logprobs is not None else -1,
        ) for text, ids in prompts])

    def _check_model(self, model: str | None) -> None:
        """404 ``model_not_found`` (as OpenAI answers) for a model this server does not serve."""
        if model is not None and model not in (self.state.model_name, self.state.model_path):
            raise ApiError(f"The model `{model}` does not exist; this server serves "
                           f"`{self.state.model_name}`", 404, "model_not_found", "model")

    def _check_context(self, reqs: list[PreparedRequest], field: str,
                       max_tokens: int | None) -> None:
        """Refuse (400 ``context_length_exceeded``) a ``max_tokens`` given as ``field`` that
        does not fit in the context after a prompt, as vLLM and SGLang do.

        Left unset, it is cut to what fits instead (by the Scheduler).
        """
        if max_tokens is None:
            return
        context = self.state.context_len
        for prepared in reqs:
            prompt = len(prepared.input_ids)
            if prompt + max_tokens > context:
                raise ApiError(
                    f"this model's context length is {context} tokens, but the prompt has "
                    f"{prompt} tokens and {field} asks for {max_tokens} more "
                    f"({prompt + max_tokens} in all); ask for at most {context - prompt}",
                    400, "context_length_exceeded", field)

    def _decode_fn(self, params: SamplingParams) -> DecodeFn:
        """The decode of an output with ``params``, as the Detokenizer does it."""
        return self.token_text.decode_fn(params.skip_special_tokens,
                                         params.spaces_between_special_tokens)

    def _output_offsets(self, prepared: PreparedRequest, start: int) -> TextOffsets:
        """Offsets of an output's tokens in a text where the output starts at ``start``."""
        return TextOffsets(self._decode_fn(prepared.req.sampling_params),
                           prepared.input_ids[-CONTEXT_IDS:], start)

    def _prompt_offsets(self, prepared: PreparedRequest) -> TextOffsets:
        """Offsets of a prompt's tokens in its echo (see ``_prompt_text``)."""
        return TextOffsets(self._echo_decode_fn(prepared))

    def _echo_decode_fn(self, prepared: PreparedRequest) -> DecodeFn:
        # A text prompt is echoed as given: the special tokens the tokenizer added are not
        # in it. Token ids are echoed decoded, special tokens included.
        return self.token_text.decode_fn(skip_special_tokens=prepared.req.text is not None)

    def _check_generation(self) -> None:
        if self.state.is_embedding:
            raise RequestError("this model is an embedding model; use /v1/embeddings")

    async def _first_outputs(self, request: Request, reqs: list[PreparedRequest]
                             ) -> list[dict[str, Any]]:
        """Run every (checked) part to completion; one that fails cancels the others, and
        so does the client leaving."""
        return await unless_client_leaves(
            request, gather_or_cancel([self._generate_one(r) for r in reqs]))

    def _generate(self, prepared: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """``TokenizerManager.generate``, logged when --log-requests is on."""
        if not self.state.server_args.log_requests:
            return self.tm.generate(prepared)
        return self._logged_generate(prepared)

    async def _generate_one(self, prepared: PreparedRequest) -> dict[str, Any]:
        """The final output of one request (``TokenizerManager.generate_one``, logged)."""
        if not self.state.server_args.log_requests:
            return await self.tm.generate_one(prepared)
        prepared.req.stream = False
        async with contextlib.aclosing(self._generate(prepared)) as outputs:
            async for out in outputs:
                return out
        raise RuntimeError("generation ended without an output")

    async def _logged_generate(self, prepared: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """Log a request's start and its finish around ``TokenizerManager.generate``.

        The prompt's text is not logged: it may be long and private; its length is.
        """
        req = prepared.req
        # The id is chosen here, not in the TokenizerManager, so that the first line has it.
        req.rid = req.rid or uuid.uuid4().hex
        logger.info("request %s %s: prompt_tokens=%d stream=%s sampling_params=%s", req.rid,
                    _route.get(), len(prepared.input_ids), req.stream,
                    _json.encode(req.sampling_params).decode())
        finished = False
        try:
            async for out in self.tm.generate(prepared):
                meta = out["meta_info"]
                if meta["finish_reason"] is not None:
                    finished = True
                    logger.info("request %s finished: reason=%s prompt_tokens=%d "
                                "completion_tokens=%d cached_tokens=%d", req.rid,
                                _json.encode(meta["finish_reason"]).decode(),
                                meta["prompt_tokens"], meta["completion_tokens"],
                                meta["cached_tokens"])
                yield out
        finally:
            if not finished:
                logger.info("request %s ended unfinished (its client went away, or a part "
                            "of the same API request failed)", req.rid)

    # ------------------------------------------------------------------ OpenAI

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, oai.CompletionRequest)
        self._check_model(body.model)
        body.check_unsupported()
        body.check_stream_options()
        self._check_generation()
        field, max_tokens = body.requested_max_tokens()
        params = body.sampling_params(max_tokens, 16, field)
        prompts = oai.split_prompts(body.prompt, "prompt", self.tm.vocab_size)
        with body.naming_fields(field):
            reqs = await self._prepare_all(prompts, params, body.stream,
                                           body.top_logprobs_num(), prompt_logprobs=body.echo)
        self._check_context(reqs, field, max_tokens)
        prefix = [self._prompt_text(r) for r in reqs[::params.n]] if body.echo else None
        if body.stream:
            return self._stream_completions(body, reqs, prefix, params.n)
        outputs = await self._first_outputs(request, reqs)
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            echoed = prefix[i // params.n] if prefix else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = oai.completion_logprobs(
                    meta, self.token_text, self._output_offsets(reqs[i], len(echoed)), 0)
                if prefix:
                    logprobs = oai.join_logprobs(oai.prompt_logprobs(
                        meta, self.token_text, self._prompt_offsets(reqs[i])), logprobs)
            choices.append({
                "index": i, "text": echoed + out["text"], "logprobs": logprobs,
                "finish_reason": oai.finish_reason_name(meta),
            })
        return JSONResponse({
            "id": oai.new_id("cmpl"), "object": "text_completion", "created": oai.now(),
            "model": self.state.model_name, "choices": choices,
            "usage": self._usage(outputs, params.n),
        })

    def _prompt_text(self, prepared: PreparedRequest) -> str:
        """The prompt as ``echo`` shows it: its text, or its token ids decoded."""
        req = prepared.req
        return req.text if req.text is not None else self._echo_decode_fn(prepared)(
            prepared.input_ids)

    def _usage(self, outputs: list[dict[str, Any]], n: int) -> dict[str, Any]:
        metas = [o["meta_info"] for o in outputs]
        prompt = sum(m["prompt_tokens"] for m in metas[::n])
        completion = sum(m["completion_tokens"] for m in metas)
        cached = sum(m["cached_tokens"] for m in metas[::n])
        return oai.usage(prompt, completion, cached)

    def _stream_completions(self, body: oai.CompletionRequest, reqs: list[PreparedRequest],
                            prefix: list[str] | None, n: int) -> Response:
        chunks = StreamChunks(oai.new_id("cmpl"), "text_completion", self.state.model_name,
                              body.include_usage)

        def chunk(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
            return chunks.choice({"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": finish})

        # With logprobs, a choice's echo waits for its first output, which brings the
        # prompt's logprobs; without, every echo goes out at once.
        echo_at_once = bool(prefix) and body.logprobs is None

        async def events() -> AsyncIterator[dict[str, Any]]:
            last: dict[int, dict[str, Any]] = {}
            sent_tokens: dict[int, int] = {}
            offsets: dict[int, TextOffsets] = {}
            for i in range(len(reqs)):
                if prefix and echo_at_once:
                    yield chunk(i, prefix[i // n], None, None)
            async for i, out in _merge([self._generate(r) for r in reqs]):
                meta = out["meta_info"]
                if i not in offsets:
                    echoed = prefix[i // n] if prefix else ""
                    offsets[i] = self._output_offsets(reqs[i], len(echoed))
                    if prefix and not echo_at_once:
                        yield chunk(i, echoed, oai.prompt_logprobs(
                            meta, self.token_text, self._prompt_offsets(reqs[i])), None)
                logprobs = oai.completion_logprobs(meta, self.token_text, offsets[i],
                                                   sent_tokens.get(i, 0))
                sent_tokens[i] = meta["completion_tokens"]
                last[i] = out
                yield chunk(i, out["delta"], logprobs, oai.finish_reason_name(meta))
            if chunks.include_usage:
                yield chunks.usage(self._usage([last[i] for i in sorted(last)], n))

        return self._sse(events())

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, oai.ChatCompletionRequest)
        self._check_model(body.model)
        body.check_unsupported()
        body.check_stream_options()
        self._check_generation()
        prompt = await self.tm.chat_prompt_ids(oai.chat_conversation(body.messages))
        field, max_tokens = body.requested_max_tokens()
        params = body.sampling_params(max_tokens, self.state.context_len, field)
        with body.naming_fields(field):
            reqs = await self._prepare_all([(None, prompt)], params, body.stream,
                                           body.top_logprobs_num())
        self._check_context(reqs, field, max_tokens)
        if body.stream:
            return self._stream_chat(body, reqs, params.n)
        outputs = await self._first_outputs(request, reqs)
        decode = self._decode_fn(params)
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": out["text"]},
            "logprobs": oai.chat_logprobs(out["meta_info"], self.token_text, decode, 0),
            "finish_reason": oai.finish_reason_name(out["meta_info"]),
        } for i, out in enumerate(outputs)]
        return JSONResponse({
            "id": oai.new_id("chatcmpl"), "object": "chat.completion", "created": oai.now(),
            "model": self.state.model_name, "choices": choices,
            "usage": self._usage(outputs, params.n),
        })

    def _stream_chat(self, body: oai.ChatCompletionRequest, reqs: list[PreparedRequest],
                     n: int) -> Response:
        chunks = StreamChunks(oai.new_id("chatcmpl"), "chat.completion.chunk",
                              self.state.model_name, body.include_usage)
        decode = self._decode_fn(reqs[0].req.sampling_params)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any,
                  finish: str | None) -> dict[str, Any]:
            return chunks.choice({"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish})

        async def events() -> AsyncIterator[dict[str, Any]]:
            last: dict[int, dict[str, Any]] = {}
            sent_tokens: dict[int, int] = {}
            for i in range(len(reqs)):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for i, out in _merge([self._generate(r) for r in reqs]):
                meta = out["meta_info"]
                logprobs = oai.chat_logprobs(meta, self.token_text, decode,
                                             sent_tokens.get(i, 0))
                sent_tokens[i] = meta["completion_tokens"]
                last[i] = out
                yield chunk(i, {"content": out["delta"]}, logprobs,
                            oai.finish_reason_name(meta))
            if chunks.include_usage:
                yield chunks.usage(self._usage([last[i] for i in sorted(last)], n))

        return self._sse(events())

    async def embeddings(self, request: Request) -> Response:
        body = await parse_body(request, oai.EmbeddingRequest)
        self._check_model(body.model)
        if not self.state.is_embedding:
            raise RequestError("this model is a generation model; it does not serve embeddings")
        if body.encoding_format not in ("float", "base64"):
            raise FieldError("encoding_format", "encoding_format must be 'float' or "
                                 f"'base64', got {body.encoding_format!r}")
        size = self.state.embedding_size
        if body.dimensions is not None and body.dimensions != size:
            raise FieldError("dimensions", f"dimensions must be this model's embedding "
                                 f"size, {size}, or left out (embeddings are not shortened), "
                                 f"got {body.dimensions}")
        items = oai.split_prompts(body.input, "input", self.tm.vocab_size)
        if any(text == "" for text, _ in items):
            # As OpenAI's API: an empty text has no embedding (a tokenizer would still
            # give its special tokens one).
            raise FieldError("input", "input must not hold an empty string")
        results = await unless_client_leaves(request, gather_or_cancel(
            [self.tm.embed(text=t, input_ids=ids) for t, ids in items]))
        data = []
        for i, res in enumerate(results):
            vector = np.asarray(res["embedding"], dtype=np.float32)
            value: Any = (base64.b64encode(vector.tobytes()).decode()
                          if body.encoding_format == "base64" else vector.tolist())
            data.append({"object": "embedding", "index": i, "embedding": value})
        if self.state.server_args.log_requests:
            for res in results:
                logger.info("request %s %s: prompt_tokens=%d, embedded", res["meta_info"]["id"],
                            _route.get(), res["meta_info"]["prompt_tokens"])
        prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
        return JSONResponse({
            "object": "list", "data": data, "model": self.state.model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.model_name, "object": "model", "created": self.state.created,
            "owned_by": "framework", "root": self.state.model_path,
            "max_model_len": self.state.context_len,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the served model, or 404 for any other id."""
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: the token ids the server would see for a text prompt."""
        body = await parse_body(request, oai.TokenizeBody)
        tokens = await self.tm.tokenize(body.the_text())
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": self.state.context_len})

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: the text of token ids, each checked against the vocabulary."""
        body = await parse_body(request, oai.DetokenizeBody)
        check_token_ids(body.tokens, self.tm.vocab_size, "tokens")
        # Decoding is fast, but a long list is still kept off the event loop.
        if len(body.tokens) > 4096:
            text = await asyncio.to_thread(self.tm.tokenizer.decode, body.tokens)
        else:
            text = self.tm.tokenizer.decode(body.tokens)
        return JSONResponse({"text": text})

    # ------------------------------------------------------------------ native

    async def generate(self, request: Request) -> Response:
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
            prompts = oai.split_prompts(body.input_ids or [], "input_ids", self.tm.vocab_size)
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
            rid=rid if each.n == 1 else None,
        ) for (text, ids), each, logprob, top, start, rid in zip(
            prompts, params, body.per_prompt("return_logprob", len(prompts)),
            body.per_prompt("top_logprobs_num", len(prompts)),
            body.per_prompt("logprob_start_len", len(prompts)), rids, strict=True)])
        if body.stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                async for i, out in _merge([self._generate(r) for r in reqs]):
                    out = {k: v for k, v in out.items() if k != "delta"}
                    out["index"] = i
                    yield out
            return self._sse(events())
        outputs = [{k: v for k, v in o.items() if k != "delta"}
                   for o in await self._first_outputs(request, reqs)]
        return JSONResponse(outputs if as_list else outputs[0])

    async def openapi(self, request: Request) -> Response:
        """``GET /openapi.json``: the API's OpenAPI document, built once with the app."""
        return JSONResponse(self.openapi_doc)

    async def health(self, request: Request) -> Response:
        if self.tm.dead_reason is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        if self.tm.dead_reason is not None:
            return Response(status_code=503)
        try:
            if self.state.is_embedding:
                await asyncio.wait_for(self.tm.embed(input_ids=[0]), 60)
            else:
                req = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(
                    max_new_tokens=1, temperature=0.0))
                await asyncio.wait_for(self.tm.generate_one(req), 60)
        except (asyncio.TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    async def get_model_info(self, request: Request) -> Response:
        return JSONResponse({
            "model_path": self.state.model_path,
            "tokenizer_path": self.state.server_args.tokenizer_path or self.state.model_path,
            "is_generation": not self.state.is_embedding,
            "served_model_name": self.state.model_name,
            "context_length": self.state.context_len,
        })

    async def get_server_info(self, request: Request) -> Response:
        info = await self.tm.get_scheduler_info()
        server_args = self.state.server_args
        args = dataclasses.asdict(server_args)
        # What is served, also where the flags were left to their defaults (the embedded
        # model, its tokenizer, the name the API reports).
        args.update(model_path=self.state.model_path,
                    tokenizer_path=server_args.tokenizer_path or self.state.model_path,
                    served_model_name=self.state.model_name)
        if args.get("api_key"):
            args["api_key"] = "<set>"  # a secret is never echoed back
        metrics = self.tm.last_metrics
        # Messages are array_like (positional on the wire); the API names each field.
        named = ({f: getattr(metrics, f) for f in metrics.__struct_fields__}
                 if metrics is not None else None)
        return JSONResponse({**args, "scheduler": info, "metrics": named})

    async def metrics(self, request: Request) -> Response:
        # Only routed with --enable-metrics, so the registry is there.
        return Response(self.tm.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def flush_cache(self, request: Request) -> Response:
        reply = await self.tm.flush_cache()
        return _operation_reply(reply.success, reply.message)

    async def abort_request(self, request: Request) -> Response:
        body = await parse_body(request, oai.AbortBody)
        if not body.rid and not body.abort_all:
            raise RequestError("give rid or abort_all")
        await self.tm.dispatch(AbortReq(
            rid=body.rid, abort_all=body.abort_all, reason="aborted by /abort_request"))
        return JSONResponse({"success": True})

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await parse_body(request, oai.UpdateWeightsBody)
        reply = await self.tm.update_weights_from_disk(body.model_path, body.load_format,
                                                       body.abort_all_requests)
        return _operation_reply(reply.success, reply.message,
                                num_paused_requests=reply.num_paused_requests)

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    def _sse(events: AsyncIterator[Any]) -> StreamingResponse:
        return StreamingResponse(sse_stream(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def route_table(routes: Routes, server_args: ServerArgs) -> list[RouteSpec]:
    """Every route of the app, with its request struct; /openapi.json is built from it."""
    json_only = ("application/json",)
    streams = ("application/json", "text/event-stream")
    bare = ()  # answers 200 or 503 without a body
    table = [
        RouteSpec("/v1/completions", routes.completions, ("POST",), "OpenAI completions",
                  oai.CompletionRequest, (400, 404, 500, 503), streams),
        RouteSpec("/v1/chat/completions", routes.chat_completions, ("POST",),
                  "OpenAI chat completions", oai.ChatCompletionRequest, (400, 404, 500, 503),
                  streams),
        RouteSpec("/v1/embeddings", routes.embeddings, ("POST",), "OpenAI embeddings",
                  oai.EmbeddingRequest, (400, 404, 500, 503)),
        RouteSpec("/v1/models", routes.models, ("GET",), "The served model, as a list"),
        # :path, since a model's id is its directory when --served-model-name is not given.
        RouteSpec("/v1/models/{model:path}", routes.retrieve_model, ("GET",),
                  "The served model's object", errors=(404, 500, 503)),
        RouteSpec("/tokenize", routes.tokenize, ("POST",), "Token ids of a text",
                  oai.TokenizeBody),
        RouteSpec("/detokenize", routes.detokenize, ("POST",), "Text of token ids",
                  oai.DetokenizeBody),
        RouteSpec("/generate", routes.generate, ("POST",), "SGLang's native generation",
                  oai.GenerateRequestBody, media=streams),
        RouteSpec("/health", routes.health, ("GET",), "Liveness of every component",
                  errors=(), media=bare),
        RouteSpec("/health_generate", routes.health_generate, ("GET",),
                  "A one-token generation (or embedding)", errors=(), media=bare),
        RouteSpec("/get_model_info", routes.get_model_info, ("GET",), "Model facts"),
        RouteSpec("/get_server_info", routes.get_server_info, ("GET",),
                  "Server arguments, the Scheduler's state and the last metrics"),
        # GET too, as SGLang accepts both.
        RouteSpec("/flush_cache", routes.flush_cache, ("GET", "POST"),
                  "Free every cached prefix"),
        RouteSpec("/abort_request", routes.abort_request, ("POST",),
                  "Abort one request or all", oai.AbortBody),
        RouteSpec("/update_weights_from_disk", routes.update_weights_from_disk, ("POST",),
                  "Load new weights of the same architecture", oai.UpdateWeightsBody),
        RouteSpec("/openapi.json", routes.openapi, ("GET",), "This document", errors=(),
                  media=json_only),
    ]
    if server_args.enable_metrics:
        table.append(RouteSpec("/metrics", routes.metrics, ("GET",), "Prometheus metrics",
                               errors=(), media=("text/plain",)))
    return table


def _operation_reply(success: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` answer; a refusal is a 400 with OpenAI's error too."""
    body: dict[str, Any] = {"success": success, "message": message, **extra}
    if not success:
        body.update(error_body(message, 400))
    return JSONResponse(body, status_code=200 if success else 400)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's error body too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    if status == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif status == 405:
        detail = f"{request.url.path} does not take {request.method}"
    response = error_response(detail, status)
    response.headers.update(getattr(exc, "headers", None) or {})
    return response


def build_app(state: ServerState) -> Starlette:
    """The Starlette application for ``state``."""
    routes = Routes(state)
    table = route_table(routes, state.server_args)
    routes.openapi_doc = build_openapi(table, api_key=bool(state.server_args.api_key),
                                       open_paths=OPEN_PATHS)
    app = Starlette(routes=[Route(spec.path, _handler(spec.handler), methods=list(spec.methods))
                            for spec in table],
                    exception_handlers={HTTPException: _http_error})
    app.state.server = state
    if state.server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.server_args.api_key)
    return app


__all__ = ["JSONResponse", "ServerState", "build_app", "error_response", "sse_event"]
