#!/usr/bin/env bash
# `framework bench serving` with overlap scheduling on and off, at 1 stream and at 64, on the
# offline benchmark's model (Llama, 4 layers, hidden 256, float32) and on the default model.
# Each (model, mode) gets one server; the two modes alternate, ROUNDS times, and each run's
# summary is kept as MODEL-MODE-STREAMS-ROUND.json; overlap.md is the table of the best
# round of each. In benchmarks/results/overlap/ or --output DIR.
# Usage: benchmarks/run_overlap.sh [--output DIR]    Environment: ROUNDS (2), MODELS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/overlap
while [ $# -gt 0 ]; do
  case $1 in
    --output) OUT=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
ROUNDS=${ROUNDS:-2}
MODELS=${MODELS:-small default}
mkdir -p "$OUT"
WORK=$(mktemp -d)
source benchmarks/server_lib.sh
cleanup() { stop_server; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$WORK/small"
python -c '
import sys
from pathlib import Path
from framework.bench.offline import OfflineBenchSettings, write_model_dir
write_model_dir(OfflineBenchSettings(), Path(sys.argv[1]))' "$WORK/small"

run_mode() {  # run_mode MODEL MODE ROUND
  local model=$1 mode=$2 round=$3 port model_args=()
  [ "$model" = small ] && model_args=(--model-path "$WORK/small" --dtype float32)
  port=$(python -c 'from framework.comm.zmq import free_tcp_port; print(free_tcp_port())')
  setsid python -m framework.cli serve "${model_args[@]}" --overlap-schedule "$mode" \
    --max-running-requests 64 --port "$port" --log-level warning > "$WORK/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.2
  done
  local url="http://127.0.0.1:$port"
  # An untimed pass first: the first batches of a fresh server pay one-off costs.
  python -m framework.cli bench serving --base-url "$url" --num-prompts 16 --input-len 92 \
    --output-len 8 --seed 1 --no-progress --output "$WORK/warmup" > /dev/null
  echo "== $model, overlap $mode, round $round"
  python -m framework.cli bench serving --base-url "$url" --num-prompts 8 --input-len 92 \
    --output-len 64 --max-concurrency 1 --no-progress --output "$OUT" \
    --run-name "$model-$mode-1-$round" | tail -n 3
  python -m framework.cli bench serving --base-url "$url" --num-prompts 128 --input-len 92 \
    --output-len 48 --max-concurrency 64 --no-progress --output "$OUT" \
    --run-name "$model-$mode-64-$round" | tail -n 3
  stop_server
}

for model in $MODELS; do
  for round in $(seq "$ROUNDS"); do
    for mode in off on; do run_mode "$model" "$mode" "$round"; done
  done
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
best = {}
for path in sorted(out.glob("*-*-*-*.json")):
    model, mode, streams, _ = path.stem.rsplit("-", 3)
    run = json.loads(path.read_text())
    key = (model, streams, mode)
    if key not in best or run["output_throughput"] > best[key]["output_throughput"]:
        best[key] = run
first = next(iter(best.values()))
lines = ["# Overlap scheduling on and off", "",
         f"Machine: {first['machine']}; commit {first['commit']}; best of the rounds of "
         "`benchmarks/run_overlap.sh`.", "",
         "| model | streams | overlap | output tok/s | TPOT p50 ms | ITL p99 ms |",
         "| --- | --- | --- | --- | --- | --- |"]
for (model, streams, mode), run in sorted(best.items()):
    lines.append(f"| {model} | {streams} | {mode} | {run['output_throughput']:.1f} | "
                 f"{run['tpot_ms']['p50']:.2f} | {run['itl_ms']['p99']:.2f} |")
(out / "overlap.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
