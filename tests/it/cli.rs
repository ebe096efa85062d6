//! `retrace check-config` as an operator runs it: a bad value stops it naming the file, the
//! evaluator and the key; a good file prints resolved, with flags laid over it.

use std::process::Command;

fn check_config(text: &str, args: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!("retrace-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("c{}.toml", text.len()));
    std::fs::write(&path, text).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .arg("check-config")
        .arg("--config")
        .arg(&path)
        .args(args)
        .env_remove("RETRACE_SET")
        .output()
        .expect("run retrace check-config");
    let _ = std::fs::remove_file(&path);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const PRM: &str =
    "[[evaluator]]\nname = \"p\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"/m\"\n";

#[test]
fn check_config_refuses_a_device_it_cannot_name() {
    let (ok, _, err) = check_config(&format!("{PRM}device = \"gpu\"\n"), &[]);
    assert!(!ok);
    assert!(
        err.contains("evaluator[0] (\"p\")") && err.contains("device \"gpu\""),
        "{err}"
    );
}

#[test]
fn check_config_prints_the_resolved_config_with_flags_over_the_file() {
    let (ok, out, err) = check_config(
        &format!("[server]\nmax_in_flight = 3\n\n{PRM}"),
        &["--max-in-flight", "5", "--set", "evaluator.p.max_wait_ms=7"],
    );
    assert!(ok, "{err}");
    assert!(out.contains("max_in_flight = 5"), "{out}");
    assert!(out.contains("max_wait_ms = 7"), "{out}");
    assert!(out.contains("device = \"cpu\""), "{out}");
}
