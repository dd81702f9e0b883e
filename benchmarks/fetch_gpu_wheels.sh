#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (it has torch, triton, transformers,
# numpy and most else, on Python 3.12; not msgspec, pyzmq, starlette or hypercorn) into
# wheels/, which the device tool carries (`carry: ["wheels"]`) and
# benchmarks/run_offline_gpu.sh installs without an index.
# Usage: benchmarks/fetch_gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
abi=cp${version/./}
mkdir -p wheels
python -m pip download --quiet --no-deps --only-binary=:all: --dest wheels \
    --python-version "$version" --implementation cp --abi "$abi" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    msgspec pyzmq starlette hypercorn h2 hpack hyperframe priority wsproto
ls wheels
