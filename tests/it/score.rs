//! `retrace score` as a user runs it against a `retrace serve` child process on the committed
//! tiny PRM: flags, a JSON file, JSONL on stdin; a table or proto3 JSON; errors name the line.

use crate::common;

use common::*;
use retrace::pb;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn score(port: u16, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .arg("score")
        .args(["--server", &format!("127.0.0.1:{port}")])
        .args(args)
        .env_remove("RETRACE_ADDRESS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).unwrap();
    }
    drop(input);
    let o = child.wait_with_output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn score_prints_tables_and_json_from_flags_files_and_stdin() {
    let dir = std::env::temp_dir().join(format!("retrace-score-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/qwen2-math-prm");
    let cfg = dir.join("retrace.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[evaluator]]\nname = \"tiny\"\nkind = \"prm\"\nfamily = \"qwen2-math-prm\"\n\
             model = {:?}\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    let port = free_port();
    let (_server, channel, _) =
        spawn_retrace_on(port, &["--config".as_ref(), cfg.as_ref()], &[]).await;
    let want = pb::evaluator_client::EvaluatorClient::new(channel)
        .evaluate(request(
            "",
            "",
            steps_trace("What is 2+3*4?", &["3*4 = 12.", "2+12 = 15."]),
        ))
        .await
        .unwrap()
        .into_inner();

    let flags = [
        "--question",
        "What is 2+3*4?",
        "--step",
        "3*4 = 12.",
        "--step",
        "2+12 = 15.",
    ];
    let (ok, out, err) = score(port, &flags, None);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("tiny: "), "{out}");
    assert!(
        lines[0].contains(&format!("trace score {:.3}", want.trace_score)),
        "{out}"
    );
    for (i, step) in want.steps.iter().enumerate() {
        assert!(
            lines[i + 1].contains(&format!("{:.3}", step.score)),
            "{out}"
        );
        let marked = lines[i + 1].starts_with('✗');
        assert_eq!(marked, want.first_error_index == i as i32, "{out}");
    }

    let (ok, out, err) = score(port, &[&flags[..], &["--json"]].concat(), None);
    assert!(ok, "{err}");
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(got["first_error_index"], want.first_error_index);
    assert_eq!(got["steps"].as_array().unwrap().len(), 2);

    let file = dir.join("trace.json");
    std::fs::write(
        &file,
        r#"{"question": "Halve 9.", "text": "9/2 = 4.5\n\nSo 4.5."}"#,
    )
    .unwrap();
    let (ok, out, err) = score(port, &["--file", file.to_str().unwrap()], None);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 3, "{out}");

    let jsonl = "{\"question\": \"q\", \"steps\": [\"a\"]}\n\
                 {\"trace\": {\"question\": \"r\", \"steps\": [\"b\", \"c\"]}, \"threshold\": 0.9}\n";
    let (ok, out, err) = score(port, &["--file", "-", "--json"], Some(jsonl));
    assert!(ok, "{err}");
    let replies: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(replies.len(), 2);
    assert!((replies[1]["threshold"].as_f64().unwrap() - 0.9).abs() < 1e-6);

    let (ok, _, err) = score(
        port,
        &["--file", "-"],
        Some("{\"question\": \"q\", \"steps\": [\"a\"]}\n{\"question\": 3}\n"),
    );
    assert!(!ok);
    assert!(err.contains("stdin: line 2"), "{err}");
    let (ok, _, err) = score(port, &["--question", "q", "--step", " "], None);
    assert!(!ok);
    assert!(err.contains("trace.steps[0]"), "{err}");
    let (ok, _, err) = score(port, &["--question", "q"], None);
    assert!(!ok);
    assert!(err.contains("--step"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
