//! A bare HTTP/2 client (the h2 crate): gRPC calls with no client-side timer or reconnection,
//! so a test sees exactly what the server does: when it answers, and when it sends GOAWAY or
//! closes the connection.

use prost::Message;
use std::net::SocketAddr;
use tokio::task::JoinHandle;
use tonic::Status;
use tonic::codegen::{Bytes, http};

/// One HTTP/2 connection: the handle that opens streams, and the task driving the connection,
/// which ends when the server closes it.
pub struct Connection {
    pub send: h2::client::SendRequest<Bytes>,
    pub closed: JoinHandle<Result<(), h2::Error>>,
}

pub async fn connect(addr: SocketAddr) -> Connection {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    Connection {
        send,
        closed: tokio::spawn(connection),
    }
}

/// The headers of a gRPC call to `path` (`/package.Service/Method`), with `grpc-timeout` when
/// given.
pub fn grpc_headers(addr: SocketAddr, path: &str, timeout: Option<&str>) -> http::Request<()> {
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        request = request.header("grpc-timeout", t);
    }
    request.body(()).unwrap()
}

/// `message` as one uncompressed gRPC frame.
pub fn frame(message: &impl Message) -> Bytes {
    let bytes = message.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(&bytes);
    out.into()
}

/// Sends a unary call whose body is `message`; the response is awaited by `finish`.
pub fn unary(
    connection: &mut Connection,
    addr: SocketAddr,
    path: &str,
    message: &impl Message,
) -> Result<h2::client::ResponseFuture, h2::Error> {
    unary_within(connection, addr, path, message, None)
}

/// `unary` with `grpc-timeout` set to `timeout` (gRPC's text form, e.g. "2000m") when given.
pub fn unary_within(
    connection: &mut Connection,
    addr: SocketAddr,
    path: &str,
    message: &impl Message,
    timeout: Option<&str>,
) -> Result<h2::client::ResponseFuture, h2::Error> {
    let (response, mut body) = connection
        .send
        .send_request(grpc_headers(addr, path, timeout), false)?;
    body.send_data(frame(message), true)?;
    Ok(response)
}

/// The call's status (from the headers of a trailers-only answer, else from the trailers) and
/// the bytes of the messages that came before it.
pub async fn finish(response: h2::client::ResponseFuture) -> Result<(Status, Vec<u8>), h2::Error> {
    let response = response.await?;
    if let Some(status) = Status::from_header_map(response.headers()) {
        return Ok((status, Vec::new()));
    }
    let mut body = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await?.expect("trailers");
    Ok((
        Status::from_header_map(&trailers).expect("a grpc-status trailer"),
        data,
    ))
}

/// The one message of a unary answer's body (`finish`'s bytes), decoded.
pub fn decode_one<M: Message + Default>(data: &[u8]) -> M {
    assert!(
        data.len() >= 5,
        "a gRPC frame needs 5 header bytes, got {}",
        data.len()
    );
    assert_eq!(data[0], 0, "a compressed frame");
    let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
    assert_eq!(data.len(), 5 + len, "one frame");
    M::decode(&data[5..]).expect("a well-formed message")
}
