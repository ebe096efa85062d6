#!/usr/bin/env bash
# One prepared run of the GPU check, at most 8 minutes (scripts/bench/gpu_check.py holds the
# stages; it runs as a module from the root, `python3 -m scripts.bench.gpu_check`).
#
#   scripts/bench/gpu-check.sh --bundle           # here: binary + tokenizer + traces -> target/gpu-bundle
#   scripts/bench/gpu-check.sh [--out DIR]        # on the GPU machine (torch, transformers, a CUDA driver)
#   scripts/bench/gpu-check.sh --cpu [--out DIR]  # the same flow on the CPU: small f32 checkpoint, numpy reference
#
# --bundle copies what the GPU machine lacks (it has no Rust toolchain and no network) into one
# folder under 64 MiB: the stripped, gzipped CUDA binary from scripts/fetch/build-cuda.sh, the
# Qwen2.5-Math-PRM tokenizer from scripts/fetch/fetch-tokenizers.sh, ProcessBench's gsm8k and math
# splits (the full set from $RETRACE_PROCESSBENCH_DIR: the check scores 64 traces of each; --cpu
# takes 8 of each, so it reads the committed subset tests/fixtures/processbench when the variable
# is unset). The CUDA libraries the binary links (cuBLAS, cuBLASLt, cuRAND, NVRTC, the runtime) are
# not carried: they are found in the GPU machine's own nvidia-* Python packages (the ones torch
# depends on).
# Results (small JSON files and summary.md) go to --out, default $OUT when set, else target/gpu-check.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
TGT="${CARGO_TARGET_DIR:-$ROOT/target}"
BUNDLE="${GPU_BUNDLE:-$ROOT/target/gpu-bundle}"
MODE=cuda
OUTDIR="${OUT:-$ROOT/target/gpu-check}"
BIN=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --bundle) MODE=bundle ;;
    --out) OUTDIR="$2"; shift ;;
    --bin) BIN="$2"; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# The check itself runs from the root (below): paths given are the caller's.
[[ -z "$BIN" || "$BIN" == /* ]] || BIN="$PWD/$BIN"
[[ "$OUTDIR" == /* ]] || OUTDIR="$PWD/$OUTDIR"

if [[ "$MODE" == bundle ]]; then
  BIN="${BIN:-${RETRACE_CUDA_TARGET_DIR:-$TGT/cuda}/release/retrace}"
  TOK="$CACHE/tokenizers/qwen2.5-math-prm"
  PB="$(pb_full "gpu-check.sh --bundle carries 64 traces of gsm8k and of math")" || exit 1
  [[ -x "$BIN" ]] || { echo "no CUDA binary at $BIN: run scripts/fetch/build-cuda.sh" >&2; exit 1; }
  [[ -f "$TOK/tokenizer.json" ]] || "$ROOT/scripts/fetch/fetch-tokenizers.sh"
  rm -rf "$BUNDLE.tmp" && mkdir -p "$BUNDLE.tmp/tokenizer" "$BUNDLE.tmp/data"
  # Stripped, the binary is ~71 MiB (most of it the kernels' PTX, which compresses ~3.5x).
  strip -o "$BUNDLE.tmp/retrace" "$BIN"
  gzip -9 "$BUNDLE.tmp/retrace"
  cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$BUNDLE.tmp/tokenizer/"
  cp "$PB/gsm8k.json" "$PB/math.json" "$BUNDLE.tmp/data/"
  rm -rf "$BUNDLE" && mv "$BUNDLE.tmp" "$BUNDLE"
  du -sh "$BUNDLE"
  echo "carry target/gpu-bundle; run: scripts/bench/gpu-check.sh"
  exit 0
fi

mkdir -p "$OUTDIR"
WORK="${GPU_CHECK_WORK:-$ROOT/target/gpu-check-work}"
if [[ "$MODE" == cpu ]]; then
  # ls fails when one of the two is not built: the other is still listed.
  BIN="${BIN:-$({ ls -t "$TGT/release/retrace" "$TGT/debug/retrace" 2>/dev/null || true; } | head -1)}"
  TOK="$CACHE/tokenizers/qwen2.5-math-prm"
  DATA="$(pb_dir)" || exit 1
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
  [[ -x "$PY" ]] || PY=python3
else
  if [[ -z "$BIN" ]]; then
    BIN="$WORK/retrace"
    mkdir -p "$WORK"
    gunzip -c "$BUNDLE/retrace.gz" > "$BIN"
    chmod +x "$BIN"
  fi
  TOK="$BUNDLE/tokenizer"
  DATA="$BUNDLE/data"
  PY="${PYTHON:-python3}"
  # The CUDA libraries from the Python nvidia-* packages torch installed (lib folders holding the
  # sonames the binary needs); the driver (libcuda.so.1) is the system's.
  LIBS="$("$PY" - <<'EOF'
import glob, os, sys
want = ["libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libnvrtc.so.13", "libcudart.so.13"]
dirs = []
for base in sys.path:
    for w in want:
        for p in glob.glob(os.path.join(base, "nvidia", "**", w), recursive=True):
            d = os.path.dirname(p)
            if d not in dirs:
                dirs.append(d)
print(":".join(dirs))
EOF
)"
  export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  {
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$BIN" | grep -E 'cuda|cublas|curand|nvrtc|not found' || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  } | tee "$OUTDIR/environment.txt"
fi
[[ -x "$BIN" ]] || { echo "no retrace binary at $BIN" >&2; exit 1; }
"$BIN" --version > "$OUTDIR/retrace-version.txt" 2>&1 || true

cd "$ROOT"
# The whole run stays under 8 minutes; each stage inside has its own limit and result file.
rm -f "$OUTDIR/summary.md"
set +e
timeout -k 10 470 "$PY" -m scripts.bench.gpu_check --mode "$MODE" --retrace "$BIN" \
  --tokenizer "$TOK" --data "$DATA" --out "$OUTDIR" --work "$WORK" 2>&1 | tee "$OUTDIR/gpu-check.log"
rc=${PIPESTATUS[0]}
# After a timeout the stages that finished still have their files; summarise those.
[[ -f "$OUTDIR/summary.md" ]] || "$PY" -m scripts.bench.gpu_check --summary-only --out "$OUTDIR" || true
set -e
[[ -f "$OUTDIR/summary.md" ]] && cat "$OUTDIR/summary.md"
# Checkpoints (the 7B one is 15 GB) and the unpacked binary are scratch and must not land in $OUT.
rm -rf "$WORK"
exit "$rc"
