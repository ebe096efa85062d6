//! The retrace contender: traces sent over the real gRPC path (unary `Evaluate`, one per trace),
//! `concurrency` of them in flight, each one's latency and step scores kept (a call its
//! connection's retirement cut off counts once, sent again).

use super::{ContenderRun, Workload};
use crate::common::connection_lost;
use anyhow::Context;
use retrace::pb;
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
        let (client, evaluator, traces) = (client.clone(), evaluator.clone(), traces.clone());
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
            let reply = again_if_cut(|| {
                let (mut client, request) = (client.clone(), request.clone());
                async move { client.evaluate(request).await }
            })
            .await
            .with_context(|| format!("retrace: trace {i}"))?
            .into_inner();
            Ok((reply.steps.iter().map(|s| s.score).collect(), 0))
        }
    })
    .await
}

/// `call`, and once more when the connection failed under it: a server retiring its connections
/// (`max_connection_age_s` and its grace) cuts what is still on one, and the channel's next
/// call goes on a new connection. Every bench workload sends through this.
pub(super) async fn again_if_cut<T, F, Fut>(call: F) -> Result<T, tonic::Status>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    match call().await {
        Err(s) if connection_lost(&s) => call().await,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A status as tonic builds one from a transport error: with the error as its source.
    fn cut() -> tonic::Status {
        let mut s = tonic::Status::cancelled("operation was canceled");
        s.set_source(Arc::new(std::io::Error::other("connection closed")));
        s
    }

    #[tokio::test]
    async fn a_call_its_connection_cut_goes_once_more_and_a_servers_answer_does_not() {
        let calls = AtomicUsize::new(0);
        let first_cut = || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Err(cut()),
                _ => Ok(7),
            }
        };
        assert_eq!(again_if_cut(first_cut).await.unwrap(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // A status the server sent (no source) is its answer; a second cut is given up on.
        let calls = AtomicUsize::new(0);
        let refused = || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(tonic::Status::resource_exhausted("busy"))
        };
        assert!(again_if_cut(refused).await.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let calls = AtomicUsize::new(0);
        let always_cut = || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(cut())
        };
        assert!(again_if_cut(always_cut).await.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
