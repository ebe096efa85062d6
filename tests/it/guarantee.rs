//! A cascade that guarantees its agreement with its judge, on a real server over a tiny head
//! and a fake judge: calibration rows choose what the head keeps, too few of them escalate
//! everything, audits reach the judge off the request path, and audits that show drift turn
//! escalation back on until the cascade is calibrated again.

use crate::common::upstream::{Fault, Upstream};
use crate::common::{TestServer, request, sample};
use crate::head::temp;
use crate::learn::{CALL_DEADLINE, head_folder, oracle, parity_trace};
use retrace::{Config, pb};
use std::time::Duration;

/// The step scores and first error a PRM gives `trace`.
async fn verdict_of(s: &TestServer, evaluator: &str, trace: pb::Trace) -> (Vec<f32>, i32, i32) {
    let mut c = s.client().await;
    let mut req = tonic::Request::new(request("v", evaluator, trace));
    req.set_timeout(CALL_DEADLINE);
    let r = c.evaluate(req).await.unwrap().into_inner();
    let scores = r.steps.iter().map(|s| s.score).collect();
    (scores, r.first_error_index, r.path)
}

/// The probability of a verdict (the cascade's `confidence = "verdict"`), from its scores.
fn verdict_confidence(scores: &[f32], first: i32) -> f64 {
    let deciding = if first < 0 {
        scores.len()
    } else {
        first as usize + 1
    };
    (0..deciding)
        .map(|i| match i as i32 == first {
            true => 1.0 - f64::from(scores[i]),
            false => f64::from(scores[i]),
        })
        .product()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guaranteed_cascade_keeps_only_what_its_calibration_rows_vouch_for() {
    let dir = temp("guarantee");
    let head = dir.join("head");
    head_folder(&head, 0.5, false);
    // The head's own verdicts on the calibration traces, from a server of the head alone.
    const ROWS: usize = 80;
    let (prm, verdicts) = own_verdicts(&head, "ghead", 0..ROWS).await;
    let mut rows: Vec<(usize, f64, i32)> = verdicts
        .iter()
        .enumerate()
        .map(|(i, (scores, first))| (i, verdict_confidence(scores, *first), *first))
        .collect();
    // The judge agrees with the head on its surest 60% and never on the rest: the threshold
    // that holds 90% agreement keeps those, and at most the few disagreements below them that
    // the bound can absorb (one in 49 keeps it under 0.1, two in 50 do not).
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    let floor = rows[ROWS * 6 / 10 + 2].1;
    let mut labels = vec![0; ROWS];
    for (rank, &(i, _, first)) in rows.iter().enumerate() {
        labels[i] = if rank < ROWS * 6 / 10 {
            first
        } else {
            (first + 2) % 3 - 1
        };
    }
    let calibration = dir.join("calibration.jsonl");
    write_rows(&calibration, 0, &labels);

    let up = Upstream::start(Fault::By(oracle)).await;
    let extra = format!(
        "target_agreement = 0.9\ntarget_confidence = 0.9\ncalibration = {:?}",
        calibration.display().to_string()
    );
    let config = cascade_config(&prm, "ghead", "gc", &up, &extra);
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    let guaranteed = [("evaluator", "gc")];
    let metrics = s
        .until_sample(
            "retrace_cascade_guaranteed",
            &guaranteed,
            1.0,
            Duration::from_secs(30),
        )
        .await;
    let gauge = |name| sample(&metrics, name, &guaranteed).unwrap();
    assert_eq!(gauge("retrace_cascade_calibration_rows"), ROWS as f64);
    assert!(gauge("retrace_cascade_disagreement_bound") <= 0.1);
    let coverage = gauge("retrace_cascade_expected_coverage");
    assert!(coverage > 0.3 && coverage < 0.65, "coverage {coverage}");
    let threshold = gauge("retrace_cascade_confidence_threshold");
    assert!(
        threshold > floor,
        "{threshold} keeps three disagreements ({floor})"
    );

    // Fresh traces: the head decides alone exactly those whose confidence clears the threshold.
    let before = up.bodies().len();
    let (mut kept, mut escalated) = (0, 0);
    for i in ROWS..ROWS + 40 {
        let (scores, first, _) = verdict_of(&s, "ghead", parity_trace(i)).await;
        let (_, _, path) = verdict_of(&s, "gc", parity_trace(i)).await;
        match verdict_confidence(&scores, first) >= threshold - 1e-6 {
            true => {
                assert_eq!(path, pb::DecisionPath::Prm as i32, "trace {i}");
                kept += 1;
            }
            false => {
                assert_eq!(path, pb::DecisionPath::Escalated as i32, "trace {i}");
                escalated += 1;
            }
        }
    }
    assert!(
        kept > 0 && escalated > 0,
        "{kept} kept, {escalated} escalated"
    );
    assert_eq!(
        up.bodies().len() - before,
        escalated,
        "the judge saw each escalation once"
    );
    let list = s
        .client()
        .await
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await;
    let info = list.unwrap().into_inner().evaluators;
    let gc = info.iter().find(|e| e.name == "gc").unwrap();
    assert!(gc.family.contains("keeps confidence >="), "{}", gc.family);
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guaranteed_cascade_with_too_few_rows_escalates_everything_and_says_so() {
    let dir = temp("guarantee-few");
    let head = dir.join("head");
    head_folder(&head, 0.5, false);
    // Twenty rows: however they agree with the head, 22 are the fewest that can hold 90% at
    // 90%.
    let calibration = dir.join("calibration.jsonl");
    write_rows(&calibration, 0, &[-1; 20]);
    let up = Upstream::start(Fault::By(oracle)).await;
    let extra = format!(
        "target_agreement = 0.9\ncalibration = {:?}",
        calibration.display().to_string()
    );
    let config = cascade_config(&head_table("fhead", &head), "fhead", "fc", &up, &extra);
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    let labels = [("evaluator", "fc")];
    let metrics = s
        .until_sample(
            "retrace_cascade_calibration_rows",
            &labels,
            20.0,
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(
        sample(&metrics, "retrace_cascade_guaranteed", &labels),
        Some(0.0)
    );
    // No confidence threshold is in force, and the gauge says so rather than keeping the last
    // one chosen (as after a swap to a head that holds no threshold).
    let none = sample(&metrics, "retrace_cascade_confidence_threshold", &labels);
    assert!(none.is_some_and(f64::is_nan), "{none:?}");
    for i in 100..110 {
        let (_, _, path) = verdict_of(&s, "fc", parity_trace(i)).await;
        assert_eq!(path, pb::DecisionPath::Escalated as i32);
    }
    let list = s
        .client()
        .await
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await;
    let info = list.unwrap().into_inner().evaluators;
    let fc = info.iter().find(|e| e.name == "fc").unwrap();
    assert!(fc.family.contains("every trace escalates"), "{}", fc.family);
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The head's own verdicts (step scores, first error) on parity traces `range`, from a server
/// of the head alone; and its table, for the next config.
async fn own_verdicts(
    head: &std::path::Path,
    name: &str,
    range: std::ops::Range<usize>,
) -> (String, Vec<(Vec<f32>, i32)>) {
    let prm = head_table(name, head);
    let alone = Config::parse(&prm, "test config", &[]).unwrap();
    let s = TestServer::start(alone, retrace::default_loader()).await;
    s.ready().await;
    let mut verdicts = Vec::new();
    for i in range {
        let (scores, first, _) = verdict_of(&s, name, parity_trace(i)).await;
        verdicts.push((scores, first));
    }
    s.stop().await.unwrap();
    (prm, verdicts)
}

/// The first errors of `own_verdicts`.
fn firsts(verdicts: &[(Vec<f32>, i32)]) -> Vec<i32> {
    verdicts.iter().map(|(_, first)| *first).collect()
}

/// The `[[evaluator]]` table of the head folder `head`, named `name`.
fn head_table(name: &str, head: &std::path::Path) -> String {
    format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n",
        head.display().to_string()
    )
}

/// Calibration rows on parity traces `from..`, each labelled `labels[k]`.
fn write_rows(path: &std::path::Path, from: usize, labels: &[i32]) {
    let lines: Vec<String> = labels
        .iter()
        .enumerate()
        .map(|(k, label)| {
            let t = parity_trace(from + k);
            serde_json::json!({"question": t.question, "steps": t.steps, "label": label})
                .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// A cascade `name` over the head `prm` (its table) and a judge on `up`, with `extra` keys.
fn cascade_config(prm: &str, head: &str, name: &str, up: &Upstream, extra: &str) -> Config {
    let text = format!(
        "{prm}\n[[evaluator]]\nname = \"{name}-j\"\nkind = \"judge\"\nbase_url = \"{}\"\n\
         model = \"fake\"\noutput = \"text\"\nretries = 0\n\n[[evaluator]]\nname = \"{name}\"\n\
         kind = \"cascade\"\nprm = \"{head}\"\njudge = \"{name}-j\"\n{extra}\n",
        up.base_url(),
    );
    Config::parse(&text, "test config", &[]).unwrap()
}

/// A served cascade `name` over the head `head` (its table `prm`) and a judge on `up`, that
/// guarantees 0.9 on `rows` and audits every trace it keeps; once its threshold is chosen.
async fn audited(
    prm: &str,
    head: &str,
    name: &str,
    rows: &std::path::Path,
    up: &Upstream,
) -> TestServer {
    let extra = format!(
        "target_agreement = 0.9\ncalibration = {:?}\naudit_rate = 1.0\naudit_floor = 1.0\n\
         audit_per_second = 1000",
        rows.display().to_string()
    );
    let s = TestServer::start(
        cascade_config(prm, head, name, up, &extra),
        retrace::default_loader(),
    )
    .await;
    s.ready().await;
    let labels = [("evaluator", name)];
    s.until_sample(
        "retrace_cascade_guaranteed",
        &labels,
        1.0,
        Duration::from_secs(30),
    )
    .await;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audits_reach_the_judge_after_the_answer_never_before_it() {
    let dir = temp("audits");
    let head = dir.join("head");
    head_folder(&head, 0.5, false);
    // Rows that agree with the head throughout: it keeps every trace.
    let (prm, verdicts) = own_verdicts(&head, "ahead", 0..40).await;
    let firsts = firsts(&verdicts);
    let rows = dir.join("calibration.jsonl");
    write_rows(&rows, 0, &firsts);
    // A judge that takes 2 s: a call that waited on it would take as long.
    let slow = "All paragraphs hold.\n\\boxed{-1}\nCategory: None";
    let up = Upstream::start(Fault::Slow(Duration::from_secs(2), slow.into())).await;
    let s = audited(&prm, "ahead", "ac", &rows, &up).await;
    let labels = [("evaluator", "ac")];
    // Four callers, five traces each, at once.
    let callers: Vec<_> = (0..4)
        .map(|c| {
            let s_addr = s.addr;
            tokio::spawn(async move {
                let url = format!("http://{s_addr}");
                let channel = tonic::transport::Channel::from_shared(url)
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
                let mut client = pb::evaluator_client::EvaluatorClient::new(channel);
                let mut took = Vec::new();
                for k in 0..5 {
                    let started = std::time::Instant::now();
                    let mut req =
                        tonic::Request::new(request("a", "ac", parity_trace(200 + 5 * c + k)));
                    req.set_timeout(CALL_DEADLINE);
                    let r = client.evaluate(req).await.unwrap().into_inner();
                    assert_eq!(r.path, pb::DecisionPath::Prm as i32);
                    took.push(started.elapsed());
                }
                took
            })
        })
        .collect();
    for c in callers {
        for took in c.await.unwrap() {
            assert!(
                took < Duration::from_millis(1500),
                "a kept trace waited {took:?}"
            );
        }
    }
    // Every kept trace was drawn (the share is 1): audited, or over the cap of eight in flight.
    let outcome = |m: &str, o| {
        sample(
            m,
            "retrace_cascade_audits_total",
            &[("evaluator", "ac"), ("outcome", o)],
        )
        .unwrap_or(0.0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let m = s.scrape().await;
        let ended = ["agreed", "disagreed", "failed", "over_budget"]
            .iter()
            .map(|o| outcome(&m, o))
            .sum::<f64>();
        if ended == 20.0 {
            break m;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{ended} of 20 audits ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let judged = outcome(&metrics, "agreed") + outcome(&metrics, "disagreed");
    assert!(judged >= 8.0, "{judged} audits judged");
    assert_eq!(up.bodies().len() as f64, judged, "the judge saw each audit");
    assert_eq!(outcome(&metrics, "failed"), 0.0);
    let agreed = sample(&metrics, "retrace_cascade_audited_agreement", &labels).unwrap();
    let want = firsts.iter().filter(|f| **f == -1).count() as f64 / firsts.len() as f64;
    assert!(
        (0.0..=1.0).contains(&agreed),
        "{agreed} (the head says -1 on {want:.2} of rows)"
    );
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audits_that_show_drift_escalate_everything_until_it_is_calibrated_again() {
    let dir = temp("drift");
    let head = dir.join("head");
    head_folder(&head, 0.5, false);
    let (prm, verdicts) = own_verdicts(&head, "dhead2", 0..60).await;
    let firsts = firsts(&verdicts);
    let rows = dir.join("calibration.jsonl");
    write_rows(&rows, 0, &firsts);
    // The judge now names, on every trace, the verdict the head gives least often on the
    // calibration traces: the kept traces mostly disagree with it.
    let rarest = (-1..3)
        .min_by_key(|v| firsts.iter().filter(|f| *f == v).count())
        .unwrap();
    let reply = format!("The verdict.\n\\boxed{{{rarest}}}\nCategory: Reasoning");
    let up = Upstream::start(Fault::PerN(reply)).await;
    let s = audited(&prm, "dhead2", "dc2", &rows, &up).await;
    let labels = [("evaluator", "dc2")];
    // One at a time, so every kept trace is audited before the next.
    let mut paths = Vec::new();
    for i in 300..460 {
        paths.push(verdict_of(&s, "dc2", parity_trace(i)).await.2);
        if paths.last() == Some(&(pb::DecisionPath::Prm as i32)) {
            // Its audit is a fast judge's call, off this request's path: let it land.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let kept = paths
        .iter()
        .take_while(|p| **p == pb::DecisionPath::Prm as i32)
        .count();
    assert!(kept > 0 && kept < 40, "{kept} kept before the drift");
    let metrics = s.scrape().await;
    let recal = [("evaluator", "dc2"), ("reason", "drift")];
    assert_eq!(
        sample(&metrics, "retrace_cascade_recalibrations_total", &recal),
        Some(1.0)
    );
    // After the drift every trace was judged; 100 of them chose again.
    assert!(
        paths[kept..kept + 100]
            .iter()
            .all(|p| *p == pb::DecisionPath::Escalated as i32)
    );
    assert!(sample(&metrics, "retrace_cascade_audited_agreement_lower", &labels).unwrap() < 0.9);
    s.stop().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
