#!/usr/bin/env bash
# `framework bench serving` on a 100M-parameter Llama (8 layers, hidden 1024, intermediate
# 2048, random weights: --load-format dummy) served alone and with 8 rank-16 LoRA adapters
# on q/k/v/o, the requests spread over the adapters in turn (request i asks for adapter
# i mod 8). Writes base.* and lora.* ({json,jsonl,md,server.json}) and lora_vs_base.md in
# benchmarks/results/serving_lora/ (or --output DIR).
# Environment: NUM_PROMPTS (128), INPUT_LEN (64), OUTPUT_LEN (32), MAX_CONCURRENCY (64),
# SERVER_ARGS (extra flags for both servers).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/serving_lora
while [ $# -gt 0 ]; do
  case $1 in
    --output) OUT=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
CONCURRENCY=${MAX_CONCURRENCY:-64}
WORKLOAD=(--num-prompts "${NUM_PROMPTS:-128}" --input-len "${INPUT_LEN:-64}"
          --output-len "${OUTPUT_LEN:-32}" --max-concurrency "$CONCURRENCY" --no-progress)
mkdir -p "$OUT"

WORK=$(mktemp -d)
source benchmarks/server_lib.sh
cleanup() { stop_server; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

python - "$WORK" <<'PY'
import sys
from pathlib import Path
from framework.bench.lora_adapters import write_random_adapters
from framework.bench.offline import OfflineBenchSettings, write_model_dir
work = Path(sys.argv[1])
(work / "model").mkdir()
settings = OfflineBenchSettings(layers=8, hidden=1024, heads=16, intermediate=2048,
                                dummy_weights=True)
write_model_dir(settings, work / "model")
write_random_adapters(work / "model", work / "adapters", count=8, rank=16)
PY
ADAPTERS=()
for i in $(seq 0 7); do ADAPTERS+=("lora$i=$WORK/adapters/lora$i"); done

run() {  # run NAME MODELS [serve flags...]
  local name=$1 models=$2 port status=0
  shift 2
  port=$(python -c 'from framework.comm.zmq import free_tcp_port; print(free_tcp_port())')
  rm -f "$OUT/$name".*
  setsid python -m framework.cli serve --model-path "$WORK/model" --load-format dummy \
    --dtype float32 --served-model-name base --max-running-requests "$CONCURRENCY" \
    --port "$port" --log-level warning "$@" ${SERVER_ARGS:-} > "$OUT/$name.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { tail -n 5 "$OUT/$name.server.log" >&2; return 1; }
    sleep 0.2
  done
  curl -sf "http://127.0.0.1:$port/get_server_info" | python -c '
import json, sys
info = json.load(sys.stdin)
keys = ("dtype", "torch_threads", "max_running_requests", "lora_paths", "max_loras_per_batch",
        "lora_backend")
json.dump({k: info.get(k) for k in keys}, sys.stdout, indent=2)' > "$OUT/$name.server.json"
  echo "== $name"
  # An untimed pass first (8 output tokens, other prompts): a fresh server's first batches
  # pay one-off costs that are not the configuration's.
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" --model "$models" \
    "${WORKLOAD[@]}" --output-len 8 --seed 1 --output "$WORK/warmup" --run-name warmup \
    > /dev/null || status=$?
  python -m framework.cli bench serving --base-url "http://127.0.0.1:$port" --model "$models" \
    "${WORKLOAD[@]}" --output "$OUT" --run-name "$name" || status=$?
  stop_server
  [ "$status" -eq 0 ] && rm -f "$OUT/$name.server.log"
  return "$status"
}

run base base
run lora "$(IFS=,; echo "${ADAPTERS[*]%%=*}" | tr ' ' ',')" --lora-paths "${ADAPTERS[@]}"
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
base, lora = (json.loads((out / f"{n}.json").read_text()) for n in ("base", "lora"))
key = "output_throughput"
ratio = lora[key] / base[key]
text = (f"# LoRA serving vs the base model\n\n"
        f"- Machine: {base['machine']}\n- Commit: {base['commit']}\n"
        f"- Run: {base['started_at']}\n"
        f"- Model: Llama, 8 layers, hidden 1024, intermediate 2048, float32, random weights\n"
        f"- {base['requests']} requests of {base['target_input_tokens'] // base['requests']} "
        f"prompt and {base['target_output_tokens'] // base['requests']} output tokens, "
        f"{base['max_in_flight']} at a time\n\n"
        f"- base: {base[key]:.1f} output tok/s\n"
        f"- 8 rank-16 adapters on q/k/v/o, requests spread over them: {lora[key]:.1f} output "
        f"tok/s\n- ratio: {ratio:.2f} (goal >= 0.70)\n")
(out / "lora_vs_base.md").write_text(text)
print(text)
PY
