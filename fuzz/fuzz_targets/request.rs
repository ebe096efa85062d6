//! Requests from raw protobuf bytes through the edge's conversion: a bad request is an
//! INVALID_ARGUMENT naming a field, a good one a trace the engine can take as it is.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use retrace::{pb, to_status};
use retrace::EngineError;
use retrace::fuzzing::{parse_evaluate, parse_rank};
use retrace::Trace;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the message type.
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    if which & 1 == 0 {
        let Ok(req) = pb::EvaluateRequest::decode(bytes) else {
            return;
        };
        let raw = req
            .trace
            .as_ref()
            .map(|t| t.text.clone())
            .unwrap_or_default();
        match parse_evaluate(req) {
            Ok(input) => check(&input.trace, &raw),
            Err(e) => refused(&e),
        }
    } else {
        let Ok(req) = pb::RankRequest::decode(bytes) else {
            return;
        };
        let raws: Vec<String> = req.candidates.iter().map(|c| c.text.clone()).collect();
        let n = req.candidates.len();
        match parse_rank(req) {
            Ok(input) => {
                assert_eq!(input.traces.len(), n);
                for (trace, raw) in input.traces.iter().zip(&raws) {
                    check(trace, raw);
                }
            }
            Err(e) => refused(&e),
        }
    }
});

fn check(trace: &Trace, raw: &str) {
    assert!(!trace.question.trim().is_empty());
    assert!(trace.options.len() <= 26 && trace.options.iter().all(|o| !o.trim().is_empty()));
    assert!(!trace.steps.is_empty());
    for step in &trace.steps {
        assert!(!step.text.trim().is_empty());
        if let Some(span) = &step.span {
            assert_eq!(&raw[span.clone()], step.text);
        }
    }
}

fn refused(e: &EngineError) {
    let (EngineError::Invalid { field, .. } | EngineError::TooLarge { field, .. }) = e else {
        panic!("a request refused as something other than bad input: {e:?}");
    };
    let field = field.to_string();
    assert!(!field.is_empty());
    let status = to_status(e);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains(&field), "{status:?}");
}
