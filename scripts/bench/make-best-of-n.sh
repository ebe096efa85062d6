#!/usr/bin/env bash
# Regenerates bench/best-of-n.jsonl (the Best-of-N bench workload) from real model output:
# starts llama-server (scripts/fetch/fetch-llama-server.sh builds it) on SmolLM2-135M-Instruct's
# Q4_1 GGUF (scripts/fetch-smollm2.sh fetches it) and samples candidates
# (scripts/bench/make_best_of_n.py). Takes a few minutes on two cores.
# Usage: scripts/bench/make-best-of-n.sh [make_best_of_n.py flags]
# Env: RETRACE_CACHE_DIR; RETRACE_PROCESSBENCH_DIR (the full ProcessBench set; unset, the
# committed subset tests/fixtures/processbench, which gives the same few-shot prompt and questions
# at make_best_of_n.py's defaults, --shots 4 and --questions 6 (up to 12)).
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
DATA="$(pb_dir)" || exit 1
DATA="$DATA/gsm8k.json"
use_venv
scripts/fetch-smollm2.sh
scripts/fetch/fetch-llama-server.sh
PORT=$(free_port)
LOG="$(mktemp -t llama-bon.XXXXXX.log)"
# Spinning OpenMP workers starve everything else on a shared machine.
OMP_WAIT_POLICY=passive "$CACHE/llama-server/bin/llama-server" \
  -m "$CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --host 127.0.0.1 --port "$PORT" \
  -c 8192 -np 4 -t "$(nproc)" --jinja >"$LOG" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PORT/health" 120 "$!" "$LOG"
mkdir -p bench
"$PY" scripts/bench/make_best_of_n.py --server "http://127.0.0.1:$PORT" --data "$DATA" \
  --out bench/best-of-n.jsonl "$@"
