"""Decode attention on a CPU over a float32 and an 8-bit KV pool, per backend.

One attention layer (``RadixAttention``) decodes ``--requests`` requests of ``--context``
cached tokens each (keys at shuffled pool slots), one new token a request per step, for
``--steps`` steps, on the native CPU backend (``cpu``: the kernel reads the pool in place,
8-bit codes included) and on the torch backend (``torch``: SDPA over decode keys and
values it keeps in float32 across steps, dequantized once per token), for each
``--kv-cache-dtype`` (``auto``: float32, ``fp8_e4m3``, ``int8``) and each count of query
heads (``--heads``). Each step is one layer call: the new token's keys and values written
to the pool (quantized where the pool holds codes), then attention. Reported: the
fastest and the median step (ms), one torch thread, with the machine and commit, in
``kv_codes_cpu.json`` and ``kv_codes_cpu.md`` under ``--output``::

    python benchmarks/bench_kv_codes_cpu.py
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_kv_codes_cpu.py --output DIR

(the second measures another checkout's ``framework``, whose commit it records).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework.bench.environment import run_stamp, write_results
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.attention.base import AttentionBackendArgs
from framework.layers.attention.cpu_native import CpuNativeAttnBackend
from framework.layers.attention.radix_attention import RadixAttention, bind_attention_backend
from framework.layers.attention.torch_native import TorchNativeAttnBackend
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

BACKENDS = {"cpu": CpuNativeAttnBackend, "torch": TorchNativeAttnBackend}
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
CPU = torch.device("cpu")


@dataclass
class Settings:
    """One run's shapes."""

    requests: int = 16
    context: int = 1024
    kv_heads: int = 8
    head_dim: int = 64
    heads: tuple[int, ...] = (32, 8)
    steps: int = 40


def decode_steps(settings: Settings, heads: int, backend_name: str, kv_cache_dtype: str
                 ) -> list[float]:
    """Seconds of each decode step of one layer (after one warm-up step)."""
    generator = torch.Generator().manual_seed(0)
    n, context, kv_heads, dim = (settings.requests, settings.context, settings.kv_heads,
                                 settings.head_dim)
    longest = context + settings.steps + 1
    req_pool = ReqToTokenPool(size=n + 1, max_context_len=longest, device=CPU)
    kv_pool = MHATokenToKVPool(n * longest + 1, torch.float32, kv_heads, dim, 1, CPU,
                               kv_cache_dtype)
    slots = (torch.randperm(n * longest, generator=generator) + 1).view(n, longest)
    rows = req_pool.alloc(n)
    assert rows is not None
    for row, own in zip(rows, slots, strict=True):
        req_pool.req_to_token[row, :longest] = own
        kv_pool.set_kv_buffer(0, own[:context], torch.randn(context, kv_heads, dim),
                              torch.randn(context, kv_heads, dim))
    layer = RadixAttention(heads, dim, dim**-0.5, kv_heads, 0)
    backend = BACKENDS[backend_name](AttentionBackendArgs(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool, max_batch_size=n + 1, context_len=longest,
        dtype=torch.float32, device=CPU))
    bind_attention_backend(layer, backend)
    times = []
    for step in range(settings.steps + 1):
        length = context + step + 1
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=n,
            input_ids=torch.zeros(n, dtype=torch.int64),
            positions=torch.full((n,), length - 1),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.full((n,), length),
            out_cache_loc=slots[:, length - 1].contiguous())
        backend.init_forward_metadata(batch)
        q = torch.randn(n, heads * dim)
        k, v = torch.randn(n, kv_heads * dim), torch.randn(n, kv_heads * dim)
        start = time.perf_counter()
        layer(q, k, v, batch)
        if step:  # the first step gathers the torch backend's copies
            times.append(time.perf_counter() - start)
    return times


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table."""
    lines = ["# Decode attention over 8-bit KV codes on a CPU", "",
             f"- Machine: {meta['machine']}", f"- Commit: {meta['commit']}",
             f"- Run: {meta['started_at']}", f"- Shapes: {meta['shapes']}",
             "- One torch thread; a step: the new tokens written, then attention", "",
             "| query heads | backend | KV cache | fastest step (ms) | median step (ms) |",
             "|---:|---|---|---:|---:|"]
    lines += [f"| {r['heads']} | {r['backend']} | {r['kv_cache_dtype']} | "
              f"{r['fastest_ms']:.2f} | {r['median_ms']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Measure every configuration and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=Settings.requests)
    parser.add_argument("--context", type=int, default=Settings.context)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--heads", type=int, nargs="+", default=list(Settings.heads))
    parser.add_argument("--output", default="benchmarks/results/kv_codes_cpu")
    args = parser.parse_args()
    settings = Settings(requests=args.requests, context=args.context, steps=args.steps,
                        heads=tuple(args.heads))
    torch.set_num_threads(1)
    meta = {**run_stamp(), "shapes": (
        f"{settings.requests} requests of {settings.context} cached tokens, "
        f"{settings.kv_heads} KV heads of {settings.head_dim}, float32 queries, "
        f"{settings.steps} steps")}
    rows = []
    for heads in settings.heads:
        for backend in BACKENDS:
            for kv_cache_dtype in KV_CACHE_DTYPES:
                times = decode_steps(settings, heads, backend, kv_cache_dtype)
                rows.append({"heads": heads, "backend": backend,
                             "kv_cache_dtype": kv_cache_dtype,
                             "fastest_ms": min(times) * 1e3,
                             "median_ms": statistics.median(times) * 1e3})
                print(render(rows[-1:], meta).splitlines()[-1], flush=True)
    for path in write_results(args.output, "kv_codes_cpu", {**meta, "rows": rows},
                              render(rows, meta)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
