"""The GPU benchmark of the plugin's kernels, run once on tiny shapes through the
interpreter with a stand-in timer: every kernel it measures is called as the script
calls it, and its error against float64 is small."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_triton_kernels.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("bench_triton_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_triton_kernels", module)
    spec.loader.exec_module(module)
    # Tiny float32 shapes: the interpreter runs every program in Python (and refuses
    # bfloat16 products).
    for name, value in {"DTYPE": torch.float32, "HIDDEN": 32, "MOE_INTERMEDIATE": 48,
                        "EXPERTS": 4, "LORA_ADAPTERS": 3, "LORA_RANK": 4,
                        "GROUP_SIZE": 16}.items():
        monkeypatch.setattr(module, name, value)
    return module


def _one_call(fn) -> float:
    fn()
    return 0.001


def test_every_kernel_runs_as_the_benchmark_calls_it(bench, tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    rows = [row for bench_kernel in (bench.bench_moe, bench.bench_quant, bench.bench_lora)
            for row in bench_kernel(5, cpu, _one_call)]
    assert [row.kernel for row in rows] == ["fused_moe", "gemm_gptq_int4", "gemm_awq_int4",
                                            "gemm_fp8", "gemm_int8", "lora_delta"]
    for row in rows:
        assert row.max_abs_error is not None and row.max_abs_error < 1e-4, row
        assert row.triton_us == row.reference_us == 1.0
    bench.write_results(rows, {"gpu": "none"}, tmp_path)
    assert "| gemm_fp8 | 5 |" in (tmp_path / "triton_kernels.md").read_text()
