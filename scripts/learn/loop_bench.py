"""Measures the learning loop: traces streamed through a recording cascade in rounds, with
`distill.py` retraining its head between rounds, against an oracle judge (oracle_judge.py: each
trace's gold label, the stand-in for a strong judge).

  python3 -m scripts.learn.loop_bench --data DIR [--splits gsm8k,math] [--seed-traces 300] \\
      [--round 500] [--rounds 4] [--margin 0.1] [--base FOLDER] [--work runs/loop-bench]

The data (ProcessBench-shaped JSON splits in DIR) is cut by question: the seed head is trained on
`--seed-traces` traces, and the rounds stream traces of other questions, which the head never saw
until the judge labelled them. Per round: the share of traces escalated to the judge, the head's
agreement with the judge (gold) on the traces it decided alone, the cascade's ProcessBench F1
against gold, judge calls and seconds per trace, and distill's decision after the round. Round 1
runs the seed head. Standard library only; the retrace binary is target/release's, else
target/debug's, else on PATH (or --retrace).

--target-agreement A (with --target-confidence C, 0.9 by default) serves the cascade with the
guarantee instead of the margin: `--calibration-traces` traces of questions apart from the seed's
and the stream's are the seed head's calibration rows, kept in its folder, so distill calibrates
each candidate on rows of its own and they travel with it. Each round then also reports, on the
round's fresh traces, the AUROC of the head's confidence in its verdict (`verdict` and `margin`)
for agreeing with the judge, and the agreement today's fixed margin would get at the same coverage
(the round's traces ranked by margin, the same share kept).

--judge-url URL (an OpenAI-compatible server, e.g. llama-server with --jinja) puts a real judge in
the oracle's place; the head's agreement with it on the traces the head decided alone is then
measured by asking the judge about those traces too (calls the cascade did not make, not counted
in the cost columns).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from scripts.lib.common import CACHE, ROOT, free_port, retrace_bin, wait_http, write_jsonl


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cut(data, splits, seed_traces, seed, calibration_traces=0):
    rows = []
    for split in splits:
        for r in json.loads((data / f"{split}.json").read_text()):
            rows.append({"id": f"{split}-{r['id']}", "dataset": split, "question": r["problem"],
                         "steps": r["steps"], "label": r["label"]})
    questions = sorted({r["question"] for r in rows})
    random.Random(seed).shuffle(questions)
    by_q = {}
    for r in rows:
        by_q.setdefault(r["question"], []).append(r)
    seed_rows, cal_rows, stream = [], [], []
    for q in questions:
        if len(seed_rows) < seed_traces:
            seed_rows.extend(by_q[q])
        elif len(cal_rows) < calibration_traces:
            cal_rows.extend(by_q[q])
        else:
            stream.extend(by_q[q])
    random.Random(seed + 1).shuffle(stream)
    return seed_rows, cal_rows, stream


def confidence(scores, first, threshold, reading):
    """The cascade's reading of a verdict's confidence (src/cascade/guard.rs)."""
    deciding = scores[:len(scores) if first < 0 else first + 1]
    if reading == "margin":
        return min((abs(s - threshold) for s in deciding), default=float("inf"))
    p = 1.0
    for i, s in enumerate(deciding):
        p *= (1 - s) if i == first else s
    return p


def auroc(items):
    """P(an agreeing item's confidence > a disagreeing one's), ties half; None without both."""
    pos = [c for c, a in items if a]
    neg = [c for c, a in items if not a]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def own_verdicts(http, traces, callers, judged):
    """The serving head's verdict on each trace, with its confidence each way and whether it
    is the judge's (`judged`, in order)."""
    asked = {id(r): v for r, v in run_round(http, traces, callers, "head")[0]}
    out = []
    for r, j in zip(traces, judged):
        v = asked[id(r)]
        scores = [s.get("score", 0.0) for s in v["steps"]]
        first, t = v["first_error_index"], v.get("threshold", 0.5)
        out.append({"verdict": confidence(scores, first, t, "verdict"),
                    "margin": confidence(scores, first, t, "margin"), "agrees": first == j})
    return out


def margin_at(verdicts, share):
    """Agreement of the `share` of traces with the widest margin: today's cascade at that
    coverage."""
    kept = sorted(verdicts, key=lambda v: -v["margin"])[:round(share * len(verdicts))]
    return sum(v["agrees"] for v in kept) / len(kept) if kept else None


def metric(pairs):
    """ProcessBench's F1 over (gold, predicted) pairs, as percentages."""
    err = [p == g for g, p in pairs if g != -1]
    ok = [p == -1 for g, p in pairs if g == -1]
    ea = 100 * sum(err) / len(err) if err else None
    ca = 100 * sum(ok) / len(ok) if ok else None
    if ea is None or ca is None:
        return None
    return 0.0 if ea + ca == 0 else 2 * ea * ca / (ea + ca)


def run_round(http, traces, callers, evaluator="c"):
    out, lock, it = [], threading.Lock(), iter(traces)

    def work():
        while True:
            with lock:
                r = next(it, None)
            if r is None:
                return
            v = post(f"{http}/v1/evaluate", {"evaluator": evaluator, "trace": {
                "question": r["question"], "steps": r["steps"]}})
            with lock:
                out.append((r, v))

    started = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.monotonic() - started


def summarize(k, results, seconds, decision, judge_of, verdicts=None):
    """`judge_of(alone)` gives the judge's first error for each trace the head decided alone;
    `verdicts`, the serving head's own verdicts on every trace of the round (own_verdicts)."""
    escalated = [(r, v) for r, v in results if v.get("path") == "DECISION_PATH_ESCALATED"]
    alone = [(r, v) for r, v in results if v.get("path") != "DECISION_PATH_ESCALATED"]
    judged = judge_of([r for r, _ in alone])
    agree = sum(v["first_error_index"] == j for (_, v), j in zip(alone, judged))
    pairs = [(r["label"], v["first_error_index"]) for r, v in results]
    n = len(results)
    row = {"round": k, "traces": n, "escalated": len(escalated) / n,
           "head_agreement_alone": agree / len(alone) if alone else None,
           "cascade_f1": metric(pairs), "judge_calls_per_trace": len(escalated) / n,
           "seconds_per_trace": seconds / n, "distill": decision}
    if verdicts is not None:
        row["head_agreement_all"] = sum(v["agrees"] for v in verdicts) / len(verdicts)
        for reading in ("verdict", "margin"):
            row[f"auroc_{reading}"] = auroc([(v[reading], v["agrees"]) for v in verdicts])
        row["margin_agreement_same_coverage"] = margin_at(verdicts, len(alone) / n)
    return row


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--splits", default="gsm8k,math")
    ap.add_argument("--seed-traces", type=int, default=300)
    ap.add_argument("--round", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--margin", type=float, default=0.1)
    ap.add_argument("--callers", type=int, default=2)
    ap.add_argument("--max-dev", type=int, default=200, help="distill's held-out rows a round")
    ap.add_argument("--base", type=Path, default=CACHE / "smollm2")
    ap.add_argument("--work", type=Path, default=Path("runs/loop-bench"))
    ap.add_argument("--retrace", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judge-url", help="a real judge's OpenAI-compatible base URL (.../v1)")
    ap.add_argument("--judge-model", default="judge")
    ap.add_argument("--target-agreement", type=float,
                    help="serve the cascade with this guarantee instead of --margin")
    ap.add_argument("--target-confidence", type=float, default=0.9)
    ap.add_argument("--calibration-traces", type=int, default=150,
                    help="with --target-agreement: the seed head's calibration rows")
    ap.add_argument("--dev-share", type=float, default=0.2, help="distill's held-out share")
    ap.add_argument("--from-round", type=int, default=1,
                    help="resume: run this round and the ones after it in a --work folder that "
                         "ran the ones before (their rows are read back from its loop.jsonl)")
    a = ap.parse_args(argv)
    retrace = retrace_bin(a.retrace)
    a.work.mkdir(parents=True, exist_ok=True)
    work = a.work.resolve()
    guaranteed = a.target_agreement is not None
    seed_rows, cal_rows, stream = cut(a.data, a.splits.split(","), a.seed_traces, a.seed,
                                      a.calibration_traces if guaranteed else 0)
    need = a.round * a.rounds
    if len(stream) < need:
        sys.exit(f"{len(stream)} traces beyond the seed; {need} asked for")
    stream = stream[:need]
    seed_file, stream_file = work / "seed.jsonl", work / "stream.jsonl"
    write_jsonl(seed_file, seed_rows)
    write_jsonl(stream_file, stream)

    head = work / "head"
    if not (head / "config.json").is_file():
        started = time.monotonic()
        subprocess.run([retrace, "train-head", "--base", str(a.base), "--data", str(seed_file),
                        "--out", str(head), "--cache", str(work / "features"), "--no-progress",
                        "--seed", str(a.seed)], check=True)
        print(f"seed head: {time.monotonic() - started:.0f} s", flush=True)
    if guaranteed and not (head / "calibration.jsonl").is_file():
        write_jsonl(head / "calibration.jsonl", cal_rows)

    oracle_port, grpc, http_port, metrics = free_port(), free_port(), free_port(), free_port()
    procs = []
    if a.judge_url:
        judge = (f'base_url = "{a.judge_url}"\nmodel = "{a.judge_model}"\nupstream = "llama.cpp"\n'
                 f'output = "json_schema"\nmax_tokens = 512\ntimeout_s = 900\ncache_entries = 0\n'
                 f'max_concurrency = 2\ndomain = "math"\n')
    else:
        procs.append(subprocess.Popen([sys.executable, "-m", "scripts.learn.oracle_judge", "--port",
                                       str(oracle_port), "--data", str(seed_file), str(stream_file)],
                                      cwd=ROOT))
        judge = (f'base_url = "http://127.0.0.1:{oracle_port}/v1"\nmodel = "oracle"\n'
                 f'output = "text"\ndomain = "math"\n')
    config = work / "retrace.toml"
    config.write_text(
        f'[[evaluator]]\nname = "head"\nkind = "prm"\nfamily = "head"\nmodel = "{head}"\n\n'
        f'[[evaluator]]\nname = "j"\nkind = "judge"\n{judge}\n'
        f'[[evaluator]]\nname = "c"\nkind = "cascade"\nprm = "head"\njudge = "j"\n'
        + (f'target_agreement = {a.target_agreement}\ntarget_confidence = {a.target_confidence}\n'
           f'calibration = "{head / "calibration.jsonl"}"\n' if guaranteed else
           f'escalate_margin = {a.margin}\n')
        + f'record = "{work / "rows" / "verdicts.jsonl"}"\n')
    http = f"http://127.0.0.1:{http_port}"
    try:
        procs.append(subprocess.Popen([retrace, "serve", "--config", str(config), "--grpc-addr",
                                       f"127.0.0.1:{grpc}", "--http-addr", f"127.0.0.1:{http_port}",
                                       "--metrics-addr", f"127.0.0.1:{metrics}"],
                                      env={**os.environ, "RETRACE_LOG": "warn"}))
        wait_http(f"{http}/health", 300, procs[-1])
        if guaranteed:
            calibrated(f"http://127.0.0.1:{metrics}/metrics")
        table = earlier_rounds(work / "loop.jsonl", a.from_round)
        for k in range(a.from_round - 1, a.rounds):
            traces = stream[k * a.round:(k + 1) * a.round]
            # The head's own verdicts before distill swaps it: what served this round.
            verdicts = own_verdicts(http, traces, a.callers, [r["label"] for r in traces]) \
                if guaranteed and not a.judge_url else None
            results, seconds = run_round(http, traces, a.callers)
            d = subprocess.run([sys.executable, "-m", "scripts.learn.distill",
                                "--config", str(config), "--evaluator", "c", "--http", http,
                                "--retrace", retrace, "--seed", str(seed_file),
                                "--work", str(work / "distill"), "--once", "--max-dev", str(a.max_dev),
                                "--dev-share", str(a.dev_share)],
                               capture_output=True, text=True, cwd=ROOT)
            decision = (d.stdout.strip().splitlines() or [d.stderr.strip()[-300:]])[-1]
            if a.judge_url:
                def judge_of(traces):
                    asked = dict((id(r), v) for r, v in run_round(http, traces, a.callers, "j")[0])
                    return [asked[id(r)]["first_error_index"] for r in traces]
            else:
                def judge_of(traces):
                    return [r["label"] for r in traces]
            row = summarize(k + 1, results, seconds, decision, judge_of, verdicts)
            if guaranteed:
                calibrated(f"http://127.0.0.1:{metrics}/metrics")
            table.append(row)
            print(json.dumps(row), flush=True)
            # Written as each round ends, so a stopped run can be resumed (--from-round).
            write_jsonl(work / "loop.jsonl", table)
        print("\n| round | traces | escalated | head = judge, alone | cascade F1 | judge calls / trace | s / trace |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in table:
            f1 = "-" if r["cascade_f1"] is None else f"{r['cascade_f1']:.1f}"
            ag = "-" if r["head_agreement_alone"] is None else f"{100 * r['head_agreement_alone']:.1f}%"
            print(f"| {r['round']} | {r['traces']} | {100 * r['escalated']:.1f}% | {ag} | {f1} | "
                  f"{r['judge_calls_per_trace']:.2f} | {r['seconds_per_trace']:.2f} |")
        if guaranteed and not a.judge_url:
            pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
            num = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            print("\n| round | coverage | agreement kept | margin at same coverage | head = judge, all | "
                  "AUROC verdict | AUROC margin |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for r in table:
                print(f"| {r['round']} | {pct(1 - r['escalated'])} | {pct(r['head_agreement_alone'])} | "
                      f"{pct(r['margin_agreement_same_coverage'])} | {pct(r['head_agreement_all'])} | "
                      f"{num(r['auroc_verdict'])} | {num(r['auroc_margin'])} |")
    finally:
        for p in procs:
            p.terminate()


def earlier_rounds(log, from_round):
    """The rows of the rounds before `from_round`, from a stopped run's log; none for a run
    from the start. A log missing one of them stops the run: the table would have a hole."""
    if from_round <= 1:
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rows = [r for r in rows if r["round"] < from_round]
    if [r["round"] for r in rows] != list(range(1, from_round)):
        sys.exit(f"--from-round {from_round}: {log} holds rounds {[r['round'] for r in rows]}, "
                 f"not 1 to {from_round - 1}")
    return rows


def calibrated(url, within=600):
    """Waits until the cascade has chosen on its calibration rows (scored at load and at each
    swap); prints what it chose."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        got = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("retrace_cascade_") and 'evaluator="c"' in line}
        if got.get("retrace_cascade_calibration_rows", 0) > 0:
            print(f"calibrated: {got}", flush=True)
            return got
        time.sleep(1)
    sys.exit("the cascade did not calibrate in time")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
