"""What the Python scripts share, as `common.sh` is what the shell scripts share: the repository
root, the download cache, where ProcessBench is, a free port, a server's readiness, the retrace
binary, and data files of rows.

A script imports it by name, `from scripts.lib.common import free_port`, and so runs as a module
from the repository root (`python3 -m scripts.bench.soak`); nothing here touches `sys.path`.
Standard library only, so that a script using it needs no venv.

  ROOT, CACHE                the repository root; the download cache ($RETRACE_CACHE_DIR)
  pb_dir()                   the full ProcessBench set when set, else the committed subset
  free_port()                a free TCP port on 127.0.0.1
  wait_http(url, secs, ...)  waits until url answers 200; gives up at once when the server died
  retrace_bin(given, ...)    the retrace binary: given, else target/release's or target/debug's
  read_rows(path)            a data file's rows: a JSON array, or JSONL
  write_jsonl(path, rows)    rows as JSONL, one object a line
"""

import json
import os
import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# As common.sh: an empty variable counts as unset.
CACHE = Path(os.environ.get("RETRACE_CACHE_DIR") or Path.home() / ".cache" / "retrace")


def pb_dir():
    """ProcessBench's folder: $RETRACE_PROCESSBENCH_DIR (a relative path is taken from the
    repository root) when set, else the committed subset tests/fixtures/processbench."""
    full = os.environ.get("RETRACE_PROCESSBENCH_DIR")
    return ROOT / full if full else ROOT / "tests" / "fixtures" / "processbench"


def free_port():
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (nothing holds it now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, seconds, proc=None, log=None):
    """Waits until `url` answers 200. Exits when it has not within `seconds` (killing `proc`),
    or as soon as `proc`, the server's process, has exited (naming `log`, where its output went)."""
    deadline = time.monotonic() + seconds
    while True:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"exited before {url} answered" + (f"; see {log}" if log else ""))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
            sys.exit(f"no answer from {url} within {seconds} s")
        time.sleep(0.2)


def retrace_bin(given=None, profiles=("release", "debug")):
    """The retrace binary: `given` when passed, else the first of target/<profile>/retrace that
    is built, else `retrace` on PATH; exits saying so when there is none."""
    if given:
        return str(given)
    for profile in profiles:
        b = ROOT / "target" / profile / "retrace"
        if b.is_file():
            return str(b)
    found = shutil.which("retrace")
    if not found:
        where = " or ".join(f"target/{p}" for p in profiles)
        build = "cargo build" if "debug" in profiles else "cargo build --release"
        sys.exit(f"no retrace binary in {where} or on PATH: build it ({build}) or pass one")
    return found


def read_rows(path):
    """A data file's rows: a JSON array, or JSONL (one object a line, blank lines skipped; split
    at "\\n" only, as a string may hold U+2028, at which str.splitlines would split too)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def write_jsonl(path, rows):
    """Writes `rows` one JSON object a line (ensure_ascii, as json.dumps does by default)."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
