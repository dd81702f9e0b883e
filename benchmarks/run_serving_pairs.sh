#!/usr/bin/env bash
# `framework bench serving` against the offline benchmark's model (Llama, 4 layers, hidden 256,
# float32) served with each transport × codec pair, in the offline benchmark's workload shape.
# Per pair TRANSPORT-CODEC.{json,jsonl,md,server.json} (or .skipped.txt), then serving_pairs.md,
# in benchmarks/results/serving_pairs/ or --output DIR.
# Usage: benchmarks/run_serving_pairs.sh [--output DIR]
# Environment: TRANSPORTS, CODECS (space-separated lists), NUM_PROMPTS (64), INPUT_LEN (92),
# OUTPUT_LEN (48), MAX_CONCURRENCY (64), SERVER_ARGS (extra flags for every server).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/serving_pairs
while [ $# -gt 0 ]; do
  case $1 in
    --output) OUT=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
TRANSPORTS=${TRANSPORTS:-zmq shm inproc}
CODECS=${CODECS:-pickle msgpack json}
WORKLOAD=(--num-prompts "${NUM_PROMPTS:-64}" --input-len "${INPUT_LEN:-92}"
          --output-len "${OUTPUT_LEN:-48}" --max-concurrency "${MAX_CONCURRENCY:-64}"
          --no-progress)
mkdir -p "$OUT"

MODEL=$(mktemp -d)
source benchmarks/server_lib.sh
cleanup() { stop_server; rm -rf "$MODEL"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

python -c '
import sys
from pathlib import Path
from framework.bench.offline import OfflineBenchSettings, write_model_dir
write_model_dir(OfflineBenchSettings(), Path(sys.argv[1]))' "$MODEL"

run_pair() {  # run_pair TRANSPORT CODEC
  local transport=$1 codec=$2 name="$1-$2" port extra=()
  # inproc channels cannot cross processes: its Scheduler and Detokenizer run as threads.
  [ "$transport" = inproc ] && extra=(--launch-mode thread)
  port=$(python -c 'from framework.comm.zmq import free_tcp_port; print(free_tcp_port())')
  rm -f "$OUT/$name".*
  # A session of its own (setsid): the server and its children are one process group.
  setsid python -m framework.cli serve --model-path "$MODEL" --dtype float32 \
    --transport "$transport" --codec "$codec" --max-running-requests 64 --port "$port" \
    --log-level warning "${extra[@]}" ${SERVER_ARGS:-} > "$OUT/$name.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    if ! kill -0 "$SERVER" 2>/dev/null; then
      wait "$SERVER" 2>/dev/null || true
      SERVER=""
      echo "note: serve refused $transport × $codec, skipped:" >&2
      tail -n 5 "$OUT/$name.server.log" >&2
      tail -n 1 "$OUT/$name.server.log" > "$OUT/$name.skipped.txt"
      rm -f "$OUT/$name.server.log"
      return 0
    fi
    sleep 0.2
  done
  curl -sf "http://127.0.0.1:$port/get_server_info" | python -c '
import json, sys
info = json.load(sys.stdin)
keys = ("transport", "codec", "launch_mode", "torch_threads", "dtype", "max_running_requests")
json.dump({k: info.get(k) for k in keys}
          | {"scheduler_torch_threads": info["scheduler"].get("torch_threads")},
          sys.stdout, indent=2)' > "$OUT/$name.server.json"
  echo "== $transport × $codec"
  local status=0
  # One untimed pass of the same shape first (8 output tokens), as the offline benchmark
  # warms each side up: the first batches of a fresh server pay one-off costs (kernel
  # set-up for new shapes, first allocations) that are not the pair's. Other prompts
  # (--seed 1), so that the timed run finds none of its own in the prefix cache.
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" \
    --output-len 8 --seed 1 --output "$MODEL/warmup" --run-name warmup > /dev/null || status=$?
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" \
    --output "$OUT" --run-name "$name" || status=$?
  stop_server
  if [ "$status" -eq 0 ]; then rm -f "$OUT/$name.server.log"; fi
  return "$status"
}

failed=0
for transport in $TRANSPORTS; do
  for codec in $CODECS; do
    run_pair "$transport" "$codec" || failed=1
  done
done
python -m framework.bench.serving_pairs summarize "$OUT"
exit "$failed"
