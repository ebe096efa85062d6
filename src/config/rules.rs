//! The rules that span a table or the whole config: the keys every kind shares, and a cascade
//! naming the others. Each kind checks its own keys; each message names the key at fault.

use super::MAX_CAPACITY;
use super::evaluator::{EvaluatorConfig, KindConfig};
use crate::rule::{Refused, refuse};

/// Checks one evaluator table against the rest (a cascade names others).
pub(super) fn check(e: &EvaluatorConfig, all: &[EvaluatorConfig]) -> Result<(), Refused> {
    if let Some(t) = e.threshold.filter(|t| !(0.0..=1.0).contains(t)) {
        return refuse(format!("threshold must lie in [0, 1], got {t}"));
    }
    if e.max_concurrency == 0 || e.max_concurrency > MAX_CAPACITY {
        return refuse(format!("max_concurrency must lie in [1, {MAX_CAPACITY}]"));
    }
    if e.max_steps == Some(0) || e.max_trace_bytes == Some(0) {
        return refuse("max_steps and max_trace_bytes must be at least 1");
    }
    match &e.kind {
        KindConfig::Prm(p) => p.check(),
        KindConfig::Judge(j) => j.check(),
        KindConfig::Cascade(c) => {
            names(all, "prm", &c.prm, "prm")?;
            names(all, "judge", &c.judge, "judge")?;
            c.check()
        }
    }
}

/// That `key = name` names an evaluator of `kind`.
fn names(all: &[EvaluatorConfig], key: &str, name: &str, kind: &str) -> Result<(), Refused> {
    match all.iter().find(|o| o.name == name) {
        Some(o) if o.kind_name() == kind => Ok(()),
        Some(o) => refuse(format!(
            "{key} {name:?} is a {} evaluator, not a {kind}",
            o.kind_name()
        )),
        None => refuse(format!("{key} {name:?} names no [[evaluator]]")),
    }
}
