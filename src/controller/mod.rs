//! `skipper controller`: assigns pool pods to functions, scales them and
//! serves `skipper.ControllerService`.
//!
//! Layout:
//! - [`config`]: flags and the validated [`Config`].
//! - [`kube`]: watches and caches (reads) and [`kube::pods`] (all writes).
//! - [`assign`]: claiming a pool pod and the assign request.
//! - [`auth`]: who may call (token reviews, the callers' roles).
//! - [`supervisor`]: one actor per function over a narrow
//!   [`supervisor::Context`]; [`supervisor::converge`] is the pure scaling
//!   core with its settings; [`context`] is the controller's implementation
//!   of the context.
//! - [`heartbeat`], [`events`], [`metrics`], [`peers`]: router activity, the
//!   event log, Prometheus metrics, and clients of the other controllers.
//! - [`feeds`]: the instance views routers' tables are made of, and
//!   draining before a scale-down.
//! - [`core`]: the operations behind the RPCs; [`grpc`]: the service and
//!   its authentication layer; [`watch`]: the `WatchInstances` streams.
//! - [`error`]: the operations' error, wrapping the leaves' own errors, and
//!   the one mapping of all of them to gRPC status codes.
//! - [`web`]: the operator's web UI (`--web-port`).
//!
//! The modules import each other without a circle (the `imports` contract
//! test reads them): leaves (`assign`, `auth`, `heartbeat`, `kube`,
//! `supervisor::converge`) own their settings and errors and know nothing of
//! the RPCs; `error` wraps them; `context`, `feeds` and `supervisor` build
//! on the leaves; `core`, `watch`, `grpc` and `web` on all of them.

pub mod assign;
pub mod auth;
pub mod config;
pub mod context;
pub mod core;
pub mod error;
pub mod events;
pub mod feeds;
pub mod grpc;
pub mod heartbeat;
pub mod kube;
pub mod metrics;
pub mod peers;
pub mod supervisor;
pub mod watch;
pub mod web;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tonic_health::ServingStatus;

pub use config::{Args, Config, ConfigError};

use self::core::Core;
use self::kube::is_running;
use self::metrics::Metrics;
use crate::credentials::Credentials;
use crate::ring::RingHandle;
use crate::shutdown::Shutdown;

/// Why the controller stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("failed to create kubernetes client: {0}")]
    KubeClient(#[source] Box<::kube::Error>),
    #[error("failed to create listener: {0}")]
    Listen(#[source] std::io::Error),
    #[error("failed to start controller: {0}")]
    Start(#[from] kube::stores::StartError),
    #[error("failed to serve controller: {0}")]
    Serve(#[source] tonic::transport::Error),
    #[error("failed to serve metrics: {0}")]
    Metrics(#[source] std::io::Error),
    #[error("--token-file: {0}")]
    Credentials(#[from] crate::credentials::CredentialsError),
    #[error("invalid configuration: {0}")]
    Telemetry(#[from] crate::telemetry::AddrError),
    #[error("failed to serve the web UI: {0}")]
    Web(#[from] web::Error),
}

/// The gRPC health service name the liveness (and startup) probe asks:
/// `SERVING` while the process runs. The overall status (`""`) is the
/// readiness: `SERVING` once the caches sync, while every watch runs.
pub const LIVENESS_SERVICE: &str = "liveness";

/// A running controller's handles, for tests and the dev playground.
#[derive(Debug, Clone)]
pub struct Running {
    pub core: Arc<Core>,
    /// Where the web UI listens, when it is served.
    pub web_addr: Option<std::net::SocketAddr>,
}

/// Runs the controller on `listener` until `shutdown` fires.
///
/// Order: start the watches, serve gRPC with health `NOT_SERVING`, wait for
/// every cache to list once (a function namespace the API server refuses
/// does not hold this up: it is retried with back-off), start discovery,
/// then report `SERVING` (as the Go implementation does), and `NOT_SERVING`
/// again while the API server refuses the ring's watch or the watches of
/// every function namespace (see [`start_health`]). Health
/// does not wait for the ring: a controller joins the ring only once its pod
/// is Ready, and readiness is this health, so a fresh install would never
/// come up. Requests that need the ring wait for a member instead (at most
/// `--hash-ring-wait-time`; an empty ring then is a discovery failure,
/// answered `UNAVAILABLE`). `ready` is called with the running core once
/// serving.
///
/// # Errors
/// See [`RunError`].
pub async fn run(
    config: Config,
    client: ::kube::Client,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: impl FnOnce(Running) + Send,
) -> Result<(), RunError> {
    let config = Arc::new(config);
    // Which key signs: what a key rotation checks before the pools stop
    // trusting the old one (`skipper keygen` prints the same id).
    tracing::info!(
        kid = %config.signing_key.key_id(config.paseto_version),
        version = ?config.paseto_version,
        "signing assignment tokens"
    );
    let credentials = match &config.token_file {
        Some(path) => match Credentials::from_file(path) {
            Ok(c) => c,
            Err(e) if config.auth.allow_unauthenticated => {
                tracing::warn!(error = %e, "calling peer controllers without a token");
                Credentials::none()
            }
            Err(e) => return Err(e.into()),
        },
        None => Credentials::none(),
    };
    credentials.keep_fresh(&shutdown);
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    crate::telemetry::process::register(&mut registry);
    if let Some(addr) = config
        .telemetry
        .metrics_addr()
        .map_err(|e| RunError::Metrics(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?
    {
        crate::telemetry::serve_metrics(addr, Arc::new(registry), &shutdown)
            .await
            .map_err(RunError::Metrics)?;
    }
    let ring = RingHandle::default();
    let single = config.single_controller_mode.then_some(config.pod_ip.as_str());
    let state = kube::stores::start(
        &client,
        &config.function_namespaces,
        config.skip_forbidden_namespaces,
        &config.namespace,
        single,
        &ring,
        &metrics,
        config.scale_interval,
        &shutdown,
    )
    .await?;

    let events = Arc::new(events::Log::default());
    let assigner = assign::Assigner::new(
        config.signing_key.clone(),
        config.paseto_version,
        config.assign_path.clone(),
        config.scale.assign_timeout,
        metrics.clone(),
        events.clone(),
        shutdown.clone(),
    );
    let started_at = SystemTime::now();
    let cluster = Arc::new(context::Cluster {
        settings: supervisor::Settings {
            scale_interval: config.scale_interval,
            scale: config.scale,
        },
        state: state.clone(),
        ring: ring.clone(),
        pod_ip: config.pod_ip.clone(),
        assigner,
        events,
        metrics: metrics.clone(),
        stale_permits: Arc::new(Semaphore::new(config.max_concurrent_stale_replacements)),
        started_at,
        feeds: Arc::new(feeds::Feeds::default()),
        drain_timeout: config.drain_timeout,
    });
    let supervisors = supervisor::Registry::new(
        cluster.clone(),
        shutdown.token().child_token(),
        shutdown.tracker().clone(),
    );
    metrics.supervisors.bind(supervisors.len_source());
    let core = Arc::new(Core {
        config: config.clone(),
        cluster,
        shutdown: shutdown.clone(),
        peers: peers::Peers::new(config.port, credentials),
        supervisors,
        routers: heartbeat::Routers::new(
            config.limits.heartbeat_routers,
            config.limits.functions_per_router,
        ),
    });

    // The web UI answers from the start (its pages show what the caches
    // hold so far); a port that cannot be bound is a start-up error.
    let web_addr = match config.web_addr {
        Some(addr) => {
            let listener = web::bind(addr).await?;
            Some(web::serve(&core, listener, config.web_template_dir.clone())?)
        }
        None => None,
    };

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("", ServingStatus::NotServing).await;
    reporter
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;
    // Every call but the health service's is authenticated first.
    let authenticator = Arc::new(auth::Authenticator::new(
        config.auth.clone(),
        auth::KubeReviewer(client.clone()),
        metrics,
    ));
    let service = tower::Layer::layer(&grpc::AuthLayer::new(authenticator), api_server(core.clone()));
    let token = shutdown.token().clone();
    let incoming = crate::net::grpc_incoming(listener);
    // HTTP/2 pings keep long-lived instance streams honest: a router that
    // vanished without a word is noticed and its stream ends. Generous, so
    // a busy peer is not mistaken for a dead one.
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)))
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, token.clone().cancelled_owned());
    let mut server = std::pin::pin!(server);

    tokio::select! {
        r = &mut server => return r.map_err(RunError::Serve),
        () = token.cancelled() => return Ok(()),
        () = state.wait_synced() => {}
    }
    start_discovery(&core);
    start_peer_pruning(&core);
    start_health(&core, reporter).await;
    ready(Running {
        core: core.clone(),
        web_addr,
    });
    let result = server.await.map_err(RunError::Serve);
    core.supervisors.stop_all();
    tracing::info!("controller shutdown");
    result
}

fn api_server(
    core: Arc<Core>,
) -> crate::api::controller_service_server::ControllerServiceServer<grpc::Service> {
    crate::api::controller_service_server::ControllerServiceServer::new(grpc::Service::new(core))
}

/// Every `--scale-interval`, ensures a supervisor for every function with
/// assigned pods; deletes tenant-labelled pods whose function annotation is
/// missing or invalid; counts the instances of the functions this
/// controller owns (the `instances` metric, summed over controllers).
fn start_discovery(core: &Arc<Core>) {
    let core2 = core.clone();
    let token = core.shutdown.token().clone();
    core.shutdown.spawn("discover-supervisors", async move {
        let core = core2;
        let mut ticker = tokio::time::interval(core.config.scale_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut counted: HashMap<String, i64> = HashMap::new();
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                _ = ticker.tick() => {}
            }
            for n in counted.values_mut() {
                *n = 0;
            }
            for ns in core.cluster.state.namespaces.values() {
                let mut seen = HashSet::new();
                for (pod, function) in ns.pods.assigned() {
                    if !is_running(&pod) {
                        continue;
                    }
                    let name = pod.metadata.name.clone().unwrap_or_default();
                    match function {
                        Some(f) => {
                            if core.cluster.is_owner(f.id()) {
                                *counted.entry(f.deployment.clone()).or_default() += 1;
                            }
                            if seen.insert(f.id()) {
                                core.supervisor(&f, false).await;
                            }
                        }
                        None => {
                            tracing::warn!(pod = %name, "failed to get function from pod; deleting it");
                            if let Err(e) = ns.writer.delete(&name).await {
                                tracing::warn!(pod = %name, error = %e, "failed to delete invalid pod");
                            }
                        }
                    }
                }
            }
            counted.retain(|deployment, n| {
                core.cluster
                    .metrics
                    .instances
                    .get_or_create(&Metrics::function(deployment))
                    .set(*n);
                *n > 0
            });
        }
    });
}

/// Keeps the health service's statuses. Each function namespace has a
/// service of its own, `namespace/<name>` ([`namespace_service`]): `SERVING`
/// while its watches run. The overall status (readiness) is `SERVING` while
/// the ring's watch runs and some function namespace is served: a namespace
/// the API server refuses (its Role is not there yet, or lacks a verb) does
/// not take the controller out of the ring for the others. Every change is
/// logged, naming what each namespace lacks. The first statuses are set
/// before this returns: whoever hears the controller is running finds them.
async fn start_health(core: &Arc<Core>, reporter: tonic_health::server::HealthReporter) {
    let health = Health {
        state: core.cluster.state.clone(),
        metrics: core.cluster.metrics.clone(),
        pod_ip: core.config.pod_ip.clone(),
        reporter,
    };
    let token = core.shutdown.token().clone();
    let mut refused = health.state.refusals.subscribe();
    refused.borrow_and_update();
    let mut last = health.publish(None).await;
    core.shutdown.spawn("health", async move {
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                () = health.state.readiness_changed(&mut refused) => {}
            }
            refused.borrow_and_update();
            last = health.publish(Some(last)).await;
        }
    });
}

/// What the health statuses are computed from and set on.
struct Health {
    state: self::kube::stores::State,
    metrics: self::metrics::Metrics,
    pod_ip: String,
    reporter: tonic_health::server::HealthReporter,
}

/// The statuses last set: overall serving, the unready function namespaces
/// (each with why), what the ring's watch is refused.
type Statuses = (bool, BTreeMap<String, String>, String);

impl Health {
    /// Sets and logs the statuses when they differ from `last`; returns them.
    async fn publish(&self, last: Option<Statuses>) -> Statuses {
        let state = &self.state;
        let unready: BTreeMap<String, String> = state
            .namespaces
            .keys()
            .filter_map(|ns| state.not_ready(ns).map(|why| (ns.clone(), why)))
            .collect();
        let ring_refused = crate::watch_access::Refusals::describe(&state.ring_refusals());
        let serving = ring_refused.is_empty()
            && (state.namespaces.is_empty() || unready.len() < state.namespaces.len());
        let now = (serving, unready, ring_refused);
        if last.as_ref() == Some(&now) {
            return now;
        }
        let (serving, unready, ring_refused) = &now;
        for ns in state.namespaces.keys() {
            let ready = !unready.contains_key(ns);
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            self.reporter
                .set_service_status(&namespace_service(ns), status)
                .await;
            self.metrics
                .function_namespace_ready
                .get_or_create(&self::metrics::FunctionNamespaceLabels {
                    function_namespace: ns.clone(),
                })
                .set(i64::from(ready));
        }
        let status = if *serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status("", status).await;
        log_health(&self.pod_ip, *serving, unready, ring_refused);
        now
    }
}

/// The gRPC health service of function namespace `ns`: `SERVING` while the
/// controller's watches of it run.
#[must_use]
pub fn namespace_service(ns: &str) -> String {
    format!("namespace/{ns}")
}

fn log_health(pod_ip: &str, serving: bool, unready: &BTreeMap<String, String>, ring_refused: &str) {
    let lacking = unready
        .iter()
        .map(|(ns, why)| format!("{ns}: {why}"))
        .collect::<Vec<_>>()
        .join("; ");
    if !ring_refused.is_empty() {
        tracing::error!(
            %pod_ip,
            refused = %ring_refused,
            "controller not serving: the API server refuses the ring's watch (grant the verb), ring membership \
             would not follow the cluster"
        );
    } else if !serving {
        tracing::error!(
            %pod_ip,
            refused = %lacking,
            "controller not serving: the API server refuses a watch of every function namespace (grant the \
             verb in each namespace's Role); retrying with back-off"
        );
    } else if unready.is_empty() {
        tracing::info!(%pod_ip, "controller serving");
    } else {
        tracing::warn!(
            %pod_ip,
            refused = %lacking,
            "controller serving, but not these function namespaces (grant the verb in each namespace's Role); \
             retrying with back-off"
        );
    }
}

/// Drops peer clients of controllers that left the ring.
fn start_peer_pruning(core: &Arc<Core>) {
    let core2 = core.clone();
    let token = core.shutdown.token().clone();
    core.shutdown.spawn("prune-peers", async move {
        let mut rx = core2.cluster.ring.subscribe();
        let members =
            |ring: &crate::ring::HashRing| i64::try_from(ring.sorted_members().len()).unwrap_or(i64::MAX);
        core2
            .cluster
            .metrics
            .ring_members
            .set(members(&rx.borrow_and_update()));
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                r = rx.changed() => if r.is_err() { return },
            }
            let ring = rx.borrow_and_update().clone();
            core2.cluster.metrics.ring_members.set(members(&ring));
            core2.peers.retain(ring.sorted_members());
        }
    });
}

/// Runs the controller until SIGTERM/SIGINT.
///
/// # Errors
/// Bad flags, an unreachable API server, or (with
/// `--skip-forbidden-namespaces`) a namespace probe that fails for another
/// reason than Forbidden (the process exits non-zero so Kubernetes restarts
/// it). A function namespace the API server refuses is not an error: the
/// controller keeps running and retries it.
pub async fn main(args: Args) -> Result<ExitCode, RunError> {
    let config = Config::try_from(args)?;
    let traces = crate::telemetry::init_traced(&config.telemetry, "skipper.controller");
    let kube_config = ::kube::Config::infer()
        .await
        .map_err(|e| RunError::KubeClient(Box::new(::kube::Error::InferConfig(e))))?;
    let client = ::kube::client::ClientBuilder::try_from(kube_config)
        .map_err(|e| RunError::KubeClient(Box::new(e)))?
        .with_layer(&kube::throttle::ThrottleLayer::new(
            config.kube_qps,
            config.kube_burst,
        ))
        .with_layer(&kube::trace::TraceLayer)
        .build();
    let addr = config.listen_addr()?;
    let listener = TcpListener::bind(addr).await.map_err(RunError::Listen)?;
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals().map_err(RunError::Listen)?;
    crate::profiling::start(&config.telemetry, &shutdown).await?;
    let grace = config.shutdown_timeout;
    let flush = config.telemetry.telemetry_shutdown_timeout;
    let result = run(config, client, listener, shutdown.clone(), |_| {}).await;
    if !shutdown.drain(grace).await {
        tracing::warn!("graceful stop timed out, forcing stop");
    }
    traces.shutdown(flush).await;
    result.map(|()| ExitCode::SUCCESS)
}
