//! The binary's memory: mimalloc as the global allocator, the bound on tokio's blocking threads,
//! and the idle trim that hands freed memory back to the OS once requests stop.
//!
//! Why each part (a `retrace serve` on the tiny PRM: tests/it/memory.rs, and
//! docs/operating.md):
//! - Every tokenization is a `spawn_blocking` job, and tokio starts a thread per waiting job, up
//!   to 512: a Rank of 128 candidates started over a hundred, each with its own mimalloc heap,
//!   and took RSS from 58 MiB to 435 MiB (256 candidates: about 250 threads, 1 GiB). Tokenizing
//!   is CPU work, so threads past a small multiple of the cores only add heaps.
//! - An idle blocking thread lives on for tokio's default 10 s, and its heap's pages with it.
//! - mimalloc purges freed memory only `purge_delay` (1 s) after the free, and only when some
//!   thread next calls into it; on a server gone quiet none does, so the memory stayed (435 MiB
//!   still, after that Rank). Purging at once (`purge_delay = 0`) would bring back the page
//!   faults on every large batch that mimalloc was chosen to avoid, so the purge is forced once,
//!   when the server has been idle for `IDLE`.

use std::time::{Duration, Instant};

/// A large batch allocates activations of tens of MiB per op; glibc malloc serves those with
/// fresh mmaps (a page fault and a zeroed page per 4 KiB, every time), mimalloc from reused memory.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long an idle blocking thread waits for more work before it exits and its heap is freed.
const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Quiet time (nothing in flight, nothing finished) before the trim: past the blocking threads'
/// keep-alive, so that their heaps are back in mimalloc's arena when it is purged.
const IDLE: Duration = Duration::from_secs(2);
/// How often the trimmer looks at the server's activity.
const POLL: Duration = Duration::from_millis(250);

/// Blocking threads: twice the cores (tokenizing is CPU-bound), and at least 8 so that model
/// loads at startup, which also run there, can't hold every thread.
fn blocking_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cores).max(8)
}

/// The runtime `retrace` runs on: tokio's multi-threaded one, its blocking pool bounded.
pub(crate) fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(blocking_threads())
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
}

/// Starts the thread that purges mimalloc's free memory once the server has been idle for
/// `IDLE` after serving requests; once per quiet spell, so a busy server never pays for it.
pub(crate) fn spawn_idle_trim() -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("idle-trim".into())
        .spawn(|| {
            // mi_collect works through the calling thread's heap, and a thread that has never
            // allocated has only the empty default one (it returns at once): allocate first.
            std::hint::black_box(vec![0u8; 64]);
            let mut idle = IdleWatch::new(retrace::activity(), Instant::now());
            loop {
                std::thread::sleep(POLL);
                if idle.due(retrace::activity(), Instant::now()) {
                    collect();
                    tracing::debug!("idle: handed mimalloc's free memory back");
                }
            }
        })
        .map(drop)
}

/// Frees this thread's empty pages and purges every arena's free memory now.
#[allow(unsafe_code)]
fn collect() {
    // SAFETY: mi_collect takes no pointers and only returns memory mimalloc holds free; it is
    // safe to call from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// Decides when a quiet spell has lasted `IDLE`: true once per spell that followed activity.
struct IdleWatch {
    last: retrace::Activity,
    quiet_since: Instant,
    trimmed: bool,
}

impl IdleWatch {
    fn new(now: retrace::Activity, at: Instant) -> Self {
        // Startup (the model load) is activity too: the first quiet spell trims.
        IdleWatch {
            last: now,
            quiet_since: at,
            trimmed: false,
        }
    }

    fn due(&mut self, now: retrace::Activity, at: Instant) -> bool {
        if now != self.last || now.in_flight > 0 {
            self.last = now;
            self.quiet_since = at;
            self.trimmed = false;
            return false;
        }
        if self.trimmed || at.duration_since(self.quiet_since) < IDLE {
            return false;
        }
        self.trimmed = true;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retrace::Activity;

    #[test]
    fn trims_once_per_quiet_spell_and_never_while_busy() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let act = |in_flight, finished| Activity {
            in_flight,
            finished,
        };
        let mut w = IdleWatch::new(act(0, 0), t0);
        assert!(!w.due(act(0, 0), at(1_000)), "not quiet for 2 s yet");
        assert!(w.due(act(0, 0), at(2_000)), "the startup's quiet spell");
        assert!(!w.due(act(0, 0), at(9_000)), "once per spell");
        // A long request in flight: never due, however long nothing finishes.
        assert!(!w.due(act(1, 0), at(10_000)));
        assert!(!w.due(act(1, 0), at(30_000)));
        assert!(!w.due(act(0, 1), at(30_500)), "it just finished");
        assert!(!w.due(act(0, 1), at(32_000)));
        assert!(w.due(act(0, 1), at(32_500)), "2 s after the last activity");
        assert!(!w.due(act(0, 1), at(40_000)));
    }
}
