//! RSS of a real `retrace serve` child (mimalloc, the tiny PRM) after one huge request: it must
//! come back near where it was before, not stay at the request's high-water mark.

use crate::common;

use common::*;
use retrace::pb;
use std::time::{Duration, Instant};

/// A step of about 80 bytes; the tiny model's tokenizer makes roughly one token of 1.7 bytes.
const STEP: &str =
    "We compute 3*4 = 12, then add 2 to get 14, which checks out since 14 - 2 = 12. ";
/// How long RSS may take to come back: the server trims once it has been idle for 2 s, after
/// its idle blocking threads (1 s keep-alive) have exited.
const SETTLE: Duration = Duration::from_secs(6);

/// KiB: before the request, the most seen in the `SETTLE` after it, and at its end.
struct Figures {
    baseline: u64,
    after: u64,
    settled: u64,
    took: Duration,
}

/// Serves the tiny PRM, warms it, measures the baseline, runs `huge`, and measures again
/// `SETTLE` later (the highest RSS on the way too).
async fn rss_around<F, Fut>(tag: &str, huge: F) -> Figures
where
    F: FnOnce(pb::evaluator_client::EvaluatorClient<tonic::transport::Channel>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let cfg = tiny_prm_config(tag, "max_trace_bytes = 1048576");
    let (server, channel, _) = spawn_retrace(&["--config".as_ref(), cfg.as_ref()], &[]).await;
    let pid = server.0.id();
    let mut client = pb::evaluator_client::EvaluatorClient::new(channel);
    client
        .evaluate(request("warm", "", steps_trace("What is 2+3*4?", &[STEP])))
        .await
        .unwrap();
    // Past the idle trim that follows the warm-up, so the baseline is a settled server's.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let baseline = rss_kib(pid);
    huge(client).await;
    let done = Instant::now();
    let mut after = rss_kib(pid);
    while done.elapsed() < SETTLE {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = after.max(rss_kib(pid));
    }
    let f = Figures {
        baseline,
        after,
        settled: rss_kib(pid),
        took: done.elapsed(),
    };
    eprintln!(
        "| {tag} | {} | {} | {} | {:.1} s |",
        f.baseline / 1024,
        f.after / 1024,
        f.settled / 1024,
        f.took.as_secs_f64()
    );
    f
}

/// One 256 KiB trace: 256 steps, about 151,000 tokens, refused after tokenizing (the tiny
/// model's context is 1,024 tokens); the cost is the tokenizing. Before the server trimmed when
/// idle, RSS went from about 64 MiB to 127 MiB and stayed there for the 10 s tokio kept the
/// tokenizing thread alive.
///
/// Margin, 16 MiB: what such a request may leave that is live, not free: the tokenizer's word
/// cache (at most 10,000 words), buffers sized by a 264 KB message in the transport, and the
/// 2 MiB granularity of transparent huge pages, which mimalloc asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rss_comes_back_after_one_256_kib_trace() {
    let f = rss_around("256k-trace", |mut c| async move {
        let steps: Vec<String> = (0..256)
            .map(|i| format!("{i}: {}", STEP.repeat(13)))
            .collect();
        let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
        let bytes: usize = steps.iter().map(|s| s.len()).sum();
        assert!(bytes >= 256 << 10, "{bytes} bytes");
        let status = c
            .evaluate(request("huge", "", steps_trace("What is 2+3*4?", &steps)))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status
                .message()
                .contains("tokens exceed the model's context"),
            "{status:?}"
        );
    })
    .await;
    assert!(
        f.settled <= f.baseline + 16 * 1024,
        "RSS {} KiB {:?} after a 256 KiB trace; baseline {} KiB (peak seen {} KiB)",
        f.settled,
        f.took,
        f.baseline,
        f.after
    );
}

/// A Rank of 128 candidates of about 1 KB (about 76,000 tokens, some 10 batches of up to 8,192):
/// the cost is 128 tokenizations at once and the batches. Before the bound on blocking threads
/// and the idle trim, tokio started a thread per tokenization and RSS went from 58 MiB to 435 MiB
/// and stayed there; after, 50 MiB to 141 MiB and back to 96 MiB.
///
/// Margin, 64 MiB: the threads that stay alive (the model thread, candle's pool, tokio's two
/// workers, up to 8 blocking threads while busy) keep pages of their own, mimalloc's per-thread
/// heaps, sized by the batches and the 128 verdicts; a trim from another thread can't free those,
/// and the next batch reuses them (four Ranks of 256 in a row, by hand, left the same 40-60 MiB
/// each time: bounded, not growing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rss_comes_back_after_one_large_batch() {
    let f = rss_around("rank-128", |mut c| async move {
        let candidate = pb::Trace {
            steps: (0..12).map(|i| format!("{i}: {STEP}")).collect(),
            ..Default::default()
        };
        let ranked = c
            .rank(pb::RankRequest {
                question: "What is 2+3*4?".into(),
                candidates: vec![candidate; 128],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .ranked;
        assert_eq!(ranked.len(), 128);
    })
    .await;
    assert!(
        f.settled <= f.baseline + 64 * 1024,
        "RSS {} KiB {:?} after a 128-candidate Rank; baseline {} KiB (peak seen {} KiB)",
        f.settled,
        f.took,
        f.baseline,
        f.after
    );
}
