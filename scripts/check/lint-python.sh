#!/usr/bin/env bash
# The Python lint, run by CI: ruff over scripts/ and clients/, with the rules of ruff.toml at the
# root (pycodestyle, pyflakes, import order). ruff comes into .venv through fetch/setup-python.sh.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
use_venv
"$ROOT/.venv/bin/ruff" check scripts clients
