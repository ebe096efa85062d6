//! Table tests for the reply parser and the vote, over replies shaped like real judges' output.

use super::*;
use ErrorCategory::Unspecified as U;
use ErrorCategory::{Hallucination as H, Misinterpretation as M, None as N, Reasoning as R};

/// A vote's expected (first_error, category, agreement).
type Want = (Option<usize>, ErrorCategory, f32);
type Sample = Result<Parsed, ParseError>;

fn ok(first_error: Option<usize>, category: ErrorCategory) -> Result<Parsed, ParseError> {
    Ok(Parsed {
        first_error,
        category,
    })
}

#[test]
fn parse_reply_table() {
    let cases: Vec<(&str, &str, usize, Result<Parsed, ParseError>)> = vec![
        (
            "plain box and category",
            "Paragraph 2 adds 7 and 5 to get 13.\n\\boxed{2}\nCategory: Reasoning",
            5,
            ok(Some(2), R),
        ),
        (
            "the last box wins over a quoted one",
            "Paragraph 4 concludes \\boxed{42}, but paragraph 1 is wrong.\n\\boxed{1}\nCategory: Hallucination",
            5,
            ok(Some(1), H),
        ),
        (
            "nested braces: \\text{-1}",
            "Every step holds.\n\\boxed{\\text{-1}}\nCategory: None",
            5,
            ok(None, N),
        ),
        (
            "category forced to None on -1",
            "\\boxed{-1}\nCategory: Reasoning",
            5,
            ok(None, N),
        ),
        (
            "inline math dollars",
            "So the earliest error is $\\boxed{2}$.\nCategory: Misinterpretation",
            5,
            ok(Some(2), M),
        ),
        (
            "display math dollars",
            "$$\\boxed{0}$$\nCategory: Hallucination",
            3,
            ok(Some(0), H),
        ),
        (
            "unicode minus",
            "All paragraphs are fine: $\\boxed{\u{2212}1}$",
            5,
            ok(None, N),
        ),
        (
            "paragraph_3 in the box",
            "\\boxed{paragraph_3}\nCategory: Reasoning",
            5,
            ok(Some(3), R),
        ),
        (
            "escaped underscore in \\text",
            "\\boxed{\\text{paragraph\\_3}}",
            5,
            ok(Some(3), U),
        ),
        (
            "tag in the box",
            "\\boxed{<paragraph_1>}\ncategory: hallucination",
            5,
            ok(Some(1), H),
        ),
        (
            "bold index",
            "\\boxed{\\textbf{2}}\nCategory: Reasoning",
            5,
            ok(Some(2), R),
        ),
        (
            "spaces in the box",
            "\\boxed{ 3 }\nCategory: Reasoning",
            5,
            ok(Some(3), R),
        ),
        ("word none", "\\boxed{None}\nCategory: None", 5, ok(None, N)),
        (
            "words no error",
            "I found nothing wrong.\n\\boxed{\\text{No error}}",
            5,
            ok(None, N),
        ),
        (
            "think stripped first",
            "<think>Maybe \\boxed{0}? No, paragraph 0 is fine.</think>\nParagraph 3 invents a fact.\n\\boxed{3}\nCategory: Hallucination",
            5,
            ok(Some(3), H),
        ),
        (
            "think opened by the chat template",
            "paragraph 0 looks off... \\boxed{0}\nCategory: Reasoning</think>\n\\boxed{4}\nCategory: Misinterpretation",
            5,
            ok(Some(4), M),
        ),
        (
            "think cut off",
            "<think>I believe \\boxed{1} but the reply was cut",
            5,
            Err(ParseError::NoAnswer),
        ),
        (
            "only thinking",
            "<think>long thought</think>\n",
            5,
            Err(ParseError::NoAnswer),
        ),
        (
            "R1-style full reply",
            "<think>\nCheck paragraph 0: fine.\n</think>\n\nThe earliest error is in paragraph 1.\n\n$$\\boxed{1}$$\n\n**Category**: Reasoning",
            4,
            ok(Some(1), R),
        ),
        (
            "index == n_steps is out of range",
            "\\boxed{5}\nCategory: Reasoning",
            5,
            Err(ParseError::OutOfRange {
                index: 5,
                n_steps: 5,
            }),
        ),
        (
            "index below -1 is out of range",
            "\\boxed{-2}",
            5,
            Err(ParseError::OutOfRange {
                index: -2,
                n_steps: 5,
            }),
        ),
        ("-1 is valid with no steps", "\\boxed{-1}", 0, ok(None, N)),
        (
            "markdown bold category",
            "\\boxed{0}\n**Category:** Hallucination",
            5,
            ok(Some(0), H),
        ),
        (
            "category on the box's line, lower case",
            "\\boxed{1} category: misinterpretation",
            5,
            ok(Some(1), M),
        ),
        (
            "category after more prose",
            "\\boxed{1}\n\nParagraph 1 claims wolves avoid the Arctic.\n\nCategory: Hallucination.",
            5,
            ok(Some(1), H),
        ),
        (
            "category in \\text{}",
            "\\boxed{0}\nCategory: \\text{Misinterpretation}",
            5,
            ok(Some(0), M),
        ),
        (
            "error category label",
            "\\boxed{2}\nError category: Reasoning",
            5,
            ok(Some(2), R),
        ),
        ("no category line", "\\boxed{2}", 5, ok(Some(2), U)),
        (
            "None beside an index says nothing",
            "\\boxed{2}\nCategory: None",
            5,
            ok(Some(2), U),
        ),
        (
            "an unlabelled mention is not a category",
            "Paragraph 1 is not a hallucination but a reasoning slip.\n\\boxed{1}",
            5,
            ok(Some(1), U),
        ),
        (
            "a labelled line before the box",
            "Category: Reasoning\n\\boxed{1}",
            5,
            ok(Some(1), R),
        ),
        (
            "after the box beats before it",
            "Category: Reasoning\n\\boxed{1}\nCategory: Hallucination",
            5,
            ok(Some(1), H),
        ),
        (
            "fallback: Answer line",
            "Paragraph 2 misstates the boiling point.\nAnswer: 2\nCategory: Hallucination",
            5,
            ok(Some(2), H),
        ),
        (
            "fallback: bold final answer",
            "**Final answer:** -1",
            5,
            ok(None, N),
        ),
        (
            "fallback: earliest error label",
            "Earliest error: paragraph 3",
            5,
            ok(Some(3), U),
        ),
        (
            "fallback: a bare -1 line",
            "Every paragraph checks out.\n-1",
            5,
            ok(None, N),
        ),
        (
            "fallback: the sentence",
            "The earliest error is in paragraph 2, where 3 x 4 is taken as 11.",
            5,
            ok(Some(2), U),
        ),
        (
            "fallback: a tagged sentence",
            "So the first error occurs at <paragraph_1>.\nCategory: Misinterpretation",
            5,
            ok(Some(1), M),
        ),
        (
            "fallback: out of range still invalid",
            "Answer: 9",
            5,
            Err(ParseError::OutOfRange {
                index: 9,
                n_steps: 5,
            }),
        ),
        (
            "a solved problem is no answer",
            "The answer is 42",
            5,
            Err(ParseError::NoAnswer),
        ),
        (
            "no answer at all",
            "I could not decide which paragraph is wrong.",
            5,
            Err(ParseError::NoAnswer),
        ),
        (
            "a box cut off mid-answer",
            "Paragraph 1 fails, so \\boxed{\\text{1",
            5,
            Err(ParseError::NoAnswer),
        ),
        (
            "an option letter in the box",
            "\\boxed{B}",
            5,
            Err(ParseError::Unreadable("B".into())),
        ),
        (
            "an empty box",
            "\\boxed{}\nCategory: None",
            5,
            Err(ParseError::Unreadable(String::new())),
        ),
        ("empty reply", "", 5, Err(ParseError::Empty)),
        ("blank reply", "  \n\t", 5, Err(ParseError::Empty)),
    ];
    let n = cases.len();
    for (name, reply, n_steps, want) in cases {
        assert_eq!(
            parse_reply(reply, n_steps),
            want,
            "case {name:?}: {reply:?}"
        );
    }
    assert_eq!(n, 46, "update the report's count when adding cases");
}

#[test]
fn vote_table() {
    let p = |k: i64, c| ok(usize::try_from(k).ok(), if k < 0 { N } else { c });
    let no = Err(ParseError::NoAnswer);
    let cases: Vec<(&str, Vec<Sample>, Option<Want>)> = vec![
        (
            "majority",
            vec![p(2, R), p(2, R), p(1, H)],
            Some((Some(2), R, 2.0 / 3.0)),
        ),
        (
            "tie: earliest seen",
            vec![p(1, R), p(2, H), p(2, H), p(1, R)],
            Some((Some(1), R, 0.5)),
        ),
        (
            "tie: earliest seen, -1 first",
            vec![p(-1, N), p(3, R)],
            Some((None, N, 0.5)),
        ),
        (
            "invalid samples don't vote",
            vec![no.clone(), p(2, R), Err(ParseError::Empty)],
            Some((Some(2), R, 1.0)),
        ),
        (
            "no error wins",
            vec![p(-1, N), p(-1, N), p(2, R)],
            Some((None, N, 2.0 / 3.0)),
        ),
        (
            "category among the winners only",
            vec![p(2, R), p(2, R), p(2, H), p(1, H), p(1, H)],
            Some((Some(2), R, 0.6)),
        ),
        (
            "category tie: Hallucination before Reasoning",
            vec![p(2, R), p(2, H)],
            Some((Some(2), H, 1.0)),
        ),
        (
            "category tie: Misinterpretation first",
            vec![p(3, R), p(3, M), p(3, H)],
            Some((Some(3), M, 1.0)),
        ),
        (
            "unspecified doesn't outvote a name",
            vec![p(2, U), p(2, U), p(2, M)],
            Some((Some(2), M, 1.0)),
        ),
        (
            "nobody named a category",
            vec![p(2, U), p(2, U)],
            Some((Some(2), U, 1.0)),
        ),
        (
            "all invalid",
            vec![no.clone(), Err(ParseError::Unreadable("B".into()))],
            None,
        ),
        ("no samples", vec![], None),
    ];
    for (name, samples, want) in cases {
        let got = vote(&samples).map(|v| (v.first_error, v.category, v.agreement));
        match (got, want) {
            (Some((k, c, a)), Some((wk, wc, wa))) => {
                assert_eq!((k, c), (wk, wc), "case {name:?}");
                assert!(
                    (a - wa).abs() < 1e-6,
                    "case {name:?}: agreement {a} != {wa}"
                );
            }
            (got, want) => assert_eq!(got, want, "case {name:?}"),
        }
    }
}

#[test]
fn parsed_replies_vote_as_integers() {
    // ProcessBench votes on raw box strings, so " 2", "2" and "paragraph_2" would split three
    // ways; parsed first, they are one index.
    let replies = [
        "\\boxed{ 2 }",
        "\\boxed{2}",
        "\\boxed{paragraph_2}",
        "\\boxed{1}",
        "\\boxed{1}",
    ];
    let samples: Vec<_> = replies.iter().map(|r| parse_reply(r, 4)).collect();
    let v = vote(&samples).unwrap();
    assert_eq!(v.first_error, Some(2));
    assert!((v.agreement - 0.6).abs() < 1e-6);
}

#[test]
fn the_repair_reply_parses() {
    assert!(REPAIR_PROMPT.contains("\\boxed{<index>}") && REPAIR_PROMPT.contains("Category:"));
    let reply = "\\boxed{1}\nCategory: Reasoning";
    assert_eq!(parse_reply(reply, 2), ok(Some(1), R));
}

#[test]
fn parse_json_reply_table() {
    let oos = |m: &str| Err(ParseError::OutOfSchema(m.to_string()));
    let cases: Vec<(&str, &str, Result<Parsed, ParseError>)> = vec![
        (
            "in the schema",
            r#"{"analysis": "Paragraph 1 adds wrongly.", "earliest_error": 1, "error_category": "Reasoning"}"#,
            ok(Some(1), R),
        ),
        (
            "no error",
            r#"{"analysis": "All fine.", "earliest_error": -1, "error_category": "None"}"#,
            ok(None, N),
        ),
        (
            "-1 overrides a named category",
            r#"{"analysis": "", "earliest_error": -1, "error_category": "Hallucination"}"#,
            ok(None, N),
        ),
        (
            "None beside an index says nothing about the kind",
            r#"{"analysis": "x", "earliest_error": 0, "error_category": "None"}"#,
            ok(Some(0), U),
        ),
        (
            "a code fence and a think block around it",
            "<think>hmm</think>\n```json\n{\"analysis\": \"a\", \"earliest_error\": 2, \"error_category\": \"Misinterpretation\"}\n```",
            ok(Some(2), M),
        ),
        (
            "the index as a string",
            r#"{"analysis": "a", "earliest_error": "2", "error_category": "Reasoning"}"#,
            oos("earliest_error is a string"),
        ),
        (
            "a fractional index",
            r#"{"analysis": "a", "earliest_error": 1.5, "error_category": "Reasoning"}"#,
            oos("earliest_error is a fractional number"),
        ),
        (
            "an unknown category",
            r#"{"analysis": "a", "earliest_error": 1, "error_category": "arithmetic"}"#,
            oos("error_category is \"arithmetic\", not a category name"),
        ),
        (
            "lower-case category",
            r#"{"analysis": "a", "earliest_error": 1, "error_category": "reasoning"}"#,
            oos("error_category is \"reasoning\", not a category name"),
        ),
        (
            "an extra key",
            r#"{"analysis": "a", "earliest_error": 1, "error_category": "Reasoning", "confidence": 0.9}"#,
            oos("unexpected key \"confidence\""),
        ),
        (
            "no analysis",
            r#"{"earliest_error": 1, "error_category": "Reasoning"}"#,
            oos("missing key \"analysis\""),
        ),
        (
            "the problem's answer as the index",
            r#"{"analysis": "a", "earliest_error": 21, "error_category": "Reasoning"}"#,
            Err(ParseError::OutOfRange {
                index: 21,
                n_steps: 5,
            }),
        ),
        ("empty", "  ", Err(ParseError::Empty)),
    ];
    for (name, reply, want) in cases {
        let got = parse_json_reply(reply, 5, true).map(|(p, _)| p);
        assert_eq!(got, want, "{name}");
    }
    // Cut off mid-string, text with a box, an array: none is a JSON object.
    for reply in [
        r#"{"analysis": "Paragraph 0 is"#,
        "\\boxed{1}\nCategory: Reasoning",
        "[1, \"Reasoning\"]",
        "Here it is: {\"analysis\": \"a\", \"earliest_error\": 1, \"error_category\": \"Reasoning\"}",
    ] {
        assert!(
            matches!(
                parse_json_reply(reply, 5, true),
                Err(ParseError::NotJson(_))
            ),
            "{reply}"
        );
    }
    // A repair reply carries the verdict alone; the analysis key is then out of the schema.
    let repair = r#"{"earliest_error": 0, "error_category": "Hallucination"}"#;
    assert_eq!(
        parse_json_reply(repair, 2, false),
        Ok((
            Parsed {
                first_error: Some(0),
                category: H
            },
            None
        ))
    );
    let (_, analysis) = parse_json_reply(
        r#"{"analysis": "Step 1 is off.", "earliest_error": 1, "error_category": "Reasoning"}"#,
        2,
        true,
    )
    .unwrap();
    assert_eq!(analysis.as_deref(), Some("Step 1 is off."));
}

#[test]
fn a_text_reply_to_a_schema_is_read_as_text_but_broken_json_is_not() {
    let text = "Paragraph 1 is wrong.\n\\boxed{1}\nCategory: Reasoning";
    let parsed = parse_ignored_schema(text, 3).expect("plain text").unwrap();
    assert_eq!(parsed.first_error, Some(1));
    // Fenced or cut-off JSON stays JSON: a boxed index inside its analysis is not a verdict.
    for json in [
        r#"{"analysis": "so \boxed{1}", "earliest_error": 1"#,
        "```json\n{\"analysis\": \"\\\\boxed{2}\"",
        r#"[1]"#,
    ] {
        assert!(parse_ignored_schema(json, 3).is_none(), "{json}");
    }
}
