//! A client connection as the router serves it.
//!
//! - **Slow readers.** A write the client does not take (its receive window
//!   stays full) for `--write-timeout` fails with `TimedOut`, which ends the
//!   connection: the response or tunnel it was for, and the instance
//!   connection behind it, are released. One timer per connection, armed
//!   only while a write waits.
//! - **Half-closed clients.** A client may shut down its sending side once
//!   its request is out and wait for the answer. hyper watches a busy
//!   connection for the end of its input and drops the request when it
//!   comes; so while an [`Exchanges`] of the connection is busy (from a
//!   request's arrival until its response has been handed over in full),
//!   the end of input is held back and shown only once the connection is
//!   idle, which then closes after the answer. A connection reset is an
//!   error, not an end of input: it still ends the request at once.
//!
//! Reads pass through otherwise (hyper bounds the wait for request
//! headers itself).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The requests of one client connection in progress, shared by its
/// service and its [`ClientIo`].
#[derive(Debug, Default)]
pub struct Exchanges {
    busy: AtomicUsize,
    /// The connection's reader, waiting to be shown a held-back end of input.
    reader: AtomicWaker,
}

impl Exchanges {
    /// A request arrived; it is in progress until the guard drops (after
    /// its response body ended).
    #[must_use]
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    fn busy(&self) -> bool {
        self.busy.load(Ordering::Acquire) > 0
    }
}

/// One request in progress on a connection (see [`Exchanges::begin`]).
#[derive(Debug)]
pub struct Busy(Arc<Exchanges>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.reader.wake();
        }
    }
}

/// A response body that keeps its request in progress ([`Busy`]) until it
/// has ended or is dropped.
#[derive(Debug)]
pub struct Answered<B> {
    body: B,
    busy: Option<Busy>,
}

impl<B> Answered<B> {
    /// `body`, keeping `busy` until its end.
    pub fn new(body: B, busy: Busy) -> Self {
        Self {
            body,
            busy: Some(busy),
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Answered<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(r, Poll::Ready(None | Some(Err(_)))) {
            self.busy = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A client connection with a bound on stalled writes that holds back the
/// end of input while a request is in progress.
#[derive(Debug)]
pub struct ClientIo<S> {
    inner: S,
    timeout: Option<Duration>,
    /// Armed while a write waits for the client.
    stall: Option<Pin<Box<Sleep>>>,
    stalled: bool,
    exchanges: Arc<Exchanges>,
    /// The client ended its input; shown once no request is in progress.
    ended: bool,
}

impl<S> ClientIo<S> {
    /// Wraps `inner`; `timeout` bounds a stalled write (`None`: no bound);
    /// `exchanges` tells when a request is in progress.
    pub fn new(inner: S, timeout: Option<Duration>, exchanges: Arc<Exchanges>) -> Self {
        Self {
            inner,
            timeout,
            stall: None,
            stalled: false,
            exchanges,
            ended: false,
        }
    }

    /// The end of input: shown when idle, held back (`Pending`, woken when
    /// the connection turns idle) while a request is in progress.
    fn end_of_input(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.ended = true;
        if !self.exchanges.busy() {
            return Poll::Ready(Ok(()));
        }
        self.exchanges.reader.register(cx.waker());
        if self.exchanges.busy() {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    }

    /// What a write that made progress (or failed) returns: the stall ends.
    fn progressed<T>(&mut self, r: io::Result<T>) -> Poll<io::Result<T>> {
        self.stalled = false;
        Poll::Ready(r)
    }

    /// A write is pending: `Pending` until the timeout, then `TimedOut`.
    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let Some(timeout) = self.timeout else {
            return Poll::Pending;
        };
        if !self.stalled {
            self.stalled = true;
            let deadline = Instant::now() + timeout;
            match &mut self.stall {
                Some(s) => s.as_mut().reset(deadline),
                None => self.stall = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let Some(stall) = self.stall.as_mut() else {
            return Poll::Pending;
        };
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {timeout:?} (--write-timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ClientIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.ended {
            return self.end_of_input(cx);
        }
        let before = buf.filled().len();
        let asked = buf.remaining() > 0;
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if asked && buf.filled().len() == before => self.end_of_input(cx),
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ClientIo<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(r) => self.progressed(r),
            Poll::Pending => self.pending(cx),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => self.progressed(r),
            Poll::Pending => self.pending(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Ready(r) => self.progressed(r),
            Poll::Pending => self.pending(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_shutdown(cx) {
            Poll::Ready(r) => self.progressed(r),
            Poll::Pending => self.pending(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt as _;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_does_not_take_times_out_and_one_it_takes_does_not() {
        // A pipe with a 16-byte buffer that nobody reads.
        let (near, far) = tokio::io::duplex(16);
        let mut io = ClientIo::new(near, Some(Duration::from_secs(30)), Arc::default());
        io.write_all(&[1; 16]).await.unwrap();
        let started = Instant::now();
        let err = io.write_all(&[2; 16]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("--write-timeout"), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(30));

        // A peer reading slowly but steadily keeps a write going.
        let (near, mut far2) = tokio::io::duplex(16);
        let mut io = ClientIo::new(near, Some(Duration::from_secs(30)), Arc::default());
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let mut buf = [0u8; 16];
            let mut total = 0;
            while total < 160 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                total += far2.read(&mut buf).await.unwrap();
            }
            total
        });
        io.write_all(&[3; 160]).await.unwrap();
        assert_eq!(reader.await.unwrap(), 160);
        drop(far);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_timeout_a_stalled_write_waits() {
        let (near, _far) = tokio::io::duplex(4);
        let mut io = ClientIo::new(near, None, Arc::default());
        io.write_all(&[1; 4]).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_secs(3600), io.write_all(&[2; 4])).await;
        assert!(waited.is_err(), "still waiting after an hour");
    }

    #[tokio::test]
    async fn the_end_of_input_waits_while_a_request_is_in_progress() {
        use tokio::io::AsyncReadExt as _;
        let (near, mut far) = tokio::io::duplex(64);
        let exchanges = Arc::new(Exchanges::default());
        let mut io = ClientIo::new(near, None, exchanges.clone());
        far.write_all(b"GET").await.unwrap();
        far.shutdown().await.unwrap();
        let busy = exchanges.begin();
        let mut buf = [0u8; 8];
        assert_eq!(io.read(&mut buf).await.unwrap(), 3);
        let mut read = Box::pin(async move {
            let n = io.read(&mut buf).await.unwrap();
            (n, io)
        });
        assert!(
            futures::poll!(read.as_mut()).is_pending(),
            "the end of input is held back while busy"
        );
        drop(busy);
        let (n, mut io) = read.await;
        assert_eq!(n, 0, "shown once idle");
        assert_eq!(io.read(&mut [0u8; 4]).await.unwrap(), 0);
        // Writes still reach the half-closed peer.
        io.write_all(b"answer").await.unwrap();
        let mut got = Vec::new();
        drop(io);
        far.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"answer");
    }
}
