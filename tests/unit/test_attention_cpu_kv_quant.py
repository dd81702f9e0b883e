"""The native CPU attention kernel reading an 8-bit KV pool (``--kv-cache-dtype``).

The pool holds FP8 E4M3 codes with one float32 scale per KV head, or int8 codes with
one float16 scale per slot and KV head; the kernel widens each row it reads (code times
scale). It is checked against attention computed in float64 over the dequantized keys
and values, for float32 and bfloat16 queries, decode, prefill, extend and mixed steps,
on the tiled (head_dim a multiple of 16) and the one-query paths, with a sliding window
and a soft cap; every code is read exactly; and the CPU backend runs the kernel (not the
torch backend) on a quantized pool, for whole batches and for a few rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from framework.forward_batch import ForwardMode
from framework.layers.attention import cpu_native
from framework.layers.attention.cpu_native import CpuNativeAttnBackend
from framework.mem_cache.kv_quant import default_scales, quantize
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from tests.unit.test_attention_cpu import (
    LENGTHS,
    WINDOW_LENGTHS,
    WINDOW_WORKLOADS,
    WORKLOADS,
    float64_attention,
    kernels,
    scattered_case,
)
from tests.unit.test_attention_torch import (
    HEAD_DIM,
    assert_matches_reference,
    backend_args,
    held_by_pool,
    reference_attention,
    run_case,
)

KV_CACHE_DTYPES = ["fp8_e4m3", "int8"]
#: Every workload of the plain kernel's tests, and a mixed step (prompts, prompts after a
#: prefix and decode tokens in one batch).
QUANT_WORKLOADS = {**WORKLOADS, "mixed": [1, 2, 5, 1, 64, 1, 300, 1]}
#: Float32 queries: the float64 attention of the dequantized values, to float32 rounding.
#: Bfloat16: the same, rounded to bfloat16 once.
TOLERANCES = {torch.float32: {"atol": 2e-6, "rtol": 1e-5},
              torch.bfloat16: {"atol": 1e-5, "rtol": 2**-8}}


def quantized_pool(buffer: torch.Tensor, kv_cache_dtype: str, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``buffer`` [slots, kv_heads, dim] as the pool holds it: its codes, their scales,
    and the float64 values they stand for (code times scale).

    FP8's per-head scales differ from 1, so that a scale dropped or taken from the wrong
    head shows; int8's are each token's own.
    """
    heads = buffer.shape[1]
    if kv_cache_dtype == "fp8_e4m3":
        generator = torch.Generator().manual_seed(seed)
        scales = torch.rand(heads, generator=generator) * 1.5 + 0.25
    else:
        scales = default_scales(kv_cache_dtype, buffer.shape[0], heads, buffer.device)
    codes, token_scales = quantize(buffer, scales, kv_cache_dtype)
    if token_scales is not None:
        scales = token_scales
    values = codes.double() * scales.double()[..., None]
    return codes, scales, values


def quantized_case(heads: int, kv_heads: int, dim: int, lens: list[int], news: list[int],
                   seed: int, kv_cache_dtype: str, dtype: torch.dtype
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...],
                              tuple[torch.Tensor, torch.Tensor]]:
    """A scattered case with 8-bit K and V: (the kernel's arguments up to the scale, the
    scales, the dequantized K and V in float64)."""
    q, k_buffer, v_buffer, *indices = scattered_case(heads, kv_heads, dim, lens, news, seed)
    k_codes, k_scale, k_values = quantized_pool(k_buffer, kv_cache_dtype, seed)
    v_codes, v_scale, v_values = quantized_pool(v_buffer * 0.5, kv_cache_dtype, seed + 1)
    args = (q.to(dtype), k_codes, v_codes, *indices)
    return args, (k_scale, v_scale), (k_values, v_values)


def check_against_float64(heads: int, kv_heads: int, dim: int, lens: list[int],
                          news: list[int], seed: int, kv_cache_dtype: str, dtype: torch.dtype,
                          window: int = 0, cap: float = 0.0) -> None:
    args, scales, (k_values, v_values) = quantized_case(heads, kv_heads, dim, lens, news,
                                                        seed, kv_cache_dtype, dtype)
    scale = dim**-0.5
    out = kernels().paged_attention(*args, scale, window, cap, *scales)
    q, _, _, *indices = args
    assert out.shape == q.shape and out.dtype == dtype
    exact = float64_attention(q, k_values, v_values, *indices, scale, window, cap)
    torch.testing.assert_close(out.double(), exact, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("workload", list(QUANT_WORKLOADS))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 128), (6, 2, 20)])
def test_kernel_on_codes_matches_float64_over_the_dequantized_pool(
        heads: int, kv_heads: int, dim: int, workload: str, kv_cache_dtype: str,
        dtype: torch.dtype) -> None:
    check_against_float64(heads, kv_heads, dim, LENGTHS, QUANT_WORKLOADS[workload],
                          heads * dim, kv_cache_dtype, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize(("window", "cap"), [(3, 0.0), (4, 2.0), (0, 2.0)])
@pytest.mark.parametrize("workload", ["decode", "mixed"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (4, 1, 20)])
def test_window_and_cap_on_codes_match_float64(heads: int, kv_heads: int, dim: int,
                                               workload: str, window: int, cap: float,
                                               kv_cache_dtype: str, dtype: torch.dtype) -> None:
    check_against_float64(heads, kv_heads, dim, WINDOW_LENGTHS, WINDOW_WORKLOADS[workload],
                          dim + window, kv_cache_dtype, dtype, window, cap)


@pytest.mark.parametrize("dim", [HEAD_DIM, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_a_request_s_decode_tokens_on_codes_attend_as_each_alone(
        kv_cache_dtype: str, dtype: torch.dtype, dim: int) -> None:
    """Decode tokens of one request at consecutive positions (a verify step's) walk its
    rows together, fetching each row once: each token's output is, bit for bit, what it
    gets as the only decode token (one vector of features a head, several, and features
    that are not a multiple of 8)."""
    prefix, count = 37, 5
    args, scales, _ = quantized_case(4, 2, dim, [prefix + count], [count], seed=4,
                                     kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    q, k_codes, v_codes, table, rows, _, _ = args
    visible = torch.arange(prefix + 1, prefix + count + 1)
    scale = dim**-0.5
    together = kernels().paged_attention(q, k_codes, v_codes, table, rows.repeat(count),
                                         visible, torch.ones(count, dtype=torch.int64),
                                         scale, 0, 0.0, *scales)
    for i in range(count):
        alone = kernels().paged_attention(q[i:i + 1].contiguous(), k_codes, v_codes, table,
                                          rows, visible[i:i + 1], torch.ones(1, dtype=torch.int64),
                                          scale, 0, 0.0, *scales)
        assert torch.equal(together[i], alone[0]), i


def every_code(kv_cache_dtype: str) -> torch.Tensor:
    """The 256 codes of the format [1, 1, 256] (E4M3's two NaN codes as zeros)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_cache_dtype == "int8":
        return bits.view(torch.int8).view(1, 1, 256)
    bits[(bits & 0x7F) == 0x7F] = 0
    return bits.view(torch.float8_e4m3fn).view(1, 1, 256)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_every_code_is_read_exactly(kv_cache_dtype: str) -> None:
    """A request of one token returns its value row: code times scale, bit for bit, FP8's
    subnormals included (the vector path: head_dim 256)."""
    codes = every_code(kv_cache_dtype)
    if kv_cache_dtype == "fp8_e4m3":
        bits = codes.view(torch.uint8)
        assert (((bits & 0x78) == 0) & ((bits & 0x07) != 0)).sum() == 14  # the subnormals
        v_scale = torch.tensor([0.75])
    else:
        v_scale = torch.tensor([[0.0], [0.75]], dtype=torch.float16)  # slot 1's is 0.75
    pool = torch.cat([torch.zeros_like(codes), codes])  # the token in slot 1
    k_scale = torch.ones_like(v_scale)
    table = torch.tensor([[1]])
    one = torch.ones(1, dtype=torch.int64)
    q = torch.randn(1, 1, 256)
    out = kernels().paged_attention(q, pool, pool, table, torch.zeros_like(one), one, one,
                                    1.0, 0, 0.0, k_scale, v_scale)
    want = (codes.float() * 0.75).view(1, 1, 256)
    assert torch.equal(out, want)


def test_the_fp8_cases_hold_subnormal_codes() -> None:
    """The pools of the checks above hold FP8 subnormal codes, so their reading counts."""
    args, _, _ = quantized_case(4, 4, 64, LENGTHS, LENGTHS, 256, "fp8_e4m3", torch.float32)
    bits = args[1].view(torch.uint8)
    assert (((bits & 0x78) == 0) & ((bits & 0x07) != 0)).sum() > 100


def test_bad_scales_are_refused_with_a_reason() -> None:
    ops = kernels()
    args, (k_scale, v_scale), _ = quantized_case(4, 2, 16, [5, 9], [2, 1], 1, "int8",
                                                 torch.float32)
    fp8_args, (fp8_k, fp8_v), _ = quantized_case(4, 2, 16, [5, 9], [2, 1], 1, "fp8_e4m3",
                                                 torch.float32)
    with pytest.raises(RuntimeError, match="need k_scale and v_scale"):
        ops.paged_attention(*args, 1.0)
    with pytest.raises(RuntimeError, match=r"float16 scales \[slots, kv_heads\]"):
        ops.paged_attention(*args, 1.0, 0, 0.0, k_scale.float(), v_scale)
    with pytest.raises(RuntimeError, match=r"float16 scales \[slots, kv_heads\]"):
        ops.paged_attention(*args, 1.0, 0, 0.0, k_scale, v_scale[:-1])
    with pytest.raises(RuntimeError, match=r"float32 scales \[kv_heads\]"):
        ops.paged_attention(*fp8_args, 1.0, 0, 0.0, fp8_k, fp8_v[:1])
    q, _, _, *indices = fp8_args
    plain = torch.zeros(fp8_args[1].shape)
    with pytest.raises(RuntimeError, match="8-bit KV codes only"):
        ops.paged_attention(q, plain, plain, *indices, 1.0, 0, 0.0, fp8_k, fp8_v)
    with pytest.raises(RuntimeError, match="KV buffers alike"):
        ops.paged_attention(q, fp8_args[1], args[2], *indices, 1.0, 0, 0.0, fp8_k, fp8_v)


class RecordingKernels:
    """The kernels, with the scales of each attention call recorded."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.scales: list[tuple[Any, ...]] = []

    def paged_attention(self, *args: Any) -> torch.Tensor:
        self.scales.append(args[10:])
        return self.ops.paged_attention(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_the_backend_runs_the_kernel_on_a_quantized_pool(kv_cache_dtype: str,
                                                         dtype: torch.dtype) -> None:
    kernels()
    req_pool = ReqToTokenPool(size=2, max_context_len=16, device=torch.device("cpu"))
    kv_pool = MHATokenToKVPool(16, dtype, 2, 8, 1, torch.device("cpu"), kv_cache_dtype)
    assert kv_pool.quantized
    assert CpuNativeAttnBackend(backend_args(req_pool, kv_pool, 4, dtype=dtype)).native


#: (decode or extend, each request's cached tokens, its new tokens, decode tokens at the
#: end of the batch, the rows asked for (None: all), the layer's window and cap).
BACKEND_STEPS = {
    "decode": (ForwardMode.DECODE, [9, 2, 5, 17], [1, 1, 1, 1], 0, None, None),
    "mixed": (ForwardMode.EXTEND, [0, 5, 17, 9, 12], [7, 6, 4, 1, 1], 2, None, (4, 2.0)),
    "rows": (ForwardMode.EXTEND, [0, 5, 0, 17], [7, 1, 12, 4], 0,
             torch.tensor([6, 7, 19, 23, 2]), None),
}


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("step", list(BACKEND_STEPS))
def test_the_backend_attends_the_codes_it_wrote(monkeypatch: pytest.MonkeyPatch, step: str,
                                                kv_cache_dtype: str) -> None:
    """The backend quantizes the new tokens into the pool and the kernel reads every token
    there with the layer's scales: the float64 attention of what the pool holds."""
    recording = RecordingKernels(kernels())
    monkeypatch.setattr(cpu_native, "load_cpu_kernels", lambda: recording)
    mode, prefix_lens, new_lens, decode_tail, rows, variant = BACKEND_STEPS[step]
    requests, output, kv_pool, _ = run_case(mode, prefix_lens, new_lens, 4, 2, seed=3,
                                            backend_cls=CpuNativeAttnBackend,
                                            query_rows=rows, variant=variant,
                                            decode_tail=decode_tail,
                                            kv_cache_dtype=kv_cache_dtype)
    # The layer's own scales, one call.
    assert len(recording.scales) == 1
    k_scale, v_scale = recording.scales[0]
    assert k_scale is kv_pool.k_scales[1] and v_scale is kv_pool.v_scales[1]
    held = held_by_pool(kv_pool, requests)
    if rows is None:
        assert_matches_reference(held, output, 4, variant)
        return
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in held])[rows]
    torch.testing.assert_close(output.view(-1, 4, HEAD_DIM).double(), expected, atol=1e-5,
                               rtol=1e-5)
