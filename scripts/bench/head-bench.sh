#!/usr/bin/env bash
# The trained-head benchmark: a head on a base (SmolLM2-135M f32 unless --base names another
# folder or .gguf file) trained on some labelled splits and tested on splits it never saw,
# against zero-shot chat-lm on the same base; a learning curve; training time; and extraction's
# throughput against serving's on the same traces.
#
#   scripts/bench/head-bench.sh --data DIR [--out runs/head-bench] [--train 2000] [--dev 300]
#                               [--test 150] [--more N] [--base PATH] [--seed S]
#
# --base: e.g. the Qwen2.5-Coder-0.5B GGUF that scripts/fetch/fetch-qwen-base.sh prints.
# --seed: the cut of the data and the heads' initialisation (default 0).
# RETRACE_BIN=PATH runs that binary instead of building target/release/retrace.
# --more N: one more learning-curve point, trained on the --train traces plus N more drawn from
# what dev left (docs/training.md's training time at 5,000 traces: --train 2000 --more 3000).
# DIR holds processbench/ and general/ (ProcessBench, Mr-Ben, BIG-Bench Mistake as JSON arrays).
# Features are cached under OUT/features, chat-lm's scores under OUT/chat-lm: a rerun reuses
# both. Prints markdown tables (docs/training.md shows them).
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
source "$(dirname "$0")/../lib/heads.sh"
cd "$ROOT"
DATA="" OUT=runs/head-bench TRAIN=2000 DEV=300 TEST=150 MORE=0 BASE="" SEED=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --train) TRAIN=$2; shift 2 ;;
    --dev) DEV=$2; shift 2 ;;
    --test) TEST=$2; shift 2 ;;
    --more) MORE=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "head-bench: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$DATA" ] || { echo "head-bench: --data DIR is required (see --help)" >&2; exit 2; }
if [ -z "$BASE" ]; then
  BASE=$CACHE/smollm2
  [ -f "$BASE/model.safetensors" ] || scripts/fetch-smollm2.sh --f32
fi
[ -e "$BASE" ] || { echo "head-bench: base $BASE does not exist" >&2; exit 2; }
release_bin
mkdir -p "$OUT"
cut_data "$DATA" "$OUT" --train "$TRAIN" --dev "$DEV" --test "$TEST" --more "$MORE" --seed "$SEED"

train() { # NAME [train-head options...]
  local name=$1; shift
  local data=("$OUT"/data/train-*.json)
  [ "$name" = more ] && data+=("$OUT"/data/more-*.json)
  "$BIN" train-head --base "$BASE" --data "${data[@]}" --dev "$OUT"/data/dev-*.json \
    --test "$OUT"/data/test-*.json --cache "$OUT/features" --out "$OUT/head-$name" --force \
    --no-progress --seed "$SEED" "$@" | tee "$OUT/train-$name.log"
}
train full
[ "$MORE" -gt 0 ] && train more
for n in 250 500 1000; do
  [ "$n" -lt "$TRAIN" ] && train "$n" --max-train "$n"
done

# Zero-shot chat-lm on the same base: its threshold chosen on the same dev, tested on the same
# held-out splits (and at its default, 0.5).
zero_shot_chat_lm "$BASE" "$OUT"
cat "$OUT/chat-lm.log"
python3 -m scripts.bench.head_bench chat --out "$OUT"

# Extraction against serving on the same 64 gsm8k traces, alternating, 2 rounds each: the
# features of a fresh cache against `retrace eval` in-process on the same base and format.
python3 - "$DATA" "$OUT/tput.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1] + "/processbench/gsm8k.json"))[:64]
json.dump(rows, open(sys.argv[2], "w"))
PY
echo '{"extract": [], "serve": []}' > "$OUT/throughput.json"
for round in 1 2; do
  rm -rf "$OUT/tput-cache" "$OUT/tput-eval"
  "$BIN" train-head --base "$BASE" --data "$OUT/tput.json" --cache "$OUT/tput-cache" \
    --out "$OUT/tput-head" --force --no-progress --taps final --mlp-hidden 0 > "$OUT/tput-train.log"
  start=$(date +%s.%N)
  "$BIN" eval --config "$OUT/chat-lm.toml" --evaluator chat-lm --data "$OUT/tput.json" \
    --out "$OUT/tput-eval" > /dev/null
  end=$(date +%s.%N)
  python3 - "$OUT" "$start" "$end" <<'PY'
import json, re, sys
out, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
log = open(out + "/tput-train.log").read()
s, tokens = re.search(r"features: ([\d.]+) s, \d+ traces \((\d+) tokens", log).groups()
t = json.load(open(out + "/throughput.json"))
t["extract"].append(int(tokens) / float(s))
t["serve"].append(int(tokens) / (end - start))
json.dump(t, open(out + "/throughput.json", "w"))
PY
done
python3 -m scripts.bench.head_bench table --out "$OUT" | tee "$OUT/results.md"
