"""The attention-backend interface: paged KV cache in, attention output out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """Computes causal attention over each request's cached prefix plus its new tokens.

    Shapes: ``q`` is ``[num_tokens, num_heads * head_dim]``, ``k`` and ``v`` are
    ``[num_tokens, num_kv_heads * head_dim]`` (new tokens only, packed request
    after request), the result is ``[num_tokens, num_heads * head_dim]``. A
    backend writes the new keys and values at ``forward_batch.out_cache_loc``
    (when ``save_kv_cache``) and reads each request's keys and values through
    ``req_to_token[req_pool_idx, :seq_len]``.
    """

    def __init__(
        self, *, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare whatever the backend needs once per batch, before the first layer runs.

        The default fills the batch's host copies of its lengths.
        """
        forward_batch.fill_cpu_lengths()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch to ``forward_extend`` or ``forward_decode`` by the batch's mode."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for a prefill batch: new tokens attend to prefix and earlier new tokens."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for a decode batch: one new token per request attends to all its tokens."""
