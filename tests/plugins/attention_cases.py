"""Random paged-attention cases and their float64 reference, for the Triton kernel tests.

A case lays requests out in a KV pool the way the scheduler does: every token
gets a shuffled slot, slot 0 stays the zero padding slot, and every slot that
no request owns holds NaN, so that a kernel reading a slot it should not turns
its output NaN. The kernels' inputs (``kv_indptr``, ``kv_indices``,
``qo_indptr``) are built here directly from the slots, independently of the
backend that builds them in production.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """Requests with a cached prefix and new tokens, their pool and the kernel inputs."""

    q: torch.Tensor  # [T, heads, dim]: the new tokens' queries, packed
    k: torch.Tensor  # [T, kv_heads, dim]: the new tokens' keys, packed
    v: torch.Tensor  # [T, kv_heads, dim]
    k_buffer: torch.Tensor  # [slots + 1, kv_heads, dim]: the prefixes written, the rest NaN
    v_buffer: torch.Tensor
    keys: list[torch.Tensor]  # per request, all of its keys [seq_len, kv_heads, dim]
    values: list[torch.Tensor]
    slots: list[torch.Tensor]  # per request, the int64 KV slot of each token
    prefix_lens: list[int]
    new_lens: list[int]
    scale: float

    @property
    def new_slots(self) -> torch.Tensor:
        """``out_cache_loc``: the slots of the new tokens, packed."""
        return torch.cat([s[p:] for s, p in zip(self.slots, self.prefix_lens)])

    def indptr(self, lens: list[int]) -> torch.Tensor:
        """``[0, l0, l0 + l1, ...]`` int32 on the case's device."""
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        out[1:] = torch.tensor(lens).cumsum(0)
        return out.to(self.q.device)

    def indices(self, lens: list[int]) -> torch.Tensor:
        """The first ``lens[b]`` slots of each request, back to back, int32 (never empty)."""
        parts = [s[:n] for s, n in zip(self.slots, lens)]
        flat = torch.cat(parts) if sum(lens) else torch.zeros(1, dtype=torch.int64)
        return flat.to(device=self.q.device, dtype=torch.int32)


def make_case(
    prefix_lens: list[int],
    new_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    write_new: bool = False,
) -> PagedCase:
    """A random case; the pool holds each prefix (and the new tokens too with ``write_new``)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    pool_slots = sum(seq_lens) + 7  # a few slots nobody owns
    k_buffer = torch.full((pool_slots + 1, num_kv_heads, head_dim), float("nan"))
    v_buffer = torch.full_like(k_buffer, float("nan"))
    k_buffer[0] = v_buffer[0] = 0.0
    free = torch.randperm(pool_slots, generator=gen) + 1
    keys, values, slots = [], [], []
    queries, new_keys, new_values = [], [], []
    for prefix_len, new_len, seq_len in zip(prefix_lens, new_lens, seq_lens):
        request_slots, free = free[:seq_len], free[seq_len:]
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        cached = seq_len if write_new else prefix_len
        k_buffer[request_slots[:cached]] = key[:cached].float()
        v_buffer[request_slots[:cached]] = value[:cached].float()
        keys.append(key)
        values.append(value)
        slots.append(request_slots)
        queries.append(torch.randn(new_len, num_heads, head_dim, generator=gen).to(dtype))
        new_keys.append(key[prefix_len:])
        new_values.append(value[prefix_len:])
    return PagedCase(
        q=torch.cat(queries).to(device),
        k=torch.cat(new_keys).to(device),
        v=torch.cat(new_values).to(device),
        k_buffer=k_buffer.to(device=device, dtype=dtype),
        v_buffer=v_buffer.to(device=device, dtype=dtype),
        keys=keys, values=values, slots=slots,
        prefix_lens=list(prefix_lens), new_lens=list(new_lens),
        scale=1.0 / math.sqrt(head_dim),
    )


def reference(case: PagedCase, sliding_window: int | None = None,
              logit_cap: float | None = None) -> torch.Tensor:
    """Causal attention of every new query over its request's keys, in float64: [T, heads, dim].

    ``sliding_window`` W: the query at position ``p`` sees the keys at ``p - W < j <= p``;
    ``logit_cap`` c: scores ``s`` become ``c * tanh(s / c)`` before the softmax.
    """
    outputs = []
    start = 0
    for key, value, prefix_len, new_len in zip(case.keys, case.values, case.prefix_lens,
                                               case.new_lens):
        q = case.q[start:start + new_len].cpu().double()
        start += new_len
        group = q.shape[1] // key.shape[1]
        k = key.double().repeat_interleave(group, dim=1)
        v = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        if logit_cap is not None:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        key_pos = torch.arange(key.shape[0])[None, :]
        query_pos = torch.arange(new_len)[:, None] + prefix_len
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (NaN anywhere in ``out`` gives NaN)."""
    diff = (out.cpu().double() - ref).abs().max()
    return float(diff / ref.abs().max())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
