"""The Starlette app: the route table of the HTTP API, assembled over one ``ServerState``.

The handlers live in ``framework.server.routes`` (one class per family); the plumbing
they share in ``responses``, ``request_body``, ``disconnect``, ``handler``, ``auth``,
and ``sse``; the fan-in of a request's parts is the runtime's (``runtime/fan_out.py``),
which the Engine uses too.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from framework.config import ServerArgs
from framework.server import openai as oai
from framework.server.auth import OPEN_PATHS, ApiKeyMiddleware
from framework.server.handler import http_error, wrap_handler
from framework.server.openapi_schema import RouteSpec, build_openapi
from framework.server.responses import JSONResponse, error_response
from framework.server.routes import AdminRoutes, NativeRoutes, OpenAIRoutes
from framework.server.sse import sse_event
from framework.server.state import ServerState


def route_table(openai: OpenAIRoutes, native: NativeRoutes, admin: AdminRoutes,
                server_args: ServerArgs) -> list[RouteSpec]:
    """Every route of the app, with its request struct; /openapi.json is built from it."""
    json_only = ("application/json",)
    streams = ("application/json", "text/event-stream")
    bare = ()  # answers 200 or 503 without a body
    table = [
        RouteSpec("/v1/completions", openai.completions, ("POST",), "OpenAI completions",
                  oai.CompletionRequest, (400, 404, 500, 503), streams),
        RouteSpec("/v1/chat/completions", openai.chat_completions, ("POST",),
                  "OpenAI chat completions", oai.ChatCompletionRequest, (400, 404, 500, 503),
                  streams),
        RouteSpec("/v1/embeddings", openai.embeddings, ("POST",), "OpenAI embeddings",
                  oai.EmbeddingRequest, (400, 404, 500, 503)),
        RouteSpec("/v1/models", openai.models, ("GET",), "The served model, as a list"),
        # :path, since a model's id is its directory when --served-model-name is not given.
        RouteSpec("/v1/models/{model:path}", openai.retrieve_model, ("GET",),
                  "The served model's object", errors=(404, 500, 503)),
        RouteSpec("/tokenize", native.tokenize, ("POST",), "Token ids of a text",
                  oai.TokenizeBody),
        RouteSpec("/detokenize", native.detokenize, ("POST",), "Text of token ids",
                  oai.DetokenizeBody),
        RouteSpec("/generate", native.generate, ("POST",), "SGLang's native generation",
                  oai.GenerateRequestBody, media=streams),
        RouteSpec("/health", admin.health, ("GET",), "Liveness of every component",
                  errors=(), media=bare),
        RouteSpec("/health_generate", admin.health_generate, ("GET",),
                  "A one-token generation (or embedding)", errors=(), media=bare),
        RouteSpec("/get_model_info", native.get_model_info, ("GET",), "Model facts"),
        RouteSpec("/get_server_info", admin.get_server_info, ("GET",),
                  "Server arguments, the Scheduler's state and the last metrics"),
        # GET too, as SGLang accepts both.
        RouteSpec("/flush_cache", admin.flush_cache, ("GET", "POST"),
                  "Free every cached prefix"),
        RouteSpec("/abort_request", admin.abort_request, ("POST",),
                  "Abort one request or all", oai.AbortBody),
        RouteSpec("/update_weights_from_disk", admin.update_weights_from_disk, ("POST",),
                  "Load new weights of the same architecture", oai.UpdateWeightsBody),
        RouteSpec("/load_lora_adapter", admin.load_lora_adapter, ("POST",),
                  "Load a LoRA adapter", oai.LoadLoraAdapterBody),
        RouteSpec("/unload_lora_adapter", admin.unload_lora_adapter, ("POST",),
                  "Unload a LoRA adapter (refused while requests use it)",
                  oai.UnloadLoraAdapterBody),
        RouteSpec("/openapi.json", admin.openapi, ("GET",), "This document", errors=(),
                  media=json_only),
    ]
    if server_args.enable_metrics:
        table.append(RouteSpec("/metrics", admin.metrics, ("GET",), "Prometheus metrics",
                               errors=(), media=("text/plain",)))
    return table


def build_app(state: ServerState) -> Starlette:
    """The Starlette application for ``state``."""
    admin = AdminRoutes(state)
    table = route_table(OpenAIRoutes(state), NativeRoutes(state), admin, state.server_args)
    admin.openapi_doc = build_openapi(table, api_key=bool(state.server_args.api_key),
                                      open_paths=OPEN_PATHS)
    app = Starlette(routes=[Route(spec.path, wrap_handler(spec.handler),
                                  methods=list(spec.methods))
                            for spec in table],
                    exception_handlers={HTTPException: http_error})
    app.state.server = state
    if state.server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.server_args.api_key)
    return app


__all__ = ["OPEN_PATHS", "JSONResponse", "ServerState", "build_app", "error_response",
           "sse_event"]
