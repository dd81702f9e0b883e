"""Benchmark and check the Triton attention kernels on a CUDA GPU.

At Llama-3-8B's head layout (32 query heads, 8 KV heads, head dim 128), for
each dtype and size:

* **decode** (split-KV, batch 1-256, context 128-32k, keys at shuffled pool
  slots): error against a float64 reference on a few requests, time with
  ``triton.testing.do_bench``, achieved bandwidth (K/V bytes read per second)
  and its fraction of a measured device-to-device copy; beside it torch SDPA
  on the same keys laid out contiguously (no paging), and FlashAttention's
  ``flash_attn_with_kvcache`` when ``flash_attn`` is installed;
* **extend** (new tokens over a cached prefix, and prefill with none): error,
  time, TFLOP/s, beside torch SDPA on contiguous keys.

Writes ``attention.json`` and ``attention.md`` (machine, GPU, commit) to
``--output`` (default ``benchmarks/results/attention``). Run on a GPU machine::

    python benchmarks/bench_attention.py            # full run, a few minutes
    python benchmarks/bench_attention.py --quick    # a handful of sizes

Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DECODE_BATCHES = [1, 8, 64, 256]
DECODE_CONTEXTS = [128, 1024, 4096, 32768]
# (batch, cached prefix, new tokens) per request.
EXTEND_SHAPES = [(1, 0, 4096), (8, 0, 1024), (4, 4096, 512), (16, 1024, 128), (1, 32768, 256)]
QUICK_DECODE = [(1, 4096), (64, 4096), (256, 1024)]
QUICK_EXTEND = [(8, 0, 1024), (4, 4096, 512)]
# K/V bytes above which a size is skipped (the SDPA baseline needs a second copy).
MAX_KV_BYTES = 24 << 30
# Requests per size checked against float64 (the reference is slow at 32k context).
CHECKED_REQUESTS = 3
GOAL = "decode at batch 64 x 4k context >= 60% of the measured copy bandwidth"


@dataclass
class Row:
    """One measured size of one kernel."""

    kernel: str
    dtype: str
    batch: int
    prefix: int  # cached tokens per request (decode: context - 1)
    new: int  # new tokens per request (decode: 1)
    error: float  # max|out - ref| / max|ref| on the checked requests
    within_tolerance: bool
    triton_us: float
    sdpa_us: float | None
    flash_us: float | None
    gbps: float  # K/V (and q, o) bytes moved per second by the Triton kernel
    copy_fraction: float  # gbps / measured device-to-device copy
    tflops: float


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of sizes")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32",
                        help="comma list of float16, bfloat16, float32")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU and none is visible; the kernels' CPU tests "
              "run with: pytest tests/plugins (Triton's interpreter)", file=sys.stderr)
        return 2
    # Runs from a checkout: the framework and the plugin need not be installed.
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "triton_attention")]
    import triton.testing

    from framework.bench.environment import git_commit, machine_description

    device = torch.device("cuda")
    copy_gbps = measure_copy_bandwidth(device, triton.testing.do_bench)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    rows: list[Row] = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        decode_sizes = QUICK_DECODE if args.quick else [
            (b, c) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
        for batch, context in decode_sizes:
            if kv_bytes(batch * context, dtype) > MAX_KV_BYTES:
                continue
            rows.append(bench_decode(batch, context, dtype, device, copy_gbps))
            print(format_row(rows[-1]), flush=True)
        for batch, prefix, new in QUICK_EXTEND if args.quick else EXTEND_SHAPES:
            rows.append(bench_extend(batch, prefix, new, dtype, device, copy_gbps))
            print(format_row(rows[-1]), flush=True)
    environment = {
        "machine": machine_description(),
        "gpu": torch.cuda.get_device_name(device),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flash_attn": flash_attn_version(),
        "copy_gbps": copy_gbps,
        "heads": [NUM_HEADS, NUM_KV_HEADS, HEAD_DIM],
    }
    write_results(rows, environment, args.output)
    failed = [r for r in rows if not r.within_tolerance]
    for row in failed:
        print(f"ERROR over tolerance: {format_row(row)}", file=sys.stderr)
    return 1 if failed else 0


def kv_bytes(tokens: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values for ``tokens`` tokens at the benchmark's head layout."""
    return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def measure_copy_bandwidth(device: torch.device, do_bench: Callable[..., float]) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


@dataclass
class PagedBatch:
    """Requests at shuffled slots of a pool, plus the same keys contiguous for the baselines."""

    k_buffer: torch.Tensor  # [slots + 1, kv_heads, dim]
    v_buffer: torch.Tensor
    slots: torch.Tensor  # [batch, seq_len] int64 slot of each token
    kv_indptr: torch.Tensor  # int32
    kv_indices: torch.Tensor  # int32


def make_paged(batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
               gen: torch.Generator) -> PagedBatch:
    """``batch`` requests of ``seq_len`` tokens each, at a random permutation of the slots."""
    tokens = batch * seq_len
    shape = (tokens + 1, NUM_KV_HEADS, HEAD_DIM)
    k_buffer = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_buffer = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    slots = (torch.randperm(tokens, generator=gen, device=device) + 1).view(batch, seq_len)
    kv_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_len
    return PagedBatch(k_buffer, v_buffer, slots, kv_indptr, slots.flatten().to(torch.int32))


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int,
              scale: float) -> torch.Tensor:
    """float64 causal attention of ``q`` ``[n, H, D]`` over ``keys`` ``[L, KH, D]``."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    outs = []
    for start in range(0, q.shape[0], 256):  # query chunks bound the score matrix
        chunk = q[start:start + 256].double()
        scores = torch.einsum("qhd,khd->hqk", chunk, k) * scale
        pos = torch.arange(start, start + chunk.shape[0], device=q.device)[:, None] + prefix
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= pos
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def checked_requests(batch: int) -> list[int]:
    """The first, last and a middle request (fewer when the batch is smaller)."""
    return sorted({0, batch // 2, batch - 1})[:CHECKED_REQUESTS]


def bench_decode(batch: int, context: int, dtype: torch.dtype, device: torch.device,
                 copy_gbps: float) -> Row:
    """One decode size: error, Triton time, SDPA (and FlashAttention) time, bandwidth."""
    import triton.testing
    from framework_triton_attention.backend import choose_num_kv_splits
    from framework_triton_attention.decode import decode_attention

    gen = torch.Generator(device=device).manual_seed(batch * 100_003 + context)
    paged = make_paged(batch, context, dtype, device, gen)
    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_kv_splits(batch, NUM_KV_HEADS, context, num_sms)
    partial_out = torch.empty(batch, NUM_HEADS, splits, HEAD_DIM, device=device)
    partial_lse = torch.empty(batch, NUM_HEADS, splits, device=device)

    def run() -> None:
        decode_attention(q, paged.k_buffer, paged.v_buffer, out, paged.kv_indptr,
                         paged.kv_indices, partial_out, partial_lse, splits, scale)

    run()
    error = 0.0
    for b in checked_requests(batch):
        keys, values = paged.k_buffer[paged.slots[b]], paged.v_buffer[paged.slots[b]]
        ref = reference(q[b:b + 1], keys, values, context - 1, scale)
        error = max(error, relative_error(out[b:b + 1], ref))
    triton_ms = triton.testing.do_bench(run)

    # Baselines on contiguous [B, KH, L, D] keys: no paging, the best case for them.
    keys = paged.k_buffer[paged.slots].transpose(1, 2).contiguous()
    values = paged.v_buffer[paged.slots].transpose(1, 2).contiguous()
    sdpa_ms = time_sdpa(q.unsqueeze(2), keys, values, None)
    flash_ms = time_flash_decode(q, keys, values, scale)
    moved = kv_bytes(batch * context, dtype) + 2 * q.numel() * q.element_size()
    gbps = moved / (triton_ms * 1e-3) / 1e9
    flops = 4 * batch * NUM_HEADS * context * HEAD_DIM
    return Row("decode", dtype_name(dtype), batch, context - 1, 1, error,
               error <= TOLERANCE[dtype], triton_ms * 1e3, _us(sdpa_ms), _us(flash_ms),
               gbps, gbps / copy_gbps, flops / (triton_ms * 1e-3) / 1e12)


def bench_extend(batch: int, prefix: int, new: int, dtype: torch.dtype, device: torch.device,
                 copy_gbps: float) -> Row:
    """One extend size (``prefix`` 0: plain prefill): error, Triton and SDPA time, TFLOP/s."""
    import triton.testing
    from framework_triton_attention.extend import extend_attention

    gen = torch.Generator(device=device).manual_seed(batch * 7919 + prefix + new)
    seq_len = prefix + new
    paged = make_paged(batch, seq_len, dtype, device, gen)
    scale = HEAD_DIM ** -0.5
    new_slots = paged.slots[:, prefix:].flatten()
    q = torch.randn(batch * new, NUM_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    k, v = paged.k_buffer[new_slots], paged.v_buffer[new_slots]
    out = torch.full_like(q, float("nan"))
    qo_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * new
    kv_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * prefix
    kv_indices = paged.slots[:, :prefix].flatten().to(torch.int32)
    if kv_indices.numel() == 0:
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)

    def run() -> None:
        extend_attention(q, k, v, out, paged.k_buffer, paged.v_buffer, qo_indptr, kv_indptr,
                         kv_indices, new, scale, has_prefix=prefix > 0)

    run()
    error = 0.0
    for b in checked_requests(batch):
        keys, values = paged.k_buffer[paged.slots[b]], paged.v_buffer[paged.slots[b]]
        rows = slice(b * new, (b + 1) * new)
        error = max(error, relative_error(out[rows], reference(q[rows], keys, values, prefix,
                                                                scale)))
    triton_ms = triton.testing.do_bench(run)

    keys = paged.k_buffer[paged.slots].transpose(1, 2).contiguous()
    values = paged.v_buffer[paged.slots].transpose(1, 2).contiguous()
    queries = q.view(batch, new, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    mask = None
    if prefix:
        mask = (torch.arange(seq_len, device=device)[None, :]
                <= torch.arange(new, device=device)[:, None] + prefix)
    sdpa_ms = time_sdpa(queries, keys, values, mask)
    # Causal: each new token attends to the prefix and, on average, half of the new tokens.
    pairs = batch * new * (prefix + (new + 1) / 2)
    flops = 4 * pairs * NUM_HEADS * HEAD_DIM
    moved = (kv_bytes(batch * seq_len, dtype) + 2 * q.numel() * q.element_size())
    gbps = moved / (triton_ms * 1e-3) / 1e9
    return Row("extend" if prefix else "prefill", dtype_name(dtype), batch, prefix, new, error,
               error <= TOLERANCE[dtype], triton_ms * 1e3, _us(sdpa_ms), None, gbps,
               gbps / copy_gbps, flops / (triton_ms * 1e-3) / 1e12)


def time_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None) -> float | None:
    """ms of torch SDPA (GQA, causal when no mask and q has several rows); None if it fails."""
    import torch.nn.functional as F
    import triton.testing

    causal = mask is None and q.shape[2] > 1

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)

    try:
        return triton.testing.do_bench(run)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        print(f"  sdpa skipped: {str(exc).splitlines()[0]}")
        return None


def time_flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> float | None:
    """ms of FlashAttention's decode on contiguous keys, or None without ``flash_attn``."""
    if q.dtype == torch.float32:
        return None  # FlashAttention has no float32 kernels
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    import triton.testing

    k_cache = keys.transpose(1, 2).contiguous()  # [B, L, KH, D]
    v_cache = values.transpose(1, 2).contiguous()
    return triton.testing.do_bench(
        lambda: flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, softmax_scale=scale))


def flash_attn_version() -> str | None:
    """The installed ``flash_attn`` version, or None."""
    try:
        import flash_attn
    except ImportError:
        return None
    return str(flash_attn.__version__)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (NaN in ``out`` gives NaN, which fails the tolerance)."""
    return float((out.double() - ref).abs().max() / ref.abs().max())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")


def _us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def format_row(row: Row) -> str:
    """One line for the console."""
    def opt(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return (f"{row.kernel:8s} {row.dtype:9s} batch {row.batch:4d} prefix {row.prefix:6d} "
            f"new {row.new:5d}  err {row.error:.1e}  triton {row.triton_us:9.1f} us  "
            f"sdpa {opt(row.sdpa_us):>9s} us  flash {opt(row.flash_us):>9s} us  "
            f"{row.gbps:7.0f} GB/s ({row.copy_fraction:.0%} of copy)  {row.tflops:6.1f} TFLOP/s")


def write_results(rows: list[Row], environment: dict[str, Any], directory: Path) -> None:
    """``attention.json`` (everything) and ``attention.md`` (tables) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    goal_rows = [r for r in rows if r.kernel == "decode" and r.batch == 64
                 and r.prefix == 4095 and r.dtype != "float32"]
    # None: the run measured no size the goal is about.
    met = all(r.copy_fraction >= 0.6 for r in goal_rows) if goal_rows else None
    goal = {"goal": GOAL, "met": met}
    payload = {"environment": environment, "goal": goal, "rows": [asdict(r) for r in rows]}
    (directory / "attention.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# Triton attention kernels",
        "",
        f"GPU {environment['gpu']}; {environment['machine']}; commit {environment['commit']}; "
        f"torch {environment['torch']}, triton {environment['triton']}, flash_attn "
        f"{environment['flash_attn'] or 'not installed'}.",
        f"Heads {NUM_HEADS} query / {NUM_KV_HEADS} KV, head dim {HEAD_DIM}. Device-to-device "
        f"copy: {environment['copy_gbps']:.0f} GB/s. SDPA and FlashAttention read contiguous "
        "keys (no paging); the Triton kernels read keys at shuffled pool slots.",
        "",
        f"Goal ({GOAL}): {_goal_word(met)}.",
        "",
        "| kernel | dtype | batch | prefix | new | error | triton µs | SDPA µs | flash µs "
        "| GB/s | of copy | TFLOP/s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = [r.kernel, r.dtype, str(r.batch), str(r.prefix), str(r.new), f"{r.error:.1e}",
                 f"{r.triton_us:.1f}", _cell(r.sdpa_us), _cell(r.flash_us), f"{r.gbps:.0f}",
                 f"{r.copy_fraction:.0%}", f"{r.tflops:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (directory / "attention.md").write_text("\n".join(lines) + "\n")


def _goal_word(met: bool | None) -> str:
    return "not measured in this run" if met is None else "met" if met else "not met"


def _cell(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


if __name__ == "__main__":
    sys.exit(main())
