"""retrace's learning loop: retrain a cascade's head from what its judge decided, and swap it in
only when it is no worse than the head serving (with `target_agreement` on the cascade: when it
keeps more traces at the cascade's targets, or as many and is no worse).

The server records each trace the cascade's judge decides (`record` on the cascade). Every
`--every` new rows this script:
  1. reads every recorded row (the current file and its rotated ones), plus any `--seed` data;
  2. holds out `--dev-share` of the recorded rows by question (a question's traces stay on one
     side; the same question always lands on the same side), and splits the held-out rows by
     question again, half and half: a selection set, on which train-head chooses the candidate's
     kind, taps and threshold, and a comparison set apart from it;
  3. trains a candidate with `retrace train-head` on the serving head's base and format, over
     the seed and the rest of the recorded rows (in files of `--chunk` rows, so each round
     extracts only the new rows' features), choosing on the selection set;
  4. scores the serving head and the candidate on the newest `--max-dev` comparison rows the
     same way (`retrace eval`, each head loaded in-process) against the judge's labels:
     ProcessBench's F1, on rows neither head chose anything on;
  5. with `target_agreement` on the cascade, calibrates both heads at its targets as the server
     would (`retrace calibrate`, guarantee.py) and measures the share each keeps on rows apart
     from the calibration rows. When the cascade's `calibration` file lies inside the head
     folder, the calibration rows are the serving head's and half the comparison rows (by
     question), written into the candidate's folder so they travel with it; else the server's
     own calibration file. The other comparison rows measure. No head trains on a calibration
     row's question;
  6. swaps when the candidate keeps more at the targets, or keeps as much (nothing, say) and its
     F1 is no worse; without a guarantee, when its F1 is no worse. A swap puts the candidate in
     the serving head's folder (the old one moved aside into the round's folder) and asks the
     server to reload (`POST /v1/reload`); a refused or failed reload puts the old folder back.
Every decision goes to WORK/distill.jsonl and WORK/report.md, and one line to stdout.

It is a script over the commands rather than a command of its own: each step is a tool that
exists (train-head, eval, the reload call), an operator can rerun any one of them by hand from the
round's folder, and the server needs nothing but its reload call. Standard library only.

  python3 -m scripts.learn.distill --config retrace.toml --evaluator CASCADE --http http://127.0.0.1:8080 \\
      [--seed FILE ...] [--every 500] [--dev-share 0.2] [--work retrace-distill] [--once]
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

from scripts.learn import guarantee
from scripts.lib.common import read_rows as read_file
from scripts.lib.common import retrace_bin, write_jsonl


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, type=Path, help="the server's config")
    ap.add_argument("--evaluator", required=True, help="the cascade whose head learns")
    ap.add_argument("--http", required=True, help="the server's HTTP address, for the reload")
    ap.add_argument("--token-env", help="variable holding the server's bearer token")
    ap.add_argument("--retrace", type=Path, help="the retrace binary (default: target/release, "
                    "else target/debug, else `retrace` on PATH)")
    ap.add_argument("--seed", type=Path, nargs="*", default=[], help="labelled data trained on too")
    ap.add_argument("--every", type=int, default=500, help="new recorded rows between rounds")
    ap.add_argument("--dev-share", type=float, default=0.2)
    ap.add_argument("--chunk", type=int, default=100,
                    help="recorded training rows per file, each file's features cached apart")
    ap.add_argument("--max-dev", type=int, default=200,
                    help="held-out rows scored per round: the newest ones (both heads are scored)")
    ap.add_argument("--work", type=Path, default=Path("retrace-distill"))
    ap.add_argument("--once", action="store_true", help="one round now, then exit")
    ap.add_argument("--poll-s", type=float, default=10.0)
    ap.add_argument("--train-arg", action="append", default=[],
                    help="passed to train-head (repeatable), e.g. --train-arg=--epochs=30")
    a = ap.parse_args(argv)
    if min(a.every, a.chunk, a.max_dev) < 1 or not 0.0 < a.dev_share < 1.0:
        ap.error("--every, --chunk and --max-dev must be at least 1, --dev-share in (0, 1)")
    return a


class Setup:
    """What the server's config says of the cascade: where it records, which head it runs."""

    def __init__(self, config, cascade):
        tables = {t.get("name"): t for t in tomllib.loads(config.read_text()).get("evaluator", [])}
        c = tables.get(cascade)
        if not c or c.get("kind") != "cascade":
            sys.exit(f"{config}: no cascade named {cascade!r}")
        record = c.get("record")
        if record is None:
            sys.exit(f"{config}: cascade {cascade!r} records nothing: set `record` on it")
        self.record = Path(record if isinstance(record, str) else record["path"])
        self.prm = c["prm"]
        p = tables.get(self.prm, {})
        if p.get("family") != "head":
            sys.exit(f"{config}: the cascade's prm {self.prm!r} is not a trained head")
        self.head = Path(p["model"])
        for path in ("record", "head"):
            v = getattr(self, path)
            if not v.is_absolute():
                setattr(self, path, config.parent / v)
        self.guarantee = guarantee.Guarantee.of(
            c, self.head, lambda v: v if v.is_absolute() else config.parent / v)

    def record_files(self):
        folder = self.record.is_dir() or str(self.record).endswith("/")
        d, stem = (self.record, "verdicts") if folder else (self.record.parent, self.record.stem)
        if not d.is_dir():
            return []
        names = [n for n in os.listdir(d) if n == f"{stem}.jsonl"
                 or (n.startswith(f"{stem}.") and n.endswith(".jsonl") and n[len(stem) + 1:-6].isdigit())]
        return sorted(d / n for n in names)


def read_rows(files):
    rows = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                # A line the writer has not finished is not a row yet.
                if line.endswith("\n") and line.strip():
                    rows.append(json.loads(line))
    return rows


def on_dev(question, share):
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")
    return h % 10_000 < share * 10_000


def to_compare(question):
    """Of a held-out question, whether it compares heads (else it selects the candidate): another
    part of the hash than `on_dev`'s, so the halves are even within the held-out share."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[8:16], "big")
    return h % 2 == 1


def split(rows, share, max_compare):
    """Training rows, the selection set (train-head's --dev) and the newest `max_compare` rows
    of the comparison set; no question on two of them."""
    held = [r for r in rows if on_dev(r["question"], share)]
    train = [r for r in rows if not on_dev(r["question"], share)]
    select = [r for r in held if not to_compare(r["question"])]
    compare = [r for r in held if to_compare(r["question"])][-max_compare:]
    return train, select, compare


def write_chunks(folder, rows, size):
    """`rows` as files of `size` rows in record order: a file already written is written again
    byte for byte, so train-head's feature cache (keyed by each file's checksum) extracts only
    the rows that are new."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        path = folder / f"rows-{start:07d}.jsonl"
        write_jsonl(path, part)
        paths.append(path)
    return paths


def run(cmd, log):
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}); see {log}")


def head_config(head, out, threshold=None):
    """A config serving `head` alone, as `head`, for the commands that load it in-process; at
    `threshold` when given (else the head's own)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "eval.toml"
    at = "" if threshold is None else f"threshold = {threshold}\n"
    cfg.write_text(f'[[evaluator]]\nname = "head"\nkind = "prm"\nfamily = "head"\n'
                   f'model = {json.dumps(str(head))}\n{at}')
    return cfg


def score(retrace, head, dev, out):
    """ProcessBench's F1 of `head` on `dev` (the judge's labels), loaded in-process."""
    cfg = head_config(head, out)
    run([retrace, "eval", "--config", str(cfg), "--evaluator", "head", "--data", str(dev),
         "--out", str(out / "eval"), "--no-progress"], out / "eval.log")
    avg = json.loads((out / "eval" / "summary.json").read_text())["summary"]["average"]
    # F1 needs both erroneous and all-correct traces; with one kind only, its accuracy decides.
    for key in ("f1", "error_acc", "correct_acc"):
        if avg.get(key) is not None:
            return key, avg[key]
    raise RuntimeError(f"{out}: eval scored no row")


def reload(http, token_env, prm):
    req = urllib.request.Request(f"{http.rstrip('/')}/v1/reload",
                                 data=json.dumps({"evaluator": prm}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    if token_env:
        req.add_header("authorization", f"Bearer {os.environ[token_env]}")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return True, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return False, json.loads(e.read() or b"{}")
        except ValueError:
            return False, {"error": f"HTTP {e.code}"}
    except (urllib.error.URLError, OSError, ValueError) as e:
        # The server unreachable, the connection cut or the reply unreadable: not swapped.
        return False, {"error": f"reload call failed: {e}"}


def swap(setup, candidate, aside, a):
    """The candidate into the serving folder, then the reload; the old folder back if refused."""
    staged = setup.head.with_name(setup.head.name + ".incoming")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(candidate, staged)
    os.rename(setup.head, aside)
    os.rename(staged, setup.head)
    ok, answer = reload(a.http, a.token_env, setup.prm)
    if not ok:
        shutil.rmtree(setup.head)
        os.rename(aside, setup.head)
    return ok, answer


def round_(k, setup, a, retrace, rows):
    here = a.work / f"round-{k:03d}"
    here.mkdir(parents=True, exist_ok=True)
    # A round rerun (after a crash) starts clean: the commands reuse scores cached in its folder.
    shutil.rmtree(here)
    here.mkdir(parents=True)
    train, select, dev = split(rows, a.dev_share, 10**12)
    every = dev
    dev = dev[-a.max_dev:]
    if not select or not dev:
        sys.exit(f"round {k}: {len(select)} selection and {len(dev)} comparison rows; "
                 "both need some: record more rows or raise --dev-share")
    g = setup.guarantee
    if g is not None:
        cal, measure, questions = guarantee.sets(g, setup.head, every, dev, here)
        counts = guarantee.count(cal), guarantee.count(measure)
        if not all(counts):
            sys.exit(f"round {k}: {counts[0]} calibration and {counts[1]} measurement rows; "
                     "both need some: record more rows or raise --dev-share")
        # No head learns from, chooses on or is compared on a calibration row's question.
        train, select, dev = ([r for r in rs if guarantee.question(r) not in questions]
                              for rs in (train, select, dev))
        for s in a.seed:
            if any(guarantee.question(r) in questions for r in read_file(s)):
                sys.exit(f"{s}: a seed row shares its question with a calibration row; a head "
                         "trained on it would be calibrated on what it learnt: keep them apart")
    chunks = write_chunks(a.work / "train", train, a.chunk)
    write_jsonl(here / "select.jsonl", select)
    write_jsonl(here / "dev.jsonl", dev)
    base_cfg = json.loads((setup.head / "config.json").read_text())
    base = Path(base_cfg["base"])
    if not base.is_absolute():
        base = setup.head / base
    if setup.head.resolve() in base.resolve().parents:
        sys.exit(f"{setup.head}: its base lies inside the head folder, which a swap moves aside; "
                 "keep the base outside it")
    data = [str(s) for s in a.seed] + [str(c) for c in chunks]
    started = time.monotonic()
    run([retrace, "train-head", "--base", str(base), "--format", base_cfg.get("format", "chat-lm"),
         "--data", *data, "--dev", str(here / "select.jsonl"), "--out", str(here / "head"),
         "--cache", str(a.work / "features"), "--force", "--no-progress", *a.train_arg],
        here / "train.log")
    train_s = time.monotonic() - started
    heads = {"serving": setup.head, "candidate": here / "head"}
    metric, serving = score(retrace, heads["serving"], here / "dev.jsonl", here / "serving")
    _, candidate = score(retrace, heads["candidate"], here / "dev.jsonl", here / "candidate")
    threshold = json.loads((here / "head" / "config.json").read_text())["threshold"]
    entry = {"round": k, "rows": len(rows), "train": len(train), "select": len(select), "dev": len(dev),
             "metric": metric, "serving": serving, "candidate": candidate,
             "threshold": threshold, "train_s": round(train_s, 1)}
    if g is not None:
        entry["coverage"] = {
            who: guarantee.coverage(run, retrace, head_config(head, here / who / "at", g.threshold),
                                    cal, measure, g, here / who / "calibrate")
            for who, head in heads.items()}
        if g.in_head is not None:
            # The rows the candidate was calibrated on move in with it.
            (heads["candidate"] / g.in_head).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cal, heads["candidate"] / g.in_head)
    better, why = guarantee.decide(metric, serving, candidate, entry.get("coverage"))
    if not better:
        entry["decision"] = why
    else:
        ok, answer = swap(setup, heads["candidate"], here / "previous-head", a)
        entry["decision"] = (f"swapped: {why}" if ok else
                             f"kept: the server refused the reload: {answer.get('error', answer)}")
    return entry


def report(a, entries):
    lines = ["# retrace distill", "",
             "| round | rows | train | dev | metric | serving | candidate | threshold | coverage | decision |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for e in entries:
        c = e.get("coverage")
        cover = f"{c['serving']['coverage']:.1%} → {c['candidate']['coverage']:.1%}" if c else "-"
        lines.append(f"| {e['round']} | {e['rows']} | {e['train']} | {e['dev']} | {e['metric']} | "
                     f"{e['serving']:.2f} | {e['candidate']:.2f} | {e['threshold']:.3f} | {cover} | "
                     f"{e['decision']} |")
    (a.work / "report.md").write_text("\n".join(lines) + "\n")


def main(argv):
    a = parse_args(argv)
    retrace = retrace_bin(a.retrace)
    setup = Setup(a.config, a.evaluator)
    a.work.mkdir(parents=True, exist_ok=True)
    log = a.work / "distill.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    last = entries[-1]["rows"] if entries else 0
    while True:
        rows = read_rows(setup.record_files())
        if len(rows) >= last + a.every or (a.once and rows):
            entry = round_(len(entries) + 1, setup, a, retrace, rows)
            entries.append(entry)
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")
            report(a, entries)
            print(f"round {entry['round']}: {entry['rows']} rows, dev {entry['metric']} serving "
                  f"{entry['serving']:.2f} candidate {entry['candidate']:.2f}: {entry['decision']}",
                  flush=True)
            last = len(rows)
        elif a.once:
            sys.exit(f"no recorded rows in {setup.record}")
        if a.once:
            return 0
        time.sleep(a.poll_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
