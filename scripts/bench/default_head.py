"""The embedded default's head, after scripts/bench/default-head.sh trained it and scored
zero-shot chat-lm beside it: prints the held-out comparison and, with --write, installs the head
folder (its base named relative to where the server writes it, its data by file name) with a
README of its provenance and figures; with --fixture, a few held-out traces and the verdicts
training computed for them, which the tests ask the served default for.

  python3 -m scripts.bench.default_head --run OUT --data OUT/data [--write DIR] [--fixture DIR]
"""

import argparse
import json
import os
import re
import shutil
import sys

from scripts.bench.head_bench import TEST, parse_log, processbench_f1
from scripts.lib.common import read_rows

# Relative to the cache folder's heads/smollm2/, where the server installs the head.
BASE = "../../gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENCES = ("ProcessBench (Apache-2.0), Mr-Ben (MIT), BIG-Bench Mistake (Apache-2.0); "
            "SmolLM2-135M-Instruct, the base, Apache-2.0")


def mean(xs):
    return sum(xs) / len(xs)


def figures(run):
    head = parse_log(open(os.path.join(run, "head.log")).read())["test"]
    chat_log = open(os.path.join(run, "chat-lm.log")).read()
    t = float(re.search(r"^threshold = ([\d.eE+-]+)", chat_log, re.M).group(1))
    rows = read_rows(os.path.join(run, "chat-lm", "chat-lm", "test.jsonl"))
    if any(r.get("error") for r in rows):
        sys.exit("default-head: some chat-lm test rows failed; rerun to resume")
    return head, processbench_f1(rows, t), processbench_f1(rows, 0.5), t


def table(head, chat, chat05, config):
    splits = list(TEST.values())
    lines = [
        "| held-out split, F1 | head (%s) | chat-lm, threshold from dev | chat-lm at 0.5 |"
        % config["head"],
        "|---|---:|---:|---:|",
    ]
    for s in splits:
        lines.append(f"| {s} | {head[s]:.1f} | {chat[s]:.1f} | {chat05[s]:.1f} |")
    m = [mean([d[s] for s in splits]) for d in (head, chat, chat05)]
    lines.append(f"| **mean** | **{m[0]:.1f}** | **{m[1]:.1f}** | **{m[2]:.1f}** |")
    return "\n".join(lines), m


def write_head(run, dest, text, config):
    os.makedirs(dest, exist_ok=True)
    config = dict(config, base=BASE)
    for key in ("data", "dev"):
        config[key] = [dict(f, path=os.path.basename(f["path"])) for f in config[key]]
    with open(os.path.join(dest, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
        out.write("\n")
    shutil.copyfile(os.path.join(run, "head", "head.safetensors"),
                    os.path.join(dest, "head.safetensors"))
    files = "\n".join(f"| {f['path']} | {f['rows']} | `{f['sha256']}` |"
                      for f in config["data"] + config["dev"])
    with open(os.path.join(dest, "README.md"), "w") as out:
        out.write(f"""# The embedded default's head

A {config['head']} head on SmolLM2-135M-Instruct's Q4_1 GGUF (`base_sha256` in `config.json`
is that file's), the evaluator `smollm2-head` that `retrace serve` without a config serves
first, so by default. The server writes these files into the cache folder's `heads/smollm2/`
when it starts; `config.json` names the GGUF relative to that folder.

Rebuilt, and measured, by one command (DIR holds `processbench/` and `general/`):

```sh
scripts/bench/default-head.sh --data DIR --write
```

Trained with seed {config['seed']} on {config['label_counts']['traces']} traces of seven splits,
its tap, kind, epoch and threshold ({config['threshold']:.4f}) chosen on dev (F1
{config['dev_f1']:.1f}); the files, as `head_bench.py prepare --train 1000 --dev 200 --test 100
--seed 0` cuts them:

| file | rows | sha256 |
|---|---:|---|
{files}

Data and base licences: {LICENCES}.

On three splits neither the head nor its dev saw (other subjects, another task, harder math),
against zero-shot chat-lm on the same file:

{text}
""")


def write_fixture(run, data, dest, config, each=2):
    """The first `each` test traces of each split that the head flags and the first `each` it
    does not, with the scores training computed for them."""
    os.makedirs(dest, exist_ok=True)
    scored = read_rows(os.path.join(run, "head", "test-scores.jsonl"))
    by_id = {}
    for name in TEST.values():
        for r in json.load(open(os.path.join(data, f"test-{name}.json"))):
            by_id[r["id"]] = r
    out, taken = [], {}
    for s in scored:
        key = (s["split"], s["prediction"] >= 0)
        if taken.get(key, 0) >= each:
            continue
        taken[key] = taken.get(key, 0) + 1
        r = by_id[s["id"]]
        out.append({"id": s["id"], "question": r["problem"], "steps": r["steps"],
                    "step_scores": s["step_scores"], "first_error": s["prediction"]})
    with open(os.path.join(dest, "known.json"), "w") as f:
        json.dump({"threshold": config["threshold"], "traces": out}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} known verdicts to {dest}/known.json")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True, help="default-head.sh's --out")
    p.add_argument("--data", required=True, help="the prepared cut (RUN/data)")
    p.add_argument("--write", help="install the head folder here (heads/smollm2)")
    p.add_argument("--fixture", help="write known.json here (tests/fixtures/default-head)")
    a = p.parse_args()
    config = json.load(open(os.path.join(a.run, "head", "config.json")))
    head, chat, chat05, t = figures(a.run)
    text, m = table(head, chat, chat05, config)
    print(text)
    verdict = m[0] > m[1]
    print(f"\nchat-lm's threshold from dev: {t:.4f}. The head {'beats' if verdict else 'does not beat'}"
          f" chat-lm on the held-out mean ({m[0]:.1f} against {m[1]:.1f}).")
    if a.write:
        write_head(a.run, a.write, text, config)
        print(f"wrote {a.write}")
    if a.fixture:
        write_fixture(a.run, a.data, a.fixture, config)


if __name__ == "__main__":
    main()
