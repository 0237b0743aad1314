//! `skipper router`: the data plane. Reads the function from the
//! `X-Skipper-Function` header, chooses an instance from the function's local
//! table (kept current by a controller stream) or asks a controller for one,
//! proxies HTTP and WebSocket traffic to it, and reports activity with
//! batched heartbeats.
//!
//! - [`config`]: flags and the validated [`Config`].
//! - [`listener`]: HTTP/1.1 and HTTP/2 (h2c) on one port, HTTP/2's bounds.
//! - [`entry`]: the function header cache, `/healthz` and `/livez`, the 400 answers.
//! - [`proxy`]: instance selection, the retry loop and policy, one attempt,
//!   header rewriting, replayable bodies, upgrades, the instance connection
//!   pool, and the one map from errors to HTTP.
//! - [`instances`]: per-function instance tables and the local choice;
//!   [`subscription`]: the `WatchInstances` stream that feeds a table.
//! - [`activity`]: in-flight guards and the heartbeat sender.
//! - [`discovery`]: DNS and EndpointSlice controller discovery.
//! - [`metrics`]: Prometheus metrics.
//!
//! The router never imports the controller: they meet at the proto.

pub mod activity;
pub mod config;
pub mod discovery;
pub mod entry;
mod h1;
pub mod instances;
pub mod listener;
pub mod metrics;
pub mod proxy;
pub mod subscription;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

pub use config::{Args, Config, Discovery, InvalidFlag};

use crate::client::{ChannelSettings, Client, Endpoints};
use crate::shutdown::{Latch, Shutdown};
use crate::watch_access::Refusals;
use activity::Activity;
use entry::HeaderCache;
use metrics::Metrics;
use proxy::{Proxy, Settings};

/// Largest request line plus headers accepted from a client (larger: 431).
pub const MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;
/// Pause after a failed `accept`.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);
/// How often controllers that refused the router's credentials are asked
/// again (the health check turns ready again once one admits them).
pub const ACCESS_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// Why the router could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration")]
    Config(#[from] InvalidFlag),
    #[error("failed to bind {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to create the Kubernetes client for controller discovery")]
    Kube(#[source] kube::Error),
    #[error("failed to install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("--controller-token-file: {0}")]
    Credentials(#[from] crate::credentials::CredentialsError),
    #[error("invalid configuration")]
    Telemetry(#[from] crate::telemetry::AddrError),
}

/// State shared by every request.
struct State {
    cache: HeaderCache,
    activity: Activity,
    metrics: Metrics,
    proxy: Proxy,
    request_timeout: Option<std::time::Duration>,
    shutdown: CancellationToken,
    /// Refused watches: `/healthz` answers 503 while there is one.
    refusals: Refusals,
    /// The controller endpoints: `/healthz` answers 503 while every
    /// controller refuses the router's credentials.
    endpoints: Endpoints,
}

/// Runs the router until SIGTERM/SIGINT, then drains.
///
/// # Errors
/// Bad flags, a port that cannot be bound, discovery that cannot start.
pub async fn main(args: Args) -> Result<ExitCode, Error> {
    let traces = crate::telemetry::init_traced(&args.telemetry, "skipper.router");
    let config = Config::try_from(&args)?;
    let addr = config::listen_addr(&args)?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals().map_err(Error::Signals)?;
    crate::profiling::start(&args.telemetry, &shutdown).await?;
    tracing::info!(%addr, "router listening");
    run(config, listener, shutdown.clone()).await?;
    if !shutdown.drain(args.telemetry.telemetry_shutdown_timeout).await {
        tracing::warn!("background tasks did not stop within --telemetry-shutdown-timeout");
    }
    traces.shutdown(args.telemetry.telemetry_shutdown_timeout).await;
    tracing::info!("router shutdown");
    Ok(ExitCode::SUCCESS)
}

/// Serves on `listener` until `shutdown` begins, then drains in three steps
/// so that clients move to another router without a failed request:
///
/// 1. For `--shutdown-delay`, `/healthz` answers 503 (endpoints drop the
///    router) while requests are still served, new connections included,
///    each response with `Connection: close`: a client on a kept-alive
///    connection gets its answer and reconnects elsewhere.
/// 2. The listener closes, idle connections are closed and in-flight
///    requests finish, for up to `--shutdown-timeout`.
/// 3. What remains (tunnels, stuck requests) is cut.
///
/// Heartbeats, controller discovery and the instance tables keep running
/// until step 2. Metrics are served on `config.metrics_addr` when set.
///
/// # Errors
/// See [`Error`].
pub async fn run(config: Config, listener: TcpListener, shutdown: Shutdown) -> Result<(), Error> {
    let metrics_listener = match config.metrics_addr {
        Some(addr) => match TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(%addr, error = %e, "failed to bind the metrics endpoint; continuing without it");
                None
            }
        },
        None => None,
    };
    serve(config, listener, metrics_listener, shutdown).await
}

/// As [`run`], with the metrics listener bound by the caller.
///
/// # Errors
/// See [`Error`].
pub async fn serve(
    config: Config,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: Shutdown,
) -> Result<(), Error> {
    config.validate()?;
    // Cancelled when the listener closes (step 2): everything requests need
    // keeps running through the shutdown delay.
    let background = shutdown.with_token(CancellationToken::new());
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    crate::telemetry::process::register(&mut registry);
    if let Some(l) = metrics_listener {
        metrics::serve(l, Arc::new(registry), &background);
    }

    let credentials = match &config.controller_token_file {
        Some(path) => crate::credentials::Credentials::from_file(path)?,
        None => crate::credentials::Credentials::none(),
    };
    credentials.keep_fresh(&background);
    let endpoints = Endpoints::new(ChannelSettings::default()).with_credentials(credentials);
    let refusals = Refusals::new();
    start_discovery(&config, &endpoints, &refusals, &background).await?;
    let client = Client::new(endpoints.clone());
    background.spawn(
        "controller-access",
        watch_access(client.clone(), background.token().clone()),
    );

    let activity = Activity::new(metrics.clone());
    background.spawn(
        "heartbeats",
        activity::run_heartbeats(
            activity.clone(),
            client.clone(),
            config.pod_ip.clone(),
            config.heartbeat_interval,
            background.token().clone(),
        ),
    );

    // Cancelled after the drain: drops instance connections and tunnels.
    let hard_stop = CancellationToken::new();
    let pool = proxy::upstream::Pool::new(config.dial_timeout, shutdown.tracker().clone(), hard_stop.clone());
    let proxy = Proxy::new(
        client,
        pool,
        Settings {
            retry: proxy::retry::Policy {
                max_attempts: config.max_round_trip_attempts,
                min: config.retry_min,
                max: config.retry_max,
            },
            response_header_timeout: config.response_header_timeout,
            get_instance_timeout: config.get_instance_timeout,
            body_pace: config.body_timeout.map(|slack| proxy::Pace {
                slack,
                min_rate: config.body_min_rate,
            }),
            trusted_proxies: config.trusted_proxies.clone(),
            router_ip: config.pod_ip.clone(),
            waiting: config.waiting,
        },
        metrics.clone(),
        shutdown.tracker().clone(),
        hard_stop.clone(),
    );
    let state = Arc::new(State {
        cache: HeaderCache::default(),
        activity,
        metrics,
        proxy,
        request_timeout: config.request_timeout,
        shutdown: shutdown.token().clone(),
        refusals,
        endpoints,
    });

    let connections = TaskTracker::new();
    // Set at the end of the shutdown delay: the listener closes and every
    // connection shuts down gracefully. Client connections wait for it and
    // for the hard stop at every wake-up, so both are latches (an atomic
    // read), not tokens.
    let closing = Latch::new();
    let hard = Latch::new();
    let idle_timeout = config.idle_timeout;
    let write_timeout = config.write_timeout;
    let stop_accepting = stop_accepting(shutdown.token().clone(), config.shutdown_delay);
    let mut stop_accepting = std::pin::pin!(stop_accepting);
    loop {
        let (stream, remote) = tokio::select! {
            () = &mut stop_accepting => break,
            r = listener.accept() => match r {
                Ok(pair) => pair,
                Err(e) => {
                    // Typically out of file descriptors: pause instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::select! {
                        () = &mut stop_accepting => break,
                        () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    }
                }
            },
        };
        crate::net::nodelay(&stream);
        let state = state.clone();
        let drain = closing.clone();
        let hard = hard.clone();
        let tracker = connections.clone();
        connections.spawn(async move {
            let mut stream = stream;
            let detected = tokio::select! {
                r = listener::detect(&mut stream, idle_timeout) => r,
                () = drain.wait() => return,
            };
            let (protocol, prefix) = match detected {
                Ok(Some(d)) => d,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(%remote, error = %e, "client connection ended");
                    return;
                }
            };
            let exchanges = Arc::new(proxy::client_io::Exchanges::default());
            let memo = Arc::new(Memo::new(proxy::Peer::new(remote, state.proxy.trusted_proxies())));
            let service =
                |state: Arc<State>, memo: Arc<Memo>, exchanges: Arc<proxy::client_io::Exchanges>| {
                    hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        let memo = memo.clone();
                        let busy = exchanges.begin();
                        async move {
                            let resp = handle(&state, &memo, req, None).await;
                            Ok::<_, Infallible>(
                                resp.map(|body| Body::new(proxy::client_io::Answered::new(body, busy))),
                            )
                        }
                    })
                };
            let result = match protocol {
                // Plain requests are the router's own ([`h1`]); from the first
                // other one, hyper serves the connection. The header read
                // timeout also bounds idle keep-alive connections (it runs
                // from the moment a connection waits for the next request); a
                // request head larger than the buffer is answered 431 by
                // hyper. A client that half-closes after its request still
                // gets the answer; one that stops reading is cut off after
                // the write timeout.
                listener::Protocol::Http1 => {
                    let io = proxy::client_io::ClientIo::new(stream, write_timeout, exchanges.clone());
                    let own = h1::Connection {
                        state: &state,
                        memo: &memo,
                        idle_timeout,
                        drain: drain.clone(),
                    };
                    let served = tokio::select! {
                        r = own.serve(io, prefix) => r,
                        () = hard.wait() => return,
                    };
                    let (io, rest) = match served {
                        Ok(h1::Served::HandOver(io, rest)) => (io, rest),
                        Ok(h1::Served::Closed) => return,
                        Err(e) => {
                            tracing::debug!(%remote, error = %e, "client connection ended");
                            return;
                        }
                    };
                    let svc = service(state, memo, exchanges);
                    let conn = http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(idle_timeout)
                        .max_header_size(MAX_REQUEST_HEAD_BYTES)
                        .serve_connection(TokioIo::new(listener::Prefixed::new(rest, io)), svc)
                        .with_upgrades();
                    futures::pin_mut!(conn);
                    tokio::select! {
                        r = conn.as_mut() => r,
                        () = drain.wait() => {
                            conn.as_mut().graceful_shutdown();
                            tokio::select! {
                                r = conn.as_mut() => r,
                                () = hard.wait() => Ok(()),
                            }
                        }
                    }
                }
                listener::Protocol::Http2 => {
                    let stream = listener::Prefixed::new(prefix, stream);
                    let io = proxy::client_io::ClientIo::new(stream, write_timeout, exchanges.clone());
                    let svc = service(state, memo, exchanges);
                    let conn = listener::http2(tracker, idle_timeout).serve_connection(TokioIo::new(io), svc);
                    futures::pin_mut!(conn);
                    tokio::select! {
                        r = conn.as_mut() => r,
                        () = drain.wait() => {
                            conn.as_mut().graceful_shutdown();
                            tokio::select! {
                                r = conn.as_mut() => r,
                                () = hard.wait() => Ok(()),
                            }
                        }
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(%remote, error = %e, "client connection ended");
            }
        });
    }
    drop(listener);
    closing.set();
    background.trigger();
    connections.close();
    let drained = tokio::time::timeout(config.shutdown_timeout, connections.wait())
        .await
        .is_ok();
    if !drained {
        tracing::warn!(
            timeout = ?config.shutdown_timeout,
            "requests still in flight after the shutdown timeout; closing them"
        );
    }
    // Ends instance connections (idle ones too) and tunnels.
    hard_stop.cancel();
    hard.set();
    let _ = tokio::time::timeout(config.shutdown_timeout, connections.wait()).await;
    Ok(())
}

/// Resolves `delay` after `shutdown` is cancelled (the end of step 1).
async fn stop_accepting(shutdown: CancellationToken, delay: std::time::Duration) {
    shutdown.cancelled().await;
    if !delay.is_zero() {
        tracing::info!(
            ?delay,
            "router draining: unready, answering with Connection: close"
        );
        tokio::time::sleep(delay).await;
    }
}

async fn start_discovery(
    config: &Config,
    endpoints: &Endpoints,
    refusals: &Refusals,
    shutdown: &Shutdown,
) -> Result<(), Error> {
    match &config.discovery {
        Discovery::Static(addrs) => endpoints.replace(addrs),
        Discovery::Dns { host, port } => {
            discovery::refresh_dns(host, *port, endpoints).await;
            shutdown.spawn(
                "controller-dns",
                discovery::run_dns(host.clone(), *port, endpoints.clone(), shutdown.token().clone()),
            );
        }
        Discovery::EndpointSlices {
            namespace,
            service,
            port,
            zone,
        } => {
            let client = kube::Client::try_default().await.map_err(Error::Kube)?;
            let client = refusals.client(
                &client,
                format!("EndpointSlices of service {service} in namespace {namespace}"),
            );
            log_refusals(refusals, shutdown);
            shutdown.spawn(
                "controller-endpointslices",
                discovery::run_endpoint_slices(
                    client,
                    namespace.clone(),
                    service.clone(),
                    *port,
                    zone.clone(),
                    endpoints.clone(),
                    shutdown.token().clone(),
                ),
            );
        }
    }
    Ok(())
}

/// Logs each change of the refused watches (the health check answers
/// 503 while one is refused).
fn log_refusals(refusals: &Refusals, shutdown: &Shutdown) {
    let mut refused = refusals.subscribe();
    let token = shutdown.token().clone();
    shutdown.spawn("health-log", async move {
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                r = refused.changed() => if r.is_err() { return },
            }
            let now = refused.borrow_and_update().clone();
            if now.is_empty() {
                tracing::info!("router healthy: every watch runs");
            } else {
                tracing::error!(
                    refused = %Refusals::describe(&now),
                    "router unhealthy (/healthz 503): the API server refuses a watch (grant the verb), the \
                     controller endpoints would not follow the cluster"
                );
            }
        }
    });
}

/// Follows whether the controllers admit the router's credentials: while
/// one refuses them it is asked again every [`ACCESS_CHECK_INTERVAL`], and
/// each change of the verdict is logged (the health check answers 503
/// while every controller refuses).
async fn watch_access(client: Client, stop: CancellationToken) {
    let mut every = tokio::time::interval(ACCESS_CHECK_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was: Option<String> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        if client.endpoints().any_refused() {
            tokio::select! {
                () = stop.cancelled() => return,
                () = client.check_access(ACCESS_CHECK_INTERVAL) => {}
            }
        }
        let now = client.endpoints().refusal();
        if now != was {
            match &now {
                Some(why) => tracing::error!(
                    refused = %why,
                    "router unhealthy (/healthz 503): the controllers refuse its credentials (check \
                     --controller-token-file and the controllers' --router-service-accounts)"
                ),
                None => tracing::info!("router healthy: the controllers admit its credentials"),
            }
            was = now;
        }
    }
}

/// One request; once shutdown has begun its response closes the connection
/// (`Connection: close`), so the client's next request opens a connection
/// to another router.
async fn handle<B>(
    state: &State,
    memo: &Memo,
    req: Request<B>,
    timer: Option<&mut h1::Deadline>,
) -> Response<Body>
where
    B: http_body::Body<Data = bytes::Bytes, Error = hyper::Error> + Send + 'static,
{
    let mut resp = respond(state, memo, req, timer).await;
    if state.shutdown.is_cancelled() && resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        resp.headers_mut()
            .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    }
    resp
}

/// What a client connection remembers: its peer as the forwarding headers
/// name it, and its last request's function (a keep-alive client sending
/// the same header again skips the header cache and the activity map). A
/// std mutex: one request at a time uses it, never across an await.
struct Memo {
    peer: proxy::Peer,
    last: std::sync::Mutex<Option<Recalled>>,
}

/// The raw header of a connection's last request and what it named.
type Recalled = (http::HeaderValue, Arc<entry::Parsed>, Arc<activity::Entry>);

impl Memo {
    fn new(peer: proxy::Peer) -> Self {
        Self {
            peer,
            last: std::sync::Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Recalled>> {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The function and a request counted in flight, when `req` names the
    /// same function as the connection's last request.
    fn recall<B>(&self, req: &Request<B>) -> Option<(Arc<entry::Parsed>, activity::InFlightGuard)> {
        let raw = req.headers().get(proxy::headers::FUNCTION)?;
        let (parsed, entry) = {
            let last = self.lock();
            let (v, p, e) = last.as_ref()?;
            if v != raw {
                return None;
            }
            (p.clone(), e.clone())
        };
        let guard = Activity::enter(&entry, &parsed)?;
        Some((parsed, guard))
    }

    fn remember<B>(&self, req: &Request<B>, parsed: &Arc<entry::Parsed>, guard: &activity::InFlightGuard) {
        if let Some(raw) = req.headers().get(proxy::headers::FUNCTION) {
            *self.lock() = Some((raw.clone(), parsed.clone(), guard.entry().clone()));
        }
    }
}

/// One request: health check, header, activity, proxy, metrics.
///
/// `timer` is the connection's timer for the request timeout, when it has
/// one request at a time (else each request has its own).
async fn respond<B>(
    state: &State,
    memo: &Memo,
    req: Request<B>,
    timer: Option<&mut h1::Deadline>,
) -> Response<Body>
where
    B: http_body::Body<Data = bytes::Bytes, Error = hyper::Error> + Send + 'static,
{
    let start = Instant::now();
    let grpc = proxy::is_grpc(req.headers());
    if let Err(e) = proxy::forwarding::check_request_host(req.version(), req.uri(), req.headers()) {
        return proxy::Error::from(e).respond(grpc);
    }
    let (parsed, guard) = match memo.recall(&req) {
        Some(hit) => hit,
        None => {
            let parsed = match state.cache.function(req.headers()) {
                Ok(p) => p,
                Err(e) => {
                    match entry::check(req.method(), req.uri().path()) {
                        Some(entry::Check::Health) => {
                            return health(
                                state.shutdown.is_cancelled(),
                                &state.refusals.current(),
                                state.endpoints.refusal().as_deref(),
                            );
                        }
                        Some(entry::Check::Live) => return Response::new(Body::empty()),
                        None => {}
                    }
                    return proxy::Error::from(e).respond(grpc);
                }
            };
            let guard = state.activity.begin(&parsed).await;
            memo.remember(&req, &parsed, &guard);
            (parsed, guard)
        }
    };
    let span = request_span(&req);
    let function = guard.entry().clone();
    let progress = proxy::Progress::default();
    // Pinned where it is made: the future is a few KiB, and every wrapper
    // that took it by value (the timeout, the span) would copy it.
    let mut forwarding =
        std::pin::pin!(
            state
                .proxy
                .forward(&parsed, req, &memo.peer, guard, progress.clone())
        );
    let result = match state.request_timeout {
        // From the request's start (no second clock read).
        Some(t) => {
            let deadline = start + t;
            let done = match timer {
                Some(timer) => {
                    timer
                        .within(deadline, forwarding.as_mut())
                        .instrument(span.clone())
                        .await
                }
                None => tokio::time::timeout_at(deadline, forwarding)
                    .instrument(span.clone())
                    .await
                    .ok(),
            };
            done.unwrap_or_else(|| {
                Err(if progress.waiting_for_client() {
                    proxy::Error::RequestIncomplete(t)
                } else {
                    proxy::Error::RequestTimeout(t)
                })
            })
        }
        None => forwarding.instrument(span.clone()).await,
    };
    if result.is_ok() {
        function.learn(&state.metrics);
    }
    let resp = result.unwrap_or_else(|e| e.respond(grpc));
    let series = function.series();
    series.requests().inc();
    series
        .duration(resp.status())
        .observe(start.elapsed().as_secs_f64());
    span.record("http.response.status_code", resp.status().as_u16());
    if resp.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    resp
}

/// The server span of one proxied request (`HTTP <METHOD>`), child of the
/// client's `traceparent`; disabled when traces are off.
fn request_span<B>(req: &Request<B>) -> tracing::Span {
    if !crate::telemetry::otel::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "router.request",
        otel.name = %format_args!("HTTP {}", req.method()),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %req.method(),
        url.path = req.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    crate::telemetry::otel::set_remote_parent(&span, crate::telemetry::otel::extract_http(req.headers()));
    span
}

/// `GET /healthz`: 200; 503 once shutdown has begun, while the API server
/// refuses a watch, or while every controller refuses the router's
/// credentials (the body names the cause).
fn health(
    shutting_down: bool,
    refused: &BTreeMap<String, crate::watch_access::Refusal>,
    credentials: Option<&str>,
) -> Response<Body> {
    let (status, body) = if shutting_down {
        (StatusCode::SERVICE_UNAVAILABLE, Body::empty())
    } else if !refused.is_empty() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Body::from(format!("{}\n", Refusals::describe(refused))),
        )
    } else if let Some(why) = credentials {
        (StatusCode::SERVICE_UNAVAILABLE, Body::from(format!("{why}\n")))
    } else {
        (StatusCode::OK, Body::empty())
    };
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_turns_503_when_shutting_down() {
        let none = BTreeMap::new();
        assert_eq!(health(false, &none, None).status(), StatusCode::OK);
        assert_eq!(
            health(true, &none, None).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[tokio::test]
    async fn health_turns_503_naming_a_refused_watch() {
        use http_body_util::BodyExt;
        let refusals = Refusals::new();
        refusals.record(
            "EndpointSlices of service c in namespace s",
            true,
            StatusCode::FORBIDDEN,
        );
        let r = health(false, &refusals.current(), None);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            body,
            "watch of EndpointSlices of service c in namespace s refused (403 Forbidden): the `watch` verb is not granted\n"
        );
        let r = health(
            false,
            &BTreeMap::new(),
            Some("all 2 controllers refuse this caller's credentials (x)"),
        );
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "all 2 controllers refuse this caller's credentials (x)\n");
    }
}
