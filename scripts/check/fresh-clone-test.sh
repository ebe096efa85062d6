#!/usr/bin/env bash
# The fresh-clone proof: clones this repository's committed HEAD into an empty temporary folder
# (nothing beside it: no shared/ data folder, no sibling checkout), unsets every RETRACE_*
# variable and CARGO_TARGET_DIR (scripts/test.sh builds into the clone's own target/, where
# scripts/check/check-deploy.sh and test-python.sh look for the binary), and runs scripts/test.sh
# there. Uncommitted changes are not in the clone: commit first.
#
#   scripts/check/fresh-clone-test.sh [--cold] [cargo test args...]
#
# The download cache stays at its default, $HOME/.cache/retrace: the scripts fill it themselves
# from the registries (sha256-checked), so reusing it proves nothing less about the repository.
# --cold points RETRACE_CACHE_DIR at an empty folder inside the temporary one instead, to prove
# the downloads and the llama-server build too (about 20 minutes more on 2 cores).
# The temporary folder is kept (its path is printed) so a failure can be looked at.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
COLD=0
if [ "${1:-}" = --cold ]; then COLD=1; shift; fi
d="$(mktemp -d "${TMPDIR:-/tmp}/retrace-fresh.XXXXXX")"
git clone -q "$ROOT" "$d/retrace"
for v in $(compgen -e | grep '^RETRACE_' || true); do unset "$v"; done
unset CARGO_TARGET_DIR
if [ "$COLD" = 1 ]; then export RETRACE_CACHE_DIR="$d/cache"; fi
cd "$d/retrace"
echo "fresh-clone-test: $(git log --oneline -1) in $d/retrace (cache: ${RETRACE_CACHE_DIR:-$HOME/.cache/retrace})"
scripts/test.sh "$@"
echo "fresh-clone-test: passed ($d)"
