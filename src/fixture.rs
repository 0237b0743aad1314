//! `skipper fixture`: the reference pod program (spec §3.4).
//!
//! It serves `GET /healthz`, the assignment endpoint `POST /__skipper/assign`
//! (verifies the PASETO token against the keys of `--public-key`, requires
//! `sub` to be the function's tenant and the token to be bound to this pod
//! ([`crate::token::Claims::check_binding`]: audience, `--pod-name`,
//! `--pod-uid`, a `jti` not seen before), persists the token 0600 and stays
//! assigned across restarts), a WebSocket ping → pong on any path, and once assigned echoes
//! every other request as JSON, including the tenant it serves. A request
//! naming another instance (`X-Skipper-Instance`, checked against
//! `--pod-name`) or another tenant (`X-Skipper-Tenant`) is answered
//! `421 Misdirected Request` before anything else happens. Test knobs on
//! the echo path: `?delay_ms=N`, `?status=N`, `?burn_ms=N`, `?bytes=N` and
//! `/sse?events=N&interval_ms=M`. With `--fixture-grpc-health-port` it also
//! serves `grpc.health.v1.Health`, reporting `--fixture-grpc-health-status` (a test knob for
//! gRPC probes).
//!
//! The port speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c); the echo
//! reports the version it received (`proto`). Once assigned it also serves
//! the gRPC echo service [`echo`] (`skipper.fixture.Echo`: unary and
//! bidirectional streaming), behind the same 421 guard.

pub mod echo;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use tokio::sync::Mutex;
use tracing::Instrument as _;

use crate::config::parse_duration;
use crate::domain::{
    DEFAULT_ASSIGN_PATH, Function, HEADER_FUNCTION, HEADER_INSTANCE, HEADER_TENANT, HEADER_TOKEN,
};
use crate::shutdown::Shutdown;
use crate::telemetry::otel;
use crate::token::{KeyError, TrustedKeys};

/// How long in-flight requests may take to finish after SIGTERM.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// Flags of `skipper fixture`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Ed25519 public keys (SPKI PEM, one or more `PUBLIC KEY` blocks) that verify assignment tokens
    #[arg(long, env = "SKIPPER_PUBLIC_KEY", hide_env_values = true)]
    pub public_key: Option<String>,

    /// Read the public keys from this PEM file instead of --public-key
    #[arg(long, env = "SKIPPER_PUBLIC_KEY_FILE", conflicts_with = "public_key")]
    pub public_key_file: Option<PathBuf>,

    /// Listen port
    #[arg(long, env = "SKIPPER_FIXTURE_PORT", default_value_t = 8888)]
    pub fixture_port: u16,

    /// Where the accepted token is persisted (mode 0600); its presence at start means "assigned"
    #[arg(long, env = "SKIPPER_FIXTURE_TOKEN_PATH", default_value = "/tmp/token")]
    pub fixture_token_path: PathBuf,

    /// Listen address
    #[arg(long, env = "SKIPPER_HOST", default_value = "0.0.0.0")]
    pub host: String,

    /// This pod's name (the downward API's metadata.name): requests naming another instance get 421
    #[arg(long, env = "SKIPPER_POD_NAME", default_value = "")]
    pub pod_name: String,

    /// This pod's UID (the downward API's metadata.uid): a token for another pod UID is refused
    #[arg(long, env = "SKIPPER_POD_UID", default_value = "")]
    pub pod_uid: String,

    /// Accept tokens that name no pod (what Go controllers issue); the pod then cannot tell a replayed token
    #[arg(long, env = "SKIPPER_ACCEPT_UNBOUND_TOKENS", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub accept_unbound_tokens: bool,

    /// Test knob: wait this long before handling an assign request
    #[arg(long, env = "SKIPPER_ASSIGN_DELAY", default_value = "0s", value_parser = parse_duration)]
    pub assign_delay: Duration,

    /// Test knob: answer every assign request with this status instead of running the checks
    #[arg(long, env = "SKIPPER_ASSIGN_STATUS", value_parser = parse_status)]
    pub assign_status: Option<u16>,

    /// Also serve the gRPC health service (grpc.health.v1.Health) on this port
    #[arg(long, env = "SKIPPER_FIXTURE_GRPC_HEALTH_PORT")]
    pub fixture_grpc_health_port: Option<u16>,

    /// Test knob: what the gRPC health service reports for the server (service "")
    #[arg(long, env = "SKIPPER_FIXTURE_GRPC_HEALTH_STATUS", default_value = "SERVING",
          value_parser = ["SERVING", "NOT_SERVING"])]
    pub fixture_grpc_health_status: String,

    /// Logging and telemetry flags.
    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

fn parse_status(s: &str) -> Result<u16, String> {
    let n: u16 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a status code: {e}"))?;
    if (100..=599).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} is not an HTTP status code (100-599)"))
    }
}

/// Why the fixture cannot start.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("--public-key (or --public-key-file) is required")]
    MissingPublicKey,
    #[error("--public-key-file {path}: {source}")]
    ReadKeyFile { path: PathBuf, source: std::io::Error },
    #[error("--public-key: {0}")]
    BadKey(#[from] KeyError),
    #[error("--host {host:?} / --fixture-port {port}: not a socket address")]
    BadAddress { host: String, port: u16 },
    #[error("--fixture-token-path {path}: {source}")]
    TokenPath { path: PathBuf, source: std::io::Error },
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving: {0}")]
    Serve(std::io::Error),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("{0}")]
    Telemetry(#[from] crate::telemetry::AddrError),
}

/// Validated fixture settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Verify assignment tokens.
    pub keys: TrustedKeys,
    /// Listen address.
    pub addr: SocketAddr,
    /// Where an accepted token is persisted.
    pub token_path: PathBuf,
    /// Wait before handling an assign request.
    pub assign_delay: Duration,
    /// Answer every assign request with this status.
    pub assign_status: Option<u16>,
    /// Where the gRPC health service listens, and whether it reports `SERVING`.
    pub grpc_health: Option<(SocketAddr, bool)>,
    /// This pod's name, checked against `X-Skipper-Instance` and a bound
    /// token's `pod` (`None`: not known; bound tokens are then refused).
    pub pod_name: Option<String>,
    /// This pod's UID, checked against a bound token's `pod_uid` (`None`:
    /// not checked).
    pub pod_uid: Option<String>,
    /// Accept tokens without the binding claims.
    pub accept_unbound_tokens: bool,
}

impl Settings {
    /// Checks the flags, naming the one that is wrong.
    ///
    /// # Errors
    /// [`FixtureError`] for a missing or malformed key or a bad address.
    pub fn from_args(args: &Args) -> Result<Self, FixtureError> {
        let pem = match (&args.public_key, &args.public_key_file) {
            (Some(pem), _) if !pem.trim().is_empty() => pem.clone(),
            (_, Some(path)) => std::fs::read_to_string(path).map_err(|source| FixtureError::ReadKeyFile {
                path: path.clone(),
                source,
            })?,
            _ => return Err(FixtureError::MissingPublicKey),
        };
        let keys = TrustedKeys::from_pem(&pem)?;
        let host = args.host.trim_start_matches('[').trim_end_matches(']');
        let ip: std::net::IpAddr = host.parse().map_err(|_| FixtureError::BadAddress {
            host: args.host.clone(),
            port: args.fixture_port,
        })?;
        Ok(Self {
            keys,
            addr: SocketAddr::new(ip, args.fixture_port),
            token_path: args.fixture_token_path.clone(),
            assign_delay: args.assign_delay,
            assign_status: args.assign_status,
            grpc_health: args.fixture_grpc_health_port.map(|port| {
                (
                    SocketAddr::new(ip, port),
                    args.fixture_grpc_health_status == "SERVING",
                )
            }),
            pod_name: Some(args.pod_name.trim().to_owned()).filter(|n| !n.is_empty()),
            pod_uid: Some(args.pod_uid.trim().to_owned()).filter(|n| !n.is_empty()),
            accept_unbound_tokens: args.accept_unbound_tokens,
        })
    }
}

/// Assignment state: `Some(tenant)` once assigned (`tenant` is `None` when a
/// persisted token no longer verifies, e.g. it expired).
#[derive(Debug, Default)]
struct Assignment {
    assigned: bool,
    tenant: Option<String>,
    /// `jti`s of every bound token that passed the checks (a replay is
    /// refused even when its first use did not complete).
    seen: std::collections::HashSet<String>,
}

struct AppState {
    settings: Settings,
    assignment: Mutex<Assignment>,
}

/// A running fixture server (used by `main` and by tests in-process).
pub struct Fixture {
    addr: SocketAddr,
    shutdown: Shutdown,
}

impl Fixture {
    /// Binds and serves until [`Fixture::stop`] or the shutdown token fires.
    ///
    /// # Errors
    /// When the token path cannot be inspected or the address cannot be bound.
    pub async fn start(settings: Settings, shutdown: Shutdown) -> Result<Self, FixtureError> {
        let assignment = load_assignment(&settings)?;
        let listener = tokio::net::TcpListener::bind(settings.addr)
            .await
            .map_err(|source| FixtureError::Bind {
                addr: settings.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(FixtureError::Serve)?;
        if let Some((health_addr, serving)) = settings.grpc_health {
            serve_grpc_health(health_addr, serving, &shutdown).await?;
        }
        let state = Arc::new(AppState {
            settings,
            assignment: Mutex::new(assignment),
        });
        let grpc =
            echo::router(state.clone()).layer(axum::middleware::from_fn_with_state(state.clone(), guard));
        let app = axum::Router::new()
            .route("/healthz", any(|| async { StatusCode::OK }))
            .route(DEFAULT_ASSIGN_PATH, any(assign))
            .fallback(echo)
            .with_state(state)
            .merge(grpc)
            .layer(axum::middleware::from_fn(traced));
        let token = shutdown.token().clone();
        shutdown.spawn("fixture-http", async move {
            if let Err(e) = axum::serve(crate::net::http_listener(listener), app)
                .with_graceful_shutdown(token.cancelled_owned())
                .await
            {
                tracing::warn!(error = %e, "fixture server stopped");
            }
        });
        tracing::info!(address = %addr, "fixture listening");
        Ok(Self { addr, shutdown })
    }

    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits up to the shutdown timeout.
    pub async fn stop(self) -> bool {
        self.shutdown.drain(SHUTDOWN_TIMEOUT).await
    }
}

/// `grpc.health.v1.Health` on `addr`, reporting `SERVING` or `NOT_SERVING`
/// for the server as a whole (service `""`); other service names are unknown.
async fn serve_grpc_health(addr: SocketAddr, serving: bool, shutdown: &Shutdown) -> Result<(), FixtureError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| FixtureError::Bind { addr, source })?;
    let (reporter, service) = tonic_health::server::health_reporter();
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter.set_service_status("", status).await;
    let token = shutdown.token().clone();
    shutdown.spawn("fixture-grpc-health", async move {
        // The reporter lives as long as the server.
        let _reporter = reporter;
        let incoming = crate::net::grpc_incoming(listener);
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "fixture gRPC health server stopped");
        }
    });
    tracing::info!(address = %addr, serving, "fixture gRPC health listening");
    Ok(())
}

fn load_assignment(settings: &Settings) -> Result<Assignment, FixtureError> {
    match std::fs::read_to_string(&settings.token_path) {
        Ok(token) => {
            // Accepted earlier: its signature still names the tenant, its
            // short lifetime may be over.
            let tenant = settings.keys.verify_signed(token.trim()).map(|c| c.sub).ok();
            Ok(Assignment {
                assigned: true,
                tenant,
                seen: std::collections::HashSet::new(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Assignment::default()),
        Err(source) => Err(FixtureError::TokenPath {
            path: settings.token_path.clone(),
            source,
        }),
    }
}

/// Runs the fixture until SIGTERM/SIGINT.
///
/// # Errors
/// [`FixtureError`] for bad flags or when the address cannot be bound.
pub async fn main(args: Args) -> Result<ExitCode, FixtureError> {
    let traces = crate::telemetry::init_traced(&args.telemetry, "skipper.fixture");
    let settings = Settings::from_args(&args)?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals().map_err(FixtureError::Signals)?;
    crate::profiling::start(&args.telemetry, &shutdown).await?;
    let fixture = Fixture::start(settings, shutdown.clone()).await?;
    shutdown.cancelled().await;
    fixture.stop().await;
    traces.shutdown(SHUTDOWN_TIMEOUT).await;
    Ok(ExitCode::SUCCESS)
}

/// Every request but the health check is a server span named `fixture`,
/// child of the caller's `traceparent`, while traces are exported.
async fn traced(req: Request, next: axum::middleware::Next) -> Response {
    if !otel::enabled() || req.uri().path() == "/healthz" {
        return next.run(req).await;
    }
    let span = tracing::info_span!(
        "fixture.request",
        otel.name = "fixture",
        otel.kind = "server",
        http.request.method = %req.method(),
        url.path = req.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    otel::set_remote_parent(&span, otel::extract_http(req.headers()));
    let resp = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", resp.status().as_u16());
    resp
}

/// A Go `http.Error`-style plain-text answer.
fn plain_error(status: StatusCode, text: &str) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        format!("{text}\n"),
    )
        .into_response()
}

async fn assign(State(state): State<Arc<AppState>>, method: Method, headers: HeaderMap) -> Response {
    if !state.settings.assign_delay.is_zero() {
        tokio::time::sleep(state.settings.assign_delay).await;
    }
    if let Some(status) = state.settings.assign_status {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return plain_error(status, "assign failed (--assign-status)");
    }
    let mut assignment = state.assignment.lock().await;
    if method != Method::POST {
        return plain_error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    }
    if assignment.assigned {
        return plain_error(StatusCode::CONFLICT, "already assigned");
    }
    let Some(token) = headers.get(HEADER_TOKEN).and_then(|v| v.to_str().ok()) else {
        return plain_error(StatusCode::BAD_REQUEST, "missing X-Skipper-Token");
    };
    let Some(function) = headers.get(HEADER_FUNCTION) else {
        return plain_error(StatusCode::BAD_REQUEST, "missing X-Skipper-Function");
    };
    let Some(function) = function.to_str().ok().and_then(|f| Function::from_json(f).ok()) else {
        return plain_error(StatusCode::BAD_REQUEST, "invalid X-Skipper-Function");
    };
    let settings = &state.settings;
    let claims = match settings.keys.verify(token, SystemTime::now()) {
        Ok(claims) if claims.sub == function.tenant => claims,
        Ok(claims) => {
            tracing::warn!(sub = %claims.sub, tenant = %function.tenant, "token subject is not the function's tenant");
            return plain_error(
                StatusCode::UNAUTHORIZED,
                "invalid token: subject is not the function's tenant",
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, "rejected assignment token");
            return plain_error(StatusCode::UNAUTHORIZED, &format!("invalid token: {e}"));
        }
    };
    if let Err(e) = claims.check_binding(
        settings.pod_name.as_deref(),
        settings.pod_uid.as_deref(),
        settings.accept_unbound_tokens,
    ) {
        tracing::warn!(error = %e, "rejected assignment token");
        return plain_error(StatusCode::UNAUTHORIZED, &format!("invalid token: {e}"));
    }
    if let Some(jti) = &claims.jti
        && !assignment.seen.insert(jti.clone())
    {
        tracing::warn!(jti = %jti, "rejected a replayed assignment token");
        return plain_error(StatusCode::CONFLICT, "already assigned");
    }
    if let Err(e) = persist_token(&state.settings.token_path, token) {
        tracing::error!(error = %e, path = %state.settings.token_path.display(), "cannot persist token");
        return plain_error(StatusCode::INTERNAL_SERVER_ERROR, "internal error");
    }
    assignment.assigned = true;
    assignment.tenant = Some(function.tenant.clone());
    tracing::info!(tenant = %function.tenant, "assigned");
    StatusCode::OK.into_response()
}

/// Writes the token with mode 0600 (write to a sibling file, then rename:
/// a reader sees the whole token or none). No fsync: the file is for a
/// restart of this pod's program, which reads it from the page cache; a
/// crash of the node that loses it ends the pod too. An fsync cost the
/// assign POST milliseconds on a busy disk.
fn persist_token(path: &Path, token: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(token.as_bytes())?;
    std::fs::rename(&tmp, path)
}

fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    let upgrade_ws = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    connection_upgrade && upgrade_ws
}

fn canonical_header(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut c = part.chars();
            match c.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + &c.as_str().to_ascii_lowercase(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

fn query_param<T: std::str::FromStr>(query: &str, name: &str) -> Option<T> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.parse().ok())
}

/// Why a request is not for this pod: it names another instance, or a
/// tenant this pod does not serve (an unassigned pod serves none), or names
/// either twice (a second value could be the one a proxy in between
/// believes). Absent headers are not checked; a pod whose token no longer
/// verifies does not know its tenant and accepts any.
fn misdirected(headers: &HeaderMap, pod_name: Option<&str>, assignment: &Assignment) -> Option<String> {
    for name in [HEADER_INSTANCE, HEADER_TENANT] {
        let n = headers.get_all(name).iter().count();
        if n > 1 {
            return Some(format!("{name} is given {n} times; a request names one"));
        }
    }
    let value = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    if let (Some(want), Some(me)) = (value(HEADER_INSTANCE), pod_name)
        && want != me
    {
        return Some(format!("this is instance {me:?}, not {want:?}"));
    }
    if let Some(want) = value(HEADER_TENANT) {
        if !assignment.assigned {
            return Some(format!("this instance serves no tenant, not {want:?}"));
        }
        if let Some(mine) = &assignment.tenant
            && *mine != want
        {
            return Some(format!("this instance serves another tenant, not {want:?}"));
        }
    }
    None
}

/// The gRPC service's guard: a call for another instance or tenant gets
/// 421 (the router tries another instance), one before assignment 503.
async fn guard(State(state): State<Arc<AppState>>, req: Request, next: axum::middleware::Next) -> Response {
    {
        let a = state.assignment.lock().await;
        if let Some(why) = misdirected(req.headers(), state.settings.pod_name.as_deref(), &a) {
            return plain_error(StatusCode::MISDIRECTED_REQUEST, &why);
        }
        if !a.assigned {
            return plain_error(StatusCode::SERVICE_UNAVAILABLE, "not assigned");
        }
    }
    next.run(req).await
}

async fn echo(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    {
        let a = state.assignment.lock().await;
        if let Some(why) = misdirected(&parts.headers, state.settings.pod_name.as_deref(), &a) {
            return plain_error(StatusCode::MISDIRECTED_REQUEST, &why);
        }
    }
    if is_websocket_upgrade(&parts.headers) {
        return match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
            Ok(ws) => ws.on_upgrade(ping_pong),
            Err(rejection) => rejection.into_response(),
        };
    }
    let tenant = {
        let a = state.assignment.lock().await;
        if !a.assigned {
            return plain_error(StatusCode::SERVICE_UNAVAILABLE, "not assigned");
        }
        a.tenant.clone()
    };
    let query = parts.uri.query().unwrap_or("").to_owned();
    if let Some(ms) = query_param::<u64>(&query, "delay_ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(ms) = query_param::<u64>(&query, "burn_ms") {
        let until = Instant::now() + Duration::from_millis(ms);
        // Busy work on a blocking thread so the CPU shows up in pod metrics.
        let _ = tokio::task::spawn_blocking(move || {
            let mut x: u64 = 0;
            while Instant::now() < until {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
        .await;
    }
    let status = query_param::<u16>(&query, "status")
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    if parts.uri.path() == "/sse" {
        let events = query_param::<u64>(&query, "events").unwrap_or(1);
        let interval = Duration::from_millis(query_param::<u64>(&query, "interval_ms").unwrap_or(100));
        let stream = futures::stream::unfold(0u64, move |i| async move {
            if i >= events {
                return None;
            }
            if i > 0 {
                tokio::time::sleep(interval).await;
            }
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(format!("id: {i}\ndata: event {i}\n\n"))),
                i + 1,
            ))
        });
        return (
            status,
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(stream),
        )
            .into_response();
    }
    if let Some(n) = query_param::<usize>(&query, "bytes") {
        return (
            status,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            vec![b'x'; n],
        )
            .into_response();
    }
    let body = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => return plain_error(StatusCode::BAD_REQUEST, &format!("reading body: {e}")),
    };
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for name in parts.headers.keys() {
        let values: Vec<&str> = parts
            .headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        headers.insert(canonical_header(name.as_str()), values.join(", "));
    }
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| parts.uri.authority().map(ToString::to_string))
        .unwrap_or_default();
    headers.insert("Host".into(), host);
    let url = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), ToString::to_string);
    let reply = serde_json::json!({
        "method": parts.method.as_str(),
        "proto": format!("{:?}", parts.version),
        "url": url,
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
        "tenant": tenant,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{reply}\n"),
    )
        .into_response()
}

async fn ping_pong(mut socket: WebSocket) {
    while let Some(Ok(msg)) = socket.recv().await {
        if let Message::Text(t) = msg
            && t.as_str() == "ping"
            && socket.send(Message::Text("pong".into())).await.is_err()
        {
            break;
        }
    }
}
