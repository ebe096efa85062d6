//! The retrace contender: traces sent over the real gRPC path (unary `Evaluate`, one per trace),
//! `concurrency` of them in flight, each one's latency and step scores kept.

use super::{Run, Workload};
use crate::api::pb;
use anyhow::Context;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tonic::transport::Channel;

/// Scores every trace of `work` through `client` with `concurrency` requests in flight.
pub async fn run(
    client: &pb::evaluator_client::EvaluatorClient<Channel>,
    evaluator: &str,
    work: &Arc<Workload>,
    concurrency: usize,
) -> anyhow::Result<Run> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (mut client, next, work) = (client.clone(), next.clone(), work.clone());
        let evaluator = evaluator.to_string();
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(t) = work.traces.get(i) else {
                    return anyhow::Ok(done);
                };
                let request = pb::EvaluateRequest {
                    id: i.to_string(),
                    evaluator: evaluator.clone(),
                    trace: Some(pb::Trace {
                        question: t.question.clone(),
                        steps: t.steps.clone(),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let sent = Instant::now();
                let reply = client
                    .evaluate(request)
                    .await
                    .with_context(|| format!("retrace: trace {i}"))?
                    .into_inner();
                let latency = sent.elapsed();
                let scores: Vec<f32> = reply.steps.iter().map(|s| s.score).collect();
                done.push((i, latency, scores, 0));
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.context("a retrace client task panicked")??);
    }
    Ok(Run::collect(started.elapsed(), work.traces.len(), results))
}
