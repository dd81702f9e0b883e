"""The ``framework_triton_kernels`` kernels compile for an sm_90 GPU, without one, and spill
no registers.

Runs ``compile_kernels_for_gpu.py`` (Triton's compiler and the ``ptxas`` bundled with it)
in a subprocess without ``TRITON_INTERPRET``: both fused-MoE kernels, at the tiles
``moe_config`` picks for a decode step and for a prefill, in float32, float16 and
bfloat16, the gate/up kernel with each gated activation; the quantized GEMMs (int4, and
8-bit with int8 and E4M3 weights, E4M3 also with block scales) at each of
``gemm_config``'s tiles; the segmented LoRA
shrink and expand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("compile_kernels_for_gpu.py")
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DTYPES = {"torch.float32", "torch.float16", "torch.bfloat16"}


# One run of the script for every family (one process pool, its imports paid once); the
# first test waits for all of it.
FAMILIES = ("moe/", "quant/", "lora/")
pytestmark = pytest.mark.timeout(600)
needs_cuda_tools = pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                                      reason="this Triton build has no bundled CUDA tools")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The script's report lines for every family, by family (``"moe/"``...)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton_cache")),
               TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, str(SCRIPT), ",".join(FAMILIES)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return {family: [row for row in rows if row["kernel"].startswith(family)]
            for family in FAMILIES}


@needs_cuda_tools
def test_moe_kernels_compile_for_sm90_without_spilling(compiled: dict[str, list[dict]]) -> None:
    rows = compiled["moe/"]
    # 3 dtypes x 2 tile regimes x (gate/up with 2 activations + down)
    assert len(rows) == 18
    assert {row["dtype"] for row in rows} == DTYPES
    assert {row["kernel"].split()[0] for row in rows} == {"moe/gate_up", "moe/down"}
    spilled = [row for row in rows if row["stack_bytes"]]
    assert not spilled, spilled


@needs_cuda_tools
def test_quantized_gemms_compile_for_sm90_without_spilling(
        compiled: dict[str, list[dict]]) -> None:
    """The int4 and 8-bit (int8, E4M3, E4M3 in blocks) GEMMs at ``gemm_config``'s tiles."""
    rows = compiled["quant/"]
    # float16 and bfloat16: 3 tile regimes x (int4 + int8 + E4M3 + E4M3 blocks); float32:
    # 1 regime x 4
    assert len(rows) == 28
    assert {row["dtype"] for row in rows} == DTYPES
    assert {row["kernel"].split()[0] for row in rows} == {"quant/int4", "quant/w8"}
    spilled = [row for row in rows if row["stack_bytes"]]
    assert not spilled, spilled


@needs_cuda_tools
def test_lora_kernels_compile_for_sm90_without_spilling(
        compiled: dict[str, list[dict]]) -> None:
    """Shrink and expand at ``triton_lora_delta``'s tiles, ranks up to 16 and 64."""
    rows = compiled["lora/"]
    assert len(rows) == 12  # 3 dtypes x 2 rank blocks x (shrink + expand)
    assert {row["dtype"] for row in rows} == DTYPES
    spilled = [row for row in rows if row["stack_bytes"]]
    assert not spilled, spilled
