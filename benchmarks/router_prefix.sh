#!/usr/bin/env bash
# `framework bench serving` through `framework router` on a shared-prefix workload, once with
# --policy cache_aware and once with round_robin, each in front of three fresh `framework
# serve` workers (empty prefix caches) on a tiny Llama checkpoint. Results, with machine and
# commit, to benchmarks/results/router_cache_aware/ (NAME.md/.json/.jsonl and summary.md).
# Usage: benchmarks/router_prefix.sh [NUM_PROMPTS]   (default 256)
#   MODEL_PATH=DIR    serve this checkpoint instead of building the tiny one
#   SERVER_ARGS=...   extra flags for every worker (e.g. --max-total-tokens N)
#   OUT=DIR           write the results there instead
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/router_cache_aware}
NUM_PROMPTS=${1:-256}
WORKLOAD=(--num-prompts "$NUM_PROMPTS" --input-len 64 --output-len 32 --range-ratio 0.5
          --shared-prefix-groups 8 --shared-prefix-len 1024 --max-concurrency 24
          --no-progress)
mkdir -p "$OUT"
SCRATCH=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap 'cleanup; rm -rf "$SCRATCH"' EXIT

MODEL=${MODEL_PATH:-}
if [ -z "$MODEL" ]; then
  MODEL=$(python -c "
from tests.model_fixtures import make_tiny_checkpoint
print(make_tiny_checkpoint('$SCRATCH', 'llama', seed=4, max_position_embeddings=4096))")
fi

free_port() { python -c 'from framework.comm.zmq import free_tcp_port; print(free_tcp_port())'; }

wait_healthy() {  # wait_healthy URL PID LOG
  for _ in $(seq 900); do
    curl -sf "$1/health" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { cat "$3"; return 1; }
    sleep 0.2
  done
  cat "$3"; return 1
}

run() {  # run POLICY
  local policy=$1 urls=() port
  for i in 1 2 3; do
    port=$(free_port)
    python -m framework.cli serve --model-path "$MODEL" --served-model-name tiny \
      --port "$port" --log-level warning ${SERVER_ARGS:-} > "$SCRATCH/worker$i.log" 2>&1 &
    PIDS+=($!)
    urls+=("http://127.0.0.1:$port")
    wait_healthy "http://127.0.0.1:$port" $! "$SCRATCH/worker$i.log"
  done
  port=$(free_port)
  python -m framework.cli router --port "$port" --policy "$policy" --log-level warning \
    --worker-url "${urls[@]}" > "$SCRATCH/router.log" 2>&1 &
  PIDS+=($!)
  wait_healthy "http://127.0.0.1:$port" $! "$SCRATCH/router.log"
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" \
    --output "$OUT" --run-name "$policy"
  curl -sf "http://127.0.0.1:$port/list_workers" > "$OUT/$policy.workers.json"
  cleanup
}

run cache_aware
run round_robin

python - "$OUT" "$NUM_PROMPTS" <<'PY'
import json, os, sys
from pathlib import Path
out, n = Path(sys.argv[1]), sys.argv[2]
runs = {p: json.loads((out / f"{p}.json").read_text()) for p in ("cache_aware", "round_robin")}
first = runs["cache_aware"]
lines = [
    "# Router: cache_aware vs round_robin on a shared-prefix workload", "",
    f"- Machine: {first['machine']}", f"- Commit: {first['commit']}",
    f"- Run: {first['started_at']}",
    f"- Workload: {n} requests, 8 groups x 1,024-token shared prefixes, 32-64 more prompt "
    "tokens, 16-32 output tokens; at most 24 in flight",
    "- Three `framework serve` workers on a tiny random Llama, behind one `framework router`"
    + (f"; worker flags `{os.environ['SERVER_ARGS']}`" if os.environ.get("SERVER_ARGS") else
       "; default KV pools"),
    "", "| policy | cache hit rate | output tok/s | requests/s | TTFT p50 (ms) | failed |",
    "|---|---:|---:|---:|---:|---:|",
]
for name, s in runs.items():
    lines.append(f"| {name} | {s['cache_hit_rate']:.1%} | {s['output_throughput']:,.1f} | "
                 f"{s['request_throughput']:.2f} | {s['ttft_ms']['p50'] or 0:,.0f} | "
                 f"{s['failed']} |")
ca, rr = runs["cache_aware"], runs["round_robin"]
ratio = ca["cache_hit_rate"] / rr["cache_hit_rate"] if rr["cache_hit_rate"] else float("inf")
speed = ca["output_throughput"] / rr["output_throughput"] if rr["output_throughput"] else 0
lines += ["", f"cache_aware / round_robin: {ratio:.2f}x the hit rate, {speed:.2f}x the "
          "output throughput."]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
