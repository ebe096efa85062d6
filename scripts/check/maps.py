#!/usr/bin/env python3
"""Checks that the maps stay true: every module a crate root declares is named in that root's
`# Layout` comment, and every integration test area (a module of tests/it/, or a test binary of
its own) is declared in tests/it/main.rs (else it never runs) and has a row in the test table of
docs/development.md. Prints each miss as FILE: what is missing, and exits 1 if any.

  python3 scripts/check/maps.py
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRATE_ROOTS = ["src/lib.rs", "crates/retrace-model/src/lib.rs", "crates/retrace-cli/src/lib.rs"]
MOD = re.compile(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", re.M)
# A test binary of its own, from the CLI package's [[test]] tables.
TEST_BIN = re.compile(r'\[\[test\]\]\s*\nname\s*=\s*"([a-z_0-9]+)"')


def layout_misses(root: Path, text: str) -> list[str]:
    """Modules declared in `text` that its `//!` comment never names."""
    doc = "\n".join(line for line in text.splitlines() if line.startswith("//!"))
    misses = []
    for name in MOD.findall(text):
        named = re.search(rf"`{name}(?:/|\.rs)?`|`{name}/[^`]*`|`{name}\.rs[^`]*`", doc)
        if not named:
            misses.append(f"{root}: module `{name}` is not named in its layout comment")
    return misses


def test_areas(it: Path) -> set[str]:
    """The areas of tests/it/: its modules (files, or folders with a mod.rs), not main or common."""
    areas = {p.stem for p in it.glob("*.rs")} | {p.parent.name for p in it.glob("*/mod.rs")}
    return areas - {"main", "common"}


def table_names(development: str) -> set[str]:
    """The areas named in the first column of docs/development.md's test table."""
    names = set()
    for line in development.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([a-z_0-9]+)`", first))
    return names


def test_misses(root: Path) -> list[str]:
    it = root / "tests/it"
    declared = set(MOD.findall((it / "main.rs").read_text()))
    binaries = set(TEST_BIN.findall((root / "crates/retrace-cli/Cargo.toml").read_text())) - {"it"}
    table = table_names((root / "docs/development.md").read_text())
    misses = []
    for area in sorted(test_areas(it) - binaries):
        if area not in declared:
            misses.append(f"tests/it/main.rs: area `{area}` is not declared (its tests never run)")
    for area in sorted(test_areas(it) | binaries):
        if area not in table:
            misses.append(f"docs/development.md: area `{area}` has no row in the test table")
    return misses


def main(root: Path = ROOT) -> int:
    misses = []
    for rel in CRATE_ROOTS:
        misses += layout_misses(Path(rel), (root / rel).read_text())
    misses += test_misses(root)
    for m in misses:
        print(m)
    print(f"maps: {'ok' if not misses else f'{len(misses)} missing'}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
