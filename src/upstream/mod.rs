//! One reliable HTTP upstream, shared by the LLM judges and the remote (vLLM) PRMs: the JSON
//! exchange with its capped body, the retry and breaker policy, and the limited, metered call.

mod call;
mod http;
pub mod policy;

pub use call::{CallError, CallPolicy, Caller};
pub use http::{AttemptError, Endpoint, MAX_REPLY_BYTES, Raw, error_reason, http_client, snippet};
