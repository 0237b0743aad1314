//! A real Kubernetes cluster on this machine: the control plane of
//! [`super::control_plane`] (etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, built by `make control-plane`) with the node agent of
//! [`super::kubelet`] as its nodes, pods on a real pod network.
//!
//! [`RealCluster::start`]:
//! 1. creates the pod network: a bridge on a private /24 with the gateway on
//!    the host ([`Bridge`]); every pod gets its own network namespace and an
//!    address on it, so Services publish pods in their EndpointSlices (a
//!    real control plane refuses loopback endpoint addresses);
//! 2. starts the control plane with kube-apiserver serving and advertising
//!    the gateway address, so pods reach it in-cluster
//!    (`KUBERNETES_SERVICE_HOST`/`PORT`, their ServiceAccount token) and the
//!    `kubernetes` Service has that endpoint, as on a real cluster;
//! 3. starts the nodes, each authenticated as the node (`system:node:<name>`
//!    in `system:nodes`: the Node authorizer and NodeRestriction limit it to
//!    its own Node, Lease and pods): by default the node agent of
//!    [`super::kubelet`] with one client per node, serving the kubelet API
//!    ([`super::kubelet::api`]: container logs for `kubectl logs`) on port
//!    10250 of the gateway, every node's `InternalIP`, which kube-apiserver
//!    calls with its kubelet client certificate; with [`Nodes::Kubelet`]
//!    upstream kubelets and containerd ([`super::kubelet_nodes`]), running
//!    pods from images, with kube-apiserver serving on port 443 of the
//!    gateway and the Service cluster IPs in the bridge's first /27, so the
//!    `kubernetes` Service's cluster IP is the gateway itself (there is no
//!    kube-proxy; pods find the API server from the variables the kubelet
//!    derives from that Service);
//! 4. creates the requested namespaces (once their `default` ServiceAccount
//!    exists, pods can be admitted there);
//! 5. optionally serves `metrics.k8s.io`: from the agent's samples through an
//!    APIService ([`super::metrics_api`]), as metrics-server does, or, on
//!    kubelet nodes, by metrics-server itself scraping the kubelets.
//!
//! [`RealCluster::shutdown`] stops the pods and the nodes, then the control
//! plane, then removes the pod network. Dropping the value does the same
//! without waiting (processes are SIGKILLed; what kubelet nodes leave is
//! removed when nodes start next, see [`super::kubelet_nodes`]). A cluster
//! that owns its work directory holds a lock file naming it under
//! [`WORK_DIR_LOCKS`]; when its process is SIGKILLed, the next cluster to
//! start removes the directory (etcd's data, containerd's images and
//! snapshots) and the lock file ([`sweep_work_dirs`]).
//!
//! Bridge mode needs root (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN`) and the `ip`
//! command of iproute2; [`RealCluster::start`] fails with one line naming
//! what is missing.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::control_plane::{self, ControlPlane, ControlPlaneError};
use super::kubelet::network::{Bridge, NetworkError};
use super::kubelet::{self, BackoffPolicy, Capacity, Kubelet, KubeletError, NodeSpec, PodNetwork};
use super::kubelet_nodes::{self, KubeletNodes, MetricsServer, NodesError};
use super::lockfile::{self, Lock};
use super::metrics_api::{self, MetricsApiError};
use super::pki::PkiError;

/// Where the lock files of the work directories real clusters own live
/// (each names its directory; see [`sweep_work_dirs`]).
pub const WORK_DIR_LOCKS: &str = "/run/skipper-real";
/// Owned work directories are `skipper-real-<pid>-<random>` in the
/// temporary directory.
const WORK_DIR_PREFIX: &str = "skipper-real-";

/// How long the agent's tasks may take to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new namespace's `default` ServiceAccount may take to appear.
const NAMESPACE_READY: Duration = Duration::from_secs(30);

/// How the cluster runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The control plane (`bin_dir` is where `make control-plane` put the
    /// binaries). Its `bind_address` is set to the pod network's gateway.
    pub control_plane: control_plane::Config,
    /// The skipper binary: the agent's sandbox shim, and `skipper` in
    /// container commands.
    pub skipper_exe: PathBuf,
    /// The nodes.
    pub nodes: Vec<NodeSpec>,
    /// Who runs the pods: the node agent (the default) or kubelet nodes.
    pub node_kind: Nodes,
    pub capacity: Capacity,
    pub restart_backoff: BackoffPolicy,
    /// How often container CPU and memory are sampled.
    pub metrics_interval: Duration,
    /// How often ConfigMap, Secret, downward API and token volumes are refreshed.
    pub volume_resync: Duration,
    /// `leaseDurationSeconds` of node Leases.
    pub lease_duration: Duration,
    /// Namespaces created at start.
    pub namespaces: Vec<String>,
    /// Serve `metrics.k8s.io` (pod metrics from the agent's samples).
    pub metrics_api: bool,
    /// Holds the control plane's files (`control-plane/`) and the pods'
    /// directories (`pods/`); a fresh temporary directory (removed at the
    /// end) when `None`.
    pub work_dir: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            control_plane: control_plane::Config::default(),
            skipper_exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("skipper")),
            nodes: vec![NodeSpec {
                name: "node-0".into(),
                zone: "zone-a".into(),
            }],
            capacity: Capacity::default(),
            restart_backoff: BackoffPolicy::default(),
            metrics_interval: Duration::from_secs(10),
            volume_resync: Duration::from_secs(60),
            lease_duration: Duration::from_secs(40),
            namespaces: Vec::new(),
            metrics_api: false,
            node_kind: Nodes::Agent,
            work_dir: None,
        }
    }
}

/// Who runs a cluster's pods.
#[derive(Debug, Clone, Default)]
pub enum Nodes {
    /// The node agent of [`super::kubelet`]: pods are processes of the host
    /// (`skipper` in a command is [`Config::skipper_exe`]); images are ignored.
    #[default]
    Agent,
    /// Upstream kubelets and containerd ([`super::kubelet_nodes`]): pods run
    /// from the images imported into the nodes.
    Kubelet(kubelet_nodes::Config),
}

/// Why the cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum RealClusterError {
    #[error("pod network: {0}")]
    Network(#[from] NetworkError),
    #[error("control plane: {0}")]
    ControlPlane(#[from] ControlPlaneError),
    #[error("node agent: {0}")]
    Kubelet(#[from] KubeletError),
    #[error("kubelet nodes: {0}")]
    KubeletNodes(#[from] NodesError),
    #[error("metrics.k8s.io: {0}")]
    MetricsApi(#[from] MetricsApiError),
    #[error("the node agent's serving certificate: {0}")]
    AgentCertificate(PkiError),
    #[error("creating {path}: {source}")]
    WorkDir { path: PathBuf, source: std::io::Error },
    #[error("creating namespace {name}: {source}")]
    Namespace { name: String, source: Box<kube::Error> },
    #[error("namespace {name}: no default ServiceAccount after {waited:?}")]
    NamespaceNotReady { name: String, waited: Duration },
}

/// A running cluster. Dropping it kills every process and removes the pod
/// network; [`RealCluster::shutdown`] stops it in order.
pub struct RealCluster {
    plane: Option<ControlPlane>,
    kubelet: Arc<Kubelet>,
    kubelet_nodes: Option<KubeletNodes>,
    metrics_server: Option<MetricsServer>,
    bridge: Arc<Bridge>,
    tracker: TaskTracker,
    stop: CancellationToken,
    work_dir: PathBuf,
    owns_work_dir: bool,
    /// Held while the owned work directory is in use (see [`sweep_work_dirs`]).
    work_dir_lock: Option<Lock>,
    metrics_api: Option<SocketAddr>,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealCluster")
            .field("plane", &self.plane)
            .field("bridge", &self.bridge.name())
            .field("work_dir", &self.work_dir)
            .finish_non_exhaustive()
    }
}

impl metrics_api::UsageSource for Kubelet {
    fn pods(&self, namespace: Option<&str>) -> Vec<metrics_api::PodUsage> {
        self.usages(namespace)
            .into_iter()
            .map(|s| metrics_api::PodUsage {
                namespace: s.namespace,
                name: s.name,
                labels: s.labels,
                timestamp: s.usage.timestamp,
                window: s.usage.window,
                containers: s
                    .usage
                    .containers
                    .into_iter()
                    .map(|c| metrics_api::ContainerUsage {
                        name: c.name,
                        cpu_millis: c.cpu_millis,
                        memory_bytes: c.memory_bytes,
                    })
                    .collect(),
            })
            .collect()
    }
}

/// The user name of a node's credential.
#[must_use]
pub fn node_user(node: &str) -> String {
    format!("system:node:{node}")
}

/// The group of every node's credential.
pub const NODES_GROUP: &str = "system:nodes";

impl RealCluster {
    /// Creates the pod network, starts the control plane on its gateway and
    /// the node agent, creates the namespaces and (optionally) serves pod
    /// metrics.
    ///
    /// # Errors
    /// [`RealClusterError`]; whatever started is stopped again.
    pub async fn start(config: Config) -> Result<Self, RealClusterError> {
        let (work_dir, owns_work_dir) = match &config.work_dir {
            Some(d) => (d.clone(), false),
            None => {
                let suffix: u64 = rand::random();
                (
                    std::env::temp_dir()
                        .join(format!("{WORK_DIR_PREFIX}{}-{suffix:016x}", std::process::id())),
                    true,
                )
            }
        };
        let pods = work_dir.join("pods");
        std::fs::create_dir_all(&pods).map_err(|source| RealClusterError::WorkDir {
            path: pods.clone(),
            source,
        })?;
        let cleanup = |e: RealClusterError| {
            if owns_work_dir {
                let _ = std::fs::remove_dir_all(&work_dir);
            }
            e
        };
        if let Nodes::Kubelet(nodes) = &config.node_kind {
            // Before the bridge: a slot is reused only once the pods of a
            // dead harness's nodes on it are gone.
            kubelet_nodes::check(nodes, config.nodes.len()).map_err(|e| cleanup(e.into()))?;
            kubelet_nodes::sweep(nodes.stop_timeout)
                .await
                .map_err(|e| cleanup(e.into()))?;
        }
        let bridge = Arc::new(Bridge::create().map_err(|e| cleanup(e.into()))?);
        // After the bridge (the privileges are there) and the nodes' sweep
        // (nothing of a dead harness runs in its directory any more).
        let work_dir_lock = if owns_work_dir {
            if matches!(config.node_kind, Nodes::Agent) {
                kubelet_nodes::sweep(kubelet_nodes::Config::default().stop_timeout)
                    .await
                    .map_err(|e| cleanup(e.into()))?;
            }
            sweep_work_dirs();
            Some(lock_work_dir(&work_dir).map_err(cleanup)?)
        } else {
            None
        };
        let mut cp = config.control_plane.clone();
        cp.bind_address = bridge.gateway();
        // Either kind of node serves the kubelet API (logs, the node proxy).
        cp.kubelet_client = true;
        if matches!(config.node_kind, Nodes::Kubelet(_)) {
            cp.secure_port = Some(kubelet_nodes::API_SERVER_PORT);
            cp.service_cluster_ip_range = Some(kubelet_nodes::service_range(bridge.subnet().0));
        }
        if cp.work_dir.is_none() {
            cp.work_dir = Some(work_dir.join("control-plane"));
        }
        let plane = ControlPlane::start(cp).await.map_err(|e| cleanup(e.into()))?;
        let (agent_nodes, api) = match config.node_kind {
            Nodes::Agent => {
                let api = agent_api(&plane, bridge.gateway(), &config.nodes)
                    .map_err(|e| cleanup(RealClusterError::AgentCertificate(e)))?;
                (config.nodes.clone(), Some(api))
            }
            Nodes::Kubelet(_) => (Vec::new(), None),
        };
        let kubelet = Arc::new(Kubelet::new(kubelet::Settings {
            skipper_exe: config.skipper_exe.clone(),
            pod_root: pods,
            nodes: agent_nodes,
            capacity: config.capacity.clone(),
            api_server: plane.addr(),
            backoff: config.restart_backoff,
            metrics_interval: config.metrics_interval,
            lease_duration: config.lease_duration,
            node_status_interval: Duration::from_secs(60),
            volume_resync: config.volume_resync,
            network: PodNetwork::Bridge(bridge.clone()),
            api,
        }));
        let mut cluster = Self {
            plane: Some(plane),
            kubelet,
            kubelet_nodes: None,
            metrics_server: None,
            bridge,
            tracker: TaskTracker::new(),
            stop: CancellationToken::new(),
            work_dir,
            owns_work_dir,
            work_dir_lock,
            metrics_api: None,
        };
        // From here on, dropping `cluster` undoes everything.
        match &config.node_kind {
            Nodes::Agent => cluster.start_agent(&config).await?,
            Nodes::Kubelet(nodes) => {
                let started = KubeletNodes::start(
                    nodes,
                    &config.nodes,
                    cluster.bridge.clone(),
                    cluster.control_plane(),
                    &cluster.work_dir,
                )
                .await?;
                cluster.kubelet_nodes = Some(started);
            }
        }
        cluster.create_namespaces(&config.namespaces).await?;
        if let (true, Nodes::Kubelet(nodes)) = (config.metrics_api, &config.node_kind) {
            let server = MetricsServer::start(
                cluster.control_plane(),
                &nodes.bin_dir,
                &cluster.work_dir.join("metrics-server"),
                Duration::from_secs(60),
            )
            .await?;
            cluster.metrics_api = Some(SocketAddr::from(([127, 0, 0, 1], server.port())));
            cluster.metrics_server = Some(server);
        } else if config.metrics_api {
            let registration = metrics_api::Registration {
                namespace: "kube-system".into(),
                service: "metrics-server".into(),
                port: 0,
                front_proxy: cluster.control_plane().front_proxy(),
                available_within: Duration::from_secs(60),
            };
            let admin = cluster.client().await?;
            let registered = metrics_api::register_and_serve(
                &admin,
                &registration,
                cluster.kubelet.clone(),
                &cluster.tracker,
                &cluster.stop,
            )
            .await?;
            cluster.metrics_api = Some(registered.addr);
        }
        tracing::info!(
            server = %cluster.server(),
            bridge = %cluster.bridge.name(),
            "real cluster ready"
        );
        Ok(cluster)
    }

    async fn start_agent(&self, config: &Config) -> Result<(), RealClusterError> {
        let mut clients = BTreeMap::new();
        for n in &config.nodes {
            let client = self
                .control_plane()
                .client_for(&node_user(&n.name), &[NODES_GROUP])
                .await?;
            clients.insert(n.name.clone(), client);
        }
        self.kubelet
            .start(
                |node| {
                    clients
                        .get(node)
                        .cloned()
                        .ok_or_else(|| format!("no credential for node {node}"))
                },
                &self.tracker,
                &self.stop,
            )
            .await?;
        Ok(())
    }

    async fn create_namespaces(&self, names: &[String]) -> Result<(), RealClusterError> {
        if names.is_empty() {
            return Ok(());
        }
        let admin = self.client().await?;
        let api: Api<Namespace> = Api::all(admin.clone());
        for name in names {
            let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).map_err(|e| {
                RealClusterError::Namespace {
                    name: name.clone(),
                    source: Box::new(kube::Error::SerdeError(e)),
                }
            })?;
            match api.create(&PostParams::default(), &ns).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => {
                    return Err(RealClusterError::Namespace {
                        name: name.clone(),
                        source: Box::new(e),
                    });
                }
            }
        }
        // Pods are admitted once their ServiceAccount exists.
        let begin = tokio::time::Instant::now();
        for name in names {
            let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), name);
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                if matches!(sas.get_opt("default").await, Ok(Some(_))) {
                    break;
                }
                if begin.elapsed() > NAMESPACE_READY {
                    return Err(RealClusterError::NamespaceNotReady {
                        name: name.clone(),
                        waited: begin.elapsed(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The control plane (kubeconfigs and clients for any identity,
    /// `compact`, process ids, logs).
    ///
    /// # Panics
    /// Never: the control plane is present until [`RealCluster::shutdown`]
    /// consumes the value.
    #[must_use]
    pub fn control_plane(&self) -> &ControlPlane {
        #[allow(clippy::expect_used)] // only `shutdown` (which consumes self) takes it
        self.plane
            .as_ref()
            .expect("the control plane runs until shutdown")
    }

    /// A client as the administrator.
    ///
    /// # Errors
    /// [`RealClusterError::ControlPlane`].
    pub async fn client(&self) -> Result<kube::Client, RealClusterError> {
        Ok(self.control_plane().client().await?)
    }

    /// The administrator's kubeconfig.
    #[must_use]
    pub fn admin_kubeconfig(&self) -> &Path {
        self.control_plane().admin_kubeconfig()
    }

    /// The API server's URL (`https://<gateway>:<port>`).
    #[must_use]
    pub fn server(&self) -> &str {
        self.control_plane().server()
    }

    /// The node agent (processes, fault hooks, usage, logs, pod
    /// directories); it runs no node on a cluster of kubelet nodes.
    #[must_use]
    pub fn kubelet(&self) -> &Arc<Kubelet> {
        &self.kubelet
    }

    /// The kubelet nodes, on a cluster of them.
    #[must_use]
    pub fn kubelet_nodes(&self) -> Option<&KubeletNodes> {
        self.kubelet_nodes.as_ref()
    }

    /// The pod network.
    #[must_use]
    pub fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    /// Where `metrics.k8s.io` is served, when it is.
    #[must_use]
    pub fn metrics_api(&self) -> Option<SocketAddr> {
        self.metrics_api
    }

    /// The work directory.
    #[must_use]
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// Stops every pod (SIGKILL, as when the node goes away) and the agent,
    /// then the control plane (SIGTERM in reverse start order), then
    /// removes the pod network.
    pub async fn shutdown(mut self) {
        self.stop_agent();
        if tokio::time::timeout(STOP_TIMEOUT, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("node agent tasks did not stop within {STOP_TIMEOUT:?}");
        }
        if let Some(server) = self.metrics_server.take() {
            server.shutdown(STOP_TIMEOUT).await;
        }
        if let Some(nodes) = self.kubelet_nodes.take() {
            nodes.shutdown().await;
        }
        if let Some(plane) = self.plane.take() {
            plane.shutdown().await;
        }
        self.bridge.remove();
    }

    fn stop_agent(&self) {
        self.kubelet.kill_all();
        self.stop.cancel();
        self.tracker.close();
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        self.stop_agent();
        drop(self.metrics_server.take());
        drop(self.kubelet_nodes.take());
        drop(self.plane.take());
        self.bridge.remove();
        if self.owns_work_dir {
            // A pod task that has not seen the cancellation yet may still add
            // a file while the tree is removed; a few passes get everything.
            for _ in 0..5 {
                if std::fs::remove_dir_all(&self.work_dir).is_ok() || !self.work_dir.exists() {
                    break;
                }
            }
        }
        // Kept (released) while the directory is there: the next start
        // removes what is left.
        if let Some(lock) = self.work_dir_lock.take()
            && !self.work_dir.exists()
        {
            lock.remove();
        }
    }
}

/// The node agent's kubelet API: on the nodes' address (the gateway), with a
/// serving certificate of the cluster CA for it and the node names, and
/// kube-apiserver's client certificate (of the same CA) required.
fn agent_api(
    plane: &ControlPlane,
    gateway: std::net::Ipv4Addr,
    nodes: &[NodeSpec],
) -> Result<kubelet::api::ApiSettings, PkiError> {
    let mut names = vec![gateway.to_string()];
    names.extend(nodes.iter().map(|n| n.name.clone()));
    let serving = plane.pki().ca.issue_serving("skipper-node-agent", &names)?;
    Ok(kubelet::api::ApiSettings {
        port: kubelet::api::KUBELET_PORT,
        client_ca_der: plane.pki().ca.cert_der().to_vec(),
        serving,
    })
}

/// Takes the lock of the owned work directory `dir` (a file under
/// [`WORK_DIR_LOCKS`] naming it).
fn lock_work_dir(dir: &Path) -> Result<Lock, RealClusterError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let path = Path::new(WORK_DIR_LOCKS).join(format!("{name}.lock"));
    let fail = |source| RealClusterError::WorkDir {
        path: path.clone(),
        source,
    };
    let mut lock = Lock::try_take(&path)
        .map_err(fail)?
        .ok_or_else(|| fail(std::io::Error::other("held by another process")))?;
    lock.write(&dir.display().to_string()).map_err(fail)?;
    Ok(lock)
}

/// Removes the work directories of real clusters whose process is gone
/// (SIGKILLed: nothing of its cleanup ran): etcd's data, the pods' and the
/// kubelet nodes' directories (containerd's images and snapshots). Only a
/// directory a lock file under [`WORK_DIR_LOCKS`] names, of the name an
/// owned work directory has, in the temporary directory, is removed.
pub fn sweep_work_dirs() {
    let temp = std::env::temp_dir();
    for (_, path) in lockfile::list(Path::new(WORK_DIR_LOCKS)) {
        let Ok(Some(lock)) = Lock::try_take(&path) else {
            continue;
        };
        let dir = PathBuf::from(lock.read().trim());
        let owned = dir.parent() == Some(temp.as_path())
            && dir
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(WORK_DIR_PREFIX));
        if owned && dir.exists() {
            tracing::info!(dir = %dir.display(), "removing the work directory of a real cluster that is gone");
            if std::fs::remove_dir_all(&dir).is_err() && dir.exists() {
                continue;
            }
        }
        lock.remove();
    }
}
