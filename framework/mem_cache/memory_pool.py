"""The paged KV cache: request slots, KV-slot allocation and the per-layer K/V buffers.

Two levels of indirection, as in SGLang:

* ``ReqToTokenPool`` maps a request slot (one row) to the KV slots of its
  tokens: ``req_to_token[req, i]`` is the KV slot of the request's token ``i``.
* ``TokenToKVPoolAllocator`` hands out KV slots; ``MHATokenToKVPool`` holds the
  keys and values of every slot for every layer.

KV slot 0 is reserved as a padding slot and never handed out, so that a
zero-filled ``req_to_token`` row never points at a live token.

``KVCachePools`` builds the three once per rank; the ``ModelRunner`` builds
it, the scheduler allocates from it and the attention backend reads and
writes through it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from framework.host_memory import available_host_memory
from framework.libc import linux_libc
from framework.mem_cache.kv_quant import (
    default_scales,
    dequantize,
    quantize,
    scale_bytes_per_head,
    storage_dtype,
)

# madvise(2) advice asking Linux for transparent huge pages.
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 1 << 21


class ReqToTokenPool:
    """Request slot → KV slots of its tokens."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, "
                f"{max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=device
        )
        self._free_slots: list[int] = list(range(size))

    def alloc(self, need: int = 1) -> list[int] | None:
        """``need`` free request slots, or ``None`` when fewer are free."""
        if need > len(self._free_slots):
            return None
        taken = self._free_slots[:need]
        self._free_slots = self._free_slots[need:]
        return taken

    def free(self, indices: int | list[int]) -> None:
        """Return request slots to the pool."""
        if isinstance(indices, int):
            indices = [indices]
        self._free_slots.extend(indices)

    def available_size(self) -> int:
        """Number of free request slots."""
        return len(self._free_slots)

    def free_indices(self) -> list[int]:
        """The free request slots (a copy, for checks)."""
        return list(self._free_slots)

    def clear(self) -> None:
        """Mark every request slot free."""
        self._free_slots = list(range(self.size))


class TokenToKVPoolAllocator:
    """Free list of KV slots ``1..size`` (slot 0 is the reserved padding slot).

    Freed slots are kept as a list of tensors and joined to the free list only
    when an allocation needs them, so freeing costs time in proportion to what
    is freed, not to the size of the free list. The join sorts the free list:
    slots freed request by request, in eviction order, would otherwise hand a
    new request's tokens out scattered over the pool; in ascending order they
    come in runs, which attention reads faster (7-10% less decode attention in
    a kernel benchmark on a pool aged by twelve jobs).
    """

    def __init__(self, size: int, device: torch.device) -> None:
        if size <= 0:
            raise ValueError(f"the KV cache needs at least one slot, got size={size}")
        self.size = size
        self.device = device
        self.clear()

    def alloc(self, need: int) -> torch.Tensor | None:
        """``need`` free KV slots (int64, on the pool's device), or ``None`` if fewer are free."""
        if need > self._available:
            return None
        if need > self._free_slots.numel():
            self._free_slots = torch.cat((self._free_slots, *self._freed)).sort().values
            self._freed = []
        taken = self._free_slots[:need]
        self._free_slots = self._free_slots[need:]
        self._available -= need
        return taken

    def free(self, indices: torch.Tensor) -> None:
        """Return KV slots to the free list."""
        if indices.numel() == 0:
            return
        self._freed.append(indices.to(self.device, torch.int64, copy=True))  # callers keep theirs
        self._available += int(indices.numel())

    def available_size(self) -> int:
        """Exact number of free KV slots."""
        return self._available

    def free_indices(self) -> torch.Tensor:
        """Every free KV slot, in no particular order (a copy, for checks, not hot paths)."""
        return torch.cat((self._free_slots, *self._freed))

    def clear(self) -> None:
        """Mark every KV slot free."""
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._freed: list[torch.Tensor] = []
        self._available = self.size


def kv_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed key or value buffer; on a Linux CPU, backed by huge pages where it can be.

    Attention reads a request's tokens from rows scattered over the buffer; with
    4 KiB pages nearly every row costs a TLB miss, with 2 MiB pages few do (a
    random layout of rows read about 20% faster). The advice is given before the
    first write, so the kernel can back the buffer with huge pages from the start.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = torch.empty(shape, dtype=dtype)
    advise_huge_pages(buffer)
    return buffer.zero_()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside ``tensor``'s memory with huge pages.

    Only advice: False where it cannot be given (not Linux, too small, refused).
    """
    start = tensor.data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    end = (start + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    libc = linux_libc()
    if end <= first or libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_HUGEPAGE) == 0


class MHATokenToKVPool:
    """Per-layer key and value buffers, ``[size + 1, num_kv_heads, head_dim]`` each.

    ``dtype`` is the model's: what attention reads and what new keys and values
    come in. With a quantized ``kv_cache_dtype`` (``kv_quant``) the buffers hold
    8-bit codes and each layer its scales; ``read_kv`` turns the tokens asked for
    back into ``dtype``.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.store_dtype = storage_dtype(kv_cache_dtype, dtype)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)  # + 1: the padding slot 0
        self.k_buffers = [kv_buffer(shape, self.store_dtype, device) for _ in range(num_layers)]
        self.v_buffers = [kv_buffer(shape, self.store_dtype, device) for _ in range(num_layers)]
        # Per layer: [kv_heads] static (fp8) or [size + 1, kv_heads] per token (int8).
        self.k_scales = [default_scales(kv_cache_dtype, size + 1, num_kv_heads, device)
                         for _ in range(num_layers)]
        self.v_scales = [default_scales(kv_cache_dtype, size + 1, num_kv_heads, device)
                         for _ in range(num_layers)]

    @property
    def quantized(self) -> bool:
        """Whether the buffers hold quantized codes rather than ``dtype`` values."""
        return self.kv_cache_dtype != "auto"

    def set_static_scales(self, layer_id: int, k: torch.Tensor | None,
                          v: torch.Tensor | None) -> None:
        """Start one layer's static (FP8) key and value scales, ``[num_kv_heads]`` each, from
        a checkpoint's (None: keep 1.0), in place, before any token is written.

        Raises:
            ValueError: a pool without static scales, or scales of another head count.
        """
        if self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError(f"a {self.kv_cache_dtype} KV cache keeps no static scales")
        for scales, new in ((self.k_scales, k), (self.v_scales, v)):
            layer_scales = scales[layer_id]
            assert layer_scales is not None  # FP8 pools keep scales
            if new is not None:
                if new.shape != layer_scales.shape:
                    raise ValueError(f"layer {layer_id}: scales of shape {tuple(new.shape)} "
                                     f"for {self.num_kv_heads} key/value heads")
                layer_scales.copy_(new)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of one layer (codes, when ``quantized``)."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write keys and values of ``n`` tokens at slots ``loc``.

        ``k`` and ``v`` are ``[n, num_kv_heads * head_dim]`` or ``[n, num_kv_heads, head_dim]``.
        """
        shape = (-1, self.num_kv_heads, self.head_dim)
        if not self.quantized:
            self.k_buffers[layer_id][loc] = k.reshape(shape).to(self.dtype)
            self.v_buffers[layer_id][loc] = v.reshape(shape).to(self.dtype)
            return
        for x, buffers, scales in ((k, self.k_buffers, self.k_scales),
                                   (v, self.v_buffers, self.v_scales)):
            layer_scales = scales[layer_id]
            assert layer_scales is not None  # quantized pools keep scales
            codes, token_scales = quantize(x.reshape(shape), layer_scales, self.kv_cache_dtype)
            buffers[layer_id][loc] = codes
            if token_scales is not None:
                layer_scales[loc] = token_scales

    def read_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape), ``[*slots.shape, kv_heads, head_dim]``
        in ``dtype``; only those tokens are dequantized."""
        flat = slots.reshape(-1)
        out = []
        for buffers, scales in ((self.k_buffers, self.k_scales),
                                (self.v_buffers, self.v_scales)):
            rows = buffers[layer_id].index_select(0, flat)
            layer_scales = scales[layer_id]
            if layer_scales is not None:
                if layer_scales.dim() == 2:  # per token
                    layer_scales = layer_scales.index_select(0, flat)
                rows = dequantize(rows, layer_scales, self.dtype)
            out.append(rows.view(*slots.shape, self.num_kv_heads, self.head_dim))
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer and scale of the pool."""
        tensors = (*self.k_buffers, *self.v_buffers, *self.k_scales, *self.v_scales)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def bytes_per_token(self) -> int:
        """Bytes of K and V (and their scales) that one token takes across all layers."""
        return kv_cache_bytes_per_token(
            self.num_kv_heads, self.head_dim, self.num_layers, self.dtype, self.kv_cache_dtype
        )


@dataclass(frozen=True)
class KVCachePools:
    """The memory of one rank's KV cache, built once and handed to whoever needs it.

    ``req_to_token_pool`` has one row per request slot, ``context_len`` wide;
    ``allocator`` hands out the KV slots ``1..max_total_tokens`` of
    ``token_to_kv_pool``, whose buffers have one more row for the padding slot 0.
    """

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    allocator: TokenToKVPoolAllocator

    def __post_init__(self) -> None:
        # The allocator's slots index the K/V buffers: sizes that differ would
        # hand out slots past the buffers' end, or leave slots never used.
        if self.allocator.size != self.token_to_kv_pool.size:
            raise ValueError(
                f"the allocator has {self.allocator.size} KV slots but the K/V buffers hold "
                f"{self.token_to_kv_pool.size}"
            )
        devices = {
            self.req_to_token_pool.device, self.token_to_kv_pool.device, self.allocator.device
        }
        if len(devices) != 1:
            raise ValueError(f"the KV cache pools must share one device, got {devices}")

    @classmethod
    def build(
        cls,
        *,
        max_total_tokens: int,
        max_requests: int,
        context_len: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> KVCachePools:
        """Allocate ``max_requests`` request rows and ``max_total_tokens`` KV slots."""
        return cls(
            req_to_token_pool=ReqToTokenPool(max_requests, context_len, device),
            token_to_kv_pool=MHATokenToKVPool(
                max_total_tokens, dtype, num_kv_heads, head_dim, num_layers, device,
                kv_cache_dtype
            ),
            allocator=TokenToKVPoolAllocator(max_total_tokens, device),
        )

    def beside(self, *, dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_layers: int,
               kv_cache_dtype: str = "auto") -> KVCachePools:
        """Pools with these request rows, KV slots and allocator, and K/V buffers of their
        own: another model's cache (a draft model's) that every slot handed out here
        indexes too."""
        return KVCachePools(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=MHATokenToKVPool(
                self.allocator.size, dtype, num_kv_heads, head_dim, num_layers,
                self.allocator.device, kv_cache_dtype),
            allocator=self.allocator,
        )


def kv_cache_bytes_per_token(
    num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
    kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of K and V (and their scales) that one token takes across all layers."""
    element_size = storage_dtype(kv_cache_dtype, dtype).itemsize
    per_head = head_dim * element_size + scale_bytes_per_head(kv_cache_dtype)
    return 2 * num_kv_heads * num_layers * per_head


# The CPU's default pool: enough for every running request at full context, capped at
# this many tokens (and at what host memory allows).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 2**16


def decide_max_total_tokens(
    *,
    max_total_tokens: int | None,
    mem_fraction: float,
    bytes_per_token: int,
    context_len: int,
    max_running_requests: int,
    device: torch.device,
    ranks_sharing_memory: int = 1,
) -> int:
    """Size of the KV cache in tokens.

    ``max_total_tokens`` wins when given. Otherwise, on CUDA, ``mem_fraction`` of
    the memory free now (after the weights are loaded) goes to the KV cache; on
    other devices the size is ``min(context_len * max_running_requests,
    CPU_DEFAULT_MAX_TOTAL_TOKENS)``, lowered to what ``mem_fraction`` of the
    host memory available now holds, split evenly between the
    ``ranks_sharing_memory`` scheduler ranks of this machine.

    Raises:
        ValueError: a size or fraction out of range, or no memory left for one token.
    """
    if max_total_tokens is not None:
        if max_total_tokens <= 0:
            raise ValueError(f"--max-total-tokens must be > 0, got {max_total_tokens}")
        return max_total_tokens
    if not 0.0 < mem_fraction <= 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {mem_fraction}")
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return _tokens_that_fit(free_bytes, mem_fraction, bytes_per_token, "device")
    default = min(context_len * max_running_requests, CPU_DEFAULT_MAX_TOTAL_TOKENS)
    available = available_host_memory()
    if available is None:
        return default
    share = available // max(ranks_sharing_memory, 1)
    return min(default, _tokens_that_fit(share, mem_fraction, bytes_per_token, "host"))


def _tokens_that_fit(free_bytes: int, mem_fraction: float, bytes_per_token: int,
                     memory: str) -> int:
    tokens = int(free_bytes * mem_fraction) // bytes_per_token
    if tokens <= 0:
        raise ValueError(
            f"no {memory} memory left for the KV cache ({free_bytes} bytes free, "
            f"{bytes_per_token} needed a token); use a smaller model or raise --mem-fraction"
        )
    return tokens
