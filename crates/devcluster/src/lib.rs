//! The Kubernetes API simulator, the node agent and the harnesses for a real
//! control plane: the cluster that `skipper dev` and the tests run Skipper on.
//!
//! [`Cluster`] is a faithful-enough Kubernetes API server for Skipper's
//! tests and for the local playground: pods, replicasets, deployments,
//! services, endpointslices, namespaces, secrets, configmaps, RBAC objects,
//! leases and `metrics.k8s.io` pod metrics, served over HTTPS to kube-rs
//! and kubectl, with one global resourceVersion, watches with bookmarks,
//! `timeoutSeconds` and `410 Gone`, JSON Patch with `test`, merge and
//! strategic-merge patches, optimistic concurrency and graceful deletion.
//! Deployments own ReplicaSets and roll them out as kube-controller-manager
//! does, ReplicaSets keep their pods (and release a pod whose labels stop
//! matching), finalizers hold deleted objects, the garbage collector follows
//! ownerReferences of every kind (`Background`, `Foreground`, `Orphan`), a
//! deleted namespace terminates (content first), and every pod is a real
//! process on its own loopback IP, or in its own network namespace on a
//! bridge ([`Config::pod_network`]; see [`kubelet`]).
//!
//! # Identity
//!
//! The cluster makes its own CA at start ([`pki`]) and serves HTTPS only.
//! Requests authenticate with a client certificate of that CA (user = `CN`,
//! group = `O`) or a ServiceAccount token ([`auth`]); anything else gets
//! `401`. [`Cluster::client`] and the kubeconfig the cluster writes are the
//! administrator (`kubernetes-admin` in `system:masters`);
//! [`Cluster::client_for`] and [`Cluster::kubeconfig_for`] give any user, a
//! node (`system:node:<name>`) or a ServiceAccount.
//!
//! # Using it in a test
//!
//! ```no_run
//! use kube::api::{Api, PostParams};
//! use k8s_openapi::api::apps::v1::Deployment;
//! use skipper_devcluster::{Cluster, Config, pool_deployment};
//!
//! # async fn example(public_key_pem: &str) -> Result<(), Box<dyn std::error::Error>> {
//! let cluster = Cluster::start(Config {
//!     // In integration tests `current_exe()` is the test binary: pass
//!     // `env!("CARGO_BIN_EXE_skipper")` here.
//!     skipper_exe: "target/debug/skipper".into(),
//!     namespaces: vec!["fixtures".into()],
//!     ..Config::default()
//! })
//! .await?;
//! let client = cluster.client()?;
//! let deployments: Api<Deployment> = Api::namespaced(client.clone(), "fixtures");
//! deployments
//!     .create(&PostParams::default(), &pool_deployment("fixtures", "fixture", 3, public_key_pem))
//!     .await?;
//! let pods = cluster
//!     .wait_ready_pods("fixtures", "skipper/deployment=fixture", 3, std::time::Duration::from_secs(20))
//!     .await?;
//! let ip = pods[0]["status"]["podIP"].as_str(); // the fixture listens on <ip>:8888
//! cluster.shutdown().await; // also happens on drop: every pod process is stopped
//! # Ok(()) }
//! ```
//!
//! kube 5's `Patch::Json` takes json-patch 4's `Patch` (the crate's own
//! `json-patch` dependency is 5): build it with
//! `serde_json::from_value(json!([...]))` and let inference pick the type.
//! kube's client retries `429`, `503` and `504` by itself, so inject other statuses to see
//! failures.
//!
//! Faults: [`Cluster::kill_pod_process`], [`Cluster::drop_watches`],
//! [`Cluster::compact`] (forces `410 Gone` on the next re-watch),
//! [`Cluster::fail_next_writes`], [`Cluster::set_latency`],
//! [`Cluster::forbid_namespace`]; the same over HTTP as
//! `POST /_sim/pods/<ns>/<name>/kill`, `/_sim/drop-watches`, `/_sim/compact`,
//! `/_sim/fail-writes?count=N&status=S[&namespace=NS]`, `/_sim/latency?ms=N`,
//! `/_sim/forbid?namespace=NS[&allow=true]` (administrators only).
//!
//! Requests are authorized as with `--authorization-mode=Node,RBAC`
//! ([`rbac`]): `system:masters` always, nodes by the Node authorizer, everyone
//! else by the Roles and bindings in the store (the bootstrap ClusterRoles
//! `cluster-admin`, `system:discovery`, `system:basic-user`,
//! `system:public-info-viewer`, `view`, `edit` and `admin` exist from the
//! start). `Impersonate-*` headers (`kubectl --as`) are honoured for callers
//! allowed to `impersonate`. [`Cluster::forbid_namespace`] remains a fault
//! that answers `403` regardless.
//!
//! # Deviations from a real cluster
//!
//! | Feature | Real cluster | Simulator |
//! |---|---|---|
//! | Anonymous requests | `system:anonymous` unless `--anonymous-auth=false` | always `401` (as with `--anonymous-auth=false`) |
//! | Client certificate groups | any number of `O` | at most one `O` in certificates the simulator issues |
//! | HTTP/2 | offered by ALPN | HTTP/1.1 only |
//! | RBAC escalation checks | creating a Role or binding needs the rights it grants (or `escalate`/`bind`) | not checked |
//! | Aggregated ClusterRoles | `view`/`edit`/`admin` aggregate labelled roles | fixed rules (core, apps, batch, discovery, policy, coordination, events, metrics) |
//! | Node authorizer | graph of pods, volumes, PVs, ResourceClaims, ... | pods, secrets, configmaps, PVCs and ServiceAccounts referenced by pods bound to the node |
//! | Admission and schema validation | full: every field of every kind, strict decoding (`fieldValidation=Strict` refuses unknown and duplicate fields, otherwise they are dropped with a warning) | strict decoding the same for JSON bodies (the schema of [`protobuf`]: unknown and duplicate fields in document order, `Warning: 299` headers, the real `400` texts; YAML bodies report unknown fields only, a strict patch's `422` quotes the patched object without `managedFields`); values: names, label keys and values, containers (DNS-label names, unique, an image), container and Service ports, non-negative workload replicas, ConfigMap and Secret keys, selectors, required containers, immutable workload selectors and finalizers of objects being deleted ([`validation`], the real `422` texts and causes); quantities in the form resource.ParseQuantity checks first (`400` with the real text); other invalid values (probes, env, volumes, ...) are accepted |
//! | Mutating admission | every configured plugin | only the ServiceAccount token volume of pods (a missing ServiceAccount is not refused) |
//! | Defaulting | every decoded object | Pods, Deployments and ReplicaSets (workload specs, pod templates, containers, probes, ports); pods lack what admission adds besides `serviceAccountName` (`priority`, `preemptionPolicy`, `enableServiceLinks`, default tolerations); a Deployment or ReplicaSet without `metadata.labels` gets its template's labels (as `extensions/v1beta1` did; `apps/v1` leaves them empty) |
//! | Response encodings | JSON, YAML or protobuf, as `Accept` asks | JSON whatever `Accept` asks (client-go offers JSON beside protobuf, so kubectl reads it) |
//! | Server-side apply | yes | no (`415`) |
//! | Rollouts | kube-controller-manager's deployment controller | the same decisions ([`deployment`], [`replicaset`]); ReplicaSet names hash the template's canonical JSON (FNV-1a), so they differ from a real cluster's for the same template |
//! | Events | `events.k8s.io/v1` and core `v1` | core `v1` only |
//! | EndpointSlice and Endpoints addresses | loopback (`127.0.0.0/8`, `::1`) refused with `422` | accepted: with [`PodNetwork::Loopback`] every pod runs on its own loopback IP (with [`PodNetwork::Bridge`], and on the real control plane, pods have routable IPs on a bridge instead, see [`real_cluster`]) |
//! | Cluster DNS, Service virtual IPs | yes | none (reach pods by IP or through EndpointSlices) |
//!
//! The pod runtime's own differences (images are ignored, pods share the
//! host's network in loopback mode, ...) are listed in [`kubelet`]. A normal exit, a panic
//! (drop), Ctrl-C or a SIGKILL of the simulator stops every pod process.

/// Mutating admission (the ServiceAccount token volume of pods).
pub mod admission;
/// Authentication: client certificates and ServiceAccount tokens.
pub mod auth;
/// A real Kubernetes control plane (etcd, kube-apiserver,
/// kube-controller-manager, kube-scheduler) as local processes.
pub mod control_plane;
/// Deployment, ReplicaSet, namespace, garbage-collection and EndpointSlice loops.
pub mod controllers;
/// The Deployment controller's decisions (rollouts, scaling, history, status).
pub mod deployment;
/// API errors and their `Status` mapping.
pub mod error;
/// The HTTPS listener.
pub mod https;
/// The node agent: runs pods as containers.
pub mod kubelet;
/// Upstream kubelet and containerd nodes for the real control plane.
pub mod kubelet_nodes;
/// Lock files under `/run` that tell a live harness's host state from a dead one's.
pub mod lockfile;
/// `metrics.k8s.io` as an aggregated API (an APIService), as metrics-server.
pub mod metrics_api;
/// JSON, merge and strategic-merge patches.
pub mod patch;
/// CA, certificates and the ServiceAccount token key.
pub mod pki;
/// `application/vnd.kubernetes.protobuf` request bodies.
pub mod protobuf;
/// Resource quantities (`250m`, `64Mi`).
pub mod quantity;
/// Node and RBAC authorization.
pub mod rbac;
/// A real cluster: the real control plane, the node agent as its nodes,
/// pods on a bridge network.
pub mod real_cluster;
/// The ReplicaSet controller's decisions (which pods go first, availability, status).
pub mod replicaset;
/// Served resource kinds and discovery.
pub mod resources;
/// TokenRequest, TokenReview and the access reviews.
pub mod reviews;
/// Binds pending pods to nodes.
pub mod scheduler;
/// Label and field selectors.
pub mod selector;
/// The HTTP server and fault endpoints.
pub mod server;
/// The object store and watch history.
pub mod store;
/// Table output for kubectl.
pub mod table;
/// Field validation (label keys and values, ports, immutable fields).
pub mod validation;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use base64::Engine as _;

use auth::Authenticator;
use error::ApiError;
use kubelet::network::Bridge;
use kubelet::{BackoffPolicy, Capacity, Kubelet, KubeletError, NodeSpec, PodNetwork};
use pki::ClusterPki;
use resources::by_kind;
use server::{Faults, Shared};
use store::Store;

/// The shortest time between two passes of the control loops.
const RECONCILE_BATCH: Duration = Duration::from_millis(20);
/// How long after a pod's `minReadySeconds` are over the controllers look
/// again (availability needs "ready for longer than").
const MIN_READY_SLACK: Duration = Duration::from_millis(10);

/// How the simulator runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the API server listens (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// What `skipper` in a container command runs.
    pub skipper_exe: PathBuf,
    /// Holds the kubeconfig and per-pod directories; a fresh temporary
    /// directory (removed on shutdown) when `None`.
    pub work_dir: Option<PathBuf>,
    /// Namespaces created at start (besides `default`, `kube-system`, `kube-public` and `kube-node-lease`).
    pub namespaces: Vec<String>,
    /// Zones of the simulated nodes (one node per zone).
    pub zones: Vec<String>,
    /// Capacity (and allocatable) of every node.
    pub node_capacity: Capacity,
    /// The kubelet's crash back-off (10 s doubling to 5 min); tests scale it down.
    pub restart_backoff: BackoffPolicy,
    /// How often pod CPU and memory are sampled.
    pub metrics_interval: Duration,
    /// How often pods' ConfigMap, Secret, downward API and token volumes are refreshed.
    pub volume_resync: Duration,
    /// `leaseDurationSeconds` of the node Leases (renewed every quarter of it).
    pub node_lease_duration: Duration,
    /// How often watches that asked for bookmarks get one.
    pub bookmark_interval: Duration,
    /// Upper bound on a watch's `timeoutSeconds`.
    pub max_watch_timeout: Duration,
    /// Events kept for watches; older resourceVersions get `410 Gone`.
    pub event_history: usize,
    /// Period of the control loops besides reacting to every change.
    pub resync_interval: Duration,
    /// Where pod IPs come from: a loopback address each in the host's
    /// network namespace ([`PodNetwork::Loopback`], the default; no
    /// privileges needed), or a network namespace per pod on a bridge
    /// ([`PodNetwork::Bridge`], root). On a bridge the API server listens on
    /// the bridge's gateway (at `listen`'s port), where both pods and the
    /// host reach it, and the bridge is removed when the cluster stops.
    pub pod_network: PodNetwork,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            skipper_exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("skipper")),
            work_dir: None,
            namespaces: Vec::new(),
            zones: vec!["zone-a".into(), "zone-b".into(), "zone-c".into()],
            node_capacity: Capacity::default(),
            restart_backoff: BackoffPolicy::default(),
            metrics_interval: Duration::from_secs(1),
            volume_resync: Duration::from_secs(10),
            node_lease_duration: Duration::from_secs(40),
            bookmark_interval: Duration::from_secs(5),
            max_watch_timeout: Duration::from_secs(1800),
            event_history: 4096,
            resync_interval: Duration::from_secs(1),
            pod_network: PodNetwork::Loopback,
        }
    }
}

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("creating the work directory {path}: {source}")]
    WorkDir { path: PathBuf, source: std::io::Error },
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("writing the kubeconfig {path}: {source}")]
    Kubeconfig { path: PathBuf, source: std::io::Error },
    #[error("building the kube client: {0}")]
    Client(String),
    #[error("setting up the cluster: {0}")]
    Setup(#[from] ApiError),
    #[error(transparent)]
    Kubelet(#[from] KubeletError),
    #[error("generating the cluster's certificates: {0}")]
    Pki(#[from] pki::PkiError),
    #[error("setting up TLS: {0}")]
    Tls(#[from] https::TlsError),
}

/// Whose credentials a kubeconfig or client carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// `kubernetes-admin` in `system:masters` (cluster-admin).
    Admin,
    /// Any user, by client certificate (`CN` = `name`, `O` = `group`).
    User {
        /// The user name.
        name: String,
        /// At most one group besides `system:authenticated`.
        group: Option<String>,
    },
    /// A node's credential: `system:node:<name>` in `system:nodes`, as a kubelet has.
    Node(String),
    /// A ServiceAccount's token (the ServiceAccount must exist).
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// How a kubeconfig's user authenticates.
#[derive(Debug, Clone)]
pub enum KubeconfigUser {
    /// A client certificate and its key (PEM).
    Certificate {
        /// The certificate.
        cert_pem: String,
        /// The private key.
        key_pem: String,
    },
    /// A bearer token.
    Token(String),
}

/// Lifetime of the ServiceAccount tokens in kubeconfigs the simulator writes (a year).
const KUBECONFIG_TOKEN_SECONDS: i64 = 365 * 24 * 3600;

/// [`Cluster::wait_ready_pods`] ran out of time.
#[derive(Debug, thiserror::Error)]
#[error("only {ready} of {wanted} pods matching {selector:?} became Ready in time")]
pub struct WaitTimeout {
    /// How many Ready pods were awaited.
    pub wanted: usize,
    /// How many were Ready at the deadline.
    pub ready: usize,
    /// The label selector.
    pub selector: String,
}

/// A running simulated cluster. Dropping it stops every pod process.
pub struct Cluster {
    shared: Arc<Shared>,
    addr: SocketAddr,
    tracker: TaskTracker,
    root: CancellationToken,
    /// The node agent's tasks, stopped before the API server so that none
    /// of its requests meets a closed server.
    agent: (TaskTracker, CancellationToken),
    work_dir: PathBuf,
    owns_work_dir: bool,
    kubeconfig: PathBuf,
    pki: Arc<ClusterPki>,
    /// The pod network's bridge, when pods have one.
    bridge: Option<Arc<Bridge>>,
    stopped: Mutex<bool>,
}

/// The text of a kubeconfig for `server` that trusts `ca_pem` and authenticates as `user`.
#[must_use]
pub fn kubeconfig_text(server: &str, ca_pem: &str, user: &KubeconfigUser) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let user = match user {
        KubeconfigUser::Certificate { cert_pem, key_pem } => {
            json!({"client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem)})
        }
        KubeconfigUser::Token(t) => json!({"token": t}),
    };
    let doc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "skipper-dev", "cluster": {
            "server": server, "certificate-authority-data": b64(ca_pem)}}],
        "contexts": [{"name": "skipper-dev", "context": {
            "cluster": "skipper-dev", "user": "skipper-dev", "namespace": "default"}}],
        "current-context": "skipper-dev",
        "users": [{"name": "skipper-dev", "user": user}],
    });
    serde_yaml_ng::to_string(&doc).unwrap_or_default()
}

impl Cluster {
    /// Starts the API server, the control loops and the pod runtime.
    ///
    /// # Errors
    /// [`ClusterError`] when the address cannot be bound or files cannot be written.
    pub async fn start(config: Config) -> Result<Self, ClusterError> {
        let (work_dir, owns_work_dir) = match &config.work_dir {
            Some(d) => (d.clone(), false),
            None => {
                let suffix: u64 = rand::random();
                (
                    std::env::temp_dir().join(format!("skipper-sim-{}-{suffix:016x}", std::process::id())),
                    true,
                )
            }
        };
        let bridge = match &config.pod_network {
            PodNetwork::Loopback => None,
            PodNetwork::Bridge(b) => Some(b.clone()),
        };
        // Pods on a bridge reach the host at its gateway only.
        let listen = bridge.as_ref().map_or(config.listen, |b| {
            SocketAddr::from((b.gateway(), config.listen.port()))
        });
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| ClusterError::Bind { addr: listen, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ClusterError::Bind { addr: listen, source })?;
        let mut serving_names = vec![addr.ip().to_string()];
        if addr.ip().is_unspecified() {
            serving_names.clear();
        }
        let pki = Arc::new(ClusterPki::generate(&serving_names)?);
        let tls = https::server_config(&pki)?;
        let store = Arc::new(Store::new(config.event_history));
        let mut namespaces = vec![
            "default".to_owned(),
            "kube-system".to_owned(),
            "kube-public".to_owned(),
            kubelet::agent::NODE_LEASE_NAMESPACE.to_owned(),
        ];
        for ns in &config.namespaces {
            if !namespaces.contains(ns) {
                namespaces.push(ns.clone());
            }
        }
        for ns in &namespaces {
            store.create(by_kind("Namespace"), "", json!({"metadata": {"name": ns}}))?;
        }
        for obj in rbac::bootstrap_policy() {
            let kind = obj["kind"].as_str().unwrap_or_default().to_owned();
            store.create(by_kind(&kind), "", obj)?;
        }
        let mut nodes: Vec<NodeSpec> = config
            .zones
            .iter()
            .enumerate()
            .map(|(i, zone)| NodeSpec {
                name: format!("sim-node-{i}"),
                zone: zone.clone(),
            })
            .collect();
        if nodes.is_empty() {
            nodes.push(NodeSpec {
                name: "sim-node-0".into(),
                zone: "zone-a".into(),
            });
        }
        let pod_root = work_dir.join("pods");
        std::fs::create_dir_all(&pod_root).map_err(|source| ClusterError::WorkDir {
            path: pod_root.clone(),
            source,
        })?;
        let kubeconfig = work_dir.join("kubeconfig");
        let admin = kubeconfig_text(
            &format!("https://{addr}"),
            pki.ca.cert_pem(),
            &KubeconfigUser::Certificate {
                cert_pem: pki.admin.cert_pem.clone(),
                key_pem: pki.admin.key_pem.clone(),
            },
        );
        if let Err(source) = pki::write_file(&kubeconfig, &admin, true).map_err(|e| match e {
            pki::PkiError::Write { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        }) {
            if owns_work_dir {
                let _ = std::fs::remove_dir_all(&work_dir);
            }
            return Err(ClusterError::Kubeconfig {
                path: kubeconfig,
                source,
            });
        }
        let kubelet = Arc::new(Kubelet::new(kubelet::Settings {
            skipper_exe: config.skipper_exe.clone(),
            pod_root,
            nodes,
            capacity: config.node_capacity.clone(),
            api_server: addr,
            backoff: config.restart_backoff,
            metrics_interval: config.metrics_interval,
            lease_duration: config.node_lease_duration,
            node_status_interval: Duration::from_secs(60),
            volume_resync: config.volume_resync,
            network: config.pod_network.clone(),
            // The simulated API server reads the agent's logs itself.
            api: None,
        }));
        let root = CancellationToken::new();
        let shared = Arc::new(Shared {
            store: store.clone(),
            kubelet: kubelet.clone(),
            faults: Faults::default(),
            watches: Mutex::new(root.child_token()),
            root: root.clone(),
            bookmark_interval: config.bookmark_interval,
            max_watch_timeout: config.max_watch_timeout,
            auth: Authenticator::new(pki.service_account.clone()),
        });
        let tracker = TaskTracker::new();
        let app = axum::Router::new()
            .fallback(server::handle)
            .with_state(shared.clone());
        tracker.spawn(https::serve(listener, tls, app, root.clone()));
        let token = root.clone();
        let resync = config.resync_interval;
        let loop_store = store.clone();
        let ctx = controllers::Context {
            ca_pem: pki.ca.cert_pem().to_owned(),
            ..controllers::Context::default()
        };
        tracker.spawn(async move {
            let store = loop_store;
            let mut rx = store.subscribe();
            loop {
                let pass_started = tokio::time::Instant::now();
                if let Err(e) = controllers::reconcile(&store, &ctx) {
                    tracing::debug!(error = %e, "reconcile pass");
                }
                // A pod turning available after minReadySeconds changes no
                // object: wake for it (just after, as availability is
                // "ready for longer than"), or resync, whichever is first.
                let next = controllers::next_wake(&store)
                    .map(|at| {
                        Duration::try_from(at.duration_since(jiff::Timestamp::now()))
                            .unwrap_or(Duration::ZERO)
                    })
                    .map_or(resync, |wait| (wait + MIN_READY_SLACK).min(resync));
                tokio::select! {
                    _ = rx.changed() => {}
                    () = tokio::time::sleep(next) => {}
                    () = token.cancelled() => break,
                }
                // Changes that arrive together are reconciled in one pass:
                // a pass copies every object, and a busy cluster (pod status,
                // leases) changes many times a millisecond.
                tokio::select! {
                    () = tokio::time::sleep_until(pass_started + RECONCILE_BATCH) => {}
                    () = token.cancelled() => break,
                }
            }
        });
        let cluster = Self {
            shared,
            addr,
            tracker,
            root,
            agent: (TaskTracker::new(), CancellationToken::new()),
            work_dir,
            owns_work_dir,
            kubeconfig,
            pki,
            bridge,
            stopped: Mutex::new(false),
        };
        // The agent authenticates per node, as kubelets do.
        let client_for = |node: &str| {
            cluster
                .client_for(&Credential::Node(node.to_owned()))
                .map_err(|e| e.to_string())
        };
        kubelet
            .start(client_for, &cluster.agent.0, &cluster.agent.1)
            .await?;
        tracing::info!(address = %addr, "simulated Kubernetes API server listening");
        Ok(cluster)
    }

    /// The API server address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:PORT`.
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The cluster CA certificate (PEM): what `ca.crt` of in-cluster
    /// configuration and the `kube-root-ca.crt` ConfigMaps hold.
    #[must_use]
    pub fn ca_pem(&self) -> &str {
        self.pki.ca.cert_pem()
    }

    /// The cluster's key material (to issue more certificates, e.g. a
    /// kubelet's serving certificate).
    #[must_use]
    pub fn pki(&self) -> &ClusterPki {
        &self.pki
    }

    /// The administrator's client certificate and key (`kubernetes-admin`, `system:masters`).
    #[must_use]
    pub fn admin_cert(&self) -> &pki::CertKey {
        &self.pki.admin
    }

    /// A kube-rs client for this cluster as the administrator (default namespace `default`).
    ///
    /// # Errors
    /// When the client cannot be built.
    pub fn client(&self) -> Result<kube::Client, ClusterError> {
        self.client_for(&Credential::Admin)
    }

    /// How `credential` authenticates: a fresh client certificate, or a
    /// ServiceAccount token valid for a year.
    ///
    /// # Errors
    /// `NotFound` for a missing ServiceAccount; certificate generation failures.
    pub fn kubeconfig_user(&self, credential: &Credential) -> Result<KubeconfigUser, ClusterError> {
        let cert = |c: pki::CertKey| KubeconfigUser::Certificate {
            cert_pem: c.cert_pem,
            key_pem: c.key_pem,
        };
        Ok(match credential {
            Credential::Admin => cert(self.pki.admin.clone()),
            Credential::User { name, group } => {
                let groups: Vec<&str> = group.iter().map(String::as_str).collect();
                cert(self.pki.ca.issue_client(name, &groups)?)
            }
            Credential::Node(node) => cert(
                self.pki
                    .ca
                    .issue_client(&format!("{}{node}", auth::NODE_USER_PREFIX), &[auth::NODES_GROUP])?,
            ),
            Credential::ServiceAccount { namespace, name } => {
                let spec = auth::TokenSpec {
                    expiration_seconds: KUBECONFIG_TOKEN_SECONDS,
                    ..auth::TokenSpec::default()
                };
                let (token, _) = self
                    .shared
                    .auth
                    .issue(&self.shared.store, namespace, name, &spec)?;
                KubeconfigUser::Token(token)
            }
        })
    }

    /// A kubeconfig (text) for this cluster as `credential`.
    ///
    /// # Errors
    /// As [`Cluster::kubeconfig_user`].
    pub fn kubeconfig_for(&self, credential: &Credential) -> Result<String, ClusterError> {
        Ok(kubeconfig_text(
            &self.base_url(),
            self.ca_pem(),
            &self.kubeconfig_user(credential)?,
        ))
    }

    /// A kube-rs client for this cluster as `credential`.
    ///
    /// # Errors
    /// As [`Cluster::kubeconfig_user`], or when the client cannot be built.
    pub fn client_for(&self, credential: &Credential) -> Result<kube::Client, ClusterError> {
        let url = self
            .base_url()
            .parse()
            .map_err(|e: http::uri::InvalidUri| ClusterError::Client(e.to_string()))?;
        let mut config = kube::Config::new(url);
        config.root_cert = Some(vec![self.pki.ca.cert_der().to_vec()]);
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let auth = match self.kubeconfig_user(credential)? {
            KubeconfigUser::Certificate { cert_pem, key_pem } => {
                json!({"client-certificate-data": b64(&cert_pem), "client-key-data": b64(&key_pem)})
            }
            KubeconfigUser::Token(t) => json!({"token": t}),
        };
        config.auth_info = serde_json::from_value(auth).map_err(|e| ClusterError::Client(e.to_string()))?;
        kube::Client::try_from(config).map_err(|e| ClusterError::Client(e.to_string()))
    }

    /// The administrator's kubeconfig the cluster wrote into its work directory.
    #[must_use]
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes the administrator's kubeconfig for this cluster to `path` (mode 0600).
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent)?;
        }
        let text = self
            .kubeconfig_for(&Credential::Admin)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        pki::write_file(path, &text, true).map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// Creates a namespace (no error when it exists).
    ///
    /// # Errors
    /// When the name is invalid.
    pub fn create_namespace(&self, name: &str) -> Result<(), ApiError> {
        match self
            .shared
            .store
            .create(by_kind("Namespace"), "", json!({"metadata": {"name": name}}))
        {
            Ok(_) | Err(ApiError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// SIGKILLs the main process of a pod's (first running) container, as a
    /// crash would: every process of that container dies, the container
    /// turns unready and restarts under the pod's `restartPolicy` (with the
    /// crash back-off); under `restartPolicy: Never` the pod ends `Failed`.
    ///
    /// # Errors
    /// `NotFound` when no container of the pod runs.
    pub fn kill_pod_process(&self, ns: &str, name: &str) -> Result<u32, ApiError> {
        self.shared
            .kubelet
            .kill_process(ns, name)
            .ok_or_else(|| ApiError::NotFound {
                res: by_kind("Pod"),
                name: name.to_owned(),
            })
    }

    /// Ends every open watch (clients resume from their last resourceVersion).
    pub fn drop_watches(&self) {
        self.shared.drop_watches();
    }

    /// Forgets the event history, so re-watching from any older resourceVersion gets `410 Gone`.
    pub fn compact(&self) {
        self.shared.store.compact();
    }

    /// The next `n` API writes fail with `status` (a `Status` body with the
    /// matching reason). The node agent writes too (leases, pod status):
    /// [`Cluster::fail_next_writes_in`] confines the failures to a namespace.
    pub fn fail_next_writes(&self, n: u32, status: StatusCode) {
        self.shared.faults.fail_next_writes(n, status, None);
    }

    /// The next `n` API writes in namespace `ns` fail with `status`.
    pub fn fail_next_writes_in(&self, ns: &str, n: u32, status: StatusCode) {
        self.shared.faults.fail_next_writes(n, status, Some(ns));
    }

    /// Answers every request in namespace `ns` with `403 Forbidden` (as a
    /// missing RBAC grant would), until [`Cluster::allow_namespace`].
    pub fn forbid_namespace(&self, ns: &str) {
        self.shared.faults.forbid_namespace(ns);
    }

    /// Lifts [`Cluster::forbid_namespace`].
    pub fn allow_namespace(&self, ns: &str) {
        self.shared.faults.allow_namespace(ns);
    }

    /// Delays every API request by `d` (zero turns it off).
    pub fn set_latency(&self, d: Duration) {
        self.shared.faults.set_latency(d);
    }

    /// The host pid of the main process of a pod's (first running) container.
    #[must_use]
    pub fn pod_pid(&self, ns: &str, name: &str) -> Option<u32> {
        self.shared.kubelet.pid_of(ns, name)
    }

    /// The directory of a pod on its node, while the pod exists: its volumes
    /// (`volumes/<name>`), container logs (`logs/<container>/<restart>.log`)
    /// and each container's private `/tmp` (`containers/<container>/tmp`).
    #[must_use]
    pub fn pod_dir(&self, ns: &str, name: &str) -> Option<PathBuf> {
        self.shared.store.get(by_kind("Pod"), ns, name)?;
        Some(self.shared.kubelet.pod_dir(ns, name))
    }

    /// Host pids of the main processes of every running container.
    #[must_use]
    pub fn pod_pids(&self) -> Vec<u32> {
        self.shared.kubelet.pids()
    }

    /// One stored object as JSON (`kind` as in [`resources::RESOURCES`], e.g. `"Pod"`).
    #[must_use]
    pub fn get(&self, kind: &str, ns: &str, name: &str) -> Option<Value> {
        self.shared.store.get(by_kind(kind), ns, name)
    }

    /// Pods of a namespace that match a label selector (query syntax) and are Ready.
    #[must_use]
    pub fn ready_pods(&self, ns: &str, selector: &str) -> Vec<Value> {
        let Ok(sel) = selector::LabelSelector::parse(selector) else {
            return Vec::new();
        };
        let (pods, _) = self.shared.store.list(by_kind("Pod"), Some(ns));
        pods.into_iter()
            .filter(|p| sel.matches_object(p) && controllers::pod_ready(p) && !store::is_terminating(p))
            .collect()
    }

    /// Waits (on store notifications, at most `timeout`) until at least `n`
    /// pods of `ns` matching `selector` are Ready, and returns them.
    ///
    /// # Errors
    /// [`WaitTimeout`] with the number that were Ready when time ran out.
    pub async fn wait_ready_pods(
        &self,
        ns: &str,
        selector: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<Value>, WaitTimeout> {
        let mut rx = self.shared.store.subscribe();
        let wait = async {
            loop {
                rx.borrow_and_update();
                let pods = self.ready_pods(ns, selector);
                if pods.len() >= n {
                    return pods;
                }
                if rx.changed().await.is_err() {
                    // The store lives as long as `self`; keep the deadline in charge.
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| WaitTimeout {
                wanted: n,
                ready: self.ready_pods(ns, selector).len(),
                selector: selector.to_owned(),
            })
    }

    fn stop_now(&self) {
        let mut stopped = self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *stopped {
            return;
        }
        *stopped = true;
        self.stop_agent();
        self.root.cancel();
        self.tracker.close();
    }

    fn stop_agent(&self) {
        self.shared.kubelet.kill_all();
        self.agent.1.cancel();
        self.agent.0.close();
    }

    /// Stops every pod process and the node agent, then the server and the
    /// control loops, waiting (at most 10 seconds) for them to end.
    pub async fn shutdown(self) {
        self.stop_agent();
        if tokio::time::timeout(Duration::from_secs(5), self.agent.0.wait())
            .await
            .is_err()
        {
            tracing::warn!("node agent tasks did not stop within 5s");
        }
        self.stop_now();
        if tokio::time::timeout(Duration::from_secs(10), self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("simulator tasks did not stop within 10s");
        }
        if let Some(bridge) = &self.bridge {
            bridge.remove();
        }
    }

    /// The pod network's bridge, when pods have one.
    #[must_use]
    pub fn bridge(&self) -> Option<&Bridge> {
        self.bridge.as_deref()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_now();
        if let Some(bridge) = &self.bridge {
            bridge.remove();
        }
        if self.owns_work_dir {
            // A pod task that has not seen the cancellation yet may still add a
            // file while the tree is removed; a few passes get everything.
            for _ in 0..5 {
                if std::fs::remove_dir_all(&self.work_dir).is_ok() || !self.work_dir.exists() {
                    break;
                }
            }
        }
    }
}

/// The standard fixture pool Deployment (spec §3.4), as
/// `manifests/example-pool.yaml` writes it: label and selector
/// `skipper/deployment: <name>` plus `skipper/tenant DoesNotExist`, template
/// annotation `skipper/port: http`, container port `http: 8888`, command
/// `skipper fixture` listening on the pod IP, `SKIPPER_PUBLIC_KEY`,
/// readiness probe `/healthz`, and an `emptyDir` at `/tmp` (the token file
/// survives container restarts).
#[must_use]
pub fn pool_deployment_json(namespace: &str, name: &str, replicas: i32, public_key_pem: &str) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"skipper/deployment": name}},
        "spec": {
            "replicas": replicas,
            "selector": {
                "matchLabels": {"skipper/deployment": name},
                "matchExpressions": [{"key": "skipper/tenant", "operator": "DoesNotExist"}],
            },
            "template": {
                "metadata": {"labels": {"skipper/deployment": name}, "annotations": {"skipper/port": "http"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    // Pod Security `restricted`, as manifests/example-pool.yaml.
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "fixture",
                        "image": "skipper",
                        "command": ["skipper", "fixture"],
                        "args": ["--log-format", "text"],
                        "ports": [{"name": "http", "containerPort": 8888}],
                        "env": [
                            {"name": "SKIPPER_PUBLIC_KEY", "value": public_key_pem},
                            {"name": "SKIPPER_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            // CPU profiles on the pod IP, as in manifests/example-pool.yaml.
                            {"name": "SKIPPER_PPROF_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "SKIPPER_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "SKIPPER_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                        ],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                                           "periodSeconds": 1, "failureThreshold": 3},
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                                            "capabilities": {"drop": ["ALL"]}},
                    }],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    })
}

/// [`pool_deployment_json`] as a typed Deployment.
///
/// # Panics
/// Never: the manifest is a fixed, valid Deployment.
#[must_use]
pub fn pool_deployment(
    namespace: &str,
    name: &str,
    replicas: i32,
    public_key_pem: &str,
) -> k8s_openapi::api::apps::v1::Deployment {
    #[allow(clippy::expect_used)] // the JSON above is a valid Deployment by construction
    serde_json::from_value(pool_deployment_json(namespace, name, replicas, public_key_pem))
        .expect("pool deployment manifest is a valid Deployment")
}
