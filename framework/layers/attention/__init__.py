"""Attention over the paged KV cache: the layer models hold and the backends that compute it."""

from __future__ import annotations

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs
from framework.layers.attention.radix_attention import RadixAttention, bind_attention_backend

__all__ = ["AttentionBackend", "AttentionBackendArgs", "RadixAttention", "bind_attention_backend"]
