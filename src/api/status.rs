//! The one table from engine errors to gRPC status codes, and the outcome label metrics use.

use crate::engine::EngineError;
use tonic::{Code, Status};

/// Most bytes of an error message a status carries: a message echoes the caller's input (an
/// evaluator name, a field), and one past the transport's header limit would replace the status
/// with the transport's own "metadata size exceeds limit".
pub(super) const MAX_MESSAGE_BYTES: usize = 1024;

/// Maps an engine error to its gRPC status: validation -> INVALID_ARGUMENT, overload ->
/// RESOURCE_EXHAUSTED, not ready or upstream down -> UNAVAILABLE, deadline -> DEADLINE_EXCEEDED,
/// caller gone -> CANCELLED, an operator's request the state refuses -> FAILED_PRECONDITION,
/// anything else -> INTERNAL.
pub fn to_status(error: &EngineError) -> Status {
    let code = match error {
        EngineError::Invalid { .. } | EngineError::TooLarge { .. } => Code::InvalidArgument,
        EngineError::Overloaded(_) => Code::ResourceExhausted,
        EngineError::Unavailable(_) => Code::Unavailable,
        EngineError::DeadlineExceeded(_) => Code::DeadlineExceeded,
        EngineError::Cancelled => Code::Cancelled,
        EngineError::Refused(_) => Code::FailedPrecondition,
        EngineError::Internal(_) => Code::Internal,
    };
    Status::new(code, capped(error.to_string()))
}

/// `message` cut to `MAX_MESSAGE_BYTES` at a character boundary, saying how much was cut.
pub(super) fn capped(mut message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let total = message.len();
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(&format!("… ({} more bytes cut)", total - end));
    message
}

/// The status table's HTTP column: what the JSON edge answers for each code.
pub(super) fn http_status(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::InvalidArgument => 400,
        Code::Unauthenticated => 401,
        Code::ResourceExhausted => 429,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
        // nginx's "client closed request": only the logs see it, the caller has gone.
        Code::Cancelled => 499,
        Code::FailedPrecondition => 409,
        _ => 500,
    }
}

/// The code's name as gRPC spells it, for JSON error bodies.
pub(super) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::Unauthenticated => "UNAUTHENTICATED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::Unavailable => "UNAVAILABLE",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::Cancelled => "CANCELLED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

/// The `outcome` label for a request's result: a bounded set of snake_case code names.
pub(crate) fn outcome(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::InvalidArgument => "invalid_argument",
        Code::ResourceExhausted => "resource_exhausted",
        Code::Unavailable => "unavailable",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Cancelled => "cancelled",
        Code::Unauthenticated => "unauthenticated",
        Code::FailedPrecondition => "failed_precondition",
        _ => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases = [
            (
                EngineError::invalid("trace.question", "is required"),
                Code::InvalidArgument,
            ),
            (
                EngineError::Overloaded("full".into()),
                Code::ResourceExhausted,
            ),
            (
                EngineError::Unavailable("loading".into()),
                Code::Unavailable,
            ),
            (
                EngineError::DeadlineExceeded("late".into()),
                Code::DeadlineExceeded,
            ),
            (EngineError::Cancelled, Code::Cancelled),
            (
                EngineError::Refused("bad head".into()),
                Code::FailedPrecondition,
            ),
            (EngineError::Internal("bug".into()), Code::Internal),
        ];
        for (err, code) in cases {
            let status = to_status(&err);
            assert_eq!(status.code(), code, "{err}");
            assert_eq!(status.message(), err.to_string());
        }
        assert_eq!(
            to_status(&EngineError::invalid("trace.steps[2]", "is empty")).message(),
            "trace.steps[2]: is empty"
        );
        let long = EngineError::invalid("evaluator", "é".repeat(4000));
        let message = to_status(&long).message().to_string();
        assert!(message.len() < MAX_MESSAGE_BYTES + 64, "{}", message.len());
        assert!(message.ends_with("more bytes cut)"), "{message}");
        assert_eq!(outcome(Code::Ok), "ok");
        let http: Vec<u16> = [
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::ResourceExhausted,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::FailedPrecondition,
            Code::Internal,
        ]
        .into_iter()
        .map(http_status)
        .collect();
        assert_eq!(http, [400, 401, 429, 503, 504, 409, 500]);
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(outcome(Code::DataLoss), "internal");
    }
}
