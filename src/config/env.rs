//! The process environment, read here and nowhere else: the cache folder, the Hugging Face
//! cache, and the secrets a config names by variable. (Flags' own variables are clap's.)

use std::path::{Path, PathBuf};

/// `$RETRACE_CACHE_DIR`, else `$HOME/.cache/retrace`, else `.cache/retrace`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RETRACE_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".cache/retrace"),
        None => PathBuf::from(".cache/retrace"),
    }
}

/// The Hugging Face hub cache: `$HF_HUB_CACHE`, `$HF_HOME/hub` or `~/.cache/huggingface/hub`.
pub fn hf_hub_cache() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
}

/// The trimmed value of `var`; `None` when it is unset or blank.
pub fn secret(var: &str) -> Option<String> {
    std::env::var(var)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}
