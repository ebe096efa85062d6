//! The recorder on a real folder: rows as dataset lines, rotation by size, a crash's half line
//! cut at the next start, and a full queue dropping rows instead of waiting.

use super::*;
use crate::trace::ErrorCategory;
use serde_json::Value;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("retrace-record-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(path: PathBuf, max_file_mb: u64, queue: usize) -> RecordConfig {
    RecordConfig {
        path,
        max_file_mb,
        max_files: 2,
        queue,
        queue_mb: 16,
    }
}

fn trace(question: &str) -> Trace {
    let mut t = Trace::of_steps(question, &["a".into(), "b".into(), "c".into()]);
    t.reference_answer = Some("42".into());
    t
}

fn judged(first_error: Option<usize>, category: ErrorCategory) -> Judgement {
    let mut j = Judgement::from_scores(vec![1.0, 0.0, 0.0], 0.5);
    j.first_error = first_error;
    j.category = category;
    j.rationale = Some("step 1 is false".into());
    j.agreement = Some(2.0 / 3.0);
    j
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Sends `rows` through a recorder whose writer is then let go and finished.
fn record_all(cfg: &RecordConfig, rows: &[(Trace, Judgement)]) {
    let (recorder, writer) = Recorder::open("c", "j", cfg).unwrap();
    for (t, j) in rows {
        recorder.record(t, j, Some(Some(2)));
    }
    drop(recorder);
    // The writer drains what was queued, then ends: run it here, to its end.
    writer.run();
}

#[test]
fn a_verdict_is_a_dataset_row_with_its_judge_and_the_prms_label() {
    let dir = temp("row");
    let cfg = config(dir.join("verdicts.jsonl"), 1, 16);
    let rows = [
        (trace("q1"), judged(Some(1), ErrorCategory::Hallucination)),
        (trace("q2"), judged(None, ErrorCategory::None)),
    ];
    record_all(&cfg, &rows);
    let got = lines(&dir.join("verdicts.jsonl"));
    assert_eq!(got.len(), 2);
    let r = &got[0];
    assert_eq!(r["question"], "q1");
    assert_eq!(r["steps"], serde_json::json!(["a", "b", "c"]));
    assert_eq!(r["reference_answer"], "42");
    assert_eq!(
        (r["label"].as_i64(), r["category"].as_str()),
        (Some(1), Some("hallucination"))
    );
    assert_eq!(
        (r["labelled_by"].as_str(), r["recorded_by"].as_str()),
        (Some("j"), Some("c"))
    );
    assert_eq!(r["rationale"], "step 1 is false");
    assert_eq!(r["prm_label"], 2);
    assert!(r["recorded_unix_ms"].as_u64().unwrap() > 0);
    assert_eq!(
        (got[1]["label"].as_i64(), got[1]["category"].as_str()),
        (Some(-1), Some("none"))
    );
    assert_ne!(got[0]["id"], got[1]["id"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn files_rotate_by_size_and_keep_the_newest() {
    let dir = temp("rotate");
    // 1 MiB files: rows of about 10 KiB, about 100 a file; 400 of them fill four.
    let cfg = config(dir.clone(), 1, 1000);
    let long = "x".repeat(10_000);
    let rows: Vec<_> = (0..400)
        .map(|i| {
            (
                trace(&format!("{i} {long}")),
                judged(Some(0), ErrorCategory::Reasoning),
            )
        })
        .collect();
    record_all(&cfg, &rows);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // Three rotations happened; the oldest went, two rotated files stay beside the current one.
    assert_eq!(
        names,
        [
            "verdicts.000002.jsonl",
            "verdicts.000003.jsonl",
            "verdicts.jsonl"
        ]
    );
    let mut kept = 0;
    for name in &names {
        let path = dir.join(name);
        assert!(std::fs::metadata(&path).unwrap().len() <= 1 << 20, "{name}");
        kept += lines(&path).len();
    }
    // The newest rows are the ones kept, in order.
    let current = lines(&dir.join("verdicts.jsonl"));
    let last = current.last().unwrap()["question"].as_str().unwrap();
    assert!(last.starts_with("399 "), "{}", &last[..10]);
    assert!(kept < 400 && kept > 200, "{kept}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_half_written_line_is_cut_at_the_next_start_and_earlier_rows_stay_whole() {
    let dir = temp("crash");
    let path = dir.join("v.jsonl");
    let cfg = config(path.clone(), 1, 16);
    record_all(&cfg, &[(trace("q1"), judged(None, ErrorCategory::None))]);
    // A crash mid-line.
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(b"{\"question\": \"half").unwrap();
    drop(f);
    record_all(&cfg, &[(trace("q2"), judged(None, ErrorCategory::None))]);
    let got = lines(&path);
    let questions: Vec<&str> = got
        .iter()
        .map(|r| r["question"].as_str().unwrap())
        .collect();
    assert_eq!(questions, ["q1", "q2"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_full_queue_drops_the_row_and_never_waits() {
    let dir = temp("full");
    let cfg = config(dir.join("v.jsonl"), 1, 2);
    let (recorder, writer) = Recorder::open("c", "j", &cfg).unwrap();
    // No writer runs yet: two rows fill the queue; the next three are dropped at once.
    for i in 0..5 {
        recorder.record(
            &trace(&format!("q{i}")),
            &judged(None, ErrorCategory::None),
            None,
        );
    }
    drop(recorder);
    writer.run();
    let got = lines(&dir.join("v.jsonl"));
    let questions: Vec<&str> = got
        .iter()
        .map(|r| r["question"].as_str().unwrap())
        .collect();
    assert_eq!(questions, ["q0", "q1"]);
    assert!(
        got[0].get("prm_label").is_none(),
        "a plain judge has no PRM"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn record_is_a_path_or_a_table_whose_keys_are_checked() {
    #[derive(Deserialize)]
    struct T {
        #[serde(default, deserialize_with = "deserialize_record")]
        record: Option<RecordConfig>,
    }
    let t: T = toml::from_str("record = \"runs/v.jsonl\"").unwrap();
    let r = t.record.unwrap();
    assert_eq!(
        (r.path, r.max_file_mb, r.max_files),
        ("runs/v.jsonl".into(), 64, 8)
    );
    let t: T = toml::from_str("record = { path = \"runs\", max_files = 3 }").unwrap();
    assert_eq!(t.record.unwrap().max_files, 3);
    let err = toml::from_str::<T>("record = { path = \"runs\", max_filez = 3 }")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("max_filez"), "{err}");
    let zero = RecordConfig {
        queue: 0,
        ..config("v.jsonl".into(), 1, 1)
    };
    assert!(zero.check().unwrap_err().0.contains("record.queue"));
}

#[test]
fn the_files_are_the_owners_alone_whatever_the_umask() {
    let dir = temp("mode");
    let path = dir.join("v.jsonl");
    // A file left readable to all, by another tool or an older server.
    std::fs::write(&path, "").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = config(path.clone(), 1, 16);
    record_all(&cfg, &[(trace("q"), judged(None, ErrorCategory::None))]);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    // A file made new is created so, not narrowed after.
    let fresh = dir.join("fresh.jsonl");
    record_all(
        &config(fresh.clone(), 1, 16),
        &[(trace("q"), judged(None, ErrorCategory::None))],
    );
    assert_eq!(mode(&fresh), 0o600);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_queue_is_bounded_in_bytes_as_well_as_rows() {
    let dir = temp("bytes");
    let cfg = RecordConfig {
        queue_mb: 1,
        ..config(dir.join("v.jsonl"), 64, 4096)
    };
    let (recorder, writer) = Recorder::open("c", "j", &cfg).unwrap();
    // Rows of about 300 KiB: room in rows for 4,096, in bytes for three.
    let long = |i: usize| {
        let step = "x".repeat(100 << 10);
        Trace::of_steps(&format!("q{i}"), &[step.clone(), step.clone(), step])
    };
    for i in 0..6 {
        recorder.record(&long(i), &judged(None, ErrorCategory::None), None);
    }
    assert!(recorder.queued.load(Ordering::Acquire) <= 1 << 20);
    drop(recorder);
    writer.run();
    let got = lines(&dir.join("v.jsonl"));
    assert_eq!(got.len(), 3, "a MiB holds three rows of 300 KiB");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn one_file_named_two_ways_is_one_file() {
    let a = config("runs/verdicts.jsonl".into(), 1, 1);
    let b = config("runs/./verdicts.jsonl".into(), 1, 1);
    let folder = config("runs/".into(), 1, 1);
    let other = config("runs/other.jsonl".into(), 1, 1);
    assert_eq!(a.current_file(), b.current_file());
    assert_eq!(a.current_file(), folder.current_file());
    assert_ne!(a.current_file(), other.current_file());
    assert!(a.current_file().is_absolute());
}
