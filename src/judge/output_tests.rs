//! Tests for the output modes: the schema and grammar built per trace, each upstream's dialect,
//! the defaults, the repair text and the refusal test.

use super::*;

#[test]
fn the_schema_bounds_the_index_and_lists_analysis_first() {
    let s = schema(5, Turn::Reply);
    assert_eq!(s["properties"]["earliest_error"]["minimum"], -1);
    assert_eq!(s["properties"]["earliest_error"]["maximum"], 4);
    assert_eq!(
        s["properties"]["error_category"]["enum"],
        json!(["Misinterpretation", "Hallucination", "Reasoning", "None"])
    );
    assert_eq!(s["additionalProperties"], false);
    assert_eq!(
        s["required"],
        json!(["analysis", "earliest_error", "error_category"])
    );
    // Decoders write properties in the order sent, and the body is serialised with sorted keys:
    // the analysis must come first in the text that goes over the wire.
    let wire = s.to_string();
    let at = |k: &str| wire.find(&format!("\"{k}\":{{")).unwrap();
    assert!(at("analysis") < at("earliest_error") && at("earliest_error") < at("error_category"));

    let repair = schema(5, Turn::Repair);
    assert!(repair["properties"].get("analysis").is_none());
    assert_eq!(
        repair["required"],
        json!(["earliest_error", "error_category"])
    );
}

#[test]
fn the_grammar_allows_exactly_the_trace_indices() {
    let g = grammar(3, Turn::Reply);
    assert!(
        g.starts_with("root ::= review \"\\\\boxed{\" verdict\n"),
        "{g}"
    );
    assert!(g.contains("index ::= \"0\" | \"1\" | \"2\"\n"), "{g}");
    assert!(!g.contains("\"3\""), "{g}");
    assert!(g.contains("\"-1}\\nCategory: None\""), "{g}");
    assert!(g.contains("after6 ::= [^{\\\\] | \"\\\\\" after1"), "{g}");
    let repair = grammar(3, Turn::Repair);
    assert!(
        repair.starts_with("root ::= \"\\\\boxed{\" verdict\n"),
        "{repair}"
    );
    assert!(!repair.contains("review"), "{repair}");
}

#[test]
fn each_upstream_gets_its_dialect() {
    let body = |mode, upstream| {
        let mut b = json!({"model": "m"});
        constrain(&mut b, mode, upstream, 4, Turn::Reply);
        b
    };
    for upstream in [
        UpstreamKind::OpenAi,
        UpstreamKind::LlamaCpp,
        UpstreamKind::Vllm,
        UpstreamKind::Sglang,
    ] {
        let b = body(OutputMode::JsonSchema, upstream);
        assert_eq!(b["response_format"]["type"], "json_schema");
        assert_eq!(b["response_format"]["json_schema"]["strict"], true);
        assert_eq!(
            b["response_format"]["json_schema"]["schema"],
            schema(4, Turn::Reply)
        );
        assert_eq!(body(OutputMode::Text, upstream), json!({"model": "m"}));
    }
    let g = json!(grammar(4, Turn::Reply));
    assert_eq!(
        body(OutputMode::Grammar, UpstreamKind::LlamaCpp)["grammar"],
        g
    );
    assert_eq!(
        body(OutputMode::Grammar, UpstreamKind::Vllm)["structured_outputs"]["grammar"],
        g
    );
    assert_eq!(body(OutputMode::Grammar, UpstreamKind::Sglang)["ebnf"], g);
}

#[test]
fn modes_and_kinds_read_from_config_names() {
    #[derive(Deserialize)]
    struct T {
        output: OutputMode,
        upstream: UpstreamKind,
    }
    let t: T = toml::from_str("output = \"json_schema\"\nupstream = \"llama.cpp\"").unwrap();
    assert_eq!(
        (t.output, t.upstream),
        (OutputMode::JsonSchema, UpstreamKind::LlamaCpp)
    );
    assert!(toml::from_str::<T>("output = \"json\"\nupstream = \"vllm\"").is_err());
    assert_eq!(OutputMode::default_for(false), OutputMode::JsonSchema);
    assert_eq!(OutputMode::default_for(true), OutputMode::Text);
}

#[test]
fn the_repair_names_the_range_and_the_refused_index() {
    let oor = ParseError::OutOfRange {
        index: 21,
        n_steps: 5,
    };
    let text = repair_prompt(OutputMode::Text, None, &oor, 5);
    assert!(
        text.starts_with("Your answer 21 is not a paragraph number."),
        "{text}"
    );
    assert!(
        text.contains("There are 5 paragraph(s), numbered 0 to 4."),
        "{text}"
    );
    assert!(text.contains("\\boxed{<index>}"), "{text}");
    let json = repair_prompt(
        OutputMode::JsonSchema,
        None,
        &ParseError::NotJson("eof".into()),
        2,
    );
    assert!(json.starts_with(JSON_REPAIR_PROMPT) && json.ends_with("numbered 0 to 1."));
    let own = repair_prompt(
        OutputMode::Grammar,
        Some("Answer now."),
        &ParseError::NoAnswer,
        1,
    );
    assert_eq!(own, "Answer now.\nThere are 1 paragraph(s), numbered 0.");
}

#[test]
fn a_refusal_names_the_constraint() {
    let cases = [
        // llama.cpp, OpenAI, DeepSeek and a strict gateway, in their own words.
        (400, "Cannot use both json_schema and grammar", true),
        (
            400,
            "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model.",
            true,
        ),
        (400, "This response_format type is unavailable now", true),
        (422, "extra fields not permitted: ebnf", true),
        (
            400,
            "Field 'n': Value must be between 1 <= value <= 2",
            false,
        ),
        (401, "Invalid API Key", false),
        (429, "rate limited on structured_outputs", false),
        (500, "grammar backend crashed", false),
    ];
    for (code, reason, want) in cases {
        assert_eq!(refuses_constraint(code, reason), want, "{code} {reason}");
    }
}
