//! An OpenAI-compatible upstream faulty at the socket level, on a tokio TcpListener on 127.0.0.1:
//! it stalls, resets, cuts off or floods a connection mid-reply, which an HTTP framework would not
//! let a test do, and it counts the connections still open, so a test can see the judge close them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the upstream does with every request.
#[derive(Debug, Clone)]
pub enum Wire {
    /// Reads the request and never answers.
    Silent,
    /// Sends the headers, promising a longer body, and the start of it; then nothing more.
    Stall,
    /// The headers and the start of the body, then a reset (RST).
    Reset,
    /// The headers and the start of the body, then an orderly close (FIN) short of its length.
    Close,
    /// A 200 of `bytes` bytes, chunked (no Content-Length to refuse it by), written as fast as the
    /// judge reads it.
    Flood(usize),
    /// A whole 200 with this JSON body; the connection stays open for the next request.
    Json(String),
}

pub struct WireUpstream {
    pub addr: SocketAddr,
    state: Arc<State>,
}

struct State {
    fault: Mutex<Wire>,
    accepted: AtomicUsize,
    open: super::Count,
    requests: AtomicUsize,
    /// Body bytes the socket took, summed over connections.
    written: AtomicUsize,
}

/// Counts a connection open until its task ends: the judge closed it, or reset it.
struct Open(Arc<State>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.add(-1);
    }
}

/// The start of every body sent short, so the judge has read something before the fault.
const PART: &[u8] = br#"{"id":"chatcmpl-x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Paragraph 0"#;

impl WireUpstream {
    pub async fn start(fault: Wire) -> WireUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            fault: Mutex::new(fault),
            accepted: AtomicUsize::new(0),
            open: super::Count::default(),
            requests: AtomicUsize::new(0),
            written: AtomicUsize::new(0),
        });
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                shared.open.add(1);
                let open = Open(shared.clone());
                tokio::spawn(connection(socket, open));
            }
        });
        WireUpstream { addr, state }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn set(&self, fault: Wire) {
        *self.state.fault.lock().unwrap() = fault;
    }

    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    pub fn accepted(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    pub fn open(&self) -> usize {
        self.state.open.get() as usize
    }

    pub fn written(&self) -> usize {
        self.state.written.load(Ordering::SeqCst)
    }

    /// Waits up to `within` for every connection to be closed by the judge.
    pub async fn wait_closed(&self, within: Duration) -> bool {
        self.state.open.until(within, |n| *n == 0).await
    }
}

/// Serves requests on one connection until the judge closes it or a fault ends it.
async fn connection(mut socket: TcpStream, open: Open) {
    let state = open.0.clone();
    while read_request(&mut socket).await {
        state.requests.fetch_add(1, Ordering::SeqCst);
        let fault = state.fault.lock().unwrap().clone();
        let short = |len: usize| {
            let mut head = head(&format!("content-length: {len}")).into_bytes();
            head.extend_from_slice(PART);
            head
        };
        match fault {
            Wire::Silent => return until_closed(&mut socket).await,
            Wire::Stall => {
                if socket.write_all(&short(4096)).await.is_ok() {
                    until_closed(&mut socket).await;
                }
                return;
            }
            Wire::Reset => {
                let _ = socket.write_all(&short(4096)).await;
                // Linger 0: closing sends RST instead of FIN.
                let _ = socket.set_zero_linger();
                return;
            }
            Wire::Close => {
                let _ = socket.write_all(&short(4096)).await;
                return;
            }
            Wire::Flood(bytes) => {
                if !flood(&mut socket, bytes, &state).await {
                    return;
                }
            }
            Wire::Json(body) => {
                let reply = format!("{}{body}", head(&format!("content-length: {}", body.len())));
                if socket.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn head(length: &str) -> String {
    format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{length}\r\n\r\n")
}

/// Writes a chunked body of `bytes`; false once the judge stopped reading and closed.
async fn flood(socket: &mut TcpStream, bytes: usize, state: &State) -> bool {
    if socket
        .write_all(head("transfer-encoding: chunked").as_bytes())
        .await
        .is_err()
    {
        return false;
    }
    let chunk = vec![b'x'; 64 << 10];
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        let frame = [format!("{n:x}\r\n").as_bytes(), &chunk[..n], b"\r\n"].concat();
        if socket.write_all(&frame).await.is_err() {
            return false;
        }
        sent += n;
        state.written.fetch_add(n, Ordering::SeqCst);
    }
    socket.write_all(b"0\r\n\r\n").await.is_ok()
}

/// Reads one request (headers, then Content-Length bytes of body); false when the judge closed
/// the connection instead.
async fn read_request(socket: &mut TcpStream) -> bool {
    let mut data = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let body_at = loop {
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    };
    let headers = String::from_utf8_lossy(&data[..body_at]).to_ascii_lowercase();
    let length: usize = headers
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while data.len() < body_at + length {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    true
}

/// Holds the connection, reading and discarding, until the judge closes it.
async fn until_closed(socket: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
}
