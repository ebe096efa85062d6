//! The real model end to end: SmolLM2-135M-Instruct in f32 (converted by `scripts/fetch-smollm2.sh
//! --f32`) as the embedded `chat-lm` evaluator, over gRPC, from the `retrace` binary itself.

use crate::common;

use common::*;
use futures::StreamExt;
use retrace::pb;
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    id: String,
    question: String,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default)]
    reference_answer: Option<String>,
    steps: Vec<String>,
    scores: Vec<f64>,
}

#[derive(Deserialize)]
struct Bench {
    id: String,
    problem: String,
    steps: Vec<String>,
}

#[tokio::test]
async fn embedded_default_serves_smollm2_end_to_end() {
    let model = retrace::Env::process().cache_dir().join("smollm2");
    assert!(
        model.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch-smollm2.sh --f32",
        model.display()
    );
    // The embedded default serves the Q4_1 GGUF (tests/gguf.rs); the same model in f32, the
    // converted folder, must score as the float64 reference does.
    let folder = format!("evaluator.smollm2.model={}", model.display());
    let (mut server, channel, metrics) =
        spawn_retrace(&["--set".as_ref(), folder.as_ref()], &[]).await;
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel.clone());
    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let shown: Vec<_> = list
        .evaluators
        .iter()
        .map(|e| (e.name.as_str(), e.family.as_str(), e.ready, e.is_default))
        .collect();
    // The head trained on the GGUF is the default; chat-lm is served beside it.
    assert_eq!(
        shown,
        [
            ("smollm2-head", "head", true, true),
            ("smollm2", "chat-lm", true, false)
        ]
    );

    // Scores match the float64 numpy reference on the same weights.
    let path = format!(
        "{}/tests/fixtures/smollm2-expected.json",
        crate::common::REPO
    );
    let expected: Expected = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for case in &expected.cases {
        let trace = pb::Trace {
            question: case.question.clone(),
            options: case.options.clone(),
            steps: case.steps.clone(),
            reference_answer: case.reference_answer.clone().unwrap_or_default(),
            ..Default::default()
        };
        let r = c
            .evaluate(request(&case.id, "smollm2", trace))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.steps.len(), case.steps.len());
        for (got, want) in r.steps.iter().zip(&case.scores) {
            assert!(
                (got.score as f64 - want).abs() < 1e-4,
                "{}: {} vs {want}",
                case.id,
                got.score
            );
        }
    }

    // ProcessBench traces over the stream: one verdict per trace, one score per step.
    let data = std::fs::read_to_string(processbench("gsm8k")).unwrap();
    let bench: Vec<Bench> = serde_json::from_str(&data).unwrap();
    let sample: Vec<&Bench> = bench.iter().take(12).collect();
    let reqs: Vec<_> = sample
        .iter()
        .map(|b| {
            request(
                &b.id,
                "smollm2",
                steps_trace(
                    &b.problem,
                    &b.steps.iter().map(String::as_str).collect::<Vec<_>>(),
                ),
            )
        })
        .collect();
    let mut out = c
        .evaluate_stream(futures::stream::iter(reqs))
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(r) = out.next().await {
        let r = r.unwrap();
        assert!(r.error.is_none(), "{:?}", r.error);
        let b = sample.iter().find(|b| b.id == r.id).expect("known id");
        assert_eq!(r.steps.len(), b.steps.len());
        assert!(r.steps.iter().all(|s| (0.0..=1.0).contains(&s.score)));
        assert!(r.first_error_index >= -1 && r.first_error_index < b.steps.len() as i32);
        n += 1;
    }
    assert_eq!(n, sample.len());
    let text = scrape(metrics).await;
    assert!(
        sample_value(&text, "retrace_batch_size_count") >= 1.0,
        "{text}"
    );
    assert!(sample_value(&text, "retrace_tokens_scored_total") > 1000.0);

    // SIGTERM: drains and exits 0.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::task::spawn_blocking(move || server.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

fn sample_value(metrics: &str, name: &str) -> f64 {
    sample(metrics, name, &[("evaluator", "smollm2")]).unwrap_or(0.0)
}
