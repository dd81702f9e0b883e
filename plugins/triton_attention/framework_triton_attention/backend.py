"""``TritonAttnBackend``: framework's attention-backend interface on the Triton kernels.

Per batch, ``init_forward_metadata`` turns ``req_to_token`` into the flat index
form the kernels read: ``kv_indptr`` / ``kv_indices`` (each request's cached
slots back to back: all of them in a decode step, the prefix in an extend
step), ``qo_indptr`` (where each request's new tokens start in the packed
batch) and, for decode, the number of KV splits. Every layer then writes its
new keys and values into the pool and runs the decode or extend kernel; the
layers run no Python loop over requests. A layer's sliding window and logit cap
(``RadixAttention.sliding_window`` / ``logit_cap``) select the kernels' windowed
and capped variants; a windowed layer's decode splits only its window's keys.
A quantized pool (``--kv-cache-dtype fp8_e4m3|int8``) is written as 8-bit codes
and read back in the kernels' registers (``kv_codes``); every query, the new
tokens' own included, sees the keys and values as the pool holds them.

The backend needs a CUDA device, or Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before this module is imported), which runs the
same kernels slowly on CPU tensors for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs

try:
    import triton  # noqa: F401  (imported here only to turn its absence into a clear error)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the triton attention backend needs the triton package: pip install triton"
    ) from exc

from framework_triton_attention.common import check_head_dim, is_interpreter
from framework_triton_attention.decode import decode_attention
from framework_triton_attention.extend import extend_attention
from framework_triton_attention.kv_codes import layer_kv
from framework_triton_attention.kv_store import store_kv

if TYPE_CHECKING:
    from framework.forward_batch import ForwardBatch
    from framework.layers.attention.radix_attention import RadixAttention

# At most this many KV splits per request in decode (the scratch buffers' width).
MAX_KV_SPLITS = 16
# A split shorter than this costs more in its merge than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 32
# Programs per streaming multiprocessor that stage 1 aims for: several waves, so that
# the last, partial wave idles few SMs.
_PROGRAMS_PER_SM = 4
# The interpreter has no multiprocessors; counting a few keeps the split path running
# there exactly as on a GPU.
_INTERPRETER_SMS = 4


@dataclass
class TritonForwardMetadata:
    """One batch's indices for the kernels, shared by all layers."""

    kv_indptr: torch.Tensor  # [B + 1] int32: start of each request's slots in kv_indices
    kv_indices: torch.Tensor  # [>= 1] int32: cached KV slots, request after request
    qo_indptr: torch.Tensor | None  # [B + 1] int32: start of each request's new tokens (extend)
    max_new_tokens: int  # the most new tokens of one request (1 in decode)
    has_prefix: bool  # extend: some request has a cached prefix (decode reads all its keys)
    num_kv_splits: int  # decode: splits per request


def choose_num_kv_splits(batch: int, num_kv_heads: int, longest: int, num_sms: int) -> int:
    """KV splits per request so that stage 1 fills the device without needlessly short splits.

    Enough (request, KV head, split) programs for every multiprocessor, no split
    shorter than ``MIN_TOKENS_PER_SPLIT`` keys of the longest request, at most
    ``MAX_KV_SPLITS``.
    """
    wanted = -(-_PROGRAMS_PER_SM * num_sms // (batch * num_kv_heads))
    by_length = -(-longest // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_KV_SPLITS))


def splits_within_window(num_kv_splits: int, sliding_window: int | None) -> int:
    """The batch's KV splits for a layer that sees at most ``sliding_window`` keys.

    ``choose_num_kv_splits`` counted the longest request's keys; a windowed layer
    reads no more than the window, and splits shorter than ``MIN_TOKENS_PER_SPLIT``
    cost more to merge than they gain.
    """
    if sliding_window is None:
        return num_kv_splits
    return max(1, min(num_kv_splits, -(-sliding_window // MIN_TOKENS_PER_SPLIT)))


class TritonAttnBackend(AttentionBackend):
    """Paged-KV attention with Triton kernels: split-KV decode, extend over a cached prefix."""

    # The kernels read fp8_e4m3 and int8 codes, dequantizing them as they load them.
    reads_quantized_kv = True

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        _check_runs_here(args)
        device = args.device
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else _INTERPRETER_SMS)
        self.kv_indptr = torch.zeros(args.max_batch_size + 1, dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(args.max_batch_size + 1, dtype=torch.int32, device=device)
        # Decode's per-split partial outputs and log-sum-exps, float32 whatever the dtype.
        self.partial_out = torch.empty(
            (args.max_batch_size, args.num_heads, MAX_KV_SPLITS, args.head_dim),
            dtype=torch.float32, device=device)
        self.partial_lse = torch.empty((args.max_batch_size, args.num_heads, MAX_KV_SPLITS),
                                       dtype=torch.float32, device=device)
        self._metadata: TritonForwardMetadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build ``kv_indptr``/``kv_indices`` (and ``qo_indptr`` or the split count) once."""
        super().init_forward_metadata(forward_batch)
        seq_lens = forward_batch.seq_lens_cpu
        assert seq_lens is not None  # filled above
        batch = forward_batch.batch_size
        if forward_batch.forward_mode.is_decode():
            kv_indptr, kv_indices = self._kv_indices(forward_batch, seq_lens)
            splits = choose_num_kv_splits(batch, self.num_kv_heads, max(seq_lens), self.num_sms)
            self._metadata = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr=None,
                                                   max_new_tokens=1, has_prefix=True,
                                                   num_kv_splits=splits)
            return
        new_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        assert new_lens is not None and prefix_lens is not None  # filled above
        kv_indptr, kv_indices = self._kv_indices(forward_batch, prefix_lens)
        qo_indptr = self.qo_indptr[: batch + 1]
        qo_indptr.copy_(_offsets(new_lens))
        self._metadata = TritonForwardMetadata(kv_indptr, kv_indices, qo_indptr,
                                               max_new_tokens=max(new_lens),
                                               has_prefix=any(prefix_lens), num_kv_splits=1)

    def _kv_indices(self, forward_batch: ForwardBatch, lens: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_indptr`` and the first ``lens[b]`` slots of each request's ``req_to_token`` row."""
        batch = forward_batch.batch_size
        kv_indptr = self.kv_indptr[: batch + 1]
        offsets = _offsets(lens)
        kv_indptr.copy_(offsets)
        total = int(offsets[-1])
        # Never empty: a kernel is handed a real pointer even when it reads nothing.
        if total == 0:
            return kv_indptr, torch.zeros(1, dtype=torch.int32, device=self.device)
        device = self.device
        counts = torch.tensor(lens, dtype=torch.int64, device=device)
        request = torch.repeat_interleave(torch.arange(batch, device=device), counts,
                                          output_size=total)
        position = torch.arange(total, device=device) - kv_indptr[:-1].long()[request]
        rows = forward_batch.req_pool_indices.to(device)[request]
        kv_indices = self.req_to_token_pool.req_to_token[rows, position].to(torch.int32)
        return kv_indptr, kv_indices

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Prefill: each request's new tokens attend to its cached prefix, then causally."""
        metadata = self._require_metadata()
        assert metadata.qo_indptr is not None  # an extend batch's metadata has it
        queries, keys, values = self._split_heads(q, k, v)
        k_buffer, v_buffer, codes = layer_kv(self.token_to_kv_pool, layer.layer_id)
        if save_kv_cache:
            store_kv(keys, values, forward_batch.out_cache_loc, k_buffer, v_buffer, codes)
        out = torch.empty(queries.shape, dtype=q.dtype, device=q.device)
        extend_attention(queries, keys, values, out, k_buffer, v_buffer, metadata.qo_indptr,
                         metadata.kv_indptr, metadata.kv_indices, metadata.max_new_tokens,
                         layer.scaling, has_prefix=metadata.has_prefix,
                         sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
                         codes=codes, new_loc=forward_batch.out_cache_loc)
        return out.view(-1, self.num_heads * self.head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decode: each request's one new token attends to its tokens (split-KV)."""
        metadata = self._require_metadata()
        queries, keys, values = self._split_heads(q, k, v)
        k_buffer, v_buffer, codes = layer_kv(self.token_to_kv_pool, layer.layer_id)
        if save_kv_cache:
            store_kv(keys, values, forward_batch.out_cache_loc, k_buffer, v_buffer, codes)
        out = torch.empty(queries.shape, dtype=q.dtype, device=q.device)
        decode_attention(queries, k_buffer, v_buffer, out, metadata.kv_indptr,
                         metadata.kv_indices, self.partial_out, self.partial_lse,
                         splits_within_window(metadata.num_kv_splits, layer.sliding_window),
                         layer.scaling, sliding_window=layer.sliding_window,
                         logit_cap=layer.logit_cap, codes=codes)
        return out.view(-1, self.num_heads * self.head_dim)

    def _require_metadata(self) -> TritonForwardMetadata:
        if self._metadata is None:
            raise RuntimeError("init_forward_metadata must run before the layers")
        return self._metadata

    def _split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q``/``k``/``v`` as ``[tokens, heads, dim]`` in the pool's dtype, rows contiguous."""
        dtype = self.token_to_kv_pool.dtype
        return (_heads(q, self.num_heads, self.head_dim, dtype),
                _heads(k, self.num_kv_heads, self.head_dim, dtype),
                _heads(v, self.num_kv_heads, self.head_dim, dtype))


def _heads(x: torch.Tensor, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[tokens, heads * dim]`` viewed as ``[tokens, heads, dim]`` (copied if it must)."""
    x = x.to(dtype).reshape(-1, num_heads, head_dim)
    # The kernels step through a token's heads and dims with unit stride for dims.
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        x = x.contiguous()
    return x


def _offsets(lengths: list[int]) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as an int32 host tensor."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def _check_runs_here(args: AttentionBackendArgs) -> None:
    """Refuse, in one line each, what the kernels cannot run on."""
    interpreted = is_interpreter()
    if args.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"the triton attention backend needs a CUDA device, not {args.device}: use "
            "--attention-backend torch (or set TRITON_INTERPRET=1 to run the kernels slowly "
            "in Triton's CPU interpreter)"
        )
    check_head_dim(args.head_dim)
    supported = [torch.float32, torch.float16]
    if not interpreted:  # the interpreter has no bfloat16 arithmetic
        supported.append(torch.bfloat16)
    if args.dtype not in supported:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in supported)
        where = " under TRITON_INTERPRET=1" if interpreted else ""
        raise ValueError(f"the triton attention backend runs {names}{where}, not {args.dtype}")
