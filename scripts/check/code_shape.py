#!/usr/bin/env python3
"""Checks the shape of the product code: no function over 80 lines and no file over 500.

Counted over every .rs file under src/ and crates/*/src/ (the server, the model crate and the
tools), tests aside: files named *_tests.rs or tests.rs, and each item a `#[cfg(test)]` gates (a
test module, a test-only helper or import), from the attribute to the item's closing brace or
semicolon; code after such an item is counted again. A function's length is its lines from the
`fn` line to its closing brace, both included, braces matched outside strings, chars and
comments. A file's length is its lines outside test items.

Usage: code_shape.py [--root DIR] [--max-fn N] [--max-file N] [--list]   (exits 1 on any excess)
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"[^\"]*\"\s+)?fn\s+(\w+)")


def strip(line, in_block):
    """The line with strings, chars and comments blanked; whether a block comment stays open."""
    out, i, n = [], 0, len(line)
    while i < n:
        if in_block:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_block = end + 2, False
            continue
        two = line[i:i + 2]
        if two == "//":
            break
        if two == "/*":
            in_block, i = True, i + 2
            continue
        c = line[i]
        if c == '"':
            j = i + 1
            while j < n and line[j] != '"':
                j += 2 if line[j] == "\\" else 1
            i = j + 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:i + 4]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:i + 4]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out), in_block


def product_lines(path):
    """The file's lines with every `#[cfg(test)]` item blanked (so line numbers stay true), and
    how many lines are product code."""
    lines = path.read_text().splitlines()
    out, k, kept = [], 0, 0
    while k < len(lines):
        if lines[k].strip().startswith("#[cfg(test)]"):
            end = item_end(lines, k)
            out.extend("" for _ in range(k, end + 1))
            k = end + 1
            continue
        out.append(lines[k])
        kept += 1
        k += 1
    return out, kept


def item_end(lines, start):
    """The last line of the item the attribute on line `start` gates: where its braces close, or
    its `;` when it has no body (`mod tests;`, `use ...;`)."""
    depth, in_block, opened = 0, False, False
    first = lines[start].strip()[len("#[cfg(test)]"):]
    for k in range(start, len(lines)):
        code, in_block = strip(first if k == start else lines[k], in_block)
        for c in code:
            if c == "{":
                depth, opened = depth + 1, True
            elif c == "}":
                depth -= 1
                if opened and depth == 0:
                    return k
            elif c == ";" and depth == 0:
                return k
    return len(lines) - 1


def functions(lines):
    """(name, first line, length) of every fn with a body."""
    found, stack, depth, in_block, pending = [], [], 0, False, None
    raw_strings = False
    for k, line in enumerate(lines):
        m = FN.match(line)
        if m and pending is None:
            pending = (m.group(7), k)
        code, in_block = strip(line, in_block)
        if 'r#"' in line or "r\"" in line:
            raw_strings = raw_strings or line.count('"#') == 0
        for c in code:
            if c == "{":
                depth += 1
                if pending is not None:
                    stack.append((pending[0], pending[1], depth))
                    pending = None
            elif c == "}":
                if stack and stack[-1][2] == depth:
                    name, start, _ = stack.pop()
                    found.append((name, start + 1, k - start + 1))
                depth -= 1
            elif c == ";" and pending is not None and depth >= 0:
                pending = None  # a declaration without a body
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repo)")
    ap.add_argument("--max-fn", type=int, default=80)
    ap.add_argument("--max-file", type=int, default=500)
    ap.add_argument("--list", action="store_true", help="print the ten longest functions")
    args = ap.parse_args()
    root = args.root.resolve()
    files = [p for d in [root / "src", *sorted((root / "crates").glob("*/src"))]
             for p in sorted(d.rglob("*.rs"))
             if not (p.name.endswith("_tests.rs") or p.name == "tests.rs")]
    bad, all_fns = [], []
    for p in files:
        lines, kept = product_lines(p)
        rel = p.relative_to(root)
        if kept > args.max_file:
            bad.append(f"{rel}: {kept} lines (at most {args.max_file})")
        for name, start, length in functions(lines):
            all_fns.append((length, f"{rel}:{start} {name}"))
            if length > args.max_fn:
                bad.append(f"{rel}:{start}: fn {name} is {length} lines (at most {args.max_fn})")
    if args.list:
        for length, where in sorted(all_fns, reverse=True)[:10]:
            print(f"{length:5} {where}")
    print(f"code shape: {len(files)} files, {len(all_fns)} functions; "
          f"{len(bad)} over the limits")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
