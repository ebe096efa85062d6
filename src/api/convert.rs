//! Proto <-> domain conversion at the edge: parse and validate incoming messages, render verdicts.

use super::pb;
use crate::engine::EngineError;
use crate::field::FieldPath;
use crate::segment::segment;
use crate::trace::{DecisionPath, ErrorCategory, Step, Trace, Verdict};
use std::time::Duration;
use tonic::metadata::MetadataMap;

/// Options are lettered A to Z when rendered for a model.
pub(crate) const MAX_OPTIONS: usize = 26;

/// An EvaluateRequest, checked: what the engine needs from it, clock values aside.
#[derive(Debug)]
pub struct EvaluateInput {
    pub id: String,
    pub evaluator: String,
    pub trace: Trace,
    pub threshold: Option<f32>,
}

/// A RankRequest, checked: one trace per candidate, in request order.
#[derive(Debug)]
pub struct RankInput {
    pub id: String,
    pub evaluator: String,
    pub traces: Vec<Trace>,
    pub threshold: Option<f32>,
}

/// Checks an EvaluateRequest; the error names the first bad field.
pub fn parse_evaluate(req: pb::EvaluateRequest) -> Result<EvaluateInput, EngineError> {
    let id = parse_id(req.id)?;
    let trace = req
        .trace
        .ok_or_else(|| EngineError::invalid("trace", "is required"))?;
    let trace = parse_trace(trace, &FieldPath::key("trace"))?;
    let threshold = parse_threshold(req.threshold, "threshold")?;
    Ok(EvaluateInput {
        id,
        evaluator: req.evaluator,
        trace,
        threshold,
    })
}

/// Checks a RankRequest: the question, options and reference answer are the request's, each
/// candidate brings only its steps or text.
pub fn parse_rank(req: pb::RankRequest) -> Result<RankInput, EngineError> {
    let id = parse_id(req.id)?;
    if req.question.trim().is_empty() {
        return Err(EngineError::invalid("question", "is required"));
    }
    if req.candidates.is_empty() {
        return Err(EngineError::invalid(
            "candidates",
            "give at least one candidate",
        ));
    }
    let threshold = parse_threshold(req.threshold, "threshold")?;
    let mut traces = Vec::with_capacity(req.candidates.len());
    for (i, c) in req.candidates.into_iter().enumerate() {
        let at = FieldPath::key("candidates").at(i);
        if !c.question.is_empty() || !c.options.is_empty() || !c.reference_answer.is_empty() {
            return Err(EngineError::invalid(
                at,
                "set question, options and reference_answer on the RankRequest, not on a candidate",
            ));
        }
        let parts = TraceParts {
            question: req.question.clone(),
            options: req.options.clone(),
            reference_answer: req.reference_answer.clone(),
            steps: c.steps,
            text: c.text,
        };
        traces.push(parts.parse(&at)?);
    }
    Ok(RankInput {
        id,
        evaluator: req.evaluator,
        traces,
        threshold,
    })
}

/// Validates a proto trace; errors name the field under `at` (e.g. `trace`, `candidates[2]`).
pub(crate) fn parse_trace(t: pb::Trace, at: &FieldPath) -> Result<Trace, EngineError> {
    if t.question.trim().is_empty() {
        return Err(EngineError::invalid(
            at.clone().then("question"),
            "is required",
        ));
    }
    let parts = TraceParts {
        question: t.question,
        options: t.options,
        reference_answer: t.reference_answer,
        steps: t.steps,
        text: t.text,
    };
    parts.parse(at)
}

/// A trace's parts as a caller gave them: steps, or text the server segments.
#[derive(Debug, Clone, Default)]
pub struct TraceParts {
    pub question: String,
    pub options: Vec<String>,
    /// Empty: reference-free.
    pub reference_answer: String,
    pub steps: Vec<String>,
    pub text: String,
}

impl TraceParts {
    /// Builds the trace; errors name the part under `at`, where the trace sits in the body.
    pub fn parse(self, at: &FieldPath) -> Result<Trace, EngineError> {
        let TraceParts {
            question,
            options,
            reference_answer,
            steps,
            text,
        } = self;
        check_options(&options, at)?;
        let steps = parse_steps(steps, &text, at)?;
        Ok(Trace {
            question,
            options,
            steps,
            reference_answer: (!reference_answer.trim().is_empty()).then_some(reference_answer),
        })
    }
}

fn check_options(options: &[String], at: &FieldPath) -> Result<(), EngineError> {
    if options.len() > MAX_OPTIONS {
        return Err(EngineError::invalid(
            at.clone().then("options"),
            format!(
                "{} options exceed the limit of {MAX_OPTIONS} (lettered A to Z)",
                options.len()
            ),
        ));
    }
    if let Some(i) = options.iter().position(|o| o.trim().is_empty()) {
        return Err(EngineError::invalid(
            at.clone().then("options").at(i),
            "is empty",
        ));
    }
    Ok(())
}

/// The steps as given, or `text` segmented when none are.
fn parse_steps(steps: Vec<String>, text: &str, at: &FieldPath) -> Result<Vec<Step>, EngineError> {
    if !steps.is_empty() {
        if let Some(i) = steps.iter().position(|s| s.trim().is_empty()) {
            return Err(EngineError::invalid(
                at.clone().then("steps").at(i),
                "is empty",
            ));
        }
        return Ok(steps
            .into_iter()
            .map(|text| Step { text, span: None })
            .collect());
    }
    if text.trim().is_empty() {
        return Err(EngineError::invalid(
            at.clone().then("steps"),
            "give the chain of thought as steps or as text",
        ));
    }
    Ok(segment(text)
        .into_iter()
        .map(|span| Step {
            text: text[span.clone()].to_string(),
            span: Some(span),
        })
        .collect())
}

/// Longest caller id: a Rank's candidates each carry it in their verdict, so a longer one would
/// multiply the response by the candidate count.
pub(crate) const MAX_ID_BYTES: usize = 256;

/// Checks a caller's `id`.
pub(crate) fn parse_id(id: String) -> Result<String, EngineError> {
    match id.len() {
        n if n > MAX_ID_BYTES => Err(EngineError::invalid(
            "id",
            format!("is {n} bytes; at most {MAX_ID_BYTES}"),
        )),
        _ => Ok(id),
    }
}

/// Checks an optional threshold override.
pub(crate) fn parse_threshold(
    t: Option<f32>,
    field: &'static str,
) -> Result<Option<f32>, EngineError> {
    match t {
        Some(v) if !(0.0..=1.0).contains(&v) => Err(EngineError::invalid(
            field,
            format!("must lie in [0, 1], got {v}"),
        )),
        other => Ok(other),
    }
}

/// Reads the `grpc-timeout` header: an integer and a unit (H, M, S, m, u, n).
pub(crate) fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

pub(crate) fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

pub(crate) fn category(c: ErrorCategory) -> pb::ErrorCategory {
    match c {
        ErrorCategory::Unspecified => pb::ErrorCategory::Unspecified,
        ErrorCategory::None => pb::ErrorCategory::None,
        ErrorCategory::Misinterpretation => pb::ErrorCategory::Misinterpretation,
        ErrorCategory::Hallucination => pb::ErrorCategory::Hallucination,
        ErrorCategory::Reasoning => pb::ErrorCategory::Reasoning,
    }
}

/// The inverse of `category`; an unknown number reads as unspecified.
pub fn category_from_pb(c: i32) -> ErrorCategory {
    match pb::ErrorCategory::try_from(c) {
        Ok(pb::ErrorCategory::None) => ErrorCategory::None,
        Ok(pb::ErrorCategory::Misinterpretation) => ErrorCategory::Misinterpretation,
        Ok(pb::ErrorCategory::Hallucination) => ErrorCategory::Hallucination,
        Ok(pb::ErrorCategory::Reasoning) => ErrorCategory::Reasoning,
        Ok(pb::ErrorCategory::Unspecified) | Err(_) => ErrorCategory::Unspecified,
    }
}

pub(crate) fn decision_path(p: DecisionPath) -> pb::DecisionPath {
    match p {
        DecisionPath::Prm => pb::DecisionPath::Prm,
        DecisionPath::Judge => pb::DecisionPath::Judge,
        DecisionPath::Escalated => pb::DecisionPath::Escalated,
        DecisionPath::Categorized => pb::DecisionPath::Categorized,
    }
}

/// Renders a verdict; offsets are filled only for steps the server segmented.
pub(crate) fn response(id: String, trace: &Trace, v: Verdict) -> pb::EvaluateResponse {
    let j = &v.judgement;
    let steps = trace
        .steps
        .iter()
        .zip(&j.step_scores)
        .map(|(step, &score)| {
            let (start, end) = step
                .span
                .clone()
                .map_or((0, 0), |r| (r.start as u32, r.end as u32));
            pb::StepVerdict {
                text: step.text.clone(),
                score,
                start,
                end,
            }
        })
        .collect();
    pb::EvaluateResponse {
        id,
        evaluator: v.evaluator.clone(),
        first_error_index: j.error_index(),
        category: category(j.category) as i32,
        steps,
        trace_score: v.trace_score,
        rationale: j.rationale.clone().unwrap_or_default(),
        timing: Some(pb::Timing {
            queue_s: v.queue.as_secs_f64(),
            inference_s: j.inference.as_secs_f64(),
            total_s: v.total.as_secs_f64(),
            tokens_computed: j.tokens.map_or(0, |t| t.0 as u32),
            tokens_reused: j.tokens.map_or(0, |t| t.1 as u32),
        }),
        error: None,
        threshold: v.threshold,
        path: decision_path(j.path) as i32,
        outcome_score: j.outcome.map(|o| o.score),
        agreement: j.agreement,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(question: &str, steps: &[&str], text: &str) -> pb::Trace {
        pb::Trace {
            question: question.into(),
            options: vec![],
            steps: steps.iter().map(|s| s.to_string()).collect(),
            text: text.into(),
            reference_answer: String::new(),
        }
    }

    fn field(r: Result<Trace, EngineError>) -> String {
        match r {
            Err(EngineError::Invalid { field, .. }) => field.to_string(),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn bad_traces_name_the_field() {
        assert_eq!(
            field(parse_trace(
                trace(" ", &["a"], ""),
                &FieldPath::key("trace")
            )),
            "trace.question"
        );
        assert_eq!(
            field(parse_trace(trace("q", &[], ""), &FieldPath::key("trace"))),
            "trace.steps"
        );
        assert_eq!(
            field(parse_trace(
                trace("q", &[], " \n\n "),
                &FieldPath::key("trace")
            )),
            "trace.steps"
        );
        assert_eq!(
            field(parse_trace(
                trace("q", &["a", " "], ""),
                &FieldPath::key("trace")
            )),
            "trace.steps[1]"
        );
        let mut t = trace("q", &["a"], "");
        t.options = vec!["x".into(), "".into()];
        assert_eq!(
            field(parse_trace(t, &FieldPath::key("candidates").at(3))),
            "candidates[3].options[1]"
        );
    }

    #[test]
    fn text_is_segmented_with_offsets() {
        let t = parse_trace(trace("q", &[], "one\n\ntwo "), &FieldPath::key("trace")).unwrap();
        assert_eq!(t.steps.len(), 2);
        assert_eq!(t.steps[1].text, "two");
        assert_eq!(t.steps[1].span, Some(5..8));
        // Steps win over text when both are given.
        let t = parse_trace(trace("q", &["s"], "one\n\ntwo"), &FieldPath::key("trace")).unwrap();
        assert_eq!(t.steps.len(), 1);
        assert_eq!(t.steps[0].span, None);
    }

    #[test]
    fn thresholds_and_timeouts() {
        assert!(parse_threshold(Some(1.5), "threshold").is_err());
        assert!(parse_threshold(Some(f32::NAN), "threshold").is_err());
        assert_eq!(parse_threshold(Some(0.0), "threshold").unwrap(), Some(0.0));
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5x"), None);
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout("1234567890S"), None);
    }
}
