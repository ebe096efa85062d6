//! The bench's child processes (a `retrace serve`, a `llama-server`): started on 127.0.0.1 with a
//! free port, killed when their guard drops (on success, error or panic), and their peak RSS read
//! from /proc.

use anyhow::{Context, bail};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed (and reaped) when dropped.
pub(crate) struct Guard {
    child: Child,
    name: String,
    /// Where its stderr went, shown when it dies early.
    log: std::path::PathBuf,
}

impl Guard {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub(crate) fn spawn(name: &str, mut cmd: Command, log: &Path) -> anyhow::Result<Guard> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Guard {
            child,
            name: name.to_string(),
            log: log.to_path_buf(),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails, with the tail of its log, when the process has already exited.
    pub(crate) fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!("{} exited ({status}):\n{}", self.name, tail.join("\n"));
        }
        Ok(())
    }

    /// Peak resident set size of the process so far, in bytes (VmHWM).
    pub(crate) fn peak_rss(&self) -> anyhow::Result<u64> {
        peak_rss(self.pid())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// VmHWM of `pid` in bytes.
pub(crate) fn peak_rss(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .with_context(|| format!("no VmHWM in {path}"))
}

/// A port on 127.0.0.1 nobody listens on right now.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Polls `ready` every 100 ms until it holds, the child dies, or `limit` passes.
pub(crate) async fn wait_until<F, Fut>(
    guard: &mut Guard,
    limit: Duration,
    mut ready: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        guard.check_alive()?;
        if ready().await {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("{} was not ready within {limit:?}", guard.name);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
