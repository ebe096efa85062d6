"""Prints scripts/bench/judge-parse-rate.sh's table from a run's files, one row per mode found.

Per mode: replies (first turns, from the proxy's log); read on the first try: those retrace did
not send a repair turn for (it repairs every unreadable reply but an empty one, and none here is
empty, so this is retrace's own parser's count); read after repair: those plus the repairs that
came back readable (short verdict-only replies, read with build_corpus.py's oracle, which
tests/it/judge_replies.rs holds equal to retrace's parser); failed requests and F1 (retrace eval's
summary.json); seconds per trace (the eval's wall time, MODE.seconds).

Usage: table.py OUT_DIR MODE...   (run as a file: this folder's name is no module name, and
Python puts the script's own folder, build_corpus.py's, first on its path)
"""

import json
import os
import sys

from build_corpus import expect_of


def fmt(v):
    return "n/a" if v is None else f"{v:.1f}"


out, modes = sys.argv[1], sys.argv[2:]
replies = [json.loads(line) for line in open(os.path.join(out, "replies.jsonl"))]
print("| output | replies | read on the first try | read after repair | failed requests "
      "| F1 ProcessBench (gsm8k, math mean) | F1 multiple-choice | s / trace |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for mode in modes:
    first = [r for r in replies if r["mode"] == mode and r["turn"] == "reply"]
    repairs = [r for r in replies if r["mode"] == mode and r["turn"] == "repair"]
    empty = sum(not r["reply"].strip() for r in first)
    read = len(first) - len(repairs) - empty
    rescued = sum("error" not in expect_of(r) for r in repairs)
    s = json.load(open(os.path.join(out, mode, "summary.json")))["summary"]
    f1 = {x["split"]: x["f1"] for x in s["splits"]}
    traces = sum(x["counts"]["error_total"] + x["counts"]["correct_total"] for x in s["splits"])
    failed = sum(x["failed"] for x in s["splits"])
    pb = [f1[k] for k in ("gsm8k", "math") if f1.get(k) is not None]
    secs = float(open(os.path.join(out, f"{mode}.seconds")).read())
    n = len(first)
    print(f"| {mode} | {n} | {read} ({100 * read / n:.1f}%) | {read + rescued} "
          f"({100 * (read + rescued) / n:.1f}%) | {failed} of {traces} "
          f"| {fmt(sum(pb) / len(pb) if pb else None)} | {fmt(f1.get('multiple-choice'))} "
          f"| {secs / traces:.1f} |")
