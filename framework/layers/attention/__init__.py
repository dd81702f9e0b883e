"""Attention over the paged KV cache: the layer models hold and the backends that compute it."""

from __future__ import annotations

from framework.layers.attention.base import AttentionBackend
from framework.layers.attention.radix_attention import RadixAttention

__all__ = ["AttentionBackend", "RadixAttention"]
