"""The kernels compile for an sm_90 GPU, without one, and spill no registers.

The interpreter runs the kernels' Python, not Triton's compiler; this test runs
the compiler (front end, MLIR passes, the ``ptxas`` bundled with Triton) in a
subprocess without ``TRITON_INTERPRET``, for every dtype at head dim 256 (the
largest tiles, where spills would start) and grouped-query ratio 8, as the launchers
configure the kernels, each attention kernel both as the default layer runs it and with
a sliding window and a logit cap. The kernels that take the ratio are compiled at ratio 1
(plain multi-head attention) too, in float32: the ratio only indexes rows of the same
tiles, and float32's full-precision dots hold the most registers. The whole sweep of
head dims runs with ``python tests/plugins/compile_for_gpu.py`` (a minute or two on two
cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (NVIDIA_BIN / "cuobjdump").exists(),
                    reason="this Triton build has no bundled CUDA tools")
def test_kernels_compile_for_sm90_without_spilling(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, str(SCRIPT), "256", "float32,float16,bfloat16",
                             "float32"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # 3 dtypes x (4 attention kernels x 2 variants + store_kv) at ratio 8, and in float32
    # the decode split and both extend kernels x 2 variants at ratio 1
    assert len(rows) == 3 * 9 + 6
    assert {row["group"] for row in rows if row["dtype"] == "torch.float32"} == {1, 8}
    spilled = [row for row in rows if row["stack_bytes"]]
    assert not spilled, spilled
