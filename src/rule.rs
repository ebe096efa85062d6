//! What a config rule says when it refuses a value: one message that names the key. Each part
//! (a PRM, a judge, an upstream, a cascade) checks its own keys and answers with this.

/// A refused config value; the message names the key and says what would be accepted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Refuses with `message`.
pub(crate) fn refuse<T>(message: impl Into<String>) -> Result<T, Refused> {
    Err(Refused(message.into()))
}

/// Longest a configured timeout or cooldown may be, one hour.
pub(crate) const MAX_SECONDS: f64 = 3600.0;
