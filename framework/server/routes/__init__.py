"""The route handlers of the HTTP API, one class per family over a shared ``RouteBase``."""

from framework.server.routes.admin import AdminRoutes
from framework.server.routes.native import NativeRoutes
from framework.server.routes.openai_api import OpenAIRoutes

__all__ = ["AdminRoutes", "NativeRoutes", "OpenAIRoutes"]
