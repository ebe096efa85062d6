//! Test harness: fake evaluators (tests only) and an in-process server on 127.0.0.1:0.
#![allow(dead_code)]

/// The repository's root, where `tests/fixtures/` lies.
pub const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

pub mod count;
pub mod http2;
pub mod llama;
pub mod load;
pub mod upstream;
pub mod vllm;
pub mod wire;

pub use count::Count;
use futures::future::BoxFuture;
use retrace::Config;
use retrace::EvaluatorLoader;
use retrace::Judgement;
use retrace::pb;
use retrace::{Description, EngineError, Evaluator, Job};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
pub use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Scores a step 0.1 when it contains "wrong", else 0.9, after `delay`; refuses a step that
/// contains "refuse" with INVALID_ARGUMENT naming it, as a model's formatter would.
pub struct Fake {
    pub delay: Duration,
    pub counters: Arc<Counters>,
}

#[derive(Default)]
pub struct Counters {
    /// Jobs that reached the "model".
    pub started: Count,
    /// Jobs that finished.
    pub finished: Count,
    /// Jobs running now, and the most that ever ran at once.
    pub running: Count,
    pub peak: Count,
}

impl Counters {
    pub fn started(&self) -> usize {
        self.started.get() as usize
    }
    pub fn finished(&self) -> usize {
        self.finished.get() as usize
    }
    /// The most jobs that ever ran at once.
    pub fn peak(&self) -> usize {
        self.peak.get() as usize
    }
    /// Waits (up to 10 s) until `n` jobs have reached the model.
    pub async fn until_started(&self, n: usize) {
        let within = Duration::from_secs(10);
        self.started.reach(n as i64, within, "jobs started").await;
    }
}

impl Evaluator for Fake {
    fn describe(&self) -> Description {
        Description {
            kind: "prm".into(),
            family: "fake".into(),
            model: "fake-model".into(),
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            self.counters.started.add(1);
            if let Some(i) = job
                .trace
                .steps
                .iter()
                .position(|s| s.text.contains("refuse"))
            {
                return Err(EngineError::invalid(
                    retrace::FieldPath::root().then("steps").at(i),
                    "refused by the fake",
                ));
            }
            let running = self.counters.running.add(1);
            self.counters.peak.max(running);
            tokio::time::sleep(self.delay).await;
            self.counters.running.add(-1);
            let scores = job
                .trace
                .steps
                .iter()
                .map(|s| if s.text.contains("wrong") { 0.1 } else { 0.9 })
                .collect();
            self.counters.finished.add(1);
            Ok(Judgement::from_scores(scores, job.threshold))
        })
    }
}

/// A config whose evaluators are fakes: each `[[evaluator]]` must still validate as a PRM.
pub fn config(server_extra: &str, evaluators: &[(&str, &str)]) -> Config {
    let mut text = format!("[server]\n{server_extra}\n");
    for (name, extra) in evaluators {
        text.push_str(&format!(
            "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"fake\"\n{extra}\n"
        ));
    }
    Config::parse(&text, "test config", &[]).expect("test config is valid")
}

/// A loader that builds fakes with `delay`, after `gate` lets it (to hold the server in loading).
pub fn fake_loader(
    delay: Duration,
    counters: Arc<Counters>,
    gate: Option<Arc<Semaphore>>,
) -> EvaluatorLoader {
    Arc::new(move |_cfg, _loaded| {
        if let Some(g) = &gate {
            let handle = tokio::runtime::Handle::current();
            let permit = handle
                .block_on(g.clone().acquire_owned())
                .expect("gate open");
            permit.forget();
        }
        let fake = Fake {
            delay,
            counters: counters.clone(),
        };
        Ok(Arc::new(fake) as Arc<dyn Evaluator>)
    })
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub handle: JoinHandle<Result<(), retrace::ServeError>>,
}

impl TestServer {
    pub async fn start(config: Config, loader: EvaluatorLoader) -> TestServer {
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (addr, metrics_addr) = (grpc.local_addr().unwrap(), metrics.local_addr().unwrap());
        let http_addr = http.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let listeners = retrace::Listeners {
            grpc,
            http: Some(http),
            metrics: Some(metrics),
        };
        let handle = tokio::spawn(retrace::serve(config, loader, listeners, async {
            let _ = stopped.await;
        }));
        TestServer {
            addr,
            metrics_addr,
            http_addr,
            stop: Some(stop),
            handle,
        }
    }

    /// A connection: the listener was bound before the server started, so it takes one at
    /// once and the handshake waits for the server.
    pub async fn channel(&self) -> Channel {
        let url = format!("http://{}", self.addr);
        let endpoint = Channel::from_shared(url.clone()).unwrap();
        match tokio::time::timeout(Duration::from_secs(10), endpoint.connect()).await {
            Ok(Ok(c)) => c,
            other => panic!("server at {url} took no connection: {other:?}"),
        }
    }

    pub async fn client(&self) -> pb::evaluator_client::EvaluatorClient<Channel> {
        pb::evaluator_client::EvaluatorClient::new(self.channel().await)
    }

    /// Waits until the server reports SERVING.
    pub async fn ready(&self) {
        let serving = ServingStatus::Serving;
        let within = Duration::from_secs(5);
        assert!(
            until_health(self.channel().await, "", serving, within).await,
            "server never became SERVING"
        );
    }

    pub async fn stop(mut self) -> Result<(), retrace::ServeError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.handle.await.expect("server task")
    }

    pub fn begin_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// GETs /metrics over plain HTTP/1.0.
    pub async fn scrape(&self) -> String {
        scrape(self.metrics_addr).await
    }

    /// Scrapes until the sample `name{labels}` reads `want` (a gauge or counter the server
    /// moves on its own time), up to `within`; the last scrape. Panics naming what it read.
    pub async fn until_sample(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        want: f64,
        within: Duration,
    ) -> String {
        let until = tokio::time::Instant::now() + within;
        loop {
            let metrics = self.scrape().await;
            let got = sample(&metrics, name, labels);
            if got == Some(want) {
                return metrics;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "{name}{labels:?} read {got:?}, not {want}, after {within:?}: {metrics}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Waits on the health Watch of `service` ("" for the server) until it reports `want`, up to
/// `within`: the server pushes every change, so nothing polls. Whether it came.
pub async fn until_health(
    channel: Channel,
    service: &str,
    want: ServingStatus,
    within: Duration,
) -> bool {
    let mut health = HealthClient::new(channel);
    let request = HealthCheckRequest {
        service: service.into(),
    };
    let watch = async {
        let Ok(reply) = health.watch(request).await else {
            return false;
        };
        let mut stream = reply.into_inner();
        while let Ok(Some(r)) = stream.message().await {
            if r.status == want as i32 {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(within, watch).await.unwrap_or(false)
}

pub async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(
        body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200"),
        "{body}"
    );
    body
}

/// The value of the first sample line that starts with `prefix` (name plus labels), if any.
pub fn sample(metrics: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The largest |got - want|, element by element; infinite where either side holds a NaN or
/// their lengths differ. `f32::max` and `f64::max` drop a NaN operand, so a fold over them
/// passes NaN scores under any tolerance.
pub fn max_gap<A: Copy + Into<f64>, B: Copy + Into<f64>>(got: &[A], want: &[B]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut worst = 0.0f64;
    for (&x, &y) in got.iter().zip(want) {
        let (x, y): (f64, f64) = (x.into(), y.into());
        let d = (x - y).abs();
        if d.is_nan() {
            return f64::INFINITY;
        }
        worst = worst.max(d);
    }
    worst
}

/// The step scores of a response, in order.
pub fn step_scores(r: &pb::EvaluateResponse) -> Vec<f32> {
    r.steps.iter().map(|s| s.score).collect()
}

pub fn steps_trace(question: &str, steps: &[&str]) -> pb::Trace {
    pb::Trace {
        question: question.into(),
        steps: steps.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// One Evaluate with `deadline` in its header (the server enforces it); fails the test if no
/// status came back within the deadline and `slack`.
pub async fn evaluate_within(
    s: &TestServer,
    evaluator: &str,
    trace: pb::Trace,
    deadline: Duration,
    slack: Duration,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    // A bare HTTP/2 call: tonic's client would cut the call itself at the deadline (CANCELLED,
    // "Timeout expired") whenever the server's answer, sent just before it, is a few ms late on
    // a loaded machine; the test is about what the server answers, and by when.
    let mut connection = http2::connect(s.addr).await;
    let started = std::time::Instant::now();
    let response = http2::unary_within(
        &mut connection,
        s.addr,
        "/retrace.v1.Evaluator/Evaluate",
        &request("r", evaluator, trace),
        Some(&format!("{}m", deadline.as_millis())),
    )
    .expect("the request is sent");
    let (status, data) = tokio::time::timeout(deadline + slack, http2::finish(response))
        .await
        .unwrap_or_else(|_| panic!("no status within {:?}", deadline + slack))
        .expect("the call ends with a status");
    assert!(
        started.elapsed() < deadline + slack,
        "took {:?}",
        started.elapsed()
    );
    match status.code() {
        tonic::Code::Ok => Ok(http2::decode_one(&data)),
        _ => Err(status),
    }
}

pub fn request(id: &str, evaluator: &str, trace: pb::Trace) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        id: id.into(),
        evaluator: evaluator.into(),
        trace: Some(trace),
        threshold: None,
    }
}

/// A free port on 127.0.0.1, for a child process that binds its own.
/// Each row's reads at `value`, every token computed: what a fake `Scorer` answers.
pub fn rows_at(batch: &[&retrace::Encoded], value: f32) -> Vec<retrace_model::Row> {
    batch
        .iter()
        .map(|e| retrace_model::Row {
            scores: vec![value; e.positions.len()],
            categories: Vec::new(),
            tokens: retrace_model::Tokens {
                computed: e.ids.len(),
                reused: 0,
            },
        })
        .collect()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills a child process (a `retrace serve` under test) when the test ends, pass or fail.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `retrace serve` child process with `args` (on free ports of 127.0.0.1), and a channel to it
/// once it is SERVING; also its metrics address.
pub async fn spawn_retrace(
    args: &[&std::ffi::OsStr],
    envs: &[(&str, &str)],
) -> (ChildGuard, Channel, SocketAddr) {
    spawn_retrace_on(free_port(), args, envs).await
}

/// `spawn_retrace` with gRPC on 127.0.0.1:`grpc`. A port found free may be taken by another
/// test's server before this one binds it, so a server that exits before it serves is started
/// again on fresh ports (its stderr, above, says why), up to three times.
pub async fn spawn_retrace_on(
    grpc: u16,
    args: &[&std::ffi::OsStr],
    envs: &[(&str, &str)],
) -> (ChildGuard, Channel, SocketAddr) {
    for _ in 0..3 {
        if let Some(up) = try_spawn_retrace_on(grpc, args, envs).await {
            return up;
        }
    }
    panic!("retrace exited early three times");
}

/// One start of `spawn_retrace_on`; `None` when the server exits before it accepts gRPC.
async fn try_spawn_retrace_on(
    grpc: u16,
    args: &[&std::ffi::OsStr],
    envs: &[(&str, &str)],
) -> Option<(ChildGuard, Channel, SocketAddr)> {
    let metrics = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_retrace"))
        .arg("serve")
        .args(args)
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}")])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .args(["--http-addr", &format!("127.0.0.1:{}", free_port())])
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawning retrace");
    let mut server = ChildGuard(child);
    let url = format!("http://127.0.0.1:{grpc}");
    let channel = loop {
        if let Ok(c) = Channel::from_shared(url.clone()).unwrap().connect().await {
            break c;
        }
        if server.0.try_wait().unwrap().is_some() {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let loading = Duration::from_secs(60);
    let serving = until_health(channel.clone(), "", ServingStatus::Serving, loading).await;
    assert!(serving, "retrace never became SERVING");
    Some((
        server,
        channel,
        format!("127.0.0.1:{metrics}").parse().unwrap(),
    ))
}

/// A ProcessBench split's JSON file: the committed subset under tests/fixtures/processbench (32
/// traces per split; its README says which and how scripts/fixtures/processbench_subset.py
/// regenerates it from the full set).
pub fn processbench(split: &str) -> std::path::PathBuf {
    let path = std::path::Path::new(REPO)
        .join("tests/fixtures/processbench")
        .join(format!("{split}.json"));
    assert!(
        path.is_file(),
        "ProcessBench fixture missing at {}",
        path.display()
    );
    path
}

/// A process's resident set (VmRSS) in KiB, from /proc.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("a VmRSS line")
}

/// A config file serving the committed tiny PRM as `tiny` (family qwen2-math-prm), with
/// `server_extra` lines under `[server]`; written under a fresh temporary folder.
pub fn tiny_prm_config(tag: &str, server_extra: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model =
        std::path::Path::new(crate::common::REPO).join("tests/fixtures/tiny/qwen2-math-prm");
    let path = dir.join("retrace.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\n{server_extra}\n[[evaluator]]\nname = \"tiny\"\nkind = \"prm\"\n\
             family = \"qwen2-math-prm\"\nmodel = {:?}\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    path
}

/// A folder under the system temp dir, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "retrace-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
