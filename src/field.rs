//! Where in a request a value sits, as a value: named keys and list indices, shown as
//! `trace.steps[2]` or `query[1]`. Each layer builds on the path it was given instead of
//! splicing strings, so an error names the caller's own field.

use std::borrow::Cow;
use std::fmt;

/// A path of keys and indices; empty is the thing itself.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldPath(Vec<Part>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Key(Cow<'static, str>),
    Index(usize),
}

impl FieldPath {
    /// The thing itself: a trace's own path, before the engine knows where the trace sits.
    pub fn root() -> FieldPath {
        FieldPath::default()
    }

    /// The one-key path `name`.
    pub fn key(name: impl Into<Cow<'static, str>>) -> FieldPath {
        FieldPath(vec![Part::Key(name.into())])
    }

    /// This path, then the key `name`.
    pub fn then(mut self, name: impl Into<Cow<'static, str>>) -> FieldPath {
        self.0.push(Part::Key(name.into()));
        self
    }

    /// This path, then item `i` of it.
    pub fn at(mut self, i: usize) -> FieldPath {
        self.0.push(Part::Index(i));
        self
    }

    /// `inner`, a path relative to this one, made absolute.
    pub fn join(&self, inner: &FieldPath) -> FieldPath {
        let mut joined = self.clone();
        joined.0.extend(inner.0.iter().cloned());
        joined
    }

    pub(crate) fn is_root(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<&'static str> for FieldPath {
    fn from(name: &'static str) -> FieldPath {
        FieldPath::key(name)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.0.iter().enumerate() {
            match segment {
                Part::Key(k) if i == 0 => f.write_str(k)?,
                Part::Key(k) => write!(f, ".{k}")?,
                Part::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_render_as_callers_write_them() {
        let steps = FieldPath::root().then("steps").at(2);
        assert_eq!(steps.to_string(), "steps[2]");
        assert_eq!(
            FieldPath::key("trace").join(&steps).to_string(),
            "trace.steps[2]"
        );
        assert_eq!(FieldPath::key("query").at(1).to_string(), "query[1]");
        let candidate = FieldPath::key("candidates").at(0);
        assert_eq!(
            candidate.join(&FieldPath::root()).to_string(),
            "candidates[0]"
        );
        assert!(FieldPath::root().is_root() && !steps.is_root());
    }
}
