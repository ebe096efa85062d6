//! `retrace label` as a process, against a judge (three samples voting) whose upstream is an
//! OpenAI-compatible fake in this test: rows carry the verdict and the vote, a failed row is
//! listed and then filled by a rerun, `--min-agreement` holds rows back, and `retrace eval`
//! reads the output back.

use crate::common::TestServer;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use retrace::Config;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The fake judge's rules, read from the prompt: the first paragraph saying "wrong" is the first
/// error (a hallucination when it says "false", else reasoning); a trace saying "SPLIT" gets one
/// dissenting sample of its `n`; one saying "FAILS" gets HTTP 500 while `failing` is set.
#[derive(Default)]
struct Judge {
    failing: AtomicBool,
    requests: AtomicUsize,
    prompts: Mutex<Vec<String>>,
}

fn verdict_of(prompt: &str) -> String {
    let paragraphs: Vec<&str> = (0..)
        .map_while(|i| {
            let open = format!("<paragraph_{i}>\n");
            let start = prompt.find(&open)? + open.len();
            let end = prompt[start..].find(&format!("</paragraph_{i}>"))? + start;
            Some(&prompt[start..end])
        })
        .collect();
    match paragraphs.iter().position(|p| p.contains("wrong")) {
        None => "All paragraphs hold.\n\\boxed{-1}\nCategory: None".into(),
        Some(i) if paragraphs[i].contains("false") => {
            format!("Paragraph {i} states a false fact.\n\\boxed{{{i}}}\nCategory: Hallucination")
        }
        Some(i) => format!("Paragraph {i} does not follow.\n\\boxed{{{i}}}\nCategory: Reasoning"),
    }
}

async fn chat(State(judge): State<Arc<Judge>>, body: Bytes) -> Response {
    judge.requests.fetch_add(1, Ordering::SeqCst);
    let body: Value = serde_json::from_slice(&body).unwrap();
    let prompt = body["messages"][0]["content"].as_str().unwrap().to_string();
    let n = body["n"].as_u64().unwrap_or(1) as usize;
    judge.prompts.lock().unwrap().push(prompt.clone());
    if prompt.contains("FAILS") && judge.failing.load(Ordering::SeqCst) {
        let error = json!({"error": {"message": "upstream exploded", "code": 500}});
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    let mut contents = vec![verdict_of(&prompt); n];
    if prompt.contains("SPLIT") {
        contents[n - 1] = "I disagree.\n\\boxed{-1}\nCategory: None".into();
    }
    let choices: Vec<Value> = contents
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": c}}))
        .collect();
    let reply = json!({"choices": choices, "usage": {"prompt_tokens": 10, "completion_tokens": 5}});
    ([("content-type", "application/json")], reply.to_string()).into_response()
}

async fn start_judge() -> (Arc<Judge>, String) {
    let judge = Arc::new(Judge::default());
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(chat))
        .with_state(judge.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (judge, url)
}

/// A judge voting over three samples, retrying nothing (a 500 fails its row at once).
fn judge_config(base_url: &str) -> String {
    format!(
        "[[evaluator]]\nname = \"voter\"\nkind = \"judge\"\nbase_url = \"{base_url}\"\n\
         model = \"fake\"\noutput = \"text\"\nsamples = 3\ntemperature = 0.8\nretries = 0\n"
    )
}

/// StrategyQA-style rows: two with a human label, one dissenting vote, one failing while the
/// upstream fails, one given as text without an id.
fn strategyqa(dir: &Path) -> PathBuf {
    let rows = [
        json!({"id": "s1", "question": "Did Aristotle use a laptop?", "steps": ["Aristotle lived in ancient Greece.", "Laptops came in the 20th century.", "So no."], "label": -1, "category": "none", "facts": ["Aristotle died in 322 BC."], "final_answer_correct": true, "generator": "g"}),
        json!({"id": "s2", "question": "Could a llama birth twice during War in Vietnam (1945-46)?", "steps": ["The war lasted about a year.", "A llama's gestation is one month, a false and wrong claim.", "So yes."], "label": 1}),
        json!({"id": "s3", "question": "Is it common to see frost during some college commencements?", "steps": ["Some commencements are in December. SPLIT", "December is summer everywhere, so this is wrong.", "So no."]}),
        json!({"id": "s4", "question": "Would a pear sink in water?", "steps": ["Pears are less dense than water. FAILS", "So it floats: no."]}),
        json!({"question": "Are more people today related to Genghis Khan than Julius Caesar?", "text": "Genghis Khan has many descendants.\n\nSo yes."}),
    ];
    let path = dir.join("sqa.jsonl");
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

async fn retrace(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_retrace"))
            .args(&args)
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

/// The rows of a JSONL file by id.
fn rows(path: &Path) -> HashMap<String, Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["id"].as_str().unwrap().to_string(), v))
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-it-label-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn args(words: &[&str], paths: &[&Path]) -> Vec<String> {
    let mut a: Vec<String> = words.iter().map(|s| s.to_string()).collect();
    a.extend(paths.iter().map(|p| p.display().to_string()));
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_writes_voted_rows_retries_failures_and_eval_reads_them() {
    let (judge, url) = start_judge().await;
    judge.failing.store(true, Ordering::SeqCst);
    let config = Config::parse(&judge_config(&url), "label test", &[]).unwrap();
    let server = TestServer::start(config, retrace::default_loader()).await;
    server.ready().await;
    let dir = temp_dir("server");
    let (data, out) = (strategyqa(&dir), dir.join("labels.jsonl"));
    let addr = server.addr.to_string();
    let label = |extra: &[&str]| {
        let mut a = args(
            &["label", "--server", &addr, "--no-progress", "--data"],
            &[&data],
        );
        a.extend(args(&["--out"], &[&out]));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // The failing row is listed (sidecar and summary) and the run exits non-zero; the rest is
    // written with its verdict and its vote.
    let o = retrace(label(&[])).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("failed 1 rows") && stdout.contains("sqa/s4:"),
        "{}",
        text(&o)
    );
    let failed = rows(&dir.join("labels.failed.jsonl"));
    assert!(
        failed["s4"]["error"]
            .as_str()
            .unwrap()
            .contains("upstream exploded"),
        "{failed:?}"
    );
    let got = rows(&out);
    assert_eq!(got.len(), 4, "{got:?}");
    let s1 = &got["s1"];
    assert_eq!(
        (&s1["label"], &s1["category"]),
        (&json!(-1), &json!("none"))
    );
    assert_eq!(
        (&s1["source_label"], &s1["source_category"]),
        (&json!(-1), &json!("none"))
    );
    assert_eq!(
        s1["facts"],
        json!(["Aristotle died in 322 BC."]),
        "input fields are kept"
    );
    assert_eq!(
        (&s1["generator"], &s1["final_answer_correct"]),
        (&json!("g"), &json!(true))
    );
    assert_eq!(
        (&s1["labelled_by"], &s1["agreement"]),
        (&json!("voter"), &json!(1.0))
    );
    let s2 = &got["s2"];
    assert_eq!(
        (&s2["label"], &s2["category"]),
        (&json!(1), &json!("hallucination"))
    );
    assert!(
        s2["rationale"].as_str().unwrap().contains("false fact"),
        "{s2}"
    );
    let s3 = &got["s3"];
    assert_eq!(
        (&s3["label"], &s3["category"]),
        (&json!(1), &json!("reasoning"))
    );
    assert_eq!(
        s3["agreement"],
        json!(0.6666667),
        "two of three samples: {s3}"
    );
    assert!(s3.get("source_label").is_none(), "{s3}");
    let text_row = &got["sqa-4"];
    assert_eq!(
        text_row["steps"],
        json!(["Genghis Khan has many descendants.", "So yes."])
    );
    assert_eq!(text_row["dataset"], "sqa");
    // Every question here is an open one: the judge got the open wording.
    let prompts = judge.prompts.lock().unwrap().clone();
    assert!(
        prompts
            .iter()
            .all(|p| p.contains("world knowledge, commonsense or science"))
    );

    // The rerun judges only the failed row, and fills it.
    judge.failing.store(false, Ordering::SeqCst);
    let before = judge.requests.load(Ordering::SeqCst);
    let o = retrace(label(&[])).await;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        judge.requests.load(Ordering::SeqCst),
        before + 1,
        "only s4 again"
    );
    let got = rows(&out);
    assert_eq!((got.len(), &got["s4"]["label"]), (5, &json!(-1)));
    assert!(rows(&dir.join("labels.failed.jsonl")).is_empty());

    // A bar the split vote misses: s3 moves to the held-back file, nothing is judged again.
    let before = judge.requests.load(Ordering::SeqCst);
    let o = retrace(label(&["--min-agreement", "0.9"])).await;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(judge.requests.load(Ordering::SeqCst), before);
    let got = rows(&out);
    assert_eq!(got.len(), 4);
    assert!(!got.contains_key("s3"));
    assert!(rows(&dir.join("labels.below-agreement.jsonl")).contains_key("s3"));

    // `eval` reads the labels back, and the same judge agrees with itself: F1 100.
    let eval_out = dir.join("eval");
    let o = retrace(
        args(
            &["eval", "--server", &addr, "--no-progress", "--data"],
            &[&out],
        )
        .into_iter()
        .chain(args(&["--out"], &[&eval_out]))
        .collect(),
    )
    .await;
    assert!(o.status.success(), "{}", text(&o));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(eval_out.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(
        summary["summary"]["average"]["f1"],
        json!(100.0),
        "{summary}"
    );
    server.stop().await.unwrap();
}

/// In-process from a config, from scratch with a bar: the split vote is held back as it is
/// labelled, and a rerun labels nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_agreement_holds_back_split_votes_from_a_local_config() {
    let (judge, url) = start_judge().await;
    let dir = temp_dir("local");
    let config = dir.join("judge.toml");
    std::fs::write(&config, judge_config(&url)).unwrap();
    let (data, out) = (strategyqa(&dir), dir.join("agreed.jsonl"));
    let label = args(&["label", "--config"], &[&config])
        .into_iter()
        .chain(args(
            &["--no-progress", "--min-agreement", "0.9", "--data"],
            &[&data],
        ))
        .chain(args(&["--out"], &[&out]))
        .collect::<Vec<_>>();
    let o = retrace(label.clone()).await;
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("held back 1 rows below --min-agreement 0.9"),
        "{}",
        text(&o)
    );
    let got = rows(&out);
    assert_eq!(got.len(), 4);
    assert!(
        got.values().all(|r| r["agreement"] == json!(1.0)),
        "{got:?}"
    );
    let held = rows(&dir.join("agreed.below-agreement.jsonl"));
    assert_eq!(held.keys().collect::<Vec<_>>(), ["s3"]);
    let before = judge.requests.load(Ordering::SeqCst);
    let o = retrace(label).await;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        judge.requests.load(Ordering::SeqCst),
        before,
        "nothing labelled twice"
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("5 already labelled"),
        "{}",
        text(&o)
    );
}
