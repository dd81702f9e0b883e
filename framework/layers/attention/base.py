"""The attention-backend interface: paged KV cache in, attention output out.

A backend is built once per rank, by ``ModelRunner``, from an
``AttentionBackendArgs``: the layers' head shape, the KV cache pools it reads
and writes, and the bounds a kernel backend sizes its buffers by (the largest
batch, the context length). Per batch, ``init_forward_metadata`` runs once
before the first layer; then every ``RadixAttention`` layer calls ``forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention
    from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


@dataclass(frozen=True)
class AttentionBackendArgs:
    """Everything an attention backend is built with, once per rank.

    Head counts are this rank's (after tensor-parallel slicing). The pools are
    the ones the scheduler allocates from, so ``req_to_token_pool.req_to_token``
    and ``out_cache_loc`` index ``token_to_kv_pool``'s buffers. ``max_batch_size``
    bounds the requests of any one batch and ``context_len`` the tokens of any
    one request; ``dtype`` is the activations' and the KV cache's dtype.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    max_batch_size: int
    context_len: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        if min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(
                f"num_heads, num_kv_heads and head_dim must be > 0, got {self.num_heads}, "
                f"{self.num_kv_heads}, {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.max_batch_size <= 0 or self.context_len <= 0:
            raise ValueError(
                f"max_batch_size and context_len must be > 0, got {self.max_batch_size}, "
                f"{self.context_len}"
            )
        if self.context_len > self.req_to_token_pool.max_context_len:
            raise ValueError(
                f"context_len ({self.context_len}) is wider than the req_to_token rows "
                f"({self.req_to_token_pool.max_context_len})"
            )
        kv_shape = (self.token_to_kv_pool.num_kv_heads, self.token_to_kv_pool.head_dim)
        if kv_shape != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"the KV pool holds (kv_heads, head_dim) = {kv_shape}, but the backend is "
                f"asked for {(self.num_kv_heads, self.head_dim)}"
            )


class AttentionBackend(ABC):
    """Computes causal attention over each request's cached prefix plus its new tokens.

    Shapes: ``q`` is ``[num_tokens, num_heads * head_dim]``, ``k`` and ``v`` are
    ``[num_tokens, num_kv_heads * head_dim]`` (new tokens only, packed request
    after request), the result is ``[num_tokens, num_heads * head_dim]``. A
    backend writes the new keys and values at ``forward_batch.out_cache_loc``
    (when ``save_kv_cache``) and reads each request's keys and values through
    ``req_to_token[req_pool_idx, :seq_len]``.

    Subclasses take the same single ``args`` argument (the registry builds
    every backend as ``ATTENTION_BACKENDS.get(name)(args)``), call
    ``super().__init__(args)`` and allocate their buffers there, once.
    """

    #: Memory the backend keeps of the KV cache beyond the pool, as a multiple of the
    #: pool's bytes per token: the pool is sized to leave room for it (on CUDA, where
    #: ``--mem-fraction`` sizes it). 0 for a backend that reads the pool in place.
    extra_kv_copies: ClassVar[float] = 0.0
    #: Whether the backend reads a quantized KV cache (``--kv-cache-dtype``, through
    #: ``MHATokenToKVPool.read_kv``); a backend that reads the buffers as model-dtype
    #: values leaves it False and is refused with one.
    reads_quantized_kv: ClassVar[bool] = False

    def __init__(self, args: AttentionBackendArgs) -> None:
        self.args = args
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.req_to_token_pool = args.req_to_token_pool
        self.token_to_kv_pool = args.token_to_kv_pool
        self.max_batch_size = args.max_batch_size
        self.context_len = args.context_len
        self.dtype = args.dtype
        self.device = args.device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare whatever the backend needs once per batch, before the first layer runs.

        The default checks the batch against ``max_batch_size`` (buffers sized by
        it must not overflow), fills the batch's host copies of its lengths and,
        in an extend batch, checks that each request's prefix and new tokens add
        up to its ``seq_len``.
        """
        if forward_batch.batch_size > self.max_batch_size:
            raise ValueError(
                f"a batch of {forward_batch.batch_size} requests exceeds the attention "
                f"backend's max_batch_size ({self.max_batch_size})"
            )
        forward_batch.fill_cpu_lengths()
        if forward_batch.forward_mode.is_extend():
            lengths = zip(forward_batch.extend_prefix_lens_cpu or [],
                          forward_batch.extend_seq_lens_cpu or [],
                          forward_batch.seq_lens_cpu or [], strict=True)
            for prefix_len, num_new, seq_len in lengths:
                if prefix_len + num_new != seq_len:
                    raise ValueError(
                        f"extend batch: prefix ({prefix_len}) + new ({num_new}) tokens != "
                        f"seq_len ({seq_len})"
                    )

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

    def forward_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The attention output of the new tokens at ``rows`` alone: ``[len(rows), heads * dim]``.

        ``rows`` index the batch's packed new tokens. Every new token's keys and
        values are still written (later steps attend to them), but only the
        queries at ``rows`` are answered: a model's last layer needs no more
        than the rows that make logits (in a prefill, each prompt's last token).
        The default computes every row and keeps ``rows``; a backend that can
        attend for some queries alone overrides it.
        """
        return self.forward(q, k, v, layer, forward_batch).index_select(0, rows)

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
