#!/usr/bin/env bash
# Every probe kind on one base, over seeds: each tap of --taps with each head of --heads trained
# on its own, then dev choosing among them all, for each seed, over one feature cache (extracted
# once, by the first run); zero-shot chat-lm on the same base with its threshold from the same
# dev. Prints one markdown table: held-out F1 per split at dev's threshold, their mean over seeds
# (lowest-highest seed), dev's F1, the mean at a threshold chosen on 20 of each split's own
# traces, and training time; then extraction's tokens/s. Each run's head folder stays
# (OUT/seed-S/head-NAME, with its dev and test scores), its log beside it (train-NAME.log).
#
#   scripts/bench/head-kinds.sh --data DIR --base PATH [--out runs/head-kinds] [--seeds 0,1,2]
#       [--taps middle,span:middle,middle+span:middle] [--heads logistic,mlp,trace]
#       [--train 300] [--dev 100] [--test 40] [--cut-seed 0] [--no-chat]
#
# --base: a model folder or .gguf (scripts/fetch/fetch-qwen-base.sh prints the 0.5B's path).
# The data is cut as head-bench.sh cuts it (--cut-seed draws the cut; --seeds move only the
# heads' shuffles and initial weights, so every seed reads the same cached features).
# RETRACE_BIN=PATH runs that binary instead of building target/release/retrace. A rerun over the
# same --out reuses the features and chat-lm's scores.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
source "$(dirname "$0")/../lib/heads.sh"
DATA="" BASE="" OUT=runs/head-kinds SEEDS=0,1,2 TAPS=middle,span:middle,middle+span:middle
HEADS=logistic,mlp,trace TRAIN=300 DEV=100 TEST=40 CUT=0 CHAT=1
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=$(realpath "$2"); shift 2 ;;
    --base) BASE=$(realpath "$2"); shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --taps) TAPS=$2; shift 2 ;;
    --heads) HEADS=$2; shift 2 ;;
    --train) TRAIN=$2; shift 2 ;;
    --dev) DEV=$2; shift 2 ;;
    --test) TEST=$2; shift 2 ;;
    --cut-seed) CUT=$2; shift 2 ;;
    --no-chat) CHAT=0; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "head-kinds: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -d "$DATA/general" ] && [ -d "$DATA/processbench" ] \
  || { echo "head-kinds: --data DIR holding general/ and processbench/ is required" >&2; exit 2; }
[ -n "$BASE" ] && [ -e "$BASE" ] || { echo "head-kinds: --base PATH is required and must exist" >&2; exit 2; }
cd "$ROOT"
release_bin
mkdir -p "$OUT"
cut_data "$DATA" "$OUT" --train "$TRAIN" --dev "$DEV" --test "$TEST" --seed "$CUT"

train() { # SEED NAME [train-head options...]
  local seed=$1 name=$2; shift 2
  mkdir -p "$OUT/seed-$seed"
  "$BIN" train-head --base "$BASE" --data "$OUT"/data/train-*.json --dev "$OUT"/data/dev-*.json \
    --test "$OUT"/data/test-*.json --cache "$OUT/features" --out "$OUT/seed-$seed/head-$name" --force \
    --no-progress --seed "$seed" "$@" > "$OUT/seed-$seed/train-$name.log"
}
for seed in ${SEEDS//,/ }; do
  train "$seed" auto --taps "$TAPS"
  for tap in ${TAPS//,/ }; do
    for head in ${HEADS//,/ }; do
      train "$seed" "$head-${tap//[:+]/_}" --taps "$tap" --head "$head"
    done
  done
  echo "head-kinds: seed $seed done" >&2
done

if [ "$CHAT" = 1 ]; then
  zero_shot_chat_lm "$BASE" "$OUT"
  python3 -m scripts.bench.head_bench chat --out "$OUT" > /dev/null
fi
python3 -m scripts.bench.head_bench kinds --out "$OUT" --taps "$TAPS" --heads "$HEADS" \
  | tee "$OUT/results.md"
