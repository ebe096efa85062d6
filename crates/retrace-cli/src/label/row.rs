//! One output row of `retrace label`: the input row's fields as read, with the evaluator's
//! verdict written over them as dataset fields (`label`, `category`) that `eval` and
//! `train-head` read, and what it rests on (`rationale`, `labelled_by`, `agreement`).

use crate::common::Record;
use retrace::{ErrorCategory, VerdictFields};
use serde_json::{Map, Value};

/// What the evaluator said about one trace.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Verdict {
    pub(super) evaluator: String,
    /// The first wrong step; -1 when every step holds.
    pub(super) first_error: i32,
    pub(super) category: ErrorCategory,
    /// The steps judged (the server's segmentation when the row gave `text`).
    pub(super) steps: Vec<String>,
    pub(super) rationale: Option<String>,
    pub(super) agreement: Option<f32>,
}

/// `record`'s row with `verdict` on it. Every field the input row had is kept; `id` and
/// `dataset` are written when it had none (the default id, and the file's split), so the row
/// keeps its key wherever it is read; `steps` when it gave only `text`. The input's `label` and
/// `category` (a human's, typically) move to `source_label` and `source_category`, unless the
/// row has a source already (an output labelled again: the first source stays, the previous
/// verdict goes). A category is written only when the evaluator names one (a PRM doesn't).
pub(super) fn build(record: Record, verdict: Verdict) -> Map<String, Value> {
    let mut row = record.source.unwrap_or_default();
    row.entry("id").or_insert_with(|| Value::from(record.id));
    if !row.get("dataset").is_some_and(non_empty_string) {
        row.insert("dataset".into(), Value::from(record.split));
    }
    let has_steps = row
        .get("steps")
        .and_then(Value::as_array)
        .is_some_and(|s| !s.is_empty());
    if !has_steps && !verdict.steps.is_empty() {
        row.insert("steps".into(), Value::from(verdict.steps));
    }
    let relabelled = row.contains_key("source_label") || row.contains_key("source_category");
    if !relabelled {
        for (from, to) in [("label", "source_label"), ("category", "source_category")] {
            if let Some(v) = row.remove(from).filter(|v| !v.is_null()) {
                row.insert(to.into(), v);
            }
        }
    }
    // An input's own values of the written fields are replaced (its `label` and `category`
    // kept first as the source's, above).
    for key in VerdictFields::KEYS {
        row.remove(key);
    }
    let fields = VerdictFields::new(
        verdict.first_error,
        verdict.category,
        &verdict.evaluator,
        verdict.rationale,
        verdict.agreement,
    );
    row.extend(fields.to_map());
    row
}

fn non_empty_string(v: &Value) -> bool {
    v.as_str().is_some_and(|s| !s.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::{Purpose, records_from_bytes};
    use serde_json::json;
    use std::path::Path;

    fn record(line: &str) -> Record {
        records_from_bytes(Path::new("sqa.jsonl"), line.as_bytes().to_vec())
            .unwrap()
            .for_purpose(Purpose::Label)
            .next()
            .unwrap()
            .unwrap()
    }

    fn verdict(first_error: i32, category: ErrorCategory) -> Verdict {
        Verdict {
            evaluator: "judge".into(),
            first_error,
            category,
            steps: vec!["s0".into(), "s1".into()],
            rationale: Some("step 1 is false".into()),
            agreement: Some(0.75),
        }
    }

    #[test]
    fn keeps_every_field_and_moves_the_human_label_aside() {
        let r = record(
            r#"{"id": 7, "problem": "Did Aristotle use a laptop?", "steps": ["a", "b"], "label": -1, "category": "none", "generator": "g", "final_answer_correct": true, "facts": ["x"]}"#,
        );
        let row = build(r, verdict(1, ErrorCategory::Hallucination));
        let want = json!({
            "id": 7, "problem": "Did Aristotle use a laptop?", "steps": ["a", "b"],
            "generator": "g", "final_answer_correct": true, "facts": ["x"], "dataset": "sqa",
            "source_label": -1, "source_category": "none",
            "label": 1, "category": "hallucination", "rationale": "step 1 is false",
            "labelled_by": "judge", "agreement": 0.75,
        });
        assert_eq!(Value::Object(row), want);
        let mut v = verdict(1, ErrorCategory::Reasoning);
        v.agreement = Some(2.0 / 3.0);
        let row = build(record(r#"{"question": "q", "steps": ["a", "b"]}"#), v);
        assert_eq!(
            serde_json::to_string(&row["agreement"]).unwrap(),
            "0.6666667"
        );
    }

    #[test]
    fn an_unlabelled_text_row_gets_id_steps_and_no_source_label() {
        let r = record(r#"{"question": "q?", "text": "s0\n\ns1", "dataset": "strategyqa"}"#);
        let mut v = verdict(-1, ErrorCategory::None);
        v.agreement = None;
        v.rationale = None;
        let row = build(r, v);
        assert_eq!(row["id"], "strategyqa-0");
        assert_eq!(row["dataset"], "strategyqa");
        assert_eq!(row["steps"], json!(["s0", "s1"]));
        assert_eq!(row["text"], "s0\n\ns1");
        assert_eq!(
            (&row["label"], &row["category"]),
            (&json!(-1), &json!("none"))
        );
        for absent in ["source_label", "source_category", "rationale", "agreement"] {
            assert!(!row.contains_key(absent), "{absent}: {row:?}");
        }
    }

    /// Relabelling a labelled output: the first source label stays, the old verdict's fields go.
    #[test]
    fn relabelling_keeps_the_first_source_and_drops_stale_fields() {
        let r = record(
            r#"{"id": "a", "question": "q", "steps": ["x", "y"], "label": 0, "category": "reasoning", "source_label": 1, "rationale": "old", "agreement": 0.5, "labelled_by": "old-judge"}"#,
        );
        let mut v = verdict(1, ErrorCategory::Unspecified);
        v.rationale = None;
        v.agreement = None;
        let row = build(r, v);
        assert_eq!(row["source_label"], 1);
        assert!(!row.contains_key("source_category"));
        assert_eq!(row["label"], 1);
        assert_eq!(row["labelled_by"], "judge");
        for absent in ["category", "rationale", "agreement"] {
            assert!(!row.contains_key(absent), "{absent}: {row:?}");
        }
    }
}
