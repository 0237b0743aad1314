//! How the router serves a client connection: HTTP/1.1 or HTTP/2 with prior
//! knowledge (h2c), told apart by the connection's first bytes (the HTTP/2
//! preface `PRI * HTTP/2.0`), on the same port.
//!
//! Both protocols go through the same service, so the function header,
//! `Host` (from `:authority` on HTTP/2), the forwarding headers, the request
//! and body timeouts, retries and metrics are the same.
//!
//! HTTP/1.1 is served exactly as without HTTP/2 (the same builder): the
//! connection's first bytes, read to tell the protocols apart, are handed
//! back to it in front of the rest ([`Prefixed`]). The wait for them is
//! bounded by `--idle-timeout`, like the wait for a request head.
//!
//! HTTP/2 is bounded so that no client can make the router hold more than a
//! fixed amount per connection:
//! - at most [`MAX_CONCURRENT_STREAMS`] streams at once (more are refused
//!   with `REFUSED_STREAM`);
//! - a client can push at most [`STREAM_WINDOW`] bytes of a request body
//!   ahead of the router's reading per stream and [`CONNECTION_WINDOW`] per
//!   connection (the router reads a body only as fast as it forwards it);
//! - at most [`MAX_SEND_BUFFER`] bytes of response data are buffered per
//!   stream for a client that does not read (its window stays closed); the
//!   write timeout of [`super::proxy::client_io`] then ends the connection;
//! - a header block larger than [`super::MAX_REQUEST_HEAD_BYTES`] is
//!   answered 431, as on HTTP/1.1;
//! - streams a client resets before the router answers are bounded by h2's
//!   defaults (the rapid-reset guard);
//! - an idle connection is pinged every `--idle-timeout` and closed when a
//!   ping is not answered within [`PING_TIMEOUT`].
//!
//! Stream tasks run on the router's connection tracker ([`Tracked`]), so
//! the drain waits for them like for connections.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http2;
use hyper_util::rt::TokioTimer;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, ReadBuf};
use tokio_util::task::TaskTracker;

/// Streams one HTTP/2 client connection may have open at once.
pub const MAX_CONCURRENT_STREAMS: u32 = 128;
/// Request body bytes a client may send ahead per stream.
pub const STREAM_WINDOW: u32 = 256 * 1024;
/// Request body bytes a client may send ahead per connection.
pub const CONNECTION_WINDOW: u32 = 1024 * 1024;
/// Response bytes buffered per stream for a client that does not read.
pub const MAX_SEND_BUFFER: usize = 64 * 1024;
/// How long an idle HTTP/2 client has to answer a ping.
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Spawns HTTP/2 stream tasks on the router's connection tracker.
#[derive(Clone, Debug)]
pub struct Tracked(pub TaskTracker);

impl<F> hyper::rt::Executor<F> for Tracked
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        self.0.spawn(fut);
    }
}

/// The HTTP/2 connection preface a prior-knowledge client opens with.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The protocol a client connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// Reads the first bytes of `io` until they tell the protocol: the full
/// HTTP/2 preface, or anything else (HTTP/1.1, also for a connection that
/// ends early). Returns the bytes read, to be served again by [`Prefixed`];
/// `None` when the client sent nothing telling within `within` (the
/// connection is closed, as for a request head that does not come).
///
/// # Errors
/// A failed read.
pub async fn detect<S: AsyncRead + Unpin>(
    io: &mut S,
    within: Duration,
) -> io::Result<Option<(Protocol, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(PREFACE.len());
    let reading = async {
        loop {
            let mut chunk = [0u8; PREFACE.len()];
            let n = io.read(&mut chunk[..PREFACE.len() - buf.len()]).await?;
            buf.extend_from_slice(&chunk[..n]);
            if n == 0 || !PREFACE.starts_with(&buf) {
                return Ok::<_, io::Error>(Protocol::Http1);
            }
            if buf.len() == PREFACE.len() {
                return Ok(Protocol::Http2);
            }
        }
    };
    match tokio::time::timeout(within, reading).await {
        Ok(p) => Ok(Some((p?, buf))),
        Err(_) => Ok(None),
    }
}

/// A connection whose first bytes were already read: they are served
/// again before the rest.
#[derive(Debug)]
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `inner`, with `prefix` read from it before.
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self { prefix, at: 0, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            if self.at == self.prefix.len() {
                self.prefix = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The HTTP/2 connection builder, with the bounds above; stream tasks run
/// on `connections`.
#[must_use]
pub fn http2(connections: TaskTracker, idle_timeout: Duration) -> http2::Builder<Tracked> {
    let mut b = http2::Builder::new(Tracked(connections));
    b.timer(TokioTimer::new())
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_send_buf_size(MAX_SEND_BUFFER)
        .max_header_list_size(u32::try_from(super::MAX_REQUEST_HEAD_BYTES).unwrap_or(u32::MAX))
        .keep_alive_interval(idle_timeout)
        .keep_alive_timeout(PING_TIMEOUT);
    b
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    #[tokio::test(start_paused = true)]
    async fn the_preface_tells_http2_anything_else_http1_and_the_bytes_are_served_again() {
        let cases: [(&[u8], Option<Protocol>); 5] = [
            (PREFACE, Some(Protocol::Http2)),
            (b"GET / HTTP/1.1\r\n\r\n", Some(Protocol::Http1)),
            (b"PRI * HTTP/1.1\r\n\r\n", Some(Protocol::Http1)),
            (b"PUT", Some(Protocol::Http1)),
            (b"PRI", None),
        ];
        for (sent, want) in cases {
            let (mut a, mut b) = tokio::io::duplex(64);
            a.write_all(sent).await.unwrap();
            if want.is_some() && sent.len() < PREFACE.len() {
                a.shutdown().await.unwrap();
            }
            let got = detect(&mut b, Duration::from_millis(200)).await.unwrap();
            assert_eq!(got.as_ref().map(|(p, _)| *p), want, "{sent:?}");
            if let Some((_, prefix)) = got {
                drop(a);
                let mut again = Vec::new();
                Prefixed::new(prefix, b).read_to_end(&mut again).await.unwrap();
                assert_eq!(again, sent, "{sent:?}");
            }
        }
    }
}
