"""KV cache memory: request slots, KV-slot allocation, per-layer K/V buffers."""

from __future__ import annotations

from framework.mem_cache.memory_pool import (
    KVCachePools,
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    kv_cache_bytes_per_token,
)
from framework.mem_cache.prefix_cache import ChunkCache, MatchResult, PrefixCache
from framework.mem_cache.radix_cache import RadixCache

__all__ = [
    "ChunkCache",
    "KVCachePools",
    "MHATokenToKVPool",
    "MatchResult",
    "PrefixCache",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "kv_cache_bytes_per_token",
]
