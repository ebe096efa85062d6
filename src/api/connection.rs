//! How long one gRPC connection lives. A gRPC client keeps its connection for ever, so pods
//! that join behind a headless Service would get no calls from clients already connected:
//! after `max_connection_age_s` tonic sends GOAWAY (the client opens its next calls on a new
//! connection, resolving the Service again), calls in flight go on, and after a further
//! `max_connection_age_grace_s` the connection is closed under whatever is still running.
//!
//! The close is ours: tonic 0.14's own grace setting skips the GOAWAY (it sleeps through age
//! and grace, then drops the connection with no warning). So tonic gets the age alone, and each
//! accepted socket here stops reading and writing when its age and grace are spent, which ends
//! the connection.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted socket that fails every read and write once `life` has passed.
pub(crate) struct Aged<IO> {
    io: IO,
    end: Pin<Box<Sleep>>,
}

impl<IO> Aged<IO> {
    fn new(io: IO, life: Duration) -> Self {
        Aged {
            io,
            end: Box::pin(tokio::time::sleep(life)),
        }
    }

    /// Whether the connection's life is over; otherwise the task is woken when it is.
    fn over(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        self.end.as_mut().poll(cx).is_ready().then(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "connection outlived server.max_connection_age_s + max_connection_age_grace_s",
            )
        })
    }
}

/// The gRPC listener's connections, each closed after `life` (age plus grace).
pub(crate) fn incoming(
    listener: TcpListener,
    life: Duration,
) -> impl tokio_stream::Stream<Item = io::Result<Aged<TcpStream>>> {
    TcpListenerStream::new(listener).map(move |accepted| {
        let socket = accepted?;
        // Small gRPC frames must not wait on Nagle's algorithm (tonic sets this on the
        // listeners it binds itself, not on ours).
        socket.set_nodelay(true)?;
        Ok(Aged::new(socket, life))
    })
}

impl<IO: AsyncRead + Unpin> AsyncRead for Aged<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.over(cx) {
            Some(e) => Poll::Ready(Err(e)),
            None => Pin::new(&mut this.io).poll_read(cx, buf),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Aged<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match this.over(cx) {
            Some(e) => Poll::Ready(Err(e)),
            None => Pin::new(&mut this.io).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl Connected for Aged<TcpStream> {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_socket_serves_until_its_life_is_over_then_fails() {
        let (near, mut far) = tokio::io::duplex(64);
        let mut aged = Aged::new(near, Duration::from_millis(50));
        far.write_all(b"hi").await.unwrap();
        let mut buf = [0u8; 2];
        aged.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hi");
        aged.write_all(b"ok").await.unwrap();
        // A read waiting for bytes that never come ends when the life does.
        let err = aged.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(aged.write(b"late").await.is_err());
    }
}
