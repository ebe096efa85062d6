//! SHA-256 of data files and of cache keys, streamed, as lowercase hex.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Hex SHA-256 of a file's bytes.
pub(crate) fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    feed(&mut hasher, path)?;
    Ok(hex(&hasher.finalize()))
}

/// Hex SHA-256 of `bytes`.
pub(crate) fn sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn feed(hasher: &mut Sha256, path: &Path) -> std::io::Result<()> {
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digests() {
        assert_eq!(
            sha256(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let path = std::env::temp_dir().join(format!("retrace-sha-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(file_sha256(&path).unwrap(), sha256(b"abc"));
        std::fs::remove_file(path).unwrap();
    }
}
