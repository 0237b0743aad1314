//! The proxy layer: choose an instance, send the request, stream back.
//!
//! [`Proxy::forward`] is the one retry loop, read top to bottom:
//!
//! 1. [`select`]: an instance for this attempt — from the function's local
//!    table (power of two choices on in-flight requests) while its
//!    `WatchInstances` stream is live, else one `GetInstance` call (a cold
//!    function, every known instance excluded, the stream down, a oneshot
//!    function).
//! 2. [`attempt`]: one exchange with that instance. An attempt is retried
//!    only when nothing reached the instance's application: connecting
//!    failed, the connection closed before the request was written (a
//!    pooled connection first gets one fresh connection), or the instance
//!    answered `421 Misdirected Request` (it is not the instance the router
//!    named). The instance is then excluded and the next attempt goes
//!    elsewhere — at once when the table still has a candidate, after the
//!    [`retry::Policy`] back-off when the controller is asked again.
//!    Once an instance has the request, its errors are final.
//! 3. [`tunnel`]: an upgrade (WebSocket) passes the 101 through and copies
//!    bytes both ways in a tracked task.
//!
//! A request without a body to an HTTP/1.1 instance is a [`direct`]
//! exchange: the request's own task writes its head on a kept connection
//! and reads the response, with no connection task between them (a kept
//! connection the instance closed before answering gets one fresh
//! connection, for an idempotent request). Everything else goes through
//! hyper's client ([`upstream`]).
//!
//! The request body is a [`ReplayBody`]: after a 421 the same bytes go to
//! the next instance (bodies up to [`replay::MAX_REPLAY_BYTES`]). Bodies
//! stream both ways through hyper (bounded memory, backpressure).
//!
//! A request that has to wait for an instance — the controller starting
//! one, or every instance at the function's `max_in_flight_requests` —
//! holds a place among the router's waiting requests ([`admission`]); a
//! request that gets none is answered 503 at once. A cold function's first
//! requests share one `GetInstance` call.

pub mod admission;
mod attempt;
pub mod body;
pub mod client_io;
pub mod direct;
mod error;
pub mod forwarding;
pub mod headers;
pub mod replay;
pub mod retry;
mod select;
mod tunnel;
pub mod upstream;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method as HttpMethod, Request, Response, Uri, Version};
use http_body::{Frame, SizeHint};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

pub use body::{ClientBodyError, Pace, Progress, RequestBody};
pub use error::{Error, MAX_BODY_LINE, RETRY_AFTER_SECS, is_grpc};
pub use forwarding::{HostError, Peer, TrustedProxies};
pub use replay::ReplayBody;
use upstream::{BodyError, Pool, UpstreamBody};

use super::activity::InFlightGuard;
use super::entry::Parsed;
use super::instances::{Slot, SlotGuard};
use super::metrics::Metrics;
use super::subscription::Subscriber;
use crate::api;
use crate::client::Client;
use crate::domain::AssignTiming;
use attempt::Outcome;
use select::Selected;

/// Deadline of a oneshot `ReleaseInstance`.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(5);

/// Settings of the proxy layer.
#[derive(Debug, Clone)]
pub struct Settings {
    pub retry: retry::Policy,
    pub response_header_timeout: Option<Duration>,
    pub get_instance_timeout: Duration,
    /// How slowly a client's request body may arrive (`None`: no bound).
    pub body_pace: Option<Pace>,
    /// Peers whose forwarding headers are kept.
    pub trusted_proxies: TrustedProxies,
    /// This router's IP, named in instance subscriptions.
    pub router_ip: String,
    /// Bounds on requests waiting for instances.
    pub waiting: admission::Limits,
}

/// Releases a oneshot instance exactly once: when dropped, a tracked task
/// sends `ReleaseInstance` with a 5 s deadline.
#[derive(Debug)]
pub struct Release {
    client: Client,
    instance: Box<api::Instance>,
    tracker: TaskTracker,
    metrics: Metrics,
    /// The request's span: the release belongs to it.
    span: tracing::Span,
}

impl Drop for Release {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(instance = ?self.instance.name, "no runtime to release oneshot instance");
            return;
        };
        let client = self.client.clone();
        let instance = *std::mem::take(&mut self.instance);
        self.metrics.controller_call("ReleaseInstance");
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
            }
            .instrument(self.span.clone()),
            &rt,
        );
    }
}

/// What a request holds until its response body (or tunnel) ends.
#[derive(Debug)]
pub struct Hold {
    pub in_flight: InFlightGuard,
    /// The request counted on the instance's table slot.
    pub slot: Option<SlotGuard>,
    pub release: Option<Box<Release>>,
}

/// The response body sent to the client: the instance's body plus the
/// request's [`Hold`], released when the body is done or the client leaves.
/// For a gRPC call, an instance lost mid-response ends the body with
/// `grpc-status` trailers instead of a reset stream (which a gRPC client
/// reads as `INTERNAL`): `CANCELLED` when the instance cancelled the stream,
/// else `UNAVAILABLE`.
pub struct ProxyBody {
    inner: UpstreamBody,
    hold: Option<Hold>,
    /// `Some(instance)` for a gRPC call.
    grpc: Option<String>,
    ended: bool,
}

impl http_body::Body for ProxyBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None | Some(Err(_)))) {
            this.hold = None;
        }
        if let Poll::Ready(Some(Err(e))) = &r
            && let Some(instance) = &this.grpc
        {
            this.ended = true;
            let code = error::grpc_code_mid_response(e);
            let line = if code == tonic::Code::Cancelled {
                format!("instance {instance:?} cancelled the call")
            } else {
                error::one_line(&format!("instance {instance:?} failed mid-response: {e}"))
            };
            tracing::warn!(error = %line, "gRPC response cut short");
            return Poll::Ready(Some(Ok(Frame::trailers(error::grpc_trailers(code, &line)))));
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
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
    metrics: Metrics,
    admission: admission::Admission,
    /// Owns subscriptions, release and tunnel tasks.
    tracker: TaskTracker,
    /// Closes open tunnels and ends subscriptions (after the drain).
    tunnels: CancellationToken,
}

/// The request as it goes to instances, rebuilt for every attempt.
struct Prepared {
    method: HttpMethod,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    /// The forwarding fields when they are not in `headers` (a request
    /// that can go as a direct exchange).
    forwarding: Option<forwarding::Forwarding>,
    /// Never sent itself: every attempt sends a replay of it.
    body: ReplayBody,
    upgrade: Option<HeaderValue>,
    /// A gRPC call (its failures are gRPC statuses).
    grpc: bool,
    /// The client sent `TE: trailers` (gRPC does): said again to h2c
    /// instances, where it is the one `TE` allowed.
    te_trailers: bool,
    /// Goes to an HTTP/1.1 instance as a direct exchange ([`direct`]): no
    /// body, no upgrade, not HTTP/1.0.
    direct: bool,
}

impl Prepared {
    /// Rewrites the client's request (headers, origin-form URI) and takes
    /// the client side of an upgrade; the body reports into `progress`.
    fn new<B>(
        req: Request<B>,
        peer: &Peer,
        settings: &Settings,
        progress: Progress,
    ) -> (Self, Option<hyper::upgrade::OnUpgrade>)
    where
        B: http_body::Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    {
        let mut req = req;
        let upgrade = headers::upgrade_protocol(req.headers());
        let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let te_trailers = headers::accepts_trailers(&parts.headers);
        let grpc = is_grpc(&parts.headers);
        forwarding::set_host_from_target(&parts.uri, &mut parts.headers);
        let empty = http_body::Body::is_end_stream(&body);
        let direct = empty && upgrade.is_none() && parts.version >= Version::HTTP_11;
        // A direct exchange writes the forwarding fields into its head
        // after the map's (no inserts, no value built apart).
        let forwarding = if direct {
            Some(headers::rewrite_apart(
                &mut parts.headers,
                Some(peer.node()),
                peer.trusted,
            ))
        } else {
            headers::rewrite_from(
                &mut parts.headers,
                Some(peer.node()),
                peer.trusted,
                upgrade.clone(),
            );
            None
        };
        crate::telemetry::otel::inject_http(&mut parts.headers);
        // Origin form: the path and query as the client sent them (no copy).
        let uri = parts
            .uri
            .into_parts()
            .path_and_query
            .and_then(|pq| {
                let mut origin = http::uri::Parts::default();
                origin.path_and_query = Some(pq);
                Uri::from_parts(origin).ok()
            })
            .unwrap_or_else(|| Uri::from_static("/"));
        let body = if empty {
            ReplayBody::empty()
        } else {
            ReplayBody::new(
                RequestBody::new(body, settings.body_pace, progress),
                replay::MAX_REPLAY_BYTES,
            )
        };
        (
            Self {
                method: parts.method,
                uri,
                version: parts.version,
                headers: parts.headers,
                forwarding,
                body,
                upgrade,
                grpc,
                te_trailers,
                direct,
            },
            client_upgrade,
        )
    }

    /// Whether the attempt at `slot` is a direct exchange.
    fn direct_to(&self, slot: &Slot) -> bool {
        self.direct && slot.protocol != crate::api::Protocol::H2c
    }

    /// The request head of a direct exchange with `slot`.
    fn direct_head(&self, slot: &Slot, tenant: &HeaderValue) -> Vec<u8> {
        let mut head = Vec::with_capacity(256 + self.headers.len() * 32);
        let target = self
            .uri
            .path_and_query()
            .map_or("/", http::uri::PathAndQuery::as_str);
        direct::write_head(
            &mut head,
            &self.method,
            target,
            &self.headers,
            self.forwarding.as_ref(),
            &[(&headers::INSTANCE, &slot.header), (&headers::TENANT, tenant)],
        );
        head
    }

    /// The request for one attempt at `slot`, or `None` when the body can
    /// no longer be sent again.
    fn request(&self, slot: &Slot, tenant: &HeaderValue) -> Option<Request<ReplayBody>> {
        let mut req = Request::new(self.body.replay()?);
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        let mut headers = self.headers.clone();
        if let Some(f) = &self.forwarding {
            f.insert_into(&mut headers);
        }
        headers.insert(headers::INSTANCE, slot.header.clone());
        headers.insert(headers::TENANT, tenant.clone());
        if slot.protocol == crate::api::Protocol::H2c && self.upgrade.is_none() {
            // HTTP/2 names the target in `:scheme` and `:authority` (from
            // Host, which HTTP/2 does not repeat).
            *req.version_mut() = Version::HTTP_2;
            *req.uri_mut() = h2_target(&self.uri, headers.remove(http::header::HOST).as_ref(), slot.addr);
            if self.te_trailers {
                headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
            }
        }
        *req.headers_mut() = headers;
        Some(req)
    }
}

impl Proxy {
    /// A proxy whose tasks are owned by `tracker`; `tunnels` closes open
    /// tunnels and ends instance subscriptions, `pool` holds instance
    /// connections.
    #[must_use]
    pub fn new(
        client: Client,
        pool: Pool,
        settings: Settings,
        metrics: Metrics,
        tracker: TaskTracker,
        tunnels: CancellationToken,
    ) -> Self {
        Self {
            client,
            pool,
            admission: admission::Admission::new(settings.waiting, metrics.waiting.clone()),
            settings,
            metrics,
            tracker,
            tunnels,
        }
    }

    /// The router's waiting requests.
    #[must_use]
    pub fn admission(&self) -> &admission::Admission {
        &self.admission
    }

    /// The peers whose forwarding headers are kept.
    #[must_use]
    pub fn trusted_proxies(&self) -> &TrustedProxies {
        &self.settings.trusted_proxies
    }

    /// The connection pool.
    #[must_use]
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Starts the function's instance subscription unless it runs already
    /// (not for oneshot functions, which get a new instance per request).
    fn subscribe(&self, parsed: &Parsed, in_flight: &InFlightGuard) {
        let table = in_flight.table();
        if parsed.function.is_oneshot() || !table.claim_subscription() {
            return;
        }
        let subscriber = Subscriber {
            client: self.client.clone(),
            router_ip: self.settings.router_ip.clone(),
        };
        let table = table.clone();
        let function = parsed.api.clone();
        let stop = self.tunnels.clone();
        // Outlives the request that started it: a span of its own, linked.
        let span = tracing::info_span!(
            "router.subscription",
            function.deployment = %parsed.function.deployment,
            function.tenant = %parsed.function.tenant,
        );
        span.follows_from(tracing::Span::current());
        self.tracker.spawn(
            async move {
                tokio::select! {
                    () = subscriber.run(table, function) => {}
                    () = stop.cancelled() => {}
                }
            }
            .instrument(span),
        );
    }

    /// Forwards `req` (its body as hyper read it from the client) for
    /// `parsed` to an instance, retrying while nothing reached an
    /// instance's application (see the module docs). The request body
    /// reports what it is doing into `progress`.
    ///
    /// # Errors
    /// [`Error`] when no response could be obtained; the caller turns it into
    /// the router's own answer.
    pub async fn forward<B>(
        &self,
        parsed: &Arc<Parsed>,
        req: Request<B>,
        peer: &Peer,
        in_flight: InFlightGuard,
        progress: Progress,
    ) -> Result<Response<Body>, Error>
    where
        B: http_body::Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    {
        self.subscribe(parsed, &in_flight);
        let (prepared, client_upgrade) = Prepared::new(req, peer, &self.settings, progress.clone());
        let mut tries = Tries::default();
        let mut attempt = 0;
        while self.settings.retry.allows(attempt + 1) {
            attempt += 1;
            let chosen = match self.select(parsed, &in_flight, &mut tries).await {
                Selected::Instance(c) => {
                    // No longer waiting.
                    tries.ticket = None;
                    c
                }
                Selected::Unusable { name, failure } => {
                    tries.failed(Some(name), failure);
                    continue;
                }
                Selected::Retry(failure) => {
                    tries.failed(None, failure);
                    continue;
                }
                Selected::Final(e) => return Err(e),
            };
            let outcome = if prepared.direct_to(&chosen.slot) {
                let head = prepared.direct_head(&chosen.slot, &in_flight.table().tenant);
                self.attempt_direct(&chosen, &head, &prepared.method).await
            } else {
                let Some(req) = prepared.request(&chosen.slot, &in_flight.table().tenant) else {
                    // The previous instance refused the request after
                    // reading more body than the router keeps.
                    return Err(Error::NotReplayable {
                        limit: replay::MAX_REPLAY_BYTES,
                        last: Box::new(tries.into_last()),
                    });
                };
                self.attempt(&chosen, req, prepared.upgrade.is_some()).await
            };
            match outcome {
                Outcome::Response(resp) => {
                    progress.answered();
                    let ms = u64::try_from(tries.get_instance_time.as_millis()).unwrap_or(u64::MAX);
                    let hold = Hold {
                        in_flight,
                        slot: chosen.guard,
                        release: chosen.release,
                    };
                    let cold = tries
                        .timing
                        .as_ref()
                        .and_then(|t| HeaderValue::try_from(t.server_timing(tries.get_instance_time)).ok());
                    let resp = match (client_upgrade, prepared.upgrade) {
                        (Some(client_upgrade), Some(want))
                            if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS =>
                        {
                            self.tunnel(resp, client_upgrade, &want, chosen.slot.name.clone(), hold, ms)
                        }
                        _ => Ok(finish(
                            resp,
                            hold,
                            ms,
                            prepared.grpc.then(|| chosen.slot.name.clone()),
                        )),
                    };
                    return resp.map(|mut r| {
                        if let Some(v) = cold {
                            r.headers_mut()
                                .append(http::header::HeaderName::from_static("server-timing"), v);
                        }
                        r
                    });
                }
                Outcome::Unusable(failure) => {
                    tracing::debug!(attempt, instance = %chosen.slot.name, error = %failure, "instance unusable; trying another");
                    // A oneshot claim is released as `chosen` drops.
                    tries.failed(Some(chosen.slot.name.clone()), failure);
                }
                Outcome::Final(e) => return Err(e),
            }
        }
        Err(Error::Exhausted {
            attempts: attempt,
            last: Box::new(tries.into_last()),
        })
    }
}

/// What the attempts of one request have learned so far.
#[derive(Debug, Default)]
struct Tries {
    /// Instances that failed this request; neither the table nor the
    /// controller offers them again.
    excluded: Vec<String>,
    /// How the last attempt failed.
    last: Option<Error>,
    /// Retries that asked the controller (they back off).
    controller_retries: u32,
    /// Time spent in `GetInstance` calls.
    get_instance_time: Duration,
    /// How the assignment a `GetInstance` call made went (a cold start):
    /// the response's `Server-Timing`.
    timing: Option<AssignTiming>,
    /// The request's place among the waiting ones, while it waits.
    ticket: Option<admission::Ticket>,
}

impl Tries {
    fn failed(&mut self, instance: Option<String>, failure: Error) {
        if let Some(name) = instance
            && !self.excluded.contains(&name)
        {
            self.excluded.push(name);
        }
        self.last = Some(failure);
    }

    fn into_last(self) -> Error {
        self.last
            .unwrap_or(Error::ControllerUnavailable(crate::client::Error::NoEndpoints {
                method: crate::client::Method::GetInstance,
            }))
    }
}

/// The absolute form of `origin` for an HTTP/2 request: `http`, the Host
/// the client named (else the instance's address), the path and query.
fn h2_target(origin: &Uri, host: Option<&HeaderValue>, addr: SocketAddr) -> Uri {
    let authority = host
        .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok())
        .or_else(|| http::uri::Authority::try_from(addr.to_string()).ok());
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = authority;
    parts.path_and_query = origin
        .path_and_query()
        .cloned()
        .or_else(|| Some(http::uri::PathAndQuery::from_static("/")));
    Uri::from_parts(parts).unwrap_or_else(|_| origin.clone())
}

fn finish(resp: Response<UpstreamBody>, hold: Hold, ms: u64, grpc: Option<String>) -> Response<Body> {
    let (mut parts, inner) = resp.into_parts();
    headers::strip_response(&mut parts.headers);
    parts
        .headers
        .insert(headers::GET_INSTANCE_DURATION_MS, duration_ms(ms));
    let body = ProxyBody {
        inner,
        hold: Some(hold),
        grpc,
        ended: false,
    };
    Response::from_parts(parts, Body::new(body))
}

/// The `X-Skipper-Get-Instance-Duration-Ms` value (a warm request's `0`
/// without formatting).
fn duration_ms(ms: u64) -> HeaderValue {
    if ms == 0 {
        HeaderValue::from_static("0")
    } else {
        HeaderValue::from(ms)
    }
}
