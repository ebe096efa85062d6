#!/usr/bin/env bash
# Measures what the front doors cost: direct gRPC, the Python client and OpenRLHF's /get_reward
# on the same ProcessBench traces and the same model (the embedded SmolLM2 default), at
# concurrency 64, in one run with alternating rounds (scripts/bench/bench_frontends.py). Builds
# retrace in release, installs the Python client (and aiohttp for the HTTP driver) into .venv,
# starts `retrace serve` on free 127.0.0.1 ports, and stops it after.
#
# Usage: scripts/bench/bench-frontends.sh [bench_frontends.py flags...]
#   e.g. scripts/bench/bench-frontends.sh --limit 64 --rounds 3 --out docs/bench-frontends.md
# Env: RETRACE_CACHE_DIR, CARGO_TARGET_DIR, RETRACE_PROCESSBENCH_DIR (the full
# ProcessBench set; required).
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
DATA="$(pb_full "bench-frontends.sh scores up to 64 gsm8k traces")" || exit 1
DATA="$DATA/gsm8k.json"

scripts/fetch-smollm2.sh
use_venv
if ! "$PY" -c "import retrace_client, aiohttp" 2>/dev/null; then
  "$PY" -m pip install -q ./clients/python "aiohttp==3.14.*"
fi
nice cargo build --release --locked
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/retrace"

GRPC=$(free_port); HTTP=$(free_port); METRICS=$(free_port)
LOG="$(mktemp -t retrace-bench-frontends.XXXXXX.log)"
# The prefix cache off: every contender scores the same traces, and with it on only the first
# would compute them. The front doors reach the default evaluator: chat-lm, as the figures in
# docs/performance.md were measured (the embedded default's own default is its trained head).
"$BIN" serve --grpc-addr "127.0.0.1:$GRPC" --http-addr "127.0.0.1:$HTTP" \
  --metrics-addr "127.0.0.1:$METRICS" --set evaluator.smollm2.prefix_cache_mb=0 \
  --set server.default_evaluator=smollm2 >"$LOG" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$HTTP/health" 300 "$!" "$LOG"
"$PY" scripts/bench/bench_frontends.py --address "127.0.0.1:$GRPC" --http "127.0.0.1:$HTTP" \
  --data "$DATA" "$@"
