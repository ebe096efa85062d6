//! The trainers' other reward contracts, called as the trainers call them: slime's remote reward
//! (`/slime/reward`, read as slime reads it), token ids decoded by the policy's real tokenizer
//! (AReaL's and verl's rollouts), and the server-side deadline an HTTP caller gets, against a
//! judge upstream that never answers.

use crate::common;
use crate::http::{chatml_prompt, client, error_of, f, post, post_with, tiny_prm_server};

use common::upstream::{Fault, Upstream, reply};
use common::{TestServer, sample};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const QUESTION: &str = "What is 2+3*4?";
const RESPONSE: &str = "3*4 = 12.\n\n2+12 = 14.\n\nThe answer is $\\boxed{14}$.";

/// What slime's `remote_rm` does with a sample: posts `{"prompt", "response", "label"}` as JSON,
/// fails on a status that is not 2xx, keeps the reply's JSON as the reward, and reads
/// `reward[reward_key]` when it runs with `--reward-key`, the reply itself otherwise.
async fn slime_remote_rm(url: &str, prompt: Value, response: &str, label: &str) -> Value {
    let payload = json!({"prompt": prompt, "response": response, "label": label});
    let r = client().post(url).json(&payload).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    r.json().await.unwrap()
}

fn reward_of(reply: &Value, reward_key: Option<&str>) -> f32 {
    match reward_key {
        Some(k) => f(&reply[k]),
        None => f(reply),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slime_reads_the_reward_as_a_number_or_under_its_reward_key() {
    let s = tiny_prm_server("slime-tiny", "").await;
    let url = format!("http://{}/slime/reward", s.http_addr);
    let prompt = chatml_prompt(QUESTION);
    // The same sample through OpenRLHF's route: the reward slime must get.
    let query = format!("{prompt}{RESPONSE}<|im_end|>");
    let (_, want) = post(
        &s,
        "/get_reward",
        &json!({"query": query, "prompts": prompt}),
    )
    .await;

    // The same reward, but for the last float bits: a second pass over the same prompt reads
    // the first one's prefix-cached keys and values, whose sums round in another order.
    let same = |a: f32, b: f32| (a - b).abs() < 1e-5;
    let plain = slime_remote_rm(&url, json!(prompt), RESPONSE, "14").await;
    assert!(plain.is_number(), "{plain}");
    assert!(
        same(reward_of(&plain, None), f(&want["rewards"])),
        "{plain} {want}"
    );

    let keyed_url = format!("{url}?reward_key=score");
    let keyed = slime_remote_rm(&keyed_url, json!(prompt), RESPONSE, "14").await;
    assert!(
        same(reward_of(&keyed, Some("score")), f(&want["rewards"])),
        "{keyed} {want}"
    );
    let logs = &want["extra_logs"];
    assert!(
        same(f(&keyed["trace_score"]), f(&logs["trace_score"])),
        "{keyed}"
    );
    // The verdict itself is exact: the same first error, steps, category and status.
    for k in ["first_error_index", "step_count", "category", "timed_out"] {
        assert_eq!(keyed[k], logs[k], "{k}: {keyed}");
    }

    // Without `--apply-chat-template`, slime's prompt is the message list itself.
    let messages = json!([{"role": "system", "content": "Please reason step by step."},
                          {"role": "user", "content": QUESTION}]);
    let from_messages = slime_remote_rm(&url, messages, RESPONSE, "14").await;
    assert!(
        same(f(&from_messages), f(&plain)),
        "{from_messages} {plain}"
    );
    // The reward rule per request, as on /get_reward.
    let correct =
        slime_remote_rm(&format!("{url}?rule=correct"), json!(prompt), RESPONSE, "").await;
    let first = logs["first_error_index"].as_i64().unwrap();
    assert_eq!(f(&correct), if first < 0 { 1.0 } else { 0.0 });

    let bad = [
        (
            "?reward_key=step_count",
            json!({"prompt": "p", "response": "r"}),
            "?reward_key",
        ),
        ("", json!({"prompt": "p", "response": 5}), "response"),
        (
            "",
            json!({"prompt": [{"role": "system", "content": "s"}], "response": "r"}),
            "prompt",
        ),
    ];
    for (query, body, field) in bad {
        let reply = post(&s, &format!("/slime/reward{query}"), &body).await;
        assert_eq!(
            error_of(&reply),
            (400, "INVALID_ARGUMENT".into(), field.into()),
            "{body}"
        );
    }
    s.stop().await.unwrap();
}

/// A server whose one evaluator is a judge named `name` on `up` that neither retries nor caches
/// and waits on its upstream far longer than any test (600 s), plus `extra` lines after it.
async fn judge_server(name: &str, up: &Upstream, extra: &str) -> TestServer {
    let text = format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\nretries = 0\ncache_entries = 0\ntimeout_s = 600\n{extra}\n",
        up.base_url()
    );
    let config = retrace::Config::parse(&text, "test config", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

const JUDGED: &str =
    "Paragraph 0 is right. Paragraph 1 claims a false fact.\n\\boxed{1}\nCategory: Hallucination";

#[tokio::test]
async fn slimes_label_is_the_reference_answer_and_the_dict_carries_the_verdict() {
    let up = Upstream::start(reply(JUDGED)).await;
    let s = judge_server(
        "slime-judge",
        &up,
        "[reward]\nlabels = \"reference\"\nrule = \"prefix\"\nreward_key = \"score\"",
    )
    .await;
    let url = format!("http://{}/slime/reward", s.http_addr);
    let response = "2 + 3 = 5.\n\n5 is even.\n\nSo 5.";
    let got = slime_remote_rm(
        &url,
        json!(chatml_prompt("What is 2 + 3?")),
        response,
        "\\frac{10}{2}",
    )
    .await;
    // `[reward] reward_key` answers with the dict; the judge named paragraph 1 of 3.
    assert!(
        (reward_of(&got, Some("score")) - 1.0 / 3.0).abs() < 1e-6,
        "{got}"
    );
    assert_eq!(got["first_error_index"], json!(1));
    assert_eq!(got["step_count"], json!(3));
    assert_eq!(
        got["category"],
        json!(retrace::pb::ErrorCategory::Hallucination as i32)
    );
    let prompt = up.bodies()[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        prompt.contains("\\frac{10}{2}"),
        "the label is not in the judge's prompt: {prompt}"
    );
    s.stop().await.unwrap();
}

/// The fetched Qwen2.5 tokenizer (scripts/fetch/fetch-tokenizers.sh): the policy's, in these tests.
fn qwen_tokenizer_dir() -> PathBuf {
    let dir = retrace::Env::process()
        .cache_dir()
        .join("tokenizers/qwen2.5");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} is missing: run scripts/fetch/fetch-tokenizers.sh",
        dir.display()
    );
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_score_as_the_text_they_encode() {
    let dir = qwen_tokenizer_dir();
    let extra = format!(
        "[reward]\npolicy_tokenizer = {:?}",
        dir.display().to_string()
    );
    let s = tiny_prm_server("ids-tiny", &extra).await;
    let policy = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let encode = |text: &str| policy.encode(text, false).unwrap().get_ids().to_vec();
    let samples = [
        (QUESTION, RESPONSE),
        (
            "Is 7 prime?",
            "7 has no divisor but 1 and 7.\n\n7 is prime.",
        ),
    ];
    let mut queries = Vec::new();
    let (mut prompt_ids, mut completion_ids) = (Vec::new(), Vec::new());
    for (q, r) in samples {
        let prompt = chatml_prompt(q);
        // The rollout as the trainer holds it: the prompt's ids, then the completion's up to
        // and with its end-of-turn token.
        let completion = format!("{r}<|im_end|>");
        prompt_ids.push(encode(&prompt));
        completion_ids.push(encode(&completion));
        queries.push(format!("{prompt}{completion}"));
    }
    assert_eq!(
        *completion_ids[0].last().unwrap(),
        151645,
        "<|im_end|> is one special token"
    );
    let (status, want) = post(&s, "/get_reward", &json!({"query": queries})).await;
    assert_eq!(status, 200, "{want}");
    let body = json!({"prompt_ids": prompt_ids, "completion_ids": completion_ids});
    let (status, got) = post(&s, "/get_reward", &body).await;
    assert_eq!(status, 200, "{got}");
    // The same traces: the same verdicts, and rewards equal but for the last float bits (the
    // second pass reuses the first's prefix-cached keys and values).
    for k in ["first_error_index", "step_count", "category", "timed_out"] {
        assert_eq!(got["extra_logs"][k], want["extra_logs"][k], "{k}");
    }
    for i in 0..2 {
        assert!(
            (f(&got["rewards"][i]) - f(&want["rewards"][i])).abs() < 1e-5,
            "{got} {want}"
        );
    }
    assert_eq!(got["extra_logs"]["step_count"], json!([3, 2]));
    // One sample as flat lists is answered with scalars, as one string is.
    let one = json!({"prompt_ids": prompt_ids[0], "completion_ids": completion_ids[0]});
    let (_, got) = post(&s, "/get_reward", &one).await;
    assert!(
        (f(&got["rewards"]) - f(&want["rewards"][0])).abs() < 1e-5,
        "{got}"
    );
    assert_eq!(got["extra_logs"]["step_count"], json!(3));

    let mut outside = completion_ids.clone();
    outside[1][3] = 10_000_000;
    let reply = post(
        &s,
        "/get_reward",
        &json!({"prompt_ids": prompt_ids, "completion_ids": outside}),
    )
    .await;
    assert_eq!(
        error_of(&reply),
        (
            400,
            "INVALID_ARGUMENT".into(),
            "completion_ids[1][3]".into()
        )
    );
    let message = reply.1["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("10000000 is not in the policy tokenizer's vocabulary"),
        "{message}"
    );
    let both = json!({"query": queries, "completion_ids": completion_ids});
    let reply = post(&s, "/get_reward", &both).await;
    assert_eq!(
        error_of(&reply),
        (400, "INVALID_ARGUMENT".into(), "query".into())
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn token_ids_without_a_policy_tokenizer_are_refused_and_a_bad_one_stops_the_server() {
    let up = Upstream::start(reply(JUDGED)).await;
    let s = judge_server("ids-none", &up, "").await;
    let reply = post(
        &s,
        "/get_reward",
        &json!({"prompt_ids": [1], "completion_ids": [2]}),
    )
    .await;
    assert_eq!(
        error_of(&reply),
        (400, "INVALID_ARGUMENT".into(), "completion_ids".into())
    );
    assert!(
        reply.1["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[reward] policy_tokenizer")
    );
    assert_eq!(up.hits(), 0);
    s.stop().await.unwrap();

    let text = format!(
        "[[evaluator]]\nname = \"x\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"m\"\n\
         [reward]\npolicy_tokenizer = \"no/such/folder\"\n",
        up.base_url()
    );
    let config = retrace::Config::parse(&text, "test config", &[]).unwrap();
    let e = TestServer::start(config, retrace::default_loader())
        .await
        .handle
        .await
        .unwrap();
    let e = e.unwrap_err().to_string();
    assert!(
        e.contains("reward.policy_tokenizer") && e.contains("no/such/folder"),
        "{e}"
    );
}

/// Posts `body` to `path` with `headers`; fails the test unless an answer comes within
/// `deadline` and `slack` (the upstream never answers, so only the server's deadline can end it).
async fn post_within(
    s: &TestServer,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    deadline: Duration,
) -> (u16, Value) {
    let slack = Duration::from_secs(10);
    let started = Instant::now();
    let reply = tokio::time::timeout(deadline + slack, post_with(s, path, body, headers))
        .await
        .unwrap_or_else(|_| panic!("no answer within {:?}", deadline + slack));
    assert!(
        started.elapsed() >= deadline,
        "answered before its deadline: {reply:?}"
    );
    reply
}

fn one_sample() -> Value {
    json!({"query": format!("{}One.\n\nTwo.<|im_end|>", chatml_prompt("Count to two."))})
}

async fn requests_counted(s: &TestServer, rpc: &str, evaluator: &str, outcome: &str) -> f64 {
    let labels = [("rpc", rpc), ("evaluator", evaluator), ("outcome", outcome)];
    sample(&s.scrape().await, "retrace_requests_total", &labels).unwrap_or(0.0)
}

#[tokio::test]
async fn a_hanging_reward_fails_at_its_deadline_naming_it() {
    let up = Upstream::start(Fault::Slow(Duration::from_secs(3600), JUDGED.into())).await;
    let s = judge_server("hang-error", &up, "[reward]\ntimeout_s = 0.5").await;
    let reply = post_within(
        &s,
        "/get_reward",
        &one_sample(),
        &[],
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(
        error_of(&reply),
        (504, "DEADLINE_EXCEEDED".into(), String::new())
    );
    let message = reply.1["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("deadline was 0.5 s, set by [reward] timeout_s"),
        "{message}"
    );
    // The caller's header wins over the config, and the error says so.
    let header = [("x-request-timeout", "0.2")];
    let reply = post_within(
        &s,
        "/get_reward",
        &one_sample(),
        &header,
        Duration::from_millis(200),
    )
    .await;
    let message = reply.1["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("0.2 s, set by its x-request-timeout header"),
        "{message}"
    );
    assert_eq!(
        requests_counted(&s, "/get_reward", "hang-error", "deadline_exceeded").await,
        2.0
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_hanging_reward_gets_empty_reward_at_its_deadline_when_asked() {
    let up = Upstream::start(Fault::Slow(Duration::from_secs(3600), JUDGED.into())).await;
    let extra = "max_concurrency = 1\n[reward]\ntimeout_s = 0.5\non_timeout = \"empty_reward\"\n\
                 empty_reward = -1.0\nreward_key = \"score\"";
    let s = judge_server("hang-empty", &up, extra).await;
    // A first request, with a longer deadline of its own, holds the judge's one slot...
    let first = {
        let (addr, body) = (s.http_addr, one_sample());
        tokio::spawn(async move {
            let url = format!("http://{addr}/get_reward");
            let r = client()
                .post(url)
                .header("x-request-timeout", "3")
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    up.until_open().await;
    // ...so this one waits in the evaluator's queue and is dropped there at its deadline,
    // before it reaches the judge.
    let (status, got) = post_within(
        &s,
        "/get_reward",
        &one_sample(),
        &[],
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (
            got["rewards"].clone(),
            got["extra_logs"]["timed_out"].clone()
        ),
        (json!(-1.0), json!(1))
    );
    assert_eq!(up.hits(), 1);
    let dropped = [("evaluator", "hang-empty"), ("reason", "deadline")];
    assert_eq!(
        sample(&s.scrape().await, "retrace_dropped_total", &dropped),
        Some(1.0)
    );
    let (status, got) = first.await.unwrap();
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (
            got["rewards"].clone(),
            got["extra_logs"]["timed_out"].clone()
        ),
        (json!(-1.0), json!(1))
    );
    // slime's route, the same way: its dict says the sample timed out.
    let slime =
        json!({"prompt": chatml_prompt("Count to two."), "response": "One.\n\nTwo.", "label": ""});
    let (status, got) =
        post_within(&s, "/slime/reward", &slime, &[], Duration::from_millis(500)).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (got["score"].clone(), got["timed_out"].clone()),
        (json!(-1.0), json!(1))
    );
    // Answered, and still counted as timeouts.
    assert_eq!(
        requests_counted(&s, "/get_reward", "hang-empty", "deadline_exceeded").await,
        2.0
    );
    assert_eq!(
        requests_counted(&s, "/slime/reward", "hang-empty", "deadline_exceeded").await,
        1.0
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn samples_answered_in_time_keep_their_rewards() {
    // The first request the upstream sees is answered, the second never is.
    let up = Upstream::start(Fault::Slow(Duration::from_secs(3600), JUDGED.into())).await;
    up.script([reply(JUDGED)]);
    let extra = "[reward]\ntimeout_s = 1\non_timeout = \"empty_reward\"\nempty_reward = -1.0\nrule = \"prefix\"";
    let s = judge_server("hang-partial", &up, extra).await;
    let two = json!({"query": [one_sample()["query"], one_sample()["query"]]});
    let (status, got) = post_within(&s, "/get_reward", &two, &[], Duration::from_secs(1)).await;
    assert_eq!(status, 200, "{got}");
    let mut timed_out: Vec<i64> = (0..2)
        .map(|i| got["extra_logs"]["timed_out"][i].as_i64().unwrap())
        .collect();
    let late = timed_out
        .iter()
        .position(|t| *t == 1)
        .expect("one sample timed out");
    timed_out.sort();
    assert_eq!(timed_out, [0, 1], "{got}");
    // The judge named paragraph 1 of 2: prefix reward 1/2.
    assert_eq!(got["rewards"][late], json!(-1.0));
    assert_eq!(got["rewards"][1 - late], json!(0.5));
    assert_eq!(got["extra_logs"]["first_error_index"][1 - late], json!(1));
    // The late sample has no verdict, and says so: no first error (-1 would read "every
    // step holds", 0 "the first is wrong", -2 "wrong, no step named") and no trace score (-1
    // is no probability).
    assert_eq!(got["extra_logs"]["first_error_index"][late], json!(-3));
    assert_eq!(got["extra_logs"]["trace_score"][late], json!(-1.0));
    assert_eq!(got["extra_logs"]["step_count"][late], json!(0));
    s.stop().await.unwrap();
}

/// `/get_reward` with two samples: the usual one, then one whose response runs past the
/// evaluator's `max_trace_bytes = 300`.
fn a_short_and_a_long_sample() -> Value {
    let long = "One more step that goes on.\n\n".repeat(20);
    let long = format!("{}{long}<|im_end|>", chatml_prompt("Count to two."));
    json!({"query": [one_sample()["query"], long]})
}

#[tokio::test]
async fn a_sample_over_the_size_limits_gets_its_status_and_the_others_their_rewards() {
    let up = Upstream::start(reply(JUDGED)).await;
    let extra = "max_trace_bytes = 300\n[reward]\nempty_reward = -1.0\nrule = \"prefix\"";
    let s = judge_server("sized", &up, extra).await;
    let (status, got) = post_with(&s, "/get_reward", &a_short_and_a_long_sample(), &[]).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["rewards"], json!([0.5, -1.0]), "{got}");
    assert_eq!(got["status"], json!(["ok", "too_large"]), "{got}");
    assert_eq!(got["extra_logs"]["too_large"], json!([0, 1]), "{got}");
    let detail = got["status_detail"][1].as_str().unwrap();
    assert!(
        detail.starts_with("query[1]") && detail.contains("bytes exceed"),
        "{detail}"
    );
    assert_eq!(got["status_detail"][0], Value::Null, "{got}");
    // The long sample never reached the judge.
    assert_eq!(up.hits(), 1);
    let scrape = s.scrape().await;
    for (state, want) in [("ok", 1.0), ("too_large", 1.0), ("unavailable", 0.0)] {
        let labels = [
            ("route", "/get_reward"),
            ("evaluator", "sized"),
            ("status", state),
        ];
        let got = sample(&scrape, "retrace_reward_samples_total", &labels);
        assert_eq!(got, Some(want), "{state}");
    }
    s.stop().await.unwrap();

    // Asked to, the same batch fails, naming the sample.
    let extra = "max_trace_bytes = 300\n[reward]\non_too_large = \"error\"";
    let s = judge_server("sized-strict", &up, extra).await;
    let (status, got) = post_with(&s, "/get_reward", &a_short_and_a_long_sample(), &[]).await;
    assert_eq!(status, 400, "{got}");
    assert_eq!(got["error"]["field"], json!("query[1]"), "{got}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn an_unavailable_judge_gives_a_stand_in_reward_only_when_asked() {
    let up = Upstream::start(Fault::Status(503, None, "down for maintenance".into())).await;
    let extra = "[reward]\non_unavailable = -2.5";
    let s = judge_server("down", &up, extra).await;
    let (status, got) = post_with(&s, "/get_reward", &one_sample(), &[]).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (got["rewards"].clone(), got["status"].clone()),
        (json!(-2.5), json!("unavailable")),
        "{got}"
    );
    assert_eq!(got["extra_logs"]["unavailable"], json!(1), "{got}");
    s.stop().await.unwrap();
    // By default the request fails, as an evaluator that is down should be retried, not
    // trained on.
    let s = judge_server("down-default", &up, "").await;
    let (status, got) = post_with(&s, "/get_reward", &one_sample(), &[]).await;
    assert_eq!(status, 503, "{got}");
    s.stop().await.unwrap();
}
