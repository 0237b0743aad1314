//! Probes as the kubelet runs them: `httpGet`, `tcpSocket`, `grpc` and
//! `exec`, with `initialDelaySeconds`, `periodSeconds`, `timeoutSeconds`,
//! `successThreshold` and `failureThreshold`.
//!
//! [`ProbeState`] is the kubelet's prober worker bookkeeping (pure): a result
//! changes only after `successThreshold` successes or `failureThreshold`
//! failures in a row; readiness starts as failure, liveness as success,
//! startup as unknown. [`run`] executes one probe; [`probe_loop`] ticks every
//! `periodSeconds` (the first tick at once), skips ticks inside
//! `initialDelaySeconds`, holds liveness and readiness until the startup
//! probe succeeded, and reports result changes to the pod worker.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use http_body_util::BodyExt as _;
use k8s_openapi::api::core::v1::{ContainerPort, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Startup,
    Liveness,
    Readiness,
}

impl Kind {
    /// The field name (`startupProbe`, ...).
    #[must_use]
    pub fn field(self) -> &'static str {
        match self {
            Self::Startup => "startupProbe",
            Self::Liveness => "livenessProbe",
            Self::Readiness => "readinessProbe",
        }
    }
}

/// What a probe does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `GET scheme://host:port/path` with headers; 200–399 is success.
    Http {
        host: Option<String>,
        port: IntOrString,
        path: String,
        scheme: String,
        headers: Vec<(String, String)>,
    },
    /// A TCP connect.
    Tcp { host: Option<String>, port: IntOrString },
    /// `grpc.health.v1.Health/Check` for `service`; `SERVING` is success.
    Grpc { port: i32, service: String },
    /// A command in the container; exit 0 is success.
    Exec { command: Vec<String> },
}

/// A probe with the kubelet's defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub action: Action,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
    /// `terminationGracePeriodSeconds` of the probe (liveness and startup).
    pub termination_grace: Option<i64>,
}

/// Why a probe cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("{0} has no handler (httpGet, tcpSocket, grpc or exec)")]
    NoHandler(&'static str),
}

fn secs(v: Option<i32>, default: i32, min: i32) -> Duration {
    Duration::from_secs(u64::try_from(v.unwrap_or(default).max(min)).unwrap_or(0))
}

fn threshold(v: Option<i32>, default: u32) -> u32 {
    v.and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(default)
}

impl Spec {
    /// Reads an API probe, applying the API defaults (period 10 s, timeout
    /// 1 s, success 1, failure 3). Liveness and startup probes always need a
    /// single success, as the API requires.
    ///
    /// # Errors
    /// [`SpecError`] when the probe has no handler.
    pub fn from_api(kind: Kind, p: &Probe) -> Result<Self, SpecError> {
        let action = if let Some(h) = &p.http_get {
            Action::Http {
                host: h.host.clone().filter(|s| !s.is_empty()),
                port: h.port.clone(),
                path: h
                    .path
                    .clone()
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| "/".into()),
                scheme: h.scheme.clone().unwrap_or_else(|| "HTTP".into()),
                headers: h
                    .http_headers
                    .iter()
                    .flatten()
                    .map(|h| (h.name.clone(), h.value.clone()))
                    .collect(),
            }
        } else if let Some(t) = &p.tcp_socket {
            Action::Tcp {
                host: t.host.clone().filter(|s| !s.is_empty()),
                port: t.port.clone(),
            }
        } else if let Some(g) = &p.grpc {
            Action::Grpc {
                port: g.port,
                service: g.service.clone().unwrap_or_default(),
            }
        } else if let Some(e) = &p.exec {
            Action::Exec {
                command: e.command.clone().unwrap_or_default(),
            }
        } else {
            return Err(SpecError::NoHandler(kind.field()));
        };
        let success_threshold = if kind == Kind::Readiness {
            threshold(p.success_threshold, 1)
        } else {
            1
        };
        Ok(Self {
            action,
            initial_delay: secs(p.initial_delay_seconds, 0, 0),
            period: secs(p.period_seconds, 10, 1),
            timeout: secs(p.timeout_seconds, 1, 1),
            success_threshold,
            failure_threshold: threshold(p.failure_threshold, 3),
            termination_grace: p.termination_grace_period_seconds,
        })
    }
}

/// The result of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// The probe ran and failed (the text says how).
    Failure(String),
    /// The probe could not run (e.g. an unknown named port): the kubelet
    /// throws the result away.
    Unknown(String),
}

/// The kubelet's per-probe bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeState {
    kind: Kind,
    last: Option<bool>,
    run: u32,
    result: Option<bool>,
}

impl ProbeState {
    /// The state of a new container: readiness failure, liveness success, startup unknown.
    #[must_use]
    pub fn new(kind: Kind) -> Self {
        Self {
            kind,
            last: None,
            run: 0,
            result: match kind {
                Kind::Readiness => Some(false),
                Kind::Liveness => Some(true),
                Kind::Startup => None,
            },
        }
    }

    /// The published result (`None`: unknown).
    #[must_use]
    pub fn result(&self) -> Option<bool> {
        self.result
    }

    /// Records one probe; returns the published result when it changes.
    pub fn observe(&mut self, success: bool, spec: &Spec) -> Option<bool> {
        if self.last == Some(success) {
            self.run = self.run.saturating_add(1);
        } else {
            self.last = Some(success);
            self.run = 1;
        }
        if (!success && self.run < spec.failure_threshold) || (success && self.run < spec.success_threshold) {
            return None;
        }
        let changed = self.result != Some(success);
        self.result = Some(success);
        if !success && matches!(self.kind, Kind::Liveness | Kind::Startup) {
            // The container gets restarted: count afresh for the next one.
            self.run = 0;
        }
        changed.then_some(success)
    }
}

/// Where the probed container lives.
#[derive(Debug, Clone)]
pub struct Target {
    pub pod_ip: IpAddr,
    pub ports: Vec<ContainerPort>,
}

impl Target {
    fn port(&self, port: &IntOrString) -> Result<u16, String> {
        match port {
            IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("invalid port number: {n}")),
            IntOrString::String(s) => {
                if let Ok(n) = s.parse::<u16>() {
                    return Ok(n);
                }
                self.ports
                    .iter()
                    .find(|p| p.name.as_deref() == Some(s.as_str()))
                    .and_then(|p| u16::try_from(p.container_port).ok())
                    .ok_or_else(|| format!("couldn't find port: {s}"))
            }
        }
    }

    fn addr(&self, host: Option<&str>, port: u16) -> Result<SocketAddr, String> {
        let ip = match host {
            None => self.pod_ip,
            Some(h) => h
                .parse::<IpAddr>()
                .map_err(|_| format!("probe host {h:?} is not an IP address"))?,
        };
        Ok(SocketAddr::new(ip, port))
    }
}

/// Runs commands inside a container (exec probes and hooks).
pub trait Exec: Send + Sync {
    /// Runs `command` in the container; its exit code, or why it did not run
    /// to the end within `timeout`.
    fn exec(
        &self,
        command: &[String],
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<i32, String>> + Send;
}

/// The `User-Agent` of HTTP probes.
pub const USER_AGENT: &str = "kube-probe/1.33";

/// `GET` over HTTP/1.1; the status code.
///
/// # Errors
/// The connection or protocol failure, as text.
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
) -> Result<http::StatusCode, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("dial tcp {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let mut req = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .header(http::header::USER_AGENT, USER_AGENT)
        .header(http::header::ACCEPT, "*/*");
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        // The kubelet reads at most 10 KiB of the body.
        let mut body = resp.into_body();
        let mut read = 0usize;
        while read < 10 * 1024 {
            match body.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, bytes::Bytes::len),
                _ => break,
            }
        }
        Ok(status)
    };
    // The connection is driven beside the exchange and dropped with it.
    let mut exchange = std::pin::pin!(exchange);
    let mut conn = std::pin::pin!(conn);
    let mut conn_done = false;
    loop {
        tokio::select! {
            r = &mut exchange => return r,
            _ = &mut conn, if !conn_done => conn_done = true,
        }
    }
}

/// gRPC `Health/Check`; whether the answer is `SERVING`.
async fn grpc_check(addr: SocketAddr, service: &str, timeout: Duration) -> Result<bool, String> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("failed to connect service {addr:?} within {timeout:?}: {e}"))?;
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .map_err(|s| format!("health rpc probe failed: {}: {}", s.code(), s.message()))?;
    Ok(resp.into_inner().status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32)
}

/// Runs one probe with its timeout.
pub async fn run<E: Exec>(spec: &Spec, target: &Target, exec: &E) -> Outcome {
    let timeout = spec.timeout;
    let attempt = async {
        match &spec.action {
            Action::Http {
                host,
                port,
                path,
                scheme,
                headers,
            } => {
                if !scheme.eq_ignore_ascii_case("HTTP") {
                    return Outcome::Unknown(format!("scheme {scheme} is not supported (only HTTP)"));
                }
                let addr = match target.port(port).and_then(|p| target.addr(host.as_deref(), p)) {
                    Ok(a) => a,
                    Err(e) => return Outcome::Unknown(e),
                };
                match http_get(addr, path, headers).await {
                    Ok(s) if (200..400).contains(&s.as_u16()) => Outcome::Success,
                    Ok(s) => Outcome::Failure(format!("HTTP probe failed with statuscode: {}", s.as_u16())),
                    Err(e) => Outcome::Failure(format!("Get \"http://{addr}{path}\": {e}")),
                }
            }
            Action::Tcp { host, port } => {
                let addr = match target.port(port).and_then(|p| target.addr(host.as_deref(), p)) {
                    Ok(a) => a,
                    Err(e) => return Outcome::Unknown(e),
                };
                match tokio::net::TcpStream::connect(addr).await {
                    Ok(_) => Outcome::Success,
                    Err(e) => Outcome::Failure(format!("dial tcp {addr}: {e}")),
                }
            }
            Action::Grpc { port, service } => {
                let addr = match u16::try_from(*port) {
                    Ok(p) => SocketAddr::new(target.pod_ip, p),
                    Err(_) => return Outcome::Unknown(format!("invalid port number: {port}")),
                };
                match grpc_check(addr, service, timeout).await {
                    Ok(true) => Outcome::Success,
                    Ok(false) => {
                        Outcome::Failure("service unhealthy (responded with \"NOT_SERVING\")".into())
                    }
                    Err(e) => Outcome::Failure(e),
                }
            }
            Action::Exec { command } => match exec.exec(command, timeout).await {
                Ok(0) => Outcome::Success,
                Ok(code) => Outcome::Failure(format!("command {command:?} exited with {code}")),
                Err(e) => Outcome::Failure(e),
            },
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(o) => o,
        Err(_) => Outcome::Failure(format!("probe timed out after {timeout:?}")),
    }
}

/// A published change of a probe result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Which container instance (the worker ignores stale ones).
    pub instance: u64,
    pub kind: Kind,
    pub success: bool,
    /// The last probe's text when it failed.
    pub message: Option<String>,
}

/// Probes one container instance until `stop` fires, sending result changes
/// to `tx`. Liveness and readiness wait for `started`; a liveness or startup
/// failure ends the loop (the container is restarted and gets a new loop).
#[allow(clippy::too_many_arguments)]
pub async fn probe_loop<E: Exec>(
    kind: Kind,
    spec: Spec,
    target: Target,
    exec: E,
    instance: u64,
    started_at: Instant,
    mut started: watch::Receiver<bool>,
    tx: mpsc::Sender<Change>,
    stop: CancellationToken,
) {
    let mut state = ProbeState::new(kind);
    let mut ticker = tokio::time::interval(spec.period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
            changed = started.changed(), if kind == Kind::Readiness && !*started.borrow() => {
                // The kubelet probes readiness at once when the container has started.
                if changed.is_err() {
                    return;
                }
                if !*started.borrow() {
                    continue;
                }
            }
        }
        // `initialDelaySeconds` counts whole seconds since the container started.
        let elapsed = Duration::from_secs(started_at.elapsed().as_secs());
        if elapsed < spec.initial_delay {
            continue;
        }
        let is_started = *started.borrow();
        match kind {
            Kind::Startup if is_started => continue,
            Kind::Liveness | Kind::Readiness if !is_started => continue,
            _ => {}
        }
        let outcome = tokio::select! {
            () = stop.cancelled() => return,
            o = run(&spec, &target, &exec) => o,
        };
        let (success, message) = match outcome {
            Outcome::Success => (true, None),
            Outcome::Failure(m) => (false, Some(m)),
            Outcome::Unknown(m) => {
                tracing::debug!(probe = kind.field(), error = %m, "probe error; result thrown away");
                continue;
            }
        };
        if let Some(result) = state.observe(success, &spec) {
            let change = Change {
                instance,
                kind,
                success: result,
                message,
            };
            if tx.send(change).await.is_err() {
                return;
            }
            if !result && matches!(kind, Kind::Liveness | Kind::Startup) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(success: u32, failure: u32) -> Spec {
        Spec {
            action: Action::Tcp {
                host: None,
                port: IntOrString::Int(80),
            },
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            success_threshold: success,
            failure_threshold: failure,
            termination_grace: None,
        }
    }

    #[test]
    fn initial_results_follow_the_kubelet() {
        assert_eq!(ProbeState::new(Kind::Readiness).result(), Some(false));
        assert_eq!(ProbeState::new(Kind::Liveness).result(), Some(true));
        assert_eq!(ProbeState::new(Kind::Startup).result(), None);
    }

    #[test]
    fn thresholds_gate_result_changes() {
        let s = spec(2, 3);
        let mut r = ProbeState::new(Kind::Readiness);
        // (probe success, published change)
        for (i, (ok, want)) in [
            (true, None),
            (true, Some(true)),
            (true, None),
            (false, None),
            (false, None),
            (true, None),
            (false, None),
            (false, None),
            (false, Some(false)),
            (false, None),
            (true, None),
            (true, Some(true)),
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(r.observe(ok, &s), want, "probe {i}");
        }
    }

    #[test]
    fn a_liveness_failure_counts_afresh_afterwards() {
        let s = spec(1, 2);
        let mut l = ProbeState::new(Kind::Liveness);
        assert_eq!(l.observe(false, &s), None);
        assert_eq!(l.observe(false, &s), Some(false));
        assert_eq!(
            l.observe(false, &s),
            None,
            "one failure after a reset is below the threshold"
        );
        let mut st = ProbeState::new(Kind::Startup);
        assert_eq!(st.observe(true, &s), Some(true));
    }

    #[test]
    fn api_probes_get_defaults() {
        let p: Probe = serde_json::from_value(serde_json::json!({"grpc": {"port": 50051}})).unwrap();
        let s = Spec::from_api(Kind::Liveness, &p).unwrap();
        assert_eq!(
            (s.period, s.timeout, s.success_threshold, s.failure_threshold),
            (Duration::from_secs(10), Duration::from_secs(1), 1, 3)
        );
        assert_eq!(
            s.action,
            Action::Grpc {
                port: 50051,
                service: String::new()
            }
        );
        let p: Probe =
            serde_json::from_value(serde_json::json!({"successThreshold": 4, "exec": {"command": ["true"]}}))
                .unwrap();
        assert_eq!(Spec::from_api(Kind::Liveness, &p).unwrap().success_threshold, 1);
        assert_eq!(Spec::from_api(Kind::Readiness, &p).unwrap().success_threshold, 4);
        assert!(Spec::from_api(Kind::Readiness, &Probe::default()).is_err());
    }

    #[test]
    fn named_ports_resolve_against_the_container() {
        let t = Target {
            pod_ip: "127.1.2.3".parse().unwrap(),
            ports: vec![ContainerPort {
                name: Some("http".into()),
                container_port: 8888,
                ..ContainerPort::default()
            }],
        };
        assert_eq!(t.port(&IntOrString::String("http".into())), Ok(8888));
        assert_eq!(t.port(&IntOrString::String("9090".into())), Ok(9090));
        assert!(t.port(&IntOrString::String("grpc".into())).is_err());
        assert_eq!(t.addr(None, 1).unwrap().to_string(), "127.1.2.3:1");
    }
}
