//! What the reuse workloads read and send: the Best-of-N file's questions and sampled
//! candidates, and an Evaluate request for a question's steps.

use anyhow::Context;
use retrace::pb;
use std::path::Path;

/// A Best-of-N line: the instruction every candidate follows, the question, the candidates.
#[derive(serde::Deserialize)]
pub(super) struct Candidates {
    pub(super) instruction: String,
    pub(super) question: String,
    pub(super) candidates: Vec<String>,
}

pub(super) fn read_candidates(path: &Path) -> anyhow::Result<Vec<Candidates>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading {} (scripts/bench/make-best-of-n.sh writes it)",
            path.display()
        )
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), i + 1))
        })
        .collect()
}

/// An Evaluate of the bench evaluator for a question and its steps.
pub(super) fn evaluate(question: String, steps: Vec<String>) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        evaluator: "bench".into(),
        trace: Some(pb::Trace {
            question,
            steps,
            ..Default::default()
        }),
        ..Default::default()
    }
}
