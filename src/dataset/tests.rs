//! Tests for the dataset reader: arrays and JSONL, line numbers, fatal errors, purposes.

use super::*;
use std::io::Write;

/// Writes `body` to a fresh folder under the temp dir as `name`; returns the folder too.
fn file(name: &str, body: &str) -> (PathBuf, PathBuf) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "retrace-dataset-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::File::create(&path)
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    (dir, path)
}

#[test]
fn reads_an_array_with_line_numbers() {
    let body = "[\n  {\"id\": \"a\", \"problem\": \"q\", \"steps\": [\"s0\", \"s1\"], \"label\": 1,\n   \"generator\": \"g\", \"final_answer_correct\": false},\n  {\"id\": \"b\", \"problem\": \"q\", \"steps\": [\"x, ]}\"], \"label\": 5}\n]\n";
    let (dir, path) = file("gsm8k.json", body);
    let rows: Vec<_> = read_records(&path).unwrap().collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let a = rows[0].as_ref().unwrap();
    assert_eq!(
        (a.id.as_str(), a.split.as_str(), a.label),
        ("a", "gsm8k", Some(1))
    );
    assert_eq!(a.final_answer_correct, Some(false));
    assert!(a.source.is_none(), "eval keeps no fields");
    let e = rows[1].as_ref().unwrap_err();
    assert_eq!(e.line, 4);
    assert!(!e.fatal);
    assert!(e.message.contains("`label` 5"), "{e}");
    assert!(e.to_string().starts_with(&format!("{}:4:", path.display())));
    assert_eq!(count_records(&path).unwrap(), 2);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn reads_jsonl_in_retraceqa_shape() {
    let body = "{\"question\": \"q\", \"options\": [\"a\", \"b\"], \"text\": \"s0\\n\\ns1\", \"label\": 0, \"category\": \"Hallucination\", \"dataset\": \"csqa\"}\n\n{\"question\": \"q\", \"steps\": [\"s\"], \"label\": -1, \"category\": \"reasoning\"}\nnot json\n";
    let (dir, path) = file("cs.jsonl", body);
    let rows: Vec<_> = read_records(&path).unwrap().collect();
    let a = rows[0].as_ref().unwrap();
    assert_eq!((a.id.as_str(), a.split.as_str()), ("csqa-0", "csqa"));
    assert_eq!(a.category, Some(ErrorCategory::Hallucination));
    assert!(a.steps.is_empty() && a.text.is_some());
    let e = rows[1].as_ref().unwrap_err();
    assert_eq!(e.line, 3);
    assert!(e.message.contains("label` is -1"), "{e}");
    assert_eq!(rows[2].as_ref().unwrap_err().line, 4);
    assert_eq!(rows.len(), 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_broken_array_is_fatal() {
    let (dir, path) = file("x.json", "[{\"id\": \"a\"");
    let rows: Vec<_> = read_records(&path).unwrap().collect();
    assert_eq!(rows.len(), 1);
    assert!(rows[0].as_ref().unwrap_err().fatal);
    std::fs::remove_dir_all(dir).unwrap();
    let (dir, path) = file("y.json", "[]");
    assert_eq!(read_records(&path).unwrap().count(), 0);
    std::fs::remove_dir_all(dir).unwrap();
}

/// `label` reads rows without a label and keeps every field; `eval` still refuses them, and a
/// label that is there is checked either way.
#[test]
fn label_reads_unlabelled_rows_and_keeps_their_fields() {
    let body = "{\"id\": 7, \"question\": \"Did Aristotle use a laptop?\", \"steps\": [\"a\", \"b\"], \"facts\": [\"x\"]}\n{\"question\": \"q\", \"steps\": [\"a\"], \"label\": 4}\n{\"question\": \"q\", \"steps\": [\"a\"], \"category\": \"reasoning\"}\n";
    let (dir, path) = file("sqa.jsonl", body);
    let eval: Vec<_> = read_records(&path).unwrap().collect();
    assert!(
        eval[0]
            .as_ref()
            .unwrap_err()
            .message
            .contains("`label` is missing")
    );
    let rows: Vec<_> = read_records(&path)
        .unwrap()
        .for_purpose(Purpose::Label)
        .collect();
    let a = rows[0].as_ref().unwrap();
    assert_eq!((a.id.as_str(), a.label), ("7", None));
    let source = a.source.as_ref().unwrap();
    assert_eq!(source["facts"], serde_json::json!(["x"]));
    assert_eq!(source["id"], serde_json::json!(7));
    let e = rows[1].as_ref().unwrap_err();
    assert!(e.message.contains("`label` 4 is not -1"), "{e}");
    let c = rows[2].as_ref().unwrap();
    assert_eq!(
        (c.label, c.category),
        (None, Some(ErrorCategory::Reasoning))
    );
    std::fs::remove_dir_all(dir).unwrap();
}
