//! Judge prompt templates: the six built-in wordings under `prompts/judge/` (math, multiple
//! choice and open questions, each reference-free and reference-based), overrides read from
//! files, and the pure rendering of a trace into one user message.
//!
//! Placeholders are `{question}`, `{options}`, `{reference_answer}` and `{tagged_steps}`, and the
//! optional `{answer_format}`: the reply format of the judge's output mode (`output::answer_format`),
//! which the built-ins end with. A template without it keeps its own wording in every mode. Any
//! other brace text (`\boxed{<index>}`) is left as written, so templates need no escaping.

use super::domain::{Domain, DomainChoice};
use crate::trace::Trace;
use std::fmt;
use std::path::{Path, PathBuf};

/// Whether the judge sees the gold answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Mode {
    ReferenceFree,
    ReferenceBased,
}

/// One of the six templates; its file is `prompts/judge/{domain}-{mode}.txt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TemplateKind {
    pub domain: Domain,
    pub mode: Mode,
}

/// A validated template: every placeholder its kind needs is present, and none it can't fill.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Template {
    kind: TemplateKind,
    text: String,
}

/// One template per kind: the built-ins, some of them replaced by a judge's overrides.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Templates {
    by_kind: [Template; 6],
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum PromptError {
    #[error("judge template {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("judge template {}: missing placeholder {{{placeholder}}}, which a {kind} template needs", path.display())]
    MissingPlaceholder {
        path: PathBuf,
        kind: TemplateKind,
        placeholder: &'static str,
    },
    // A reference-free template that names {reference_answer} would leak nothing (there is no
    // value) but almost certainly means the wrong file was configured; refuse it at load time.
    #[error("judge template {}: placeholder {{{placeholder}}} has no value in a {kind} template", path.display())]
    UnexpectedPlaceholder {
        path: PathBuf,
        kind: TemplateKind,
        placeholder: &'static str,
    },
    #[error("a {kind} prompt needs {what}, and the trace has none")]
    MissingInput {
        kind: TemplateKind,
        what: &'static str,
    },
    /// A fixed `domain` whose wording has no place for the trace's options: refused rather than
    /// judged without them.
    #[error(
        "a {kind} prompt has no place for options, and the trace has some (the judge's domain is fixed; domain = \"auto\" words a trace with options as multiple choice)"
    )]
    UnshownOptions { kind: TemplateKind },
}

impl PromptError {
    /// The trace's field a rendering error is about, when the trace (not a template) is at fault.
    pub(crate) fn field(&self) -> Option<&'static str> {
        match self {
            PromptError::MissingInput {
                what: "options", ..
            }
            | PromptError::UnshownOptions { .. } => Some("options"),
            PromptError::MissingInput { .. } => Some("reference_answer"),
            _ => None,
        }
    }
}

const PLACEHOLDERS: [&str; 5] = [
    "question",
    "options",
    "reference_answer",
    "tagged_steps",
    ANSWER_FORMAT,
];
/// The one placeholder any template may use or leave out.
const ANSWER_FORMAT: &str = "answer_format";

const MATH_FREE: &str = include_str!("../../prompts/judge/math-reference-free.txt");
const MATH_BASED: &str = include_str!("../../prompts/judge/math-reference-based.txt");
const MC_FREE: &str = include_str!("../../prompts/judge/multiple-choice-reference-free.txt");
const MC_BASED: &str = include_str!("../../prompts/judge/multiple-choice-reference-based.txt");
const OPEN_FREE: &str = include_str!("../../prompts/judge/open-reference-free.txt");
const OPEN_BASED: &str = include_str!("../../prompts/judge/open-reference-based.txt");

impl TemplateKind {
    pub(crate) const ALL: [TemplateKind; 6] = [
        TemplateKind::new(Domain::Math, Mode::ReferenceFree),
        TemplateKind::new(Domain::Math, Mode::ReferenceBased),
        TemplateKind::new(Domain::MultipleChoice, Mode::ReferenceFree),
        TemplateKind::new(Domain::MultipleChoice, Mode::ReferenceBased),
        TemplateKind::new(Domain::Open, Mode::ReferenceFree),
        TemplateKind::new(Domain::Open, Mode::ReferenceBased),
    ];

    pub(crate) const fn new(domain: Domain, mode: Mode) -> Self {
        TemplateKind { domain, mode }
    }

    /// The kind a trace calls for: the domain `choice` gives it (`auto`: by its shape, see
    /// `domain::auto`), reference-based when it carries a gold answer.
    pub(crate) fn for_trace(trace: &Trace, choice: DomainChoice) -> Self {
        let domain = choice.domain_for(trace);
        let mode = if trace.reference_answer.is_some() {
            Mode::ReferenceBased
        } else {
            Mode::ReferenceFree
        };
        TemplateKind::new(domain, mode)
    }

    /// The file stem, also the name used in config and logs: `multiple-choice-reference-free`.
    pub(crate) fn name(self) -> &'static str {
        match (self.domain, self.mode) {
            (Domain::Math, Mode::ReferenceFree) => "math-reference-free",
            (Domain::Math, Mode::ReferenceBased) => "math-reference-based",
            (Domain::MultipleChoice, Mode::ReferenceFree) => "multiple-choice-reference-free",
            (Domain::MultipleChoice, Mode::ReferenceBased) => "multiple-choice-reference-based",
            (Domain::Open, Mode::ReferenceFree) => "open-reference-free",
            (Domain::Open, Mode::ReferenceBased) => "open-reference-based",
        }
    }

    #[cfg(test)]
    pub(crate) fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The placeholders this kind must use; it may use no others.
    pub(crate) fn placeholders(self) -> &'static [&'static str] {
        match (self.domain, self.mode) {
            (Domain::Math | Domain::Open, Mode::ReferenceFree) => &["question", "tagged_steps"],
            (Domain::Math | Domain::Open, Mode::ReferenceBased) => {
                &["question", "reference_answer", "tagged_steps"]
            }
            (Domain::MultipleChoice, Mode::ReferenceFree) => {
                &["question", "options", "tagged_steps"]
            }
            (Domain::MultipleChoice, Mode::ReferenceBased) => {
                &["question", "options", "reference_answer", "tagged_steps"]
            }
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }

    fn builtin(self) -> &'static str {
        [
            MATH_FREE, MATH_BASED, MC_FREE, MC_BASED, OPEN_FREE, OPEN_BASED,
        ][self.index()]
    }
}

impl fmt::Display for TemplateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Template {
    /// The built-in wording for `kind` (checked by a unit test, so this can't fail at runtime).
    pub(crate) fn builtin(kind: TemplateKind) -> Template {
        Template {
            kind,
            text: trim_final_newline(kind.builtin()).to_string(),
        }
    }

    /// Validates `text` as a `kind` template; `path` only names it in errors.
    pub(crate) fn new(
        kind: TemplateKind,
        text: &str,
        path: &Path,
    ) -> Result<Template, PromptError> {
        let used = placeholders_in(text);
        let allowed = kind.placeholders();
        if let Some(missing) = allowed.iter().find(|p| !used.contains(p)) {
            return Err(PromptError::MissingPlaceholder {
                path: path.to_path_buf(),
                kind,
                placeholder: missing,
            });
        }
        if let Some(extra) = used
            .iter()
            .find(|p| !allowed.contains(p) && **p != ANSWER_FORMAT)
        {
            return Err(PromptError::UnexpectedPlaceholder {
                path: path.to_path_buf(),
                kind,
                placeholder: extra,
            });
        }
        Ok(Template {
            kind,
            text: trim_final_newline(text).to_string(),
        })
    }

    /// Reads and validates an override for `kind` from `path`.
    pub(crate) fn load(kind: TemplateKind, path: &Path) -> Result<Template, PromptError> {
        let text = std::fs::read_to_string(path).map_err(|source| PromptError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Template::new(kind, &text, path)
    }

    #[cfg(test)]
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The user message for `trace`, with `answer_format` for `{answer_format}`. One pass over
    /// the template, so text in the trace that looks like a placeholder (`{options}` in a
    /// question) is never expanded.
    pub(crate) fn render(&self, trace: &Trace, answer_format: &str) -> Result<String, PromptError> {
        let missing = |what| PromptError::MissingInput {
            kind: self.kind,
            what,
        };
        let mut out = String::with_capacity(self.text.len() + trace.byte_len() * 2);
        let mut rest = self.text.as_str();
        while let Some((before, name, after)) = next_placeholder(rest) {
            out.push_str(before);
            match name {
                "question" => out.push_str(&trace.question),
                ANSWER_FORMAT => out.push_str(answer_format),
                "options" if trace.options.is_empty() => return Err(missing("options")),
                "options" => out.push_str(&options_text(&trace.options)),
                "reference_answer" => match &trace.reference_answer {
                    Some(r) => out.push_str(r),
                    None => return Err(missing("a reference answer")),
                },
                _ => out.push_str(&tagged_steps(trace.step_texts())),
            }
            rest = after;
        }
        out.push_str(rest);
        Ok(out)
    }
}

impl Templates {
    pub(crate) fn builtin() -> Templates {
        Templates {
            by_kind: TemplateKind::ALL.map(Template::builtin),
        }
    }

    /// Replaces the template of `template`'s kind.
    pub(crate) fn set(&mut self, template: Template) {
        let i = template.kind.index();
        self.by_kind[i] = template;
    }

    pub(crate) fn get(&self, kind: TemplateKind) -> &Template {
        &self.by_kind[kind.index()]
    }

    /// Renders `trace` with the template `choice` gives it; a wording without options refuses a
    /// trace that has some (only a fixed domain picks one for such a trace).
    pub(crate) fn render(
        &self,
        trace: &Trace,
        choice: DomainChoice,
        answer_format: &str,
    ) -> Result<String, PromptError> {
        let kind = TemplateKind::for_trace(trace, choice);
        if kind.domain != Domain::MultipleChoice && !trace.options.is_empty() {
            return Err(PromptError::UnshownOptions { kind });
        }
        self.get(kind).render(trace, answer_format)
    }
}

impl Default for Templates {
    fn default() -> Self {
        Templates::builtin()
    }
}

/// Steps as ProcessBench tags them, indexed from 0, so replies index the same way the label does.
pub(crate) fn tagged_steps<'a>(steps: impl IntoIterator<Item = &'a str>) -> String {
    steps
        .into_iter()
        .enumerate()
        .map(|(i, s)| format!("<paragraph_{i}>\n{s}\n</paragraph_{i}>"))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// "(A) text" lines, lettered as `prm::format::question_text` letters them; the API caps options
/// at 26, so letters never repeat.
pub(crate) fn options_text(options: &[String]) -> String {
    options
        .iter()
        .enumerate()
        .map(|(i, o)| format!("({}) {o}", char::from(b'A' + (i % 26) as u8)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A file's final newline is an editor's habit, not part of the prompt.
fn trim_final_newline(text: &str) -> &str {
    let text = text.strip_suffix('\n').unwrap_or(text);
    text.strip_suffix('\r').unwrap_or(text)
}

/// Splits `text` at its first known placeholder: (before, name, after).
fn next_placeholder(text: &str) -> Option<(&str, &'static str, &str)> {
    let mut from = 0;
    while let Some(open) = text[from..].find('{').map(|i| i + from) {
        let tail = &text[open + 1..];
        for name in PLACEHOLDERS {
            if tail.starts_with(name) && tail[name.len()..].starts_with('}') {
                return Some((&text[..open], name, &tail[name.len() + 1..]));
            }
        }
        from = open + 1;
    }
    None
}

fn placeholders_in(mut text: &str) -> Vec<&'static str> {
    let mut found = Vec::new();
    while let Some((_, name, after)) = next_placeholder(text) {
        if !found.contains(&name) {
            found.push(name);
        }
        text = after;
    }
    found
}

#[cfg(test)]
#[path = "prompt_tests.rs"]
mod tests;
