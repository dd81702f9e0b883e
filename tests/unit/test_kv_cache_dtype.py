"""The quantized KV pool (``--kv-cache-dtype``): what it holds, what it reads back, its bytes."""

from __future__ import annotations

import pytest
import torch

from framework.mem_cache.kv_quant import check_kv_cache_dtype
from framework.mem_cache.memory_pool import MHATokenToKVPool, kv_cache_bytes_per_token

HEADS, DIM, LAYERS, SIZE = 2, 64, 2, 32
CPU = torch.device("cpu")


def _pool(kv_cache_dtype: str, dtype: torch.dtype = torch.float32) -> MHATokenToKVPool:
    return MHATokenToKVPool(SIZE, dtype, HEADS, DIM, LAYERS, CPU, kv_cache_dtype)


def _tokens(seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5, HEADS, DIM, generator=gen, dtype=torch.float64) * scale


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_tokens_read_back_within_the_format_s_rounding(kv_cache_dtype: str) -> None:
    pool = _pool(kv_cache_dtype)
    k, v = _tokens(0, 100.0), _tokens(1, 0.01)
    loc = torch.tensor([3, 7, 1, 30, 12])
    pool.set_kv_buffer(1, loc, k.float(), v.float())
    k_read, v_read = pool.read_kv(1, loc)
    assert k_read.dtype == torch.float32 and k_read.shape == (5, HEADS, DIM)
    for want, got in ((k, k_read.double()), (v, v_read.double())):
        if kv_cache_dtype == "int8":  # half a step of absmax / 127, per token and head
            bound = want.abs().amax(dim=-1, keepdim=True) / 254 * 1.01
        else:  # half a step of a 3-bit mantissa, relative; subnormals below 2^-6
            bound = want.abs() * 2.0**-4 + 2.0**-10
        assert ((got - want).abs() <= bound).all()
        assert not torch.equal(got, want)
    assert pool.get_kv_buffer(1)[0].dtype == {"fp8_e4m3": torch.float8_e4m3fn,
                                              "int8": torch.int8}[kv_cache_dtype]
    # Another layer's slots are untouched; a read keeps the slots' shape.
    assert pool.read_kv(0, loc.view(1, 5))[0].shape == (1, 5, HEADS, DIM)
    assert (pool.read_kv(0, loc)[0] == 0).all()


def test_the_model_dtype_pool_reads_back_exactly() -> None:
    pool = _pool("auto")
    k = _tokens(2, 3.0).float()
    loc = torch.tensor([4, 2, 9, 5, 6])
    pool.set_kv_buffer(0, loc, k, -k)
    k_read, v_read = pool.read_kv(0, loc)
    assert torch.equal(k_read, k) and torch.equal(v_read, -k)
    assert not pool.quantized and pool.k_scales == [None, None]


def test_eight_bit_pools_hold_about_twice_the_tokens_of_bfloat16() -> None:
    bf16 = kv_cache_bytes_per_token(HEADS, DIM, LAYERS, torch.bfloat16)
    fp8 = kv_cache_bytes_per_token(HEADS, DIM, LAYERS, torch.bfloat16, "fp8_e4m3")
    int8 = kv_cache_bytes_per_token(HEADS, DIM, LAYERS, torch.bfloat16, "int8")
    assert bf16 / fp8 == 2.0  # >= 1.9: twice the tokens in the same memory
    assert bf16 / int8 == 128 / 66 >= 1.9  # head dim 64: 64 codes + a float16 scale a head
    for kv_cache_dtype, per_token in (("auto", bf16), ("fp8_e4m3", fp8), ("int8", int8)):
        pool = _pool(kv_cache_dtype, torch.bfloat16)
        assert pool.bytes_per_token() == per_token
        assert pool.nbytes == per_token * (SIZE + 1) + (16 * LAYERS if kv_cache_dtype ==
                                                         "fp8_e4m3" else 0)


def test_an_unknown_kv_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8_e4m3, int8"):
        check_kv_cache_dtype("fp4")
