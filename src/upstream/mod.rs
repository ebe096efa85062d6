//! One reliable HTTP upstream, shared by the LLM judges and the remote (vLLM) PRMs: the JSON
//! exchange with its capped body, the retry and breaker policy, and the limited, metered call.

mod call;
mod config;
mod http;
pub(crate) mod policy;

pub(crate) use call::{CallError, CallPolicy, Caller};
pub use config::UpstreamConfig;
pub use http::SetupError;
pub use http::http_client;
pub(crate) use http::{AttemptError, Endpoint, Raw, snippet};

use crate::env::{Env, Secret};

/// The API key in the environment variable `var` names, when it names one; an error when that
/// variable is not set, so a missing key stops startup rather than failing every request.
pub(crate) fn api_key(var: Option<&str>) -> Result<Option<Secret>, SetupError> {
    match var {
        Some(var) => Env::process()
            .secret(var)
            .map(|key| Some(Secret(key)))
            .ok_or_else(|| SetupError::MissingKey(var.to_string())),
        None => Ok(None),
    }
}
