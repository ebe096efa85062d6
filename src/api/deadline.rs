//! The caller's deadline (`grpc-timeout`), kept by a layer around every gRPC service so that the
//! caller hears DEADLINE_EXCEEDED whichever timer fires first.
//!
//! tonic keeps a timer of its own for the header, started as the headers arrive (before our
//! handler has the request, which may still be in flight), and answers CANCELLED ("Timeout
//! expired") when it fires, a code clients treat as the caller having gone. This layer sits
//! inside tonic's timer and is called before that timer is set, so its deadline is never the
//! later one; and whenever it is polled it reads the clock, not only its own timer, so it answers
//! first even when both timers have fired by the time the task runs (tonic polls the service
//! before looking at its timer).

use super::convert::parse_grpc_timeout;
use super::status::to_status;
use super::unreadable::rpc_of;
use crate::engine::EngineError;
use crate::metrics;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};

/// When a call arrived and how long its caller gives it. The layer puts it in the request's
/// extensions; handlers take it from there (`Arrival::take`) and derive the engine's deadline
/// from it, so that every timer counts from the same instant.
#[derive(Clone, Debug)]
pub(super) struct Arrival {
    pub(super) at: Instant,
    pub(super) timeout: Option<Duration>,
    /// Set once a handler has the request: from then on its own recorder counts the call.
    handled: Arc<AtomicBool>,
}

impl Arrival {
    fn new(timeout: Option<Duration>) -> Self {
        Arrival {
            at: Instant::now(),
            timeout,
            handled: Arc::default(),
        }
    }

    /// The deadline this layer answers at, and the recorders count by: a little before the
    /// caller's. tonic's timer was set a moment before this arrival (at least as early, and later
    /// only by what ran in between),
    /// and tokio fires timers on whole milliseconds, so a layer timer set for the caller's own
    /// deadline could land a tick after tonic's and lose to it. The margin sits between the
    /// engine's (a tenth, at most 20 ms: its answer, which says where the time went, still
    /// comes first) and tonic's.
    pub(super) fn deadline(&self) -> Option<Instant> {
        let d = self.timeout?;
        self.at
            .checked_add(d - (d / 20).min(Duration::from_millis(10)))
    }

    /// The call's arrival, marked as handled: the handler counts the call from here on. A
    /// request that did not come through the layer arrives now.
    pub(super) fn take<T>(request: &tonic::Request<T>) -> Arrival {
        match request.extensions().get::<Arrival>() {
            Some(arrival) => {
                arrival.handled.store(true, Ordering::SeqCst);
                arrival.clone()
            }
            None => Arrival::new(super::convert::grpc_timeout(request.metadata())),
        }
    }
}

/// The layer (`Server::layer`): wraps the whole router, so it is called before tonic sets its
/// timer.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Deadlines;

impl<S> tower_layer::Layer<S> for Deadlines {
    type Service = WithDeadline<S>;

    fn layer(&self, inner: S) -> WithDeadline<S> {
        WithDeadline(inner)
    }
}

/// A service whose calls end with DEADLINE_EXCEEDED when their caller's deadline passes.
#[derive(Clone, Debug)]
pub(crate) struct WithDeadline<S>(S);

impl<S, B> Service<http::Request<B>> for WithDeadline<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let timeout = request
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let arrival = Arrival::new(timeout);
        let rpc = rpc_of(request.uri().path());
        request.extensions_mut().insert(arrival.clone());
        let response = self.0.call(request);
        let Some(deadline) = arrival.deadline() else {
            return Box::pin(response);
        };
        Box::pin(async move {
            let mut response = std::pin::pin!(response);
            let mut timer = std::pin::pin!(tokio::time::sleep_until(deadline));
            let answered = std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = response.as_mut().poll(cx) {
                    return Poll::Ready(Some(r));
                }
                // The clock first: tonic's timer may have fired while ours has not yet.
                if Instant::now() >= deadline || timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Poll::Pending
            })
            .await;
            match answered {
                Some(response) => response,
                None => Ok(expired(&arrival, rpc)),
            }
        })
    }
}

/// The answer to a call whose deadline passed first, counted here when no handler had it (the
/// handler's recorder counts the rest, as a deadline, when the call is dropped).
fn expired(arrival: &Arrival, rpc: Option<&'static str>) -> http::Response<Body> {
    let handled = arrival.handled.load(Ordering::SeqCst);
    if let (false, Some(rpc)) = (handled, rpc) {
        metrics::record_request(rpc, "unknown", "deadline_exceeded", arrival.at.elapsed());
    }
    let timeout = arrival.timeout.unwrap_or_default();
    let when = match handled {
        true => "before it was answered",
        false => "before the request had arrived whole",
    };
    let error = EngineError::DeadlineExceeded(format!("the caller's {timeout:?} ran out {when}"));
    to_status(&error).into_http()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    /// A service that never answers.
    #[derive(Clone)]
    struct Never;

    impl Service<http::Request<()>> for Never {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Pending<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            std::future::pending()
        }
    }

    fn call(timeout: &str) -> impl Future<Output = http::Response<Body>> {
        let request = http::Request::builder()
            .uri("/retrace.v1.Evaluator/Evaluate")
            .header("grpc-timeout", timeout)
            .body(())
            .unwrap();
        let response = WithDeadline(Never).call(request);
        async move { response.await.unwrap() }
    }

    /// tonic's order: its timer is set, then the layer is called. Time passes between the two
    /// (1 ms here, as on a loaded machine); when tonic's timer fires the layer must already
    /// have answered, or the caller hears tonic's CANCELLED.
    #[tokio::test(start_paused = true)]
    async fn the_layer_answers_before_a_timer_tonic_set_just_before_it() {
        let timeout = Duration::from_millis(100);
        let tonic_timer = tokio::time::sleep(timeout);
        tokio::time::advance(Duration::from_millis(1)).await;
        let request = http::Request::builder()
            .uri("/retrace.v1.Evaluator/Evaluate")
            .header("grpc-timeout", "100m")
            .body(())
            .unwrap();
        let layer = WithDeadline(Never).call(request);
        let first = tokio::select! {
            biased;
            r = layer => Some(r.unwrap()),
            _ = tonic_timer => None,
        };
        let response = first.expect("tonic's timer fired before the layer answered");
        let status = tonic::Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::DeadlineExceeded);
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_is_deadline_exceeded() {
        let response = call("50m").await;
        let status = tonic::Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert_eq!(
            status.message(),
            "deadline exceeded: the caller's 50ms ran out before the request had arrived whole"
        );
    }
}
