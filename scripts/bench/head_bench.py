"""The head benchmark's data and its table.

`prepare`: cuts the labelled splits into training, dev and test files, by question (one
question's traces stay on one side), drawn with a seed; the test splits are never trained on.
With --more, extra training files for the learning curve's largest point.
`table`: reads what scripts/bench/head-bench.sh ran and prints the results as markdown.
`kinds`: the same for scripts/bench/head-kinds.sh (each tap x head kind over seeds).
`chat`: zero-shot chat-lm's held-out F1 from `retrace calibrate`'s output.

  python3 -m scripts.bench.head_bench {prepare,table,kinds,chat} ...   (from the repository root)
"""
import argparse
import glob
import json
import os
import random
import re
import sys

from scripts.lib.common import read_rows

# Splits a head trains on (a share of each goes to training, a smaller one to dev) and splits
# it is only tested on. The training splits are the short ones, so that extraction is cheap.
TRAIN = {
    "general/mrben-biology.json": "mrben-biology",
    "general/mrben-chemistry.json": "mrben-chemistry",
    "general/mrben-math.json": "mrben-math",
    "general/bbm-dyck_languages.json": "bbm-dyck_languages",
    "general/bbm-multistep_arithmetic.json": "bbm-multistep_arithmetic",
    "processbench/gsm8k.json": "gsm8k",
    "processbench/math.json": "math",
}
TEST = {
    "general/mrben-physics.json": "mrben-physics",
    "general/bbm-tracking_shuffled_objects.json": "bbm-tracking_shuffled_objects",
    "processbench/olympiadbench.json": "olympiadbench",
}


def key(row):
    return " ".join(row["problem"].lower().split())


# Rows longer than this (question and steps, in characters) are left out: a few BIG-Bench
# Mistake Dyck traces run past SmolLM2's 8,192-token context.
MAX_CHARS = 12000


def by_question(rows, rng):
    """The rows grouped by question, the groups in a seeded order."""
    groups = {}
    for r in rows:
        if len(r["problem"]) + sum(len(s) for s in r["steps"]) > MAX_CHARS:
            continue
        groups.setdefault(key(r), []).append(r)
    order = sorted(groups)
    rng.shuffle(order)
    return [groups[q] for q in order]


def take(groups, n):
    """Whole groups from the front until n rows; the rest."""
    out, i = [], 0
    while i < len(groups) and len(out) < n:
        out.extend(groups[i])
        i += 1
    return out, groups[i:]


def write(path, rows, split):
    for r in rows:
        r["dataset"] = split
    with open(path, "w") as f:
        json.dump(rows, f)


def prepare(a):
    rng = random.Random(a.seed)
    os.makedirs(a.out, exist_ok=True)
    sizes = {p: len(json.load(open(os.path.join(a.data, p)))) for p in TRAIN}
    total = sum(sizes.values())
    counts = {}
    for path, split in TRAIN.items():
        rows = json.load(open(os.path.join(a.data, path)))
        groups = by_question(rows, rng)
        share = sizes[path] / total
        train, rest = take(groups, round(a.train * share))
        dev, rest = take(rest, round(a.dev * share))
        write(os.path.join(a.out, f"train-{split}.json"), train, split)
        write(os.path.join(a.out, f"dev-{split}.json"), dev, split)
        counts[split] = (len(train), len(dev))
        # The learning curve's largest point: training rows beyond --train, from what dev left
        # (drawn after it, so the other files, and their cached features, stay the same).
        more_path = os.path.join(a.out, f"more-{split}.json")
        if a.more > 0:
            more, _ = take(rest, round(a.more * share))
            write(more_path, more, split)
            counts[split] += (len(more),)
        elif os.path.exists(more_path):
            os.remove(more_path)
    for path, split in TEST.items():
        rows = json.load(open(os.path.join(a.data, path)))
        test, _ = take(by_question(rows, rng), a.test)
        write(os.path.join(a.out, f"test-{split}.json"), test, split)
        counts[split] = (0, len(test))
    for split, (tr, other, *more) in counts.items():
        extra = f", {more[0]} more" if more else ""
        print(f"{split}: {tr} train, {other} {'test' if split in TEST.values() else 'dev'}{extra}")


def parse_log(text):
    """What one train-head run printed: the head kept, dev F1, timings, and each test split's F1
    at dev's threshold (`test`) and at one chosen on its own first 20 traces (`own`)."""
    out = {"test": {}, "own": {}}
    m = re.search(r"dev F1 ([\d.]+)", text)
    out["dev_f1"] = float(m.group(1)) if m else None
    m = re.search(r"head on layers (\[.*\]) (?:concatenated |averaged )?\(tap (\S+)\)", text)
    out["layers"], out["tap"] = (m.group(1), m.group(2)) if m else ("?", "?")
    m = re.search(r"wrote \S+: (\w+) head", text)
    out["head"] = m.group(1) if m else "?"
    m = re.search(r"features: ([\d.]+) s, (\d+) traces \((\d+) tokens, (\d+) tokens/s\)", text)
    if m:
        out["features_s"], out["tokens"] = float(m.group(1)), int(m.group(3))
        out["tokens_s"] = int(m.group(4))
    m = re.search(r"training on (\d+) traces: ([\d.]+) s", text)
    if m:
        out["train_traces"], out["train_s"] = int(m.group(1)), float(m.group(2))
    m = re.search(r"^test mean F1 over splits: ([\d.]+)", text, re.M)
    out["test_mean"] = float(m.group(1)) if m else None
    for m in re.finditer(r"^test (\S+): F1 (\S+) \(error accuracy", text, re.M):
        out["test"][m.group(1)] = None if m.group(2) == "-" else float(m.group(2))
    for m in re.finditer(r"^test (\S+): F1 (\S+) on its other", text, re.M):
        out["own"][m.group(1)] = None if m.group(2) == "-" else float(m.group(2))
    return out


def trained(log):
    return parse_log(open(log).read())


def processbench_f1(rows, t):
    """ProcessBench's F1 per split (percent) with each trace's first error re-decided at t: the
    first step scored under t, -1 when none is."""
    by = {}
    for r in rows:
        first = next((i for i, s in enumerate(r["step_scores"]) if s < t), -1)
        err, cor = by.setdefault(r["split"], ([], []))
        (err if r["label"] != -1 else cor).append(first == r["label"])
    out = {}
    for split, (err, cor) in by.items():
        e = 100 * sum(err) / len(err) if err else None
        c = 100 * sum(cor) / len(cor) if cor else None
        out[split] = None if e is None or c is None else (0 if e + c == 0 else 2 * e * c / (e + c))
    return out


def chat(a):
    """Zero-shot chat-lm's held-out F1 at the threshold calibrate chose on dev, and at 0.5."""
    log = open(os.path.join(a.out, "chat-lm.log")).read()
    t = float(re.search(r"^threshold = ([\d.eE+-]+)", log, re.M).group(1))
    rows = read_rows(os.path.join(a.out, "chat-lm", "chat-lm", "test.jsonl"))
    failed = [r for r in rows if r.get("error")]
    if failed:
        sys.exit(f"head-bench: {len(failed)} chat-lm test rows failed: {failed[0]['error']}")
    summary = {"threshold": t, "calibrated": processbench_f1(rows, t),
               "default": processbench_f1(rows, 0.5)}
    json.dump(summary, open(os.path.join(a.out, "chat-lm", "summary.json"), "w"), indent=1)
    print(json.dumps(summary))


def mean(xs):
    """The mean of the values that exist; None when none does."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def table(a):
    runs = {}
    for log in glob.glob(os.path.join(a.out, "train-*.log")):
        runs[os.path.basename(log)[6:-4]] = trained(log)
    full = runs.get("full")
    chat = json.load(open(os.path.join(a.out, "chat-lm", "summary.json")))
    splits = list(TEST.values())
    print("### Held-out splits (never trained on), F1\n")
    print("| split | head | zero-shot chat-lm (threshold from dev) | zero-shot chat-lm (0.5) |")
    print("|---|---:|---:|---:|")
    head_f1, chat_f1, chat05 = [], [], []
    for s in splits:
        h = full["test"].get(s) if full else None
        c = chat["calibrated"].get(s)
        c5 = chat["default"].get(s)
        head_f1.append(h)
        chat_f1.append(c)
        chat05.append(c5)
        print(f"| {s} | {f(h)} | {f(c)} | {f(c5)} |")

    mh, mc, m5 = mean(head_f1), mean(chat_f1), mean(chat05)
    print(f"| **mean** | **{f(mh)}** | **{f(mc)}** | **{f(m5)}** |")
    if mh is not None and mc:
        print(f"\nhead / chat-lm (from dev): {mh / mc:.2f}x, {mh - mc:+.1f} points; "
              f"chat-lm's threshold from dev: {chat['threshold']}")
    print("\n### Learning curve (the same dev and test; training traces drawn by seed)\n")
    print("| training traces | dev F1 | test mean F1 | head, layers | training s |")
    print("|---:|---:|---:|---|---:|")
    for name, r in sorted(runs.items(), key=lambda kv: kv[1].get("train_traces", 0)):
        tm = mean([r["test"].get(s) for s in splits])
        print(f"| {r.get('train_traces', '?')} | {f(r['dev_f1'])} | {f(tm)} | "
              f"{r['head']} {r['layers']} | {f(r.get('train_s'))} |")
    tput = os.path.join(a.out, "throughput.json")
    if os.path.exists(tput):
        t = json.load(open(tput))
        print("\n### Extraction against serving, same traces, same machine\n")
        print("| round | extraction tokens/s | serving tokens/s (eval, in-process) | ratio |")
        print("|---:|---:|---:|---:|")
        for i, (x, s) in enumerate(zip(t["extract"], t["serve"])):
            print(f"| {i + 1} | {x:.0f} | {s:.0f} | {x / s:.2f} |")


def spread(xs):
    """Mean (lowest-highest) of the values that exist; "-" when none does."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{sum(xs) / len(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def split_means(run, key):
    """A run's mean over the held-out splits, of `test` (dev's threshold) or `own` (20 traces)."""
    if key == "test" and run.get("test_mean") is not None:
        return run["test_mean"]  # as train-head averaged them, before rounding
    xs = [run[key].get(s) for s in TEST.values()]
    return None if None in xs else mean(xs)


def kinds(a):
    """head-kinds.sh's table: each tap x head over the seeds, dev choosing among them all, and
    zero-shot chat-lm, held-out F1 per split and its mean with the seeds' spread."""
    seeds = sorted(glob.glob(os.path.join(a.out, "seed-*")))
    if not seeds:
        sys.exit(f"head-bench: no seed-* folders under {a.out}")
    splits = list(TEST.values())
    print(f"{len(seeds)} seed(s); held-out F1 at dev's threshold, mean over seeds "
          "(lowest-highest); \"own 20\": each split at a threshold chosen on its first 20 traces, "
          "scored on its others\n")
    print("| head | tap | " + " | ".join(splits) + " | **mean** | dev | own 20 | training s |")
    print("|---|---|" + "---:|" * (len(splits) + 4))
    # Every run's log, read once: {log name: [one run per seed that has it]}.
    logs = {}
    for d in seeds:
        for p in sorted(glob.glob(os.path.join(d, "train-*.log"))):
            logs.setdefault(os.path.basename(p)[6:-4], []).append(trained(p))
    names = [(h, t) for t in a.taps.split(",") for h in a.heads.split(",")] + [("dev chooses", None)]
    for head, tap in names:
        name = "auto" if tap is None else f"{head}-{re.sub(r'[:+]', '_', tap)}"
        runs = logs.get(name, [])
        if not runs:
            continue
        chosen = {r["head"] + ("" if r["tap"] == "?" else " " + r["tap"]) for r in runs}
        kept = "" if tap else " (" + ", ".join(sorted(chosen)) + ")"
        cells = [spread([r["test"].get(s) for r in runs]) for s in splits]
        print(f"| {head}{kept} | {tap or a.taps} | " + " | ".join(cells)
              + f" | **{spread([split_means(r, 'test') for r in runs])}** "
              + f"| {spread([r['dev_f1'] for r in runs])} "
              + f"| {spread([split_means(r, 'own') for r in runs])} "
              + f"| {spread([r.get('train_s') for r in runs])} |")
    summary = os.path.join(a.out, "chat-lm", "summary.json")
    if os.path.exists(summary):
        chat = json.load(open(summary))
        cal = [chat["calibrated"].get(s) for s in splits]
        m = None if None in cal else mean(cal)
        print("| zero-shot chat-lm, threshold from dev | - | "
              + " | ".join(f(c) for c in cal) + f" | **{f(m)}** | - | - | - |")
    every = [r for runs in logs.values() for r in runs if r.get("tokens_s")]
    x = max(every, key=lambda r: r["tokens"], default=None)
    if x:
        print(f"\nextraction: {x['tokens']} tokens in {x['features_s']:.0f} s, "
              f"{x['tokens_s']} tokens/s (the run that read the most through the base)")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare")
    q.add_argument("--data", required=True, help="folder holding processbench/ and general/")
    q.add_argument("--out", required=True)
    q.add_argument("--train", type=int, default=2000)
    q.add_argument("--dev", type=int, default=300)
    q.add_argument("--test", type=int, default=150, help="traces per test split")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--more", type=int, default=0,
                   help="training traces beyond --train, written to more-*.json")
    for name in ("chat", "table"):
        sub.add_parser(name).add_argument("--out", required=True)
    k = sub.add_parser("kinds")
    k.add_argument("--out", required=True, help="head-kinds.sh's folder")
    k.add_argument("--taps", required=True, help="the taps, comma-separated, as trained")
    k.add_argument("--heads", required=True, help="the head kinds, comma-separated")
    a = p.parse_args()
    {"prepare": prepare, "chat": chat, "table": table, "kinds": kinds}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
