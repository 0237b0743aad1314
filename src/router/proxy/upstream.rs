//! Connections to instances: a keep-alive pool per instance address with
//! `TCP_NODELAY`, and the split the retry loop relies on — [`Pool::connect`]
//! fails while the caller still owns the request (retryable), [`Conn::send`]
//! consumes it (its errors are final).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;

use super::replay::ReplayBody;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Idle connections kept per instance.
pub const MAX_IDLE_PER_INSTANCE: usize = 256;
/// Idle connections older than this are closed instead of reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Connecting to an instance failed; nothing of the request was sent.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connect to {addr} failed: {source}")]
    Io {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("connect to {addr} timed out after {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("connection to {addr} closed before the request was written")]
    Closed { addr: SocketAddr },
    #[error("HTTP/1 handshake with {addr} failed: {source}")]
    Handshake {
        addr: SocketAddr,
        #[source]
        source: hyper::Error,
    },
}

/// Sending on a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The connection turned out closed before the request was written;
    /// the request comes back untouched.
    #[error("pooled connection was closed before the request was sent")]
    NotSent(Box<Request<ReplayBody>>),
    /// The request was (at least partly) handed to the instance.
    #[error(transparent)]
    Failed(hyper::Error),
}

struct Idle {
    sender: http1::SendRequest<ReplayBody>,
    since: Instant,
}

/// Keep-alive connections per instance address. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    /// A std mutex: critical sections are a push or pop on a vector, never
    /// across an await.
    idle: Arc<Mutex<HashMap<SocketAddr, Vec<Idle>>>>,
    dial_timeout: Duration,
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("dial_timeout", &self.dial_timeout)
            .finish_non_exhaustive()
    }
}

/// A connection ready for one request.
pub struct Conn {
    sender: http1::SendRequest<ReplayBody>,
    addr: SocketAddr,
    reused: bool,
    pool: Pool,
}

impl Pool {
    /// A pool whose connection tasks are owned by `tracker` and stop when
    /// `stop` is cancelled.
    #[must_use]
    pub fn new(dial_timeout: Duration, tracker: TaskTracker, stop: CancellationToken) -> Self {
        Self {
            idle: Arc::default(),
            dial_timeout,
            tracker,
            stop,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Vec<Idle>>> {
        // Poisoning needs a panic inside a push/pop, which cannot happen.
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A reusable idle connection to `addr`, else a new one.
    ///
    /// # Errors
    /// [`ConnectError`] when a new connection cannot be made.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Conn, ConnectError> {
        if let Some(sender) = self.take_idle(addr) {
            return Ok(Conn {
                sender,
                addr,
                reused: true,
                pool: self.clone(),
            });
        }
        self.connect_new(addr, false).await
    }

    fn take_idle(&self, addr: SocketAddr) -> Option<http1::SendRequest<ReplayBody>> {
        let mut idle = self.lock();
        let list = idle.get_mut(&addr)?;
        while let Some(i) = list.pop() {
            if i.since.elapsed() < IDLE_TIMEOUT && !i.sender.is_closed() {
                return Some(i.sender);
            }
        }
        None
    }

    /// A fresh connection; `upgrades` keeps it usable for a protocol switch.
    ///
    /// # Errors
    /// [`ConnectError`].
    pub async fn connect_new(&self, addr: SocketAddr, upgrades: bool) -> Result<Conn, ConnectError> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
        .map_err(|source| ConnectError::Io { addr, source })?;
        socket
            .set_nodelay(true)
            .and_then(|()| socket.set_keepalive(true))
            .map_err(|source| ConnectError::Io { addr, source })?;
        let stream = match tokio::time::timeout(self.dial_timeout, socket.connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => return Err(ConnectError::Io { addr, source }),
            Err(_) => {
                return Err(ConnectError::Timeout {
                    addr,
                    timeout: self.dial_timeout,
                });
            }
        };
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|source| ConnectError::Handshake { addr, source })?;
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            let result = if upgrades {
                tokio::select! {
                    r = conn.with_upgrades() => r,
                    () = stop.cancelled() => Ok(()),
                }
            } else {
                tokio::select! {
                    r = conn => r,
                    () = stop.cancelled() => Ok(()),
                }
            };
            if let Err(e) = result {
                tracing::debug!(%addr, error = %e, "instance connection ended");
            }
        });
        Ok(Conn {
            sender,
            addr,
            reused: false,
            pool: self.clone(),
        })
    }

    /// Performs the HTTP/1 handshake over an established transport to `addr`
    /// and keeps the connection as idle, as if a request had just finished
    /// on it. Lets tests script what the instance end of a pooled
    /// connection does.
    ///
    /// # Errors
    /// [`ConnectError::Handshake`].
    pub async fn adopt<T>(&self, addr: SocketAddr, io: T) -> Result<(), ConnectError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(io))
            .await
            .map_err(|source| ConnectError::Handshake { addr, source })?;
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(%addr, error = %e, "instance connection ended");
                },
                () = stop.cancelled() => {}
            }
        });
        self.put_back(addr, sender);
        Ok(())
    }

    fn put_back(&self, addr: SocketAddr, sender: http1::SendRequest<ReplayBody>) {
        if self.stop.is_cancelled() || sender.is_closed() {
            return;
        }
        let mut idle = self.lock();
        let list = idle.entry(addr).or_default();
        if list.len() < MAX_IDLE_PER_INSTANCE {
            list.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    /// Closes idle connections that are closed or expired and forgets
    /// addresses without any.
    pub fn sweep(&self) {
        let mut idle = self.lock();
        for list in idle.values_mut() {
            list.retain(|i| i.since.elapsed() < IDLE_TIMEOUT && !i.sender.is_closed());
        }
        idle.retain(|_, list| !list.is_empty());
    }

    /// Closes every idle connection.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Idle connections to `addr`.
    #[must_use]
    pub fn idle_count(&self, addr: SocketAddr) -> usize {
        self.lock().get(&addr).map_or(0, Vec::len)
    }
}

impl Conn {
    /// Whether this connection came from the pool.
    #[must_use]
    pub fn is_reused(&self) -> bool {
        self.reused
    }

    /// Sends the request and waits for the response headers. The connection
    /// returns to the pool once the response body has been read to its end
    /// (never for upgrades).
    ///
    /// # Errors
    /// [`SendError::NotSent`] when the connection closed before the request
    /// was written, [`SendError::Failed`] otherwise.
    pub async fn send(
        mut self,
        req: Request<ReplayBody>,
        pool_after: bool,
    ) -> Result<Response<UpstreamBody>, SendError> {
        if self.reused {
            // Readiness was checked at checkout; a close since then returns
            // the request.
            if let Err(e) = std::future::poll_fn(|cx| self.sender.poll_ready(cx)).await {
                tracing::debug!(error = %e, "pooled connection closed");
                return Err(SendError::NotSent(Box::new(req)));
            }
        }
        match self.sender.try_send_request(req).await {
            Ok(resp) => {
                let back = pool_after.then(|| (self.pool.clone(), self.addr, self.sender));
                Ok(resp.map(|inner| UpstreamBody { inner, back }))
            }
            Err(mut e) => match e.take_message() {
                Some(req) => Err(SendError::NotSent(Box::new(req))),
                None => Err(SendError::Failed(e.into_error())),
            },
        }
    }
}

/// An instance's response body; returns its connection to the pool when it
/// has been read to the end.
pub struct UpstreamBody {
    inner: Incoming,
    back: Option<(Pool, SocketAddr, http1::SendRequest<ReplayBody>)>,
}

impl UpstreamBody {
    fn finish(&mut self) {
        if let Some((pool, addr, sender)) = self.back.take() {
            pool.put_back(addr, sender);
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body that needed no reading (HEAD, 204, 304) still frees its
        // connection; an unfinished one takes the connection down with it.
        if http_body::Body::is_end_stream(&self.inner) {
            self.finish();
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(None) => this.finish(),
            Poll::Ready(Some(Err(_))) => this.back = None,
            _ => {
                if this.inner.is_end_stream() {
                    this.finish();
                }
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
