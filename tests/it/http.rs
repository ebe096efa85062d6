//! The HTTP/JSON edge against a served engine: OpenRLHF's `/get_reward` on a real tiny PRM,
//! scored exactly as gRPC scores the same trace; the JSON API; and the status table's HTTP
//! column (fakes, for overload, deadlines and loading).

use crate::common;

use common::*;
use retrace::pb;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

const SYSTEM: &str = "<|im_start|>system\nPlease reason step by step, and put your final answer \
                      within \\boxed{}.<|im_end|>\n";

/// A ChatML prompt as OpenRLHF's dataset renders it with the chat template.
pub fn chatml_prompt(question: &str) -> String {
    format!("{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
}

/// A server hosting the committed tiny Qwen2.5-Math-PRM-shaped model, loaded for real, as the
/// evaluator `name` (a test that reads its metrics gives a name no other test uses).
pub async fn tiny_prm_server(name: &str, extra: &str) -> TestServer {
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/qwen2-math-prm");
    let text = format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\n\
         family = \"qwen2-math-prm\"\nmodel = {:?}\n{extra}",
        model.display().to_string()
    );
    let config = retrace::Config::parse(&text, "test", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

/// An HTTP client (reqwest needs its TLS provider named even for plain HTTP).
pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub async fn post(s: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    post_with(s, path, body, &[]).await
}

pub async fn post_with(
    s: &TestServer,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = client()
        .post(format!("http://{}{path}", s.http_addr))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The same trace through gRPC Evaluate: the reference for what `/get_reward` must answer.
pub async fn grpc_verdict(s: &TestServer, question: &str, text: &str) -> pb::EvaluateResponse {
    let trace = pb::Trace {
        question: question.into(),
        text: text.into(),
        ..Default::default()
    };
    s.client()
        .await
        .evaluate(request("ref", "", trace))
        .await
        .unwrap()
        .into_inner()
}

pub fn f(v: &Value) -> f32 {
    v.as_f64().unwrap() as f32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_reward_scores_openrlhf_samples_as_grpc_scores_their_traces() {
    let s = tiny_prm_server("tiny", "").await;
    let samples = [
        (
            "What is 2+3*4?",
            "3*4 = 12.\n\n2+12 = 14.\n\nThe answer is $\\boxed{14}$.",
        ),
        (
            "Is 7 prime?",
            "7 has no divisor but 1 and 7.\n\n7 is prime.",
        ),
        ("Halve 9.", "9/2 = 4.5"),
    ];
    let prompts: Vec<String> = samples.iter().map(|(q, _)| chatml_prompt(q)).collect();
    // The query is the decoded prompt + response, end-of-turn and padding markers kept.
    let mut queries: Vec<String> = samples
        .iter()
        .zip(&prompts)
        .map(|((_, r), p)| format!("{p}{r}<|im_end|>\n<|endoftext|>"))
        .collect();
    queries.push(format!("{}<|im_end|>", prompts[0])); // an empty completion
    let mut all_prompts = prompts.clone();
    all_prompts.push(prompts[0].clone());
    let body =
        json!({"query": queries, "prompts": all_prompts, "labels": ["14", "yes", "4.5", "14"]});
    let (status, got) = post(&s, "/get_reward", &body).await;
    assert_eq!(status, 200, "{got}");
    let logs = &got["extra_logs"];
    for (i, (q, r)) in samples.iter().enumerate() {
        let want = grpc_verdict(&s, q, r).await;
        // Batched with its neighbours here, alone over gRPC: the packed decoder is exact.
        assert!(
            (f(&got["rewards"][i]) - want.trace_score).abs() < 1e-5,
            "{i}: {got}"
        );
        assert_eq!(got["scores"][i], got["rewards"][i]);
        assert_eq!(logs["first_error_index"][i], json!(want.first_error_index));
        assert_eq!(logs["step_count"][i], json!(want.steps.len()));
        assert_eq!(logs["category"][i], json!(want.category));
    }
    assert_eq!(logs["step_count"][1], json!(2));
    // The empty completion gets empty_reward (0) instead of failing the trainer's batch.
    assert_eq!(got["rewards"][3], json!(0.0));
    assert_eq!(logs["step_count"][3], json!(0));

    // One sample as strings (newer OpenRLHF sends one per request) is answered with scalars, and
    // without `prompts` the response is found after the last assistant header.
    let (q, r) = samples[0];
    let one = json!({"query": format!("{}{r}<|im_end|>", chatml_prompt(q))});
    let (status, got) = post(&s, "/get_reward", &one).await;
    assert_eq!(status, 200, "{got}");
    let want = grpc_verdict(&s, q, r).await;
    assert!(
        (f(&got["rewards"]) - want.trace_score).abs() < 1e-5,
        "{got}"
    );
    assert_eq!(got["extra_logs"]["step_count"], json!(3));

    // The reward rules, per request by query parameter.
    let first = want.first_error_index;
    let (_, correct) = post(&s, "/get_reward?rule=correct", &one).await;
    assert_eq!(f(&correct["rewards"]), if first < 0 { 1.0 } else { 0.0 });
    let (_, prefix) = post(&s, "/get_reward?rule=prefix", &one).await;
    let share = if first < 0 { 1.0 } else { first as f32 / 3.0 };
    assert!((f(&prefix["rewards"]) - share).abs() < 1e-6, "{prefix}");
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_single_sample_requests_is_batched() {
    let s = tiny_prm_server("burst", "max_wait_ms = 50").await;
    let body = json!({
        "query": format!("{}Step one.\n\nStep two.<|im_end|>", chatml_prompt("Count to two.")),
        "prompts": chatml_prompt("Count to two."),
        "labels": "",
    });
    let burst = (0..16).map(|_| post(&s, "/get_reward", &body));
    let replies = futures::future::join_all(burst).await;
    assert!(replies.iter().all(|(status, _)| *status == 200));
    let metrics = s.scrape().await;
    let batches = sample(
        &metrics,
        "retrace_batch_size_count",
        &[("evaluator", "burst")],
    )
    .unwrap();
    let traces = sample(
        &metrics,
        "retrace_batch_size_sum",
        &[("evaluator", "burst")],
    )
    .unwrap();
    assert_eq!(traces, 16.0);
    assert!(batches < 16.0, "16 requests ran as {batches} batches");
    let ok = sample(
        &metrics,
        "retrace_requests_total",
        &[
            ("rpc", "/get_reward"),
            ("evaluator", "burst"),
            ("outcome", "ok"),
        ],
    );
    assert_eq!(ok, Some(16.0));
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_api_mirrors_grpc() {
    let s = tiny_prm_server("tiny", "").await;
    let req = json!({"id": "j1", "trace": {"question": "2+2?", "steps": ["2+2 = 4.", "So 4."]}});
    let (status, got) = post(&s, "/v1/evaluate", &req).await;
    assert_eq!(status, 200, "{got}");
    let want = s
        .client()
        .await
        .evaluate(request(
            "j1",
            "",
            steps_trace("2+2?", &["2+2 = 4.", "So 4."]),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got["id"], "j1");
    assert_eq!(got["first_error_index"], json!(want.first_error_index));
    assert_eq!(got["category"], "ERROR_CATEGORY_UNSPECIFIED");
    assert_eq!(got["path"], "DECISION_PATH_PRM");
    for (i, step) in want.steps.iter().enumerate() {
        assert!((f(&got["steps"][i]["score"]) - step.score).abs() < 1e-6);
    }
    // proto3 JSON readers take lowerCamelCase too.
    let camel =
        json!({"trace": {"question": "2+2?", "text": "2+2 = 4.\n\nSo 4.", "referenceAnswer": "4"}});
    assert_eq!(post(&s, "/v1/evaluate", &camel).await.0, 200);

    let rank = json!({"id": "r", "question": "2+2?", "candidates": [
        {"steps": ["2+2 = 5."]}, {"steps": ["2+2 = 4.", "So 4."]}, {"text": "Four."}]});
    let (status, got) = post(&s, "/v1/rank", &rank).await;
    assert_eq!(status, 200, "{got}");
    let ranked = got["ranked"].as_array().unwrap();
    assert_eq!(ranked.len(), 3);
    let scores: Vec<f32> = ranked
        .iter()
        .map(|c| f(&c["verdict"]["trace_score"]))
        .collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");

    let list: Value = client()
        .get(format!("http://{}/v1/evaluators", s.http_addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["evaluators"][0]["name"], "tiny");
    assert_eq!(list["evaluators"][0]["family"], "qwen2-math-prm");
    let health = client()
        .get(format!("http://{}/health", s.http_addr))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    s.stop().await.unwrap();
}

async fn fake_server(server_extra: &str, delay: Duration) -> TestServer {
    let s = TestServer::start(
        config(server_extra, &[("a", "")]),
        fake_loader(delay, Arc::new(Counters::default()), None),
    )
    .await;
    s.ready().await;
    s
}

pub fn error_of(reply: &(u16, Value)) -> (u16, String, String) {
    let e = &reply.1["error"];
    assert_eq!(e["code"], json!(reply.0), "{}", reply.1);
    (
        reply.0,
        e["status"].as_str().unwrap_or_default().to_string(),
        e["field"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test]
async fn bad_input_gets_400_naming_the_field() {
    let s = fake_server("", Duration::from_millis(1)).await;
    let cases = [
        ("/get_reward", json!({"prompts": ["p"]}), "query"),
        ("/get_reward", json!({"query": ["a", 3]}), "query[1]"),
        (
            "/get_reward",
            json!({"query": ["a", "b"], "prompts": ["a"]}),
            "prompts",
        ),
        ("/get_reward", json!({"query": ["plain text"]}), "query[0]"),
        (
            "/get_reward",
            json!({"query": [format!("{}{}", chatml_prompt(" "), "a step")]}),
            "prompts[0]",
        ),
        (
            "/v1/evaluate",
            json!({"trace": {"question": "q", "steps": ["a", " "]}}),
            "trace.steps[1]",
        ),
        (
            "/v1/evaluate",
            json!({"trace": {"question": "q"}, "evaluatr": "a"}),
            "body",
        ),
        (
            "/v1/evaluate",
            json!({"evaluator": "nope", "trace": {"question": "q", "text": "s"}}),
            "evaluator",
        ),
        (
            "/v1/rank",
            json!({"question": "q", "candidates": []}),
            "candidates",
        ),
    ];
    for (path, body, field) in cases {
        let reply = post(&s, path, &body).await;
        assert_eq!(
            error_of(&reply),
            (400, "INVALID_ARGUMENT".into(), field.into()),
            "{path} {body}"
        );
    }
    let r = client()
        .post(format!("http://{}/get_reward?rule=min", s.http_addr))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["field"], "?rule");
    let r = client()
        .post(format!("http://{}/v1/evaluate", s.http_addr))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"].as_str().unwrap().contains("line 1"),
        "{e}"
    );
    let r = client()
        .get(format!("http://{}/v2/nothing", s.http_addr))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn auth_overload_and_deadlines_follow_the_status_table() {
    let mut config = config(
        "auth_tokens_env = \"RETRACE_HTTP_TEST_TOKENS\"\nmax_in_flight = 1",
        &[("a", "")],
    );
    config.env = retrace::Env::fixed([("RETRACE_HTTP_TEST_TOKENS", "tok")]);
    let counters = Arc::new(Counters::default());
    let s = TestServer::start(
        config,
        fake_loader(Duration::from_millis(300), counters.clone(), None),
    )
    .await;
    s.ready().await;
    let body = json!({"query": [format!("{}one step", chatml_prompt("q"))]});
    let reply = post(&s, "/get_reward", &body).await;
    assert_eq!(error_of(&reply).0, 401);
    let reply = post_with(
        &s,
        "/get_reward",
        &body,
        &[("authorization", "Bearer nope")],
    )
    .await;
    assert_eq!(
        error_of(&reply),
        (401, "UNAUTHENTICATED".into(), String::new())
    );
    let auth = ("authorization", "Bearer tok");
    let with_token = [auth];
    let (ok, shed) = tokio::join!(post_with(&s, "/get_reward", &body, &with_token), async {
        // Once the first holds the one place in flight.
        counters.until_started(1).await;
        post_with(&s, "/get_reward", &body, &with_token).await
    });
    assert_eq!(ok.0, 200, "{}", ok.1);
    assert_eq!(
        error_of(&shed),
        (429, "RESOURCE_EXHAUSTED".into(), String::new())
    );
    let late = post_with(
        &s,
        "/get_reward",
        &body,
        &[auth, ("x-request-timeout", "0.05")],
    )
    .await;
    assert_eq!(
        error_of(&late),
        (504, "DEADLINE_EXCEEDED".into(), String::new())
    );
    let bad = post_with(
        &s,
        "/get_reward",
        &body,
        &[auth, ("x-request-timeout", "soon")],
    )
    .await;
    assert_eq!(
        error_of(&bad),
        (400, "INVALID_ARGUMENT".into(), "x-request-timeout".into())
    );
    let metrics = s.scrape().await;
    let count = |outcome| {
        sample(
            &metrics,
            "retrace_requests_total",
            &[("rpc", "/get_reward"), ("outcome", outcome)],
        )
    };
    assert_eq!(count("resource_exhausted"), Some(1.0));
    assert_eq!(count("deadline_exceeded"), Some(1.0));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn loading_is_503_and_health_says_so() {
    let gate = Arc::new(Semaphore::new(0));
    let s = TestServer::start(
        config("", &[("a", "")]),
        fake_loader(
            Duration::from_millis(1),
            Arc::new(Counters::default()),
            Some(gate.clone()),
        ),
    )
    .await;
    let url = format!("http://{}", s.http_addr);
    // The listener was bound before the server started: the request waits for it.
    let health = client().get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let body = json!({"query": format!("{}one step", chatml_prompt("q"))});
    let reply = post(&s, "/get_reward", &body).await;
    assert_eq!(error_of(&reply), (503, "UNAVAILABLE".into(), String::new()));
    gate.add_permits(1);
    s.ready().await;
    assert_eq!(post(&s, "/get_reward", &body).await.0, 200);
    s.stop().await.unwrap();
}

/// A reward sample's errors name the sample where the body has it: its own index in the list
/// (not its index among the non-empty ones), and `query` alone for one sample, whose steps
/// the body has no field for.
#[tokio::test]
async fn reward_errors_name_the_sample_the_body_holds() {
    // A sample over the limits fails its request only when asked to; by default it gets its
    // status (a_sample_over_the_size_limits_gets_its_status_and_the_others_their_rewards).
    let strict = "max_steps = 2\n[reward]\non_too_large = \"error\"";
    let s = fake_server(strict, Duration::from_millis(1)).await;
    let too_long = format!("{}one\n\ntwo\n\nthree", chatml_prompt("q"));
    let empty = format!("{}<|im_end|>", chatml_prompt("q"));
    let fits = format!("{}one\n\ntwo", chatml_prompt("q"));
    let cases = [
        (
            json!({"query": [empty.clone(), too_long.clone()]}),
            "query[1]",
        ),
        (
            json!({"query": [fits, empty, too_long.clone()]}),
            "query[2]",
        ),
        (json!({"query": too_long}), "query"),
    ];
    for (body, field) in cases {
        let reply = post(&s, "/get_reward", &body).await;
        assert_eq!(
            error_of(&reply),
            (400, "INVALID_ARGUMENT".into(), field.into()),
            "{body}"
        );
        let message = reply.1["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("3 steps exceed this evaluator's limit of 2"),
            "{message}"
        );
    }
    s.stop().await.unwrap();
}

/// A Reload over gRPC with `token`, and its code.
async fn grpc_reload(addr: std::net::SocketAddr, token: Option<&str>) -> tonic::Code {
    let url = format!("http://127.0.0.1:{}", addr.port());
    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel);
    let mut req = tonic::Request::new(pb::ReloadRequest {
        evaluator: "a".into(),
    });
    if let Some(t) = token {
        let value = format!("Bearer {t}").parse().unwrap();
        req.metadata_mut().insert("authorization", value);
    }
    c.reload(req)
        .await
        .map_or_else(|s| s.code(), |_| tonic::Code::Ok)
}

#[tokio::test]
async fn reload_needs_an_admin_token_where_one_is_set_and_an_evaluation_token_is_not_one() {
    let mut config = config(
        "auth_tokens_env = \"EVAL_TOKENS\"\nadmin_tokens_env = \"ADMIN_TOKENS\"",
        &[("a", "")],
    );
    config.env = retrace::Env::fixed([("EVAL_TOKENS", "tok"), ("ADMIN_TOKENS", "root")]);
    let counters = Arc::new(Counters::default());
    let s = TestServer::start(config, fake_loader(Duration::ZERO, counters, None)).await;
    s.ready().await;
    let body = json!({"evaluator": "a"});
    let bearer = |t: &'static str| {
        [(
            "authorization",
            if t == "root" {
                "Bearer root"
            } else {
                "Bearer tok"
            },
        )]
    };
    let as_evaluator = post_with(&s, "/v1/reload", &body, &bearer("tok")).await;
    assert_eq!(
        error_of(&as_evaluator),
        (401, "UNAUTHENTICATED".into(), String::new())
    );
    let as_admin = post_with(&s, "/v1/reload", &body, &bearer("root")).await;
    assert_eq!(as_admin.0, 200, "{}", as_admin.1);
    assert_eq!(
        grpc_reload(s.addr, Some("tok")).await,
        tonic::Code::Unauthenticated
    );
    assert_eq!(
        grpc_reload(s.addr, None).await,
        tonic::Code::Unauthenticated
    );
    assert_eq!(grpc_reload(s.addr, Some("root")).await, tonic::Code::Ok);
    // The admin token passes the evaluation routes' check that comes first.
    let trace = json!({"trace": {"question": "q", "steps": ["a step"]}});
    let evaluated = post_with(&s, "/v1/evaluate", &trace, &bearer("root")).await;
    assert_eq!(evaluated.0, 200, "{}", evaluated.1);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn without_an_admin_token_reload_is_refused_unless_the_listener_is_loopback() {
    // Listening on every address, as the default 0.0.0.0 does, reached here over loopback.
    let grpc = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
    let counters = Arc::new(Counters::default());
    let listeners = retrace::Listeners {
        grpc,
        http: Some(http),
        metrics: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(retrace::serve(
        config("", &[("a", "")]),
        fake_loader(Duration::ZERO, counters, None),
        listeners,
        async {
            let _ = stopped.await;
        },
    ));
    assert_eq!(
        grpc_reload(grpc_addr, None).await,
        tonic::Code::PermissionDenied
    );
    let url = format!("http://127.0.0.1:{}/v1/reload", http_addr.port());
    let r = client()
        .post(url)
        .json(&json!({"evaluator": "a"}))
        .send()
        .await
        .unwrap();
    let reply = (r.status().as_u16(), r.json::<Value>().await.unwrap());
    assert_eq!(
        error_of(&reply),
        (403, "PERMISSION_DENIED".into(), String::new())
    );
    assert!(
        reply.1["error"]["message"]
            .as_str()
            .unwrap()
            .contains("admin_tokens_env"),
        "{}",
        reply.1
    );
    // Evaluation is open as before: no evaluation token is set.
    let url = format!("http://127.0.0.1:{}/v1/evaluators", http_addr.port());
    assert_eq!(client().get(url).send().await.unwrap().status(), 200);
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn an_overloaded_call_says_when_to_come_back() {
    let config = config("max_in_flight = 1", &[("a", "")]);
    let counters = Arc::new(Counters::default());
    let s = TestServer::start(
        config,
        fake_loader(Duration::from_millis(300), counters.clone(), None),
    )
    .await;
    s.ready().await;
    let trace = json!({"trace": {"question": "q", "steps": ["a step"]}});
    let url = format!("http://{}/v1/evaluate", s.http_addr);
    let (held, refused) = tokio::join!(post(&s, "/v1/evaluate", &trace), async {
        counters.until_started(1).await;
        client().post(&url).json(&trace).send().await.unwrap()
    });
    assert_eq!(held.0, 200, "{}", held.1);
    assert_eq!(refused.status(), 429);
    let after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(after >= 1, "{after}");
    // gRPC says it in the status's trailers, in milliseconds.
    let (mut first, mut second) = (s.client().await, s.client().await);
    let (held, refused) = tokio::join!(
        first.evaluate(request("1", "", steps_trace("q", &["a step"]))),
        async {
            counters.until_started(2).await;
            second
                .evaluate(request("2", "", steps_trace("q", &["a step"])))
                .await
        }
    );
    held.unwrap();
    let status = refused.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    let ms: u64 = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .expect("a pushback")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((50..=60_000).contains(&ms), "{ms}");
    s.stop().await.unwrap();
}
