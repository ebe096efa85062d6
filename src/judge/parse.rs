//! Reading a judge's reply: the earliest wrong paragraph from the last `\boxed{}`, the category
//! line after it, fallbacks for replies without a box, and majority voting over samples.
//!
//! Pure functions only. An unreadable reply is an error, never a guessed verdict: ProcessBench
//! counts an unparseable prediction wrong in both subsets, and so must we.

use crate::trace::ErrorCategory;

/// A reply's verdict; `first_error` is `None` when the judge found every paragraph correct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parsed {
    pub first_error: Option<usize>,
    pub category: ErrorCategory,
}

/// Why a reply carries no verdict. All but `Empty` are worth one repair turn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the reply is empty")]
    Empty,
    #[error("the reply gives no \\boxed{{}} answer")]
    NoAnswer,
    #[error("the answer `{0}` is not a paragraph index")]
    Unreadable(String),
    #[error("paragraph {index} is out of range for {n_steps} steps")]
    OutOfRange { index: i64, n_steps: usize },
    /// A structured reply that is not one JSON object (cut off, or the constraint was ignored).
    #[error("the reply is not a JSON object: {0}")]
    NotJson(String),
    /// A JSON object, but not the schema's: a missing or extra key, a wrong type, an unknown
    /// category. Read no further, since any reading of it would be a guess.
    #[error("the reply's JSON is not in the schema: {0}")]
    OutOfSchema(String),
}

/// The samples' majority verdict.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Vote {
    pub first_error: Option<usize>,
    pub category: ErrorCategory,
    /// Votes for the winner over valid votes, in (0, 1].
    pub agreement: f32,
}

/// The repair turn sent after a reply without a readable answer: only the two final lines.
pub(crate) const REPAIR_PROMPT: &str = "Your reply did not end with the answer in the required form. \
Reply with only these two lines and nothing else:\n\\boxed{<index>}\nCategory: <category>\n\
<index> is the number of the earliest paragraph with an error, or -1 if every paragraph is correct; \
<category> is Misinterpretation, Hallucination, Reasoning, or None when the index is -1.";

const BOX: &str = "\\boxed{";

/// Reads the judge's verdict for a trace of `n_steps` steps.
pub fn parse_reply(reply: &str, n_steps: usize) -> Result<Parsed, ParseError> {
    if reply.trim().is_empty() {
        return Err(ParseError::Empty);
    }
    let text = strip_think(reply);
    let (index, answer_end) = match text.rfind(BOX) {
        Some(start) => {
            let body = start + BOX.len();
            // A box left open means the reply was cut off mid-answer; an earlier box would be a
            // quote from the solution (`\boxed{42}`), not the verdict.
            let close = matching_brace(&text[body..]).ok_or(ParseError::NoAnswer)?;
            let raw = &text[body..body + close];
            let index = read_index(raw).ok_or_else(|| ParseError::Unreadable(raw.trim().into()))?;
            (index, body + close + 1)
        }
        None => fallback(&text).ok_or(ParseError::NoAnswer)?,
    };
    let category = category_line(&text[answer_end..]).or_else(|| category_line(&text));
    verdict(index, n_steps, category)
}

/// Reads a reply written to the output modes' schema (`output::schema`) (with `analysis` when `with_analysis`, as a first
/// reply is; a repair reply has only the verdict): exactly that object, with nothing but
/// whitespace, a `<think>` block or one Markdown code fence around it. Returns the verdict and
/// the analysis.
pub fn parse_json_reply(
    reply: &str,
    n_steps: usize,
    with_analysis: bool,
) -> Result<(Parsed, Option<String>), ParseError> {
    use super::keys::{ANALYSIS, CATEGORY_NAMES, EARLIEST_ERROR, ERROR_CATEGORY};
    if reply.trim().is_empty() {
        return Err(ParseError::Empty);
    }
    let text = strip_think(reply);
    let text = unfence(text.trim());
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ParseError::NotJson(e.to_string()))?;
    let serde_json::Value::Object(object) = value else {
        return Err(ParseError::NotJson(format!(
            "{} is not an object",
            kind_of(&value)
        )));
    };
    let schema_err = |m: String| Err(ParseError::OutOfSchema(m));
    let mut expected = vec![EARLIEST_ERROR, ERROR_CATEGORY];
    if with_analysis {
        expected.insert(0, ANALYSIS);
    }
    if let Some(extra) = object.keys().find(|k| !expected.contains(&k.as_str())) {
        return schema_err(format!("unexpected key {extra:?}"));
    }
    if let Some(missing) = expected.iter().find(|k| !object.contains_key(**k)) {
        return schema_err(format!("missing key {missing:?}"));
    }
    let analysis = match object.get(ANALYSIS) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(other) => return schema_err(format!("{ANALYSIS} is {}", kind_of(other))),
        None => None,
    };
    let index = match &object[EARLIEST_ERROR] {
        serde_json::Value::Number(n) if n.as_i64().is_some() => n.as_i64().unwrap_or_default(),
        other => return schema_err(format!("{EARLIEST_ERROR} is {}", kind_of(other))),
    };
    let category = match &object[ERROR_CATEGORY] {
        serde_json::Value::String(s) if CATEGORY_NAMES.contains(&s.as_str()) => s.as_str(),
        other => return schema_err(format!("{ERROR_CATEGORY} is {other}, not a category name")),
    };
    let category = match category {
        "Misinterpretation" => ErrorCategory::Misinterpretation,
        "Hallucination" => ErrorCategory::Hallucination,
        "Reasoning" => ErrorCategory::Reasoning,
        _ => ErrorCategory::None,
    };
    Ok((verdict(index, n_steps, Some(category))?, analysis))
}

/// A reply asked for under a JSON schema that came back as plain text, because the upstream (a
/// proxy, an older server) dropped `response_format`: read as a text reply. `None` when it looks
/// like JSON, however broken (cut off, out of schema): reading a boxed index out of a broken
/// object's analysis would be a guess.
pub(crate) fn parse_ignored_schema(
    reply: &str,
    n_steps: usize,
) -> Option<Result<Parsed, ParseError>> {
    let text = strip_think(reply);
    let text = unfence(text.trim());
    // A fence left open (a reply cut off inside it) still holds JSON.
    let text = match text.strip_prefix("```") {
        Some(rest) => rest
            .split_once('\n')
            .map_or("", |(_, body)| body)
            .trim_start(),
        None => text,
    };
    if text.starts_with('{') || text.starts_with('[') {
        return None;
    }
    Some(parse_reply(reply, n_steps))
}

/// The inside of one Markdown code fence (```json ... ```), or the text as it is.
fn unfence(text: &str) -> &str {
    let Some(inner) = text.strip_prefix("```").and_then(|t| t.strip_suffix("```")) else {
        return text;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.trim()
}

fn kind_of(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(n) if n.is_f64() => "a fractional number",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The winner among samples: each already an integer index, so "2" and " 2" never split a vote.
/// Ties go to the index seen first, as `Counter.most_common` does in ProcessBench's voting;
/// callers pass samples in request order (choice index), not arrival order, to stay
/// deterministic. Invalid samples don't vote; all invalid gives `None`.
pub fn vote(samples: &[Result<Parsed, ParseError>]) -> Option<Vote> {
    let valid: Vec<&Parsed> = samples.iter().filter_map(|s| s.as_ref().ok()).collect();
    // (index, votes) in first-seen order.
    let mut tally: Vec<(Option<usize>, usize)> = Vec::new();
    for p in &valid {
        match tally.iter_mut().find(|(k, _)| *k == p.first_error) {
            Some((_, n)) => *n += 1,
            None => tally.push((p.first_error, 1)),
        }
    }
    let &(first_error, votes) = tally
        .iter()
        .reduce(|best, t| if t.1 > best.1 { t } else { best })?;
    let category = match first_error {
        None => ErrorCategory::None,
        Some(_) => {
            let named = [
                ErrorCategory::Misinterpretation,
                ErrorCategory::Hallucination,
                ErrorCategory::Reasoning,
            ];
            let count = |c| {
                valid
                    .iter()
                    .filter(|p| p.first_error == first_error && p.category == c)
                    .count()
            };
            // Strictly greater keeps the earlier, higher-priority category on a tie.
            named
                .into_iter()
                .map(|c| (c, count(c)))
                .reduce(|best, c| if c.1 > best.1 { c } else { best })
                .filter(|(_, n)| *n > 0)
                .map_or(ErrorCategory::Unspecified, |(c, _)| c)
        }
    };
    Some(Vote {
        first_error,
        category,
        agreement: votes as f32 / valid.len() as f32,
    })
}

fn verdict(
    index: i64,
    n_steps: usize,
    category: Option<ErrorCategory>,
) -> Result<Parsed, ParseError> {
    match index {
        -1 => Ok(Parsed {
            first_error: None,
            category: ErrorCategory::None,
        }),
        k if k >= 0 && (k as u64) < n_steps as u64 => Ok(Parsed {
            first_error: Some(k as usize),
            // "None" beside a real index contradicts itself; it says nothing about the kind.
            category: match category {
                Some(ErrorCategory::None) | None => ErrorCategory::Unspecified,
                Some(c) => c,
            },
        }),
        index => Err(ParseError::OutOfRange { index, n_steps }),
    }
}

/// Drops `<think>` blocks. An unclosed one was cut off and is all thought; a `</think>` with no
/// opener means the chat template opened the block in the prompt, so all before it is thought.
fn strip_think(reply: &str) -> String {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    let mut out = String::new();
    let mut rest = reply;
    loop {
        match (rest.find(OPEN), rest.find(CLOSE)) {
            (open, Some(close)) if open.is_none_or(|o| close < o) => {
                out.clear();
                rest = &rest[close + CLOSE.len()..];
            }
            (Some(open), close) => {
                out.push_str(&rest[..open]);
                let Some(close) = close else { break };
                rest = &rest[close + CLOSE.len()..];
            }
            (None, _) => {
                out.push_str(rest);
                break;
            }
        }
    }
    out
}

/// Byte offset of the `}` closing a group whose `{` came just before `text`; counting braces
/// is what lets `\boxed{\text{-1}}` through, where ProcessBench's `[^}]*` regex stops early.
fn matching_brace(text: &str) -> Option<usize> {
    let mut depth = 1usize;
    for (i, ch) in text.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// An answer as an integer: LaTeX wrappers, `$`, tags and a "paragraph" prefix removed, the
/// unicode minus read as `-`, and the words for "no error" read as -1.
fn read_index(raw: &str) -> Option<i64> {
    let mut s = raw
        .to_lowercase()
        .replace(['\u{2212}', '\u{2013}'], "-")
        .replace("\\_", "_");
    // Longest first, so `\textbf` isn't left as "bf" by removing `\text`.
    for cmd in [
        "\\textbf", "\\textrm", "\\texttt", "\\mathrm", "\\mathbf", "\\text",
    ] {
        s = s.replace(cmd, "");
    }
    let s: String = s
        .chars()
        .filter(|c| !c.is_whitespace() && !"{}$<>_*`\\()[]".contains(*c))
        .collect();
    let s = s.trim_end_matches('.');
    let s = s.strip_prefix("paragraph").unwrap_or(s);
    match s {
        "none" | "noerror" | "noerrors" | "notfound" | "nomistake" | "nomistakes" => Some(-1),
        _ => s.parse().ok(),
    }
}

/// For replies with no box: first a final answer line ("Answer: 2", "-1"), then a sentence
/// like "the earliest error is in paragraph 2". Returns the index and where it ended.
fn fallback(text: &str) -> Option<(i64, usize)> {
    let last = text
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !is_category_label(l));
    if let Some(line) = last {
        let bare = line.trim_matches(|c: char| c == '*' || c == '#' || c == '`' || c == '>');
        let value = match bare.rsplit_once(':') {
            Some((label, value)) => {
                let label = label.to_ascii_lowercase();
                ["answer", "index", "error", "paragraph"]
                    .iter()
                    .any(|w| label.contains(w))
                    .then_some(value)
            }
            None => Some(bare),
        };
        if let Some(k) = value.and_then(read_index) {
            let end = line.as_ptr() as usize - text.as_ptr() as usize + line.len();
            return Some((k, end));
        }
    }
    // ASCII lowercasing keeps byte offsets, so positions found here index `text` too.
    let lower = text.to_ascii_lowercase();
    let phrase = ["earliest error", "first error"]
        .iter()
        .filter_map(|p| lower.rfind(p).map(|i| i + p.len()))
        .max()?;
    let sentence = lower[phrase..].split(['\n', '.']).next().unwrap_or("");
    let at = phrase + sentence.find("paragraph")? + "paragraph".len();
    let digits_from = at + lower[at..].find(|c: char| !matches!(c, ' ' | '_' | '\\'))?;
    let len = lower[digits_from..]
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len() - digits_from);
    let k = lower[digits_from..digits_from + len].parse().ok()?;
    Some((k, digits_from + len))
}

/// The last labelled category in `text`: a line starting "Category:" (markdown bold, "Error
/// category" and `\text{}` allowed). An unlabelled mention ("not a hallucination") never counts.
fn category_line(text: &str) -> Option<ErrorCategory> {
    text.lines().rev().find_map(category_of_label)
}

fn is_category_label(line: &str) -> bool {
    let lower = line
        .trim_start_matches(|c: char| !c.is_alphanumeric())
        .to_ascii_lowercase();
    lower.starts_with("category") || lower.starts_with("error category")
}

fn category_of_label(line: &str) -> Option<ErrorCategory> {
    if !is_category_label(line) {
        return None;
    }
    let lower = line.to_ascii_lowercase();
    let after = &lower[lower.find("category")? + "category".len()..];
    after
        .split(|c: char| !c.is_ascii_alphabetic())
        .find_map(|word| match word {
            // Only the names the prompt offers: "correct" and "unspecified" are not verdicts.
            "correct" | "unspecified" => None,
            word => ErrorCategory::parse(word),
        })
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
