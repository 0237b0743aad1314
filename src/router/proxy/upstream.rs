//! Connections to instances: idle HTTP/1.1 keep-alive connections are kept
//! on each instance's [`Slot`] ([`IdleConnections`]); an instance whose pool
//! speaks h2c gets one multiplexed HTTP/2 connection, shared by every
//! request to it (upgrades still go over HTTP/1.1); new connections have
//! `TCP_NODELAY`. The split the retry loop relies on — [`Pool::connect`]
//! fails while the caller still owns the request (retryable),
//! [`Conn::send`] consumes it (its errors are final).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;

use super::direct::{DirectBody, DirectConn, ExchangeError};
use super::replay::ReplayBody;
use crate::api::Protocol;
use crate::router::instances::Slot;
use crate::router::listener::{CONNECTION_WINDOW, MAX_SEND_BUFFER, PING_TIMEOUT, STREAM_WINDOW, Tracked};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpSocket;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

/// Idle connections kept per instance.
pub const MAX_IDLE_PER_INSTANCE: usize = 256;
/// Idle connections older than this are closed instead of reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often an HTTP/2 connection to an instance is pinged (a dead peer
/// is noticed within this plus [`PING_TIMEOUT`]).
pub const H2_PING_INTERVAL: Duration = Duration::from_secs(30);

/// Connecting to an instance failed; nothing of the request was sent.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connect to {addr} failed: {source}")]
    Io {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("connect to {addr} timed out after {timeout:?}")]
    Timeout {
        addr: std::net::SocketAddr,
        timeout: Duration,
    },
    #[error("connection to {addr} closed before the request was written")]
    Closed { addr: std::net::SocketAddr },
    #[error("{protocol} handshake with {addr} failed: {source}")]
    Handshake {
        addr: std::net::SocketAddr,
        protocol: &'static str,
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

impl Idle {
    fn usable(&self) -> bool {
        self.since.elapsed() < IDLE_TIMEOUT && !self.sender.is_closed()
    }
}

/// The multiplexed HTTP/2 connection to an instance and its generation
/// (which dial made it).
struct Shared {
    sender: http2::SendRequest<ReplayBody>,
    generation: u64,
}

/// Idle keep-alive connections to one instance, newest last, and its
/// shared HTTP/2 connection; they go when the instance's slot goes.
#[derive(Default)]
pub struct IdleConnections {
    /// A std mutex: a push or a pop, never across an await.
    idle: Mutex<Vec<Idle>>,
    /// Connections of the router's own exchanges ([`super::direct`]); a
    /// std mutex, never across an await.
    direct: Mutex<Vec<DirectConn>>,
    /// The HTTP/2 connection (h2c pools); a std mutex, never across an
    /// await.
    shared: Mutex<Option<Shared>>,
    /// Held while an HTTP/2 connection is dialled, so a burst of requests
    /// to a new instance makes one connection, not one each.
    dialing: tokio::sync::Mutex<u64>,
}

impl std::fmt::Debug for IdleConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleConnections")
            .field("len", &self.len())
            .finish()
    }
}

impl IdleConnections {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // Poisoning needs a panic inside a push/pop, which cannot happen.
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The newest usable idle connection (expired and closed ones on the
    /// way are dropped).
    fn take(&self) -> Option<http1::SendRequest<ReplayBody>> {
        let mut idle = self.lock();
        while let Some(i) = idle.pop() {
            if i.usable() {
                return Some(i.sender);
            }
        }
        None
    }

    /// Keeps `sender` for the next request (at most
    /// [`MAX_IDLE_PER_INSTANCE`]; expired and closed ones make room first).
    fn put(&self, sender: http1::SendRequest<ReplayBody>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.lock();
        if idle.len() >= MAX_IDLE_PER_INSTANCE {
            idle.retain(Idle::usable);
        }
        if idle.len() < MAX_IDLE_PER_INSTANCE {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    fn lock_direct(&self) -> std::sync::MutexGuard<'_, Vec<DirectConn>> {
        self.direct
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The newest usable kept connection for a direct exchange (expired
    /// and closed ones on the way are dropped).
    pub(super) fn take_direct(&self) -> Option<DirectConn> {
        let mut idle = self.lock_direct();
        while let Some(c) = idle.pop() {
            if c.usable(IDLE_TIMEOUT) {
                return Some(c);
            }
        }
        None
    }

    /// Keeps `conn` for the next direct exchange (at most
    /// [`MAX_IDLE_PER_INSTANCE`]; expired and closed ones make room first).
    pub(super) fn put_direct(&self, conn: DirectConn) {
        let mut idle = self.lock_direct();
        if idle.len() >= MAX_IDLE_PER_INSTANCE {
            idle.retain(|c| c.usable(IDLE_TIMEOUT));
        }
        if idle.len() < MAX_IDLE_PER_INSTANCE {
            idle.push(conn);
        }
    }

    /// The shared HTTP/2 connection when it is open, with its generation.
    fn shared(&self) -> Option<(http2::SendRequest<ReplayBody>, u64)> {
        let shared = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        shared
            .as_ref()
            .filter(|s| !s.sender.is_closed())
            .map(|s| (s.sender.clone(), s.generation))
    }

    fn set_shared(&self, sender: http2::SendRequest<ReplayBody>, generation: u64) {
        *self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Shared { sender, generation });
    }

    /// Whether an open HTTP/2 connection to the instance is kept.
    #[must_use]
    pub fn has_shared(&self) -> bool {
        self.shared().is_some()
    }

    /// Idle connections kept now (hyper's and the direct exchanges').
    #[must_use]
    pub fn len(&self) -> usize {
        self.lock().len() + self.lock_direct().len()
    }

    /// Whether none is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes connections to instances (idle ones are taken from the
/// instance's slot first). Cheap to clone.
#[derive(Clone)]
pub struct Pool {
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
    sender: Sender,
    slot: Arc<Slot>,
    reused: bool,
}

enum Sender {
    H1(http1::SendRequest<ReplayBody>),
    /// A handle on the instance's shared HTTP/2 connection.
    H2(http2::SendRequest<ReplayBody>),
}

impl Pool {
    /// Connections whose tasks are owned by `tracker` and stop when `stop`
    /// is cancelled.
    #[must_use]
    pub fn new(dial_timeout: Duration, tracker: TaskTracker, stop: CancellationToken) -> Self {
        Self {
            dial_timeout,
            tracker,
            stop,
        }
    }

    /// A reusable idle connection to `slot`'s instance, else a new one.
    ///
    /// # Errors
    /// [`ConnectError`] when a new connection cannot be made.
    pub async fn connect(&self, slot: &Arc<Slot>) -> Result<Conn, ConnectError> {
        if slot.protocol == Protocol::H2c {
            if let Some((sender, _)) = slot.connections.shared() {
                return Ok(Conn {
                    sender: Sender::H2(sender),
                    slot: slot.clone(),
                    reused: true,
                });
            }
            return self.connect_h2(slot, None).await;
        }
        if let Some(sender) = slot.connections.take() {
            return Ok(Conn {
                sender: Sender::H1(sender),
                slot: slot.clone(),
                reused: true,
            });
        }
        self.connect_new(slot, false).await
    }

    /// A fresh connection; `upgrades` keeps it usable for a protocol switch
    /// (upgrades use HTTP/1.1 whatever the pool's protocol). For an h2c
    /// instance without `upgrades`, the shared connection is replaced
    /// unless another request replaced it already.
    ///
    /// # Errors
    /// [`ConnectError`].
    pub async fn connect_new(&self, slot: &Arc<Slot>, upgrades: bool) -> Result<Conn, ConnectError> {
        if slot.protocol == Protocol::H2c && !upgrades {
            // Whatever was shared when this request failed is stale.
            let stale = slot.connections.shared().map_or(0, |(_, g)| g);
            return self.connect_h2(slot, Some(stale)).await;
        }
        let addr = slot.addr;
        let stream = self.dial(addr).await?;
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|source| ConnectError::Handshake {
                addr,
                protocol: "HTTP/1.1",
                source,
            })?;
        let stop = self.stop.clone();
        let span = tracing::debug_span!("router.instance_connection", instance = %slot.name, %addr);
        self.tracker.spawn(
            async move {
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
                    tracing::debug!(error = %e, "instance connection ended");
                }
            }
            .instrument(span),
        );
        Ok(Conn {
            sender: Sender::H1(sender),
            slot: slot.clone(),
            reused: false,
        })
    }

    /// The instance's shared HTTP/2 connection, dialled by one request at a
    /// time: a request that waited for another's dial uses its result.
    /// `stale` is the generation a failed request used (its replacement is
    /// any later one).
    async fn connect_h2(&self, slot: &Arc<Slot>, stale: Option<u64>) -> Result<Conn, ConnectError> {
        let mut dialed = slot.connections.dialing.lock().await;
        if let Some((sender, generation)) = slot.connections.shared()
            && stale.is_none_or(|g| generation > g)
        {
            return Ok(Conn {
                sender: Sender::H2(sender),
                slot: slot.clone(),
                reused: stale.is_none(),
            });
        }
        let addr = slot.addr;
        let stream = self.dial(addr).await?;
        let mut builder = http2::Builder::new(Tracked(self.tracker.clone()));
        builder
            .timer(TokioTimer::new())
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_send_buf_size(MAX_SEND_BUFFER)
            .keep_alive_interval(H2_PING_INTERVAL)
            .keep_alive_timeout(PING_TIMEOUT);
        let (sender, conn) =
            builder
                .handshake(TokioIo::new(stream))
                .await
                .map_err(|source| ConnectError::Handshake {
                    addr,
                    protocol: "HTTP/2",
                    source,
                })?;
        *dialed += 1;
        let generation = *dialed;
        slot.connections.set_shared(sender.clone(), generation);
        let stop = self.stop.clone();
        let span =
            tracing::debug_span!("router.instance_connection", instance = %slot.name, %addr, generation);
        self.tracker.spawn(
            async move {
                tokio::select! {
                    r = conn => if let Err(e) = r {
                        tracing::debug!(error = %e, "instance connection ended");
                    },
                    () = stop.cancelled() => {}
                }
            }
            .instrument(span),
        );
        Ok(Conn {
            sender: Sender::H2(sender),
            slot: slot.clone(),
            reused: false,
        })
    }

    /// A new connection to `slot`'s instance for direct exchanges.
    ///
    /// # Errors
    /// [`ConnectError`] when it cannot be made.
    pub(super) async fn dial_direct(&self, slot: &Slot) -> Result<DirectConn, ConnectError> {
        Ok(DirectConn::new(self.dial(slot.addr).await?))
    }

    /// A TCP connection to `addr` with `TCP_NODELAY` and keep-alive, within
    /// the dial timeout.
    async fn dial(&self, addr: std::net::SocketAddr) -> Result<tokio::net::TcpStream, ConnectError> {
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
        match tokio::time::timeout(self.dial_timeout, socket.connect(addr)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(source)) => Err(ConnectError::Io { addr, source }),
            Err(_) => Err(ConnectError::Timeout {
                addr,
                timeout: self.dial_timeout,
            }),
        }
    }

    /// Performs the HTTP/1 handshake over an established transport to
    /// `slot`'s instance and keeps the connection as idle on the slot, as
    /// if a request had just finished on it. Lets tests script what the
    /// instance end of a pooled connection does.
    ///
    /// # Errors
    /// [`ConnectError::Handshake`].
    pub async fn adopt<T>(&self, slot: &Arc<Slot>, io: T) -> Result<(), ConnectError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let addr = slot.addr;
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(io))
            .await
            .map_err(|source| ConnectError::Handshake {
                addr,
                protocol: "HTTP/1.1",
                source,
            })?;
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(%addr, error = %e, "instance connection ended");
                },
                () = stop.cancelled() => {}
            }
        });
        slot.connections.put(sender);
        Ok(())
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
        self,
        req: Request<ReplayBody>,
        pool_after: bool,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let Self { sender, slot, reused } = self;
        let mut sender = match sender {
            Sender::H1(s) => s,
            Sender::H2(mut sender) => {
                return match sender.try_send_request(req).await {
                    Ok(resp) => Ok(resp.map(|inner| UpstreamBody {
                        inner: Inner::Hyper(inner),
                        back: None,
                    })),
                    Err(mut e) => match e.take_message() {
                        Some(req) => Err(SendError::NotSent(Box::new(req))),
                        None => Err(SendError::Failed(e.into_error())),
                    },
                };
            }
        };
        if reused {
            // Readiness was checked at checkout; a close since then returns
            // the request.
            if let Err(e) = std::future::poll_fn(|cx| sender.poll_ready(cx)).await {
                tracing::debug!(error = %e, "pooled connection closed");
                return Err(SendError::NotSent(Box::new(req)));
            }
        }
        match sender.try_send_request(req).await {
            Ok(resp) => {
                let back = pool_after.then_some((slot, sender));
                Ok(resp.map(|inner| UpstreamBody {
                    inner: Inner::Hyper(inner),
                    back,
                }))
            }
            Err(mut e) => match e.take_message() {
                Some(req) => Err(SendError::NotSent(Box::new(req))),
                None => Err(SendError::Failed(e.into_error())),
            },
        }
    }
}

/// An instance's response body: read by hyper's client (its connection
/// returns to the pool when the body has been read to the end), or by a
/// direct exchange ([`DirectBody`], which returns its connection itself).
pub struct UpstreamBody {
    inner: Inner,
    back: Option<(Arc<Slot>, http1::SendRequest<ReplayBody>)>,
}

enum Inner {
    Hyper(Incoming),
    Direct(DirectBody),
}

/// Reading an instance's response body failed.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error(transparent)]
    Direct(#[from] ExchangeError),
}

impl UpstreamBody {
    /// The body of a direct exchange.
    pub(super) fn direct(body: DirectBody) -> Self {
        Self {
            inner: Inner::Direct(body),
            back: None,
        }
    }

    fn finish(&mut self) {
        if let Some((slot, sender)) = self.back.take() {
            slot.connections.put(sender);
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body that needed no reading (HEAD, 204, 304) still frees its
        // connection; an unfinished one takes the connection down with it.
        if let Inner::Hyper(inner) = &self.inner
            && http_body::Body::is_end_stream(inner)
        {
            self.finish();
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let inner = match &mut this.inner {
            Inner::Direct(d) => return Pin::new(d).poll_frame(cx).map_err(BodyError::Direct),
            Inner::Hyper(inner) => inner,
        };
        let r = Pin::new(&mut *inner).poll_frame(cx);
        let end = inner.is_end_stream();
        match &r {
            Poll::Ready(None) => this.finish(),
            Poll::Ready(Some(Err(_))) => this.back = None,
            _ => {
                if end {
                    this.finish();
                }
            }
        }
        r.map_err(BodyError::Hyper)
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Hyper(b) => b.is_end_stream(),
            Inner::Direct(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Hyper(b) => b.size_hint(),
            Inner::Direct(b) => b.size_hint(),
        }
    }
}
