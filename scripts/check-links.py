#!/usr/bin/env python3
"""Checks the documentation's links, standard library only.

Every relative link and #anchor in README.md, docs/*.md and scripts/README.md, and every alert's
runbook_url under deploy/, must resolve: to a file or folder of this repository and, for an anchor,
to a heading of that Markdown file as GitHub slugs it (lowercased, punctuation dropped, spaces to
'-', '-1', '-2', ... on repeated headings). Links into this repository on GitHub
(https://github.com/retrace-project/retrace/blob/main/PATH or /tree/main/PATH) are checked as the
PATH they name; http(s) links to anything else are skipped. A runbook_url must be absolute.

It also fails when one of these files names a path that exists on one machine only (an absolute
path under a user's or a workplace's top folder, or a data folder beside the clone; the names are in
MACHINE_ROOTS and SIBLING below); write $HOME/... or ~/.cache/...
instead.

Usage: scripts/check-links.py [--root DIR]. Prints each problem as file:line: message and exits 1
when there is any.
"""

import argparse
import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

REPO_URLS = (
    "https://github.com/retrace-project/retrace/blob/main/",
    "https://github.com/retrace-project/retrace/tree/main/",
)

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^\s{0,3}(#{1,6})(?:\s+(.*?))?\s*$")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]*)(?:\s+[\"'(][^)]*)?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
RUNBOOK = re.compile(r"runbook_url:\s*[\"']?([^\"'\s]+)")
# A path of one machine: an absolute path under one of these top folders where a path starts (not
# inside a URL or after $HOME, ~ or a variable), or the workplace's data folder beside the clone.
# Spelled in pieces so that this file does not name them itself.
MACHINE_ROOTS = ["wo" + "rk", "ho" + "me", "ro" + "ot", "tm" + "p", "Us" + "ers"]
SIBLING = re.escape("..") + "/" + "sha" + "red"
MACHINE_PATH = re.compile(
    r"(?:(?<![\w.~}$/:-])/(?:" + "|".join(MACHINE_ROOTS) + r")/|" + SIBLING + r"\b)"
)


def slug(text):
    """GitHub's anchor for a heading's text: the rendered text, lowercased, with every character
    that is not a letter, mark, number, connector punctuation, space or hyphen dropped, and spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers, not snake_case
    out = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            out.append(ch)
    return "".join(out).replace(" ", "-")


def markdown_lines(text):
    """(line number, line, inside a fenced code block) for each line."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            mark = m.group(1)
            if fence is None:
                fence = mark[0] * len(mark)
                yield n, line, True
                continue
            if mark[0] == fence[0] and len(mark) >= len(fence) and not line.strip()[len(mark):].strip():
                fence = None
                yield n, line, True
                continue
        yield n, line, fence is not None


def anchors_of(path, cache={}):
    """Every anchor a Markdown file has: its headings' slugs (with GitHub's -N suffixes on repeats)
    and explicit <a name/id> anchors."""
    if path in cache:
        return cache[path]
    seen, anchors = {}, set()
    prev = None
    for _, line, fenced in markdown_lines(path.read_text(encoding="utf-8")):
        if fenced:
            prev = None
            continue
        heading = None
        m = ATX.match(line)
        if m:
            heading = re.sub(r"\s+#+\s*$", "", m.group(2) or "")
        elif prev is not None and prev.strip() and SETEXT.match(line) and not ATX.match(prev):
            # A setext heading: the line above, underlined. A lone '---' after a blank line is a rule.
            heading = prev.strip()
        if heading is not None:
            base = slug(heading)
            n = seen.get(base, 0)
            anchors.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
        anchors.update(a for a in HTML_ANCHOR.findall(line))
        prev = line
    cache[path] = anchors
    return anchors


def strip_code_spans(line):
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


class Checker:
    def __init__(self, root):
        self.root = root.resolve()
        self.problems = []

    def problem(self, path, line, message):
        self.problems.append(f"{path.relative_to(self.root)}:{line}: {message}")

    def check_target(self, src, line, target, *, base):
        """A link's target: a path relative to base (or, for this repository's GitHub URLs, to
        the root), optionally with #anchor."""
        target = target.strip()
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        if not target:
            self.problem(src, line, "empty link")
            return
        for prefix in REPO_URLS:
            if target.startswith(prefix):
                rel, base = target[len(prefix):], self.root
                break
        else:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                return  # http(s) elsewhere, mailto:, ...: not ours to check
            rel = target
        path_part, _, anchor = rel.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if path_part.startswith("/"):
            dest = (self.root / path_part.lstrip("/")).resolve()
        elif path_part:
            dest = (base / path_part).resolve()
        else:
            dest = src.resolve()
        try:
            dest.relative_to(self.root)
        except ValueError:
            self.problem(src, line, f"{target}: points outside the repository")
            return
        if not dest.exists():
            self.problem(src, line, f"{target}: {dest.relative_to(self.root)} does not exist")
            return
        if anchor:
            anchor = unquote(anchor)
            if dest.is_dir() or dest.suffix.lower() not in {".md", ".markdown"}:
                if not re.fullmatch(r"L\d+(-L\d+)?", anchor):
                    self.problem(src, line, f"{target}: #{anchor} in a file that is not Markdown")
                return
            if anchor not in anchors_of(dest):
                self.problem(src, line,
                             f"{target}: no heading in {dest.relative_to(self.root)} has the anchor #{anchor}")

    def check_machine_paths(self, path, n, line):
        for m in MACHINE_PATH.finditer(line):
            self.problem(path, n, f"names a path of one machine ({m.group(0)!r}): write $HOME/..., "
                                  "~/.cache/... or a path inside the repository")

    def check_markdown(self, path):
        for n, line, fenced in markdown_lines(path.read_text(encoding="utf-8")):
            self.check_machine_paths(path, n, line)
            if fenced:
                continue
            prose = strip_code_spans(line)
            targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
            targets += HTML_LINK.findall(prose)
            m = REF_DEF.match(prose)
            if m:
                targets.append(m.group(1))
            for t in targets:
                self.check_target(path, n, t, base=path.parent)

    def check_runbooks(self, path):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            return
        for n, line in enumerate(text.splitlines(), 1):
            for url in RUNBOOK.findall(line):
                if "{{" in url:
                    continue  # a template, filled in by Prometheus
                if not any(url.startswith(p) for p in REPO_URLS):
                    if re.match(r"^https?://", url):
                        continue
                    self.problem(path, n, f"runbook_url {url!r} is not absolute: Alertmanager shows it as it is, "
                                          f"so use {REPO_URLS[0]}docs/...")
                    continue
                self.check_target(path, n, url, base=self.root)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = p.parse_args()
    c = Checker(args.root)
    root = c.root
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "scripts" / "README.md"]
    checked = 0
    for d in docs:
        if d.exists():
            c.check_markdown(d)
            checked += 1
    deploy = sorted(f for f in (root / "deploy").rglob("*") if f.is_file()) if (root / "deploy").is_dir() else []
    for f in deploy:
        c.check_runbooks(f)
    if c.problems:
        print("\n".join(c.problems))
        print(f"check-links: {len(c.problems)} problem(s)", file=sys.stderr)
        sys.exit(1)
    print(f"check-links: ok ({checked} Markdown files, the runbook_urls under deploy/)")


if __name__ == "__main__":
    main()
