//! Judge and cascade evaluators against a real peer: llama.cpp's llama-server running
//! SmolLM2-135M-Instruct on 127.0.0.1 (with an API key), behind a real `retrace serve` process:
//! a user's own grammar through `extra_body`, the per-trace JSON schema and grammar, free text.
//! scripts/test.sh builds the server and fetches the model; nothing here is skipped.

use crate::common;

use common::{ChildGuard, request, sample, scrape, spawn_retrace};
use retrace::pb;
use std::path::PathBuf;
use tonic::Code;

const KEY: &str = "retrace-test-key";

/// Constrains SmolLM2 (far too small to follow the prompt's format on its own) to the verdict
/// lines, through `extra_body`, as a user would with any llama.cpp judge.
const GRAMMAR: &str = r#"root ::= "\\boxed{" ("-1" | [0-2]) "}\nCategory: " ("Misinterpretation" | "Hallucination" | "Reasoning" | "None")"#;

fn cache() -> PathBuf {
    retrace::Env::process().cache_dir()
}

/// llama-server with an API key and four slots (`n` up to 4 in one request; 1,024 tokens each).
async fn llama_server() -> (ChildGuard, u16) {
    common::llama::llama_server(&["-c", "4096", "-np", "4", "-t", "2", "--api-key", KEY]).await
}

fn config(port: u16) -> String {
    let judge = |name: &str, extra: &str| {
        format!(
            "[[evaluator]]\nname = \"{name}\"\nkind = \"judge\"\n\
             base_url = \"http://127.0.0.1:{port}/v1\"\nmodel = \"smollm2\"\n\
             api_key_env = \"RETRACE_TEST_JUDGE_KEY\"\ntimeout_s = 120\n{extra}\n"
        )
    };
    let grammar = format!("max_tokens = 32\nextra_body = {{ grammar = '''{GRAMMAR}''' }}");
    format!(
        "[[evaluator]]\nname = \"smollm2\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"{}\"\n\n{}{}{}{}{}{}\
         [[evaluator]]\nname = \"cascade\"\nkind = \"cascade\"\nprm = \"smollm2\"\njudge = \"judge\"\nescalate_margin = 1.0\n",
        cache().join("smollm2").display(),
        judge("judge", &grammar),
        judge(
            "vote",
            &format!("{grammar}\nsamples = 3\ntemperature = 0.9")
        ),
        judge(
            "free",
            "output = \"text\"\nmax_tokens = 96\ncache_entries = 0"
        ),
        judge(
            "schema",
            "upstream = \"llama.cpp\"\noutput = \"json_schema\"\nmax_tokens = 160"
        ),
        judge(
            "grammar",
            "upstream = \"llama.cpp\"\noutput = \"grammar\"\nmax_tokens = 160"
        ),
        judge("bad-key", "api_key_env = \"RETRACE_TEST_BAD_KEY\"")
            .replace("api_key_env = \"RETRACE_TEST_JUDGE_KEY\"\n", ""),
    )
}

fn trace() -> pb::Trace {
    pb::Trace {
        question: "Tom has 3 apples and buys 4 more. How many apples does he have?".into(),
        steps: vec![
            "Tom starts with 3 apples.".into(),
            "He buys 4 more, so he has 3 + 4 = 8 apples.".into(),
            "The answer is 8.".into(),
        ],
        ..Default::default()
    }
}

fn is_consistent(r: &pb::EvaluateResponse) -> bool {
    let none = r.category == pb::ErrorCategory::None as i32;
    (-1..3).contains(&r.first_error_index) && (r.first_error_index == -1) == none
}

#[tokio::test]
async fn judge_and_cascade_against_llama_server() {
    let (_llama, port) = llama_server().await;
    let dir = std::env::temp_dir().join(format!("retrace-judge-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("retrace.toml");
    std::fs::write(&path, config(port)).unwrap();
    let envs = [
        ("RETRACE_TEST_JUDGE_KEY", KEY),
        ("RETRACE_TEST_BAD_KEY", "wrong-key"),
    ];
    let (_retrace, channel, metrics) =
        spawn_retrace(&["--config".as_ref(), path.as_os_str()], &envs).await;
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel);
    let eval = |name: &str| request("t", name, trace());

    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let kinds: Vec<(&str, &str)> = list
        .evaluators
        .iter()
        .map(|e| (e.name.as_str(), e.kind.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("smollm2", "prm"),
            ("judge", "judge"),
            ("vote", "judge"),
            ("free", "judge"),
            ("schema", "judge"),
            ("grammar", "judge"),
            ("bad-key", "judge"),
            ("cascade", "cascade")
        ]
    );

    // One greedy sample, read from llama.cpp's real reply.
    let one = c.evaluate(eval("judge")).await.unwrap().into_inner();
    assert_eq!(one.path, pb::DecisionPath::Judge as i32);
    assert!(is_consistent(&one), "{one:?}");
    assert!(one.rationale.starts_with("\\boxed{"), "{}", one.rationale);
    let scores: Vec<f32> = one.steps.iter().map(|s| s.score).collect();
    let k = one.first_error_index;
    let want: Vec<f32> = (0..3)
        .map(|i| if k == -1 || i < k { 1.0 } else { 0.0 })
        .collect();
    assert_eq!(scores, want);

    // Voting: three samples in one request with n = 3.
    let voted = c.evaluate(eval("vote")).await.unwrap().into_inner();
    assert!(is_consistent(&voted), "{voted:?}");
    for s in &voted.steps {
        let thirds = s.score * 3.0;
        assert!(
            (thirds - thirds.round()).abs() < 1e-5,
            "score {} is not a vote share",
            s.score
        );
    }

    // Free text from a 135M model: a verdict if the reply (or its repair turn) was readable,
    // otherwise UNAVAILABLE, never a guess.
    match c.evaluate(eval("free")).await {
        Ok(r) => assert!(is_consistent(&r.get_ref().clone()), "{r:?}"),
        Err(s) => {
            assert_eq!(s.code(), Code::Unavailable, "{s:?}");
            assert!(
                s.message().contains("no readable verdict"),
                "{}",
                s.message()
            );
        }
    }

    // Constrained per trace by llama.cpp itself (a JSON schema, then a GBNF grammar): a verdict
    // in range every time, read from the reply or, when the budget cut the review short, from a
    // repair turn constrained to the verdict alone. Never an unreadable reply.
    for name in ["schema", "grammar"] {
        let r = c.evaluate(eval(name)).await.unwrap().into_inner();
        assert!(is_consistent(&r), "{name}: {r:?}");
    }

    // A wrong key: llama.cpp's 401, reported with its reason and not retried.
    let status = c.evaluate(eval("bad-key")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("HTTP 401: Invalid API Key"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("after 1 attempt(s)"),
        "{}",
        status.message()
    );

    // The cascade escalates (margin 1) and so answers with the judge's index over the PRM's
    // scores; the judge is greedy, so its index is the one seen above.
    let prm = c.evaluate(eval("smollm2")).await.unwrap().into_inner();
    let cascade = c.evaluate(eval("cascade")).await.unwrap().into_inner();
    assert_eq!(cascade.path, pb::DecisionPath::Escalated as i32);
    assert_eq!(cascade.first_error_index, one.first_error_index);
    let scores = |r: &pb::EvaluateResponse| r.steps.iter().map(|s| s.score).collect::<Vec<_>>();
    assert_eq!(scores(&cascade), scores(&prm));

    let m = scrape(metrics).await;
    let requests = |judge, outcome| {
        sample(
            &m,
            "retrace_judge_requests_total",
            &[("judge", judge), ("outcome", outcome)],
        )
    };
    assert_eq!(
        requests("judge", "ok"),
        Some(1.0),
        "the cascade's call was a cache hit"
    );
    assert_eq!(requests("vote", "ok"), Some(3.0));
    assert_eq!(requests("schema", "ok"), Some(1.0));
    assert_eq!(requests("grammar", "ok"), Some(1.0));
    assert_eq!(requests("bad-key", "http_4xx"), Some(1.0));
    let prompt_tokens = sample(
        &m,
        "retrace_judge_tokens_total",
        &[("judge", "judge"), ("kind", "prompt")],
    );
    assert!(
        prompt_tokens.is_some_and(|t| t > 100.0),
        "{prompt_tokens:?}"
    );
    assert_eq!(
        sample(
            &m,
            "retrace_cascade_total",
            &[("cascade", "cascade"), ("path", "escalated")]
        ),
        Some(1.0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
