#!/usr/bin/env bash
# Regenerates docs/performance.md's reuse tables: `retrace bench` on the tree-search, Best-of-N, RL-burst
# and plain ProcessBench workloads (the prefix cache on, off, and no reuse at all; llama-server's
# per-step procedure for tree search), through scripts/bench/bench.sh, which fetches the model,
# builds llama-server, the f32 GGUF and retrace in release when missing. The Best-of-N candidates
# are bench/best-of-n.jsonl (scripts/bench/make-best-of-n.sh regenerates them).
#
# Usage: scripts/bench/bench-reuse.sh [retrace bench flags...]
#   e.g. scripts/bench/bench-reuse.sh --limit 16 --rounds 1 --out docs/bench-reuse.md
set -euo pipefail
exec "$(dirname "$0")/bench.sh" --workload tree,best-of-n,rl-burst,processbench "$@"
