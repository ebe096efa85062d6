//! Dataset rows: generated rows, written as JSONL and as a JSON array, each read back as the
//! record it describes or refused on its own line, exactly when the documented rules say so.

use super::{cases, pieces};
use proptest::prelude::*;
use retrace::ErrorCategory;
use retrace_cli::{Record, records_from_bytes};
use std::path::Path;

#[derive(Debug, Clone)]
struct Row {
    question: Option<String>,
    steps: Vec<String>,
    text: Option<String>,
    label: i64,
    category: Option<String>,
}

fn row() -> impl Strategy<Value = Row> {
    let words = "[a-z \n]{0,4}";
    let category = prop::sample::select(vec![
        "none",
        "Reasoning",
        "hallucination",
        "misinterpretation",
        "unspecified",
        "bogus",
        " ",
    ]);
    (
        prop::option::of(words),
        prop::collection::vec(words, 0..4),
        prop::option::of(words),
        -2i64..5,
        prop::option::of(category.prop_map(str::to_string)),
    )
        .prop_map(|(question, steps, text, label, category)| Row {
            question,
            steps,
            text,
            label,
            category,
        })
}

/// Whether the reader must accept `row`, by the rules in `crates/retrace-cli/src/common/dataset.rs`'s header.
fn valid(row: &Row) -> bool {
    let blank = |s: &Option<String>| s.as_deref().is_none_or(|s| s.trim().is_empty());
    let label_ok = row.label >= -1 && (row.steps.is_empty() || row.label < row.steps.len() as i64);
    let category = match row.category.as_deref().filter(|c| !c.trim().is_empty()) {
        None => Some(None),
        Some(c) => match ErrorCategory::parse(c) {
            Some(ErrorCategory::Unspecified) | None => None,
            Some(c) => Some(Some(c)),
        },
    };
    let category_ok = match category {
        None => false,
        Some(Some(ErrorCategory::None)) => row.label == -1,
        Some(Some(_)) => row.label != -1,
        Some(None) => true,
    };
    let has_trace = !row.steps.is_empty() || !blank(&row.text);
    !blank(&row.question)
        && has_trace
        && row.steps.iter().all(|s| !s.trim().is_empty())
        && label_ok
        && category_ok
}

fn to_json(row: &Row) -> String {
    let mut v = serde_json::json!({ "steps": row.steps, "label": row.label });
    if let Some(q) = &row.question {
        v["problem"] = q.as_str().into();
    }
    if let Some(t) = &row.text {
        v["text"] = t.as_str().into();
    }
    if let Some(c) = &row.category {
        v["category"] = c.as_str().into();
    }
    v.to_string()
}

fn check(rows: &[Row], bytes: String, first_line: usize) -> Result<(), TestCaseError> {
    let read: Vec<_> = records_from_bytes(Path::new("split.jsonl"), bytes.into_bytes())
        .expect("valid UTF-8")
        .collect();
    prop_assert_eq!(read.len(), rows.len());
    for (i, (row, got)) in rows.iter().zip(read).enumerate() {
        match got {
            Ok(r) => {
                prop_assert!(valid(row), "accepted {:?} as {:?}", row, r);
                prop_assert_eq!(&r, &expected(row, i));
            }
            Err(e) => {
                prop_assert!(!valid(row), "refused {:?}: {}", row, e);
                prop_assert!(!e.fatal);
                prop_assert_eq!(e.line, first_line + i);
            }
        }
    }
    Ok(())
}

fn expected(row: &Row, i: usize) -> Record {
    Record {
        id: format!("split-{i}"),
        split: "split".into(),
        question: row.question.clone().unwrap_or_default(),
        options: Vec::new(),
        steps: row.steps.clone(),
        text: row.text.clone().filter(|t| !t.trim().is_empty()),
        label: Some(row.label as i32),
        category: row
            .category
            .as_deref()
            .filter(|c| !c.trim().is_empty())
            .and_then(ErrorCategory::parse),
        reference_answer: None,
        final_answer_correct: None,
        generator: None,
        source: None,
    }
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn rows_are_read_or_refused_by_the_rules(rows in prop::collection::vec(row(), 1..6)) {
        let lines: Vec<String> = rows.iter().map(to_json).collect();
        check(&rows, lines.iter().map(|l| format!("{l}\n")).collect(), 1)?;
        check(&rows, format!("[\n{}\n]\n", lines.join(",\n")), 2)?;
    }

    #[test]
    fn any_bytes_give_rows_or_errors_and_stop_at_a_fatal_one(
        text in pieces(&["[", "]", "{", "}", ",", "\"", "\\", "\n", " ", "\"label\": -1",
            "\"problem\": \"q\"", "\"steps\": [\"a\"]", ":", "1"], 30),
    ) {
        let Ok(rows) = records_from_bytes(Path::new("x.json"), text.into_bytes()) else {
            return Ok(());
        };
        let mut fatal = false;
        for row in rows {
            prop_assert!(!fatal, "a row after a fatal error");
            if let Err(e) = row {
                prop_assert!(e.line >= 1, "{}", e);
                fatal = e.fatal;
            }
        }
    }
}
