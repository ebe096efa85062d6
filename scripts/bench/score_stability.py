"""Whether a trace's step scores move with what else the server is doing, on one model file.

Starts `retrace serve` on MODEL (a GGUF or an HF folder, `family = "chat-lm"` unless --family)
twice over, as two evaluators in one server: `cached` (the prefix cache on) and `uncached`
(`prefix_cache_mb = 0`), and measures:

- the cache: "What is 2+3*4?" with "3*4 = 12." then "2+12 = 15." scored on `cached` first, then
  its siblings "2+12 = 18." and "2+12 = 99." (sharing the first step, so the cache serves it),
  against the same siblings on `uncached`;
- the batch: the first 8 traces of a ProcessBench split scored one at a time on `uncached`,
  then the same 8 among 16 sent at once.

Prints a table of the largest differences; exits 1 when one passes --tolerance (default 1e-5).
Standard library only.

    python3 -m scripts.bench.score_stability --retrace target/release/retrace --model GGUF \
        --data tests/fixtures/processbench/gsm8k.json
"""

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request

from scripts.lib.common import free_port, retrace_bin, wait_http

QUESTION = "What is 2+3*4?"
FIRST = "3*4 = 12."
SIBLINGS = ["2+12 = 18.", "2+12 = 99."]


def post(url, body):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def scores(base, evaluator, question, steps):
    body = {"evaluator": evaluator, "trace": {"question": question, "steps": steps}}
    reply = post(f"{base}/v1/evaluate", body)
    return [s.get("score", 0.0) for s in reply.get("steps", [])]


def start(retrace, model, family, workdir):
    config = os.path.join(workdir, "stability.toml")
    with open(config, "w") as f:
        for name, cache in [("cached", None), ("uncached", 0)]:
            f.write(f'[[evaluator]]\nname = "{name}"\nkind = "prm"\n')
            f.write(f'family = "{family}"\nmodel = {json.dumps(model)}\n')
            if cache is not None:
                f.write(f"prefix_cache_mb = {cache}\n")
            f.write("\n")
    http = free_port()
    cmd = [
        retrace, "serve", "--config", config,
        "--grpc-addr", f"127.0.0.1:{free_port()}",
        "--http-addr", f"127.0.0.1:{http}",
        "--metrics-addr", f"127.0.0.1:{free_port()}",
    ]
    log = open(os.path.join(workdir, "serve.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    wait_http(f"{base}/health", 300, proc, log.name)
    return proc, base


def cache_gap(base):
    """Largest step-score difference between a cached and an uncached run of the siblings."""
    scores(base, "cached", QUESTION, [FIRST, "2+12 = 15."])
    rows, worst = [], 0.0
    for last in SIBLINGS:
        a = scores(base, "cached", QUESTION, [FIRST, last])
        b = scores(base, "uncached", QUESTION, [FIRST, last])
        gap = max(abs(x - y) for x, y in zip(a, b))
        rows.append((last, a[-1], b[-1], gap))
        worst = max(worst, gap)
    return rows, worst


def batch_gap(base, data):
    traces = json.load(open(data))[:16]
    alone = [scores(base, "uncached", t["problem"], t["steps"]) for t in traces[:8]]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(
            pool.map(lambda t: scores(base, "uncached", t["problem"], t["steps"]), traces)
        )
    return max(
        abs(x - y) for a, b in zip(alone, together[:8]) for x, y in zip(a, b)
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--retrace", help="the retrace binary (default: target/release's, else "
                    "target/debug's, else on PATH)")
    ap.add_argument("--model", required=True, help="a GGUF file or an HF folder")
    ap.add_argument("--family", default="chat-lm")
    ap.add_argument("--data", default="tests/fixtures/processbench/gsm8k.json")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        proc, base = start(retrace_bin(args.retrace), args.model, args.family, work)
        try:
            rows, cache_worst = cache_gap(base)
            batch_worst = batch_gap(base, args.data)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"model: {os.path.basename(args.model.rstrip('/'))}")
    print("| last step | score, cache on | cache off | largest step difference |")
    print("|---|---:|---:|---:|")
    for last, a, b, gap in rows:
        print(f"| {last} | {a:.5f} | {b:.5f} | {gap:.1e} |")
    print(f"batch: 8 traces alone against among 16, largest step difference {batch_worst:.1e}")
    bad = max(cache_worst, batch_worst) > args.tolerance
    print("FAIL" if bad else "ok", f"(tolerance {args.tolerance:g})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
