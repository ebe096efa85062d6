#!/usr/bin/env bash
# The long runs of the overload tests, printing the tables docs/operating.md shows:
# - tests/it/reliability.rs: a `retrace serve` child on the tiny PRM, overloaded at twice its
#   measured sustainable rate for SECONDS (default 60), then as long under load before SIGTERM;
# - tests/it/overload_model.rs: the same child on SmolLM2-135M f32 (scripts/fetch-smollm2.sh
#   --f32), at twice its capacity for SECONDS with 2 s deadlines, uniform and 10:1 mixed traces.
#
#   scripts/bench/soak.sh [SECONDS] [cargo test args, e.g. --release]
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
seconds="${1:-60}"
shift || true
RETRACE_SOAK_S="$seconds" cargo test -p retrace-cli --test it "$@" -- reliability:: --nocapture \
  --test-threads=1
RETRACE_SOAK_S="$seconds" cargo test -p retrace-cli --test overload_model "$@" -- --nocapture
