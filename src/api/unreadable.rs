//! Requests tonic could not read before our handlers ran (a message over the decoding limit, a
//! call with no message, a body cut off inside one): answered INVALID_ARGUMENT saying what was
//! wrong, as the status table has it for bad input, and counted; tonic's own OUT_OF_RANGE and
//! INTERNAL would blame the server.

use crate::metrics;
use std::task::{Context, Poll};
use std::time::Instant;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use tonic::{Code, Status};

/// The field our messages name: the request as a whole, since none of it could be read.
const FIELD: &str = "request";

/// What was wrong, in our words, when `status` is one tonic (or our codec) gives a request it
/// could not read; `None` for every other status. tonic's wording is matched exactly (and
/// pinned by tests/it/unreadable.rs over a real HTTP/2 call) so that a status of our own handlers is never taken for one:
/// they answer OUT_OF_RANGE never, and INTERNAL only as `internal error: ...`.
pub(super) fn reason(status: &Status) -> Option<String> {
    let message = status.message();
    match status.code() {
        Code::OutOfRange => {
            let sizes = message
                .strip_prefix("Error, decoded message length too large: found ")?
                .strip_suffix(" bytes")?;
            let (len, limit) = sizes.split_once(" bytes, the limit is: ")?;
            let (len, limit): (u64, u64) = (len.parse().ok()?, limit.parse().ok()?);
            Some(format!(
                "message of {len} bytes exceeds the {} limit",
                bytes(limit)
            ))
        }
        Code::Internal => match message {
            "Missing request message." => Some("is missing: the call carried no message".into()),
            "Unexpected EOF decoding stream." => {
                Some("is cut short: the body ended inside a message".into())
            }
            _ => None,
        },
        // Our codec's own (src/api/codec.rs), already in our words.
        Code::InvalidArgument => message
            .strip_prefix("request: ")
            .filter(|m| m.starts_with("could not be decoded as "))
            .map(str::to_string),
        _ => None,
    }
}

/// `4 MiB` for a whole number of MiB, else the bytes.
fn bytes(n: u64) -> String {
    match n % (1 << 20) {
        0 => format!("{} MiB", n >> 20),
        _ => format!("{n} bytes"),
    }
}

/// Wraps the Evaluator service: a response whose status says the request could not be read
/// (`reason`) becomes INVALID_ARGUMENT `request: ...`, counted in `retrace_requests_total` under
/// the RPC with evaluator `unknown` (the handler, which counts the rest, never ran).
#[derive(Clone)]
pub(crate) struct Readable<S>(pub S);

impl<S: NamedService> NamedService for Readable<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for Readable<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let rpc = rpc_of(request.uri().path());
        let arrived = Instant::now();
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            // Only a trailers-only response (the status in its headers) can be one: tonic
            // answers a request it could not read before any message is sent.
            let Some(status) = Status::from_header_map(response.headers()) else {
                return Ok(response);
            };
            let Some(reason) = reason(&status) else {
                return Ok(response);
            };
            // The codec's INVALID_ARGUMENT is already ours; only the count is missing.
            if let Some(rpc) = rpc {
                metrics::record_request(rpc, "unknown", "invalid_argument", arrived.elapsed());
            }
            tracing::info!(rpc = rpc.unwrap_or("?"), %status, "request could not be read");
            Ok(Status::invalid_argument(format!("{FIELD}: {reason}")).into_http())
        })
    }
}

/// The metrics label of a retrace.v1.Evaluator method, from its path; `None` for any other.
pub(super) fn rpc_of(path: &str) -> Option<&'static str> {
    match path.rsplit_once('/')?.1 {
        "Evaluate" => Some("Evaluate"),
        "EvaluateStream" => Some("EvaluateStream"),
        "Rank" => Some("Rank"),
        "ListEvaluators" => Some("ListEvaluators"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tonics_request_errors_and_leaves_every_other_status_alone() {
        let over = Status::out_of_range(
            "Error, decoded message length too large: found 5242885 bytes, the limit is: 4194304 bytes",
        );
        assert_eq!(
            reason(&over).as_deref(),
            Some("message of 5242885 bytes exceeds the 4 MiB limit")
        );
        let odd_limit = Status::out_of_range(
            "Error, decoded message length too large: found 20 bytes, the limit is: 10 bytes",
        );
        assert_eq!(
            reason(&odd_limit).as_deref(),
            Some("message of 20 bytes exceeds the 10 bytes limit")
        );
        assert!(
            reason(&Status::internal("Missing request message."))
                .unwrap()
                .starts_with("is missing")
        );
        assert!(
            reason(&Status::internal("Unexpected EOF decoding stream."))
                .unwrap()
                .starts_with("is cut short")
        );
        // Statuses our handlers give, and tonic's others, pass through.
        for status in [
            Status::internal("internal error: Missing request message."),
            Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ),
            Status::out_of_range("something else"),
            Status::invalid_argument("trace.question: is required"),
            Status::invalid_argument("request: is something we never say"),
            Status::resource_exhausted("server at capacity: 2 requests in flight"),
        ] {
            assert_eq!(reason(&status), None, "{status:?}");
        }
    }

    #[test]
    fn labels_only_the_evaluators_methods() {
        assert_eq!(rpc_of("/retrace.v1.Evaluator/Rank"), Some("Rank"));
        assert_eq!(rpc_of("/retrace.v1.Evaluator/Nope"), None);
        assert_eq!(rpc_of(""), None);
    }
}
