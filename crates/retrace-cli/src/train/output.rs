//! Writing the head folder (docs/training.md; its `config.json` is `retrace::HeadConfig`, its
//! tensor names `retrace_model::head_tensors`): `config.json`, `head.safetensors`, the dev
//! scores and the report, written into a temporary folder beside `--out` and renamed into
//! place, so a failed or interrupted run leaves no half head behind.

use super::TrainError;
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A file of the head folder.
pub(crate) enum Content {
    Text(String),
    Tensors(HashMap<String, Tensor>),
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> TrainError {
    move |source| TrainError::Io { what, source }
}

/// Refuses an existing `out` unless `force`.
pub(crate) fn check_out(out: &Path, force: bool) -> Result<(), TrainError> {
    if out.exists() && !force {
        return Err(TrainError::Usage(format!(
            "--out {} exists; pass --force to replace it",
            out.display()
        )));
    }
    Ok(())
}

/// The temporary folder beside `out` that becomes it.
fn staging(out: &Path) -> Result<PathBuf, TrainError> {
    let name = out
        .file_name()
        .ok_or_else(|| TrainError::Usage(format!("--out {} names no folder", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok(parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Writes `files` (name, content) as the folder `out`, all or nothing: into a temporary folder
/// beside it, then one rename (an existing `out` is replaced only with `force`).
pub(crate) fn write_folder(
    out: &Path,
    force: bool,
    files: &[(&str, Content)],
) -> Result<(), TrainError> {
    check_out(out, force)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    }
    let tmp = staging(out)?;
    let result = fill(&tmp, files).and_then(|()| swap(&tmp, out));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn fill(tmp: &Path, files: &[(&str, Content)]) -> Result<(), TrainError> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(io(format!("removing {}", tmp.display())))?;
    }
    std::fs::create_dir_all(tmp).map_err(io(format!("creating {}", tmp.display())))?;
    for (name, content) in files {
        let path = tmp.join(name);
        match content {
            Content::Text(text) => {
                std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))?
            }
            Content::Tensors(tensors) => candle_core::safetensors::save(tensors, &path)?,
        }
    }
    Ok(())
}

/// Puts `tmp` where `out` is: an old `out` moves aside first and goes only once the new one
/// is in place.
fn swap(tmp: &Path, out: &Path) -> Result<(), TrainError> {
    let old = out.exists().then(|| tmp.with_extension("old"));
    if let Some(old) = &old {
        std::fs::rename(out, old).map_err(io(format!("moving {} aside", out.display())))?;
    }
    if let Err(e) = std::fs::rename(tmp, out) {
        if let Some(old) = &old {
            let _ = std::fs::rename(old, out);
        }
        return Err(io(format!(
            "renaming {} to {}",
            tmp.display(),
            out.display()
        ))(e));
    }
    if let Some(old) = &old {
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("retrace-out-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_all_or_nothing_and_refuses_to_overwrite() {
        let d = dir("swap");
        let out = d.join("head");
        let files = [("a.txt", Content::Text("one".into()))];
        write_folder(&out, false, &files).unwrap();
        assert_eq!(entries(&out), ["a.txt"]);
        let e = write_folder(&out, false, &files).unwrap_err().to_string();
        assert!(e.contains("--force"), "{e}");
        let files = [("b.txt", Content::Text("two".into()))];
        write_folder(&out, true, &files).unwrap();
        assert_eq!(entries(&out), ["b.txt"]);
        assert_eq!(entries(&d), ["head"]);
        // A file that cannot be written (a folder in the way is not possible inside a fresh
        // folder, so name one inside a missing subfolder): nothing is left behind.
        let bad = [
            ("c.txt", Content::Text("x".into())),
            ("missing/d.txt", Content::Text("y".into())),
        ];
        assert!(write_folder(&d.join("other"), false, &bad).is_err());
        assert_eq!(entries(&d), ["head"]);
        std::fs::remove_dir_all(d).unwrap();
    }
}
