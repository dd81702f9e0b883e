"""The attention layer a model holds: its shape, plus a call into the batch's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """One layer's attention over the paged KV cache.

    Holds no weights; the computation is done by ``forward_batch.attn_backend``,
    which ``ModelRunner`` sets per batch, so that models are independent of the
    kernels.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """``[n, heads * dim]`` attention output for the batch's new tokens."""
        if forward_batch.attn_backend is None:
            raise RuntimeError(
                "forward_batch.attn_backend is not set; run the model via ModelRunner"
            )
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scaling={self.scaling:g}"
        )
