//! An evaluator's verdict as a dataset row's fields (`label`, `category`, `rationale`,
//! `labelled_by`, `agreement`): what `record` and `retrace label` both write, and `eval` and
//! `train-head` read back.

use crate::trace::{ErrorCategory, Judgement};
use serde::{Serialize, Serializer};

/// A verdict as a row's fields, in the order a row writes them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VerdictFields {
    /// The first wrong step, -1 when every step holds.
    pub label: i32,
    /// `none` for -1; else the evaluator's category, or none where it names none (a PRM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub category: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rationale: Option<String>,
    /// The evaluator that decided.
    pub labelled_by: String,
    /// A voting judge's agreement, written as its shortest decimal (2/3 as 0.6666667).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "shortest")]
    pub agreement: Option<f32>,
}

impl VerdictFields {
    /// The keys it writes: a row that had them from an earlier verdict drops them first.
    pub const KEYS: [&'static str; 5] =
        ["label", "category", "rationale", "labelled_by", "agreement"];

    /// `labelled_by`'s verdict: its first error (-1 for none) and category by the rule above.
    pub fn new(
        first_error: i32,
        category: ErrorCategory,
        labelled_by: &str,
        rationale: Option<String>,
        agreement: Option<f32>,
    ) -> Self {
        let category = match (first_error, category) {
            (-1, _) => Some(ErrorCategory::None.as_str()),
            (_, ErrorCategory::Unspecified) => None,
            (_, c) => Some(c.as_str()),
        };
        VerdictFields {
            label: first_error,
            category,
            rationale,
            labelled_by: labelled_by.into(),
            agreement,
        }
    }

    /// `labelled_by`'s judgement.
    pub fn of(judged: &Judgement, labelled_by: &str) -> Self {
        VerdictFields::new(
            index(judged.first_error),
            judged.category,
            labelled_by,
            judged.rationale.clone(),
            judged.agreement,
        )
    }

    /// The fields as JSON values, to write over a row's own.
    pub fn to_map(&self) -> serde_json::Map<String, serde_json::Value> {
        // Strings, integers and finite-or-null floats: serialising cannot fail.
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        }
    }
}

/// A first error as a row's `label`: -1 for none.
pub(crate) fn index(first_error: Option<usize>) -> i32 {
    first_error.map_or(-1, |k| i32::try_from(k).unwrap_or(i32::MAX))
}

/// `x` as the f64 whose decimal is `x`'s shortest: read back as f32, it is `x` again, and a
/// JSON value holding it does not print the widened 0.6666666865348816.
fn shortest<S: Serializer>(x: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => s.serialize_f64(x.to_string().parse().unwrap_or(f64::from(*x))),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_category_follows_the_label_and_agreement_is_written_shortest() {
        let v = VerdictFields::new(-1, ErrorCategory::Reasoning, "j", None, Some(2.0 / 3.0));
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"label":-1,"category":"none","labelled_by":"j","agreement":0.6666667}"#
        );
        let v = VerdictFields::new(2, ErrorCategory::Unspecified, "prm", None, None);
        assert_eq!(
            serde_json::Value::Object(v.to_map()),
            json!({"label": 2, "labelled_by": "prm"})
        );
        let v = VerdictFields::new(0, ErrorCategory::Hallucination, "j", Some("r".into()), None);
        assert_eq!(v.category, Some("hallucination"));
        assert!(!v.to_map().contains_key("agreement"));
    }
}
