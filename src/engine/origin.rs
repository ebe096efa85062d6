//! A request's origin: where its trace sits in the caller's body, so errors name the caller's field.

use super::EngineError;
use crate::field::FieldPath;

/// Where a request's trace came from in the caller's body.
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    /// The trace's own field: `trace`, `candidates[2]`, `query[1]`.
    pub at: FieldPath,
    /// The body spells the trace's parts (`steps`, `question`) as fields of their own; when it
    /// doesn't (a reward sample is one string), errors name `at` and say the part in words.
    pub has_parts: bool,
}

impl Origin {
    /// A trace given as a message with its parts as fields (gRPC, `/v1/...`).
    pub fn fields(at: FieldPath) -> Origin {
        Origin {
            at,
            has_parts: true,
        }
    }

    /// A trace given as one string (a reward sample).
    pub fn text(at: FieldPath) -> Origin {
        Origin {
            at,
            has_parts: false,
        }
    }

    /// `e`, with a field an evaluator named relative to the trace made the caller's.
    pub(crate) fn locate(&self, e: EngineError) -> EngineError {
        match e {
            EngineError::Invalid { field, message } if self.has_parts || field.is_root() => {
                EngineError::Invalid {
                    field: self.at.join(&field),
                    message,
                }
            }
            EngineError::Invalid { field, message } => EngineError::Invalid {
                field: self.at.clone(),
                message: format!("{field}: {message}"),
            },
            EngineError::TooLarge {
                field,
                limit,
                message,
            } => match self.locate(EngineError::invalid(field, message)) {
                EngineError::Invalid { field, message } => EngineError::TooLarge {
                    field,
                    limit,
                    message,
                },
                other => other,
            },
            other => other,
        }
    }
}
