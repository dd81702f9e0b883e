#!/usr/bin/env bash
# On a CUDA machine: the kernel plugin's tests (compiled kernels on the GPU) and the peak
# memory of a pre-quantized checkpoint's load (deferred float weights), then the kernel
# benchmark, whose results go to benchmarks/results/triton_kernels/ (or $OUT when set, as on
# a lent machine). Arguments go to the benchmark (e.g. --quick). The checkout and the plugins
# are installed in place without dependencies, so that the machine's own torch and triton
# are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "run_triton_kernels_gpu.sh: needs a CUDA GPU")'
python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -e . -e plugins/triton_attention -e plugins/triton_kernels
python -m pytest -q -p no:cacheprovider tests/plugins/test_triton_moe.py \
    tests/plugins/test_triton_quant.py tests/plugins/test_triton_lora.py \
    tests/unit/test_deferred_weights.py
python benchmarks/bench_triton_kernels.py --output "${OUT:-benchmarks/results/triton_kernels}" "$@"
