//! The proxy layer: get an instance, connect, send, stream back.
//!
//! The retry loop lives in [`Proxy::forward`] and nowhere else. An attempt
//! may be retried only while the router still owns the request: when
//! GetInstance fails, when connecting to the instance fails, or when the
//! connection closed before the request was written (a pooled connection
//! first gets one fresh connection to the same instance). An idempotent
//! request without a body is also retried when the instance's connection
//! closed or reset before a response began (the instance died with the
//! request in flight): it is rebuilt from its head. Then the instance is
//! excluded, the loop backs off (exponential with jitter) and asks again,
//! up to `--max-round-trip-attempts` attempts. Writing a request with a
//! body consumes it, so once written its errors are final and a body is
//! never replayed half-sent.
//!
//! Bodies stream both ways through hyper (bounded memory, backpressure);
//! upgrades (WebSocket) pass the 101 through and copy bytes both ways in a
//! tracked tunnel task.

pub mod body;
mod error;
pub mod headers;
pub mod upstream;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body::{Frame, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use body::{ClientBodyError, RequestBody};
pub use error::{Error, MAX_BODY_LINE, RETRY_AFTER_SECS};
use upstream::{Pool, SendError, UpstreamBody};

use super::activity::InFlightGuard;
use super::entry::Parsed;
use crate::api;
use crate::client::Client;
use crate::domain::HEADER_GET_INSTANCE_DURATION_MS;

/// Deadline of a oneshot `ReleaseInstance`.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(5);

/// Settings of the proxy layer.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_attempts: u32,
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub response_header_timeout: Option<Duration>,
    pub get_instance_timeout: Duration,
    /// Bound on a pause in the client's request body (`None`: no bound).
    pub body_timeout: Option<Duration>,
}

/// Releases a oneshot instance exactly once: when dropped, a tracked task
/// sends `ReleaseInstance` with a 5 s deadline.
#[derive(Debug)]
pub struct Release {
    client: Client,
    instance: api::Instance,
    tracker: TaskTracker,
}

impl Drop for Release {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(instance = ?self.instance.name, "no runtime to release oneshot instance");
            return;
        };
        let client = self.client.clone();
        let instance = std::mem::take(&mut self.instance);
        self.tracker.spawn_on(
            async move {
                let name = instance.name.clone().unwrap_or_default();
                let req = api::ReleaseInstanceRequest {
                    instance: Some(instance),
                };
                match client.release_instance(req, RELEASE_DEADLINE).await {
                    Ok(_) => tracing::debug!(instance = %name, "released oneshot instance"),
                    Err(e) => {
                        tracing::warn!(instance = %name, error = %e, "failed to release oneshot instance");
                    }
                }
            },
            &rt,
        );
    }
}

/// What a request holds until its response body (or tunnel) ends.
#[derive(Debug)]
pub struct Hold {
    pub in_flight: InFlightGuard,
    pub release: Option<Release>,
}

/// The response body sent to the client: the instance's body plus the
/// request's [`Hold`], released when the body is done or the client leaves.
pub struct ProxyBody {
    inner: UpstreamBody,
    hold: Option<Hold>,
}

impl http_body::Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None | Some(Err(_)))) {
            self.hold = None;
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

/// The proxy: controller client, connection pool and tunnel ownership.
#[derive(Debug, Clone)]
pub struct Proxy {
    client: Client,
    pool: Pool,
    settings: Settings,
    /// Owns release and tunnel tasks.
    tracker: TaskTracker,
    /// Closes open tunnels.
    tunnels: CancellationToken,
}

/// The outcome of the last failed attempt.
enum Failed {
    GetInstance(Box<crate::client::Error>),
    Connect(Error),
}

impl Proxy {
    /// A proxy whose tasks are owned by `tracker`; `tunnels` closes open
    /// tunnels, `pool` holds instance connections.
    #[must_use]
    pub fn new(
        client: Client,
        pool: Pool,
        settings: Settings,
        tracker: TaskTracker,
        tunnels: CancellationToken,
    ) -> Self {
        Self {
            client,
            pool,
            settings,
            tracker,
            tunnels,
        }
    }

    /// The connection pool.
    #[must_use]
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn backoff(&self) -> impl Iterator<Item = Duration> + use<> {
        let max = self.settings.retry_max;
        ExponentialBuilder::new()
            .with_min_delay(self.settings.retry_min)
            .with_max_delay(max)
            .with_jitter()
            .without_max_times()
            .build()
            .map(move |d| d.min(max))
    }

    /// Forwards `req` (its body as hyper read it from the client) for
    /// `parsed` to an instance, retrying while the request is still owned
    /// (see the module docs).
    ///
    /// # Errors
    /// [`Error`] when no response could be obtained; the caller turns it into
    /// the router's own answer.
    pub async fn forward<B>(
        &self,
        parsed: &Arc<Parsed>,
        req: Request<B>,
        client_addr: SocketAddr,
        in_flight: InFlightGuard,
    ) -> Result<Response<Body>, Error>
    where
        B: http_body::Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    {
        let mut req = req.map(|b| RequestBody::new(b, self.settings.body_timeout));
        let upgrade = headers::upgrade_protocol(req.headers());
        let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        headers::rewrite(req.headers_mut(), Some(client_addr), upgrade.clone());
        let path = req
            .uri()
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        *req.uri_mut() = Uri::try_from(path).unwrap_or_else(|_| Uri::from_static("/"));
        let oneshot = parsed.function.is_oneshot();
        let head =
            (upgrade.is_none() && is_idempotent(req.method()) && http_body::Body::is_end_stream(req.body()))
                .then(|| Head::of(&req));

        let mut backoff = self.backoff();
        let mut excluded: Vec<String> = Vec::new();
        let mut get_instance_time = Duration::ZERO;
        let mut last: Option<Failed> = None;
        let mut attempt = 0;
        'attempts: while attempt < self.settings.max_attempts {
            attempt += 1;
            if attempt > 1
                && let Some(wait) = backoff.next()
            {
                tokio::time::sleep(wait).await;
            }
            let t0 = Instant::now();
            let got = self
                .client
                .get_instance(
                    api::GetInstanceRequest {
                        function: Some(parsed.api.clone()),
                        exclude_instance_names: excluded.clone(),
                    },
                    self.settings.get_instance_timeout,
                )
                .await;
            get_instance_time += t0.elapsed();
            let instance = match got.map(|r| r.instance) {
                Ok(Some(i)) => i,
                Ok(None) => {
                    last = Some(Failed::GetInstance(Box::new(crate::client::Error::Rpc {
                        method: crate::client::Method::GetInstance,
                        status: Box::new(tonic::Status::internal("response without an instance")),
                    })));
                    continue;
                }
                Err(e) => {
                    tracing::debug!(attempt, error = %e, "failed to get instance for function");
                    if Error::is_final_get_instance(&e) {
                        // Another controller gives the same answer: no retry helps.
                        return Err(Error::from_get_instance(e));
                    }
                    last = Some(Failed::GetInstance(Box::new(e)));
                    continue;
                }
            };
            let name = instance.name.clone().unwrap_or_default();
            let addr_text = instance.addr.clone().unwrap_or_default();
            let release = oneshot.then(|| Release {
                client: self.client.clone(),
                instance: instance.clone(),
                tracker: self.tracker.clone(),
            });
            // Nothing reaches the instance on these paths: it is excluded and
            // the loop asks again (a oneshot claim is released on drop).
            let mut unusable = |failure: Error, release: Option<Release>| {
                tracing::debug!(attempt, instance = %name, error = %failure, "instance unusable; trying another");
                if !excluded.contains(&name) {
                    excluded.push(name.clone());
                }
                drop(release);
                last = Some(Failed::Connect(failure));
            };
            let Ok(addr) = addr_text.parse::<SocketAddr>() else {
                unusable(
                    Error::InstanceAddress {
                        name: name.clone(),
                        addr: addr_text,
                    },
                    release,
                );
                continue;
            };
            let conn = if upgrade.is_some() {
                self.pool.connect_new(addr, true).await
            } else {
                self.pool.connect(addr).await
            };
            let mut conn = match conn {
                Ok(c) => c,
                Err(source) => {
                    unusable(
                        Error::Connect {
                            name: name.clone(),
                            source,
                        },
                        release,
                    );
                    continue;
                }
            };
            let resp = loop {
                let reused = conn.is_reused();
                let sending = conn.send(req, upgrade.is_none());
                let sent = match self.settings.response_header_timeout {
                    Some(t) => match tokio::time::timeout(t, sending).await {
                        Ok(r) => r,
                        Err(_) => {
                            return Err(Error::ResponseHeaderTimeout { name, timeout: t });
                        }
                    },
                    None => sending.await,
                };
                match sent {
                    Ok(r) => break r,
                    Err(SendError::NotSent(back)) => {
                        req = *back;
                        // A pooled connection may just have aged out on the
                        // instance's side: one fresh connection to the same
                        // instance, else the instance is unusable.
                        let fresh = if reused {
                            self.pool.connect_new(addr, upgrade.is_some()).await
                        } else {
                            Err(upstream::ConnectError::Closed { addr })
                        };
                        match fresh {
                            Ok(c) => conn = c,
                            Err(source) => {
                                unusable(
                                    Error::Connect {
                                        name: name.clone(),
                                        source,
                                    },
                                    release,
                                );
                                continue 'attempts;
                            }
                        }
                    }
                    Err(SendError::Failed(source)) => match &head {
                        Some(head) if closed_before_response(&source) => {
                            req = head.rebuild(self.settings.body_timeout);
                            unusable(Error::from_send(name.clone(), source), release);
                            continue 'attempts;
                        }
                        _ => return Err(Error::from_send(name, source)),
                    },
                }
            };
            let hold = Hold { in_flight, release };
            let ms = u64::try_from(get_instance_time.as_millis()).unwrap_or(u64::MAX);
            return match (client_upgrade, upgrade) {
                (Some(client_upgrade), Some(want)) if resp.status() == StatusCode::SWITCHING_PROTOCOLS => {
                    self.tunnel(resp, client_upgrade, &want, name, hold, ms)
                }
                _ => Ok(finish(resp, hold, ms)),
            };
        }
        let last = match last {
            Some(Failed::GetInstance(e)) => Error::from_get_instance(*e),
            Some(Failed::Connect(e)) => e,
            None => Error::ControllerUnavailable(crate::client::Error::NoEndpoints {
                method: crate::client::Method::GetInstance,
            }),
        };
        Err(Error::Exhausted {
            attempts: attempt,
            last: Box::new(last),
        })
    }

    /// Passes a 101 through and copies bytes both ways until either side
    /// closes or tunnels are closed at shutdown.
    fn tunnel(
        &self,
        mut resp: Response<UpstreamBody>,
        client_upgrade: hyper::upgrade::OnUpgrade,
        want: &HeaderValue,
        name: String,
        hold: Hold,
        ms: u64,
    ) -> Result<Response<Body>, Error> {
        let got = resp.headers().get(header::UPGRADE).cloned();
        let matches = got.as_ref().is_some_and(|g| {
            g.to_str()
                .unwrap_or_default()
                .eq_ignore_ascii_case(want.to_str().unwrap_or_default())
        });
        if !matches {
            return Err(Error::UpgradeMismatch {
                name,
                want: want.to_str().unwrap_or_default().to_owned(),
                got: got
                    .map(|g| g.to_str().unwrap_or_default().to_owned())
                    .unwrap_or_default(),
            });
        }
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let stop = self.tunnels.clone();
        self.tracker.spawn(async move {
            let _hold = hold;
            let (client, upstream) = match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::warn!(instance = %name, error = %e, "upgrade failed");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            tokio::select! {
                r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
                    if let Err(e) = r {
                        tracing::debug!(instance = %name, error = %e, "tunnel ended");
                    }
                }
                () = stop.cancelled() => tracing::debug!(instance = %name, "tunnel closed at shutdown"),
            }
        });
        let (mut parts, _) = resp.into_parts();
        parts
            .headers
            .insert(HEADER_GET_INSTANCE_DURATION_MS, HeaderValue::from(ms));
        Ok(Response::from_parts(parts, Body::empty()))
    }
}

/// The head of a request without a body, kept to send it again.
struct Head {
    method: http::Method,
    uri: Uri,
    version: http::Version,
    headers: http::HeaderMap,
}

impl Head {
    fn of<B>(req: &Request<B>) -> Self {
        Self {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
        }
    }

    fn rebuild(&self, body_timeout: Option<Duration>) -> Request<RequestBody> {
        let empty =
            http_body_util::BodyExt::map_err(http_body_util::Empty::<Bytes>::new(), |never| match never {});
        let mut req = Request::new(RequestBody::new(empty, body_timeout));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// Methods a retry cannot turn into a second effect (RFC 9110 §9.2.2).
fn is_idempotent(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::TRACE
            | http::Method::PUT
            | http::Method::DELETE
    )
}

/// Whether a send failed because the instance's end of the connection
/// closed or reset before a response began (not because of the client's
/// body, and not a malformed response).
fn closed_before_response(e: &hyper::Error) -> bool {
    if ClientBodyError::find(e).is_some() {
        return false;
    }
    if e.is_incomplete_message() || e.is_closed() {
        return true;
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            );
        }
        cur = err.source();
    }
    false
}

fn finish(resp: Response<UpstreamBody>, hold: Hold, ms: u64) -> Response<Body> {
    let (mut parts, inner) = resp.into_parts();
    headers::strip_response(&mut parts.headers);
    parts
        .headers
        .insert(HEADER_GET_INSTANCE_DURATION_MS, HeaderValue::from(ms));
    let body = ProxyBody {
        inner,
        hold: Some(hold),
    };
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(min_ms: u64, max_ms: u64) -> Vec<Duration> {
        let settings = Settings {
            max_attempts: 6,
            retry_min: Duration::from_millis(min_ms),
            retry_max: Duration::from_millis(max_ms),
            response_header_timeout: None,
            get_instance_timeout: Duration::from_secs(1),
            body_timeout: None,
        };
        let e = crate::client::Endpoints::new(crate::client::ChannelSettings::default());
        let p = Proxy::new(
            Client::new(e),
            Pool::new(
                Duration::from_secs(1),
                TaskTracker::new(),
                CancellationToken::new(),
            ),
            settings,
            TaskTracker::new(),
            CancellationToken::new(),
        );
        p.backoff().take(12).collect()
    }

    #[test]
    fn backoff_grows_with_jitter_and_stays_within_bounds() {
        for _ in 0..200 {
            let waits = backoff(100, 5000);
            let first = waits[0].as_millis();
            assert!((100..200).contains(&first), "{waits:?}");
            let second = waits[1].as_millis();
            assert!((200..400).contains(&second), "{waits:?}");
            assert!(waits.iter().all(|w| *w <= Duration::from_secs(5)), "{waits:?}");
            assert_eq!(*waits.last().unwrap(), Duration::from_secs(5));
        }
        assert!(backoff(10, 10).iter().all(|w| *w == Duration::from_millis(10)));
    }
}
