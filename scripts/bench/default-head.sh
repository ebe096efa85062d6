#!/usr/bin/env bash
# Rebuilds the embedded default's head, heads/smollm2/, and decides by measurement whether it
# may be the default: a head trained on SmolLM2-135M-Instruct's Q4_1 GGUF (the very file the
# embedded default serves) on head-bench's training splits of ProcessBench, Mr-Ben and BIG-Bench
# Mistake, against zero-shot chat-lm on the same file, both with thresholds from the same dev, on
# the three splits neither trains on. Prints the comparison; writes the head folder (its base
# named relative to where the server installs it), its README's figures and the test fixture of
# known verdicts only with --write.
#
#   scripts/bench/default-head.sh --data DIR [--out runs/default-head] [--write]
#
# DIR holds processbench/ and general/ (as head-bench.sh). RETRACE_BIN=PATH runs that binary
# instead of building target/release/retrace. Features and chat-lm's scores are cached under OUT.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
source "$(dirname "$0")/../lib/heads.sh"
DATA="" OUT=runs/default-head WRITE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=$(cd "$2" && pwd); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --write) WRITE=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "default-head: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$DATA" ] || { echo "default-head: --data DIR is required (see --help)" >&2; exit 2; }
cd "$ROOT"
BASE=$CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$BASE" ] || scripts/fetch-smollm2.sh
release_bin
mkdir -p "$OUT"
cut_data "$DATA" "$OUT" --train 1000 --dev 200 --test 100 --seed 0
"$BIN" train-head --base "$BASE" --data "$OUT"/data/train-*.json --dev "$OUT"/data/dev-*.json \
  --test "$OUT"/data/test-*.json --cache "$OUT/features" --out "$OUT/head" --force \
  --no-progress --seed 0 | tee "$OUT/head.log"
zero_shot_chat_lm "$BASE" "$OUT"
python3 -m scripts.bench.default_head --run "$OUT" --data "$OUT/data" \
  $([ "$WRITE" = 1 ] && echo "--write heads/smollm2 --fixture tests/fixtures/default-head")
if [ "$WRITE" = 1 ]; then
  # The fixture's served scores are the new head's, and the binary embeds heads/smollm2: build
  # it again before asking it.
  release_bin
  python3 -m scripts.fixtures.default_head_served --retrace "$BIN"
fi
