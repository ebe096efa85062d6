#!/usr/bin/env bash
# Regenerates docs/performance.md's speed table: fetches SmolLM2-135M-Instruct and builds llama.cpp's
# llama-server when missing, writes the f32 GGUF llama-server loads (the same numbers retrace
# loads: both are the Q4_1 GGUF dequantized to f32), builds retrace in release, and runs
# `retrace bench` with the arguments given (its defaults are docs/performance.md's run: 64 traces, 3 rounds).
#
# Usage: scripts/bench/bench.sh [retrace bench flags...]
#   e.g. scripts/bench/bench.sh --scaling --out runs/bench.md   (docs/performance.md's table and plot)
#        scripts/bench/bench.sh --limit 16 --rounds 1           (a quick look)
# Env: RETRACE_CACHE_DIR (default ~/.cache/retrace), CARGO_TARGET_DIR, RETRACE_PROCESSBENCH_DIR
# (the full ProcessBench set; required).
# Idempotent: every step is skipped when its output is already there.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
GGUF_Q="$CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_F32="$CACHE/bench/SmolLM2-135M-Instruct.f32.gguf"
DATA="$(pb_full "bench.sh scores 64 gsm8k traces by default and walks math and olympiadbench")" || exit 1
DATA="$DATA/gsm8k.json"

scripts/fetch-smollm2.sh --f32
scripts/fetch/fetch-llama-server.sh
if [ ! -s "$GGUF_F32" ]; then
  use_venv
  mkdir -p "$(dirname "$GGUF_F32")"
  "$PY" scripts/fetch/gguf_to_f32.py "$GGUF_Q" "$GGUF_F32.part"
  mv -f "$GGUF_F32.part" "$GGUF_F32"
fi
nice cargo build --release --locked
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/retrace"
exec "$BIN" bench --data "$DATA" --llama-gguf "$GGUF_F32" "$@"
