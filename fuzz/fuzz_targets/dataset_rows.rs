//! Dataset files (a ProcessBench JSON array or JSONL rows) from arbitrary bytes: every row is a
//! valid record or an error with a line, and nothing is read past a fatal error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrace_cli::{Record, records_from_bytes};
use retrace::ErrorCategory;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(records) = records_from_bytes(Path::new("fuzz.jsonl"), data.to_vec()) else {
        return;
    };
    let lines = data.iter().filter(|&&b| b == b'\n').count() + 1;
    let mut fatal = false;
    for row in records {
        assert!(!fatal, "a row after a fatal error");
        match row {
            Ok(record) => check(&record),
            Err(e) => {
                assert!(e.line >= 1 && e.line <= lines, "{e} ({lines} lines)");
                fatal = e.fatal;
            }
        }
    }
});

fn check(r: &Record) {
    assert!(
        !r.id.trim().is_empty() && !r.question.trim().is_empty(),
        "{r:?}"
    );
    assert!(r.steps.iter().all(|s| !s.trim().is_empty()), "{r:?}");
    assert!(!r.steps.is_empty() || r.text.as_deref().is_some_and(|t| !t.trim().is_empty()));
    if let Some(label) = r.label {
        assert!(label >= -1, "{r:?}");
        assert!(
            r.steps.is_empty() || (label as i64) < r.steps.len() as i64,
            "{r:?}"
        );
    }
    match r.category {
        Some(ErrorCategory::None) => assert_eq!(r.label, Some(-1)),
        Some(ErrorCategory::Unspecified) => panic!("unspecified category read: {r:?}"),
        Some(_) => assert_ne!(r.label, Some(-1)),
        None => {}
    }
}
