#!/usr/bin/env bash
# Checks that each image under deploy/ builds from exactly what its Dockerfile copies, without
# Docker: for every deploy/Dockerfile*, reads the COPY lines of its build stage (the first stage,
# up to the next FROM; `COPY --from=...` lines are skipped, a COPY may name several sources and
# other --flags), copies exactly those paths from the repository root into an empty temporary
# folder laid out as the stage's WORKDIR, and runs there the stage's `cargo build --locked` of
# the same binary. A source path the Dockerfile forgets to copy (prompts/ compiled in by
# include_str!, a crates/ folder of a workspace, ...) then fails here as it would in `docker
# build`, and the message names the Dockerfile.
#
# What it does not check: the base images, the apt-get lines and the runtime stage. It builds the
# dev profile, not --release (the same sources, and the dependencies already built for the tests
# are reused). The CUDA image (Dockerfile.cuda) is built WITHOUT its `cuda` feature, since this
# machine has no nvcc: that checks the same sources compile, not the CUDA kernels.
#
#   scripts/check-images.sh [deploy/Dockerfile ...]      # default: every deploy/Dockerfile*
#
# Env: CARGO_TARGET_DIR (default $ROOT/target): the dependencies are shared with that target
# folder. Note the temporary crate's binary is written to its debug/ folder as any build's is
# (the next cargo build in the repository puts the repository's own back).
set -euo pipefail
source "$(dirname "$0")/lib/common.sh"
cd "$ROOT"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(deploy/Dockerfile*)
failed=()
for df in "${FILES[@]}"; do
  echo "== $df"
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/retrace-image-check.XXXXXX")"
  # The build stage's WORKDIR-relative COPY plan, and its cargo build arguments.
  if ! plan="$(python3 - "$df" "$WORK" <<'PYEOF'
import json, os, shlex, shutil, sys

df, work = sys.argv[1], sys.argv[2]
lines, cur = [], ""
for raw in open(df, encoding="utf-8"):
    s = raw.rstrip("\n")
    if not cur and (not s.strip() or s.lstrip().startswith("#")):
        continue
    if s.endswith("\\"):
        cur += s[:-1] + " "
        continue
    lines.append((cur + s).strip())
    cur = ""
if cur:
    lines.append(cur.strip())

stage, froms, workdir, build = [], 0, "/", None
for l in lines:
    word = l.split(None, 1)[0].upper()
    if word == "FROM":
        froms += 1
        if froms > 1:
            break
        continue
    if froms == 1:
        stage.append(l)
if froms == 0:
    sys.exit(f"{df}: no FROM line")

def copy_args(rest):
    rest = rest.strip()
    if rest.startswith("["):
        return json.loads(rest)
    return shlex.split(rest)

copied = 0
for l in stage:
    word, rest = (l.split(None, 1) + [""])[:2]
    word = word.upper()
    if word == "WORKDIR":
        workdir = os.path.join(workdir, rest.strip())
    elif word in ("COPY", "ADD"):
        args = copy_args(rest)
        flags = [a for a in args if a.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue  # from another stage or image, not from the build context
        args = [a for a in args if not a.startswith("--")]
        if len(args) < 2:
            sys.exit(f"{df}: cannot read: {l}")
        *srcs, dest = args
        # Relative to the stage's WORKDIR; the temporary folder stands for that WORKDIR.
        dest_abs = os.path.normpath(os.path.join(workdir, dest))
        rel = os.path.relpath(dest_abs, workdir)
        if rel.startswith(".."):
            print(f"note: {l!r} copies outside WORKDIR {workdir}; skipped", file=sys.stderr)
            continue
        target = os.path.join(work, rel)
        into_dir = dest.endswith("/") or len(srcs) > 1
        for src in srcs:
            if not os.path.exists(src):
                sys.exit(f"{df}: `{l}` copies {src}, which is not in the repository")
            if os.path.isdir(src):
                # Docker copies a folder's contents into the destination.
                shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
            else:
                to = os.path.join(target, os.path.basename(src)) if into_dir else target
                os.makedirs(os.path.dirname(to) or ".", exist_ok=True)
                shutil.copy2(src, to)
            copied += 1
    elif word == "RUN" and "cargo build" in rest and build is None:
        build = shlex.split(rest[rest.index("cargo build"):].split("&&")[0])
if build is None:
    sys.exit(f"{df}: its build stage runs no `cargo build`")
args, skip = [], False
for i, a in enumerate(build[2:]):
    if skip:
        skip = False
        continue
    if a in ("--release", "--locked"):
        continue
    if a == "--features":
        skip = True  # the CPU feature set: no --features (cuda needs nvcc)
        continue
    if a.startswith("--features="):
        continue
    args.append(a)
print(" ".join(shlex.quote(a) for a in args))
print(f"copied {copied} paths of the build stage (WORKDIR {workdir})", file=sys.stderr)
PYEOF
  )"; then
    failed+=("$df: its COPY lines could not be followed (above)")
    rm -rf "$WORK"
    continue
  fi
  echo "in $WORK: $(cd "$WORK" && ls -A | tr '\n' ' ')"
  # shellcheck disable=SC2086
  if (cd "$WORK" && cargo build --locked $plan 2>&1 | tail -40; exit "${PIPESTATUS[0]}"); then
    echo "ok: $df builds from what it copies"
  else
    failed+=("$df: cargo build --locked $plan failed in a folder holding only what its build stage COPYs (a path missing from its COPY lines? add it, e.g. COPY prompts prompts)")
  fi
  rm -rf "$WORK"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo >&2
  printf 'check-images: FAILED %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "check-images: every image's build stage builds from what it copies"
