//! Judge output modes through the gRPC API against the in-test upstream: the constraint in each
//! upstream's dialect, the fallback to text when an upstream refuses it, schema replies read
//! exactly, out-of-schema replies refused, and repairs that name the paragraphs' range.

use crate::common;

use common::upstream::{Fault, Upstream, reply};
use common::{TestServer, request, steps_trace};
use retrace::Config;
use retrace::pb;
use serde_json::{Value, json};
use tonic::Code;

const IN_SCHEMA: &str = r#"{"analysis": "Paragraph 0 holds. Paragraph 1 says 5 is even, which is false.", "earliest_error": 1, "error_category": "Hallucination"}"#;
const BOXED: &str = "Paragraph 1 is wrong.\n\\boxed{1}\nCategory: Reasoning";

fn judge_table(name: &str, upstream: &Upstream, extra: &str) -> String {
    format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         cache_entries = 0\n{extra}\n\n",
        upstream.base_url()
    )
}

async fn start(text: &str) -> TestServer {
    let config = Config::parse(text, "test config", &[]).expect("valid config");
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

async fn judge(s: &TestServer, evaluator: &str) -> Result<pb::EvaluateResponse, tonic::Status> {
    let trace = steps_trace("What is 2 + 3?", &["2 + 3 = 5.", "5 is even.", "So 5."]);
    let req = request("r", evaluator, trace);
    s.client().await.evaluate(req).await.map(|r| r.into_inner())
}

fn prompt(body: &Value) -> &str {
    body["messages"][0]["content"].as_str().unwrap()
}

#[tokio::test]
async fn the_constraint_is_sent_in_each_upstreams_dialect() {
    let up = Upstream::start(reply(IN_SCHEMA)).await;
    let combos = [
        ("default", ""),
        (
            "openai-json",
            "upstream = \"openai\"\noutput = \"json_schema\"",
        ),
        ("llama-json", "upstream = \"llama.cpp\""),
        ("vllm-json", "upstream = \"vllm\"\noutput = \"json_schema\""),
        (
            "llama-grammar",
            "upstream = \"llama.cpp\"\noutput = \"grammar\"",
        ),
        ("vllm-grammar", "upstream = \"vllm\"\noutput = \"grammar\""),
        (
            "sglang-grammar",
            "upstream = \"sglang\"\noutput = \"grammar\"",
        ),
        ("text", "upstream = \"vllm\"\noutput = \"text\""),
    ];
    let text: String = combos
        .iter()
        .map(|(name, extra)| judge_table(name, &up, extra))
        .collect();
    let s = start(&text).await;
    for (i, (name, _)) in combos.iter().enumerate() {
        let json_mode = name.ends_with("json") || *name == "default";
        up.set_default(reply(if json_mode { IN_SCHEMA } else { BOXED }));
        let r = judge(&s, name).await.unwrap();
        assert_eq!(r.first_error_index, 1, "{name}");
        let body = &up.bodies()[i];
        let constraint_keys: Vec<&str> =
            ["response_format", "grammar", "structured_outputs", "ebnf"]
                .into_iter()
                .filter(|k| body.get(*k).is_some())
                .collect();
        match *name {
            "text" => assert!(constraint_keys.is_empty(), "{name}: {body}"),
            n if json_mode => {
                assert_eq!(constraint_keys, ["response_format"], "{n}");
                let format = &body["response_format"];
                assert_eq!(format["type"], "json_schema");
                assert_eq!(format["json_schema"]["strict"], true);
                let schema = &format["json_schema"]["schema"];
                assert_eq!(schema["properties"]["earliest_error"]["maximum"], 2, "{n}");
                assert_eq!(schema["additionalProperties"], false);
                assert!(prompt(body).contains("\"earliest_error\": <index>"), "{n}");
                assert!(prompt(body).contains("(numbered 0 to 2)"), "{n}");
            }
            n => {
                let key = match n {
                    "llama-grammar" => "grammar",
                    "vllm-grammar" => "structured_outputs",
                    _ => "ebnf",
                };
                assert_eq!(constraint_keys, [key], "{n}");
                let g = match key {
                    "structured_outputs" => body[key]["grammar"].as_str().unwrap(),
                    _ => body[key].as_str().unwrap(),
                };
                assert!(g.contains("index ::= \"0\" | \"1\" | \"2\"\n"), "{n}: {g}");
                assert!(
                    prompt(body).contains("without writing \\boxed{} in it"),
                    "{n}"
                );
            }
        }
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_reply_in_the_schema_is_read_exactly_with_its_analysis_as_rationale() {
    let up = Upstream::start(reply(IN_SCHEMA)).await;
    let s = start(&judge_table("j", &up, "")).await;
    let r = judge(&s, "j").await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Hallucination as i32);
    assert_eq!(
        r.rationale,
        "Paragraph 0 holds. Paragraph 1 says 5 is even, which is false."
    );
    let scores: Vec<f32> = r.steps.iter().map(|s| s.score).collect();
    assert_eq!(scores, [1.0, 0.0, 0.0]);
    assert_eq!(up.hits(), 1);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn an_out_of_schema_reply_is_an_error_after_a_verdict_only_repair() {
    let wrong = r#"{"analysis": "a", "earliest_error": "1", "error_category": "Reasoning"}"#;
    let up = Upstream::start(reply(wrong)).await;
    let s = start(&judge_table("j", &up, "")).await;
    let status = judge(&s, "j").await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status
            .message()
            .contains("not in the schema: earliest_error is a string"),
        "{}",
        status.message()
    );
    assert_eq!(up.hits(), 2, "the reply, then one repair");
    let repair = &up.bodies()[1];
    let schema = &repair["response_format"]["json_schema"]["schema"];
    assert_eq!(
        schema["required"],
        json!(["earliest_error", "error_category"])
    );
    let ask = repair["messages"][2]["content"].as_str().unwrap();
    assert!(
        ask.contains("There are 3 paragraph(s), numbered 0 to 2."),
        "{ask}"
    );

    // A repair in the schema rescues it.
    up.script([
        reply(wrong),
        reply(r#"{"earliest_error": 2, "error_category": "Reasoning"}"#),
    ]);
    let r = judge(&s, "j").await.unwrap();
    assert_eq!(r.first_error_index, 2);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_refused_constraint_falls_back_to_text_once_and_is_remembered() {
    let up = Upstream::start(reply(BOXED)).await;
    let s = start(&judge_table("j", &up, "")).await;
    // OpenAI's words for a model without structured outputs.
    let refusal = "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model.";
    up.script([Fault::Status(400, None, refusal.into())]);
    let r = judge(&s, "j").await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Reasoning as i32);
    assert_eq!(up.hits(), 2);
    let bodies = up.bodies();
    assert!(bodies[0].get("response_format").is_some());
    assert!(bodies[1].get("response_format").is_none());
    assert!(prompt(&bodies[1]).contains("\\boxed{<index>}\nCategory: <category>"));
    // Remembered: the next trace goes straight to text.
    judge(&s, "j").await.unwrap();
    assert_eq!(up.hits(), 3);
    assert!(up.bodies()[2].get("response_format").is_none());
    // Any other 400 is reported, not a reason to drop the schema.
    let s2 = start(&judge_table("j2", &up, "")).await;
    up.script([Fault::Status(400, None, "bad model".into())]);
    assert_eq!(
        judge(&s2, "j2").await.unwrap_err().code(),
        Code::Unavailable
    );
    assert_eq!(up.hits(), 4);
    s.stop().await.unwrap();
    s2.stop().await.unwrap();
}

#[tokio::test]
async fn a_text_index_out_of_range_gets_a_repair_that_names_the_range() {
    let up = Upstream::start(reply(BOXED)).await;
    let s = start(&judge_table("j", &up, "output = \"text\"")).await;
    // The problem's answer boxed instead of a paragraph index, as small models do.
    up.script([reply("2 + 3 = 5, so the answer is \\boxed{21}")]);
    let r = judge(&s, "j").await.unwrap();
    assert_eq!(r.first_error_index, 1);
    let ask = up.bodies()[1]["messages"][2]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        ask.starts_with(
            "Your answer 21 is not a paragraph number. There are 3 paragraph(s), numbered 0 to 2."
        ),
        "{ask}"
    );
    assert!(up.bodies()[1].get("response_format").is_none());
    s.stop().await.unwrap();
}

#[tokio::test]
async fn config_refuses_a_grammar_without_a_grammar_upstream_and_conflicting_constraints() {
    let up = Upstream::start(reply(BOXED)).await;
    let parse = |extra: &str| Config::parse(&judge_table("j", &up, extra), "t.toml", &[]);
    let err = parse("output = \"grammar\"").unwrap_err().to_string();
    assert!(err.contains("output = \"grammar\" needs upstream"), "{err}");
    let err = parse("output = \"json_schema\"\nextra_body = { grammar = 'root ::= \"x\"' }")
        .unwrap_err()
        .to_string();
    assert!(err.contains("extra_body sets `grammar`"), "{err}");
    let err = parse("output = \"json\"").unwrap_err().to_string();
    assert!(err.contains("json_schema"), "{err}");
    let err = parse("upstream = \"ollama\"").unwrap_err().to_string();
    assert!(err.contains("llama.cpp"), "{err}");
    assert!(
        Config::parse(
            "[[evaluator]]\nname = \"p\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"m\"\noutput = \"text\"\n",
            "t.toml",
            &[]
        )
        .unwrap_err()
        .to_string()
        .contains("unknown field `output`")
    );
    // A user's own grammar in extra_body keeps the judge in text mode, with no schema added.
    let s = start(&judge_table(
        "own",
        &up,
        "extra_body = { grammar = 'root ::= \"x\"' }",
    ))
    .await;
    judge(&s, "own").await.unwrap();
    let body = &up.bodies()[0];
    assert!(body.get("response_format").is_none() && body["grammar"] == "root ::= \"x\"");
    s.stop().await.unwrap();
}

/// An upstream that drops `response_format` (some proxies and older servers do) and answers in
/// text: its boxed verdict is read, without a repair turn, and counted so the operator sees it.
#[tokio::test]
async fn a_text_reply_to_a_schema_request_is_read_as_text_and_counted() {
    let up = Upstream::start(reply(BOXED)).await;
    let s = start(&judge_table("j-no-schema", &up, "")).await;
    let r = judge(&s, "j-no-schema").await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Reasoning as i32);
    assert_eq!(up.hits(), 1, "read at once, no repair turn");
    // The request did ask for the schema.
    assert!(up.bodies()[0].get("response_format").is_some());
    let metrics = s.scrape().await;
    let ignored = common::sample(
        &metrics,
        "retrace_judge_schema_ignored_total",
        &[("judge", "j-no-schema")],
    );
    assert_eq!(ignored, Some(1.0), "{metrics}");
    s.stop().await.unwrap();
}
