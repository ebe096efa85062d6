#!/usr/bin/env python3
"""Writes the ProcessBench traces that share their problem with another trace, one JSON file per
split (the same fields, the same split names), for a Best-of-N measurement with `retrace eval`:
each problem's traces are its candidates and `final_answer_correct` says which are right.

Usage: processbench_best_of_n.py --data DIR --out DIR [--mixed]
       (--mixed keeps only problems with both a right and a wrong final answer)
"""
import argparse
import collections
import json
import os

SPLITS = ["gsm8k", "math", "olympiadbench", "omnimath"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixed", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split in SPLITS:
        rows = json.load(open(os.path.join(args.data, split + ".json")))
        groups = collections.defaultdict(list)
        for r in rows:
            groups[r["problem"].strip()].append(r)
        keep = [g for g in groups.values() if len(g) > 1
                and (not args.mixed or len({r["final_answer_correct"] for r in g}) == 2)]
        out = [r for g in keep for r in g]
        json.dump(out, open(os.path.join(args.out, split + ".json"), "w"), ensure_ascii=False)
        print(f"{split}: {len(keep)} problems, {len(out)} traces")


if __name__ == "__main__":
    main()
