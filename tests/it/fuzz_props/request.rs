//! Requests as the server receives them (protobuf bytes) through the edge's conversion: refused
//! as INVALID_ARGUMENT naming the first bad field, in the order the checks promise, or accepted
//! as the trace they describe.

use super::cases;
use proptest::prelude::*;
use prost::Message;
use retrace::EngineError;
use retrace::fuzzing::{parse_evaluate, parse_rank, segment};
use retrace::{pb, to_status};

fn trace() -> impl Strategy<Value = pb::Trace> {
    (
        "[ a]{0,2}",
        prop_oneof![
            3 => prop::collection::vec("[ a]{0,2}", 0..3),
            1 => prop::collection::vec("a", 25..28),
        ],
        prop::collection::vec("[ a]{0,2}", 0..3),
        "[ a\n]{0,6}",
        "[ a]{0,2}",
    )
        .prop_map(
            |(question, options, steps, text, reference_answer)| pb::Trace {
                question,
                options,
                steps,
                text,
                reference_answer,
            },
        )
}

fn evaluate_request() -> impl Strategy<Value = pb::EvaluateRequest> {
    (
        prop_oneof![3 => "[a-z]{0,3}", 1 => "[a-z]{255,258}"],
        prop::option::of(trace()),
        prop::option::of(-0.5f32..1.5),
    )
        .prop_map(|(id, trace, threshold)| pb::EvaluateRequest {
            id,
            evaluator: "e".into(),
            trace,
            threshold,
        })
}

/// The field the conversion must name for `req`, or `None` when it must accept it.
fn first_bad_field(req: &pb::EvaluateRequest) -> Option<String> {
    let blank = |s: &str| s.trim().is_empty();
    if req.id.len() > 256 {
        return Some("id".into());
    }
    let Some(t) = &req.trace else {
        return Some("trace".into());
    };
    if blank(&t.question) {
        return Some("trace.question".into());
    }
    if t.options.len() > 26 {
        return Some("trace.options".into());
    }
    if let Some(i) = t.options.iter().position(|o| blank(o)) {
        return Some(format!("trace.options[{i}]"));
    }
    if let Some(i) = t.steps.iter().position(|s| blank(s)) {
        return Some(format!("trace.steps[{i}]"));
    }
    if t.steps.is_empty() && blank(&t.text) {
        return Some("trace.steps".into());
    }
    match req.threshold {
        Some(v) if !(0.0..=1.0).contains(&v) => Some("threshold".into()),
        _ => None,
    }
}

fn invalid_field(e: &EngineError) -> Result<String, TestCaseError> {
    let (EngineError::Invalid { field, .. } | EngineError::TooLarge { field, .. }) = e else {
        return Err(TestCaseError::fail(format!("not bad input: {e:?}")));
    };
    let status = to_status(e);
    prop_assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let field = field.to_string();
    prop_assert!(status.message().contains(&field), "{:?}", status);
    Ok(field)
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn evaluate_requests_are_refused_by_field_or_taken_as_given(req in evaluate_request()) {
        let bytes = req.encode_to_vec();
        let decoded = pb::EvaluateRequest::decode(bytes.as_slice()).expect("our own encoding");
        let want = first_bad_field(&req);
        match parse_evaluate(decoded) {
            Err(e) => prop_assert_eq!(Some(invalid_field(&e)?), want),
            Ok(input) => {
                prop_assert_eq!(want, None);
                let t = req.trace.expect("accepted with a trace");
                prop_assert_eq!((input.id, input.evaluator, input.threshold), (req.id, req.evaluator, req.threshold));
                let steps: Vec<&str> = input.trace.steps.iter().map(|s| s.text.as_str()).collect();
                if t.steps.is_empty() {
                    let spans = segment(&t.text);
                    let segmented: Vec<&str> = spans.iter().map(|s| &t.text[s.clone()]).collect();
                    prop_assert_eq!(steps, segmented);
                    let kept: Vec<_> = input.trace.steps.iter().map(|s| s.span.clone()).collect();
                    prop_assert_eq!(kept, spans.into_iter().map(Some).collect::<Vec<_>>());
                } else {
                    prop_assert_eq!(steps, t.steps.iter().map(String::as_str).collect::<Vec<_>>());
                }
                let reference = (!t.reference_answer.trim().is_empty()).then_some(t.reference_answer);
                prop_assert_eq!(input.trace.reference_answer, reference);
            }
        }
    }

    #[test]
    fn rank_requests_take_their_question_once(
        question in "[ a]{0,2}",
        candidates in prop::collection::vec(trace(), 0..4),
    ) {
        let req = pb::RankRequest { id: "r".into(), question, candidates, ..Default::default() };
        let decoded = pb::RankRequest::decode(req.encode_to_vec().as_slice()).expect("our own encoding");
        match parse_rank(decoded) {
            Ok(input) => {
                prop_assert_eq!(input.traces.len(), req.candidates.len());
                prop_assert!(input.traces.iter().all(|t| t.question == req.question));
            }
            Err(e) => {
                let field = invalid_field(&e)?;
                let known = ["question", "candidates"].contains(&field.as_str()) || field.starts_with("candidates[");
                prop_assert!(known, "{}", field);
            }
        }
    }

    #[test]
    fn any_bytes_decode_to_a_request_or_not_and_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(req) = pb::EvaluateRequest::decode(bytes.as_slice())
            && let Err(e) = parse_evaluate(req)
        {
            invalid_field(&e)?;
        }
        if let Ok(req) = pb::RankRequest::decode(bytes.as_slice())
            && let Err(e) = parse_rank(req)
        {
            invalid_field(&e)?;
        }
    }
}
