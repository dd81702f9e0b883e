"""Compile the Triton kernels for an sm_90 GPU without one, and report register spills.

Run as a script in a process where ``TRITON_INTERPRET`` is unset (the interpreter
replaces the kernels with Python functions that cannot be compiled): Triton's
front end, its MLIR passes and the bundled ``ptxas`` run on the CPU, so type
errors, unsupported constructs and spilling tile configurations show up on a
machine with no GPU. Every attention kernel is compiled as the default layer runs
it and with a sliding window and a logit cap (``VARIANT``, Gemma 2's values).
Every kernel is compiled at grouped-query ratio 8; the kernels whose constants hold
the ratio (``GROUP``) are compiled at ratio 1 too, in the dtypes asked for. Prints one
JSON line per compiled kernel configuration:
``{"kernel", "dtype", "head_dim", "group", "stack_bytes"}``.

Usage: ``python tests/plugins/compile_for_gpu.py [head_dims] [dtypes] [ratio_1_dtypes]``,
comma lists (``ratio_1_dtypes``: those of ``dtypes`` compiled at ratio 1 too; all of them
by default).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import triton
from framework_triton_attention import decode, extend, kv_store
from framework_triton_attention.common import cap_arg, dot_precision, window_arg
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# The kernels' (SLIDING_WINDOW, LOGIT_CAP) constexprs: the default layer's, and a windowed,
# soft-capped layer's.
DEFAULT = {"SLIDING_WINDOW": window_arg(None), "LOGIT_CAP": cap_arg(None)}
VARIANT = {"SLIDING_WINDOW": window_arg(4096), "LOGIT_CAP": cap_arg(50.0)}


def arg_types(dtype: torch.dtype) -> Callable[[str], str]:
    """Triton signature type of each runtime argument of the kernels, by name."""
    data = "*" + TRITON_TYPES[dtype]

    def of(name: str) -> str:
        if name in ("partial_out_ptr", "partial_lse_ptr"):
            return "*fp32"
        if name.endswith("indptr_ptr") or name == "kv_indices_ptr":
            return "*i32"
        if name == "loc_ptr":
            return "*i64"
        if name.endswith("_ptr"):
            return data
        return "fp32" if name == "qk_scale" else "i32"

    return of


def compile_kernel(kernel: Any, dtype: torch.dtype, constants: dict[str, Any],
                   num_warps: int) -> Any:
    """``triton.compile`` of one configuration for ``TARGET``."""
    types = arg_types(dtype)
    signature = {name: "constexpr" if name in constants else types(name)
                 for name in kernel.arg_names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": 2})


def stack_bytes(compiled: Any) -> int:
    """Per-thread stack (spilled registers) of the compiled kernel, from ``cuobjdump``."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
    fields = next(line for line in usage.splitlines() if "STACK:" in line).split()
    return int(next(f for f in fields if f.startswith("STACK:")).split(":")[1])


def configurations(head_dim: int, dtype: torch.dtype, group: int
                   ) -> list[tuple[str, Any, dict[str, Any], int]]:
    """Every kernel as the launchers configure it for this shape."""
    precision = dot_precision(dtype)
    block_n, decode_warps = decode.decode_config(head_dim, dtype)
    block_m, extend_n, extend_warps = extend.extend_config(head_dim, dtype)
    rows = max(16, triton.next_power_of_2(group))
    out = []
    for suffix, variant in (("", DEFAULT), (" window+cap", VARIANT)):
        out += [(f"decode_split{suffix}", decode._decode_split_kernel,
                 {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_H": rows, "BLOCK_N": block_n,
                  "DOT_PRECISION": precision, **variant}, decode_warps),
                (f"decode_merge{suffix}", decode._decode_merge_kernel,
                 {"HEAD_DIM": head_dim, "SLIDING_WINDOW": variant["SLIDING_WINDOW"]}, 4)]
        for has_prefix in (True, False):
            out.append((f"extend(prefix={has_prefix}){suffix}", extend._extend_kernel,
                        {"GROUP": group, "HEAD_DIM": head_dim, "HAS_PREFIX": has_prefix,
                         "BLOCK_M": block_m, "BLOCK_N": extend_n,
                         "DOT_PRECISION": precision, **variant}, extend_warps))
    row = 8 * head_dim
    out.append(("store_kv", kv_store._store_kv_kernel,
                {"ROW": row, "BLOCK": min(triton.next_power_of_2(row), 1024)}, 4))
    return out


def compile_rows(dtype_name: str, head_dim: int, group: int,
                 grouped_only: bool = False) -> list[dict[str, Any]]:
    """The report line of every kernel of one dtype, head dim and group size.

    ``grouped_only``: only the kernels whose constants hold the group size (the others
    compile the same at every group size).
    """
    dtype = getattr(torch, dtype_name)
    rows = []
    for name, kernel, constants, num_warps in configurations(head_dim, dtype, group):
        if grouped_only and "GROUP" not in constants:
            continue
        compiled = compile_kernel(kernel, dtype, constants, num_warps)
        rows.append({"kernel": name, "dtype": str(dtype), "head_dim": head_dim,
                     "group": group, "stack_bytes": stack_bytes(compiled)})
    return rows


def main(argv: list[str]) -> int:
    """Compile every configuration asked for, one process per core; one JSON line each."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_for_gpu.py: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    head_dims = [int(d) for d in (argv[0] if argv else "16,32,64,128,256").split(",")]
    dtypes = (argv[1] if len(argv) > 1 else "float32,float16,bfloat16").split(",")
    ratio_1 = argv[2].split(",") if len(argv) > 2 else dtypes
    jobs = [(dtype, head_dim, 8, False) for dtype in dtypes for head_dim in head_dims]
    jobs += [(dtype, head_dim, 1, True) for dtype in dtypes if dtype in ratio_1
             for head_dim in head_dims]
    workers = min(len(jobs), len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for rows in pool.map(compile_rows, *zip(*jobs, strict=True)):
            for row in rows:
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
