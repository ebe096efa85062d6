//! The embedded default: SmolLM2-135M-Instruct's Q4_1 GGUF from the cache folder, served as a
//! head trained on that very file (`smollm2-head`, listed first, so the default) and as the
//! zero-shot `chat-lm` PRM (`smollm2`). The head's files are compiled into the binary and
//! written into the cache folder when the server starts, beside the GGUF its config names.

use super::{Config, KindConfig};
use crate::prm::format::Family;
use std::path::{Path, PathBuf};

/// The zero-shot evaluator's name.
pub(super) const CHAT: &str = "smollm2";
/// The trained head's name.
pub(super) const HEAD: &str = "smollm2-head";
/// Where scripts/fetch-smollm2.sh puts the checkpoint, under the cache folder: served
/// quantized as it is, its tokenizer rebuilt from the file.
const GGUF: &str = "gguf/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Where the head is written, under the cache folder; its config names the GGUF relative to it.
const HEAD_DIR: &str = "heads/smollm2";
/// The head folder as committed in `heads/smollm2/` (its README says how it was trained).
const HEAD_FILES: [(&str, &[u8]); 2] = [
    (
        "config.json",
        include_bytes!("../../heads/smollm2/config.json"),
    ),
    (
        "head.safetensors",
        include_bytes!("../../heads/smollm2/head.safetensors"),
    ),
];

/// The two tables; each `model` is its own name until `place` points it at the cache folder.
pub(super) fn text() -> String {
    let table = |name: &str, family: &str| {
        format!(
            "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"{family}\"\nmodel = \"{name}\"\n"
        )
    };
    table(HEAD, "head") + "\n" + &table(CHAT, Family::ChatLm.as_str())
}

/// Points the embedded evaluators at the cache folder, unless `--set` gave them a model.
pub(super) fn place(config: &mut Config) {
    let cache = config.server.cache_dir.clone();
    for e in &mut config.evaluators {
        let KindConfig::Prm(p) = &mut e.kind else {
            continue;
        };
        let at = match e.name.as_str() {
            CHAT => GGUF,
            HEAD => HEAD_DIR,
            _ => continue,
        };
        if p.model == e.name {
            p.model = cache.join(at).display().to_string();
        }
    }
}

/// Writes the embedded head's files into `cache_dir`'s `heads/smollm2/` where they are missing
/// or differ (each written whole, then renamed into place), and returns the folder.
pub fn install_head(cache_dir: &Path) -> std::io::Result<PathBuf> {
    let dir = cache_dir.join(HEAD_DIR);
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in HEAD_FILES {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|b| b == bytes) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(dir)
}
