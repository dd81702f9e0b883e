"""The operational routes: health, server facts, metrics, the prefix cache, aborts,
weight reloads and the API's own description (``/openapi.json``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from starlette.requests import Request
from starlette.responses import Response

from framework.messages import AbortReq
from framework.runtime.tokenizer_manager import GenerateRequest, RequestError
from framework.sampling_params import SamplingParams
from framework.server import openai as oai
from framework.server.request_body import parse_body
from framework.server.responses import JSONResponse
from framework.server.routes.base import RouteBase
from framework.server.sse import error_body
from framework.server.state import ServerState


class AdminRoutes(RouteBase):
    """Liveness, facts and operations of the running server."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        # Set by ``build_app`` once the route table is known.
        self.openapi_doc: dict[str, Any] = {}

    async def openapi(self, request: Request) -> Response:
        """``GET /openapi.json``: the API's OpenAPI document, built once with the app."""
        return JSONResponse(self.openapi_doc)

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while every component lives, 503 once one died."""
        if self.tm.dead_reason is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """``GET /health_generate``: 200 if a one-token generation (or an embedding)
        comes back within a minute, else 503."""
        if self.tm.dead_reason is not None:
            return Response(status_code=503)
        try:
            if self.state.model.is_embedding:
                await asyncio.wait_for(self.tm.embed(input_ids=[0]), 60)
            else:
                req = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(
                    max_new_tokens=1, temperature=0.0))
                await asyncio.wait_for(self.tm.generate_one(req), 60)
        except (asyncio.TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    async def get_server_info(self, request: Request) -> Response:
        """``GET /get_server_info``: the server's arguments, the Scheduler's
        state and its last metrics."""
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
        """``GET /metrics``: the Prometheus metrics."""
        # Only routed with --enable-metrics, so the registry is there.
        return Response(self.tm.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def flush_cache(self, request: Request) -> Response:
        """``GET|POST /flush_cache``: free every cached prefix."""
        reply = await self.tm.flush_cache()
        return _operation_reply(reply.success, reply.message)

    async def abort_request(self, request: Request) -> Response:
        """``POST /abort_request``: abort the request ``rid``, or all of them."""
        body = await parse_body(request, oai.AbortBody)
        if not body.rid and not body.abort_all:
            raise RequestError("give rid or abort_all")
        await self.tm.dispatch(AbortReq(
            rid=body.rid, abort_all=body.abort_all, reason="aborted by /abort_request"))
        return JSONResponse({"success": True})

    async def update_weights_from_disk(self, request: Request) -> Response:
        """``POST /update_weights_from_disk``: load new weights of the same
        architecture."""
        body = await parse_body(request, oai.UpdateWeightsBody)
        reply = await self.tm.update_weights_from_disk(body.model_path, body.load_format,
                                                       body.abort_all_requests)
        return _operation_reply(reply.success, reply.message,
                                num_paused_requests=reply.num_paused_requests)

    async def load_lora_adapter(self, request: Request) -> Response:
        """``POST /load_lora_adapter``: load a LoRA adapter under a name requests may use."""
        body = await parse_body(request, oai.LoadLoraAdapterBody)
        reply = await self.tm.load_lora_adapter(body.lora_name, body.lora_path)
        return _operation_reply(reply.success, reply.message)

    async def unload_lora_adapter(self, request: Request) -> Response:
        """``POST /unload_lora_adapter``: unload a LoRA adapter (refused while in use)."""
        body = await parse_body(request, oai.UnloadLoraAdapterBody)
        reply = await self.tm.unload_lora_adapter(body.lora_name)
        return _operation_reply(reply.success, reply.message)



def _operation_reply(success: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's ``{"success", "message"}`` answer; a refusal is a 400 with OpenAI's error too."""
    body: dict[str, Any] = {"success": success, "message": message, **extra}
    if not success:
        body.update(error_body(message, 400))
    return JSONResponse(body, status_code=200 if success else 400)
