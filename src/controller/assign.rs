//! Assigning a pool pod to a function (spec §3.1–3.3, §4.4–4.5): pick a
//! Running and Ready unassigned pod, claim it with the JSON Patch, wait for
//! the pod store to show a new pool pod when the pool is empty (woken by the
//! watch, bounded by the caller's deadline), POST the assign path with a
//! token bound to that pod (name, UID, a fresh `jti`), delete the pod when that fails, and mark the instance ready
//! in memory at once while `skipper/ready-at` is patched in the background
//! ([`READY_AT_PATCH_DELAY`] later).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use rand::seq::IndexedRandom;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::events;
use super::kube::pods::WriteError;
use super::kube::stores::Namespace;
use super::kube::{Instance, InvalidPod, format_time, is_ready, join_addr, pod_port};
use super::metrics::{AssignFailureLabels, Metrics};
use crate::api::{EventSeverity, EventType};
use crate::domain::{ANNOTATION_REPLICA_SET, AssignTiming, Function, HEADER_FUNCTION, HEADER_TOKEN};
use crate::shutdown::Shutdown;
use crate::telemetry::otel;
use crate::token::{BOUND_TOKEN_LIFETIME, PodRef, SigningKey, TokenError, Version};

/// Consecutive failed assignments of one deployment after which it backs
/// off.
pub const FAILURES_BEFORE_BACKOFF: u32 = 3;
/// First back-off period; it doubles with every further failure.
pub const BACKOFF_MIN: Duration = Duration::from_secs(2);
/// Longest back-off period.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Longest part of a pod's answer quoted in errors and events.
const MAX_QUOTED_BODY: usize = 256;
/// How long after an assignment its `skipper/ready-at` patch is sent. The
/// instance is ready in this controller's memory at once; the patch is
/// bookkeeping for other readers (peers after a ring change, the UI), and
/// sent at once it competes for CPU with the instance's first request on
/// this controller, the API server and, on a small node, the pod and the
/// router (a cold start's median through the router 4.7-4.8 ms against
/// 5.5 ms on the playground). Other readers see the pod unready this much
/// longer (spec edge case 46).
pub const READY_AT_PATCH_DELAY: Duration = Duration::from_millis(100);
/// Pods answering "already assigned" (409) one assignment deletes and moves
/// past before it gives up: each is evidence against that pod only, so none
/// counts toward the deployment's back-off.
pub const MAX_ALREADY_ASSIGNED: usize = 8;

/// Why the assign request to a claimed pod failed (the pod is deleted).
#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("{0}")]
    Port(#[source] InvalidPod),
    #[error("failed to sign the assignment token: {0}")]
    Sign(#[source] TokenError),
    #[error("failed to build assign request: {0}")]
    Build(#[source] http::Error),
    #[error("failed to send assign request: {0}")]
    Send(#[source] hyper_util::client::legacy::Error),
    #[error("failed to send assign request: timed out after {0:?}")]
    Timeout(Duration),
    #[error("assign request failed: status={status} body={body}")]
    Refused { status: u16, body: String },
}

/// The status a pod answers when it already serves a tenant.
const ALREADY_ASSIGNED: u16 = 409;

impl PostError {
    /// `(status, reason)` labels of the failure metric (a fixed set).
    fn labels(&self) -> (String, &'static str) {
        match self {
            Self::Refused { status, .. } if *status == ALREADY_ASSIGNED => {
                (status.to_string(), "already-assigned")
            }
            Self::Refused { status, .. } => (status.to_string(), "refused"),
            Self::Timeout(_) => ("none".into(), "timeout"),
            Self::Send(_) => ("none".into(), "unreachable"),
            Self::Port(_) | Self::Build(_) => ("none".into(), "invalid-pod"),
            Self::Sign(_) => ("none".into(), "signing"),
        }
    }

    /// Whether the pod said it already serves a tenant: evidence against
    /// that pod, not against its deployment.
    fn already_assigned(&self) -> bool {
        matches!(self, Self::Refused { status, .. } if *status == ALREADY_ASSIGNED)
    }
}

/// Why a claimed pod did not become an instance.
#[derive(Debug, thiserror::Error)]
pub enum AssignError {
    /// The assign request failed (the pod is deleted).
    #[error(transparent)]
    Post(#[from] PostError),
    /// The pod accepted but cannot be read as an instance.
    #[error(transparent)]
    Instance(#[from] InvalidPod),
}

/// Why an assignment produced no instance ([`super::error`] gives each its
/// gRPC code).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no unassigned pod of deployment {namespace}/{deployment} became available before the deadline")]
    NoPoolPod { namespace: String, deployment: String },
    #[error("failed to assign pod {pod}: {source}")]
    AssignFailed {
        pod: String,
        #[source]
        source: AssignError,
    },
    #[error(
        "deployment {namespace}/{deployment} is backing off after {failures} consecutive failed assignments; next attempt in {retry_in:?}; last: {last}"
    )]
    AssignBackoff {
        namespace: String,
        deployment: String,
        failures: u32,
        retry_in: Duration,
        last: String,
    },
    /// The claim's write failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// Consecutive failures of one deployment's assignments.
#[derive(Debug, Default)]
struct Streak {
    failures: u32,
    until: Option<Instant>,
    /// An attempt after the back-off is in progress; others wait for it.
    probing: bool,
    last: String,
    /// ReplicaSets whose pods failed: a Ready pool pod of any other one
    /// (a rollout, say with the right key) ends the back-off.
    replica_sets: HashSet<String>,
}

/// The deployment's back-off ended because a ReplicaSet none of whose pods
/// failed has Ready pool pods.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ended {
    replica_set: String,
    failures: u32,
}

type Key = (String, String);

/// Per-deployment back-off after consecutive failed assignments. Keys are
/// deployments that exist (functions are admitted first); an entry lives
/// only while its deployment keeps failing.
#[derive(Debug, Default)]
struct Backoff {
    // A std mutex: lookups and counter updates only, never across an await.
    streaks: Mutex<HashMap<Key, Streak>>,
}

/// The right to attempt an assignment; ends a probe when dropped.
struct Attempt<'a> {
    backoff: &'a Backoff,
    key: Key,
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.backoff.lock().get_mut(&self.key) {
            s.probing = false;
        }
    }
}

impl Backoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Streak>> {
        self.streaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether an assignment for `key` may go ahead now: outside a back-off,
    /// as the single attempt once it has passed, or because `fresh` names a
    /// ReplicaSet with Ready pool pods that is not among the failed ones
    /// (the cause may be gone: the back-off ends, and [`Ended`] says so).
    fn attempt(
        &self,
        key: Key,
        now: Instant,
        fresh: impl FnOnce(&HashSet<String>) -> Option<String>,
    ) -> Result<(Attempt<'_>, Option<Ended>), Error> {
        let mut streaks = self.lock();
        let mut ended = None;
        if let Some(s) = streaks.get_mut(&key)
            && let Some(until) = s.until
        {
            if now < until || s.probing {
                if let Some(replica_set) = fresh(&s.replica_sets) {
                    ended = Some(Ended {
                        replica_set,
                        failures: s.failures,
                    });
                } else {
                    return Err(Error::AssignBackoff {
                        namespace: key.0,
                        deployment: key.1,
                        failures: s.failures,
                        retry_in: until.saturating_duration_since(now).max(Duration::from_secs(1)),
                        last: s.last.clone(),
                    });
                }
            } else {
                s.probing = true;
            }
        }
        if ended.is_some() {
            streaks.remove(&key);
        }
        drop(streaks);
        Ok((Attempt { backoff: self, key }, ended))
    }

    /// Records a failure of a pod of `replica_set`; returns the back-off it
    /// starts, if any.
    fn failed(&self, key: &Key, replica_set: Option<&str>, reason: String, now: Instant) -> Option<Duration> {
        let mut streaks = self.lock();
        let s = streaks.entry(key.clone()).or_default();
        s.failures = s.failures.saturating_add(1);
        s.last = reason;
        if let Some(rs) = replica_set {
            s.replica_sets.insert(rs.to_owned());
        }
        if s.failures < FAILURES_BEFORE_BACKOFF {
            return None;
        }
        let doublings = (s.failures - FAILURES_BEFORE_BACKOFF).min(16);
        let period = BACKOFF_MIN.saturating_mul(1 << doublings).min(BACKOFF_MAX);
        s.until = Some(now + period);
        Some(period)
    }

    /// Whether an assignment for `namespace/deployment` would be refused at
    /// `now` unless a fresh ReplicaSet ends the back-off
    /// ([`Backoff::attempt`]). The map holds only failing deployments.
    fn is_backing_off(&self, namespace: &str, deployment: &str, now: Instant) -> bool {
        self.lock().iter().any(|((ns, d), s)| {
            ns == namespace && d == deployment && s.until.is_some_and(|until| now < until || s.probing)
        })
    }

    /// The ReplicaSets whose pods failed in the current streak of
    /// `namespace/deployment` (none when its last assignment succeeded).
    fn failed_replica_sets(&self, namespace: &str, deployment: &str) -> HashSet<String> {
        self.lock()
            .iter()
            .find(|((ns, d), _)| ns == namespace && d == deployment)
            .map(|(_, s)| s.replica_sets.clone())
            .unwrap_or_default()
    }

    /// Ends the streak; whether one was backing off.
    fn succeeded(&self, key: &Key) -> bool {
        self.lock().remove(key).is_some_and(|s| s.until.is_some())
    }
}

/// A Ready, claimable pool pod of `ns`'s `deployment` owned by a ReplicaSet
/// not in `failed`: the ReplicaSet's name.
fn fresh_replica_set(ns: &Namespace, deployment: &str, failed: &HashSet<String>) -> Option<String> {
    if failed.is_empty() {
        return None;
    }
    candidates(ns, deployment)
        .into_iter()
        .find(|c| !failed.contains(&c.replica_set))
        .map(|c| c.replica_set)
}

/// A pool pod a claim may take, with what ranks it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Candidate {
    name: String,
    replica_set: String,
    /// When its ReplicaSet was created (`None` while the ReplicaSet is not
    /// in the cache yet).
    born: Option<jiff::Timestamp>,
}

/// The pool pods of `ns`'s `deployment` a claim may take: Ready, owned by a
/// ReplicaSet, and not of a ReplicaSet a rollout scaled to zero. That
/// ReplicaSet's pods are being deleted (a claim races the deletion, and the
/// assign request may find the pod gone), and an instance on one would be
/// stale at once. Both this and staleness read the same ReplicaSet cache.
fn candidates(ns: &Namespace, deployment: &str) -> Vec<Candidate> {
    candidates_of(&ns.pods.pool(deployment), |name| ns.replica_sets.get(name))
}

/// [`candidates`] among `pool`, with the ReplicaSet cache's `replica_set`.
fn candidates_of(pool: &[Arc<Pod>], replica_set: impl Fn(&str) -> Option<Arc<ReplicaSet>>) -> Vec<Candidate> {
    pool.iter()
        .filter(|p| is_ready(p) && is_pool_owned(p))
        .filter_map(|p| {
            let owner = p.metadata.owner_references.as_ref()?.first()?.name.clone();
            let rs = replica_set(&owner);
            if rs.as_deref().is_some_and(super::kube::is_scaled_to_zero) {
                return None;
            }
            Some(Candidate {
                name: p.metadata.name.clone()?,
                born: rs.and_then(|rs| rs.metadata.creation_timestamp.as_ref().map(|t| t.0)),
                replica_set: owner,
            })
        })
        .collect()
}

/// The untried candidates a claim picks from: those of the newest
/// ReplicaSet (a rollout's new pods before the old ones, which would be
/// replaced once it ends) among the ReplicaSets none of whose pods failed
/// an assignment in the deployment's current streak (`failed`), so that a
/// rollout whose new pods refuse assignments leaves the old pods serving
/// while it lasts. A ReplicaSet not in the cache yet counts as the newest:
/// its watch lags the pods' watch, and a pod is never older than its
/// ReplicaSet.
fn newest<'a>(
    candidates: &'a [Candidate],
    tried: &HashSet<String>,
    failed: &HashSet<String>,
) -> Vec<&'a Candidate> {
    let rank = |c: &Candidate| (!failed.contains(&c.replica_set), c.born.is_none(), c.born);
    let untried = || candidates.iter().filter(|c| !tried.contains(&c.name));
    let Some(top) = untried().map(rank).max() else {
        return Vec::new();
    };
    untried().filter(|c| rank(c) == top).collect()
}

/// `text` cut to [`MAX_QUOTED_BODY`] bytes on a character boundary.
fn quote(text: &str) -> String {
    let text = text.trim();
    if text.len() <= MAX_QUOTED_BODY {
        return text.to_owned();
    }
    let mut cut = MAX_QUOTED_BODY;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

/// Everything an assignment needs.
#[derive(Clone)]
pub struct Assigner {
    http: HttpClient<HttpConnector, Empty<Bytes>>,
    key: SigningKey,
    version: Version,
    path: String,
    timeout: Duration,
    metrics: Metrics,
    events: Arc<events::Log>,
    backoff: Arc<Backoff>,
    shutdown: Shutdown,
}

impl std::fmt::Debug for Assigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assigner")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Guard that keeps the waiting gauge raised while a claim waits.
struct Waiting<'a> {
    metrics: &'a Metrics,
    deployment: &'a str,
}

impl<'a> Waiting<'a> {
    /// Raises the gauge of `deployment`.
    fn start(metrics: &'a Metrics, deployment: &'a str) -> Self {
        metrics
            .waiting_for_unassigned_pods
            .get_or_create(&Metrics::function(deployment))
            .inc();
        Self { metrics, deployment }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.metrics
            .waiting_for_unassigned_pods
            .get_or_create(&Metrics::function(self.deployment))
            .dec();
    }
}

impl Assigner {
    /// An assigner signing with `key` and POSTing `path` with `timeout`;
    /// failed assignments are counted in `metrics` and logged in `events`.
    #[must_use]
    pub fn new(
        key: SigningKey,
        version: Version,
        path: String,
        timeout: Duration,
        metrics: Metrics,
        events: Arc<events::Log>,
        shutdown: Shutdown,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
            key,
            version,
            path,
            timeout,
            metrics,
            events,
            backoff: Arc::default(),
            shutdown,
        }
    }

    /// Assigns a pool pod of `ns` to `function`, waiting for one until
    /// `deadline`.
    ///
    /// # Errors
    /// [`Error::NoPoolPod`] when no pool pod appears before the deadline,
    /// [`Error::AssignFailed`] when the pod refused or did not answer (the
    /// pod is deleted), [`Error::AssignBackoff`] while the deployment backs
    /// off after [`FAILURES_BEFORE_BACKOFF`] consecutive failures,
    /// [`Error::Write`] when the API server fails.
    #[tracing::instrument(name = "controller.assign", skip_all, fields(function = %function.id(), deployment = %function.deployment))]
    pub async fn assign(
        &self,
        ns: &Namespace,
        function: &Function,
        deadline: Instant,
    ) -> Result<Instance, Error> {
        let key = (function.namespace.clone(), function.deployment.clone());
        let (_attempt, ended) = self.backoff.attempt(key.clone(), Instant::now(), |failed| {
            fresh_replica_set(ns, &function.deployment, failed)
        })?;
        if let Some(ended) = ended {
            self.backoff_ended(function, &ended);
        }
        self.metrics
            .assignments_total
            .get_or_create(&Metrics::function(&function.deployment))
            .inc();
        let started = Instant::now();
        let mut already_assigned = 0;
        let (pod, name, claimed, ready_at) = loop {
            // Boxed: a claimed pod is large, and this frame is part of
            // every caller's future, also while it waits for a pool pod.
            let pod = Box::new(self.claim(ns, function, deadline).await?);
            let name = pod.metadata.name.clone().unwrap_or_default();
            let claimed = Instant::now();
            let e = match Box::pin(self.post(&pod, function)).await {
                Ok(t) => break (pod, name, claimed, t),
                Err(e) => e,
            };
            if let Err(e) = Box::pin(ns.writer.delete(&name)).await {
                tracing::warn!(pod = %name, error = %e, "failed to delete pod after a failed assignment");
            }
            let (status, reason) = e.labels();
            self.metrics
                .assignment_failures_total
                .get_or_create(&AssignFailureLabels {
                    function_deployment: function.deployment.clone(),
                    status,
                    reason,
                })
                .inc();
            let message = format!("pod {name} failed its assignment and was deleted: {e}");
            if e.already_assigned() && already_assigned + 1 < MAX_ALREADY_ASSIGNED {
                // That pod serves someone else; the deployment is fine.
                already_assigned += 1;
                self.events.push(
                    function,
                    EventType::AssignmentFailed,
                    EventSeverity::Warn,
                    format!("{message}; claiming another (not counted toward the deployment's back-off)"),
                );
                continue;
            }
            let replica_set = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_REPLICA_SET));
            let backoff = if e.already_assigned() {
                None
            } else {
                self.backoff.failed(
                    &key,
                    replica_set.map(String::as_str),
                    message.clone(),
                    Instant::now(),
                )
            };
            let message = match backoff {
                Some(d) => {
                    self.metrics
                        .assignment_backoff_seconds
                        .get_or_create(&Metrics::function(&function.deployment))
                        .set(i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
                    format!("{message}; deployment backs off for {d:?}")
                }
                None => message,
            };
            self.events.push(
                function,
                EventType::AssignmentFailed,
                EventSeverity::Warn,
                message,
            );
            return Err(Error::AssignFailed {
                pod: name,
                source: e.into(),
            });
        };
        let posted = Instant::now();
        if self.backoff.succeeded(&key) {
            self.metrics
                .assignment_backoff_seconds
                .get_or_create(&Metrics::function(&function.deployment))
                .set(0);
        }
        let stamp = format_time(ready_at);
        ns.pods.mark_ready(&name, &stamp);
        {
            let writer = ns.writer.clone();
            let name = name.clone();
            let timeout = self.timeout;
            let stop = self.shutdown.token().clone();
            self.shutdown.spawn("patch-ready-at", async move {
                // After the instance's first request, which the router
                // sends as soon as this assignment returns; at once when
                // the controller stops.
                tokio::select! {
                    () = tokio::time::sleep(READY_AT_PATCH_DELAY) => {}
                    () = stop.cancelled() => {}
                }
                match tokio::time::timeout(timeout, writer.patch_ready_at(&name, &stamp)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(pod = %name, error = %e, "failed to persist ready-at annotation")
                    }
                    Err(_) => tracing::warn!(pod = %name, "failed to persist ready-at annotation: timed out"),
                }
            });
        }
        let mut instance =
            Instance::from_pod(&pod, Arc::new(function.clone())).map_err(|e| Error::AssignFailed {
                pod: name.clone(),
                source: e.into(),
            })?;
        let secs = ready_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        instance.ready_at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        instance.assign_timing = Some(Box::new(AssignTiming {
            instance: name,
            claim: claimed - started,
            assign: posted - claimed,
        }));
        Ok(instance)
    }

    /// Records that `function`'s deployment no longer backs off.
    fn backoff_ended(&self, function: &Function, ended: &Ended) {
        self.metrics
            .assignment_backoff_seconds
            .get_or_create(&Metrics::function(&function.deployment))
            .set(0);
        let message = format!(
            "deployment {}/{} stops backing off after {} consecutive failed assignments: ReplicaSet {} has Ready pool pods, none of which failed",
            function.namespace, function.deployment, ended.failures, ended.replica_set
        );
        tracing::info!(deployment = %function.deployment, replica_set = %ended.replica_set, "{message}");
        self.events.push(
            function,
            EventType::AssignmentBackoffEnded,
            EventSeverity::Info,
            message,
        );
    }

    /// Waits until a pod of `function`'s pool could be claimed, or until
    /// `deadline`, counted in `waiting_for_unassigned_pods` while it waits.
    /// While the deployment backs off it returns at once: the assignment
    /// that follows fails without waiting.
    pub async fn wait_for_pool_pod(&self, ns: &Namespace, function: &Function, deadline: Instant) {
        if self
            .backoff
            .is_backing_off(&function.namespace, &function.deployment, Instant::now())
        {
            return;
        }
        let mut waiting = None;
        let mut changes = ns.pods.subscribe();
        loop {
            changes.mark_unchanged();
            if !candidates(ns, &function.deployment).is_empty() {
                return;
            }
            if waiting.is_none() {
                waiting = Some(Waiting::start(&self.metrics, &function.deployment));
            }
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return;
            }
        }
    }

    /// Claims a pool pod, trying each candidate once and waiting for the
    /// store to change when none is left.
    async fn claim(
        &self,
        ns: &Namespace,
        function: &Function,
        deadline: Instant,
    ) -> Result<k8s_openapi::api::core::v1::Pod, Error> {
        let mut tried: HashSet<String> = HashSet::new();
        let failed = self
            .backoff
            .failed_replica_sets(&function.namespace, &function.deployment);
        let mut waiting: Option<Waiting<'_>> = None;
        let mut changes = ns.pods.subscribe();
        loop {
            changes.mark_unchanged();
            let all = candidates(ns, &function.deployment);
            let pick = newest(&all, &tried, &failed)
                .choose(&mut rand::rng())
                .map(|c| c.name.clone());
            if let Some(name) = pick {
                let owner = ns.pods.get(&name).and_then(|p| pool_deployment(ns, &p));
                // Boxed, like every API request here: the request's future
                // is allocated while it runs, not kept in the frame of a
                // claim that waits for a pool pod.
                match Box::pin(
                    ns.writer
                        .claim(&name, function, SystemTime::now(), owner.as_ref()),
                )
                .await
                {
                    Ok(pod) => return Ok(pod),
                    Err(WriteError::Conflict(_)) => {
                        tracing::debug!(pod = %name, "pod no longer claimable, trying another");
                        tried.insert(name);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if waiting.is_none() {
                waiting = Some(Waiting::start(&self.metrics, &function.deployment));
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(Error::NoPoolPod {
                    deployment: function.deployment.clone(),
                    namespace: function.namespace.clone(),
                });
            }
        }
    }

    /// POSTs the assignment; returns the time captured before signing.
    async fn post(
        &self,
        pod: &k8s_openapi::api::core::v1::Pod,
        function: &Function,
    ) -> Result<SystemTime, PostError> {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        let port = pod_port(pod).map_err(PostError::Port)?;
        let now = SystemTime::now();
        let target = PodRef {
            name: pod.metadata.name.as_deref().unwrap_or_default(),
            uid: pod.metadata.uid.as_deref().unwrap_or_default(),
        };
        // Valid for the assign request only; a long assign timeout extends it.
        let lifetime = BOUND_TOKEN_LIFETIME.max(self.timeout.saturating_mul(2));
        let (token, _jti) = self
            .key
            .sign_bound(self.version, &function.tenant, target, lifetime, now)
            .map_err(PostError::Sign)?;
        let uri = format!("http://{}{}", join_addr(&ip, &port), self.path);
        let mut req = http::Request::post(uri)
            .header(HEADER_TOKEN, token)
            .header(HEADER_FUNCTION, function.to_json())
            .header(http::header::CONTENT_LENGTH, "0")
            .body(Empty::<Bytes>::new())
            .map_err(PostError::Build)?;
        let span = if otel::enabled() {
            tracing::info_span!(
                "controller.assign_post",
                otel.name = %format_args!("POST {}", self.path),
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                http.request.method = "POST",
                server.address = %ip,
                k8s.pod.name = pod.metadata.name.as_deref().unwrap_or_default(),
                http.response.status_code = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        span.in_scope(|| otel::inject_http(req.headers_mut()));
        let exchange = async {
            let resp = self.http.request(req).await.map_err(PostError::Send)?;
            let status = resp.status();
            span.record("http.response.status_code", status.as_u16());
            if status == http::StatusCode::OK {
                return Ok(());
            }
            // Bounded read: the pod's answer is quoted, never kept whole.
            let body = http_body_util::Limited::new(resp.into_body(), 4 * MAX_QUOTED_BODY)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Err(PostError::Refused {
                status: status.as_u16(),
                body: quote(&String::from_utf8_lossy(&body)),
            })
        };
        let outcome = match tokio::time::timeout(self.timeout, exchange)
            .instrument(span.clone())
            .await
        {
            Ok(Ok(())) => Ok(now),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PostError::Timeout(self.timeout)),
        };
        if outcome.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        outcome
    }
}

/// The ownerReference a claim of `pod` gives it: to the Deployment that owns
/// the pod's ReplicaSet (as the ReplicaSet cache knows it); `None` for a
/// ReplicaSet without one.
fn pool_deployment(
    ns: &Namespace,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    let rs = pod.metadata.owner_references.as_ref()?.first()?;
    let rs = ns.replica_sets.get(&rs.name)?;
    let d = rs
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "Deployment" && o.controller == Some(true))?;
    Some(super::kube::pods::pool_owner(&d.name, &d.uid))
}

/// Whether the pod's first owner is a ReplicaSet (claimable pool pod).
fn is_pool_owned(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    pod.metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.first())
        .is_some_and(|o| o.kind == "ReplicaSet")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> (String, String) {
        ("ns".into(), "pool".into())
    }

    /// No ReplicaSet of fresh Ready pods.
    fn none(_: &HashSet<String>) -> Option<String> {
        None
    }

    #[test]
    fn consecutive_failures_back_off_with_one_attempt_per_period() {
        let b = Backoff::default();
        let t0 = Instant::now();
        for i in 1..FAILURES_BEFORE_BACKOFF {
            drop(b.attempt(key(), t0, none).expect("no back-off yet"));
            assert_eq!(b.failed(&key(), Some("rs-1"), format!("refusal {i}"), t0), None);
        }
        drop(b.attempt(key(), t0, none).unwrap());
        assert_eq!(
            b.failed(&key(), Some("rs-1"), "401".into(), t0),
            Some(BACKOFF_MIN)
        );
        let err = b
            .attempt(key(), t0 + Duration::from_millis(500), none)
            .err()
            .unwrap();
        assert!(matches!(err, Error::AssignBackoff { failures: 3, .. }), "{err}");
        assert!(err.to_string().contains("401"), "{err}");
        // After the period exactly one attempt goes ahead at a time.
        let later = t0 + BACKOFF_MIN;
        let (probe, ended) = b.attempt(key(), later, none).unwrap();
        assert_eq!(ended, None);
        assert!(
            b.attempt(key(), later, none).is_err(),
            "a second attempt waits for the probe"
        );
        assert_eq!(
            b.failed(&key(), Some("rs-1"), "401".into(), later),
            Some(BACKOFF_MIN * 2)
        );
        drop(probe);
        assert!(b.attempt(key(), later + BACKOFF_MIN, none).is_err());
        let probe = b.attempt(key(), later + BACKOFF_MIN * 2, none).unwrap();
        assert!(b.succeeded(&key()), "the streak was backing off");
        drop(probe);
        assert!(
            b.attempt(key(), later + BACKOFF_MIN * 2, none).is_ok(),
            "a success ends the streak"
        );
        assert!(!b.succeeded(&key()), "nothing was backing off");
        // Periods are capped.
        for _ in 0..40 {
            b.failed(&key(), None, "x".into(), t0);
        }
        assert_eq!(
            b.lock()[&key()].until.unwrap().saturating_duration_since(t0),
            BACKOFF_MAX
        );
    }

    #[test]
    fn ready_pods_of_a_replica_set_that_did_not_fail_end_the_back_off() {
        let b = Backoff::default();
        let t0 = Instant::now();
        for rs in ["old-a", "old-a", "old-b"] {
            b.failed(&key(), Some(rs), format!("pod of {rs} refused: 401"), t0);
        }
        let asked = std::cell::RefCell::new(Vec::new());
        // Only the failed ReplicaSets have Ready pods: still backing off,
        // and the check saw both of them.
        let err = b
            .attempt(key(), t0, |failed| {
                asked.borrow_mut().extend(failed.iter().cloned());
                ["old-a", "old-b"]
                    .into_iter()
                    .find(|rs| !failed.contains(*rs))
                    .map(str::to_owned)
            })
            .err()
            .expect("pods of failed ReplicaSets do not end it");
        assert!(matches!(err, Error::AssignBackoff { .. }), "{err}");
        let mut asked = asked.into_inner();
        asked.sort();
        assert_eq!(asked, ["old-a", "old-b"]);
        // A rollout's new ReplicaSet is Ready: the back-off ends at once,
        // within its period, and the next failure starts a fresh streak.
        let (_attempt, ended) = b
            .attempt(key(), t0 + Duration::from_millis(10), |failed| {
                ["old-a", "new"]
                    .into_iter()
                    .find(|rs| !failed.contains(*rs))
                    .map(str::to_owned)
            })
            .expect("the back-off ends");
        assert_eq!(
            ended,
            Some(Ended {
                replica_set: "new".into(),
                failures: 3
            })
        );
        assert_eq!(b.failed(&key(), Some("new"), "refused".into(), t0), None);
        assert_eq!(b.lock()[&key()].failures, 1);
    }

    #[test]
    fn already_assigned_is_told_apart_from_other_refusals() {
        let conflict = PostError::Refused {
            status: 409,
            body: "already assigned".into(),
        };
        assert!(conflict.already_assigned());
        assert_eq!(conflict.labels(), ("409".into(), "already-assigned"));
        let unauthorized = PostError::Refused {
            status: 401,
            body: "invalid token".into(),
        };
        assert!(!unauthorized.already_assigned());
        assert_eq!(unauthorized.labels(), ("401".into(), "refused"));
        assert!(!PostError::Timeout(Duration::from_secs(1)).already_assigned());
    }

    fn pool_pod(name: &str, replica_set: &str, ready: bool) -> Arc<Pod> {
        use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.owner_references = Some(vec![OwnerReference {
            kind: "ReplicaSet".into(),
            name: replica_set.into(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
        p.status = Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some("10.0.0.1".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        });
        Arc::new(p)
    }

    fn replica_set(name: &str, desired: i32, born_secs: i64) -> Arc<ReplicaSet> {
        use k8s_openapi::api::apps::v1::ReplicaSetSpec;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut rs = ReplicaSet::default();
        rs.metadata.name = Some(name.into());
        rs.metadata.creation_timestamp = Some(Time(jiff::Timestamp::from_second(born_secs).unwrap()));
        rs.spec = Some(ReplicaSetSpec {
            replicas: Some(desired),
            ..ReplicaSetSpec::default()
        });
        Arc::new(rs)
    }

    /// Names of [`candidates_of`] `pool` with `sets` in the cache.
    fn names(pool: &[Arc<Pod>], sets: &[Arc<ReplicaSet>], tried: &[&str]) -> (Vec<String>, Vec<String>) {
        names_failed(pool, sets, tried, &[])
    }

    /// [`names`] when pods of the `failed` ReplicaSets failed assignments.
    fn names_failed(
        pool: &[Arc<Pod>],
        sets: &[Arc<ReplicaSet>],
        tried: &[&str],
        failed: &[&str],
    ) -> (Vec<String>, Vec<String>) {
        let all = candidates_of(pool, |n| {
            sets.iter()
                .find(|rs| rs.metadata.name.as_deref() == Some(n))
                .cloned()
        });
        let tried: HashSet<String> = tried.iter().map(|t| (*t).to_owned()).collect();
        let failed: HashSet<String> = failed.iter().map(|f| (*f).to_owned()).collect();
        let mut first: Vec<String> = newest(&all, &tried, &failed)
            .into_iter()
            .map(|c| c.name.clone())
            .collect();
        first.sort();
        let mut all: Vec<String> = all.into_iter().map(|c| c.name).collect();
        all.sort();
        (all, first)
    }

    #[test]
    fn claims_skip_pods_of_a_replica_set_scaled_to_zero_and_take_the_newest_first() {
        let pool = [
            pool_pod("old-1", "old", true),
            pool_pod("mid-1", "mid", true),
            pool_pod("new-1", "new", true),
            pool_pod("new-2", "new", true),
            pool_pod("new-3", "new", false),
        ];
        // A rollout scaled `old` to zero: its pod is being deleted.
        let sets = [
            replica_set("old", 0, 100),
            replica_set("mid", 1, 200),
            replica_set("new", 2, 300),
        ];
        let (all, first) = names(&pool, &sets, &[]);
        assert_eq!(
            all,
            ["mid-1", "new-1", "new-2"],
            "Ready pods of ReplicaSets with replicas"
        );
        assert_eq!(first, ["new-1", "new-2"], "the newest ReplicaSet's pods first");
        // Once the newest ReplicaSet's pods were tried, the next one's.
        let (_, first) = names(&pool, &sets, &["new-1", "new-2"]);
        assert_eq!(first, ["mid-1"]);
        let (_, first) = names(&pool, &sets, &["new-1", "new-2", "mid-1"]);
        assert!(first.is_empty(), "never a pod of the retired ReplicaSet");
        // A ReplicaSet the cache does not hold yet (its watch lags the
        // pods'): its pods are claimable, and first.
        let (all, first) = names(&pool, &sets[..1], &[]);
        assert_eq!(all, ["mid-1", "new-1", "new-2"]);
        assert_eq!(first, ["mid-1", "new-1", "new-2"]);
        let (_, first) = names(&pool, &sets[..2], &[]);
        assert_eq!(
            first,
            ["new-1", "new-2"],
            "an unknown ReplicaSet before a known one"
        );
    }

    #[test]
    fn quoted_answers_are_cut() {
        let long = "é".repeat(400);
        let q = quote(&long);
        assert!(q.len() <= MAX_QUOTED_BODY + '…'.len_utf8());
        assert!(q.ends_with('…'));
        assert_eq!(quote(" short \n"), "short");
    }
}
