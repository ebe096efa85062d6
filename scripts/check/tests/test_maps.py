"""The map check on planted trees: a module missing from a layout comment, an area missing from
tests/it/main.rs or from the test table, and a tree where everything is named."""
from pathlib import Path

from scripts.check import maps


def plant(tmp: Path, *, layout: str, main_mods: str, table: str):
    for rel in maps.CRATE_ROOTS:
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"//! # Layout\n{layout}\n\nmod alpha;\npub(crate) mod beta;\n")
    it = tmp / "tests/it"
    (it / "common").mkdir(parents=True)
    (it / "main.rs").write_text(main_mods)
    (it / "http.rs").write_text("")
    (it / "sigterm.rs").write_text("")
    cargo = tmp / "crates/retrace-cli/Cargo.toml"
    cargo.write_text('[[test]]\nname = "it"\n\n[[test]]\nname = "sigterm"\n')
    docs = tmp / "docs"
    docs.mkdir()
    (docs / "development.md").write_text(f"| area | what |\n|---|---|\n{table}\n")


def test_a_tree_whose_maps_name_everything_passes(tmp_path):
    plant(tmp_path, layout="//! - `alpha/`: a\n//! - `beta.rs`: b", main_mods="mod common;\nmod http;\n",
          table="| `http`, `sigterm` | both |")
    assert maps.main(tmp_path) == 0


def test_each_missing_name_is_reported(tmp_path, capsys):
    plant(tmp_path, layout="//! - `alpha/`: a", main_mods="mod common;\n", table="| `sigterm` | s |")
    assert maps.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "module `beta` is not named" in out
    assert "area `http` is not declared" in out
    assert "area `http` has no row" in out
    assert "sigterm" not in out
