"""framework: an asyncio-first LLM serving runtime.

The public API is ``Engine`` (offline generation and embeddings),
``SamplingParams`` and ``ServerArgs``; they are imported on first use so that
``import framework`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs"]

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.runtime.engine import Engine
    from framework.sampling_params import SamplingParams

_LAZY = {
    "Engine": "framework.runtime.engine",
    "SamplingParams": "framework.sampling_params",
    "ServerArgs": "framework.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
