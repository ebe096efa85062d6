//! Judge and cascade evaluators through the gRPC API against a fault-injecting upstream: server
//! errors, 429 with Retry-After, slow replies, truncated JSON, event streams, garbage, the
//! breaker, voting, the cache, and cancellation reaching the upstream.

use crate::common;

use common::upstream::{Fault, Upstream, reply};
use common::{TestServer, request, sample, steps_trace};
use retrace::Config;
use retrace::pb;
use std::time::{Duration, Instant};
use tonic::Code;

const GOOD: &str =
    "Paragraph 0 is right. Paragraph 1 claims a false fact.\n\\boxed{1}\nCategory: Hallucination";

/// A server whose one evaluator is a judge named `name` on `upstream`, plus `extra` keys. The
/// replies here are text; the structured modes are tests/judge_output.rs's.
async fn judge_server(name: &str, upstream: &Upstream, extra: &str) -> TestServer {
    let text = format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\nbreaker_cooldown_s = 1\n{extra}\n",
        upstream.base_url()
    );
    start(&text).await
}

async fn start(text: &str) -> TestServer {
    let config = Config::parse(text, "test config", &[]).expect("valid config");
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

fn three_steps() -> pb::Trace {
    steps_trace("What is 2 + 3?", &["2 + 3 = 5.", "5 is even.", "So 5."])
}

async fn judge(
    s: &TestServer,
    evaluator: &str,
    timeout: Option<&str>,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    let mut req = tonic::Request::new(request("r", evaluator, three_steps()));
    if let Some(t) = timeout {
        // The header alone, so the server (not the client's timer) enforces the deadline.
        req.metadata_mut()
            .insert("grpc-timeout", t.parse().unwrap());
    }
    s.client().await.evaluate(req).await.map(|r| r.into_inner())
}

async fn metric(s: &TestServer, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(&s.scrape().await, name, labels).unwrap_or(0.0)
}

#[tokio::test]
async fn a_reply_becomes_a_verdict_with_the_judge_path() {
    let up = Upstream::start(reply(GOOD)).await;
    let s = judge_server("j-ok", &up, "").await;
    let r = judge(&s, "j-ok", None).await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Hallucination as i32);
    assert_eq!(r.path, pb::DecisionPath::Judge as i32);
    let scores: Vec<f32> = r.steps.iter().map(|s| s.score).collect();
    assert_eq!(scores, [1.0, 0.0, 0.0]);
    assert!(r.rationale.contains("false fact"), "{}", r.rationale);
    let body = &up.bodies()[0];
    assert_eq!(body["model"], "fake");
    assert_eq!(body["temperature"], 0.0);
    assert_eq!(body["max_tokens"], 1024);
    assert!(body.get("n").is_none());
    let prompt = body["messages"][0]["content"].as_str().unwrap();
    assert!(
        prompt.contains("<paragraph_1>\n5 is even.\n</paragraph_1>"),
        "{prompt}"
    );
    assert_eq!(
        up.auth_headers()[0],
        None,
        "no api_key_env, no Authorization header"
    );
    let m = s.scrape().await;
    assert_eq!(
        sample(
            &m,
            "retrace_judge_requests_total",
            &[("judge", "j-ok"), ("outcome", "ok")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &m,
            "retrace_judge_tokens_total",
            &[("judge", "j-ok"), ("kind", "prompt")]
        ),
        Some(100.0)
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn server_errors_are_retried_then_reported_unavailable() {
    let err = || Fault::Status(500, None, "boom".into());
    let up = Upstream::start(err()).await;
    let s = judge_server("j-500", &up, "retries = 2").await;
    let status = judge(&s, "j-500", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("HTTP 500: boom"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("after 3 attempt(s)"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 3, "one try and two retries");
    assert_eq!(
        metric(&s, "retrace_judge_retries_total", &[("judge", "j-500")]).await,
        2.0
    );
    assert_eq!(
        metric(
            &s,
            "retrace_judge_requests_total",
            &[("judge", "j-500"), ("outcome", "http_5xx")]
        )
        .await,
        3.0
    );
    // Then a 500 followed by a good reply succeeds on the retry.
    up.script([err()]);
    up.set_default(reply(GOOD));
    assert_eq!(judge(&s, "j-500", None).await.unwrap().first_error_index, 1);
    assert_eq!(up.hits(), 5);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_client_error_is_not_retried() {
    let up = Upstream::start(Fault::Status(401, None, "Invalid API Key".into())).await;
    let s = judge_server("j-401", &up, "retries = 3").await;
    let status = judge(&s, "j-401", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("HTTP 401: Invalid API Key"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 1);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn retry_after_is_honoured_and_one_past_the_deadline_is_not_waited_for() {
    let up = Upstream::start(reply(GOOD)).await;
    let s = judge_server("j-429", &up, "retries = 2\ncache_entries = 0").await;
    up.script([Fault::Status(429, Some("1".into()), "slow down".into())]);
    let started = Instant::now();
    let r = judge(&s, "j-429", None).await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited {:?}",
        started.elapsed()
    );
    assert_eq!(up.hits(), 2);
    // Retry-After 30 s against a 2 s deadline: give up now, with the upstream's reason.
    up.script([Fault::Status(429, Some("30".into()), "slow down".into())]);
    let started = Instant::now();
    let status = judge(&s, "j-429", Some("2S")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("HTTP 429: slow down"),
        "{}",
        status.message()
    );
    // Given up before the deadline (UNAVAILABLE, not DEADLINE_EXCEEDED), with no retry sent.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(up.hits(), 3);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_slow_upstream_meets_the_deadline_and_is_cancelled() {
    let up = Upstream::start(Fault::Slow(Duration::from_secs(10), GOOD.into())).await;
    let s = judge_server("j-slow", &up, "timeout_s = 0.5").await;
    // The caller's deadline, shorter than timeout_s.
    let started = Instant::now();
    let status = judge(&s, "j-slow", Some("300m")).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // Far from the upstream's 10 s: the deadline cut the exchange.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        up.wait_idle(Duration::from_secs(2)).await,
        "upstream request left open"
    );
    // No caller deadline: timeout_s bounds the exchange, and timeouts are not retried.
    let status = judge(&s, "j-slow", None).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("did not answer in time"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 2);
    assert!(
        up.wait_idle(Duration::from_secs(2)).await,
        "upstream request left open"
    );
    // A caller that leaves takes its upstream request with it.
    let call = tokio::spawn({
        let mut c = s.client().await;
        async move { c.evaluate(request("gone", "j-slow", three_steps())).await }
    });
    up.until_open().await;
    call.abort();
    assert!(
        up.wait_idle(Duration::from_secs(2)).await,
        "upstream request outlived its caller"
    );
    assert_eq!(
        metric(
            &s,
            "retrace_judge_in_flight_requests",
            &[("judge", "j-slow")]
        )
        .await,
        0.0
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn malformed_replies_are_unavailable_and_not_retried() {
    let up = Upstream::start(Fault::Garbage).await;
    let s = judge_server("j-bad", &up, "retries = 3").await;
    let cases = [
        (Fault::TruncatedJson, "EOF"),
        (Fault::EventStream, "event stream"),
        (Fault::Garbage, "<html>"),
    ];
    for (i, (fault, needle)) in cases.into_iter().enumerate() {
        up.script([fault]);
        let status = judge(&s, "j-bad", None).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("not a chat completion"),
            "{}",
            status.message()
        );
        assert!(status.message().contains(needle), "{}", status.message());
        assert_eq!(up.hits(), i + 1);
    }
    s.stop().await.unwrap();
}

/// A body past the cap is refused as it streams in, not read whole, parsed and cached.
#[tokio::test]
async fn an_oversized_reply_is_refused_and_not_retried() {
    let huge = format!("{}\n{GOOD}", "x".repeat(5 << 20));
    let up = Upstream::start(reply(&huge)).await;
    let s = judge_server("j-huge", &up, "retries = 3").await;
    let status = judge(&s, "j-huge", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("the body is over 4 MiB"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 1, "a broken body is not retried");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn an_unreadable_reply_gets_one_repair_turn() {
    let up = Upstream::start(reply("Looks fine to me.")).await;
    let s = judge_server("j-repair", &up, "cache_entries = 0").await;
    up.script([
        reply("The steps all hold."),
        reply("\\boxed{-1}\nCategory: None"),
    ]);
    let r = judge(&s, "j-repair", None).await.unwrap();
    assert_eq!(r.first_error_index, -1);
    assert_eq!(r.category, pb::ErrorCategory::None as i32);
    let repair = &up.bodies()[1]["messages"];
    assert_eq!(repair[1]["role"], "assistant");
    assert_eq!(repair[1]["content"], "The steps all hold.");
    assert!(
        repair[2]["content"]
            .as_str()
            .unwrap()
            .contains("only these two lines")
    );
    // Unreadable twice: an error, never a made-up verdict.
    let status = judge(&s, "j-repair", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("no readable verdict"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 4);
    let m = s.scrape().await;
    let repairs = |r| {
        sample(
            &m,
            "retrace_judge_repairs_total",
            &[("judge", "j-repair"), ("result", r)],
        )
    };
    assert_eq!(
        (repairs("repaired"), repairs("failed")),
        (Some(1.0), Some(1.0))
    );
    assert_eq!(
        sample(
            &m,
            "retrace_judge_requests_total",
            &[("judge", "j-repair"), ("outcome", "parse_error")]
        ),
        Some(1.0)
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn the_breaker_opens_then_lets_one_probe_through() {
    let up = Upstream::start(reply(GOOD)).await;
    let s = judge_server(
        "j-breaker",
        &up,
        "retries = 0\nbreaker_failures = 2\ncache_entries = 0",
    )
    .await;
    up.script([
        Fault::Status(503, None, "down".into()),
        Fault::Status(503, None, "down".into()),
    ]);
    for _ in 0..2 {
        assert_eq!(
            judge(&s, "j-breaker", None).await.unwrap_err().code(),
            Code::Unavailable
        );
    }
    let status = judge(&s, "j-breaker", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("circuit breaker open"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 2, "an open breaker sends nothing");
    let m = s.scrape().await;
    assert_eq!(
        sample(
            &m,
            "retrace_judge_breaker_opened_total",
            &[("judge", "j-breaker")]
        ),
        Some(1.0)
    );
    let state = |m: &str| sample(m, "retrace_judge_breaker_state", &[("judge", "j-breaker")]);
    assert_eq!(state(&m), Some(2.0), "open");
    assert_eq!(
        sample(
            &m,
            "retrace_judge_requests_total",
            &[("judge", "j-breaker"), ("outcome", "circuit_open")]
        ),
        Some(1.0)
    );
    // After the 1 s cooldown a probe goes through, succeeds, and closes the breaker.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        judge(&s, "j-breaker", None)
            .await
            .unwrap()
            .first_error_index,
        1
    );
    assert_eq!(
        judge(&s, "j-breaker", None)
            .await
            .unwrap()
            .first_error_index,
        1
    );
    assert_eq!(up.hits(), 4);
    assert_eq!(state(&s.scrape().await), Some(0.0), "closed again");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn samples_vote_through_n_or_parallel_requests() {
    let votes = |v: &[&str]| Fault::Reply(v.iter().map(|s| s.to_string()).collect());
    let up = Upstream::start(reply("\\boxed{2}\nCategory: Reasoning")).await;
    let s = judge_server("j-vote", &up, "samples = 3\ntemperature = 0.8").await;
    up.script([votes(&[
        "\\boxed{1}\nCategory: Reasoning",
        "\\boxed{2}\nCategory: Misinterpretation",
        "\\boxed{1}\nCategory: Hallucination",
    ])]);
    let r = judge(&s, "j-vote", None).await.unwrap();
    assert_eq!(r.first_error_index, 1);
    // A tie between the winners' categories goes to the higher-priority one.
    assert_eq!(r.category, pb::ErrorCategory::Hallucination as i32);
    let scores: Vec<f32> = r.steps.iter().map(|s| s.score).collect();
    assert_eq!(scores, [1.0, 1.0 / 3.0, 0.0]);
    assert_eq!(up.bodies()[0]["n"], 3);
    assert_eq!(up.bodies()[0]["temperature"], 0.8f32);
    assert_eq!(
        metric(
            &s,
            "retrace_judge_vote_disagreements_total",
            &[("judge", "j-vote")]
        )
        .await,
        1.0
    );
    // A server that ignores `n` answers one choice: the other two come from parallel requests,
    // and from then on every sample is its own request.
    up.script([votes(&["\\boxed{0}\nCategory: Reasoning"])]);
    let r = judge(&s, "j-vote", None).await.unwrap();
    assert_eq!(r.first_error_index, 2, "two of three said 2");
    assert_eq!(up.hits(), 4);
    judge(&s, "j-vote", None).await.unwrap();
    assert_eq!(up.hits(), 7);
    assert!(up.bodies()[4..].iter().all(|b| b.get("n").is_none()));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_refused_n_falls_back_to_parallel_requests() {
    let up = Upstream::start(reply("\\boxed{0}\nCategory: Reasoning")).await;
    let s = judge_server("j-no-n", &up, "samples = 4\ntemperature = 0.8").await;
    // llama.cpp's own words when `n` exceeds its slots.
    let refusal = "Field 'n': Value must be between 1 <= value <= 2, but got 4";
    up.script([Fault::Status(400, None, refusal.into())]);
    let r = judge(&s, "j-no-n", None).await.unwrap();
    assert_eq!(r.first_error_index, 0);
    assert_eq!(
        up.hits(),
        5,
        "the refused request, then four single samples"
    );
    assert!(up.bodies()[1..].iter().all(|b| b.get("n").is_none()));
    // Any other 400 is the caller's problem, not a reason to fan out.
    up.script([Fault::Status(400, None, "bad model".into())]);
    let s2 = judge_server("j-no-n2", &up, "samples = 4\ntemperature = 0.8").await;
    assert_eq!(
        judge(&s2, "j-no-n2", None).await.unwrap_err().code(),
        Code::Unavailable
    );
    assert_eq!(up.hits(), 6);
    s.stop().await.unwrap();
    s2.stop().await.unwrap();
}

#[tokio::test]
async fn greedy_replies_are_cached() {
    let up = Upstream::start(reply(GOOD)).await;
    let s = judge_server("j-cache", &up, "").await;
    let held = |m: &str, what| sample(m, what, &[("judge", "j-cache")]);
    let m = s.scrape().await;
    assert_eq!(
        (
            held(&m, "retrace_judge_cache_entries"),
            held(&m, "retrace_judge_cache_bytes")
        ),
        (Some(0.0), Some(0.0)),
        "an empty cache is exported before its first use"
    );
    for _ in 0..3 {
        assert_eq!(
            judge(&s, "j-cache", None).await.unwrap().first_error_index,
            1
        );
    }
    assert_eq!(up.hits(), 1);
    let m = s.scrape().await;
    let cache = |r| {
        sample(
            &m,
            "retrace_judge_cache_total",
            &[("judge", "j-cache"), ("result", r)],
        )
    };
    assert_eq!((cache("hit"), cache("miss")), (Some(2.0), Some(1.0)));
    // One entry: its key (the whole request body) and the reply's text.
    assert_eq!(held(&m, "retrace_judge_cache_entries"), Some(1.0));
    let bytes = held(&m, "retrace_judge_cache_bytes").unwrap();
    assert!(bytes > 2.0 * GOOD.len() as f64, "{bytes}");
    s.stop().await.unwrap();
}

fn tiny_prm(name: &str) -> String {
    let dir = std::path::Path::new(crate::common::REPO).join("tests/fixtures/tiny/chat-lm");
    format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"{}\"\n",
        dir.display()
    )
}

#[tokio::test]
async fn a_cascade_escalates_categorizes_or_keeps_the_prm_verdict() {
    let up = Upstream::start(reply(GOOD)).await;
    let judge_table = format!(
        "[[evaluator]]\nname = \"c-judge\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\noutput = \"text\"\nretries = 0\ncache_entries = 0\n",
        up.base_url()
    );
    // Margin 1 escalates every trace; margin 0 with threshold 0 (nothing is wrong) never does;
    // threshold 1 (everything is wrong) with categorize asks only for the category.
    let text = format!(
        "{}{judge_table}\
         [[evaluator]]\nname = \"always\"\nkind = \"cascade\"\nprm = \"c-prm\"\njudge = \"c-judge\"\nescalate_margin = 1.0\n\
         [[evaluator]]\nname = \"never\"\nkind = \"cascade\"\nprm = \"c-prm\"\njudge = \"c-judge\"\nescalate_margin = 0.0\nthreshold = 0.0\n\
         [[evaluator]]\nname = \"categorize\"\nkind = \"cascade\"\nprm = \"c-prm\"\njudge = \"c-judge\"\nescalate_margin = 0.0\nthreshold = 1.0\ncategorize = true\n",
        tiny_prm("c-prm")
    );
    let s = start(&text).await;
    let prm = judge(&s, "c-prm", None).await.unwrap();

    let r = judge(&s, "always", None).await.unwrap();
    assert_eq!(r.path, pb::DecisionPath::Escalated as i32);
    assert_eq!(
        (r.first_error_index, r.category),
        (1, pb::ErrorCategory::Hallucination as i32)
    );
    let scores = |r: &pb::EvaluateResponse| r.steps.iter().map(|s| s.score).collect::<Vec<_>>();
    assert_eq!(scores(&r), scores(&prm), "step scores stay the PRM's");
    assert_eq!(up.hits(), 1);

    let r = judge(&s, "never", None).await.unwrap();
    assert_eq!(
        (r.path, r.first_error_index),
        (pb::DecisionPath::Prm as i32, -1)
    );
    assert_eq!(up.hits(), 1, "a sure PRM costs no judge call");

    // Threshold 1: the PRM's first error is step 0, but the judge says 1: no category.
    let r = judge(&s, "categorize", None).await.unwrap();
    assert_eq!(r.path, pb::DecisionPath::Categorized as i32);
    assert_eq!(
        (r.first_error_index, r.category),
        (0, pb::ErrorCategory::Unspecified as i32)
    );
    up.set_default(reply("\\boxed{0}\nCategory: Misinterpretation"));
    let r = judge(&s, "categorize", None).await.unwrap();
    assert_eq!(
        (r.first_error_index, r.category),
        (0, pb::ErrorCategory::Misinterpretation as i32)
    );

    // A judge outage degrades the cascade to its PRM, and says so.
    up.set_default(Fault::Status(500, None, "down".into()));
    let r = judge(&s, "always", None).await.unwrap();
    assert_eq!(r.path, pb::DecisionPath::Prm as i32);
    assert_eq!(r.first_error_index, prm.first_error_index);
    assert!(r.rationale.contains("judge unavailable"), "{}", r.rationale);
    let m = s.scrape().await;
    let path = |p| {
        sample(
            &m,
            "retrace_cascade_total",
            &[("cascade", "always"), ("path", p)],
        )
    };
    assert_eq!(
        (path("escalated"), path("judge_failed")),
        (Some(1.0), Some(1.0))
    );
    s.stop().await.unwrap();
}

/// A cascade and its own PRM driven together past the PRM's `max_concurrency`: the cascade's
/// calls wait at the PRM's gate like everyone else's, so no admitted request finds the model's
/// queue (sized for that gate) full.
#[tokio::test]
async fn a_cascade_and_its_prm_at_full_concurrency_share_the_prms_gate() {
    let up = Upstream::start(reply(GOOD)).await;
    // One job at a time in batches of one: the model's queue has room for exactly one request.
    let text = format!(
        "{}max_concurrency = 1\nmax_batch_size = 1\nmax_wait_ms = 0\n\
         [[evaluator]]\nname = \"g-judge\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         [[evaluator]]\nname = \"g-cascade\"\nkind = \"cascade\"\nprm = \"g-prm\"\njudge = \"g-judge\"\nescalate_margin = 0.0\n",
        tiny_prm("g-prm"),
        up.base_url()
    );
    let s = start(&text).await;
    let client = s.client().await;
    let calls = (0..32).map(|i| {
        let mut c = client.clone();
        let evaluator = if i % 2 == 0 { "g-prm" } else { "g-cascade" };
        async move {
            c.evaluate(request(&format!("{i}"), evaluator, three_steps()))
                .await
        }
    });
    let results = futures::future::join_all(calls).await;
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| {
            r.as_ref()
                .err()
                .map(|e| format!("{:?}: {}", e.code(), e.message()))
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 32 failed: {failed:?}",
        failed.len()
    );
    // Both kinds of caller reached the PRM through its gate, and the queue drained.
    let metrics = s.scrape().await;
    assert_eq!(
        sample(&metrics, "retrace_queue_depth", &[("evaluator", "g-prm")]),
        Some(0.0)
    );
    assert_eq!(up.hits(), 0, "a margin of 0 never escalates");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn prompt_templates_are_overridden_from_prompts_dir() {
    let dir = std::env::temp_dir().join(format!("retrace-prompts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let custom = "Check {question}\n{tagged_steps}\nAnswer as \\boxed{i}.";
    std::fs::write(dir.join("math-reference-free.txt"), custom).unwrap();
    let up = Upstream::start(reply(GOOD)).await;
    let extra = format!("prompts_dir = \"{}\"", dir.display());
    let s = judge_server("j-prompts", &up, &extra).await;
    judge(&s, "j-prompts", None).await.unwrap();
    let prompt = up.bodies()[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        prompt.starts_with("Check What is 2 + 3?\n<paragraph_0>"),
        "{prompt}"
    );
    s.stop().await.unwrap();

    // A template missing a placeholder stops startup, naming the file.
    std::fs::write(
        dir.join("math-reference-free.txt"),
        "No steps here: {question}",
    )
    .unwrap();
    let text = format!(
        "[[evaluator]]\nname = \"j-bad-prompt\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"m\"\n{extra}\n",
        up.base_url()
    );
    let config = Config::parse(&text, "test config", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    let err = s.handle.await.unwrap().unwrap_err().to_string();
    assert!(err.contains("math-reference-free.txt"), "{err}");
    assert!(err.contains("{tagged_steps}"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
