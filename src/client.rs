//! The typed `skipper.ControllerService` client, used by routers and by
//! controllers to reach their peers.
//!
//! What lives here:
//! - [`RETRY_POLICIES`]: the per-method retry table of the wire contract
//!   (retry only `UNAVAILABLE`, randomised exponential backoff as the gRPC
//!   retry design describes). `backon` computes the schedule; the choice of
//!   retry crate stays inside this module.
//! - [`Endpoints`]: a set of controller addresses that discovery (DNS
//!   re-resolution, EndpointSlice watches) replaces at run time. Calls are
//!   spread round-robin over it; each address has one lazily connected
//!   channel that is kept while the address stays in the set. An address
//!   that refused a connection is skipped for [`UNREACHABLE_HOLD`] (unless
//!   every address is), and a call whose connection failed goes at once to
//!   the next address it has not tried: nothing reached a controller, so
//!   this is not a retry and costs none of the method's attempts.
//! - [`Client`]: one method per RPC, each with a caller-supplied deadline
//!   that bounds the whole call, retries included.
//! - Access: each address remembers whether its controller last refused
//!   the caller's credentials (`UNAUTHENTICATED`, `PERMISSION_DENIED`) or
//!   answered; [`Endpoints::refusal`] says when every controller refuses,
//!   and [`Client::check_access`] asks the refusing ones again with a call
//!   that changes nothing.
//!
//! Nothing here knows about routing or supervisors.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use tokio::sync::{Notify, watch};
use tonic::transport::{Channel, Endpoint};

use tracing::Instrument as _;

use crate::api;
use crate::api::controller_service_client::ControllerServiceClient;
use crate::credentials::Credentials;
use crate::domain::{ASSIGN_TIMING_METADATA, AssignTiming};
use crate::telemetry::otel;

/// The transport of every call: a channel whose requests carry the
/// caller's credentials.
pub type Transport = tonic::service::interceptor::InterceptedService<Channel, Credentials>;

/// An RPC of `skipper.ControllerService`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    GetInstance,
    Heartbeat,
    Scale,
    ReleaseInstance,
    GetClusterState,
    WatchInstances,
}

impl Method {
    /// The method name as it appears in the gRPC path.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::GetInstance => "GetInstance",
            Self::Heartbeat => "Heartbeat",
            Self::Scale => "Scale",
            Self::ReleaseInstance => "ReleaseInstance",
            Self::GetClusterState => "GetClusterState",
            Self::WatchInstances => "WatchInstances",
        }
    }

    /// The retry policy of this method ([`RetryPolicy::NONE`] when the table
    /// has no entry).
    #[must_use]
    pub fn retry_policy(self) -> RetryPolicy {
        RETRY_POLICIES
            .iter()
            .find(|(m, _)| *m == self)
            .map_or(RetryPolicy::NONE, |(_, p)| *p)
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How one method is retried: only `UNAVAILABLE` is retried, up to
/// `max_attempts` attempts in total, waiting a uniformly random time in
/// `[0, min(initial_backoff * multiplier^(n-1), max_backoff)]` before retry `n`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first included (1 = no retry).
    pub max_attempts: usize,
    /// Cap on the backoff before the first retry.
    pub initial_backoff: Duration,
    /// Cap on any backoff.
    pub max_backoff: Duration,
    /// Growth of the cap per retry.
    pub multiplier: f32,
}

impl RetryPolicy {
    /// No retries.
    pub const NONE: Self = Self {
        max_attempts: 1,
        initial_backoff: Duration::ZERO,
        max_backoff: Duration::ZERO,
        multiplier: 1.0,
    };

    /// The deterministic backoff caps, one per retry (the jitter is applied
    /// on top when the retry happens).
    fn schedule(self) -> ExponentialBuilder {
        ExponentialBuilder::new()
            .with_min_delay(self.initial_backoff)
            .with_max_delay(self.max_backoff)
            .with_factor(self.multiplier)
            .with_max_times(self.max_attempts.saturating_sub(1))
    }

    /// The caps this policy waits under before each retry, in order.
    #[must_use]
    pub fn backoff_caps(self) -> Vec<Duration> {
        self.schedule().build().collect()
    }
}

/// The per-method retry table (spec §2.5). `GetClusterState` is not retried;
/// neither is `WatchInstances` (the subscriber re-subscribes itself).
pub const RETRY_POLICIES: &[(Method, RetryPolicy)] = &[
    (
        Method::GetInstance,
        RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
            multiplier: 2.0,
        },
    ),
    (
        Method::Heartbeat,
        RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            multiplier: 2.0,
        },
    ),
    (
        Method::Scale,
        RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            multiplier: 2.0,
        },
    ),
    (
        Method::ReleaseInstance,
        RetryPolicy {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
            multiplier: 2.0,
        },
    ),
];

/// Uniform in `[0, cap]` (the gRPC retry design's randomised backoff).
fn full_jitter(cap: Duration) -> Duration {
    // Nanosecond counts of retry caps fit in u64 by a wide margin.
    let nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::random_range(0..=nanos))
}

/// A failed call. Cloned when several requests await one call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Discovery currently knows no controller address.
    #[error("failed to call {method}: no controller endpoints known")]
    NoEndpoints { method: Method },
    /// The controller answered with a gRPC error (after the retries the
    /// method's policy allows). The status is part of the message.
    #[error("failed to call {method}: {}: {}", .status.code(), .status.message())]
    Rpc {
        method: Method,
        status: Box<tonic::Status>,
    },
    /// The caller's deadline passed before an answer arrived.
    #[error("failed to call {method}: deadline of {deadline:?} exceeded")]
    DeadlineExceeded { method: Method, deadline: Duration },
}

impl Error {
    /// The gRPC code this failure amounts to (`UNAVAILABLE` when no endpoint
    /// is known, `DEADLINE_EXCEEDED` on the caller's deadline).
    #[must_use]
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::NoEndpoints { .. } => tonic::Code::Unavailable,
            Self::Rpc { status, .. } => status.code(),
            Self::DeadlineExceeded { .. } => tonic::Code::DeadlineExceeded,
        }
    }
}

/// Result of a client call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How long an address whose connection failed is skipped by
/// [`Endpoints`] (while another address is not). The first call after it
/// probes the address again.
pub const UNREACHABLE_HOLD: Duration = Duration::from_secs(1);

/// One controller address with its lazily connected channel.
#[derive(Debug, Clone)]
struct Target {
    addr: SocketAddr,
    channel: Channel,
    /// Until when the address is skipped after a failed connection (shared
    /// by the clones of this target; kept while the address stays).
    unreachable_until: Arc<Mutex<Option<tokio::time::Instant>>>,
    /// The controller's last word on the caller's credentials: why it
    /// refused them, or `None` once it answered otherwise (or before it was
    /// asked).
    refused: Arc<Mutex<Option<String>>>,
}

impl Target {
    fn reachable(&self, now: tokio::time::Instant) -> bool {
        self.unreachable_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|until| now >= until)
    }

    fn mark_unreachable(&self) {
        *self
            .unreachable_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(tokio::time::Instant::now() + UNREACHABLE_HOLD);
    }

    /// Records what the controller's answer says about the credentials: a
    /// refusal, or (any other answer from the controller itself) that they
    /// were admitted. A failed connection says nothing.
    fn record_access(&self, answer: &Result<(), &tonic::Status>) {
        let verdict = match answer {
            Ok(()) => None,
            Err(status) if is_credentials_refusal(status.code()) => {
                Some(format!("{:?}: {}", status.code(), status.message()))
            }
            // No word from the controller itself: a failed connection, a
            // transport error, a call cut short.
            Err(status)
                if is_connect_failure(status)
                    || matches!(
                        status.code(),
                        tonic::Code::Unavailable
                            | tonic::Code::Cancelled
                            | tonic::Code::DeadlineExceeded
                            | tonic::Code::Unknown
                    ) =>
            {
                return;
            }
            Err(_) => None,
        };
        *self.refused.lock().unwrap_or_else(PoisonError::into_inner) = verdict;
    }

    fn refused(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Whether `code` is a controller refusing the caller's credentials.
#[must_use]
pub fn is_credentials_refusal(code: tonic::Code) -> bool {
    matches!(code, tonic::Code::Unauthenticated | tonic::Code::PermissionDenied)
}

/// Whether `status` is a failure to connect to the controller (nothing was
/// sent), rather than an answer or a broken call.
fn is_connect_failure(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// Connection settings applied to every channel.
#[derive(Debug, Clone, Copy)]
pub struct ChannelSettings {
    /// Bound on establishing a TCP connection to a controller.
    pub connect_timeout: Duration,
    /// HTTP/2 ping period while a call is open, and how long a ping may go
    /// unanswered before the connection counts as dead: a long-lived
    /// `WatchInstances` stream to a controller that vanished without a
    /// word ends within their sum.
    pub keepalive: (Duration, Duration),
}

impl Default for ChannelSettings {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            keepalive: (Duration::from_secs(15), Duration::from_secs(20)),
        }
    }
}

/// The controller addresses calls are spread over, replaceable at run time.
///
/// Cloning shares the set. Discovery calls [`Endpoints::replace`];
/// [`Endpoints::failures`] wakes discovery when a call found a controller
/// unreachable so it can re-resolve early.
#[derive(Debug, Clone)]
pub struct Endpoints {
    targets: Arc<watch::Sender<Arc<[Target]>>>,
    next: Arc<AtomicUsize>,
    failure: Arc<Notify>,
    settings: ChannelSettings,
    credentials: Credentials,
}

impl Endpoints {
    /// An empty set (calls fail with [`Error::NoEndpoints`] until
    /// [`Endpoints::replace`] gives addresses).
    #[must_use]
    pub fn new(settings: ChannelSettings) -> Self {
        let (tx, _) = watch::channel(Arc::from(Vec::new()));
        Self {
            targets: Arc::new(tx),
            next: Arc::new(AtomicUsize::new(0)),
            failure: Arc::new(Notify::new()),
            settings,
            credentials: Credentials::none(),
        }
    }

    /// The same set, presenting `credentials` on every call.
    #[must_use]
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// A client of `target` presenting this set's credentials.
    fn client(&self, target: Target) -> ControllerServiceClient<Transport> {
        ControllerServiceClient::with_interceptor(target.channel, self.credentials.clone())
    }

    /// A set holding `addrs`.
    #[must_use]
    pub fn fixed(addrs: &[SocketAddr], settings: ChannelSettings) -> Self {
        let e = Self::new(settings);
        e.replace(addrs);
        e
    }

    /// Replaces the address set. Channels of addresses that stay are kept
    /// (and so is an address's unreachable mark: discovery may list a
    /// controller that is gone for a while); new addresses get a channel
    /// that connects on first use.
    pub fn replace(&self, addrs: &[SocketAddr]) {
        let current = self.targets.borrow().clone();
        let mut old: HashMap<SocketAddr, Target> = current.iter().map(|t| (t.addr, t.clone())).collect();
        let next: Vec<Target> = addrs
            .iter()
            .map(|&addr| {
                old.remove(&addr).unwrap_or_else(|| Target {
                    addr,
                    channel: self.channel(addr),
                    unreachable_until: Arc::default(),
                    refused: Arc::default(),
                })
            })
            .collect();
        self.targets.send_replace(Arc::from(next));
    }

    /// The current addresses, in order.
    #[must_use]
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.targets.borrow().iter().map(|t| t.addr).collect()
    }

    /// Resolves once the address set satisfies `pred` (checked now and on
    /// every replacement). Callers bound the wait.
    pub async fn wait_until(&self, mut pred: impl FnMut(&[SocketAddr]) -> bool) {
        let mut rx = self.targets.subscribe();
        let _ = rx
            .wait_for(|t| pred(&t.iter().map(|x| x.addr).collect::<Vec<_>>()))
            .await;
    }

    /// Why every known controller refuses the caller's credentials, when
    /// each of them did so the last time it was asked (`None` while any
    /// admitted them, was not asked yet, or none is known).
    #[must_use]
    pub fn refusal(&self) -> Option<String> {
        let targets = self.targets.borrow().clone();
        let mut reasons: Vec<String> = Vec::with_capacity(targets.len());
        for t in targets.iter() {
            reasons.push(t.refused()?);
        }
        reasons.dedup();
        let first = reasons.first()?;
        Some(match targets.len() {
            1 => format!(
                "the controller at {} refuses this caller's credentials ({first})",
                targets[0].addr
            ),
            n => format!("all {n} controllers refuse this caller's credentials ({first})"),
        })
    }

    /// Whether any controller refused the caller's credentials last time.
    #[must_use]
    pub fn any_refused(&self) -> bool {
        self.targets.borrow().iter().any(|t| t.refused().is_some())
    }

    /// Notified each time a call finds a controller unavailable.
    #[must_use]
    pub fn failures(&self) -> Arc<Notify> {
        self.failure.clone()
    }

    fn channel(&self, addr: SocketAddr) -> Channel {
        let uri = format!("http://{addr}");
        // A `http://<socket address>` URI is always valid; `from_shared` only
        // rejects malformed URIs.
        #[allow(clippy::expect_used)]
        let endpoint = Endpoint::from_shared(uri).expect("socket address URI");
        endpoint
            .connect_timeout(self.settings.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(self.settings.keepalive.0)
            .keep_alive_timeout(self.settings.keepalive.1)
            .connect_lazy()
    }

    /// The next target, round-robin, skipping addresses marked unreachable
    /// while another one is not.
    fn pick(&self) -> Option<Target> {
        self.pick_other(&[])
    }

    /// As [`Endpoints::pick`], never one of `tried` (`None` when every
    /// address was tried).
    fn pick_other(&self, tried: &[SocketAddr]) -> Option<Target> {
        let targets = self.targets.borrow().clone();
        let untried: Vec<&Target> = targets.iter().filter(|t| !tried.contains(&t.addr)).collect();
        if untried.is_empty() {
            return None;
        }
        let now = tokio::time::Instant::now();
        let reachable: Vec<&Target> = untried.iter().copied().filter(|t| t.reachable(now)).collect();
        let from = if reachable.is_empty() {
            &untried
        } else {
            &reachable
        };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % from.len();
        Some(from[i].clone())
    }
}

/// The typed `ControllerService` client. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    endpoints: Endpoints,
}

impl Client {
    /// A client spreading calls over `endpoints`.
    #[must_use]
    pub fn new(endpoints: Endpoints) -> Self {
        Self { endpoints }
    }

    /// The endpoint set this client uses.
    #[must_use]
    pub fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    /// Asks for a ready instance of a function (retried per the method's
    /// policy).
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get_instance(
        &self,
        req: api::GetInstanceRequest,
        deadline: Duration,
    ) -> Result<api::GetInstanceResponse> {
        self.call(
            Method::GetInstance,
            Method::GetInstance.retry_policy(),
            deadline,
            req,
            |mut c, r| async move { c.get_instance(r).await },
        )
        .await
        .map(|(r, _)| r)
    }

    /// One `GetInstance` attempt, never retried here: for a caller whose
    /// own loop retries (the router's, which also excludes the instances
    /// that failed), so that loop stays the only one.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get_instance_once(
        &self,
        req: api::GetInstanceRequest,
        deadline: Duration,
    ) -> Result<api::GetInstanceResponse> {
        self.get_instance_once_timed(req, deadline).await.map(|(r, _)| r)
    }

    /// As [`Client::get_instance_once`], with the timing of the assignment
    /// the call made, if it assigned a pod.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get_instance_once_timed(
        &self,
        req: api::GetInstanceRequest,
        deadline: Duration,
    ) -> Result<(api::GetInstanceResponse, Option<AssignTiming>)> {
        let (resp, metadata) = self
            .call(
                Method::GetInstance,
                RetryPolicy::NONE,
                deadline,
                req,
                |mut c, r| async move { c.get_instance(r).await },
            )
            .await?;
        let timing = metadata
            .get(ASSIGN_TIMING_METADATA)
            .and_then(|v| v.to_str().ok())
            .and_then(AssignTiming::decode);
        Ok((resp, timing))
    }

    /// Opens a `WatchInstances` stream on the next controller: `requests`
    /// is the router's half (the subscription first), the answer the
    /// controller's. One attempt; `deadline` bounds only the wait for the
    /// stream to open.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn watch_instances<S>(
        &self,
        requests: S,
        deadline: Duration,
    ) -> Result<tonic::Streaming<api::WatchInstancesResponse>>
    where
        S: futures::Stream<Item = api::WatchInstancesRequest> + Send + 'static,
    {
        let method = Method::WatchInstances;
        let target = self.endpoints.pick().ok_or(Error::NoEndpoints { method })?;
        let mut client = self.endpoints.client(target.clone());
        match tokio::time::timeout(deadline, client.watch_instances(tonic::Request::new(requests))).await {
            Ok(Ok(resp)) => {
                target.record_access(&Ok(()));
                Ok(resp.into_inner())
            }
            Ok(Err(status)) => {
                target.record_access(&Err(&status));
                if is_connect_failure(&status) {
                    target.mark_unreachable();
                }
                if status.code() == tonic::Code::Unavailable {
                    self.endpoints.failure.notify_one();
                }
                Err(Error::Rpc {
                    method,
                    status: Box::new(status),
                })
            }
            Err(_) => Err(Error::DeadlineExceeded { method, deadline }),
        }
    }

    /// Sends a batch of heartbeats. An empty batch sends nothing.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn heartbeat(
        &self,
        req: api::HeartbeatRequest,
        deadline: Duration,
    ) -> Result<api::HeartbeatResponse> {
        if req.heartbeats.is_empty() {
            return Ok(api::HeartbeatResponse {});
        }
        self.call(
            Method::Heartbeat,
            Method::Heartbeat.retry_policy(),
            deadline,
            req,
            |mut c, r| async move { c.heartbeat(r).await },
        )
        .await
        .map(|(r, _)| r)
    }

    /// Scales a function on its ring owner.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn scale(&self, req: api::ScaleRequest, deadline: Duration) -> Result<api::ScaleResponse> {
        self.call(
            Method::Scale,
            Method::Scale.retry_policy(),
            deadline,
            req,
            |mut c, r| async move { c.scale(r).await },
        )
        .await
        .map(|(r, _)| r)
    }

    /// Releases (deletes) an instance.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn release_instance(
        &self,
        req: api::ReleaseInstanceRequest,
        deadline: Duration,
    ) -> Result<api::ReleaseInstanceResponse> {
        self.call(
            Method::ReleaseInstance,
            Method::ReleaseInstance.retry_policy(),
            deadline,
            req,
            |mut c, r| async move { c.release_instance(r).await },
        )
        .await
        .map(|(r, _)| r)
    }

    /// Fetches a controller's state snapshot.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get_cluster_state(
        &self,
        req: api::GetClusterStateRequest,
        deadline: Duration,
    ) -> Result<api::GetClusterStateResponse> {
        self.call(
            Method::GetClusterState,
            Method::GetClusterState.retry_policy(),
            deadline,
            req,
            |mut c, r| async move { c.get_cluster_state(r).await },
        )
        .await
        .map(|(r, _)| r)
    }

    /// Asks every controller that last refused the caller's credentials
    /// again, with a call each controller rejects without acting on it once
    /// it admits the caller (a `Heartbeat` naming no router:
    /// `INVALID_ARGUMENT`), so its verdict on the credentials is current.
    /// Bounded by `deadline` per controller.
    pub async fn check_access(&self, deadline: Duration) {
        let targets = self.endpoints.targets.borrow().clone();
        let probes = targets
            .iter()
            .filter(|t| t.refused().is_some())
            .map(|t| async move {
                let mut request = tonic::Request::new(api::HeartbeatRequest::default());
                request.set_timeout(deadline);
                let mut client = self.endpoints.client(t.clone());
                if let Ok(answer) = tokio::time::timeout(deadline, client.heartbeat(request)).await {
                    t.record_access(&answer.as_ref().map(|_| ()));
                }
            });
        futures::future::join_all(probes).await;
    }

    /// One call: attempts per `policy`, each on the next endpoint, all
    /// inside `deadline`; the answer and its metadata. An attempt whose
    /// connection fails marks that address unreachable and goes on to the
    /// next address it has not tried (nothing was sent). With traces on,
    /// every exchange is a client span whose context travels in the
    /// request's metadata.
    async fn call<Req, Resp, F, Fut>(
        &self,
        method: Method,
        policy: RetryPolicy,
        deadline: Duration,
        req: Req,
        rpc: F,
    ) -> Result<(Resp, tonic::metadata::MetadataMap)>
    where
        Req: Clone,
        F: Fn(ControllerServiceClient<Transport>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let end = tokio::time::Instant::now() + deadline;
        let attempt = || async {
            let mut tried: Vec<SocketAddr> = Vec::new();
            let mut target = self.endpoints.pick().ok_or(Error::NoEndpoints { method })?;
            loop {
                let mut request = tonic::Request::new(req.clone());
                request.set_timeout(end.saturating_duration_since(tokio::time::Instant::now()));
                let span = rpc_span(method, target.addr);
                span.in_scope(|| otel::inject_grpc(request.metadata_mut()));
                let answer = rpc(self.endpoints.client(target.clone()), request)
                    .instrument(span.clone())
                    .await;
                let code = match &answer {
                    Ok(_) => tonic::Code::Ok,
                    Err(status) => status.code(),
                };
                target.record_access(&answer.as_ref().map(|_| ()));
                span.record("rpc.grpc.status_code", code as i32);
                if code != tonic::Code::Ok {
                    span.record("otel.status_code", "ERROR");
                }
                let status = match answer {
                    Ok(resp) => {
                        let (metadata, body, _) = resp.into_parts();
                        return Ok((body, metadata));
                    }
                    Err(_) if tokio::time::Instant::now() >= end => {
                        return Err(Error::DeadlineExceeded { method, deadline });
                    }
                    Err(status) => status,
                };
                if status.code() == tonic::Code::Unavailable {
                    self.endpoints.failure.notify_one();
                }
                if is_connect_failure(&status) {
                    target.mark_unreachable();
                    tried.push(target.addr);
                    if let Some(next) = self.endpoints.pick_other(&tried) {
                        tracing::debug!(%method, unreachable = %target.addr, next = %next.addr, "controller unreachable; trying the next one");
                        target = next;
                        continue;
                    }
                }
                return Err(Error::Rpc {
                    method,
                    status: Box::new(status),
                });
            }
        };
        let retried = attempt
            .retry(policy.schedule())
            .when(|e: &Error| e.code() == tonic::Code::Unavailable)
            .adjust(|_, cap| cap.map(full_jitter));
        match tokio::time::timeout_at(end, retried).await {
            Ok(result) => result,
            Err(_) => Err(Error::DeadlineExceeded { method, deadline }),
        }
    }
}

/// The client span of one attempt (`skipper.ControllerService/<Method>`);
/// disabled when traces are off.
fn rpc_span(method: Method, server: SocketAddr) -> tracing::Span {
    if !otel::enabled() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "grpc.client",
        otel.name = %format_args!("skipper.ControllerService/{}", method.name()),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "skipper.ControllerService",
        rpc.method = method.name(),
        server.address = %server,
        rpc.grpc.status_code = tracing::field::Empty,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_retried_method_has_one_policy() {
        for m in [
            Method::GetInstance,
            Method::Heartbeat,
            Method::Scale,
            Method::ReleaseInstance,
        ] {
            assert_eq!(RETRY_POLICIES.iter().filter(|(x, _)| *x == m).count(), 1);
        }
        assert_eq!(Method::GetClusterState.retry_policy(), RetryPolicy::NONE);
    }

    #[test]
    fn backoff_caps_grow_by_the_multiplier_up_to_the_maximum() {
        let ms = |p: RetryPolicy| -> Vec<u128> {
            p.backoff_caps()
                .iter()
                .map(|d| (d.as_micros() + 500) / 1000)
                .collect()
        };
        assert_eq!(ms(Method::GetInstance.retry_policy()), vec![10, 20]);
        assert_eq!(ms(Method::Heartbeat.retry_policy()), vec![10]);
        assert_eq!(ms(Method::Scale.retry_policy()), vec![50, 100]);
        let long = RetryPolicy {
            max_attempts: 6,
            ..Method::GetInstance.retry_policy()
        };
        assert_eq!(ms(long), vec![10, 20, 40, 80, 100]);
        assert!(RetryPolicy::NONE.backoff_caps().is_empty());
    }

    #[test]
    fn jitter_stays_within_zero_and_the_cap() {
        let cap = Duration::from_millis(50);
        for _ in 0..1000 {
            assert!(full_jitter(cap) <= cap);
        }
        assert_eq!(full_jitter(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn replacing_endpoints_keeps_order_and_round_robins() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let e = Endpoints::new(ChannelSettings::default());
            assert!(e.pick().is_none());
            e.replace(&[a, b]);
            assert_eq!(e.addrs(), vec![a, b]);
            let picks: Vec<_> = (0..4).map(|_| e.pick().unwrap().addr).collect();
            assert_eq!(picks, vec![a, b, a, b]);
            e.replace(&[b]);
            assert_eq!(e.pick().unwrap().addr, b);
        });
    }

    #[test]
    fn an_unreachable_address_is_skipped_for_the_hold_unless_all_are() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let e = Endpoints::fixed(&[a, b], ChannelSettings::default());
            let first = e.pick().unwrap();
            assert_eq!(first.addr, a);
            first.mark_unreachable();
            assert!((0..4).all(|_| e.pick().unwrap().addr == b));
            // Discovery listing `a` again keeps the mark.
            e.replace(&[a, b]);
            assert!((0..4).all(|_| e.pick().unwrap().addr == b));
            // Never one already tried in this call.
            assert_eq!(e.pick_other(&[b]).unwrap().addr, a);
            assert!(e.pick_other(&[a, b]).is_none());
            // Every address unreachable: round-robin over all of them.
            e.pick_other(&[a]).unwrap().mark_unreachable();
            let picks: std::collections::HashSet<_> = (0..4).map(|_| e.pick().unwrap().addr).collect();
            assert_eq!(picks.len(), 2);
            // After the hold, both are candidates again.
            tokio::time::advance(UNREACHABLE_HOLD).await;
            e.replace(&[a, b]);
            let picks: std::collections::HashSet<_> = (0..4).map(|_| e.pick().unwrap().addr).collect();
            assert_eq!(picks.len(), 2);
            // A fresh address set forgets the mark of an address that left.
            e.pick_other(&[b]).unwrap().mark_unreachable();
            e.replace(&[b]);
            e.replace(&[a, b]);
            let picks: std::collections::HashSet<_> = (0..4).map(|_| e.pick().unwrap().addr).collect();
            assert_eq!(picks.len(), 2);
        });
    }
}
