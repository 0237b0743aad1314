//! The node agent ("kubelet"): runs the pods bound to its nodes as real
//! processes, talking to the cluster only through the Kubernetes API with a
//! kube-rs [`kube::Client`] per node (each with that node's credential) —
//! the same agent serves the in-process simulator and a real control plane.
//!
//! It registers its Nodes (capacity and allocatable, zone and hostname
//! labels, an `InternalIP` address, the `Ready` condition) and renews their
//! heartbeat Leases in `kube-node-lease`; it watches the pods whose
//! `spec.nodeName` is one of its nodes and runs each in a [`worker`]:
//!
//! - **Network** ([`network`], [`Settings::network`]): with
//!   [`PodNetwork::Bridge`] (root; the real cluster of
//!   [`super::real_cluster`], and `skipper dev` when it can) each pod gets its own network namespace with
//!   `eth0` on the agent's bridge, a routable IP of the bridge's /24 and its
//!   own `lo`; every container, exec probe and exec hook joins it. With
//!   [`PodNetwork::Loopback`] (the simulator's default, also without
//!   privileges) each pod gets its own loopback IP (`127.a.b.c`) in the
//!   host's network namespace.
//! - **Sandbox**: each container runs in its own mount, PID and UTS namespaces
//!   ([`sandbox`]) with a private `/tmp` and home (`/root`, `HOME`), the
//!   pod's hostname, a kubelet-style `/etc/hosts`, and its volumes at their
//!   `mountPath` ([`volumes`]: `emptyDir`, `hostPath`, `configMap`,
//!   `secret`, `downwardAPI`, `projected` with ServiceAccount tokens from
//!   the TokenRequest API). The container's command is PID 1 of its
//!   namespace: signals reach only it, and its other processes die with it.
//!   Pods die with the agent (`PR_SET_PDEATHSIG` on the shim and PID 1).
//! - **Containers**: init containers run in order, each to completion,
//!   before the others; sidecars (`restartPolicy: Always` init containers)
//!   start in order and keep running; then every container starts.
//! - **Environment** ([`env`]): `envFrom`, `env` with `$(VAR)` expansion,
//!   `fieldRef`, `resourceFieldRef`, `configMapKeyRef`, `secretKeyRef`, and
//!   the `kubernetes` service variables (`KUBERNETES_SERVICE_HOST`/`PORT`)
//!   pointing at the API server the agent serves.
//! - **Probes** ([`probe`]): `httpGet`, `tcpSocket`, `grpc`, `exec` with
//!   every timing field and the kubelet's defaults; the startup probe gates
//!   the others, a failed liveness (or startup) probe restarts the
//!   container, readiness drives `Ready`/`ContainersReady` (and so the
//!   EndpointSlice conditions).
//! - **Restarts** ([`restart`]): `Always`/`OnFailure`/`Never`,
//!   `restartCount`, `lastState.terminated`, `CrashLoopBackOff` with the
//!   kubelet's back-off (10 s doubling to 5 min, reset after 10 min of
//!   running; [`Settings::backoff`] scales it).
//! - **Termination**: on deletion each container's `preStop` hook (`exec`,
//!   `httpGet`, `sleep`) runs within `terminationGracePeriodSeconds`, then
//!   SIGTERM goes to its main process with what is left (at least 2 s), then
//!   SIGKILL; sidecars stop after the regular containers. The final status
//!   is reported and the pod deleted for good (grace 0, uid precondition).
//! - **Status** ([`status`]): phase, conditions and container statuses as
//!   the kubelet computes them, written to `pods/{name}/status`.
//!
//! # Where this agent differs from a real kubelet
//!
//! | Feature | Real kubelet | This agent |
//! |---|---|---|
//! | Images | Pulled and unpacked per container | Ignored: a container sees the host's filesystem (except its private `/tmp` and `/root` and its volumes); `skipper` in a command (and a container without `command`, whose entrypoint is `skipper`, with `fixture` when there are no `args`) runs the agent's own binary |
//! | Network | A network namespace per pod, wired by a CNI plugin; Services reached through kube-proxy | Bridge mode (root): a network namespace per pod on one bridge per agent (a private /24, gateway on the host), as the CNI `bridge` plugin does; `hostNetwork` pods stay in the host's namespace with the node's address (the gateway); no kube-proxy, so cluster IPs do not route; no NAT, so pods reach the host's addresses but nothing beyond it, and pods of different agents cannot reach each other. Loopback mode (the simulator's default, also without privileges): pods share the host's network namespace with a loopback IP each; a program must bind that IP (`fieldRef: status.podIP`), two pods binding the wildcard address on one port collide |
//! | Service variables | Docker-link variables for every Service with a cluster IP | Only the `kubernetes` ones, pointing at the API server the agent talks to (Services here have no cluster IP) |
//! | Cluster DNS | `resolv.conf` pointing at cluster DNS | The host's `resolv.conf` |
//! | `securityContext` | User, groups, capabilities, read-only root, seccomp applied | Not applied: containers run as the agent's user (said once, at start, in the agent's log) |
//! | Resource limits | cgroups enforce CPU and memory limits; OOM kills | Not enforced; requests count for scheduling only |
//! | `emptyDir.medium: Memory`, `sizeLimit` | tmpfs, eviction over the limit | A directory on disk, no limit |
//! | Volumes | Also PVCs, CSI, NFS, image volumes, ... | `emptyDir`, `hostPath`, `configMap`, `secret`, `downwardAPI`, `projected`; others keep the pod in `ContainerCreating` with a `MountVolume.SetUp failed` message |
//! | HTTP probes and hooks | `HTTP` and `HTTPS`; same-host redirects followed | `HTTP` only (`HTTPS` probes never succeed, logged); a 3xx answer is success without following it |
//! | Exec probe output, Events | Recorded as Events (`Unhealthy`, `Killing`, `BackOff`, ...) | Logged by the agent; no Events are written |
//! | `terminationMessagePath` | Read into `terminated.message` | Not read |
//! | Container logs | `kubectl logs` through the kubelet's HTTPS server, CRI log format with the time of each line | Plain files under the pod directory (`logs/<container>/<restart>.log`), stdout and stderr interleaved, no time per line; `kubectl logs` (with `-f`, `--tail`, `--limit-bytes`, `--previous`) served by the simulator, and on a real control plane by the agent's kubelet API ([`api`]); `--timestamps`, `--since` and `--since-time` are refused |
//! | Exec, attach, port-forward | Through the kubelet | Not served |
//! | Static pods, eviction, node pressure, graceful node shutdown, in-place resize, ephemeral containers | Supported | Not supported |
//!
//! Without mount and PID namespaces (not root and no user namespaces) the
//! agent does not start: [`Kubelet::start`] fails with one line naming what
//! is missing.

pub mod agent;
pub mod api;
pub mod env;
pub mod logs;
pub mod network;
pub mod probe;
pub mod restart;
pub mod runtime;
pub mod sandbox;
pub mod status;
pub mod volumes;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use network::PodNetwork;
pub use restart::BackoffPolicy;

/// One node the agent runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub name: String,
    /// `topology.kubernetes.io/zone`.
    pub zone: String,
}

/// Capacity (and allocatable) of each node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    pub cpu: String,
    pub memory: String,
    pub pods: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Self {
            cpu: "16".into(),
            memory: "64Gi".into(),
            pods: 250,
        }
    }
}

/// Settings of the agent.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The skipper binary: runs the sandbox shim, and `skipper` in commands.
    pub skipper_exe: PathBuf,
    /// Pod directories live here (`<namespace>_<name>`).
    pub pod_root: PathBuf,
    pub nodes: Vec<NodeSpec>,
    pub capacity: Capacity,
    /// The API server address pods get as `KUBERNETES_SERVICE_HOST`/`PORT`.
    pub api_server: SocketAddr,
    /// The crash back-off.
    pub backoff: BackoffPolicy,
    /// How often container CPU and memory are sampled.
    pub metrics_interval: Duration,
    /// `leaseDurationSeconds` of node Leases (renewed every quarter of it).
    pub lease_duration: Duration,
    /// How often node status is reported.
    pub node_status_interval: Duration,
    /// How often ConfigMap, Secret, downward API and token volumes are refreshed.
    pub volume_resync: Duration,
    /// Where pod IPs come from: loopback addresses in the host's network
    /// namespace, or a network namespace per pod on a bridge.
    pub network: network::PodNetwork,
    /// The kubelet API (container logs, for kube-apiserver) on the nodes'
    /// address; not served when `None` (the simulator serves logs itself).
    pub api: Option<api::ApiSettings>,
}

impl Settings {
    /// `<pod root>/<namespace>_<name>`.
    #[must_use]
    pub fn pod_dir(&self, ns: &str, name: &str) -> PathBuf {
        self.pod_root.join(format!("{ns}_{name}"))
    }

    /// The log file of a container of pod `ns/name`: the current
    /// instance's, or with `previous` the one before it.
    ///
    /// # Errors
    /// [`LogError`] when there is no such instance.
    pub fn log_file(
        &self,
        ns: &str,
        name: &str,
        container: &str,
        previous: bool,
    ) -> Result<PathBuf, LogError> {
        let dir = self.pod_dir(ns, name).join("logs").join(container);
        let mut restarts: Vec<u32> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
            .collect();
        restarts.sort_unstable();
        let pick = if previous {
            restarts.iter().rev().nth(1)
        } else {
            restarts.last()
        };
        match pick {
            Some(n) => Ok(dir.join(format!("{n}.log"))),
            None if previous => Err(LogError::NoPrevious {
                container: container.to_owned(),
                pod: name.to_owned(),
            }),
            None => Err(LogError::NotStarted {
                container: container.to_owned(),
                pod: name.to_owned(),
            }),
        }
    }
}

/// CPU and memory of one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerUsage {
    pub name: String,
    /// CPU over the last interval, in millicores.
    pub cpu_millis: u64,
    /// Resident memory of all its processes.
    pub memory_bytes: u64,
}

/// The latest usage sample of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUsage {
    pub containers: Vec<ContainerUsage>,
    /// When it was taken (RFC 3339).
    pub timestamp: String,
    /// The interval the CPU figures cover.
    pub window: Duration,
}

/// The latest usage sample of a pod, with the pod's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSample {
    pub namespace: String,
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub usage: PodUsage,
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("{0}")]
    SandboxUnavailable(String),
    #[error("creating the pod directory {path}: {source}")]
    PodRoot { path: PathBuf, source: std::io::Error },
    #[error("registering node {node}: {source}")]
    RegisterNode {
        node: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("the node agent is already started")]
    AlreadyStarted,
    #[error("building the API client of node {node}: {reason}")]
    Client { node: String, reason: String },
    #[error("the kubelet API: {0}")]
    Api(#[from] api::ApiError),
}

/// Why a container log cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    #[error("previous terminated container {container:?} in pod {pod:?} not found")]
    NoPrevious { container: String, pod: String },
    #[error("container {container:?} in pod {pod:?} is waiting to start")]
    NotStarted { container: String, pod: String },
}

/// Why the agent has no log for a container of a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContainerLogError {
    #[error("pod {pod:?} does not exist on this node")]
    PodNotFound { pod: String },
    #[error("container {container:?} not found in pod {pod:?}")]
    ContainerNotFound { container: String, pod: String },
    #[error(transparent)]
    Log(#[from] LogError),
}

/// The node agent: handle for the simulator (metrics, logs, fault hooks).
pub struct Kubelet {
    settings: Arc<Settings>,
    registry: Arc<agent::Registry>,
    kill: CancellationToken,
    started: OnceLock<()>,
}

impl Kubelet {
    /// An agent that does not run yet.
    #[must_use]
    pub fn new(settings: Settings) -> Self {
        Self {
            settings: Arc::new(settings),
            registry: Arc::new(agent::Registry::default()),
            kill: CancellationToken::new(),
            started: OnceLock::new(),
        }
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Checks that pods can get sandboxes, registers the nodes, and starts
    /// the agent's loops on `tracker` until `stop` fires. `client_for` gives
    /// the API client of each node (by name).
    ///
    /// # Errors
    /// [`KubeletError`]; [`KubeletError::SandboxUnavailable`] names what is missing.
    pub async fn start(
        &self,
        client_for: impl Fn(&str) -> Result<kube::Client, String>,
        tracker: &TaskTracker,
        stop: &CancellationToken,
    ) -> Result<(), KubeletError> {
        if self.started.set(()).is_err() {
            return Err(KubeletError::AlreadyStarted);
        }
        sandbox::check(&self.settings.skipper_exe)
            .await
            .map_err(KubeletError::SandboxUnavailable)?;
        std::fs::create_dir_all(&self.settings.pod_root).map_err(|source| KubeletError::PodRoot {
            path: self.settings.pod_root.clone(),
            source,
        })?;
        let mut clients = std::collections::BTreeMap::new();
        for n in &self.settings.nodes {
            let client = client_for(&n.name).map_err(|reason| KubeletError::Client {
                node: n.name.clone(),
                reason,
            })?;
            clients.insert(n.name.clone(), client);
        }
        // Before the nodes are registered: a node advertises the API only
        // once something answers there.
        if let Some(settings) = &self.settings.api {
            let addr = SocketAddr::from((self.settings.network.host_ip(), settings.port));
            let listener = api::bind(addr).await?;
            let tls = api::tls_config(settings)?;
            let app = api::router(
                Arc::new(AgentLogs(self.registry.clone(), self.settings.clone())),
                stop,
            );
            tracker.spawn(super::https::serve(listener, tls, app, stop.clone()));
            tracing::info!(%addr, "kubelet API listening");
        }
        let ctx = agent::context(
            clients,
            self.settings.clone(),
            tracker.clone(),
            self.registry.clone(),
        );
        let agent = agent::Agent::new(ctx, self.kill.clone());
        agent
            .register_nodes()
            .await
            .map_err(|(node, e)| KubeletError::RegisterNode {
                node,
                source: Box::new(e),
            })?;
        agent.spawn(tracker, stop);
        // Once, at start: this is how every pod runs here, not something a
        // pod did (the module docs list the other differences).
        tracing::info!(
            "securityContext and resource limits are not applied by this node agent: containers run as its own user"
        );
        Ok(())
    }

    /// SIGKILLs the main process of a pod's first running container, as a
    /// crash would; the container restarts under the pod's `restartPolicy`.
    /// The pid, or `None` when no container of the pod runs.
    #[must_use]
    pub fn kill_process(&self, ns: &str, name: &str) -> Option<u32> {
        let pid = self.registry.main_pid(ns, name)?;
        runtime::signal(pid, nix::sys::signal::Signal::SIGKILL);
        Some(pid)
    }

    /// Stops every pod at once (SIGKILL), as when the node dies.
    pub fn kill_all(&self) {
        self.kill.cancel();
        self.registry.kill_everything();
    }

    /// Main processes of every running container.
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        self.registry.main_pids()
    }

    /// The main process of a pod's first running container.
    #[must_use]
    pub fn pid_of(&self, ns: &str, name: &str) -> Option<u32> {
        self.registry.main_pid(ns, name)
    }

    /// Latest CPU and memory of a pod's containers.
    #[must_use]
    pub fn usage(&self, ns: &str, name: &str) -> Option<PodUsage> {
        self.registry.usage(ns, name)
    }

    /// Latest CPU and memory of every pod of `namespace` (every namespace
    /// when `None`) that has a sample.
    #[must_use]
    pub fn usages(&self, namespace: Option<&str>) -> Vec<PodSample> {
        self.registry.usages(namespace)
    }

    /// The directory of a pod on the node.
    #[must_use]
    pub fn pod_dir(&self, ns: &str, name: &str) -> PathBuf {
        self.settings.pod_dir(ns, name)
    }

    /// The log file of a container: the current instance's, or with
    /// `previous` the one before it.
    ///
    /// # Errors
    /// [`LogError`] when there is no such instance.
    pub fn log_file(
        &self,
        ns: &str,
        name: &str,
        container: &str,
        previous: bool,
    ) -> Result<PathBuf, LogError> {
        self.settings.log_file(ns, name, container, previous)
    }

    /// Whether the instance of container `container` of pod `ns/name` that
    /// logs to `log` is starting or running (a followed log goes on).
    #[must_use]
    pub fn writes_log(&self, ns: &str, name: &str, container: &str, log: &std::path::Path) -> bool {
        self.registry.writes_log(ns, name, container, log)
    }
}

/// The agent's logs as its kubelet API serves them: of the pods it runs.
struct AgentLogs(Arc<agent::Registry>, Arc<Settings>);

impl api::LogSource for AgentLogs {
    fn log_file(
        &self,
        ns: &str,
        pod: &str,
        container: &str,
        previous: bool,
    ) -> Result<PathBuf, ContainerLogError> {
        let containers = self
            .0
            .pod_containers(ns, pod)
            .ok_or_else(|| ContainerLogError::PodNotFound { pod: pod.to_owned() })?;
        if !containers.iter().any(|c| c == container) {
            return Err(ContainerLogError::ContainerNotFound {
                container: container.to_owned(),
                pod: pod.to_owned(),
            });
        }
        Ok(self.1.log_file(ns, pod, container, previous)?)
    }

    fn writes_log(&self, ns: &str, pod: &str, container: &str, log: &std::path::Path) -> bool {
        self.0.writes_log(ns, pod, container, log)
    }
}
