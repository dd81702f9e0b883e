"""KV cache memory: request slots, KV-slot allocation, per-layer K/V buffers."""

from __future__ import annotations

from framework.mem_cache.memory_pool import (
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    kv_cache_bytes_per_token,
)

__all__ = [
    "MHATokenToKVPool",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "kv_cache_bytes_per_token",
]
