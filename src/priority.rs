//! The model's threads yield to the async runtime: they run at a lower scheduling priority, so
//! refusals, health answers and metrics stay fast while a model saturates the cores.
//!
//! On Linux a thread's nice value is its own; elsewhere the threads keep the process's priority.

/// How much lower than the runtime the model's threads run. At nice 10 a thread's share of a
/// contended core is about a tenth of a nice-0 thread's: the runtime takes the core when it has
/// work, and the model has the cores to itself otherwise.
const NICE: i32 = 10;

/// Builds the global compute pool (candle's, gemm's and the kernels' threads) with its threads
/// at the lower priority. Once per process: a pool already built keeps its priority, which is
/// logged, not fatal (an in-process test server, or a second `serve`).
pub(crate) fn lower_compute_pool() {
    let built = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("compute-{i}"))
        .start_handler(|_| lower_this_thread())
        .build_global();
    if let Err(e) = built {
        tracing::debug!(error = %e, "the compute pool was built before; its priority stays");
    }
}

/// Lowers the calling thread's priority (a model thread's, at its start).
pub(crate) fn lower_this_thread() {
    // On Linux PRIO_PROCESS with a thread id sets that one thread's nice value, and raising
    // one's own nice needs no privilege.
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), NICE) {
        tracing::warn!(error = %e, "could not lower a model thread's priority");
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn a_lowered_thread_runs_at_nice_10_and_others_keep_theirs() {
        let nice = || std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // Field 19 of stat is the nice value; the command name (field 2) has no spaces here.
        let field = |stat: String| {
            stat.split_whitespace()
                .nth(18)
                .unwrap()
                .parse::<i32>()
                .unwrap()
        };
        let before = field(nice());
        let lowered = std::thread::spawn(move || {
            super::lower_this_thread();
            field(nice())
        })
        .join()
        .unwrap();
        // setpriority sets the value itself, and raising one's priority back takes privilege.
        assert_eq!(lowered, before.max(super::NICE));
        assert_eq!(
            field(nice()),
            before,
            "the calling thread keeps its priority"
        );
    }
}
