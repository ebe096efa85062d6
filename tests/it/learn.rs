//! The cascade that learns, on a real server: a cascade records what its judge (a fake upstream)
//! decided, as dataset rows, while a load runs; its head is replaced on disk and reloaded
//! (the Reload call), then a broken head is refused; no request fails and the bad head never
//! serves. And `scripts/learn/distill.py` closing the loop. Each test names its evaluators apart:
//! the metrics are the process's.

use crate::common::upstream::{Fault, Upstream, reply};
use crate::common::{TestServer, request, sample};
use crate::head::{copy_base, temp, weights, write_config, write_weights};
use retrace::{Config, pb};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tonic::Code;

const GOOD: &str =
    "Paragraph 0 is right. Paragraph 1 claims a false fact.\n\\boxed{1}\nCategory: Hallucination";

/// A head folder over the tiny base (copied into it), with `threshold`; `retrained` gives its
/// step weights the other sign, so its scores are not the first head's.
pub(crate) fn head_folder(dir: &Path, threshold: f64, retrained: bool) {
    let base = dir.join("base");
    copy_base(&base);
    let sum = retrace_model::checkpoint_sha256(&base).unwrap();
    let mut w = weights(64);
    if retrained {
        let step = w.iter_mut().find(|t| t.0 == "step.weight").unwrap();
        step.2.iter_mut().for_each(|v| *v = -*v);
    }
    write_weights(dir, &w);
    write_config(dir, "base", &sum, threshold);
}

/// Each load call's deadline: a request never answered fails the test instead of hanging it.
pub(crate) const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// The step scores `evaluator` gives the probe trace.
async fn scores(s: &TestServer, evaluator: &str) -> Vec<f32> {
    let mut c = s.client().await;
    let mut req = tonic::Request::new(request("probe", evaluator, trace(7)));
    req.set_timeout(CALL_DEADLINE);
    let got = c.evaluate(req).await.unwrap().into_inner();
    got.steps.iter().map(|s| s.score).collect()
}

/// `dir` replaced by `new` in two renames, as `train-head --force` swaps its output.
fn replace(dir: &Path, new: &Path) {
    let old = dir.with_extension("old");
    std::fs::rename(dir, &old).unwrap();
    std::fs::rename(new, dir).unwrap();
    std::fs::remove_dir_all(old).unwrap();
}

fn trace(i: usize) -> pb::Trace {
    let steps = vec![
        format!("{i} + 3 = {}.", i + 3),
        "It is even.".into(),
        "So it is.".into(),
    ];
    pb::Trace {
        question: format!("What is {i} + 3?"),
        steps,
        ..Default::default()
    }
}

async fn threshold(s: &TestServer, name: &str) -> f32 {
    let mut c = s.client().await;
    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap();
    let info = list.get_ref().evaluators.iter().find(|e| e.name == name);
    info.unwrap().threshold
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascade_records_and_its_head_is_swapped_under_load_without_a_failed_request() {
    let dir = temp("learn");
    let head = dir.join("head");
    head_folder(&head, 0.25, false);
    let first = retrace_model::checkpoint_sha256(&head).unwrap();
    // The retrained head, served beside from the start: what the swapped head must then give.
    let retrained = dir.join("retrained");
    head_folder(&retrained, 0.75, true);
    let base_sum = retrace_model::checkpoint_sha256(&head.join("base")).unwrap();
    let up = Upstream::start(reply(GOOD)).await;
    let record = dir.join("rows").join("verdicts.jsonl");
    let text = format!(
        "[[evaluator]]\nname = \"learner\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n\n\
         [[evaluator]]\nname = \"j\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\n\n[[evaluator]]\nname = \"c\"\nkind = \"cascade\"\nprm = \"learner\"\n\
         judge = \"j\"\nescalate_margin = 1.0\nrecord = {:?}\n\n[[evaluator]]\n\
         name = \"retrained\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n",
        head.display().to_string(),
        up.base_url(),
        record.display().to_string(),
        retrained.display().to_string(),
    );
    let config = Config::parse(&text, "test config", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    assert_eq!(threshold(&s, "c").await, 0.25);
    let (old_scores, new_scores) = (scores(&s, "learner").await, scores(&s, "retrained").await);
    assert_ne!(old_scores, new_scores, "the two heads must score apart");

    // The load: two callers on the cascade, one on the head, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let judged = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for (k, evaluator) in ["c", "c", "learner"].into_iter().enumerate() {
        let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
        let judged = judged.clone();
        let mut client = s.client().await;
        callers.push(tokio::spawn(async move {
            let mut i = k * 1000;
            while !stop.load(Ordering::Relaxed) {
                let mut req = tonic::Request::new(request(&i.to_string(), evaluator, trace(i)));
                req.set_timeout(CALL_DEADLINE);
                let r = client.evaluate(req).await;
                sent.fetch_add(1, Ordering::SeqCst);
                match r {
                    Ok(_) if evaluator == "c" => _ = judged.fetch_add(1, Ordering::SeqCst),
                    Ok(_) => {}
                    Err(e) => {
                        eprintln!("{evaluator} {i}: {e:?}");
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                }
                i += 1;
            }
        }));
    }
    let until_sent = |n: usize| {
        let sent = sent.clone();
        async move {
            while sent.load(Ordering::SeqCst) < n {
                tokio::task::yield_now().await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), until_sent(10))
        .await
        .unwrap();

    // A retrained head, put in place and reloaded while the load runs.
    let new = dir.join("head.new");
    head_folder(&new, 0.75, true);
    let second = retrace_model::checkpoint_sha256(&new).unwrap();
    replace(&head, &new);
    let mut admin = s.client().await;
    let reload = || pb::ReloadRequest {
        evaluator: "learner".into(),
    };
    let swapped = admin.reload(reload()).await.unwrap().into_inner();
    assert_eq!(swapped.evaluator, "learner");
    assert_eq!(threshold(&s, "learner").await, 0.75);
    assert_eq!(
        threshold(&s, "c").await,
        0.75,
        "the cascade follows its head's swap"
    );
    // The weights were swapped, not the threshold alone: the head now scores as the retrained
    // one does.
    assert_eq!(scores(&s, "learner").await, new_scores);
    let after = sent.load(Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(60), until_sent(after + 10))
        .await
        .unwrap();

    // A broken head (its base's checksum is not the base's) is refused; the last one serves on.
    let bad = dir.join("head.bad");
    head_folder(&bad, 0.5, false);
    write_config(&bad, "base", &"0".repeat(64), 0.5);
    replace(&head, &bad);
    let refused = admin.reload(reload()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("checksum"),
        "{}",
        refused.message()
    );
    assert_eq!(threshold(&s, "learner").await, 0.75);
    let cascade = pb::ReloadRequest {
        evaluator: "c".into(),
    };
    let not_prm = admin.reload(cascade).await.unwrap_err();
    assert_eq!(not_prm.code(), Code::InvalidArgument);
    let after = sent.load(Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(60), until_sent(after + 10))
        .await
        .unwrap();

    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "of {}",
        sent.load(Ordering::SeqCst)
    );
    // Every cascade answer escalated (margin 1), so each becomes a row, counted once written.
    let judged = judged.load(Ordering::SeqCst) as f64;
    let written = [("evaluator", "c"), ("outcome", "written")];
    let within = Duration::from_secs(10);
    let metrics = s
        .until_sample("retrace_recorded_total", &written, judged, within)
        .await;
    let reloads = |outcome| {
        sample(
            &metrics,
            "retrace_reloads_total",
            &[("evaluator", "learner"), ("outcome", outcome)],
        )
    };
    assert_eq!(
        (reloads("swapped"), reloads("refused")),
        (Some(1.0), Some(1.0))
    );
    // The head serving is 1, the one it replaced 0; the refused one never served.
    let info = |head: &str| {
        let labels = [
            ("evaluator", "learner"),
            ("head_sha256", head),
            ("base_sha256", base_sum.as_str()),
        ];
        sample(&metrics, "retrace_head_info", &labels)
    };
    assert_eq!((info(&first), info(&second)), (Some(0.0), Some(1.0)));
    s.stop().await.unwrap();

    // The rows are what the tools read.
    let rows = retrace_cli::read_records(&record).unwrap();
    let rows: Vec<_> = rows.map(Result::unwrap).collect();
    assert!(rows.len() >= 20, "{} rows", rows.len());
    assert_eq!(rows.len() as f64, judged);
    for r in &rows {
        assert_eq!(r.label, Some(1));
        assert_eq!(r.category, Some(retrace::ErrorCategory::Hallucination));
        assert_eq!(r.steps.len(), 3);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An oracle judge: a trace whose second step says "odd" is wrong there, any other holds.
pub(crate) fn oracle(body: &serde_json::Value) -> String {
    match body.to_string().contains("It is odd.") {
        true => "Paragraph 1 is false.\n\\boxed{1}\nCategory: Reasoning".into(),
        false => "All paragraphs hold.\n\\boxed{-1}\nCategory: None".into(),
    }
}

pub(crate) fn parity_trace(i: usize) -> pb::Trace {
    let parity = if i.is_multiple_of(2) {
        "It is even."
    } else {
        "It is odd."
    };
    let steps = vec![
        format!("{i} + 2 = {}.", i + 2),
        parity.into(),
        "So it is.".into(),
    ];
    pb::Trace {
        question: format!("Is {i} + 2 even?"),
        steps,
        ..Default::default()
    }
}

/// The head the loop tests start from, in `dir/head`, over the tiny base copied beside it (a
/// swap moves the head's folder aside, so its base lies outside it).
fn loop_head(dir: &Path) -> std::path::PathBuf {
    let base = dir.join("base");
    copy_base(&base);
    let sum = retrace_model::checkpoint_sha256(&base).unwrap();
    let head = dir.join("head");
    std::fs::create_dir_all(&head).unwrap();
    write_weights(&head, &weights(64));
    write_config(&head, base.to_str().unwrap(), &sum, 0.5);
    head
}

/// One round of `scripts/learn/distill.py` on `cascade` of the served `toml`, working in
/// `dir/work`: its first log entry, and what it printed. Panics if it failed.
fn distill_once(
    dir: &Path,
    toml: &Path,
    cascade: &str,
    s: &TestServer,
    dev_share: &str,
) -> (serde_json::Value, String) {
    let out = std::process::Command::new("python3")
        .current_dir(crate::common::REPO)
        .args(["-m", "scripts.learn.distill"])
        .args(["--config", toml.to_str().unwrap(), "--evaluator", cascade])
        .args(["--http", &format!("http://{}", s.http_addr)])
        .args(["--retrace", env!("CARGO_BIN_EXE_retrace"), "--once"])
        .args(["--dev-share", dev_share])
        .args(["--work", dir.join("work").to_str().unwrap()])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let log = std::fs::read_to_string(dir.join("work/distill.jsonl")).unwrap();
    let entry = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    (entry, said)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distill_retrains_the_head_from_recorded_rows_and_swaps_it_in() {
    let dir = temp("distill");
    let head = loop_head(&dir);
    let up = Upstream::start(Fault::By(oracle)).await;
    let text = format!(
        "[[evaluator]]\nname = \"dhead\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n\n\
         [[evaluator]]\nname = \"dj\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\n\n[[evaluator]]\nname = \"dc\"\nkind = \"cascade\"\nprm = \"dhead\"\n\
         judge = \"dj\"\nescalate_margin = 1.0\nrecord = {:?}\n",
        head.display().to_string(),
        up.base_url(),
        dir.join("rows/verdicts.jsonl").display().to_string(),
    );
    let toml = dir.join("retrace.toml");
    std::fs::write(&toml, &text).unwrap();
    let config = Config::parse(&text, "test config", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    let mut client = s.client().await;
    const TRACES: usize = 60;
    for i in 0..TRACES {
        let r = client
            .evaluate(request(&i.to_string(), "dc", parity_trace(i)))
            .await;
        assert_eq!(
            r.unwrap().get_ref().path,
            pb::DecisionPath::Escalated as i32
        );
    }
    let written = [("evaluator", "dc"), ("outcome", "written")];
    s.until_sample(
        "retrace_recorded_total",
        &written,
        TRACES as f64,
        Duration::from_secs(10),
    )
    .await;

    let (entry, said) = distill_once(&dir, &toml, "dc", &s, "0.3");
    assert_eq!(entry["rows"], TRACES);
    let decision = entry["decision"].as_str().unwrap();
    assert!(decision.starts_with("swapped: dev f1"), "{said}");
    assert!(
        entry["candidate"].as_f64() >= entry["serving"].as_f64(),
        "{entry}"
    );
    // The candidate serves: its threshold, through the cascade too; the old head is kept aside.
    let trained: serde_json::Value =
        serde_json::from_slice(&std::fs::read(head.join("config.json")).unwrap()).unwrap();
    let want = trained["threshold"].as_f64().unwrap() as f32;
    assert_eq!(threshold(&s, "dc").await, want);
    assert!(
        dir.join("work/round-001/previous-head/head.safetensors")
            .is_file()
    );
    assert!(
        std::fs::read_to_string(dir.join("work/report.md"))
            .unwrap()
            .contains("swapped")
    );
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rows of `parity_trace(i)` for `range`, labelled as `oracle` judges them.
fn oracle_rows(range: std::ops::Range<usize>) -> String {
    range
        .map(|i| {
            let t = parity_trace(i);
            let label = if i % 2 == 1 { 1 } else { -1 };
            serde_json::json!({"question": t.question, "steps": t.steps, "label": label})
                .to_string()
                + "\n"
        })
        .collect()
}

fn questions(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["question"].to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distill_swaps_a_guaranteed_cascades_head_by_coverage_and_its_calibration_travels() {
    let dir = temp("distill-guarantee");
    let head = loop_head(&dir);
    // The serving head's calibration rows live in its folder, so a candidate brings its own.
    std::fs::write(head.join("calibration.jsonl"), oracle_rows(1000..1030)).unwrap();
    let up = Upstream::start(Fault::By(oracle)).await;
    let text = format!(
        "[[evaluator]]\nname = \"ghead2\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n\n\
         [[evaluator]]\nname = \"gj2\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\n\n[[evaluator]]\nname = \"gc2\"\nkind = \"cascade\"\nprm = \"ghead2\"\n\
         judge = \"gj2\"\ntarget_agreement = 0.6\ntarget_confidence = 0.6\ncalibration = {:?}\n\
         record = {:?}\n",
        head.display().to_string(),
        up.base_url(),
        head.join("calibration.jsonl").display().to_string(),
        dir.join("rows/verdicts.jsonl").display().to_string(),
    );
    let toml = dir.join("retrace.toml");
    std::fs::write(&toml, &text).unwrap();
    let config = Config::parse(&text, "test config", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    let cascade = [("evaluator", "gc2")];
    s.until_sample(
        "retrace_cascade_calibration_rows",
        &cascade,
        30.0,
        Duration::from_secs(30),
    )
    .await;
    let mut client = s.client().await;
    let mut escalated = 0;
    for i in 0..100 {
        let r = client
            .evaluate(request(&i.to_string(), "gc2", parity_trace(i)))
            .await;
        escalated += usize::from(r.unwrap().get_ref().path == pb::DecisionPath::Escalated as i32);
    }
    let written = [("evaluator", "gc2"), ("outcome", "written")];
    s.until_sample(
        "retrace_recorded_total",
        &written,
        escalated as f64,
        Duration::from_secs(10),
    )
    .await;

    let (entry, _) = distill_once(&dir, &toml, "gc2", &s, "0.6");
    // Both heads calibrated on one set and measured on another, no question on both.
    let round = dir.join("work/round-001");
    let (cal, measure) = (
        questions(&round.join("calibration.jsonl")),
        questions(&round.join("measure.jsonl")),
    );
    assert!(!cal.is_empty() && !measure.is_empty(), "{entry}");
    assert!(cal.iter().all(|q| !measure.contains(q)));
    for who in ["serving", "candidate"] {
        let c = &entry["coverage"][who];
        assert_eq!(c["calibration_rows"], cal.len(), "{entry}");
        assert_eq!(c["measured_rows"], measure.len(), "{entry}");
    }
    // The candidate learnt the parity the oracle judges by, so it keeps more at the targets.
    let (serving, candidate) = (
        entry["coverage"]["serving"]["coverage"].as_f64().unwrap(),
        entry["coverage"]["candidate"]["coverage"].as_f64().unwrap(),
    );
    assert!(candidate > serving, "{entry}");
    let decision = entry["decision"].as_str().unwrap();
    assert!(decision.starts_with("swapped: coverage"), "{entry}");
    // Its calibration rows moved in with it, and the server chose on them what the loop did.
    assert_eq!(
        std::fs::read(head.join("calibration.jsonl")).unwrap(),
        std::fs::read(round.join("calibration.jsonl")).unwrap()
    );
    let metrics = s
        .until_sample(
            "retrace_cascade_calibration_rows",
            &cascade,
            cal.len() as f64,
            Duration::from_secs(30),
        )
        .await;
    let chosen = entry["coverage"]["candidate"]["threshold"]
        .as_f64()
        .unwrap();
    let served = sample(&metrics, "retrace_cascade_confidence_threshold", &cascade).unwrap();
    assert!(
        (served - chosen).abs() < 1e-9,
        "{served} served, {chosen} chosen"
    );
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_every_head_under_load_and_counts_the_swap() {
    let dir = temp("sighup");
    let head = dir.join("head");
    head_folder(&head, 0.25, false);
    let retrained = dir.join("retrained");
    head_folder(&retrained, 0.75, true);
    let toml = dir.join("retrace.toml");
    let text = format!(
        "[[evaluator]]\nname = \"hup\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n\n\
         [[evaluator]]\nname = \"hup-retrained\"\nkind = \"prm\"\nfamily = \"head\"\n\
         model = {:?}\n",
        head.display().to_string(),
        retrained.display().to_string(),
    );
    std::fs::write(&toml, text).unwrap();
    let (server, channel, metrics) =
        crate::common::spawn_retrace(&["--config".as_ref(), toml.as_os_str()], &[]).await;
    let client = pb::evaluator_client::EvaluatorClient::new(channel);
    let score = |evaluator: &'static str| {
        let mut c = client.clone();
        async move {
            let mut req = tonic::Request::new(request("probe", evaluator, trace(7)));
            req.set_timeout(CALL_DEADLINE);
            let got = c.evaluate(req).await.map(|r| r.into_inner());
            got.map(|r| r.steps.iter().map(|s| s.score).collect::<Vec<f32>>())
        }
    };
    let want = score("hup-retrained").await.unwrap();
    assert_ne!(score("hup").await.unwrap(), want);

    // A caller keeps the head busy through the swap; none of its calls may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, mut c) = (stop.clone(), client.clone());
        tokio::spawn(async move {
            let (mut sent, mut failed) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let mut req = tonic::Request::new(request(&sent.to_string(), "hup", trace(sent)));
                req.set_timeout(CALL_DEADLINE);
                if let Err(e) = c.evaluate(req).await {
                    failed.push(e);
                }
                sent += 1;
            }
            (sent, failed)
        })
    };
    let new = dir.join("head.new");
    head_folder(&new, 0.75, true);
    replace(&head, &new);
    let pid = nix::unistd::Pid::from_raw(server.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    // Every head is reloaded, the one with nothing new on disk too; each swap is counted.
    let swaps = || async {
        let metrics = crate::common::scrape(metrics).await;
        ["hup", "hup-retrained"].map(|e| {
            let labels = [("evaluator", e), ("outcome", "swapped")];
            crate::common::sample(&metrics, "retrace_reloads_total", &labels)
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while swaps().await != [Some(1.0), Some(1.0)] {
        assert!(std::time::Instant::now() < deadline, "{:?}", swaps().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(score("hup").await.unwrap(), want, "the new weights serve");
    stop.store(true, Ordering::Relaxed);
    let (sent, failed) = load.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert!(sent > 0);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
