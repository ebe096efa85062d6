//! Where traces are judged: a running server reached over gRPC (checked SERVING first), or the
//! evaluators of a config loaded in this process.

use super::{EvalError, shown};
use retrace::Config;
use retrace::Engine;
use retrace::pb;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

/// Where traces are judged.
pub(crate) enum EvalBackend {
    /// A running server, over EvaluateStream.
    Remote {
        addr: String,
        client: Box<pb::evaluator_client::EvaluatorClient<Channel>>,
        token: Option<MetadataValue<Ascii>>,
    },
    /// Evaluators loaded in this process.
    Local { engine: Arc<Engine> },
}

impl EvalBackend {
    /// Connects to `addr` (`host:port` or a URL) and waits up to `wait` for it to report SERVING.
    pub(crate) async fn connect(
        addr: &str,
        token: Option<String>,
        ca_cert: Option<&Path>,
        wait: Duration,
    ) -> Result<EvalBackend, EvalError> {
        let fail = |message: String| EvalError::Connect {
            addr: addr.to_string(),
            message,
        };
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|e| fail(e.to_string()))?
            .connect_timeout(Duration::from_secs(5));
        if let Some(ca) = ca_cert {
            let pem = std::fs::read(ca)
                .map_err(|e| EvalError::io(format!("reading {}", shown(ca)), e))?;
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
                .map_err(|e| fail(e.to_string()))?;
        }
        let token = token
            .map(|t| format!("Bearer {t}").parse())
            .transpose()
            .map_err(|_| fail("the bearer token is not valid header text".into()))?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let last = match endpoint.connect().await {
                Ok(channel) => {
                    let mut health =
                        tonic_health::pb::health_client::HealthClient::new(channel.clone());
                    let check = tonic_health::pb::HealthCheckRequest {
                        service: String::new(),
                    };
                    match health.check(check).await {
                        Ok(r) if r.get_ref().status == 1 => {
                            return Ok(EvalBackend::Remote {
                                addr: addr.to_string(),
                                client: Box::new(pb::evaluator_client::EvaluatorClient::new(
                                    channel,
                                )),
                                token,
                            });
                        }
                        Ok(_) => "the server is not SERVING yet (still loading?)".to_string(),
                        Err(s) => format!("health check: {s}"),
                    }
                }
                Err(e) => match std::error::Error::source(&e) {
                    Some(cause) => format!("{e}: {cause}"),
                    None => e.to_string(),
                },
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(fail(format!("gave up after {wait:?}: {last}")));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Loads every evaluator of `config` in this process.
    pub(crate) async fn local(config: &Config) -> Result<EvalBackend, EvalError> {
        let engine = retrace::new_engine(config);
        retrace::load_engine(&engine, config, retrace::default_loader())
            .await
            .map_err(EvalError::Load)?;
        Ok(EvalBackend::Local { engine })
    }

    /// The name of the evaluator `requested` selects (empty: the default).
    pub(crate) async fn resolve(&self, requested: &str) -> Result<String, EvalError> {
        match self {
            EvalBackend::Local { engine } => engine
                .resolve_name(requested)
                .map(str::to_string)
                .map_err(|e| EvalError::Usage(e.to_string())),
            EvalBackend::Remote {
                client,
                token,
                addr,
            } => {
                let list = list_evaluators(client, token.as_ref()).await.map_err(|s| {
                    EvalError::Connect {
                        addr: addr.clone(),
                        message: format!("ListEvaluators: {s}"),
                    }
                })?;
                let found = list
                    .iter()
                    .find(|e| {
                        if requested.is_empty() {
                            e.is_default
                        } else {
                            e.name == requested
                        }
                    })
                    .map(|e| e.name.clone());
                found.ok_or_else(|| {
                    let names: Vec<_> = list.iter().map(|e| e.name.as_str()).collect();
                    EvalError::Usage(format!(
                        "the server hosts no evaluator {requested:?} (it hosts {})",
                        names.join(", ")
                    ))
                })
            }
        }
    }
}

/// The server's evaluators. The call is sent again, up to twice, when the connection fails
/// under it: a server retiring its connections may cut this first call as it cuts any other,
/// and asking again changes nothing on the server.
async fn list_evaluators(
    client: &pb::evaluator_client::EvaluatorClient<Channel>,
    token: Option<&MetadataValue<Ascii>>,
) -> Result<Vec<pb::EvaluatorInfo>, tonic::Status> {
    let mut tries = 0;
    loop {
        let mut req = tonic::Request::new(pb::ListEvaluatorsRequest {});
        if let Some(t) = token {
            req.metadata_mut().insert("authorization", t.clone());
        }
        match client.clone().list_evaluators(req).await {
            Ok(reply) => return Ok(reply.into_inner().evaluators),
            Err(s) if connection_lost(&s) && tries < 2 => tries += 1,
            Err(s) => return Err(s),
        }
    }
}

/// Whether `status` is the connection failing under a call (tonic made it from a transport
/// error, which it keeps as the source) rather than a status the server sent: what a server
/// retiring the connection (`max_connection_age_s` and its grace) does to a call still on it.
pub(crate) fn connection_lost(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
}
