#!/usr/bin/env bash
# The long run of the reliability tests (tests/it/reliability.rs): a `retrace serve` child on the
# tiny PRM, overloaded at twice its measured sustainable rate for SECONDS (default 60), then as
# long under load before SIGTERM; prints the two figures tables docs/operating.md shows.
#
#   scripts/soak.sh [SECONDS] [cargo test args, e.g. --release]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
RETRACE_SOAK_S="$seconds" cargo test -p retrace-cli --test it "$@" -- reliability:: --nocapture \
  --test-threads=1
