//! The process environment, read here and nowhere else: the cache folder, the Hugging Face
//! cache, and the secrets a config names by variable. (Flags' own variables are clap's.) It is a
//! value, so a test hands in the variables it means instead of setting the process's.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where variables come from: the process, or a fixed set.
#[derive(Clone, Default)]
pub struct Env {
    /// `None` reads the process's environment at each lookup.
    fixed: Option<Arc<HashMap<String, String>>>,
}

/// A secret string: never printed, serialised as "[redacted]".
#[derive(Clone, serde::Deserialize, PartialEq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Env {
    /// The process's environment.
    pub fn process() -> Env {
        Env::default()
    }

    /// Exactly these variables, and no others.
    pub fn fixed<'a>(vars: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        let vars = vars
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Env {
            fixed: Some(Arc::new(vars)),
        }
    }

    fn var(&self, key: &str) -> Option<String> {
        match &self.fixed {
            Some(vars) => vars.get(key).cloned(),
            // The one reader of the process environment (clippy.toml keeps it so).
            #[allow(clippy::disallowed_methods)]
            None => std::env::var(key).ok(),
        }
    }

    /// `$RETRACE_CACHE_DIR`, else `$HOME/.cache/retrace`, else `.cache/retrace`.
    pub fn cache_dir(&self) -> PathBuf {
        if let Some(dir) = self.var("RETRACE_CACHE_DIR") {
            return PathBuf::from(dir);
        }
        match self.var("HOME") {
            Some(home) => Path::new(&home).join(".cache/retrace"),
            None => PathBuf::from(".cache/retrace"),
        }
    }

    /// The Hugging Face hub cache: `$HF_HUB_CACHE`, `$HF_HOME/hub` or `~/.cache/huggingface/hub`.
    pub fn hf_hub_cache(&self) -> Option<PathBuf> {
        let var = |k: &str| self.var(k).map(PathBuf::from);
        var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
    }

    /// `$RETRACE_SIMD`: the widest vector unit the kernels may use (`avx512`, `avx2`, `base`),
    /// which the binary passes to `retrace_model::kernels::cap_simd`.
    pub fn simd(&self) -> Option<String> {
        self.secret("RETRACE_SIMD")
    }

    /// The trimmed value of `var`; `None` when it is unset or blank.
    pub fn secret(&self, var: &str) -> Option<String> {
        self.var(var)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }
}

impl fmt::Debug for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.fixed {
            Some(vars) => write!(f, "Env::fixed({} variables)", vars.len()),
            None => f.write_str("Env::process()"),
        }
    }
}

/// Two configs are equal whatever environment each reads.
impl PartialEq for Env {
    fn eq(&self, _: &Env) -> bool {
        true
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl serde::Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}
