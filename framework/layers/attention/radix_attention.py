"""The attention layer a model holds: its shape, plus a call into the bound backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.base import AttentionBackend


class RadixAttention(nn.Module):
    """One layer's attention over the paged KV cache.

    Holds no weights; the computation is done by the attention backend bound
    to the layer once, after the model is built (``bind_attention_backend``),
    so that models are independent of the kernels and batches carry no
    backend.

    Two per-layer variants every backend honours:

    * ``sliding_window`` W: the query at position ``p`` sees only the keys at
      positions ``p - W < j <= p`` (W keys, its own included; transformers'
      convention). ``None``: every earlier key.
    * ``logit_cap`` c (soft-capping, Gemma 2): each score ``s = q.k * scaling``
      becomes ``c * tanh(s / c)`` before the softmax. ``None``: scores as they are.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        *,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}")
        if logit_cap is not None and logit_cap <= 0:
            raise ValueError(f"logit_cap must be > 0 or None, got {logit_cap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        self.attn_backend: AttentionBackend | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[n, heads * dim]`` attention output for the batch's new tokens.

        With ``rows``, only those new tokens' output, ``[len(rows), heads * dim]``
        (``AttentionBackend.forward_rows``); every new token's keys and values are
        still saved.
        """
        if self.attn_backend is None:
            raise RuntimeError(
                f"attention layer {self.layer_id} has no attention backend bound; run the "
                "model through ModelRunner, or call bind_attention_backend(model, backend)"
            )
        if rows is not None:
            if not save_kv_cache:
                raise ValueError("attention for some rows alone always saves the keys and values")
            return self.attn_backend.forward_rows(q, k, v, self, forward_batch, rows)
        return self.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scaling={self.scaling:g}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", logit_cap={self.logit_cap:g}" if self.logit_cap else "")
        )


def bind_attention_backend(model: nn.Module, backend: AttentionBackend) -> int:
    """Make every ``RadixAttention`` in ``model`` compute with ``backend``; returns how many.

    Each layer's shape is checked against the backend's, so that a backend
    built for other heads or another KV pool fails here rather than computing
    wrong attention. An encoder without ``RadixAttention`` layers binds none.
    """
    layers = [module for module in model.modules() if isinstance(module, RadixAttention)]
    for layer in layers:
        _check_layer_fits(layer, backend)
    for layer in layers:
        layer.attn_backend = backend
    return len(layers)


def _check_layer_fits(layer: RadixAttention, backend: AttentionBackend) -> None:
    layer_shape = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    backend_shape = (backend.num_heads, backend.num_kv_heads, backend.head_dim)
    if layer_shape != backend_shape:
        raise ValueError(
            f"attention layer {layer.layer_id} has (heads, kv_heads, head_dim) = {layer_shape}, "
            f"the backend {backend_shape}"
        )
    num_layers = backend.token_to_kv_pool.num_layers
    if not 0 <= layer.layer_id < num_layers:
        raise ValueError(
            f"attention layer id {layer.layer_id} is outside the KV pool's {num_layers} layers"
        )
