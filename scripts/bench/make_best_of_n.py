#!/usr/bin/env python3
"""Writes bench/best-of-n.jsonl: Best-of-N candidates sampled from SmolLM2-135M-Instruct.

A reranker scores N candidate solutions of one question that all follow one long instruction
(a few-shot prompt). This makes that workload from real model output: the prompt is an
instruction and worked examples from ProcessBench's GSM8K split (traces labelled correct), the
questions are later GSM8K problems, and each question's candidates are sampled from SmolLM2
through a running llama-server (temperature 0.8, one seed per candidate).

Usage: make_best_of_n.py --server http://127.0.0.1:PORT --data gsm8k.json --out bench/best-of-n.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

INSTRUCTION = (
    "You solve grade-school math word problems. Reason step by step: write each step as its own "
    "short paragraph, separated by a blank line, state every intermediate result with its unit, "
    "check the arithmetic of each step before going on, and end with the final answer in the "
    "form \\boxed{ANSWER}. Here are solved examples in exactly that style."
)


def few_shot(rows: list[dict], k: int) -> tuple[str, set[str]]:
    shots, used = [], set()
    for row in rows:
        if row["label"] != -1 or len(row["steps"]) > 6:
            continue
        steps = "\n\n".join(" ".join(s.split()) for s in row["steps"])
        shots.append(f"Example {len(shots) + 1}.\nQuestion: {row['problem'].strip()}\nSolution:\n{steps}")
        used.add(row["id"])
        if len(shots) == k:
            break
    return INSTRUCTION + "\n\n" + "\n\n".join(shots), used


def sample(server: str, system: str, question: str, seed: int, max_tokens: int) -> str:
    body = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question: {question}\nSolution:"},
        ],
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    req = urllib.request.Request(
        f"{server}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["message"]["content"].strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args()
    rows = json.load(open(args.data))
    prompt, used = few_shot(rows, args.shots)
    questions = []
    for row in rows:
        q = row["problem"].strip()
        if row["id"] not in used and q not in questions:
            questions.append(q)
        if len(questions) == args.questions:
            break
    jobs = [(qi, c) for qi in range(len(questions)) for c in range(args.candidates)]
    with ThreadPoolExecutor(args.parallel) as pool:
        texts = list(pool.map(
            lambda j: sample(args.server, prompt, questions[j[0]], 1000 * j[0] + j[1], args.max_tokens), jobs))
    with open(args.out, "w") as f:
        for qi, q in enumerate(questions):
            cands = [t if t else "(no answer)" for (i, _), t in zip(jobs, texts) if i == qi]
            f.write(json.dumps({"instruction": prompt, "question": q, "candidates": cands}) + "\n")
    print(f"wrote {len(questions)} questions x {args.candidates} candidates to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
