//! The offline benchmark: ProcessBench's metric on the committed ProcessBench subset (real traces,
//! tests/fixtures/processbench) with scripted predictions,
//! calibration with a known best threshold, the report, and `retrace eval` / `retrace calibrate`
//! run as a binary against a server (a fake evaluator in-process, and a real tiny PRM).

use crate::common;

use common::*;
use futures::future::BoxFuture;
use retrace::{Description, EngineError, Evaluator, Job};
use retrace::{ErrorCategory, Judgement};
use retrace_cli::{
    Analysis, Calibration, Report, Row, ScoredTrace, Summary, first_below, read_records, read_rows,
    rethreshold, sweep,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const SPLITS: [&str; 4] = ["gsm8k", "math", "olympiadbench", "omnimath"];

/// The label of every trace of a split, in file order.
fn labels(split: &str) -> Vec<i32> {
    read_records(&processbench(split))
        .unwrap()
        .map(|r| {
            r.expect("ProcessBench rows are valid")
                .label
                .expect("eval reads labels")
        })
        .collect()
}

fn close(a: Option<f64>, b: f64) {
    let a = a.expect("defined");
    assert!((a - b).abs() < 1e-9, "{a} != {b}");
}

#[test]
fn processbench_files_read_as_documented() {
    // The committed subset: 32 traces per split, 12 of them correct (label -1).
    let expected = [(32, 12); 4];
    for (split, (n, correct)) in SPLITS.iter().zip(expected) {
        let l = labels(split);
        assert_eq!(l.len(), n, "{split}");
        assert_eq!(l.iter().filter(|&&x| x == -1).count(), correct, "{split}");
    }
}

#[test]
fn predictions_equal_to_labels_score_100() {
    let data: Vec<(&str, Vec<i32>)> = SPLITS.iter().map(|s| (*s, labels(s))).collect();
    let s = Summary::of(
        data.iter()
            .flat_map(|(split, l)| l.iter().map(move |&x| (*split, x, Some(x)))),
    );
    assert_eq!(s.splits.len(), 4);
    for x in &s.splits {
        close(x.error_acc, 100.0);
        close(x.correct_acc, 100.0);
        close(x.f1, 100.0);
    }
    close(s.average.f1, 100.0);
}

#[test]
fn predicting_all_correct_scores_error_0_correct_100_f1_0() {
    for split in SPLITS {
        let l = labels(split);
        let s = Summary::of(l.iter().map(|&x| (split, x, Some(-1))));
        close(s.splits[0].error_acc, 0.0);
        close(s.splits[0].correct_acc, 100.0);
        close(s.splits[0].f1, 0.0);
    }
}

/// Trace i predicts its label when i % 3 == 0, -1 when 1, and fails (no prediction) when 2.
#[test]
fn a_known_mix_gives_exact_numbers() {
    let mut f1s = Vec::new();
    // (error traces, hit, correct traces, hit), as run_eval.py's formula gives them.
    let pinned = [
        (20, 7, 12, 9),
        (20, 7, 12, 8),
        (20, 7, 12, 8),
        (20, 6, 12, 8),
    ];
    for (split, pin) in SPLITS.iter().zip(pinned) {
        let l = labels(split);
        let pred = |i: usize, x: i32| match i % 3 {
            0 => Some(x),
            1 => Some(-1),
            _ => None,
        };
        let s = Summary::of(l.iter().enumerate().map(|(i, &x)| (*split, x, pred(i, x))));
        // Independently: count the subsets and hits by hand.
        let (mut ne, mut he, mut nc, mut hc) = (0usize, 0usize, 0usize, 0usize);
        for (i, &x) in l.iter().enumerate() {
            if x == -1 {
                nc += 1;
                hc += usize::from(i % 3 != 2);
            } else {
                ne += 1;
                he += usize::from(i % 3 == 0);
            }
        }
        assert_eq!((ne, he, nc, hc), pin, "{split}");
        let e = he as f64 / ne as f64 * 100.0;
        let c = hc as f64 / nc as f64 * 100.0;
        let x = &s.splits[0];
        close(x.error_acc, e);
        close(x.correct_acc, c);
        close(x.f1, 2.0 * e * c / (e + c));
        let failed = (0..l.len()).filter(|i| i % 3 == 2).count();
        assert_eq!(x.failed, failed);
        f1s.push(2.0 * e * c / (e + c));
    }
    // gsm8k by run_eval.py's formula: 35.0, 75.0, F1 47.727272...
    let gsm = Summary::of(
        labels("gsm8k")
            .iter()
            .enumerate()
            .map(|(i, &x)| ("gsm8k", x, [Some(x), Some(-1), None][i % 3])),
    );
    close(gsm.splits[0].f1, 47.72727272727273);
    let mean = f1s.iter().sum::<f64>() / 4.0;
    assert!((mean - 45.22746544015622).abs() < 1e-9, "{mean}");
}

fn trace(split: &str, label: i32, scores: &[f32]) -> ScoredTrace {
    ScoredTrace {
        split: split.into(),
        label,
        scores: Some(scores.to_vec()),
    }
}

#[test]
fn calibration_finds_the_known_best_threshold() {
    // Correct steps score in [0.62, 0.99], wrong first steps in [0.05, 0.41]; a trace's steps
    // after its first error score anything. Every threshold in (0.41, 0.62] is perfect.
    let mut traces = Vec::new();
    for i in 0..200 {
        let n = 2 + i % 6;
        let good = |k: usize| 0.62 + ((i * 7 + k * 13) % 38) as f32 / 100.0;
        let bad = |k: usize| 0.05 + ((i * 11 + k * 3) % 37) as f32 / 100.0;
        let label = if i % 4 == 0 { -1 } else { (i % n) as i32 };
        let scores: Vec<f32> = (0..n)
            .map(|k| match label {
                -1 => good(k),
                l if (k as i32) < l => good(k),
                l if k as i32 == l => bad(k),
                _ => {
                    if k % 2 == 0 {
                        good(k)
                    } else {
                        bad(k)
                    }
                }
            })
            .collect();
        traces.push(trace(if i % 2 == 0 { "a" } else { "b" }, label, &scores));
    }
    let curve = sweep(&traces);
    let best = curve.best();
    let all = || traces.iter().flat_map(|t| t.scores.clone().unwrap());
    let highest_bad = all().filter(|&s| s < 0.5).fold(0.0, f32::max);
    let lowest_good = all().filter(|&s| s >= 0.5).fold(1.0, f32::min);
    assert!((highest_bad - 0.41).abs() < 1e-6 && (lowest_good - 0.62).abs() < 1e-6);
    assert_eq!(best.f1, 100.0);
    assert_eq!(best.low, Some(highest_bad));
    assert_eq!(best.high, lowest_good);
    assert!(best.threshold > highest_bad && best.threshold <= lowest_good);
    // Re-deciding every trace at the chosen threshold gives the same 100.
    let direct = Summary::of(traces.iter().map(|t| {
        let p = first_below(t.scores.as_deref().unwrap(), best.threshold);
        (t.split.as_str(), t.label, Some(p))
    }));
    close(direct.average.f1, 100.0);
    // A threshold just outside the interval is worse.
    for off in [0.40, 0.63] {
        assert!(curve.mean_f1(curve.point(off)) < 100.0, "{off}");
    }
}

fn row(split: &str, label: i32, scores: &[f32], gold: Option<ErrorCategory>) -> Row {
    let p = first_below(scores, 0.5);
    Row {
        id: format!("{split}-{label}-{}", scores.len()),
        split: split.into(),
        label,
        prediction: Some(p),
        category: Some(if p == -1 {
            ErrorCategory::None
        } else {
            ErrorCategory::Unspecified
        }),
        gold_category: gold,
        step_scores: scores.to_vec(),
        matched: p == label,
        generator: Some("gen-a".into()),
        final_answer_correct: Some(label == -1 || scores.len() > 2),
        evaluator: "e".into(),
        threshold: Some(0.5),
        error: None,
        trace_score: None,
        outcome_score: None,
        question_key: None,
    }
}

#[test]
fn the_report_renders_markdown_and_html_with_svg() {
    let rows = [
        row("x", -1, &[0.9, 0.8], Some(ErrorCategory::None)),
        row("x", 1, &[0.9, 0.3, 0.2], Some(ErrorCategory::Reasoning)),
        row("y", 0, &[0.6, 0.9], Some(ErrorCategory::Hallucination)),
        row("y", -1, &[0.7], Some(ErrorCategory::None)),
    ];
    let traces: Vec<ScoredTrace> = rows.iter().map(ScoredTrace::of).collect();
    let curve = sweep(&traces);
    let choice = curve.best();
    let tuned: Vec<Row> = rows
        .iter()
        .map(|r| rethreshold(r, choice.threshold))
        .collect();
    let analysis = Analysis::of(&tuned);
    assert_eq!(analysis.summary.average.f1, Some(100.0));
    let report = Report {
        title: "test <report>".into(),
        notes: vec!["evaluator: `e`".into()],
        analysis,
        calibration: Some(Calibration {
            evaluator: "e".into(),
            curve,
            choice: choice.clone(),
            per_split: vec![],
            test: None,
        }),
    };
    let html = retrace_cli::render_html(&report);
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_eq!(
        html.matches("<svg").count(),
        4,
        "F1, index, category, curve"
    );
    assert!(html.contains("test &lt;report&gt;"));
    assert!(!html.contains("<script"), "self-contained, no scripts");
    assert!(html.contains(&format!("threshold = {}", choice.threshold)));
    let md = retrace_cli::render_markdown(&report);
    assert!(md.contains(
        "| split | error traces | correct traces | error acc | correct acc | F1 | failed |"
    ));
    assert!(
        md.contains("| x | 1 | 1 | 100.0 | 100.0 | 100.0 | 0 |"),
        "{md}"
    );
    assert!(md.contains("Answer-level analysis"));
    assert!(md.contains("| gold \\ predicted |"));
}

/// Runs the `retrace` binary with `args`; returns its output.
async fn retrace(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_retrace"))
            .args(&args)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .output()
            .expect("run retrace")
    })
    .await
    .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn rows_of(path: &Path) -> Vec<Row> {
    let mut rows = Vec::new();
    read_rows(path, |r| rows.push(r)).unwrap();
    rows
}

/// A JSONL file in ReTraceQA's shape: categories, a text trace, one bad row (line 4).
fn commonsense_jsonl(dir: &Path) -> PathBuf {
    let path = dir.join("cs.jsonl");
    let lines = [
        r#"{"id": "c1", "question": "Where do wolves live?", "options": ["arctic", "desert"], "steps": ["Wolves live in many places.", "Wolves are wrong for the arctic.", "So desert."], "label": 1, "category": "hallucination", "final_answer_correct": false, "dataset": "csqa", "generator": "tiny-gen"}"#,
        r#"{"id": "c2", "question": "Salt on ice?", "text": "Salt lowers the freezing point.\n\nSo ice melts.", "label": -1, "category": "none", "final_answer_correct": true, "dataset": "csqa", "generator": "tiny-gen"}"#,
        r#"{"id": "c3", "question": "Salt on ice?", "steps": ["Salt lowers the freezing point.", "So ice forms more easily, which is wrong."], "label": 1, "category": "reasoning", "final_answer_correct": true, "dataset": "csqa", "generator": "tiny-gen"}"#,
        r#"{"id": "c4", "question": "broken", "steps": ["a"], "label": 3}"#,
    ];
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// The fake evaluator's rule: the first step containing "wrong" is the first error.
fn fake_prediction(steps: &[String]) -> i32 {
    steps
        .iter()
        .position(|s| s.contains("wrong"))
        .map_or(-1, |i| i as i32)
}

/// The fake, except that its first call outlasts a whole connection's life, so the connection
/// it came on is cut under it however fast the machine is.
struct FirstOutlivesItsConnection {
    fake: Fake,
    first: Duration,
    calls: Arc<AtomicUsize>,
}

impl Evaluator for FirstOutlivesItsConnection {
    fn describe(&self) -> Description {
        self.fake.describe()
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(self.first).await;
            }
            self.fake.evaluate(job).await
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_outlives_the_connections_the_server_retires() {
    // Connections retired after 1 s and cut 1 s later; the first trace takes 5 s, the rest
    // 150 ms each, one at a time. The eval's first stream is cut while that trace is judged:
    // the run finishes only if the eval opens a new stream and sends the trace again.
    let calls = Arc::new(AtomicUsize::new(0));
    let loader: retrace::EvaluatorLoader = {
        let calls = calls.clone();
        Arc::new(move |_, _| {
            let fake = Fake {
                delay: Duration::from_millis(150),
                counters: Arc::default(),
            };
            Ok(Arc::new(FirstOutlivesItsConnection {
                fake,
                first: Duration::from_secs(5),
                calls: calls.clone(),
            }) as Arc<dyn Evaluator>)
        })
    };
    let server = TestServer::start(
        config(
            "max_connection_age_s = 1\nmax_connection_age_grace_s = 1",
            &[("fake", "")],
        ),
        loader,
    )
    .await;
    server.ready().await;
    let dir = TempDir::new("aged");
    let out = dir.0.join("out");
    let gsm = processbench("gsm8k");
    let mut args: Vec<String> = ["eval", "--server", &server.addr.to_string(), "--data"]
        .map(String::from)
        .to_vec();
    args.push(gsm.display().to_string());
    args.extend(["--limit", "8", "--concurrency", "1", "--out"].map(String::from));
    args.push(out.display().to_string());
    let o = retrace(args).await;
    assert!(o.status.success(), "{}", text(&o));
    let rows = rows_of(&out.join("predictions.jsonl"));
    assert_eq!(rows.len(), 8, "{}", text(&o));
    assert!(rows.iter().all(|r| r.error.is_none()), "{}", text(&o));
    // The trace cut with the first connection was sent again: more calls than traces (had no
    // connection been cut, the first call would have finished and there would be 8).
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls > 8, "{calls} calls for 8 traces: no call was cut");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_and_calibrate_run_end_to_end_against_a_server() {
    let server = TestServer::start(
        config("", &[("fake", "")]),
        fake_loader(Duration::ZERO, Arc::new(Counters::default()), None),
    )
    .await;
    server.ready().await;
    let dir = TempDir::new("e2e");
    let out = dir.0.join("out");
    let cs = commonsense_jsonl(&dir.0);
    let (gsm, math) = (processbench("gsm8k"), processbench("math"));
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec!["eval".into(), "--server".into(), server.addr.to_string()];
        a.extend(["--data".into(), gsm.display().to_string()]);
        a.push(math.display().to_string());
        a.push(cs.display().to_string());
        a.extend(["--limit", "6", "--concurrency", "4", "--out"].map(String::from));
        a.push(out.display().to_string());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // A bad row stops the run, naming its file and line.
    let o = retrace(args(&[])).await;
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("{}:4:", cs.display())),
        "{}",
        text(&o)
    );

    // With --skip-bad it is skipped and counted; everything else is judged.
    let o = retrace(args(&["--skip-bad"])).await;
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("average"), "{}", text(&o));
    let predictions = out.join("predictions.jsonl");
    let rows = rows_of(&predictions);
    assert_eq!(rows.len(), 6 + 6 + 3, "{}", text(&o));

    // Each row is exactly what the fake evaluator says about its record.
    let mut expected: HashMap<(String, String), (i32, usize, i32)> = HashMap::new();
    for f in [&gsm, &math, &cs] {
        for r in read_records(f).unwrap().take(6).flatten() {
            let steps = if r.steps.is_empty() {
                vec!["x".to_string(); 2] // c2's text segments into two clean steps
            } else {
                r.steps.clone()
            };
            expected.insert(
                (r.split, r.id),
                (r.label.unwrap(), steps.len(), fake_prediction(&steps)),
            );
        }
    }
    for row in &rows {
        let (label, n, pred) = expected[&row.key()];
        assert_eq!(row.label, label);
        assert_eq!(row.prediction, Some(pred), "{row:?}");
        assert_eq!(row.matched, pred == label);
        assert_eq!(row.step_scores.len(), n, "{row:?}");
        assert_eq!(row.evaluator, "fake");
        assert_eq!(first_below(&row.step_scores, 0.5), pred);
    }
    let by_id: HashMap<&str, &Row> = rows.iter().map(|r| (r.id.as_str(), r)).collect();
    assert_eq!(
        by_id["c1"].gold_category,
        Some(ErrorCategory::Hallucination)
    );
    assert_eq!(by_id["c1"].category, Some(ErrorCategory::Unspecified));
    assert_eq!(by_id["c2"].split, "csqa");

    // The summary on disk agrees with the metric recomputed from the rows.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let recomputed = Summary::of(
        rows.iter()
            .map(|r| (r.split.as_str(), r.label, r.prediction)),
    );
    let f1 = summary["summary"]["average"]["f1"].as_f64().unwrap();
    assert!((f1 - recomputed.average.f1.unwrap()).abs() < 1e-9);
    assert_eq!(summary["summary"]["splits"].as_array().unwrap().len(), 3);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<svg"));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| csqa |"), "{md}");
    assert!(
        md.contains("tiny-gen"),
        "answer-level rows by generator: {md}"
    );

    // A rerun at another threshold would mix decisions: refused.
    let o = retrace(args(&["--skip-bad", "--threshold", "0.9"])).await;
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("threshold 0.5, not 0.9"), "{}", text(&o));

    // Resuming: nothing is judged twice; a removed row is judged again.
    let o = retrace(args(&["--skip-bad"])).await;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(rows_of(&predictions).len(), rows.len());
    let all = std::fs::read_to_string(&predictions).unwrap();
    let kept: Vec<&str> = all.lines().skip(1).collect();
    std::fs::write(&predictions, kept.join("\n") + "\n").unwrap();
    let o = retrace(args(&["--skip-bad"])).await;
    assert!(o.status.success(), "{}", text(&o));
    let again = rows_of(&predictions);
    assert_eq!(again.len(), rows.len());
    let mut a: Vec<_> = again.iter().map(Row::key).collect();
    let mut b: Vec<_> = rows.iter().map(Row::key).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);

    // Calibrate on one split, test on another; the printed threshold is the library's choice.
    let cal_out = dir.0.join("cal");
    let o = retrace(
        [
            "calibrate",
            "--server",
            &server.addr.to_string(),
            "--calibrate-on",
            &cs.display().to_string(),
            "--test-on",
            &gsm.display().to_string(),
            "--limit",
            "5",
            "--skip-bad",
            "--per-split",
            "--target-agreement",
            "0.9",
            "--out",
            &cal_out.display().to_string(),
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("threshold = "))
        .unwrap_or_else(|| panic!("no config line: {}", text(&o)));
    let printed: f32 = line["threshold = ".len()..].parse().unwrap();
    let cal_rows = rows_of(&cal_out.join("fake/calibration.jsonl"));
    assert_eq!(cal_rows.len(), 3);
    let choice = sweep(&cal_rows.iter().map(ScoredTrace::of).collect::<Vec<_>>()).best();
    assert_eq!(printed, choice.threshold);
    // Fake scores are 0.1 (a "wrong" step) and 0.9: any t in (0.1, 0.9] is perfect on cs.jsonl.
    assert_eq!(choice.f1, 100.0);
    assert!(printed > 0.1 && printed <= 0.9, "{printed}");
    assert_eq!(rows_of(&cal_out.join("fake/test.jsonl")).len(), 5);
    // Three calibration rows cannot hold 90% agreement at 90% (22 are the fewest): no
    // confidence threshold for either reading, and no config line for one.
    let guarantee = std::fs::read_to_string(cal_out.join("fake/guarantee.txt")).unwrap();
    assert!(stdout.contains(&guarantee), "{stdout}");
    for kind in ["verdict", "margin"] {
        let row = guarantee.lines().find(|l| l.starts_with(kind)).unwrap();
        assert!(row.contains("none") && row.contains("0/3"), "{guarantee}");
    }
    assert!(!guarantee.contains("target_agreement = "), "{guarantee}");
    // The same choice as JSON, for scripts: no threshold, none kept, five test rows.
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(cal_out.join("fake/guarantee.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json["target_agreement"], 0.9);
    let ways = json["ways"].as_array().unwrap();
    assert_eq!(ways.len(), 2);
    for w in ways {
        assert!(w["threshold"].is_null(), "{w}");
        assert_eq!(
            (w["calibration_rows"].as_u64(), w["kept"].as_u64()),
            (Some(3), Some(0))
        );
        assert_eq!(w["test"]["rows"], 5, "{w}");
        assert_eq!(w["test"]["kept"], 0, "{w}");
    }
    assert!(
        std::fs::read_to_string(cal_out.join("fake/report.html"))
            .unwrap()
            .contains("<svg")
    );

    // The same file on both sides is refused.
    let o = retrace(
        [
            "calibrate",
            "--server",
            &server.addr.to_string(),
            "--calibrate-on",
            &gsm.display().to_string(),
            "--test-on",
            &gsm.display().to_string(),
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("apart"),
        "{}",
        text(&o)
    );
    server.stop().await.unwrap();
}

/// `retrace serve` with the committed tiny chat-lm PRM as a child process, then `retrace eval`
/// and `retrace calibrate` against it on a ProcessBench sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_against_retrace_serve_with_a_real_tiny_prm() {
    let dir = TempDir::new("prm");
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/chat-lm");
    let (grpc, metrics, http) = (free_port(), free_port(), free_port());
    let cfg = dir.0.join("retrace.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\ngrpc_addr = \"127.0.0.1:{grpc}\"\nmetrics_addr = \"127.0.0.1:{metrics}\"\n\
             http_addr = \"127.0.0.1:{http}\"\n\n\
             [[evaluator]]\nname = \"tiny\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = {:?}\nthreshold = 0.5\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    let log = dir.0.join("serve.log");
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_retrace"))
            .args(["serve", "--config", &cfg.display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start retrace serve"),
    );
    // Wait for SERVING; a server that exits (a PRM that fails to load) fails the test at once.
    let addr = format!("127.0.0.1:{grpc}");
    let url = format!("http://{addr}");
    let mut serving = false;
    for _ in 0..1200 {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!(
                "retrace serve exited ({status}) before serving:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        if let Ok(ch) = tonic::transport::Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
        {
            let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
            let r = h
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await;
            if r.is_ok_and(|r| r.into_inner().status == 1) {
                serving = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(serving, "retrace serve never became SERVING");

    let out = dir.0.join("out");
    let (gsm, math) = (processbench("gsm8k"), processbench("math"));
    let o = retrace(
        [
            "eval",
            "--server",
            &addr,
            "--data",
            &gsm.display().to_string(),
            &math.display().to_string(),
            "--limit",
            "4",
            "--out",
            &out.display().to_string(),
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    let rows = rows_of(&out.join("predictions.jsonl"));
    assert_eq!(rows.len(), 8);
    let steps: HashMap<(String, String), usize> = [&gsm, &math]
        .iter()
        .flat_map(|f| read_records(f).unwrap().take(4).flatten())
        .map(|r| ((r.split, r.id), r.steps.len()))
        .collect();
    // The tiny model's context is 2048 tokens: a longer trace is refused (INVALID_ARGUMENT), and
    // such a failed request is a wrong prediction.
    let (failed, judged): (Vec<&Row>, Vec<&Row>) = rows.iter().partition(|r| r.error.is_some());
    assert!(judged.len() >= 4, "most of the sample fits: {rows:?}");
    for row in &failed {
        let e = row.error.as_deref().unwrap();
        assert!(
            e.starts_with("InvalidArgument") && e.contains("context"),
            "{e}"
        );
        assert_eq!((row.prediction, row.matched), (None, false));
    }
    for row in judged {
        assert_eq!(row.evaluator, "tiny");
        assert_eq!(row.step_scores.len(), steps[&row.key()]);
        assert!(
            row.step_scores.iter().all(|s| (0.0..=1.0).contains(s)),
            "{row:?}"
        );
        // The server's verdict is the PRM rule applied to the scores it returned.
        assert_eq!(row.prediction, Some(first_below(&row.step_scores, 0.5)));
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["failed"].as_u64(), Some(failed.len() as u64));
    let recomputed = Summary::of(
        rows.iter()
            .map(|r| (r.split.as_str(), r.label, r.prediction)),
    );
    assert_eq!(recomputed.splits.len(), 2);
    let f1 = summary["summary"]["average"]["f1"].as_f64();
    assert_eq!(
        f1.map(|f| (f * 1e9).round()),
        recomputed.average.f1.map(|f| (f * 1e9).round())
    );
    assert!(
        std::fs::read_to_string(out.join("report.html"))
            .unwrap()
            .contains("<svg")
    );

    let cal = dir.0.join("cal");
    let o = retrace(
        [
            "calibrate",
            "--server",
            &addr,
            "--calibrate-on",
            &gsm.display().to_string(),
            "--test-on",
            &math.display().to_string(),
            "--limit",
            "4",
            "--out",
            &cal.display().to_string(),
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let t: f32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("threshold = "))
        .expect("a config line")
        .parse()
        .unwrap();
    assert!((0.0..=1.0).contains(&t));
    let cal_rows = rows_of(&cal.join("tiny/calibration.jsonl"));
    let best = sweep(&cal_rows.iter().map(ScoredTrace::of).collect::<Vec<_>>()).best();
    assert_eq!(best.threshold, t);
    drop(child);
}

/// `eval --config`: the evaluators run in this process (the engine with the real loader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_in_process_from_a_config() {
    let dir = TempDir::new("local");
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/chat-lm");
    let cfg = dir.0.join("retrace.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[evaluator]]\nname = \"tiny\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = {:?}\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    let out = dir.0.join("out");
    let opts = retrace_cli::EvalOptions {
        data: vec![processbench("gsm8k")],
        evaluator: None,
        threshold: Some(0.25),
        out: out.clone(),
        connect: retrace_cli::ConnectOptions {
            server: None,
            config: Some(cfg),
            set: vec![],
            concurrency: 4,
            limit: Some(3),
            skip_bad: false,
            token_env: None,
            ca_cert: None,
            wait_s: 0.0,
            no_progress: true,
        },
    };
    let outcome = retrace_cli::eval(opts.clone())
        .await
        .expect("eval runs in-process");
    assert_eq!(outcome.stats.judged, 3);
    assert_eq!(outcome.analysis.rows, 3);
    let rows = rows_of(&outcome.predictions);
    for row in &rows {
        assert_eq!(row.error, None, "{row:?}");
        assert_eq!(
            (row.evaluator.as_str(), row.threshold),
            ("tiny", Some(0.25))
        );
        assert_eq!(row.prediction, Some(first_below(&row.step_scores, 0.25)));
    }
    // A rerun resumes: everything is already there.
    let again = retrace_cli::eval(opts).await.unwrap();
    assert_eq!((again.stats.judged, again.stats.already_done), (0, 3));
    assert_eq!(rows_of(&out.join("predictions.jsonl")), rows);
}
