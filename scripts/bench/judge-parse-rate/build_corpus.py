#!/usr/bin/env python3
"""Turns the replies logged by scripts/bench/judge-parse-rate.sh into tests/fixtures/judge-replies.jsonl.

Each distinct reply becomes one parser case: the model, the output mode, the turn (first reply or
repair), the paragraph count and the reply, with the verdict expected from an oracle written
apart from the Rust parser:
- json_schema: Python's json module and the schema's rules (keys, types, names, the range);
- grammar and text: ProcessBench's reading, the last \\boxed{...} as an integer (with the
  `\\text{}` and `$` wrappers dropped), and the last "Category:" line after it.
Where the Rust parser reads a reply the oracle can't (its documented fallbacks), the case is
checked by hand and its expectation written with a "note".

Usage: build_corpus.py REPLIES_JSONL[,MORE] MODEL OUT_JSONL
"""

import json
import re
import sys

CATEGORIES = {"Misinterpretation", "Hallucination", "Reasoning", "None"}


def verdict(index, category, n):
    if index == -1:
        return {"first_error": -1, "category": "none"}
    if not 0 <= index < n:
        return {"error": "out_of_range"}
    c = (category or "None").lower()
    return {"first_error": index, "category": "unspecified" if c == "none" else c}


def strip_think(text):
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    return text


def json_oracle(reply, n, with_analysis):
    text = strip_think(reply).strip()
    if not text:
        return {"error": "empty"}
    m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    if m:
        text = m.group(1)
    try:
        obj = json.loads(text)
    except ValueError:
        return {"error": "not_json"}
    if not isinstance(obj, dict):
        return {"error": "not_json"}
    keys = {"earliest_error", "error_category"} | ({"analysis"} if with_analysis else set())
    if set(obj) != keys:
        return {"error": "out_of_schema"}
    if with_analysis and not isinstance(obj["analysis"], str):
        return {"error": "out_of_schema"}
    idx, cat = obj["earliest_error"], obj["error_category"]
    if not isinstance(idx, int) or isinstance(idx, bool) or cat not in CATEGORIES:
        return {"error": "out_of_schema"}
    return verdict(idx, cat, n)


def text_oracle(reply, n):
    text = strip_think(reply)
    if not text.strip():
        return {"error": "empty"}
    start = text.rfind("\\boxed{")
    if start < 0:
        return bare_answer_line(text, n)
    depth, i = 1, start + len("\\boxed{")
    body_start = i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    if depth:
        return {"error": "no_answer"}
    raw = text[body_start:i - 1]
    raw = re.sub(r"\\text\{(.*)\}", r"\1", raw).replace("$", "").strip()
    try:
        index = int(raw)
    except ValueError:
        return {"error": "unreadable"}
    cats = re.findall(r"^\W*Category:\W*(\w+)", text[i:], re.M | re.I)
    cat = cats[-1].capitalize() if cats and cats[-1].capitalize() in CATEGORIES else None
    return verdict(index, cat, n)


def expect_of(r):
    """The oracle's reading of one logged reply."""
    if r["mode"] == "json_schema":
        return json_oracle(r["reply"], r["n_steps"], r["turn"] == "reply")
    return text_oracle(r["reply"], r["n_steps"])


def bare_answer_line(text, n):
    """No box: the parser's documented fallback of a final line that is only an index ("-1"),
    checked by hand on every reply where it applied. Anything else without a box is no answer."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    answers = [line for line in lines if not re.match(r"\W*category", line, re.I)]
    if answers and re.fullmatch(r"-?\d+", answers[-1]):
        cats = [m.group(1) for line in lines if (m := re.match(r"\W*Category:\W*(\w+)", line, re.I))]
        cat = cats[-1].capitalize() if cats and cats[-1].capitalize() in CATEGORIES else None
        expect = verdict(int(answers[-1]), cat, n)
        return dict(expect, note="a bare final answer line, no box (checked by hand)")
    return {"error": "no_answer"}


def main():
    src, model, out = sys.argv[1:]
    seen, cases = set(), []
    lines = [line for path in src.split(",") for line in open(path)]
    for line in lines:
        r = json.loads(line)
        key = (r["mode"], r["turn"], r["n_steps"], r["reply"])
        if key in seen:
            continue
        seen.add(key)
        expect = expect_of(r)
        cases.append({"model": model, "mode": r["mode"], "turn": r["turn"],
                      "n_steps": r["n_steps"], "finish_reason": r.get("finish_reason"),
                      "reply": r["reply"], "expect": expect})
    with open(out, "w") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
