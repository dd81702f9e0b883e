#!/usr/bin/env bash
# `framework bench serving` against the same model served with --dp-size 1 and --dp-size 2,
# results to benchmarks/results/serving_dp/ (one NAME.md/.json/.jsonl per run).
# Usage: benchmarks/run_serving_dp.sh [--model-path DIR] ; extra server flags via SERVER_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/serving_dp
WORKLOAD=(--num-prompts 96 --input-len 128 --output-len 48 --range-ratio 0.5
          --max-concurrency 48 --no-progress)
mkdir -p "$OUT"

run() {  # run NAME SERVER-FLAGS...
  local name=$1; shift
  local port
  port=$(python -c 'from framework.comm.zmq import free_tcp_port; print(free_tcp_port())')
  python -m framework.cli serve --port "$port" --log-level warning ${SERVER_ARGS:-} "$@" \
    > "$OUT/$name.server.log" 2>&1 &
  local server=$!
  trap 'kill "$server" 2>/dev/null || true' RETURN
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "$OUT/$name.server.log"; return 1; }
    sleep 0.2
  done
  # The thread count each scheduler replica runs torch on, from the server itself.
  curl -sf "http://127.0.0.1:$port/get_server_info" | python -c '
import json, os, sys
info = json.load(sys.stdin)["scheduler"]
replicas = info.get("replicas", [info])
threads = [r["torch_threads"] for r in replicas]
load = open("/proc/loadavg").read().split()[0]
print(f"{len(replicas)} scheduler replica(s), torch threads each: {threads}, "
      f"usable cores: {len(os.sched_getaffinity(0))}, load average before the run: {load}")' \
    > "$OUT/$name.replicas.txt"
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" "${WORKLOAD[@]}" \
    --output "$OUT" --run-name "$name"
  kill "$server"
  wait "$server" || true
  rm -f "$OUT/$name.server.log"
}

run dp1 --dp-size 1 "$@"
run dp2 --dp-size 2 "$@"
