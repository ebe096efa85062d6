#!/usr/bin/env bash
# The Python checks: the client's, the bench scripts' and the checks'. Installs retrace-client
# (clients/python, its messages generated from proto/) with pytest into the repo's .venv when
# missing or built from other sources, then runs its tests, the bench scripts' and the checks'
# tests (scripts/bench/tests, scripts/check/tests) and the examples against real `retrace serve`
# processes started from $RETRACE_BIN (default target/debug/retrace, built by cargo beforehand;
# never built here).
# Exits non-zero when any test or example fails.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
export RETRACE_BIN="${RETRACE_BIN:-$PWD/target/debug/retrace}"
if [ ! -x "$RETRACE_BIN" ]; then
  echo "test-python: no retrace binary at $RETRACE_BIN (run cargo build, or set RETRACE_BIN)" >&2
  exit 1
fi

# Reinstall only when the sources the package is built from changed since the last install.
stamp=.venv/.retrace-client.stamp
sources=$(find clients/python/pyproject.toml clients/python/setup.py clients/python/retrace_client proto \
  -name '_pb' -prune -o -type f \( -name '*.py' -o -name '*.proto' -o -name '*.toml' \) -print | LC_ALL=C sort)
want=$(cat $sources | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
  || ! .venv/bin/python -c "import retrace_client, pytest, pytest_asyncio" 2>/dev/null; then
  .venv/bin/pip install -q ./clients/python "pytest==9.2.*" "pytest-asyncio==1.5.*"
  echo "$want" > "$stamp"
fi

.venv/bin/python -m pytest -q clients/python/tests
# The bench scripts' reading of train-head's output and the checks' parsers (their own folders,
# apart from the client's config).
.venv/bin/python -m pytest -q -p no:asyncio scripts/bench/tests scripts/check/tests scripts/learn/tests
for example in examples/best_of_n.py examples/grpo_reward_step.py; do
  echo "== $example"
  .venv/bin/python "$example"
done
