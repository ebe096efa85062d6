//! The retrace contender: traces sent over the real gRPC path (unary `Evaluate`, one per trace),
//! `concurrency` of them in flight, each one's latency and step scores kept (a call its
//! connection's retirement cut off counts once, sent again).

use super::{ContenderRun, Workload};
use crate::eval::connection_lost;
use anyhow::Context;
use retrace::api::pb;
use std::sync::Arc;
use tonic::transport::Channel;

/// Scores every trace of `work` through `client` with `concurrency` requests in flight.
pub(super) async fn run(
    client: &pb::evaluator_client::EvaluatorClient<Channel>,
    evaluator: &str,
    work: &Arc<Workload>,
    concurrency: usize,
) -> anyhow::Result<ContenderRun> {
    let (client, evaluator, traces) = (client.clone(), evaluator.to_string(), work.clone());
    super::drive(work.traces.len(), concurrency, move |i| {
        let (mut client, evaluator, traces) = (client.clone(), evaluator.clone(), traces.clone());
        async move {
            let t = &traces.traces[i];
            let request = pb::EvaluateRequest {
                id: i.to_string(),
                evaluator,
                trace: Some(pb::Trace {
                    question: t.question.clone(),
                    steps: t.steps.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            };
            // A call the server's retirement of its connection cut goes again, on the
            // channel's new connection.
            let mut reply = client.evaluate(request.clone()).await;
            if matches!(&reply, Err(s) if connection_lost(s)) {
                reply = client.evaluate(request).await;
            }
            let reply = reply
                .with_context(|| format!("retrace: trace {i}"))?
                .into_inner();
            Ok((reply.steps.iter().map(|s| s.score).collect(), 0))
        }
    })
    .await
}
