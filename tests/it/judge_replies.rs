//! The reply parsers over real replies: every distinct reply Qwen2.5-Coder-1.5B-Instruct gave
//! through llama-server in scripts/bench/judge-parse-rate.sh's run (json_schema, grammar and text
//! modes, first replies and repairs), each with the verdict an oracle written apart from the
//! parser expects (scripts/bench/judge-parse-rate/build_corpus.py). Among them: grammar replies that
//! began to box the problem's answer and were held to an index by the grammar, reviews cut off by the token budget (unreadable, then
//! repaired), "Here -1" in words (refused), and a bare final "-1" line (read).

use retrace::ErrorCategory;
use retrace::fuzzing::{ParseError, Parsed, parse_json_reply, parse_reply};
use serde_json::Value;

const CORPUS: &str = include_str!("../fixtures/judge-replies.jsonl");

fn category_name(c: ErrorCategory) -> &'static str {
    match c {
        ErrorCategory::None => "none",
        ErrorCategory::Misinterpretation => "misinterpretation",
        ErrorCategory::Hallucination => "hallucination",
        ErrorCategory::Reasoning => "reasoning",
        ErrorCategory::Unspecified => "unspecified",
    }
}

fn error_name(e: &ParseError) -> &'static str {
    match e {
        ParseError::Empty => "empty",
        ParseError::NoAnswer => "no_answer",
        ParseError::Unreadable(_) => "unreadable",
        ParseError::OutOfRange { .. } => "out_of_range",
        ParseError::NotJson(_) => "not_json",
        ParseError::OutOfSchema(_) => "out_of_schema",
    }
}

/// The parse as the corpus writes it: `{"first_error", "category"}` or `{"error"}`.
fn as_expect(parsed: &Result<Parsed, ParseError>) -> Value {
    match parsed {
        Ok(p) => serde_json::json!({
            "first_error": p.first_error.map_or(-1, |k| k as i64),
            "category": category_name(p.category),
        }),
        Err(e) => serde_json::json!({"error": error_name(e)}),
    }
}

#[test]
fn real_replies_parse_as_the_oracle_reads_them() {
    let cases: Vec<Value> = CORPUS
        .lines()
        .map(|l| serde_json::from_str(l).expect("a corpus line is JSON"))
        .collect();
    let mut modes = std::collections::BTreeMap::<&str, usize>::new();
    for (i, c) in cases.iter().enumerate() {
        let mode = c["mode"].as_str().unwrap();
        let reply = c["reply"].as_str().unwrap();
        let n_steps = c["n_steps"].as_u64().unwrap() as usize;
        let parsed = match mode {
            "json_schema" => parse_json_reply(reply, n_steps, c["turn"] == "reply").map(|(p, _)| p),
            _ => parse_reply(reply, n_steps),
        };
        // A hand-checked case carries a "note" beside its verdict.
        let mut expect = c["expect"].clone();
        expect.as_object_mut().unwrap().remove("note");
        assert_eq!(
            as_expect(&parsed),
            expect,
            "case {i} ({mode}, {} paragraphs): {reply}",
            n_steps
        );
        *modes.entry(mode).or_default() += 1;
    }
    // The corpus covers every mode, so a mode's parser can't drop out of this test unseen.
    for mode in ["json_schema", "grammar", "text"] {
        assert!(
            modes.get(mode).is_some_and(|n| *n >= 10),
            "{mode}: {modes:?}"
        );
    }
}
