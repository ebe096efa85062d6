//! The code-shape gate (`scripts/check/code_shape.py`) run on planted trees: a test-only item
//! is skipped, and only that item, so product code after it is still measured.
use crate::common::{REPO, TempDir};
use std::path::Path;
use std::process::Command;

/// Runs the gate on `root`; its exit status and what it printed.
fn gate(root: &Path) -> (bool, String) {
    let script = Path::new(REPO).join("scripts/check/code_shape.py");
    let out = Command::new("python3")
        .arg(script)
        .arg("--root")
        .arg(root)
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A tree whose one file is `text`.
fn tree(text: &str) -> TempDir {
    let dir = TempDir::new("shape");
    std::fs::create_dir_all(dir.0.join("src")).unwrap();
    std::fs::write(dir.0.join("src/lib.rs"), text).unwrap();
    dir
}

fn long_fn(name: &str, lines: usize) -> String {
    let body: String = (0..lines)
        .map(|i| format!("    let _x{i} = {i};\n"))
        .collect();
    format!("fn {name}() {{\n{body}}}\n")
}

#[test]
fn a_long_function_after_a_test_helper_is_caught() {
    let text = format!(
        "#[cfg(test)]\nfn helper() -> u32 {{\n    1\n}}\n\n{}",
        long_fn("after_helper", 90)
    );
    let (ok, out) = gate(&tree(&text).0);
    assert!(!ok, "the gate passed a 92-line function: {out}");
    assert!(out.contains("fn after_helper is 92 lines"), "{out}");
}

#[test]
fn a_long_function_inside_a_test_module_is_not_counted() {
    let text = format!(
        "fn short() {{}}\n\n#[cfg(test)]\nmod tests {{\n{}}}\n",
        long_fn("in_tests", 90)
    );
    let (ok, out) = gate(&tree(&text).0);
    assert!(ok, "a test module's function was counted: {out}");
    assert!(out.contains("1 files, 1 functions; 0 over"), "{out}");
}

#[test]
fn a_test_module_declared_by_path_ends_at_its_semicolon() {
    let text = format!(
        "#[cfg(test)]\n#[path = \"x_tests.rs\"]\nmod tests;\n{}",
        long_fn("after_decl", 85)
    );
    let (ok, out) = gate(&tree(&text).0);
    assert!(!ok, "{out}");
    assert!(out.contains("fn after_decl is 87 lines"), "{out}");
}

#[test]
fn the_repository_passes_its_own_gate() {
    let (ok, out) = gate(Path::new(REPO));
    assert!(ok, "{out}");
}
