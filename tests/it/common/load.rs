//! A load generator for overload tests: requests sent with a deadline, the outcomes tallied by
//! code, latencies kept for quantiles, closed loops to measure what a server sustains.

use retrace::pb;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tonic::Code;
use tonic::transport::Channel;

/// Past the deadline, how long the client waits before calling a request unanswered.
pub const UNANSWERED: Duration = Duration::from_secs(3);

/// How one request ended, and after how long.
pub struct Outcome {
    pub code: Option<Code>,
    pub latency: Duration,
    pub started: Instant,
    /// The server's GOAWAY refused the stream before it was read: the request never reached
    /// the service (tonic reports this as INTERNAL, "connection error received").
    pub unprocessed: bool,
    /// The status's message, for a failure's report.
    pub message: String,
}

/// Sends `request` with `deadline`; `code` is None when nothing came back in time.
pub async fn send(channel: Channel, request: pb::EvaluateRequest, deadline: Duration) -> Outcome {
    let mut client = pb::evaluator_client::EvaluatorClient::new(channel);
    let mut req = tonic::Request::new(request);
    req.set_timeout(deadline);
    let started = Instant::now();
    let answer = tokio::time::timeout(deadline + UNANSWERED, client.evaluate(req))
        .await
        .ok();
    let unprocessed = matches!(&answer, Some(Err(s)) if refused_by_goaway(s));
    let message = match &answer {
        Some(Err(s)) => s.message().to_string(),
        _ => String::new(),
    };
    Outcome {
        message,
        code: answer.map(|r| r.map_or_else(|s| code_seen(&s), |_| Code::Ok)),
        latency: started.elapsed(),
        started,
        unprocessed,
    }
}

/// A stream the client opened past the last one a server's GOAWAY accepts: h2 fails it with the
/// GOAWAY's reason (NO_ERROR on a graceful shutdown), or resets it REFUSED_STREAM, which tonic
/// reports as INTERNAL. The server never saw the request, so it is safe to send again
/// elsewhere. Read from the h2 error behind the status, not from its message's words.
fn refused_by_goaway(status: &tonic::Status) -> bool {
    use std::error::Error;
    let mut cause: Option<&(dyn Error + 'static)> = Error::source(status);
    while let Some(e) = cause {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let graceful = h2.is_go_away() && h2.reason() == Some(h2::Reason::NO_ERROR);
            return graceful || h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        cause = e.source();
    }
    false
}

/// The status's code, with tonic's own client timer counted as the deadline it is: the server
/// answers a little before the deadline, and when that answer is a few ms late on a loaded
/// machine the client's timer fires first (CANCELLED, "Timeout expired"), which for the caller
/// is a request past its deadline.
pub fn code_seen(status: &tonic::Status) -> Code {
    match (status.code(), status.message()) {
        (Code::Cancelled, "Timeout expired") => Code::DeadlineExceeded,
        (code, _) => code,
    }
}

/// The `p` quantile (nearest rank) of `xs`, in ms.
pub fn ms_quantile(xs: &[Duration], p: f64) -> f64 {
    let mut v: Vec<Duration> = xs.to_vec();
    v.sort();
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1].as_secs_f64() * 1e3
}

/// p50 / p99 / max, in ms.
pub fn quantiles(xs: &[Duration]) -> String {
    format!(
        "{:.1} / {:.1} / {:.1}",
        ms_quantile(xs, 0.5),
        ms_quantile(xs, 0.99),
        ms_quantile(xs, 1.0)
    )
}

/// Counts of outcomes by code, as the client saw them.
#[derive(Default)]
pub struct Tally {
    pub ok: usize,
    pub exhausted: usize,
    pub deadline: usize,
    pub other: Vec<Code>,
    pub unanswered: usize,
    /// Latencies of admitted requests (every answer but RESOURCE_EXHAUSTED).
    pub admitted: Vec<Duration>,
    pub refused: Vec<Duration>,
    /// Each refusal slower than `SLOW_REFUSAL`: when it was sent, its latency and its message,
    /// so a failed floor says which path refused late.
    pub slow_refusals: Vec<(Instant, Duration, String)>,
}

/// A refusal slower than this is kept with its message (`Tally::slow_refusals`).
pub const SLOW_REFUSAL: Duration = Duration::from_millis(100);

impl Tally {
    pub fn add(&mut self, o: &Outcome) {
        match o.code {
            None => self.unanswered += 1,
            Some(Code::ResourceExhausted) => {
                self.exhausted += 1;
                self.refused.push(o.latency);
                if o.latency > SLOW_REFUSAL {
                    let slow = (o.started, o.latency, o.message.clone());
                    self.slow_refusals.push(slow);
                }
            }
            Some(code) => {
                match code {
                    Code::Ok => self.ok += 1,
                    Code::DeadlineExceeded => self.deadline += 1,
                    other => self.other.push(other),
                }
                self.admitted.push(o.latency);
            }
        }
    }

    pub fn total(&self) -> usize {
        self.ok + self.exhausted + self.deadline + self.other.len() + self.unanswered
    }
}

/// Request `i` of a workload.
pub type Workload = Arc<dyn Fn(usize) -> pb::EvaluateRequest + Send + Sync>;

/// Closed loop: `workers` callers, each sending its next request (`make(i)`, with `deadline`)
/// when the last is answered, for `secs`; returns the requests that came back OK per second,
/// the rate the server sustains.
pub async fn closed_loop(
    channel: &Channel,
    workers: usize,
    secs: f64,
    deadline: Duration,
    make: &Workload,
    tally: &mut Tally,
) -> f64 {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut set = JoinSet::new();
    for w in 0..workers {
        let (channel, make) = (channel.clone(), make.clone());
        set.spawn(async move {
            let mut outcomes = Vec::new();
            let mut i = w;
            while Instant::now() < end {
                outcomes.push(send(channel.clone(), make(i), deadline).await);
                i += workers;
            }
            outcomes
        });
    }
    let started = Instant::now();
    let mut ok = 0;
    while let Some(outcomes) = set.join_next().await {
        for o in outcomes.unwrap() {
            ok += usize::from(o.code == Some(Code::Ok));
            tally.add(&o);
        }
    }
    ok as f64 / started.elapsed().as_secs_f64()
}

/// Open loop: request `first + i` leaves at `i / rate` whatever came back, as a trainer's
/// reward calls do, for `secs`; returns the tally and how long until the last was answered.
pub async fn open_loop(
    channel: &Channel,
    rate: f64,
    secs: f64,
    deadline: Duration,
    make: &Workload,
    first: usize,
) -> (Tally, Duration) {
    let n = (rate * secs).ceil() as usize;
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..n {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(i as f64 / rate)).into()).await;
        set.spawn(send(channel.clone(), make(first + i), deadline));
    }
    let mut tally = Tally::default();
    while let Some(o) = set.join_next().await {
        tally.add(&o.unwrap());
    }
    (tally, t0.elapsed())
}
