//! Property tests beside the fuzz targets in `fuzz/`: a few hundred generated cases per parser
//! on every test run, each checked against what the parser promises, not only for panics.

mod config;
mod data;
mod request;

use proptest::prelude::*;
use retrace::ErrorCategory;
use retrace::fuzzing::segment;
use retrace::fuzzing::{ParseError, Parsed, parse_json_reply, parse_reply, vote};

pub(crate) fn cases() -> ProptestConfig {
    ProptestConfig::with_cases(300)
}

/// Text built from the pieces each parser branches on, so that few cases reach deep.
pub(crate) fn pieces(parts: &'static [&'static str], len: usize) -> impl Strategy<Value = String> {
    let part = prop_oneof![
        3 => prop::sample::select(parts).prop_map(str::to_string),
        1 => "\\PC{0,6}",
    ];
    prop::collection::vec(part, 0..len).prop_map(|v| v.concat())
}

const TEXT_PARTS: &[&str] = &[
    "\n",
    "\n\n",
    "\r\n",
    " \t",
    "\u{2003}",
    "\u{85}",
    "\x0c",
    "Step 2: ",
    "step 10) ",
    "3. ",
    "12) ",
    "1.5 ",
    "x",
    "so 2+2=4.",
];

const REPLY_PARTS: &[&str] = &[
    "\\boxed{",
    "}",
    "{",
    "-1",
    "2",
    "paragraph_3",
    "\\text{",
    "<think>",
    "</think>",
    "\n",
    "Category: ",
    "Reasoning",
    "None",
    "**",
    "Answer: ",
    "the earliest error is in paragraph ",
    "\"earliest_error\": ",
    "\"error_category\": \"Hallucination\"",
    "\"analysis\": \"a\"",
    ", ",
    "```json\n",
    "```",
    "\u{2212}",
];

/// Every step's text, in order.
fn texts<'a>(text: &'a str, spans: &[std::ops::Range<usize>]) -> Vec<&'a str> {
    spans.iter().map(|s| &text[s.clone()]).collect()
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn segmentation_rebuilds_the_text_and_is_stable(text in pieces(TEXT_PARTS, 40)) {
        let spans = segment(&text);
        let mut at = 0;
        for span in &spans {
            prop_assert!(at <= span.start && span.start < span.end, "{:?}", spans);
            prop_assert!(text[at..span.start].chars().all(char::is_whitespace));
            let step = &text[span.clone()];
            prop_assert_eq!(step, step.trim());
            at = span.end;
        }
        prop_assert!(text[at..].chars().all(char::is_whitespace));
        prop_assert_eq!(spans.is_empty(), text.trim().is_empty());
        // Its own steps, given back as paragraphs, are segmented into the same steps.
        let steps = texts(&text, &spans);
        let joined = steps.join("\n\n");
        prop_assert_eq!(texts(&joined, &segment(&joined)), steps);
    }

    #[test]
    fn any_reply_reads_as_a_verdict_in_range_or_an_error(
        reply in pieces(REPLY_PARTS, 24),
        n_steps in 0usize..12,
        analysis: bool,
    ) {
        let text = parse_reply(&reply, n_steps);
        let json = parse_json_reply(&reply, n_steps, analysis).map(|(p, _)| p);
        for result in [&text, &json] {
            check_verdict(&reply, n_steps, result)?;
        }
        if let Some(v) = vote(&[text, json]) {
            prop_assert!(v.agreement > 0.0 && v.agreement <= 1.0);
        }
    }

    #[test]
    fn a_well_formed_reply_is_read_back(
        review in "[^\\\\<]{0,80}",
        n_steps in 1usize..40,
        pick: prop::sample::Index,
        named in prop::sample::select(vec!["Misinterpretation", "Hallucination", "Reasoning"]),
    ) {
        let index = pick.index(n_steps + 1) as i64 - 1;
        let name = if index == -1 { "None" } else { named };
        let want = Parsed {
            first_error: usize::try_from(index).ok(),
            category: ErrorCategory::parse(name).expect("a category name"),
        };
        let reply = format!("{review}\n\\boxed{{{index}}}\nCategory: {name}");
        prop_assert_eq!(parse_reply(&reply, n_steps), Ok(want));
        let json = serde_json::json!({
            "analysis": review, "earliest_error": index, "error_category": name,
        });
        let (parsed, analysis) = parse_json_reply(&json.to_string(), n_steps, true).unwrap();
        prop_assert_eq!(parsed, want);
        prop_assert_eq!(analysis.as_deref(), Some(review.as_str()));
    }
}

fn check_verdict(
    reply: &str,
    n_steps: usize,
    result: &Result<Parsed, ParseError>,
) -> Result<(), TestCaseError> {
    match result {
        Ok(p) => match p.first_error {
            None => prop_assert_eq!(p.category, ErrorCategory::None),
            Some(i) => prop_assert!(i < n_steps && p.category != ErrorCategory::None),
        },
        Err(ParseError::Empty) => prop_assert!(reply.trim().is_empty()),
        Err(ParseError::OutOfRange { index, .. }) => {
            prop_assert!(*index != -1 && (*index < 0 || *index >= n_steps as i64))
        }
        Err(_) => prop_assert!(!reply.trim().is_empty()),
    }
    Ok(())
}
