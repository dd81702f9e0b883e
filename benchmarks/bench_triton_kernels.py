"""Benchmark and check the Triton kernels of ``plugins/triton_kernels`` on a CUDA GPU.

For each kernel, at shapes of a Llama-3-8B / Mixtral-8x7B layer and for decode-sized
and prefill-sized batches:

* **fused MoE** (``MOE_BACKENDS["triton"]``: 8 experts, top 2, hidden 4096,
  intermediate 14336) against the torch reference (``torch_fused_experts``) and, where
  ``vllm`` is installed, its ``fused_experts``;
* **int4 GEMM** (GPTQ and AWQ, group 128) and **8-bit GEMM** (FP8 E4M3 per-channel,
  int8) (``QUANT_LINEAR_BACKENDS["triton"]``, 4096 x 4096) against the torch reference
  (dequantize, then a product) and a plain 16-bit ``F.linear`` on the dequantized weight;
* **segmented LoRA** (``LORA_BACKENDS["triton"]``: 8 adapters of rank 16, 4096 -> 4096,
  the batch's rows spread over them) against the torch reference (``torch_lora_delta``).

Each row: the largest error against a float64 computation of the same inputs (on the
first sizes, where float64 is cheap), the time from ``triton.testing.do_bench`` for
the kernel and the baselines, and the speed-up. Writes ``triton_kernels.json`` and
``triton_kernels.md`` (machine, GPU, commit) to ``--output`` (default
``benchmarks/results/triton_kernels``; ``$OUT`` on a lent machine). Run::

    python benchmarks/bench_triton_kernels.py [--quick] [--output DIR]

Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPE = torch.bfloat16
HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K = 4096, 14336, 8, 2
LORA_ADAPTERS, LORA_RANK = 8, 16
GROUP_SIZE = 128  # of the int4 formats
TOKENS = [1, 16, 64, 256, 2048]
QUICK_TOKENS = [1, 64, 1024]
#: Sizes (tokens) checked against float64 as well as timed.
CHECKED = 64


@dataclass
class Row:
    """One kernel at one batch size."""

    kernel: str
    tokens: int
    triton_us: float
    reference_us: float
    baseline: str
    baseline_us: float | None
    max_abs_error: float | None


def main(argv: list[str] | None = None) -> int:
    """Measure every kernel; write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three batch sizes")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/triton_kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton_kernels.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    device = torch.device("cuda")
    rows: list[Row] = []
    for tokens in QUICK_TOKENS if args.quick else TOKENS:
        rows += bench_moe(tokens, device, do_bench)
        rows += bench_quant(tokens, device, do_bench)
        rows += bench_lora(tokens, device, do_bench)
        for row in rows[-7:]:
            print(format_row(row), flush=True)
    write_results(rows, environment(device), args.output)
    return 0


def _us(do_bench: Callable[..., float], fn: Callable[[], Any]) -> float:
    return do_bench(fn) * 1000.0


def bench_moe(tokens: int, device: torch.device, do_bench: Callable[..., float]) -> list[Row]:
    """The fused MoE of one Mixtral layer over ``tokens`` tokens."""
    from framework_triton_kernels.moe import triton_fused_experts

    from framework.layers.activation import GatedActivation
    from framework.layers.moe.torch_moe import torch_fused_experts

    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=device, generator=gen).to(DTYPE)
    w13 = (torch.randn(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN, device=device, generator=gen)
           / HIDDEN ** 0.5).to(DTYPE)
    w2 = (torch.randn(EXPERTS, HIDDEN, MOE_INTERMEDIATE, device=device, generator=gen)
          / MOE_INTERMEDIATE ** 0.5).to(DTYPE)
    logits = torch.randn(tokens, EXPERTS, device=device, generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    act = GatedActivation("silu")
    error = None
    if tokens <= CHECKED:
        exact = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(),
                                    ids, act)
        error = (triton_fused_experts(x, w13, w2, weights, ids, act).double()
                 - exact).abs().max().item()
    peer = peer_fused_experts()
    return [Row("fused_moe", tokens,
                _us(do_bench, lambda: triton_fused_experts(x, w13, w2, weights, ids, act)),
                _us(do_bench, lambda: torch_fused_experts(x, w13, w2, weights, ids, act)),
                "vLLM fused_experts" if peer else "",
                _us(do_bench, lambda: peer(x, w13, w2, weights, ids)) if peer else None,
                error)]


def peer_fused_experts() -> Callable[..., Any] | None:
    """vLLM's fused MoE (same ``[E, 2I, H]`` / ``[E, H, I]`` layout), where installed."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError:
        return None
    return fused_experts


def bench_quant(tokens: int, device: torch.device, do_bench: Callable[..., float]
                ) -> list[Row]:
    """Each quantized format's GEMM of ``tokens`` rows by a 4096 x 4096 weight."""
    import torch.nn.functional as F
    from framework_triton_kernels.quant_linear import TritonQuantLinear

    from framework.layers.quantization.awq import AwqWeight, quantize_awq
    from framework.layers.quantization.fp8 import Fp8Weight
    from framework.layers.quantization.gptq import GptqWeight, quantize_gptq
    from framework.layers.quantization.int8 import Int8Weight
    from framework.layers.quantization.torch_kernels import TorchQuantLinear

    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5
    weights = {
        "gptq_int4": GptqWeight.from_checkpoint(quantize_gptq(w, GROUP_SIZE), GROUP_SIZE),
        "awq_int4": AwqWeight.from_checkpoint(quantize_awq(w, GROUP_SIZE), GROUP_SIZE),
        "fp8": Fp8Weight.from_float(w),
        "int8": Int8Weight.from_float(w),
    }
    x = torch.randn(tokens, HIDDEN, generator=gen).to(device=device, dtype=DTYPE)
    triton_kernel, torch_kernel = TritonQuantLinear(), TorchQuantLinear()
    rows = []
    for name, weight in weights.items():
        weight.tensors = {k: t.to(device) for k, t in weight.tensors.items()}
        prepared = triton_kernel.prepare(weight)
        dense = weight.dequantize().to(device=device, dtype=DTYPE)
        error = None
        if tokens <= CHECKED:
            exact = x.double() @ weight.dequantize().to(device).double().t()
            error = (triton_kernel.apply(prepared, x).double() - exact).abs().max().item()
        rows.append(Row(f"gemm_{name}", tokens,
                        _us(do_bench, lambda p=prepared: triton_kernel.apply(p, x)),
                        _us(do_bench, lambda q=weight: torch_kernel.apply(q, x)),
                        "bf16 F.linear", _us(do_bench, lambda d=dense: F.linear(x, d)), error))
    return rows


def bench_lora(tokens: int, device: torch.device, do_bench: Callable[..., float]
               ) -> list[Row]:
    """The segmented LoRA delta of ``tokens`` rows spread over the adapters."""
    from framework_triton_kernels.lora import triton_lora_delta

    from framework.lora.batch import LoraBatch
    from framework.lora.ops import torch_lora_delta

    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=device, generator=gen).to(DTYPE)
    a = (torch.randn(LORA_ADAPTERS, LORA_RANK, HIDDEN, device=device, generator=gen)
         / HIDDEN ** 0.5).to(DTYPE)
    b = (torch.randn(LORA_ADAPTERS, HIDDEN, LORA_RANK, device=device, generator=gen)
         / LORA_RANK ** 0.5).to(DTYPE)
    scalings = torch.ones(LORA_ADAPTERS, device=device)
    requests = min(tokens, 64)
    new = [tokens // requests + (i < tokens % requests) for i in range(requests)]
    batch = LoraBatch.build([i % LORA_ADAPTERS for i in range(requests)], new, device)
    error = None
    if tokens <= CHECKED:
        exact = torch_lora_delta(x.double(), a.double(), b.double(), scalings.double(), batch)
        error = (triton_lora_delta(x, a, b, scalings, batch).double() - exact).abs().max().item()
    return [Row("lora_delta", tokens,
                _us(do_bench, lambda: triton_lora_delta(x, a, b, scalings, batch)),
                _us(do_bench, lambda: torch_lora_delta(x, a, b, scalings, batch)),
                "", None, error)]


def environment(device: torch.device) -> dict[str, Any]:
    """The GPU, the machine, the commit and the versions."""
    import triton

    sys.path.insert(0, str(ROOT))
    from framework.bench.environment import git_commit, machine_description

    return {"gpu": torch.cuda.get_device_name(device), "machine": machine_description(),
            "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE).removeprefix("torch.")}


def format_row(row: Row) -> str:
    """One Markdown table row."""
    error = "" if row.max_abs_error is None else f"{row.max_abs_error:.2e}"
    baseline = "" if row.baseline_us is None else f"{row.baseline} {row.baseline_us:.1f}"
    return (f"| {row.kernel} | {row.tokens} | {row.triton_us:.1f} | {row.reference_us:.1f} | "
            f"{row.reference_us / row.triton_us:.2f}x | {baseline} | {error} |")


def write_results(rows: list[Row], env: dict[str, Any], directory: Path) -> None:
    """``triton_kernels.json`` and ``triton_kernels.md`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "triton_kernels.json").write_text(
        json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    lines = ["# Triton kernels (plugins/triton_kernels)", "",
             *(f"- {key}: {value}" for key, value in env.items()), "",
             "| kernel | tokens | triton us | torch reference us | speed-up | baseline us "
             "| max abs error vs float64 |", "|---|---:|---:|---:|---:|---|---:|",
             *map(format_row, rows)]
    (directory / "triton_kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
