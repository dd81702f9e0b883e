#!/usr/bin/env bash
# On a CUDA machine: the Triton plugin's tests (compiled kernels, both backends on the GPU),
# then the attention benchmark, whose results go to benchmarks/results/attention/.
# Arguments go to the benchmark (e.g. --quick). The checkout and the plugin are installed
# in place without dependencies, so that the machine's own torch and triton are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "run_attention_gpu.sh: needs a CUDA GPU")'
python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -e . -e plugins/triton_attention
python -m pytest -q -p no:cacheprovider tests/plugins
python benchmarks/bench_attention.py "$@"
