//! A checkpoint's checksum: what ties a trained head (and a cache of features) to the base it
//! was computed on, so a head is never served over other weights, another tokenizer or another
//! chat template than its own.

use crate::error::ModelError;
use crate::gguf::is_gguf;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// The files of a Hugging Face folder besides its weights that decide what the model computes
/// for a trace: its shape, and how a trace becomes token ids (the tokenizer, the chat template).
const FEATURE_FILES: [&str; 6] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// SHA-256 (lowercase hex) over what a checkpoint computes with: a `.gguf` file's bytes (it
/// carries its tokenizer, template and config); for a Hugging Face folder, each
/// `*.safetensors` file in sorted name order, then each of `FEATURE_FILES` it has, hashing for
/// each its file name, a NUL byte, its length (8 bytes, little-endian) and its bytes (so
/// renaming a shard changes the sum, and no two files' bytes run together).
pub fn checkpoint_sha256(path: &Path) -> Result<String, ModelError> {
    let mut hasher = Sha256::new();
    if is_gguf(path) && path.is_file() {
        hash_file(&mut hasher, path)?;
    } else if path.is_dir() {
        let files = safetensors_files(path)?;
        if files.is_empty() {
            return Err(ModelError::MissingFile(path.join("model.safetensors")));
        }
        let others = FEATURE_FILES
            .iter()
            .map(|name| (name.to_string(), path.join(name)))
            .filter(|(_, file)| file.is_file());
        for (name, file) in files.into_iter().chain(others) {
            let len = std::fs::metadata(&file)
                .map_err(|source| ModelError::Io {
                    path: file.clone(),
                    source,
                })?
                .len();
            hasher.update(name.as_bytes());
            hasher.update([0u8]);
            hasher.update(len.to_le_bytes());
            hash_file(&mut hasher, &file)?;
        }
    } else {
        return Err(ModelError::MissingFile(path.to_path_buf()));
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The folder's `*.safetensors` files (plain files only), sorted by name.
fn safetensors_files(folder: &Path) -> Result<Vec<(String, std::path::PathBuf)>, ModelError> {
    let io = |source| ModelError::Io {
        path: folder.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(folder).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") && entry.path().is_file() {
            files.push((name, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

fn hash_file(hasher: &mut Sha256, path: &Path) -> Result<(), ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_a_gguf_file_and_a_folder_of_shards_by_name_and_bytes() {
        let dir = std::env::temp_dir().join(format!("retrace-sha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gguf = dir.join("m.gguf");
        std::fs::write(&gguf, b"abc").unwrap();
        // sha256("abc"), the FIPS 180-2 test vector: the file carries its tokenizer and config.
        assert_eq!(
            checkpoint_sha256(&gguf).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let folder = dir.join("hf");
        std::fs::create_dir_all(&folder).unwrap();
        assert!(matches!(
            checkpoint_sha256(&folder),
            Err(ModelError::MissingFile(_))
        ));
        std::fs::write(folder.join("b.safetensors"), b"2").unwrap();
        std::fs::write(folder.join("a.safetensors"), b"1").unwrap();
        std::fs::write(folder.join("config.json"), b"{}").unwrap();
        std::fs::write(folder.join("README.md"), b"not read").unwrap();
        let mut want = Sha256::new();
        for (name, bytes) in [
            ("a.safetensors", &b"1"[..]),
            ("b.safetensors", b"2"),
            ("config.json", b"{}"),
        ] {
            want.update(name.as_bytes());
            want.update([0u8]);
            want.update((bytes.len() as u64).to_le_bytes());
            want.update(bytes);
        }
        let want: String = want.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let sum = checkpoint_sha256(&folder).unwrap();
        assert_eq!(sum, want);
        // Renaming a shard changes the sum; a file the model never reads does not.
        std::fs::write(folder.join("README.md"), b"changed").unwrap();
        assert_eq!(checkpoint_sha256(&folder).unwrap(), sum);
        std::fs::rename(folder.join("b.safetensors"), folder.join("c.safetensors")).unwrap();
        assert_ne!(checkpoint_sha256(&folder).unwrap(), sum);
        assert!(checkpoint_sha256(&dir.join("nothing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_shapes_the_features_beside_the_weights_changes_the_sum() {
        let dir = std::env::temp_dir().join(format!("retrace-sha-meta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.safetensors"), b"w").unwrap();
        let mut sums = vec![checkpoint_sha256(&dir).unwrap()];
        for name in FEATURE_FILES {
            std::fs::write(dir.join(name), b"one").unwrap();
            sums.push(checkpoint_sha256(&dir).unwrap());
            std::fs::write(dir.join(name), b"two").unwrap();
            sums.push(checkpoint_sha256(&dir).unwrap());
        }
        let distinct: std::collections::HashSet<&String> = sums.iter().collect();
        assert_eq!(distinct.len(), sums.len(), "{sums:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
