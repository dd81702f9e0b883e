"""The KV cache pools: request slots, KV-slot accounting, per-layer K/V buffers, sizing,
and the three built together as ``KVCachePools``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.mem_cache import KVCachePools as ExportedKVCachePools
from framework.mem_cache import memory_pool
from framework.mem_cache.memory_pool import (
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    KVCachePools,
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    decide_max_total_tokens,
    kv_cache_bytes_per_token,
)

CPU = torch.device("cpu")


def test_req_to_token_pool_allocates_each_row_once_and_takes_rows_back() -> None:
    pool = ReqToTokenPool(size=4, max_context_len=16, device=CPU)
    assert pool.req_to_token.shape == (4, 16)
    assert pool.req_to_token.dtype == torch.int64
    first = pool.alloc(3)
    assert first is not None and len(set(first)) == 3
    assert pool.available_size() == 1
    assert pool.alloc(2) is None, "more rows than are free must fail, not over-allocate"
    last = pool.alloc()
    assert last is not None and set(last).isdisjoint(first)
    assert pool.available_size() == 0
    pool.free(first[0])
    pool.free(first[1:] + last)
    assert pool.available_size() == 4
    assert sorted(pool.alloc(4) or []) == [0, 1, 2, 3]


def test_req_to_token_pool_rejects_empty_shapes() -> None:
    with pytest.raises(ValueError, match="size"):
        ReqToTokenPool(size=0, max_context_len=8, device=CPU)


def test_allocator_never_hands_out_the_padding_slot() -> None:
    allocator = TokenToKVPoolAllocator(size=10, device=CPU)
    assert allocator.available_size() == 10
    slots = allocator.alloc(10)
    assert slots is not None and slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, 11))
    assert allocator.alloc(1) is None
    assert allocator.available_size() == 0


def test_freed_slots_come_back_in_ascending_order() -> None:
    """Freed out of order (as requests end), they are handed out in runs again."""
    allocator = TokenToKVPoolAllocator(size=12, device=CPU)
    held = allocator.alloc(12)
    assert held is not None
    for part in ([9, 10, 11], [1, 2], [12], [5, 6, 7, 8], [3, 4]):
        allocator.free(torch.tensor(part))
    assert allocator.alloc(12).tolist() == list(range(1, 13))


def test_allocator_reuses_freed_slots_and_refuses_too_large_requests() -> None:
    allocator = TokenToKVPoolAllocator(size=8, device=CPU)
    held = allocator.alloc(6)
    assert held is not None
    assert allocator.alloc(3) is None, "a failed alloc must not take any slot"
    assert allocator.available_size() == 2
    allocator.free(held[:4])
    assert allocator.available_size() == 6
    again = allocator.alloc(6)
    assert again is not None
    assert set(again.tolist()).isdisjoint(held[4:].tolist())
    allocator.free(torch.empty(0, dtype=torch.int64))
    assert allocator.available_size() == 0
    allocator.clear()
    assert allocator.available_size() == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=7)), max_size=40))
def test_allocator_accounting_holds_for_any_alloc_free_sequence(
    ops: list[tuple[bool, int]],
) -> None:
    size = 16
    allocator = TokenToKVPoolAllocator(size=size, device=CPU)
    held: list[torch.Tensor] = []
    for is_alloc, amount in ops:
        if is_alloc:
            slots = allocator.alloc(amount)
            if slots is None:
                assert amount > allocator.available_size()
            else:
                held.append(slots)
        elif held:
            allocator.free(held.pop(amount % len(held)))
        in_use = torch.cat(held).tolist() if held else []
        assert len(in_use) == len(set(in_use)), "a slot was handed out twice"
        assert 0 not in in_use
        assert allocator.available_size() + len(in_use) == size


def test_kv_pool_writes_both_layouts_casts_dtype_and_keeps_layers_apart() -> None:
    pool = MHATokenToKVPool(
        size=6, dtype=torch.bfloat16, num_kv_heads=2, head_dim=3, num_layers=2, device=CPU
    )
    k_buffer, v_buffer = pool.get_kv_buffer(1)
    assert k_buffer.shape == (7, 2, 3) and v_buffer.dtype == torch.bfloat16
    loc = torch.tensor([5, 2])
    k_flat = torch.randn(2, 6)
    v_heads = torch.randn(2, 2, 3)
    pool.set_kv_buffer(1, loc, k_flat, v_heads)
    torch.testing.assert_close(k_buffer[loc], k_flat.view(2, 2, 3).to(torch.bfloat16))
    torch.testing.assert_close(v_buffer[loc], v_heads.to(torch.bfloat16))
    untouched = torch.tensor([0, 1, 3, 4, 6])
    assert not k_buffer[untouched].any() and not v_buffer[untouched].any()
    assert not pool.get_kv_buffer(0)[0].any(), "writing layer 1 must not touch layer 0"


def test_bytes_per_token_counts_keys_and_values_of_every_layer() -> None:
    assert kv_cache_bytes_per_token(8, 128, 32, torch.float16) == 2 * 8 * 128 * 32 * 2
    assert kv_cache_bytes_per_token(2, 16, 2, torch.float32) == 2 * 2 * 16 * 2 * 4
    pool = MHATokenToKVPool(4, torch.float32, 2, 16, 2, CPU)
    assert pool.bytes_per_token() == kv_cache_bytes_per_token(2, 16, 2, torch.float32)


def test_sizing_prefers_explicit_tokens_and_caps_the_cpu_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_pool, "available_host_memory", lambda: 1 << 40)
    common = {"mem_fraction": 0.8, "bytes_per_token": 1024, "device": CPU}
    explicit = decide_max_total_tokens(
        max_total_tokens=1234, context_len=100, max_running_requests=2, **common
    )
    assert explicit == 1234
    small = decide_max_total_tokens(
        max_total_tokens=None, context_len=256, max_running_requests=8, **common
    )
    assert small == 256 * 8
    large = decide_max_total_tokens(
        max_total_tokens=None, context_len=32768, max_running_requests=64, **common
    )
    assert large == CPU_DEFAULT_MAX_TOTAL_TOKENS
    with pytest.raises(ValueError, match="max-total-tokens"):
        decide_max_total_tokens(
            max_total_tokens=0, context_len=100, max_running_requests=2, **common
        )


def test_the_cpu_default_fits_the_host_memory_its_ranks_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common = {"max_total_tokens": None, "bytes_per_token": 1024, "context_len": 4096,
              "max_running_requests": 8, "device": CPU}
    monkeypatch.setattr(memory_pool, "available_host_memory", lambda: 10_000 * 1024)
    assert decide_max_total_tokens(mem_fraction=0.5, **common) == 5_000
    assert decide_max_total_tokens(mem_fraction=0.5, ranks_sharing_memory=4, **common) == 1_250
    # Where memory is plentiful, the default stays what the requests need at full context.
    monkeypatch.setattr(memory_pool, "available_host_memory", lambda: 1 << 40)
    assert decide_max_total_tokens(mem_fraction=0.5, **common) == 4096 * 8
    # Where the kernel does not say, the same.
    monkeypatch.setattr(memory_pool, "available_host_memory", lambda: None)
    assert decide_max_total_tokens(mem_fraction=0.5, **common) == 4096 * 8
    monkeypatch.setattr(memory_pool, "available_host_memory", lambda: 1000)
    with pytest.raises(ValueError, match="no host memory left for the KV cache"):
        decide_max_total_tokens(mem_fraction=0.8, **common)
    with pytest.raises(ValueError, match="mem-fraction"):
        decide_max_total_tokens(mem_fraction=1.5, **common)


def test_kv_cache_pools_build_consistent_shapes() -> None:
    pools = KVCachePools.build(
        max_total_tokens=40, max_requests=5, context_len=24, dtype=torch.bfloat16,
        num_kv_heads=2, head_dim=4, num_layers=3, device=CPU,
    )
    assert KVCachePools is ExportedKVCachePools
    assert pools.req_to_token_pool.req_to_token.shape == (5, 24)
    assert pools.req_to_token_pool.available_size() == 5
    assert pools.allocator.size == pools.token_to_kv_pool.size == 40
    assert pools.allocator.available_size() == 40
    assert len(pools.token_to_kv_pool.k_buffers) == len(pools.token_to_kv_pool.v_buffers) == 3
    for layer in range(3):
        k_buffer, v_buffer = pools.token_to_kv_pool.get_kv_buffer(layer)
        # One row per KV slot the allocator can hand out, plus the padding slot 0.
        assert k_buffer.shape == v_buffer.shape == (41, 2, 4)
        assert k_buffer.dtype == v_buffer.dtype == torch.bfloat16
    slots = pools.allocator.alloc(40)
    assert slots is not None and int(slots.max()) < pools.token_to_kv_pool.k_buffers[0].shape[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pools.allocator = TokenToKVPoolAllocator(40, CPU)  # type: ignore[misc]


def test_kv_cache_pools_refuse_an_allocator_that_does_not_match_the_buffers() -> None:
    with pytest.raises(ValueError, match="KV slots"):
        KVCachePools(
            req_to_token_pool=ReqToTokenPool(2, 8, CPU),
            token_to_kv_pool=MHATokenToKVPool(16, torch.float32, 1, 4, 1, CPU),
            allocator=TokenToKVPoolAllocator(17, CPU),
        )


def test_on_cuda_the_pool_leaves_room_for_the_backend_s_kept_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend keeps up to a second copy of the KV: the pool gets half the room."""
    from types import SimpleNamespace

    from framework.layers.attention.torch_native import TorchNativeAttnBackend
    from framework.model_executor.model_runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000_000, 80_000_000))
    config = SimpleNamespace(num_kv_heads_per_rank=lambda tp: 2, head_dim=16, context_len=64)
    runner = SimpleNamespace(
        model_config=config, tp_size=1, start_layer=0, end_layer=2, dtype=torch.float32,
        device=torch.device("cuda", 0), attention_backend="torch", parallel=None,
        server_args=SimpleNamespace(max_total_tokens=None, mem_fraction=0.5,
                                    max_running_requests=4, dp_size=1, kv_cache_dtype="auto"))
    per_token = kv_cache_bytes_per_token(2, 16, 2, torch.float32)
    assert TorchNativeAttnBackend.extra_kv_copies == 1.0
    tokens = ModelRunner._decide_kv_cache_tokens(runner, 0)  # type: ignore[arg-type]
    assert tokens == 5_000_000 // (2 * per_token)
    # A draft model's KV cache beside it (its bytes per slot) is counted too.
    tokens = ModelRunner._decide_kv_cache_tokens(runner, 100)  # type: ignore[arg-type]
    assert tokens == 5_000_000 // (2 * per_token + 100)
    # An 8-bit pool: its codes and scales, and kept copies in the model's dtype.
    runner.server_args.kv_cache_dtype = "int8"
    codes = kv_cache_bytes_per_token(2, 16, 2, torch.float32, "int8")
    assert codes == 2 * 2 * 2 * (16 + 2)
    tokens = ModelRunner._decide_kv_cache_tokens(runner, 0)  # type: ignore[arg-type]
    assert tokens == 5_000_000 // (codes + per_token)


def test_cpu_kv_buffers_are_zeroed_and_ask_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[int] = []
    real = memory_pool.advise_huge_pages

    def record(tensor: torch.Tensor) -> bool:
        advised.append(tensor.data_ptr())
        return real(tensor)

    monkeypatch.setattr(memory_pool, "advise_huge_pages", record)
    pool = MHATokenToKVPool(8192, torch.float32, 4, 64, 2, torch.device("cpu"))
    buffers = [*pool.k_buffers, *pool.v_buffers]
    assert sorted(advised) == sorted(b.data_ptr() for b in buffers)
    assert all(not b.any() for b in buffers)
    assert memory_pool.advise_huge_pages(torch.zeros(16)) is False  # no whole huge page in it
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():  # a Linux with THP
        # 8 MiB: at least three whole 2 MiB pages
        assert memory_pool.advise_huge_pages(torch.empty(2 * 1024 * 1024)) is True


def test_pools_beside_share_the_rows_slots_and_allocator_with_buffers_of_their_own() -> None:
    pools = KVCachePools.build(max_total_tokens=32, max_requests=4, context_len=16,
                               dtype=torch.float32, num_kv_heads=2, head_dim=8, num_layers=3,
                               device=torch.device("cpu"))
    draft = pools.beside(dtype=torch.float32, num_kv_heads=1, head_dim=4, num_layers=1)
    assert draft.req_to_token_pool is pools.req_to_token_pool
    assert draft.allocator is pools.allocator
    assert draft.token_to_kv_pool.size == pools.token_to_kv_pool.size == 32
    assert draft.token_to_kv_pool.get_kv_buffer(0)[0].shape[1:] == (1, 4)
    assert draft.token_to_kv_pool.nbytes < pools.token_to_kv_pool.nbytes
