#!/usr/bin/env bash
# Judge distillation, end to end: a real instruct judge (Qwen2.5-Coder-1.5B on llama-server,
# scripts/fetch/fetch-judge.sh) labels traces with `retrace label`; a head on SmolLM2-135M (f32) is
# trained on the labels of some questions with `retrace train-head`; on the other questions' traces,
# neither trained on, it prints how often the head's first error agrees with the judge's, and each
# one's cost per trace on this machine, measured side by side in alternating rounds, both on the
# same test traces within a round and on new ones each round (the judge through `retrace eval`, two
# requests in flight as llama-server has two slots; the head through a `retrace serve` of it, 16 in
# flight).
#
#   scripts/bench/judge-distill.sh --data DIR [--out runs/judge-distill] [--traces 200] [--split S]
#
# DIR holds general/ (Mr-Ben, BIG-Bench Mistake); --split names the file whose first --traces
# traces (in a seeded order) are labelled [default mrben-biology]. Rows the judge fails stop the
# script before training; `retrace label` resumes, so a rerun labels only what is missing.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
DATA="" OUT=runs/judge-distill TRACES=200 SPLIT=mrben-biology
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --traces) TRACES=$2; shift 2 ;;
    --split) SPLIT=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "judge-distill: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$DATA" ] || { echo "judge-distill: --data DIR is required (see --help)" >&2; exit 2; }
BASE=$CACHE/smollm2
[ -f "$BASE/model.safetensors" ] || scripts/fetch-smollm2.sh --f32
GGUF="$(scripts/fetch/fetch-judge.sh)"
scripts/fetch/fetch-llama-server.sh
LLAMA="$CACHE/llama-server/bin/llama-server"
cargo build --release --locked --quiet
BIN="$ROOT/target/release/retrace"
mkdir -p "$OUT"

# The traces, without their gold labels (the judge's are what the head learns).
python3 - "$DATA/general/$SPLIT.json" "$OUT/unlabelled.jsonl" "$TRACES" <<'PY'
import json, random, sys
rows = json.load(open(sys.argv[1]))
random.Random(0).shuffle(rows)
with open(sys.argv[2], "w") as f:
    for r in rows[: int(sys.argv[3])]:
        r.pop("label", None)
        f.write(json.dumps(r) + "\n")
PY

LPORT=$(free_port)
"$LLAMA" -m "$GGUF" --host 127.0.0.1 --port "$LPORT" -c 8192 -np 2 -t 2 --jinja \
  >"$OUT/llama-server.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$LPORT/health" 300
cat >"$OUT/judge.toml" <<TOML
[[evaluator]]
name = "judge"
kind = "judge"
base_url = "http://127.0.0.1:$LPORT/v1"
model = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
upstream = "llama.cpp"
output = "json_schema"
max_tokens = 512
timeout_s = 900
cache_entries = 0
max_concurrency = 2
TOML
# `retrace label` exits non-zero when any row failed (after writing the rest and listing the
# failures): a head trained on part of the labels would not be the run asked for.
if ! "$BIN" label --config "$OUT/judge.toml" --evaluator judge --data "$OUT/unlabelled.jsonl" \
  --out "$OUT/labelled.jsonl" --concurrency 2 --no-progress | tee "$OUT/label.log"; then
  echo "judge-distill: labelling failed (summary in $OUT/label.log; failed rows and their errors" \
    "in $OUT/labelled.failed.jsonl); rerun the same command to label only what is missing" >&2
  exit 1
fi

# Train on 70% of the questions, test on the rest.
python3 - "$OUT" <<'PY'
import json, random, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/labelled.jsonl")]
qs = sorted({" ".join(r["problem" if "problem" in r else "question"].lower().split()) for r in rows})
random.Random(0).shuffle(qs)
test_q = set(qs[: round(len(qs) * 0.3)])
key = lambda r: " ".join(r["problem" if "problem" in r else "question"].lower().split())
with open(f"{out}/train.jsonl", "w") as tr, open(f"{out}/test.jsonl", "w") as te:
    for r in rows:
        (te if key(r) in test_q else tr).write(json.dumps(r) + "\n")
PY
"$BIN" train-head --base "$BASE" --data "$OUT/train.jsonl" --test "$OUT/test.jsonl" \
  --cache "$OUT/features" --out "$OUT/head" --force --no-progress | tee "$OUT/train.log"

# Each one's cost per trace on the same test traces, side by side: alternating rounds.
GPORT=$(free_port); MPORT=$(free_port); HPORT=$(free_port)
cat >"$OUT/head.toml" <<TOML
[server]
grpc_addr = "127.0.0.1:$GPORT"
metrics_addr = "127.0.0.1:$MPORT"
http_addr = "127.0.0.1:$HPORT"

[[evaluator]]
name = "head"
kind = "prm"
family = "head"
model = "$ROOT/$OUT/head"
TOML
"$BIN" serve --config "$OUT/head.toml" >"$OUT/serve.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$MPORT/metrics" 120
# Each round its own traces, so that neither the head's prefix cache nor llama-server's prompt
# cache holds a trace from an earlier round.
N=${COST_TRACES:-12}
timed() { # ROUND NAME, eval options...
  local round=$1 name=$2; shift 2
  rm -rf "$OUT/cost-$name"
  local start; start=$(date +%s.%N)
  "$BIN" eval --data "$OUT/cost-$round.jsonl" --out "$OUT/cost-$name" --no-progress "$@" >/dev/null
  echo "$name $(echo "$(date +%s.%N) - $start" | bc)" >>"$OUT/cost.txt"
}
: >"$OUT/cost.txt"
for round in 1 2; do
  sed -n "$(( (round - 1) * N + 1 )),$(( round * N ))p" "$OUT/test.jsonl" >"$OUT/cost-$round.jsonl"
  timed "$round" judge --config "$OUT/judge.toml" --evaluator judge --concurrency 2
  timed "$round" head --server "127.0.0.1:$GPORT" --evaluator head
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/head/test-scores.jsonl")]
n = sum(1 for _ in open(f"{out}/cost-1.jsonl"))
cost = {}
for line in open(f"{out}/cost.txt"):
    name, secs = line.split()
    cost.setdefault(name, []).append(float(secs) / n)
agree = sum(r["prediction"] == r["label"] for r in rows)
wrong = sum(r["label"] != -1 for r in rows)
print("\n| round | judge s/trace (Qwen2.5-Coder-1.5B Q4_K_M, llama-server) | head s/trace (SmolLM2-135M f32, retrace serve) | head speed-up |")
print("|---:|---:|---:|---:|")
for i, (j, h) in enumerate(zip(cost["judge"], cost["head"])):
    print(f"| {i + 1} | {j:.2f} | {h:.3f} | {j / h:.0f}x |")
print(f"\n{n} test traces per round. On all {len(rows)} test traces (questions neither trained on; "
      f"{wrong} with a first error by the judge), the head's first error equals the judge's on "
      f"{agree} ({100 * agree / len(rows):.1f}%).")
PY
