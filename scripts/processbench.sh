# Sourced by the scripts that read ProcessBench (needs $ROOT, the repo root). The one variable is
# RETRACE_PROCESSBENCH_DIR: a folder holding the full set's four JSON splits (gsm8k.json,
# math.json, olympiadbench.json, omnimath.json). The repository carries only a 32-trace-per-split
# subset, tests/fixtures/processbench (its README says which traces and why).
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

pb_full() {
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
