"""The CPU attention backend: a native kernel over the paged pool, in place.

On a CPU the torch backend's attention is far from what the machine can do:
decode is bound by reading every request's keys and values, which SDPA reads
at about half the memory's rate after the backend has copied them into
padded tensors (``kept_kv``); prefill runs SDPA over padded length groups, a
fraction of the arithmetic rate on these small per-request products. The
kernel in ``csrc/paged_attention.cpp`` takes the whole batch in one call per
layer: for each request and key/value head it copies that head's keys and
values out of the pool (through ``req_to_token``) into contiguous blocks that
stay in cache, then runs every new token of the request against them,
causally. Prefill, decode and mixed steps are the same call (a decode token
is a request with one new token); nothing is kept between steps, so the pool
needs no room for copies. A layer's sliding window and soft cap go to the
kernel with each call, which reads only the keys a window lets a query see.

A quantized KV cache (``--kv-cache-dtype fp8_e4m3|int8``) is read as it is held: the
kernel takes the layer's 8-bit codes and scales and widens each row it reads to
float32 (code times scale), so that a decode step reads a quarter of float32's bytes
(half of bfloat16's). The new tokens are quantized into the pool by the pool itself
(``set_kv_buffer``) before the kernel reads them, as every other token.

The backend runs the kernel for float32 or bfloat16 on a CPU when it could be built
(``native_build``); anywhere else (another device or dtype, no C++ compiler) it is the
torch backend, which it then delegates everything to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs
from framework.layers.attention.native_build import KERNEL_DTYPES, load_cpu_kernels
from framework.layers.attention.torch_native import TorchNativeAttnBackend

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention

#: An extend batch whose requests have at most this many new tokens each (a verify step
#: of speculative decoding, a short prompt) runs each new token as a decode token: the
#: kernel's decode walk sums a query's scores and values in another order than its
#: extend path does, so that otherwise a verify step's attention would differ from the
#: plain decode steps' in the last bits, and greedy speculation could pick another token
#: where two logits nearly tie. Each such token reads its request's rows once more, a
#: small cost next to the rest of a step at these lengths.
DECODE_WALK_TOKENS = 16
#: A layer's pool as the kernel takes it: key and value buffers (values, or 8-bit codes)
#: and the codes' key and value scales (None and None for values).
_LayerPool = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None]]


class CpuNativeAttnBackend(AttentionBackend):
    """Causal attention by the native CPU kernel (float32 or bfloat16 on a CPU), else the
    torch backend."""

    extra_kv_copies = 0.0
    reads_quantized_kv = True

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        native = args.device.type == "cpu" and args.dtype in KERNEL_DTYPES
        self._ops = load_cpu_kernels() if native else None
        self._fallback = None if self._ops is not None else TorchNativeAttnBackend(args)
        # Of the planned batch: each request's row in req_to_token, its tokens and its
        # new tokens (None until init_forward_metadata has run).
        self._batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # A decode step's new tokens per request, sliced from one tensor made here rather
        # than made anew every step.
        self._ones = torch.ones(args.max_batch_size, dtype=torch.int64, device=args.device)

    @property
    def native(self) -> bool:
        """Whether the native kernel runs (else the torch backend does everything)."""
        return self._ops is not None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Check the batch and keep its lengths for the layers' kernel calls."""
        if self._fallback is not None:
            self._fallback.init_forward_metadata(forward_batch)
            return
        super().init_forward_metadata(forward_batch)
        counts = forward_batch.extend_seq_lens_cpu or []
        if forward_batch.forward_mode.is_extend() and max(counts, default=0) <= DECODE_WALK_TOKENS:
            self._batch = _as_decode_tokens(forward_batch.req_pool_indices_cpu or [],
                                            forward_batch.seq_lens_cpu or [], counts,
                                            forward_batch.seq_lens.device)
            return
        if forward_batch.forward_mode.is_decode():
            new = self._ones[:forward_batch.batch_size]
        else:  # the check above refused an extend batch without them
            assert forward_batch.extend_seq_lens is not None
            new = forward_batch.extend_seq_lens.contiguous()
        self._batch = (forward_batch.req_pool_indices.contiguous(),
                       forward_batch.seq_lens.contiguous(), new)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """Any batch (prefill, decode or mixed): every new token, causally, in one call."""
        if self._fallback is not None:
            return self._fallback.forward(q, k, v, layer, forward_batch, save_kv_cache)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    # One kernel for both modes.
    forward_extend = forward
    forward_decode = forward

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer: RadixAttention, forward_batch: ForwardBatch,
                     rows: torch.Tensor) -> torch.Tensor:
        """Only the queries at ``rows``: each is run as a request's one new token.

        The query of a request's ``i``-th new token sees the request's first
        ``prefix + i + 1`` tokens; given as a request of that many tokens with one
        new token, the kernel computes exactly its attention. In a prefill's last
        layer, where only each prompt's last token makes logits, that is one query
        a request, as in a decode step, instead of the whole prompt's.

        Each query so run reads its keys and values from the pool on its own,
        where the whole batch's call reads them once for several queries: asked,
        beyond one row a request, for more than a quarter of the other rows (the
        prompt's logprobs), the layer runs for every row and keeps ``rows``, which
        is then faster.
        """
        if self._ops is None or self._batch is None or self._few_rows_cost_more(q, rows):
            return super().forward_rows(q, k, v, layer, forward_batch, rows)
        k_buffer, v_buffer, scales = self._pool(k, v, layer, forward_batch, save_kv_cache=True)
        req_pool_indices, seq_lens, new = self._batch
        if req_pool_indices.shape[0] == q.shape[0]:  # one new token a request already
            owner, visible = rows, seq_lens.index_select(0, rows)
        else:
            ends = torch.cumsum(new, dim=0)  # past each request's last row in the batch
            owner = torch.searchsorted(ends, rows, right=True)
            # Tokens the query sees: the request's own up to the query, itself included.
            visible = seq_lens[owner] - ends[owner] + rows + 1
        queries = q.index_select(0, rows).reshape(rows.shape[0], layer.num_heads, layer.head_dim)
        # The query is the last of its `visible` tokens: its window ends at itself there too.
        out = self._ops.paged_attention(queries, k_buffer, v_buffer,
                                        self.req_to_token_pool.req_to_token,
                                        req_pool_indices.index_select(0, owner), visible,
                                        torch.ones_like(visible), layer.scaling,
                                        *_variant(layer), *scales)
        return out.view(rows.shape[0], layer.num_heads * layer.head_dim)

    def _few_rows_cost_more(self, q: torch.Tensor, rows: torch.Tensor) -> bool:
        # Shapes only (no sync): a decode step's rows, one a request, cost the same on
        # either path; the extra rows of prompt logprobs are what can make it slower.
        assert self._batch is not None
        requests = self._batch[0].shape[0]
        return 4 * (rows.shape[0] - requests) > q.shape[0] - requests

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if self._ops is None or self._batch is None:
            raise RuntimeError("init_forward_metadata must run before the layers")
        k_buffer, v_buffer, scales = self._pool(k, v, layer, forward_batch, save_kv_cache)
        queries = q.reshape(q.shape[0], layer.num_heads, layer.head_dim).contiguous()
        out = self._ops.paged_attention(queries, k_buffer, v_buffer,
                                        self.req_to_token_pool.req_to_token, *self._batch,
                                        layer.scaling, *_variant(layer), *scales)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def _pool(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
              forward_batch: ForwardBatch, save_kv_cache: bool) -> _LayerPool:
        """The layer's key and value buffers and their scales, the new tokens' rows
        written first when asked (else they are in the pool already)."""
        assert self._ops is not None  # callers run the kernels only
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        if save_kv_cache and pool.quantized:  # quantized by the pool's own rounding
            pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        elif save_kv_cache:
            rows = k.shape[0]
            self._ops.write_kv(k_buffer, v_buffer, forward_batch.out_cache_loc,
                               k.reshape(rows, -1), v.reshape(rows, -1))
        return k_buffer, v_buffer, (pool.k_scales[layer_id], pool.v_scales[layer_id])


def _as_decode_tokens(req_pool_indices: list[int], seq_lens: list[int], counts: list[int],
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's batch with each new token as a request of its own: its request's row,
    the tokens it sees (the request's own up to itself) and one new token. Made from the
    host copies of the lengths: a handful of torch operators on these few tokens would
    cost more than the lists."""
    rows, visible = [], []
    for row, seq_len, count in zip(req_pool_indices, seq_lens, counts, strict=True):
        rows.extend([row] * count)
        visible.extend(range(seq_len - count + 1, seq_len + 1))
    as_tensor = torch.tensor([rows, visible], dtype=torch.int64, device=device)
    return as_tensor[0], as_tensor[1], torch.ones(len(rows), dtype=torch.int64, device=device)


def _variant(layer: RadixAttention) -> tuple[int, float]:
    """The layer's sliding window and soft cap as the kernel takes them (0: none)."""
    return layer.sliding_window or 0, layer.logit_cap or 0.0
