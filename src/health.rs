//! grpc.health.v1 as load balancers and clients read it: the whole server ("") and the Evaluator
//! service, SERVING only while every evaluator is ready; and each evaluator under its own name
//! (`evaluator_service`), so a dead model thread shows which evaluator it took, while the others
//! go on answering.

use crate::api::{EvaluatorService, pb};
use crate::engine::Engine;
use crate::metrics;
use std::collections::HashMap;
use tonic::server::NamedService;
use tonic_health::ServingStatus;

/// The health service name of one evaluator: `retrace.v1.Evaluator/<name>`.
pub fn evaluator_service(evaluator: &str) -> String {
    format!("{}/{evaluator}", service_name())
}

fn service_name() -> &'static str {
    <pb::evaluator_server::EvaluatorServer<EvaluatorService> as NamedService>::NAME
}

/// Publishes readiness to grpc.health.v1 and the readiness gauges.
pub(crate) struct Health {
    reporter: tonic_health::server::HealthReporter,
    serving: bool,
    /// Each evaluator's last published readiness.
    evaluators: HashMap<String, bool>,
}

impl Health {
    /// NOT_SERVING everywhere until the evaluators load.
    pub(crate) async fn new(
        evaluators: &[&str],
    ) -> (
        Self,
        tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    ) {
        let (reporter, service) = tonic_health::server::health_reporter();
        let health = Health {
            reporter,
            serving: false,
            evaluators: evaluators.iter().map(|e| (e.to_string(), false)).collect(),
        };
        health.set(ServingStatus::NotServing).await;
        for name in evaluators {
            health
                .reporter
                .set_service_status(evaluator_service(name), ServingStatus::NotServing)
                .await;
        }
        (health, service)
    }

    /// Publishes every evaluator's readiness; the server is SERVING only while all are ready.
    pub(crate) async fn follow(&mut self, engine: &Engine) {
        let statuses = engine.list();
        for s in &statuses {
            metrics::set_ready(&s.name, s.ready);
            if self.evaluators.insert(s.name.clone(), s.ready) != Some(s.ready) {
                if !s.ready {
                    tracing::warn!(evaluator = %s.name, "evaluator not ready: NOT_SERVING");
                }
                self.reporter
                    .set_service_status(evaluator_service(&s.name), status(s.ready))
                    .await;
            }
        }
        let ready = statuses.iter().all(|s| s.ready);
        if self.serving != ready {
            match ready {
                true => tracing::info!("every evaluator is ready: SERVING"),
                false => tracing::warn!("an evaluator is not ready: NOT_SERVING"),
            }
            self.set(status(ready)).await;
            self.serving = ready;
        }
    }

    /// NOT_SERVING everywhere: shutdown has begun.
    pub(crate) async fn shutting_down(&mut self) {
        self.set(ServingStatus::NotServing).await;
        for name in self.evaluators.keys() {
            self.reporter
                .set_service_status(evaluator_service(name), ServingStatus::NotServing)
                .await;
        }
    }

    /// Ends every health Watch stream once it has carried the last status: a Watch never ends by
    /// itself, gRPC clients with health checking hold one per connection, and the drain waits
    /// for every open stream, so one would hold the exit for the whole grace period. A Check
    /// during the drain gets NOT_FOUND; new connections are refused by then anyway.
    pub(crate) async fn end_watches(&mut self) {
        self.reporter.clear_service_status("").await;
        self.reporter.clear_service_status(service_name()).await;
        for name in self.evaluators.keys() {
            self.reporter
                .clear_service_status(&evaluator_service(name))
                .await;
        }
    }

    async fn set(&self, status: ServingStatus) {
        self.reporter.set_service_status("", status).await;
        self.reporter
            .set_service_status(service_name(), status)
            .await;
    }
}

fn status(ready: bool) -> ServingStatus {
    match ready {
        true => ServingStatus::Serving,
        false => ServingStatus::NotServing,
    }
}
