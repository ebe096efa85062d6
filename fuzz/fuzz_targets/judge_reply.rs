//! The judge reply parsers (text and JSON), the vote over their verdicts and the repair turn's
//! text: never a panic, and every verdict in range for the trace.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrace::fuzzing::{OutputMode, refuses_constraint, repair_prompt};
use retrace::fuzzing::{ParseError, Parsed, parse_json_reply, parse_reply, vote};
use retrace::ErrorCategory;

fuzz_target!(|data: &[u8]| {
    // The first byte is the trace's step count (and, for JSON, whether analysis is expected).
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let n_steps = usize::from(first >> 1);
    let reply = String::from_utf8_lossy(rest);
    let text = parse_reply(&reply, n_steps);
    check(&reply, n_steps, &text);
    let json = parse_json_reply(&reply, n_steps, first & 1 == 1).map(|(p, _)| p);
    check(&reply, n_steps, &json);
    for (mode, result) in [(OutputMode::Text, &text), (OutputMode::JsonSchema, &json)] {
        if let Err(e) = result {
            assert!(!repair_prompt(mode, None, e, n_steps).is_empty());
        }
    }
    if let Some(v) = vote(&[text, json]) {
        assert!(v.agreement > 0.0 && v.agreement <= 1.0, "{v:?}");
    }
    let _ = refuses_constraint(400 + u16::from(first), &reply);
});

fn check(reply: &str, n_steps: usize, result: &Result<Parsed, ParseError>) {
    match result {
        Ok(Parsed {
            first_error: None,
            category,
        }) => assert_eq!(*category, ErrorCategory::None),
        Ok(Parsed {
            first_error: Some(i),
            category,
        }) => {
            assert!(*i < n_steps, "index {i} for {n_steps} steps");
            assert_ne!(*category, ErrorCategory::None);
        }
        Err(ParseError::Empty) => assert!(reply.trim().is_empty()),
        Err(ParseError::OutOfRange { index, .. }) => {
            assert!(*index != -1 && (*index < 0 || *index >= n_steps as i64));
        }
        Err(_) => assert!(!reply.trim().is_empty()),
    }
}
