//! llama.cpp's llama-server as a real peer: built by scripts/fetch/fetch-llama-server.sh, serving
//! SmolLM2-135M-Instruct's Q4_1 GGUF (scripts/fetch-smollm2.sh) on 127.0.0.1.

use super::{ChildGuard, free_port};
use std::path::PathBuf;
use std::time::Duration;

/// The GGUF the embedded default serves and llama-server loads.
pub fn smollm2_gguf() -> PathBuf {
    retrace::Env::process()
        .cache_dir()
        .join("gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Starts llama-server on the SmolLM2 GGUF with `args` on a free port and waits for /health.
pub async fn llama_server(args: &[&str]) -> (ChildGuard, u16) {
    // The product installs ring as rustls' provider when it builds a client; tests' own
    // reqwest clients need it too.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bin = retrace::Env::process()
        .cache_dir()
        .join("llama-server/bin/llama-server");
    let gguf = smollm2_gguf();
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/fetch/fetch-llama-server.sh",
        bin.display()
    );
    assert!(
        gguf.is_file(),
        "{} is missing: run scripts/fetch-smollm2.sh",
        gguf.display()
    );
    let port = free_port();
    let child = std::process::Command::new(&bin)
        .arg("-m")
        .arg(&gguf)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args)
        // Passive OpenMP waits: spinning threads starve everything else on a shared CPU.
        .env("OMP_WAIT_POLICY", "passive")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawning llama-server");
    let mut guard = ChildGuard(child);
    let url = format!("http://127.0.0.1:{port}/health");
    for i in 0.. {
        if reqwest::get(&url)
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            break;
        }
        assert!(
            guard.0.try_wait().unwrap().is_none(),
            "llama-server exited early"
        );
        assert!(i < 600, "llama-server never became healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (guard, port)
}
