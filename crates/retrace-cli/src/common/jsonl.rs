//! The append-only JSONL files the tools resume from (`eval`'s predictions, `label`'s rows and
//! sidecars): a writer that flushes one line per row, and the mending of a last line a crash cut.

use super::{EvalError, shown};
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// Appends rows, one line each, written whole as they come so a crash loses at most the line in
/// flight.
pub(crate) struct Writer {
    file: File,
    path: String,
}

impl Writer {
    /// Opens `path` for appending, creating it when absent.
    pub(crate) fn append(path: &Path) -> Result<Writer, EvalError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| EvalError::io(format!("opening {}", shown(path)), e))?;
        Ok(Writer {
            file,
            path: shown(path),
        })
    }

    /// Creates `path` empty (replacing what was there).
    pub(crate) fn create(path: &Path) -> Result<Writer, EvalError> {
        let file = File::create(path)
            .map_err(|e| EvalError::io(format!("creating {}", shown(path)), e))?;
        Ok(Writer {
            file,
            path: shown(path),
        })
    }

    pub(crate) fn write(&mut self, row: &impl Serialize) -> Result<(), EvalError> {
        let mut line = serde_json::to_string(row)
            .map_err(|e| EvalError::io(format!("encoding a row for {}", self.path), e.into()))?;
        line.push('\n');
        self.write_line(&line)
    }

    /// Writes `line` (which ends in a newline) as it is.
    pub(crate) fn write_line(&mut self, line: &str) -> Result<(), EvalError> {
        self.file
            .write_all(line.as_bytes())
            .map_err(|e| EvalError::io(format!("writing {}", self.path), e))
    }
}

/// Makes `path` end with a whole line before rows are appended: a last line without its newline
/// is kept (newline added) when `whole` accepts it, else cut off, so its trace is judged again.
/// An absent file is left absent.
pub(crate) fn mend_last_line(path: &Path, whole: impl Fn(&str) -> bool) -> Result<(), EvalError> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(EvalError::io(format!("reading {}", shown(path)), e)),
    };
    let complete = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if complete == text.len() {
        return Ok(());
    }
    let open = |append: bool| {
        OpenOptions::new()
            .write(true)
            .append(append)
            .open(path)
            .map_err(|e| EvalError::io(format!("opening {}", shown(path)), e))
    };
    if whole(&String::from_utf8_lossy(&text[complete..])) {
        open(true)?
            .write_all(b"\n")
            .map_err(|e| EvalError::io(format!("writing {}", shown(path)), e))
    } else {
        tracing::warn!(file = %shown(path), "dropping an incomplete last line");
        open(false)?
            .set_len(complete as u64)
            .map_err(|e| EvalError::io(format!("truncating {}", shown(path)), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_line_is_dropped_and_a_whole_one_ended() {
        let path = std::env::temp_dir().join(format!("retrace-jsonl-{}.jsonl", std::process::id()));
        let parses = |l: &str| serde_json::from_str::<serde_json::Value>(l).is_ok();
        std::fs::write(&path, "{\"a\": 1}\n{\"a\":").unwrap();
        mend_last_line(&path, parses).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\": 1}\n");
        std::fs::write(&path, "{\"a\": 1}").unwrap();
        mend_last_line(&path, parses).unwrap();
        let mut w = Writer::append(&path).unwrap();
        w.write(&serde_json::json!({"b": 2})).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"a\": 1}\n{\"b\":2}\n"
        );
        std::fs::remove_file(&path).unwrap();
        mend_last_line(&path, parses).unwrap();
        assert!(!path.exists(), "an absent file stays absent");
    }
}
