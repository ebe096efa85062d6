//! The files of a `label` run and what a rerun makes of them: OUT (rows at or above the
//! agreement bar), OUT's held-back sidecar (rows below it), OUT's failures sidecar (rows the
//! last run could not label, retried); the keys a rerun skips; rows moved across a changed bar.

use crate::common::Key;
use crate::common::{DataError, EvalError, jsonl};
use serde::Deserialize;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// OUT and its sidecars.
#[derive(Debug, Clone)]
pub(super) struct Paths {
    pub(super) out: PathBuf,
    /// `OUT-STEM.below-agreement.jsonl`: labelled rows below `--min-agreement`.
    pub(super) held: PathBuf,
    /// `OUT-STEM.failed.jsonl`: the rows the latest run failed on, with the error.
    pub(super) failed: PathBuf,
}

impl Paths {
    pub(super) fn new(out: &Path) -> Paths {
        let stem = out
            .file_stem()
            .map_or_else(|| "labels".into(), |s| s.to_string_lossy().into_owned());
        let beside = |suffix: &str| out.with_file_name(format!("{stem}.{suffix}.jsonl"));
        Paths {
            out: out.to_path_buf(),
            held: beside("below-agreement"),
            failed: beside("failed"),
        }
    }
}

/// What OUT and the held-back file hold, once the bar of this run applies to them.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Resume {
    /// Keys already labelled (in either file): not judged again.
    pub(super) done: HashSet<Key>,
    /// Rows moved from the held-back file into OUT: they meet this run's bar.
    pub(super) admitted: usize,
    /// Rows moved from OUT to the held-back file: they fall below this run's bar.
    pub(super) held_back: usize,
}

/// The fields a rerun reads of a row already written.
#[derive(Deserialize)]
struct Written {
    id: Option<serde_json::Value>,
    dataset: Option<String>,
    labelled_by: Option<String>,
    agreement: Option<f32>,
}

/// One row of OUT or the held-back file: its line, key and agreement.
struct Line {
    text: String,
    key: Key,
    agreement: Option<f32>,
}

/// Whether a row belongs in OUT under `bar`: a row without a vote has no agreement to meet it.
pub(super) fn meets(agreement: Option<f32>, bar: Option<f32>) -> bool {
    bar.is_none_or(|bar| agreement.is_some_and(|a| a >= bar))
}

/// Reads what earlier runs wrote (mending a line a crash cut), refuses files another evaluator
/// wrote, and moves rows across `bar` (this run's `--min-agreement`; none admits every row) so
/// that OUT holds exactly the rows that meet it; rows move as written, nothing is judged again.
pub(super) fn prepare(
    paths: &Paths,
    evaluator: &str,
    bar: Option<f32>,
) -> Result<Resume, EvalError> {
    let out = read_lines(&paths.out, evaluator)?;
    let held = read_lines(&paths.held, evaluator)?;
    let mut resume = Resume {
        done: out.iter().chain(&held).map(|l| l.key.clone()).collect(),
        ..Resume::default()
    };
    let (stay, leave): (Vec<Line>, Vec<Line>) =
        out.into_iter().partition(|l| meets(l.agreement, bar));
    let (admit, keep): (Vec<Line>, Vec<Line>) =
        held.into_iter().partition(|l| meets(l.agreement, bar));
    resume.admitted = admit.len();
    resume.held_back = leave.len();
    if admit.is_empty() && leave.is_empty() {
        return Ok(resume);
    }
    // Each file is replaced whole by a rename; a crash between the two renames leaves a moved
    // row in both files or in neither, and a row in neither is only labelled again.
    replace(&paths.out, stay.iter().chain(&admit))?;
    replace(&paths.held, keep.iter().chain(&leave))?;
    Ok(resume)
}

/// The rows of `path` (absent: none), each checked to be `evaluator`'s.
fn read_lines(path: &Path, evaluator: &str) -> Result<Vec<Line>, EvalError> {
    jsonl::mend_last_line(path, |tail| serde_json::from_str::<Written>(tail).is_ok())?;
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(EvalError::io(format!("opening {}", path.display()), e)),
    };
    let mut lines = Vec::new();
    for (i, text) in BufReader::new(file).lines().enumerate() {
        let text = text.map_err(|e| EvalError::io(format!("reading {}", path.display()), e))?;
        if text.trim().is_empty() {
            continue;
        }
        let bad = |message: String| DataError {
            file: path.display().to_string(),
            line: i + 1,
            message,
            fatal: true,
        };
        let row: Written =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a labelled row: {e}")))?;
        let key =
            key_of(&row).ok_or_else(|| bad("a labelled row needs `id` and `dataset`".into()))?;
        match row.labelled_by.as_deref() {
            Some(by) if by == evaluator => {}
            other => {
                return Err(EvalError::Usage(format!(
                    "{}:{}: a row labelled by {:?}, not {evaluator:?}: choose another --out",
                    path.display(),
                    i + 1,
                    other.unwrap_or("no evaluator")
                )));
            }
        }
        lines.push(Line {
            text,
            key,
            agreement: row.agreement,
        });
    }
    Ok(lines)
}

/// The key the dataset reader gives the row: its split and its id (a number read as text).
fn key_of(row: &Written) -> Option<Key> {
    let id = match row.id.as_ref()? {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => return None,
    };
    Some((row.dataset.clone()?, id))
}

/// Writes `lines` to a temporary file beside `path`, then renames it over `path`.
fn replace<'a>(path: &Path, lines: impl Iterator<Item = &'a Line>) -> Result<(), EvalError> {
    let tmp = path.with_extension("jsonl.tmp");
    let mut writer = jsonl::Writer::create(&tmp)?;
    for line in lines {
        writer.write_line(&format!("{}\n", line.text))?;
    }
    drop(writer);
    std::fs::rename(&tmp, path)
        .map_err(|e| EvalError::io(format!("replacing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("retrace-label-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn row(id: &str, agreement: Option<f32>) -> String {
        let mut v = serde_json::json!({"id": id, "dataset": "d", "labelled_by": "j", "label": -1});
        if let Some(a) = agreement {
            v["agreement"] = a.into();
        }
        format!("{v}\n")
    }

    fn ids(path: &Path) -> Vec<String> {
        read_lines(path, "j")
            .unwrap()
            .into_iter()
            .map(|l| l.key.1)
            .collect()
    }

    #[test]
    fn sidecars_sit_beside_out() {
        let p = Paths::new(Path::new("runs/sqa.jsonl"));
        assert_eq!(p.held, Path::new("runs/sqa.below-agreement.jsonl"));
        assert_eq!(p.failed, Path::new("runs/sqa.failed.jsonl"));
    }

    #[test]
    fn meets_needs_a_vote_only_under_a_bar() {
        assert!(meets(None, None));
        assert!(meets(Some(0.5), None));
        assert!(!meets(None, Some(0.0)));
        assert!(meets(Some(2.0 / 3.0), Some(0.6)));
        assert!(!meets(Some(2.0 / 3.0), Some(0.7)));
    }

    /// Raising the bar moves rows out of OUT; lowering it moves them back; none is relabelled.
    #[test]
    fn rows_move_across_a_changed_bar() {
        let d = dir("bar");
        let paths = Paths::new(&d.join("out.jsonl"));
        let lines = [row("a", Some(1.0)), row("b", Some(0.6)), row("c", None)];
        std::fs::write(&paths.out, lines.concat()).unwrap();
        let r = prepare(&paths, "j", Some(0.8)).unwrap();
        assert_eq!((r.admitted, r.held_back, r.done.len()), (0, 2, 3));
        assert_eq!(ids(&paths.out), ["a"]);
        assert_eq!(ids(&paths.held), ["b", "c"]);
        // The same bar again: nothing moves, and a cut last line is dropped.
        let mut held = std::fs::read_to_string(&paths.held).unwrap();
        held.push_str("{\"id\": \"x\"");
        std::fs::write(&paths.held, held).unwrap();
        let r = prepare(&paths, "j", Some(0.8)).unwrap();
        assert_eq!((r.admitted, r.held_back, r.done.len()), (0, 0, 3));
        let r = prepare(&paths, "j", Some(0.5)).unwrap();
        assert_eq!((r.admitted, r.held_back), (1, 0));
        assert_eq!(ids(&paths.out), ["a", "b"]);
        let r = prepare(&paths, "j", None).unwrap();
        assert_eq!((r.admitted, r.held_back), (1, 0));
        assert_eq!(ids(&paths.out), ["a", "b", "c"]);
        assert!(ids(&paths.held).is_empty());
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn another_evaluators_rows_are_refused_and_bad_lines_named() {
        let d = dir("refuse");
        let paths = Paths::new(&d.join("out.jsonl"));
        std::fs::write(&paths.out, row("a", None)).unwrap();
        let e = prepare(&paths, "other", None).unwrap_err().to_string();
        assert!(
            e.contains("out.jsonl:1: a row labelled by \"j\", not \"other\""),
            "{e}"
        );
        std::fs::write(&paths.out, format!("{}{{\"id\": \"b\"}}\n", row("a", None))).unwrap();
        let e = prepare(&paths, "j", None).unwrap_err().to_string();
        assert!(
            e.contains("out.jsonl:2: a labelled row needs `id` and `dataset`"),
            "{e}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }
}
