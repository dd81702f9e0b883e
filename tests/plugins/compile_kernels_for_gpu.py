"""Compile the ``framework_triton_kernels`` kernels for an sm_90 GPU without one, and report
register spills.

As ``compile_for_gpu.py`` does for the attention kernels (whose ``TARGET`` and
``stack_bytes`` this reuses): run as a script in a process where ``TRITON_INTERPRET``
is unset, so that Triton's front end, its MLIR passes and the bundled ``ptxas`` run on
the CPU. ``CONFIGS`` lists every configuration, built by one function per kernel family,
each as its launcher sets the kernel up on a GPU. Prints one JSON line per configuration:
``{"kernel", "dtype", "constants", "num_warps", "num_stages", "stack_bytes"}``.

Usage: ``python tests/plugins/compile_kernels_for_gpu.py [prefixes]``: a comma list of
kernel-name prefixes (e.g. ``moe``) to compile only those; all by default.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

import torch
import triton
from compile_for_gpu import TARGET, TRITON_TYPES, stack_bytes
from framework_triton_kernels import lora, moe, quant_gemm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelConfig(NamedTuple):
    """One kernel as a launcher configures it."""

    #: ``family/kernel`` and what tells this configuration apart.
    name: str
    kernel: Any
    #: The ``tl.constexpr`` arguments.
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    #: The Triton signature type of each runtime argument, by name (``"*fp16"``, ``"i32"``).
    arg_types: Callable[[str], str]
    dtype: torch.dtype


def moe_arg_types(dtype: torch.dtype) -> Callable[[str], str]:
    """The MoE kernels' argument types: index tensors int64, the routing weights and the
    per-pair rows float32, the activations and weights in ``dtype``, sizes and strides i32."""
    data = "*" + TRITON_TYPES[dtype]

    def of(name: str) -> str:
        if name in ("slot_ptr", "token_ptr", "block_expert_ptr"):
            return "*i64"
        if name in ("scale_ptr", "out_ptr"):
            return "*fp32"
        return data if name.endswith("_ptr") else "i32"

    return of


def moe_configurations() -> list[KernelConfig]:
    """Both fused-MoE kernels at ``moe_config``'s decode and prefill tiles (8 experts,
    8 and 4,096 routed rows), in every dtype, with each gated activation."""
    out = []
    for dtype in DTYPES:
        for regime, pairs in (("decode", 8), ("prefill", 4096)):
            config = moe.moe_config(pairs, 8, dtype)
            tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                     "BLOCK_K": config.block_k, "DOT_PRECISION": moe.dot_precision(dtype)}
            types = moe_arg_types(dtype)
            for activation in sorted(set(moe.ACTIVATIONS.values())):
                out.append(KernelConfig(f"moe/gate_up {regime} {activation}",
                                        moe._gate_up_kernel,
                                        {**tiles, "ACTIVATION": activation},
                                        config.num_warps, config.num_stages, types,
                                        dtype))
            out.append(KernelConfig(f"moe/down {regime}", moe._down_kernel, tiles,
                                    config.num_warps, config.num_stages, types, dtype))
    return out


def quant_arg_types(dtype: torch.dtype, weight: str) -> Callable[[str], str]:
    """The quantized GEMMs' argument types: the 8-bit ``w_ptr`` as ``weight`` (``*i8`` or
    ``*fp8e4nv``), GPTQ-packed int32 ``qweight``, uint8 zero points, float16 group scales,
    float32 channel scales, the activations in ``dtype``, sizes and strides i32."""
    data = "*" + TRITON_TYPES[dtype]
    fixed = {"qweight_ptr": "*i32", "zeros_ptr": "*u8", "scales_ptr": "*fp16",
             "w_ptr": weight, "scale_ptr": "*fp32"}

    def of(name: str) -> str:
        return fixed.get(name, data if name.endswith("_ptr") else "i32")

    return of


def quant_configurations() -> list[KernelConfig]:
    """Both quantized GEMMs at each of ``gemm_config``'s tiles (1, 64 and 4,096 rows), in
    every dtype: int4 at group size 128, the 8-bit one with int8 and E4M3 weights (E4M3
    also in blocks of 128 input rows)."""
    out = []
    for dtype in DTYPES:
        regimes: dict[quant_gemm.GemmConfig, str] = {}
        for regime, rows in (("decode", 1), ("mid", 64), ("prefill", 4096)):
            regimes.setdefault(quant_gemm.gemm_config(rows, dtype), regime)
        for config, regime in regimes.items():
            tiles = {"HAS_BIAS": True, **quant_gemm.dot_args(dtype),
                     "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
            out.append(KernelConfig(
                f"quant/int4 {regime}", quant_gemm._int4_gemm_kernel,
                {**tiles, "GROUP_SIZE": 128,
                 "BLOCK_K": quant_gemm.int4_block_k(128, config.block_k)},
                config.num_warps, config.num_stages, quant_arg_types(dtype, "*i8"), dtype))
            for weight, scale_cols in (("*i8", 0), ("*fp8e4nv", 0), ("*fp8e4nv", 128)):
                w8 = quant_gemm.w8_config(config, scale_cols)
                out.append(KernelConfig(
                    f"quant/w8 {regime} {weight[1:]} scale_cols={scale_cols}",
                    quant_gemm._w8_gemm_kernel,
                    {**tiles, "BLOCK_N": w8.block_n, "SCALE_COLS": scale_cols,
                     "BLOCK_K": w8.block_k}, w8.num_warps, w8.num_stages,
                    quant_arg_types(dtype, weight), dtype))
    return out


def lora_arg_types(dtype: torch.dtype) -> Callable[[str], str]:
    """The LoRA kernels' argument types: rows, segments and slots int64, the shrunk rows
    float32, the activations, adapter matrices and scalings in ``dtype``, sizes i32."""
    data = "*" + TRITON_TYPES[dtype]

    def of(name: str) -> str:
        if name in ("rows_ptr", "starts_ptr", "lens_ptr", "slots_ptr"):
            return "*i64"
        if name == "mid_ptr":
            return "*fp32"
        return data if name.endswith("_ptr") else "i32"

    return of


def lora_configurations() -> list[KernelConfig]:
    """Shrink and expand at ``triton_lora_delta``'s tiles, for ranks up to 16 and 64, in
    every dtype."""
    out = []
    for dtype in DTYPES:
        for block_r in (16, 64):
            out.append(KernelConfig(f"lora/shrink rank<={block_r}", lora._shrink_kernel,
                                    {"BLOCK_M": 16, "BLOCK_R": block_r, "BLOCK_K": 32}, 4, 2,
                                    lora_arg_types(dtype), dtype))
            out.append(KernelConfig(f"lora/expand rank<={block_r}", lora._expand_kernel,
                                    {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_R": block_r}, 4, 2,
                                    lora_arg_types(dtype), dtype))
    return out


CONFIGS: list[KernelConfig] = (moe_configurations() + quant_configurations()
                               + lora_configurations())


def compile_config(config: KernelConfig) -> Any:
    """``triton.compile`` of one configuration for ``TARGET``."""
    signature = {name: "constexpr" if name in config.constants else config.arg_types(name)
                 for name in config.kernel.arg_names}
    source = triton.compiler.ASTSource(fn=config.kernel, signature=signature,
                                       constexprs=config.constants)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": config.num_warps,
                                   "num_stages": config.num_stages})


def compile_row(index: int) -> dict[str, Any]:
    """The report line of ``CONFIGS[index]`` (by index: the pool's workers import it)."""
    config = CONFIGS[index]
    return {"kernel": config.name, "dtype": str(config.dtype), "constants": config.constants,
            "num_warps": config.num_warps, "num_stages": config.num_stages,
            "stack_bytes": stack_bytes(compile_config(config))}


def main(argv: list[str]) -> int:
    """Compile the configurations asked for, one process per core; one JSON line each."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_kernels_for_gpu.py: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    prefixes = tuple(argv[0].split(",")) if argv else ("",)
    chosen = [i for i, config in enumerate(CONFIGS) if config.name.startswith(prefixes)]
    if not chosen:
        print(f"compile_kernels_for_gpu.py: no kernel named {prefixes}", file=sys.stderr)
        return 2
    workers = min(len(chosen), len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(compile_row, chosen):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
