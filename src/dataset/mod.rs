//! Input traces: ProcessBench JSON arrays and JSONL rows (ProcessBench or ReTraceQA shape) read
//! one record at a time, each bad row reported with its file and line; labelled for `eval`, and
//! labelled or not for `label` (`Purpose`).
//!
//! Fields (JSON array elements and JSONL lines alike; unknown fields are ignored):
//! - `id` (string or integer; default `<split>-<n>`, n counting rows from 0);
//! - `question` (or ProcessBench's `problem`), required;
//! - `options`: answer options, optional;
//! - `steps`: the chain of thought as steps, or `text`: raw text the server segments;
//! - `label`: index of the first wrong step, -1 when every step holds; required for `eval`,
//!   optional for `label` (checked the same way when present);
//! - `category`: `none`, `misinterpretation`, `hallucination` or `reasoning`, optional;
//! - `reference_answer`, `final_answer_correct`, `generator`, optional;
//! - `dataset`: the split the row counts under; default the file's stem (`gsm8k.json` -> gsm8k).
//!
//! `verdict.rs` writes the other way: an evaluator's verdict as the fields a row carries.

use crate::trace::ErrorCategory;
use serde::Deserialize;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
pub use verdict::VerdictFields;
pub(crate) use verdict::index as verdict_index;

mod verdict;

/// One labelled trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub id: String,
    pub split: String,
    pub question: String,
    pub options: Vec<String>,
    /// Empty when the trace is given as `text`.
    pub steps: Vec<String>,
    pub text: Option<String>,
    /// Always present when read for `eval`.
    pub label: Option<i32>,
    pub category: Option<ErrorCategory>,
    pub reference_answer: Option<String>,
    pub final_answer_correct: Option<bool>,
    pub generator: Option<String>,
    /// Every field of the row as read, kept only when reading for `label` (which writes them
    /// back beside its own).
    pub source: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What rows are read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Purpose {
    /// Scoring against labels: every row needs its `label`.
    #[default]
    Eval,
    /// Making labels: a row may have none, and its fields are kept (`Record::source`).
    Label,
}

/// A bad row (or a broken file): where, and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct DataError {
    pub file: String,
    /// 1-based; 0 when the file could not be read at all.
    pub line: usize,
    pub message: String,
    /// The rest of the file cannot be read (a broken array, an I/O error): `--skip-bad` can't
    /// step over it.
    pub fatal: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawId {
    Text(String),
    Number(i64),
}

#[derive(Deserialize)]
struct RawRecord {
    id: Option<RawId>,
    #[serde(alias = "problem")]
    question: Option<String>,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default)]
    steps: Vec<String>,
    text: Option<String>,
    label: Option<i64>,
    category: Option<String>,
    reference_answer: Option<String>,
    final_answer_correct: Option<bool>,
    dataset: Option<String>,
    generator: Option<String>,
}

/// Where rows come from: a JSON array held in memory (one file at a time), or JSONL streamed.
enum Source {
    Array(ArrayScan),
    Lines(Box<dyn BufRead + Send>, usize),
}

/// Walks the top-level elements of a JSON array without parsing them, keeping line numbers.
struct ArrayScan {
    text: String,
    pos: usize,
    line: usize,
    started: bool,
    done: bool,
}

/// The records of one file, in order. Memory: one JSON array file, or one JSONL line.
pub struct Records {
    file: String,
    split: String,
    source: Source,
    /// Rows seen so far (good and bad), for default ids.
    index: usize,
    failed: bool,
    purpose: Purpose,
}

/// Opens `path`: a JSON array when its first non-blank byte is `[`, else JSONL.
pub fn read_records(path: &Path) -> Result<Records, DataError> {
    let file = path.display().to_string();
    let fatal = |message: String| DataError {
        file: file.clone(),
        line: 0,
        message,
        fatal: true,
    };
    let mut f = File::open(path).map_err(|e| fatal(format!("cannot open: {e}")))?;
    let mut head = [0u8; HEAD];
    let n = f.read(&mut head).map_err(|e| fatal(e.to_string()))?;
    if opens_array(&head[..n]) {
        let bytes = std::fs::read(path).map_err(|e| fatal(format!("cannot read: {e}")))?;
        return records_from_bytes(path, bytes);
    }
    let f = File::open(path).map_err(|e| fatal(format!("cannot open: {e}")))?;
    Ok(Records::new(
        path,
        Source::Lines(Box::new(BufReader::new(f)), 0),
    ))
}

/// The records of `bytes`, read as the file at `path` would be (which names them in errors and
/// gives the default split); a JSON array is held in memory whole either way.
pub fn records_from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Records, DataError> {
    let source = if opens_array(&bytes[..bytes.len().min(HEAD)]) {
        let text = String::from_utf8(bytes).map_err(|e| DataError {
            file: path.display().to_string(),
            line: 0,
            message: format!("cannot read: {e}"),
            fatal: true,
        })?;
        Source::Array(ArrayScan::new(text))
    } else {
        Source::Lines(Box::new(std::io::Cursor::new(bytes)), 0)
    };
    Ok(Records::new(path, source))
}

/// How much of a file decides its shape: a JSON array must open within it.
const HEAD: usize = 512;

fn opens_array(head: &[u8]) -> bool {
    head.iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'[')
}

/// Counts the rows of `path` without parsing them (for the progress bar).
pub fn count_records(path: &Path) -> Result<usize, DataError> {
    let mut records = read_records(path)?;
    let mut n = 0;
    while let Some(item) = records.next_raw() {
        if item.is_ok_and(|(_, s)| !s.trim().is_empty()) {
            n += 1;
        }
    }
    Ok(n)
}

impl ArrayScan {
    fn new(text: String) -> Self {
        ArrayScan {
            text,
            pos: 0,
            line: 1,
            started: false,
            done: false,
        }
    }

    fn skip_ws(&mut self) {
        let b = self.text.as_bytes();
        while self.pos < b.len() && b[self.pos].is_ascii_whitespace() {
            if b[self.pos] == b'\n' {
                self.line += 1;
            }
            self.pos += 1;
        }
    }

    /// The next element as (line, text), or an error message with its line.
    fn next_element(&mut self) -> Option<Result<(usize, String), (usize, String)>> {
        if self.done {
            return None;
        }
        self.skip_ws();
        if !self.started {
            // The caller checked that the text opens with `[`; an empty array ends at once.
            self.started = true;
            self.pos += 1;
            self.skip_ws();
            if self.text.as_bytes().get(self.pos) == Some(&b']') {
                self.done = true;
                return None;
            }
        }
        let b = self.text.as_bytes();
        let (start, start_line) = (self.pos, self.line);
        let (mut depth, mut in_str, mut escaped) = (0usize, false, false);
        while self.pos < b.len() {
            let c = b[self.pos];
            if c == b'\n' {
                self.line += 1;
            }
            if in_str {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_str = false,
                    _ => {}
                }
            } else {
                match c {
                    b'"' => in_str = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' if depth > 0 => depth -= 1,
                    b',' | b']' if depth == 0 => break,
                    _ => {}
                }
            }
            self.pos += 1;
        }
        self.done = true;
        if self.pos >= b.len() {
            return Some(Err((start_line, "the JSON array is not closed".into())));
        }
        let element = self.text[start..self.pos].to_string();
        if b[self.pos] == b',' {
            self.pos += 1;
            self.done = false;
        } else {
            self.pos += 1; // `]`
            self.skip_ws();
            if self.pos < self.text.len() {
                return Some(Err((
                    self.line,
                    "unexpected text after the JSON array".into(),
                )));
            }
        }
        Some(Ok((start_line, element)))
    }
}

impl Records {
    fn new(path: &Path, source: Source) -> Self {
        let split = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "data".into());
        Records {
            file: path.display().to_string(),
            split,
            source,
            index: 0,
            failed: false,
            purpose: Purpose::Eval,
        }
    }

    /// Reads the rows for `purpose` (`Purpose::Eval` unless set).
    pub fn for_purpose(mut self, purpose: Purpose) -> Self {
        self.purpose = purpose;
        self
    }

    /// The next row's line and text, unparsed.
    fn next_raw(&mut self) -> Option<Result<(usize, String), DataError>> {
        if self.failed {
            return None;
        }
        let file = &self.file;
        let result = match &mut self.source {
            Source::Array(scan) => scan.next_element()?.map_err(|(line, message)| DataError {
                file: file.clone(),
                line,
                message,
                fatal: true,
            }),
            Source::Lines(reader, line) => loop {
                let mut buf = String::new();
                *line += 1;
                match reader.read_line(&mut buf) {
                    Ok(0) => return None,
                    Ok(_) if buf.trim().is_empty() => continue,
                    Ok(_) => break Ok((*line, buf)),
                    Err(e) => {
                        break Err(DataError {
                            file: file.clone(),
                            line: *line,
                            message: format!("cannot read: {e}"),
                            fatal: true,
                        });
                    }
                }
            },
        };
        if result.is_err() {
            self.failed = true;
        }
        Some(result)
    }

    fn parse(&self, line: usize, row: &str, index: usize) -> Result<Record, DataError> {
        let bad = |line: usize, message: String| DataError {
            file: self.file.clone(),
            line,
            message,
            fatal: false,
        };
        let raw: RawRecord = serde_json::from_str(row)
            .map_err(|e| bad(line + e.line().saturating_sub(1), e.to_string()))?;
        let split = raw
            .dataset
            .filter(|d| !d.trim().is_empty())
            .unwrap_or_else(|| self.split.clone());
        let id = match raw.id {
            Some(RawId::Text(s)) if !s.trim().is_empty() => s,
            Some(RawId::Number(n)) => n.to_string(),
            Some(RawId::Text(_)) => return Err(bad(line, "`id` is empty".into())),
            None => format!("{split}-{index}"),
        };
        let at = |m: &str| bad(line, format!("row {id:?}: {m}"));
        let question = raw
            .question
            .filter(|q| !q.trim().is_empty())
            .ok_or_else(|| at("`question` (or `problem`) is missing or empty"))?;
        let label = match (raw.label, self.purpose) {
            (None, Purpose::Eval) => return Err(at("`label` is missing")),
            (label, _) => label,
        };
        let text = raw.text.filter(|t| !t.trim().is_empty());
        if raw.steps.is_empty() && text.is_none() {
            return Err(at("give the chain of thought as `steps` or `text`"));
        }
        if let Some(i) = raw.steps.iter().position(|s| s.trim().is_empty()) {
            return Err(at(&format!("steps[{i}] is empty")));
        }
        let (label, category) =
            gold(label, raw.category.as_deref(), raw.steps.len()).map_err(|m| at(&m))?;
        let source = match self.purpose {
            Purpose::Eval => None,
            // The row just parsed as a record, so it is a JSON object.
            Purpose::Label => {
                Some(serde_json::from_str(row).map_err(|e| bad(line, e.to_string()))?)
            }
        };
        Ok(Record {
            id,
            split,
            question,
            options: raw.options,
            steps: raw.steps,
            text,
            label,
            category,
            reference_answer: raw.reference_answer.filter(|r| !r.trim().is_empty()),
            final_answer_correct: raw.final_answer_correct,
            generator: raw.generator.filter(|g| !g.trim().is_empty()),
            source,
        })
    }
}

/// The gold `label` (-1 or a step index, when `n_steps` is known) and `category` (one of the
/// four, consistent with the label), as data gives them; an error says which is wrong.
fn gold(
    label: Option<i64>,
    category: Option<&str>,
    n_steps: usize,
) -> Result<(Option<i32>, Option<ErrorCategory>), String> {
    if let Some(label) = label {
        let in_range = label >= -1 && (n_steps == 0 || label < n_steps as i64);
        if !in_range || label > i64::from(i32::MAX) {
            return Err(format!(
                "`label` {label} is not -1 or a step index (the trace has {n_steps} steps)"
            ));
        }
    }
    let category = match category.filter(|c| !c.trim().is_empty()) {
        None => None,
        Some(c) => match ErrorCategory::parse(c) {
            Some(ErrorCategory::Unspecified) | None => {
                return Err(format!(
                    "`category` {c:?} is not one of none, misinterpretation, hallucination, reasoning"
                ));
            }
            Some(c) => Some(c),
        },
    };
    match (category, label) {
        (Some(ErrorCategory::None), Some(l)) if l != -1 => {
            Err("`category` is none but `label` names a wrong step".into())
        }
        (Some(c), Some(-1)) if c != ErrorCategory::None => {
            Err(format!("`category` is {} but `label` is -1", c.as_str()))
        }
        _ => Ok((label.map(|l| l as i32), category)),
    }
}

impl Records {
    /// The next record with the line it starts on (for errors found after reading, such as a
    /// label past the steps a `text` segments into).
    pub fn next_located(&mut self) -> Option<Result<(usize, Record), DataError>> {
        let (line, text) = match self.next_raw()? {
            Ok(x) => x,
            Err(e) => return Some(Err(e)),
        };
        let index = self.index;
        self.index += 1;
        Some(self.parse(line, &text, index).map(|r| (line, r)))
    }
}

impl Iterator for Records {
    type Item = Result<Record, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_located().map(|r| r.map(|(_, record)| record))
    }
}

/// The files named, each checked to exist, in order.
pub fn check_files(files: &[PathBuf]) -> Result<(), DataError> {
    for f in files {
        if !f.is_file() {
            return Err(DataError {
                file: f.display().to_string(),
                line: 0,
                message: "no such file".into(),
                fatal: true,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
