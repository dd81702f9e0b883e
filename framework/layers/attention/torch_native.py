"""The reference attention backend: plain ``torch`` SDPA, one request at a time.

Clarity over speed: each request gathers its keys and values from the paged
pool through ``req_to_token`` and runs one ``scaled_dot_product_attention``
call, so there is no padding to the longest request. It runs on any device
and is the baseline the faster backends are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention


@dataclass
class _RequestSpan:
    """Where one request's new tokens sit in the packed batch, and what they attend to."""

    token_start: int  # first row of the request in q / the output
    num_new: int  # new tokens (1 in decode)
    seq_len: int  # tokens to attend over: cached prefix + new
    # [num_new, seq_len] bool, True where attending is allowed; None when every
    # query may see every key (a single new token).
    mask: torch.Tensor | None


class TorchNativeAttnBackend(AttentionBackend):
    """Causal attention over the paged KV cache with ``torch.nn.functional`` SDPA."""

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        self._spans: list[_RequestSpan] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Work out each request's token range and causal mask once for all layers."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        assert seq_lens is not None  # filled above
        if forward_batch.forward_mode.is_decode():
            self._spans = [_RequestSpan(i, 1, seq_len, None) for i, seq_len in enumerate(seq_lens)]
            return
        new_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        assert new_lens is not None and prefix_lens is not None  # filled above
        self._spans = []
        start = 0
        for num_new, prefix_len, seq_len in zip(new_lens, prefix_lens, seq_lens, strict=True):
            if prefix_len + num_new != seq_len:
                raise ValueError(
                    f"extend batch: prefix ({prefix_len}) + new ({num_new}) tokens != "
                    f"seq_len ({seq_len})"
                )
            self._spans.append(
                _RequestSpan(start, num_new, seq_len, self._causal_mask(prefix_len, num_new))
            )
            start += num_new

    def _causal_mask(self, prefix_len: int, num_new: int) -> torch.Tensor | None:
        if num_new == 1:
            return None
        # New token j sits at position prefix_len + j and sees keys 0..prefix_len + j.
        query_pos = torch.arange(num_new, device=self.device)[:, None] + prefix_len
        key_pos = torch.arange(prefix_len + num_new, device=self.device)[None, :]
        return key_pos <= query_pos

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Prefill: each request's new tokens attend causally to its prefix and themselves."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decode: each request's single new token attends to all of its tokens."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        pool = self.token_to_kv_pool
        req_to_token = self.req_to_token_pool.req_to_token
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
        queries = q.reshape(-1, layer.num_heads, layer.head_dim)
        output = torch.empty_like(queries)
        group = layer.num_heads // layer.num_kv_heads
        for i, span in enumerate(self._spans):
            slots = req_to_token[forward_batch.req_pool_indices[i], : span.seq_len]
            rows = slice(span.token_start, span.token_start + span.num_new)
            output[rows] = self._attend(
                queries[rows], k_buffer[slots], v_buffer[slots], span.mask, layer.scaling, group
            )
        return output.view(q.shape[0], layer.num_heads * layer.head_dim)

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        group: int,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[n, heads, dim]`` over ``k``, ``v`` ``[s, kv_heads, dim]``."""
        # Query head h reads key/value head h // group (grouped-query attention).
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype), k, v, attn_mask=mask, scale=scaling
        )
        return out.transpose(0, 1).to(q.dtype)
