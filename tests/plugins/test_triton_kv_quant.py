"""The Triton attention plugin over an 8-bit KV cache (``--kv-cache-dtype fp8_e4m3|int8``).

The store kernel writes the codes and scales ``MHATokenToKVPool.set_kv_buffer``
writes, bit for bit; decode and extend dequantize codes as they load them and
match float64 attention over the pool's dequantized keys and values; an Engine
on the Triton backend gives the torch backend's greedy tokens over the same
quantized cache. Without a GPU the kernels run in Triton's CPU interpreter.

Run as a module (``python -m tests.plugins.test_triton_kv_quant``, without
``TRITON_INTERPRET``), this file compiles the kernels' 8-bit variants for sm_90
and prints one JSON line per kernel with its spilled bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from framework_triton_attention import decode, extend, kv_store
from framework_triton_attention.backend import MAX_KV_SPLITS
from framework_triton_attention.common import dot_precision
from framework_triton_attention.kv_codes import KV_FP8, KV_INT8, e4m3_to_float, layer_kv

from framework.mem_cache.memory_pool import MHATokenToKVPool
from tests.plugins.attention_cases import (
    TOLERANCE,
    PagedCase,
    make_case,
    reference,
    relative_error,
)
from tests.plugins.compile_for_gpu import DEFAULT, TARGET, arg_types, stack_bytes
from tests.plugins.greedy_rule import assert_same_greedy, two_greedy_rounds

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KV_DTYPES = ("fp8_e4m3", "int8")
# Static fp8 scales per KV head: unlike 1.0, a kernel that drops them is far off.
FP8_SCALES = (0.02, 0.05)


def quantized_pool(case: PagedCase, kv_cache_dtype: str, dtype: torch.dtype,
                   cached: list[int]) -> MHATokenToKVPool:
    """A one-layer pool holding each request's first ``cached[b]`` tokens as codes.

    Every slot no request owns reads as NaN (an E4M3 NaN code; a NaN int8 scale),
    so that a kernel reading one turns its output NaN.
    """
    num_kv_heads, head_dim = case.k.shape[1], case.k.shape[2]
    pool = MHATokenToKVPool(case.k_buffer.shape[0] - 1, dtype, num_kv_heads, head_dim, 1,
                            DEVICE, kv_cache_dtype)
    owned = torch.cat(case.slots)
    unowned = torch.ones(pool.size + 1, dtype=torch.bool)
    unowned[owned] = False
    unowned[0] = False
    if kv_cache_dtype == "fp8_e4m3":
        for scales in (pool.k_scales[0], pool.v_scales[0]):
            scales.copy_(torch.tensor(FP8_SCALES))
        for buffer in pool.get_kv_buffer(0):
            buffer.view(torch.uint8)[unowned.to(DEVICE)] = 0x7F
    else:
        for scales in (pool.k_scales[0], pool.v_scales[0]):
            scales[unowned.to(DEVICE)] = float("nan")
    for key, value, slots, n in zip(case.keys, case.values, case.slots, cached):
        pool.set_kv_buffer(0, slots[:n].to(DEVICE), key[:n].to(DEVICE), value[:n].to(DEVICE))
    return pool


def as_the_pool_holds_them(case: PagedCase, pool: MHATokenToKVPool) -> PagedCase:
    """The case with every request's keys and values dequantized from the pool."""
    keys, values = zip(*(pool.read_kv(0, slots.to(DEVICE)) for slots in case.slots))
    return dataclasses.replace(case, keys=[k.cpu() for k in keys],
                               values=[v.cpu() for v in values])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_decode_reads_codes(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    case = make_case([6, 40, 1], [1, 1, 1], 4, 2, 16, dtype, DEVICE, seed=11)
    pool = quantized_pool(case, kv_cache_dtype, dtype, [p + 1 for p in case.prefix_lens])
    k_buffer, v_buffer, codes = layer_kv(pool, 0)
    seq_lens = [p + 1 for p in case.prefix_lens]
    out = torch.empty_like(case.q)
    partial_out = torch.empty(3, 4, MAX_KV_SPLITS, 16, device=DEVICE)
    partial_lse = torch.empty(3, 4, MAX_KV_SPLITS, device=DEVICE)
    decode.decode_attention(case.q, k_buffer, v_buffer, out, case.indptr(seq_lens),
                            case.indices(seq_lens), partial_out, partial_lse, 3, case.scale,
                            codes=codes)
    ref = reference(as_the_pool_holds_them(case, pool))
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_extend_stores_then_reads_codes(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    case = make_case([5, 0, 9], [3, 4, 1], 4, 2, 16, dtype, DEVICE, seed=3)
    pool = quantized_pool(case, kv_cache_dtype, dtype, case.prefix_lens)
    k_buffer, v_buffer, codes = layer_kv(pool, 0)
    new_loc = case.new_slots.to(DEVICE)
    kv_store.store_kv(case.k, case.v, new_loc, k_buffer, v_buffer, codes)
    out = torch.empty_like(case.q)
    # The new tokens too are read as the pool holds them, not from the step's k and v.
    unread = torch.full_like(case.k, float("nan"))
    extend.extend_attention(case.q, unread, unread, out, k_buffer, v_buffer,
                            case.indptr(case.new_lens), case.indptr(case.prefix_lens),
                            case.indices(case.prefix_lens), max(case.new_lens), case.scale,
                            codes=codes, new_loc=new_loc)
    ref = reference(as_the_pool_holds_them(case, pool))
    assert relative_error(out, ref) < TOLERANCE[dtype]


def fp8_store_targets() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between two (ties), their negatives, and
    values past ±448 (clamped): what ``x / scale`` is made to hit exactly."""
    finite = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (finite[:-1] + finite[1:]) / 2
    targets = torch.cat([finite, midpoints, torch.tensor([448.5, 500.0, 1e6])])
    return torch.cat([targets, -targets])


def int8_store_rows() -> torch.Tensor:
    """Rows of 16 that hit int8's ties (scale 0.5: ``x / scale`` = k + 1/2), an all-zero
    row (the smallest scale) and random rows of widely different ranges."""
    ties = torch.tensor([63.5, 0.25, 0.75, 1.25, -1.25, -0.25, -0.75, 2.25,
                         -2.25, 31.25, -31.75, 62.75, -63.25, 0.0, 5.25, -5.75])
    gen = torch.Generator().manual_seed(7)
    spread = torch.logspace(-3, 3, 30)[:, None]
    return torch.cat([ties[None], torch.zeros(1, 16), torch.randn(30, 16, generator=gen) * spread])


def store_both_ways(kv_cache_dtype: str, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[MHATokenToKVPool, MHATokenToKVPool]:
    """The same keys and values stored by ``set_kv_buffer`` and by the store kernel."""
    num_tokens, num_kv_heads, head_dim = k.shape
    pools = [MHATokenToKVPool(num_tokens + 3, k.dtype, num_kv_heads, head_dim, 1, DEVICE,
                              kv_cache_dtype) for _ in range(2)]
    if kv_cache_dtype == "fp8_e4m3":
        for pool in pools:
            pool.k_scales[0].copy_(torch.tensor([1.0, 0.25]))
            pool.v_scales[0].copy_(torch.tensor([0.25, 1.0]))
    loc = (torch.randperm(num_tokens + 3, generator=torch.Generator().manual_seed(1))
           [:num_tokens] + 1).to(DEVICE)
    k, v = k.to(DEVICE), v.to(DEVICE)
    pools[0].set_kv_buffer(0, loc, k, v)
    k_buffer, v_buffer, codes = layer_kv(pools[1], 0)
    kv_store.store_kv(k, v, loc, k_buffer, v_buffer, codes)
    return pools[0], pools[1]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_the_store_kernel_writes_the_pools_codes_and_scales(kv_cache_dtype: str) -> None:
    if kv_cache_dtype == "fp8_e4m3":
        targets = fp8_store_targets()
        targets = torch.cat([targets, torch.zeros(-targets.numel() % 32)]).view(-1, 2, 16)
        # x / scale hits each target exactly: the scales are powers of two.
        k = targets * torch.tensor([1.0, 0.25])[:, None]
        v = targets.flip(0) * torch.tensor([0.25, 1.0])[:, None]
    else:
        k = int8_store_rows().view(-1, 2, 16)
        v = -k.flip(0)
    for dtype in (torch.float32, torch.float16):
        expected, got = store_both_ways(kv_cache_dtype, k.to(dtype), v.to(dtype))
        for want, have in zip(expected.get_kv_buffer(0), got.get_kv_buffer(0)):
            assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got.k_scales[0], expected.k_scales[0])
        assert torch.equal(got.v_scales[0], expected.v_scales[0])


@triton.jit
def _widen_kernel(code_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, e4m3_to_float(tl.load(code_ptr + offsets)))


def test_every_e4m3_code_widens_exactly() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    _widen_kernel[(1,)](codes, out, N=256)
    expected = codes.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def generate(model_dir: Path, backend: str, kv_cache_dtype: str) -> list[dict[str, Any]]:
    """Greedy outputs of the prompts, then of the prompts grown (their prefix cached)."""
    return two_greedy_rounds(model_dir, PROMPTS, GREEDY, attention_backend=backend,
                             device=DEVICE.type, kv_cache_dtype=kv_cache_dtype)


def test_an_engine_gives_the_torch_backends_greedy_tokens_over_codes(
        tiny_checkpoint: Callable[..., Path]) -> None:
    # int8 only: its per-token scales are written and read on both paths; fp8's kernels
    # are checked above (an Engine under the interpreter costs minutes).
    model_dir = tiny_checkpoint("llama", seed=5)
    for got, ref in zip(generate(model_dir, "triton", "int8"),
                        generate(model_dir, "torch", "int8"), strict=True):
        assert_same_greedy(got, ref)


ROOT = Path(__file__).resolve().parents[2]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# The pointer types of a quantized layer's buffers (E4M3 as bytes) and scales, by format.
CODE_TYPES = {"fp8_e4m3": ("*u8", "*fp32"), "int8": ("*i8", "*fp16")}
FORMATS = {"fp8_e4m3": KV_FP8.value, "int8": KV_INT8.value}


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="this Triton build has no bundled CUDA tools")
def test_the_code_reading_kernels_compile_for_sm90_without_spilling(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-m", "tests.plugins.test_triton_kv_quant"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # 2 formats x (3 dtypes x (decode + extend) + the store kernel)
    assert len(rows) == 14
    spilled = [row for row in rows if row["stack_bytes"]]
    assert not spilled, spilled


def code_configurations(kv_cache_dtype: str, dtype: torch.dtype
                        ) -> list[tuple[str, Any, dict[str, Any], int]]:
    """The code-reading kernels as the launchers configure them at head dim 256 (the
    largest tiles) and 8 query heads per KV head (their tiles are those of any group)."""
    fmt = FORMATS[kv_cache_dtype]
    token_scales = kv_cache_dtype == "int8"
    head_dim, group = 256, 8
    block_n, decode_warps = decode.decode_config(head_dim, dtype, token_scales)
    block_m, extend_n, extend_warps = extend.extend_config(head_dim, dtype, token_scales)
    common = {"GROUP": group, "HEAD_DIM": head_dim, "DOT_PRECISION": dot_precision(dtype),
              "KV_QUANT": fmt, **DEFAULT}
    return [
        ("decode_split_codes", decode._decode_split_codes_kernel,
         {"BLOCK_H": 16, "BLOCK_N": block_n, **common}, decode_warps),
        ("extend_codes", extend._extend_codes_kernel,
         {"HAS_PREFIX": True, "BLOCK_M": block_m, "BLOCK_N": extend_n, **common},
         extend_warps),
    ]


def compile_codes_kernel(kernel: Any, kv_cache_dtype: str, dtype: torch.dtype,
                         constants: dict[str, Any], num_warps: int) -> Any:
    """``triton.compile`` of one code-reading configuration for sm_90."""
    buffer_type, scale_type = CODE_TYPES[kv_cache_dtype]
    types = arg_types(dtype)

    def of(name: str) -> str:
        if name in ("k_buffer_ptr", "v_buffer_ptr"):
            return buffer_type
        return scale_type if name in ("k_scale_ptr", "v_scale_ptr") else types(name)

    signature = {name: "constexpr" if name in constants else of(name)
                 for name in kernel.arg_names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": 2})


def compile_rows(kv_cache_dtype: str) -> list[dict[str, Any]]:
    """The report line of every code-reading kernel of one format."""
    jobs = [(name, kernel, dtype, constants, warps)
            for dtype in (torch.float32, torch.float16, torch.bfloat16)
            for name, kernel, constants, warps in code_configurations(kv_cache_dtype, dtype)]
    jobs.append(("store_kv_codes", kv_store._store_kv_codes_kernel, torch.bfloat16,
                 {"HEAD_DIM": 256, "KV_QUANT": FORMATS[kv_cache_dtype]}, 1))
    rows = []
    for name, kernel, dtype, constants, warps in jobs:
        compiled = compile_codes_kernel(kernel, kv_cache_dtype, dtype, constants, warps)
        rows.append({"kernel": name, "kv_cache_dtype": kv_cache_dtype, "dtype": str(dtype),
                     "stack_bytes": stack_bytes(compiled)})
    return rows


def main() -> int:
    """Compile the code-reading kernels of both formats (a process each); one JSON line each."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for rows in pool.map(compile_rows, KV_DTYPES):
            for row in rows:
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
