#!/usr/bin/env bash
# On a CUDA machine: `framework bench offline` on a Llama-3-8B-shaped model with dummy
# bfloat16 weights (--llama3-8b), the Engine on the Triton attention plugin; results to
# $OUT (the device tool's output folder) or benchmarks/results/offline_gpu/.
# The machine's own torch, triton and transformers are kept: the checkout and the plugin
# are installed in place without dependencies, the rest from wheels/
# (benchmarks/fetch_gpu_wheels.sh). Arguments go to the benchmark (e.g. --repeats 2).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "run_offline_gpu.sh: needs a CUDA GPU")'
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }
if [ -d wheels ]; then
  pip_install --no-index --no-deps wheels/*.whl
fi
pip_install --no-deps --no-build-isolation -e . -e plugins/triton_attention
output=${OUT:-benchmarks/results/offline_gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/gpu.txt || true
python -m framework.cli bench offline --llama3-8b --attention-backend triton \
    --output "$output" "$@"
cp /tmp/gpu.txt "$output/gpu.txt" 2>/dev/null || true
