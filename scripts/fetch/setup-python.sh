#!/usr/bin/env bash
# Idempotently creates .venv with the Python packages the fixture scripts and test setup need, and
# ruff, the Python lint (scripts/check/lint-python.sh).
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, tokenizers, safetensors, gguf, jinja2, transformers" 2>/dev/null; then
  .venv/bin/pip install -q "numpy==2.4.*" "tokenizers==0.23.*" "safetensors==0.8.*" "gguf==0.19.*" "jinja2==3.1.*" "transformers==5.24.*"
fi
# Pinned to a minor version: a new ruff may flag what this one passed.
if ! .venv/bin/ruff --version 2>/dev/null | grep -q '^ruff 0\.17\.'; then
  .venv/bin/pip install -q "ruff==0.17.*"
fi
