#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ over its committed corpus, one target at a time, and
# prints libFuzzer's final stats (executions, exec/s) for each. Installs cargo-fuzz if missing.
#
#   scripts/check/fuzz.sh [SECONDS_OR_RUNS] [TARGET...]
#     120          each target for 120 seconds (default 60)
#     10000000runs each target for ten million executions
#
# Builds with nightly, optimised, with debug assertions and overflow checks, and without a
# sanitizer (-s none): the targets are safe Rust, and an ASan build of the whole dependency tree
# (candle included) costs far more than it finds here. New inputs go to a scratch corpus beside
# the build; merge the worthwhile ones with `cargo fuzz cmin`. Crashes land in fuzz/artifacts/.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT/fuzz"
budget="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(segment judge_reply dataset_rows config request)
fi
case "$budget" in
  *runs) limit="-runs=${budget%runs}" ;;
  *) limit="-max_total_time=$budget" ;;
esac
# The same dependency versions as the main crate, resolved from its lock.
[ -f Cargo.lock ] || cp ../Cargo.lock Cargo.lock
command -v cargo-fuzz >/dev/null || cargo +nightly install cargo-fuzz --locked
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
flags=(-O -a -s none)
nice -n 15 cargo +nightly fuzz build "${flags[@]}"
for t in "${targets[@]}"; do
  scratch="$CARGO_TARGET_DIR/fuzz-corpus/$t"
  mkdir -p "$scratch"
  echo "== $t ($limit)"
  # One job: the machines this runs on are shared.
  status=0
  nice -n 15 cargo +nightly fuzz run "${flags[@]}" "$t" "$scratch" "corpus/$t" -- \
    "$limit" -timeout=10 -print_final_stats=1 >"$scratch.log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec|Done )' "$scratch.log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$scratch.log"
    exit "$status"
  fi
done
