//! Kubelet nodes: the upstream kubelet and containerd (built by `make
//! nodes` from `tools/nodes/`) as the nodes of the real control plane,
//! running pods from container images with runc, the CNI plugins and
//! cgroups, as on a production cluster.
//!
//! Each node has its own kubelet, containerd, root directories, cgroup tree
//! and CNI network: one CNI `bridge` network per node on the cluster's pod
//! bridge ([`Bridge`], created by [`super::real_cluster`]), each with its own
//! slice of the bridge's /24 ([`pod_range`]) and its own address on it (the
//! node's `InternalIP`, [`node_ip`]). Every node shares one layer-2 segment,
//! so pods reach each other, the nodes and kube-apiserver (on the gateway)
//! without the host forwarding packets between networks.
//!
//! What the host sees, and how each part is undone:
//!
//! - **Mounts.** containerd and the kubelet run in one private mount
//!   namespace per node (`unshare --mount --propagation private`, the
//!   kubelet joins it with `nsenter`): container root filesystems, volumes,
//!   `/dev/shm` of sandboxes, the pods' network namespaces and the kubelet's
//!   shared root directory are mounted there and nowhere else, and they
//!   vanish with the namespace once its last process exits.
//! - **Sysctls.** The kubelet sets `vm.overcommit_memory=1`,
//!   `kernel.panic=10` and `kernel.panic_on_oops=1` at start unless
//!   `protectKernelDefaults` is set, which instead refuses to start when
//!   they differ. The node runs with `protectKernelDefaults: true` and, in
//!   its mount namespace only, those three files of `/proc/sys` bound over
//!   by files holding the expected values: the kubelet finds what it wants
//!   and the host's values never change.
//! - **Processes and cgroups.** Every node has a cgroup tree
//!   `<base>/skipper-kubelet-<id>` in every cgroup v1 hierarchy (`<base>`
//!   is this process's own memory cgroup, so the nodes' memory is accounted
//!   where this process's is): containerd and the kubelet run in its
//!   `runtime` child (the shims they start inherit it), pods in the
//!   kubelet's `kubepods` (`cgroupRoot`). Stopping a node kills every
//!   process in the tree (as a node losing power does), waits until the
//!   tree is empty and removes it.
//! - **Network.** The kubelet runs with `makeIPTablesUtilChains: false`
//!   (otherwise it installs a `KUBE-FIREWALL` chain that drops traffic to
//!   127.0.0.0/8 from non-loopback sources) and the bridge plugin with
//!   `isGateway: false` and `ipMasq: false`, so neither iptables nor
//!   `net.ipv4.ip_forward` change; pod veths go with the pods' network
//!   namespaces, node addresses and the bridge with [`Bridge::remove`].
//! - **Files.** Everything else (containerd's root and state, runc's state,
//!   the kubelet's root and pod logs, the CNI configuration, IPAM state and
//!   cache) lives in the node's directory under the work directory.
//!
//! A node holds a lock file under [`STATE_DIR`] while it lives; when
//! [`KubeletNodes::start`] finds a node cgroup tree whose lock nobody holds
//! (its process was SIGKILLed), it kills what still runs there and removes
//! it and the lock file, before it starts anything; lock files of trees
//! that are gone already are removed too ([`crate::lockfile`]).

use std::collections::BTreeSet;
use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::api::Api;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::control_plane::{ControlPlane, ControlPlaneError};
use super::kubelet::NodeSpec;
use super::kubelet::network::{Bridge, NetworkError};
use super::lockfile::{self, Lock};
use super::pki::{self, PkiError};

/// What `make nodes` builds into [`Config::bin_dir`].
pub const BINARIES: [&str; 6] = [
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "metrics-server",
    "pause",
];
/// The pause image's archive in [`Config::bin_dir`], imported into every node.
pub const PAUSE_ARCHIVE: &str = "pause.oci.tar";
/// The pause image's reference (`make nodes` names it so; containerd runs it
/// as every pod's sandbox).
pub const PAUSE_IMAGE: &str = "localhost/skipper/pause:1";
/// Where the nodes' lock files live.
pub const STATE_DIR: &str = "/run/skipper-kubelet";
/// Node cgroup trees are `<base>/skipper-kubelet-<id>`.
pub const CGROUP_PREFIX: &str = "skipper-kubelet-";
/// The cgroup v1 hierarchies' mount points.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The kubelet's port (every node has an address of its own).
pub const KUBELET_PORT: u16 = 10250;
/// The first pod address of the bridge's /24 (below it: the gateway and the
/// Service cluster IPs, [`service_range`]).
const FIRST_POD_HOST: u8 = 32;
/// The last pod address; node addresses follow ([`node_ip`]).
const LAST_POD_HOST: u8 = 239;
/// The first node address.
const FIRST_NODE_HOST: u8 = 240;
/// At most this many nodes share a bridge (`.240` to `.253`).
pub const MAX_NODES: usize = 14;
/// kube-apiserver's port on the gateway: the `kubernetes` Service's port,
/// which the kubelet gives pods as `KUBERNETES_SERVICE_PORT`.
pub const API_SERVER_PORT: u16 = 443;
/// The sysctls the kubelet insists on (`protectKernelDefaults`) whose
/// expected values the node's mount namespace shows it, with those values.
const KERNEL_DEFAULTS: [(&str, &str); 3] = [
    ("/proc/sys/vm/overcommit_memory", "1"),
    ("/proc/sys/kernel/panic", "10"),
    ("/proc/sys/kernel/panic_on_oops", "1"),
];

/// How the nodes run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where `make nodes` put [`BINARIES`] and [`PAUSE_ARCHIVE`] (`target/nodes`).
    pub bin_dir: PathBuf,
    /// runc (Debian's `runc`; crun fails on cgroup v1 hybrid hosts).
    pub runc: PathBuf,
    /// The CNI plugins (Debian's `containernetworking-plugins`).
    pub cni_bin_dir: PathBuf,
    /// OCI archives imported into every node's containerd before it serves
    /// pods (`target/image/skipper.oci.tar`): there is no registry.
    pub images: Vec<PathBuf>,
    /// How long a node may take to report Ready.
    pub ready_timeout: Duration,
    /// How long a node's processes may take to exit once killed.
    pub stop_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bin_dir: PathBuf::from("target/nodes"),
            runc: PathBuf::from("/usr/sbin/runc"),
            cni_bin_dir: PathBuf::from("/usr/lib/cni"),
            images: Vec::new(),
            ready_timeout: Duration::from_secs(90),
            stop_timeout: Duration::from_secs(20),
        }
    }
}

/// Why the nodes could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    #[error(
        "{binary} not found in {dir}: build the kubelet nodes with `make nodes` (needs Go, gcc and buildah), \
         or point the nodes directory at them"
    )]
    MissingBinary { binary: String, dir: PathBuf },
    #[error("{what} not found at {path}: {hint}")]
    MissingTool {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("image archive {0} not found: build it with `make image`")]
    MissingImage(PathBuf),
    #[error("{count} kubelet nodes asked for; one bridge holds at most {MAX_NODES}")]
    TooManyNodes { count: usize },
    #[error("kubelet nodes need cgroup v1 hierarchies under {CGROUP_ROOT}: {0}")]
    Cgroups(String),
    #[error(
        "{count} kubelet nodes and their control plane need about {need} inotify instances ({INOTIFY_PER_NODE} a node, \
         {INOTIFY_PER_CLUSTER} the control plane); fs.inotify.max_user_instances is {max} and root's processes \
         use {used}: raise it, e.g. `sysctl -w fs.inotify.max_user_instances=1024`"
    )]
    Inotify {
        count: usize,
        need: usize,
        max: usize,
        used: usize,
    },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting {what}: {source}")]
    Spawn { what: String, source: std::io::Error },
    #[error("{what} failed ({status}): {stderr}")]
    Command {
        what: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{name} exited ({status}) while starting; the end of {log}:\n{tail}")]
    Exited {
        name: String,
        status: std::process::ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{what} after {waited:?}; the end of {log}:\n{tail}")]
    NotReady {
        what: String,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("key material: {0}")]
    Pki(#[from] PkiError),
    #[error("control plane: {0}")]
    ControlPlane(#[from] ControlPlaneError),
    #[error("pod network: {0}")]
    Network(#[from] NetworkError),
    #[error("metrics-server: {0}")]
    MetricsServer(String),
    #[error("metrics.k8s.io: {0}")]
    MetricsApi(#[from] super::metrics_api::MetricsApiError),
}

// ---------------------------------------------------------------------------
// Pure parts: addresses, names, configuration files.

/// The Service cluster IP range of a cluster on `bridge` (its /24's first
/// /27): its first address, the `kubernetes` Service's cluster IP, is the
/// gateway, where kube-apiserver listens on 443. There is no kube-proxy, so
/// that is the only cluster IP that reaches anything — the one pods use, as
/// the kubelet gives them `KUBERNETES_SERVICE_HOST`/`PORT` from it.
#[must_use]
pub fn service_range(subnet: Ipv4Addr) -> String {
    format!("{subnet}/27")
}

/// The node address of node `index` on the bridge of `subnet` (`.240`, `.241`, ...).
#[must_use]
pub fn node_ip(subnet: Ipv4Addr, index: usize) -> Ipv4Addr {
    let [a, b, c, _] = subnet.octets();
    #[allow(clippy::cast_possible_truncation)] // index < MAX_NODES
    Ipv4Addr::new(a, b, c, FIRST_NODE_HOST + index as u8)
}

/// The first and last pod address of node `index` of `count`: the pod
/// addresses of the /24 split evenly.
#[must_use]
pub fn pod_range(subnet: Ipv4Addr, index: usize, count: usize) -> (Ipv4Addr, Ipv4Addr) {
    let [a, b, c, _] = subnet.octets();
    let total = usize::from(LAST_POD_HOST - FIRST_POD_HOST) + 1;
    let per = total / count.max(1);
    #[allow(clippy::cast_possible_truncation)] // below 256
    let first = FIRST_POD_HOST as usize + per * index;
    #[allow(clippy::cast_possible_truncation)]
    (
        Ipv4Addr::new(a, b, c, first as u8),
        Ipv4Addr::new(a, b, c, (first + per - 1) as u8),
    )
}

/// The cgroup path (in every hierarchy) this process's nodes live under: its
/// own memory cgroup, read from `/proc/self/cgroup`, so the nodes' memory is
/// accounted where this process's is (`/` when it has none).
#[must_use]
pub fn cgroup_base(proc_self_cgroup: &str) -> String {
    proc_self_cgroup
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then(|| path.trim_end_matches('/').to_owned())
        })
        .next()
        .unwrap_or_default()
}

/// The id of a node cgroup tree's name (`skipper-kubelet-1a2b-0` → `1a2b-0`).
#[must_use]
pub fn parse_cgroup_name(name: &str) -> Option<&str> {
    let id = name.strip_prefix(CGROUP_PREFIX)?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')).then_some(id)
}

/// What a node's configuration files say.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The node's name.
    pub name: String,
    pub zone: String,
    /// The node's directory (everything of the node's lives under it).
    pub dir: PathBuf,
    /// The node's address (its `InternalIP`, where the kubelet serves).
    pub ip: Ipv4Addr,
    pub kubelet_port: u16,
    /// `cgroupRoot` of the kubelet (its `kubepods` go below).
    pub cgroup_root: String,
    /// The bridge, its /24, its gateway, and this node's pod addresses.
    pub bridge: String,
    pub subnet: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub pods: (Ipv4Addr, Ipv4Addr),
    pub runc: PathBuf,
    pub cni_bin_dir: PathBuf,
    pub ca_cert: PathBuf,
    pub max_pods: u32,
}

impl Layout {
    /// containerd's socket.
    #[must_use]
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    fn path(&self, rel: &str) -> String {
        self.dir.join(rel).display().to_string()
    }

    /// The name of the node's CNI network.
    #[must_use]
    pub fn network_name(&self) -> String {
        format!("skipper-{}", self.name)
    }
}

/// containerd's configuration (version 3): state and sockets in the node's
/// directory; the CRI plugin with runc through the v2 shim (cgroupfs, runc's
/// state in the node's directory), `restrict_oom_score_adj` (without
/// `CAP_SYS_RESOURCE` no process may lower its OOM score, and the kubelet
/// asks −998 for some), the pods' network namespaces under containerd's
/// state directory, the CNI configuration of [`cni_config`], and the local
/// pause image as the sandbox image (pinned: image garbage collection
/// keeps it).
#[must_use]
pub fn containerd_config(l: &Layout) -> String {
    format!(
        r#"version = 3
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{runc}'
        Root = '{runc_root}'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{cni_bin}']
    conf_dir = '{cni_conf}'
    max_conf_num = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'
"#,
        root = l.path("containerd/root"),
        state = l.path("containerd/state"),
        socket = l.containerd_socket().display(),
        runc = l.runc.display(),
        runc_root = l.path("runc"),
        cni_bin = l.cni_bin_dir.display(),
        cni_conf = l.path("cni/net.d"),
    )
}

/// The node's CNI network: the `bridge` plugin on the cluster's bridge
/// without making the host a gateway (`isGateway: false`: the bridge
/// already has the gateway address, and the plugin would turn on
/// `net.ipv4.ip_forward`) or masquerading (`ipMasq: false`: no iptables
/// rules), host-local addresses from the node's slice of the /24 with its
/// state in the node's directory, a default route via the gateway; and
/// `loopback` for the pod's `lo`.
#[must_use]
pub fn cni_config(l: &Layout) -> String {
    let value = json!({
        "cniVersion": "1.0.0",
        "name": l.network_name(),
        "plugins": [
            {"type": "bridge", "bridge": l.bridge, "isGateway": false, "ipMasq": false,
             "hairpinMode": false,
             "ipam": {"type": "host-local", "dataDir": l.path("cni/ipam"),
                      "ranges": [[{"subnet": format!("{}/24", l.subnet),
                                   "rangeStart": l.pods.0.to_string(),
                                   "rangeEnd": l.pods.1.to_string(),
                                   "gateway": l.gateway.to_string()}]],
                      "routes": [{"dst": "0.0.0.0/0", "gw": l.gateway.to_string()}]}},
            {"type": "loopback"},
        ],
    });
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

/// The kubelet's configuration (`KubeletConfiguration`, JSON): cgroup v1
/// accepted (`failCgroupV1: false`) with the `cgroupfs` driver under the
/// node's cgroup tree; containerd's socket; serving on the node's address
/// with a certificate from the cluster CA, clients authenticated by the
/// cluster CA or a TokenReview and authorized by a SubjectAccessReview (as
/// kubeadm sets it up); no read-only port; no iptables chains
/// (`makeIPTablesUtilChains: false`); `protectKernelDefaults` (see the
/// module docs); pod logs in the node's directory; no swap check, no eviction
/// thresholds and no image garbage collection (a test machine's disk is not
/// the node's); the host's resolvers for pods (there is no cluster DNS).
#[must_use]
pub fn kubelet_config(l: &Layout) -> String {
    let value = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": false,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": l.cgroup_root,
        "cgroupsPerQOS": true,
        "enforceNodeAllocatable": ["pods"],
        "containerRuntimeEndpoint": format!("unix://{}", l.containerd_socket().display()),
        "address": l.ip.to_string(),
        "port": l.kubelet_port,
        "readOnlyPort": 0,
        // Its health port would be one loopback port for every node of the
        // host; the Node's Ready condition says what it would.
        "healthzPort": 0,
        "tlsCertFile": l.path("pki/kubelet.crt"),
        "tlsPrivateKeyFile": l.path("pki/kubelet.key"),
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": l.ca_cert.display().to_string()},
        },
        "authorization": {"mode": "Webhook"},
        "makeIPTablesUtilChains": false,
        "protectKernelDefaults": true,
        "podLogsDir": l.path("pod-logs"),
        "volumePluginDir": l.path("volume-plugins"),
        "maxPods": l.max_pods,
        "serializeImagePulls": false,
        "failSwapOn": false,
        "resolvConf": "/etc/resolv.conf",
        "localStorageCapacityIsolation": false,
        "imageGCHighThresholdPercent": 100,
        "evictionHard": {},
        "evictionPressureTransitionPeriod": "0s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
        "nodeStatusReportFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
    });
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Host state: locks and cgroup trees.

/// The cgroup hierarchies mounted under [`CGROUP_ROOT`] (directories with a
/// `cgroup.procs`): the v1 hierarchies, and on a hybrid host the cgroup2
/// `unified` one, where runc creates every container's cgroup too.
fn hierarchies() -> Vec<PathBuf> {
    std::fs::read_dir(CGROUP_ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").is_file())
        .collect()
}

/// The lock file of node cgroup tree `id`.
fn lock_path(id: &str) -> PathBuf {
    Path::new(STATE_DIR).join(format!("{id}.lock"))
}

/// Takes the lock of `id` (`None` when a live process holds it).
fn try_lock(id: &str) -> Result<Option<Lock>, NodesError> {
    let path = lock_path(id);
    Lock::try_take(&path).map_err(|source| NodesError::Io {
        what: "locking",
        path,
        source,
    })
}

/// A node's cgroup tree: `<base>/skipper-kubelet-<id>` in every hierarchy.
#[derive(Debug, Clone)]
struct CgroupTree {
    /// The path below each hierarchy's mount point (`/…/skipper-kubelet-<id>`).
    path: String,
}

impl CgroupTree {
    fn dirs(&self) -> Vec<PathBuf> {
        hierarchies()
            .into_iter()
            .map(|h| h.join(self.path.trim_start_matches('/')))
            .collect()
    }

    /// Creates the tree and its `runtime` child in every hierarchy; cpuset
    /// directories get their parent's CPUs and memory nodes (a new cpuset is
    /// empty, and no process may join an empty one).
    fn create(&self) -> Result<(), NodesError> {
        for hierarchy in hierarchies() {
            let dir = hierarchy.join(self.path.trim_start_matches('/'));
            let runtime = dir.join("runtime");
            // Another harness's nodes may remove an empty parent between
            // two levels (see `remove_empty_parents`): try again.
            let mut made = std::fs::create_dir_all(&runtime);
            for _ in 0..5 {
                match &made {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        made = std::fs::create_dir_all(&runtime);
                    }
                    _ => break,
                }
            }
            made.map_err(|source| NodesError::Io {
                what: "creating",
                path: runtime.clone(),
                source,
            })?;
            if hierarchy.join("cpuset.cpus").is_file() {
                // Every level from the hierarchy's root down to `runtime`.
                let mut level = hierarchy.clone();
                for part in Path::new(self.path.trim_start_matches('/'))
                    .components()
                    .chain(Path::new("runtime").components())
                {
                    let parent = level.clone();
                    level = level.join(part);
                    for file in ["cpuset.cpus", "cpuset.mems"] {
                        let current = std::fs::read_to_string(level.join(file)).unwrap_or_default();
                        if current.trim().is_empty() {
                            let value = std::fs::read_to_string(parent.join(file)).unwrap_or_default();
                            std::fs::write(level.join(file), value.trim()).map_err(|source| {
                                NodesError::Io {
                                    what: "writing",
                                    path: level.join(file),
                                    source,
                                }
                            })?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Moves `pid` into the `runtime` child in every hierarchy.
    fn join(&self, pid: u32) -> Result<(), NodesError> {
        for dir in self.dirs() {
            let procs = dir.join("runtime/cgroup.procs");
            std::fs::write(&procs, pid.to_string()).map_err(|source| NodesError::Io {
                what: "joining",
                path: procs.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// The processes anywhere in the tree, in any hierarchy.
    fn pids(&self) -> BTreeSet<i32> {
        let mut pids = BTreeSet::new();
        for dir in self.dirs() {
            for entry in walkdir(&dir) {
                let text = std::fs::read_to_string(entry.join("cgroup.procs")).unwrap_or_default();
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        pids
    }

    /// SIGKILLs every process of the tree until it is empty (or `timeout`
    /// passes), then removes the tree's directories, deepest first. Returns
    /// whether the tree is gone.
    async fn destroy(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if Instant::now() >= deadline {
                tracing::warn!(cgroup = %self.path, "processes of a kubelet node still run after {timeout:?}");
                return false;
            }
        }
        let mut gone = true;
        for hierarchy in hierarchies() {
            let dir = hierarchy.join(self.path.trim_start_matches('/'));
            let mut all = walkdir(&dir);
            all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for d in all {
                if let Err(e) = std::fs::remove_dir(&d)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(dir = %d.display(), error = %e, "removing a kubelet node's cgroup");
                    gone = false;
                }
            }
            remove_empty_parents(&hierarchy, &dir);
        }
        gone
    }
}

/// Removes the directories between `hierarchy` and `dir` (exclusive) that
/// [`CgroupTree::create`] made for the base path in hierarchies where this
/// process's cgroup is elsewhere (`/process_api/…` exists in the memory
/// hierarchy only): each once it holds no process and no other cgroup — a
/// cgroup that does is refused by the kernel and kept, and so is every one
/// above it.
fn remove_empty_parents(hierarchy: &Path, dir: &Path) {
    let mut level = dir.parent();
    while let Some(d) = level {
        if d == hierarchy || !d.starts_with(hierarchy) || std::fs::remove_dir(d).is_err() {
            break;
        }
        level = d.parent();
    }
}

/// `dir` and every directory below it (empty when `dir` is missing).
fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        out.push(d);
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    out
}

/// Node cgroup trees anywhere in the first levels of every hierarchy: each
/// tree's id, hierarchy and directory (one per hierarchy). The base is this
/// process's memory cgroup or another's of the same depth: three levels
/// down are looked at.
fn node_trees() -> Vec<(String, PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for hierarchy in hierarchies() {
        let mut level = vec![hierarchy.clone()];
        for _ in 0..3 {
            let mut next = Vec::new();
            for d in &level {
                for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                    if !e.file_type().is_ok_and(|t| t.is_dir()) {
                        continue;
                    }
                    let name = e.file_name().to_string_lossy().into_owned();
                    match parse_cgroup_name(&name) {
                        Some(id) => out.push((id.to_owned(), hierarchy.clone(), e.path())),
                        None => next.push(e.path()),
                    }
                }
            }
            level = next;
        }
    }
    out
}

/// The trees of [`node_trees`] whose lock nobody holds: what a SIGKILLed
/// harness left. Each is destroyed (its processes killed: the shims and
/// containers, which outlive containerd by design, and with them the
/// node's mount namespace and the pods' network namespaces).
async fn sweep_stale(timeout: Duration) -> Result<(), NodesError> {
    let mut stale = BTreeSet::new();
    for (id, hierarchy, dir) in node_trees() {
        let rel = dir
            .strip_prefix(&hierarchy)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        stale.insert((id, format!("/{}", rel.display())));
    }
    for (id, path) in stale {
        let Some(lock) = try_lock(&id)? else {
            continue;
        };
        tracing::info!(cgroup = %path, "removing a kubelet node whose harness is gone");
        if (CgroupTree { path }).destroy(timeout).await {
            lock.remove();
        }
    }
    // Lock files of nodes whose tree is gone already (or was never made).
    for (id, _) in lockfile::list(Path::new(STATE_DIR)) {
        if parse_cgroup_name(&format!("{CGROUP_PREFIX}{id}")).is_some()
            && let Some(lock) = try_lock(&id)?
        {
            lock.remove();
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Processes.

/// `setpriv --pdeathsig KILL --`: the process dies with this one, even when
/// this one is SIGKILLed.
const SETPRIV: &str = "/usr/bin/setpriv";
/// util-linux's `unshare` and `nsenter`.
const UNSHARE: &str = "/usr/bin/unshare";
const NSENTER: &str = "/usr/bin/nsenter";

/// The last `lines` lines of a log file (empty when unreadable).
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Starts `argv` under `setpriv --pdeathsig KILL`, its output to `log`.
fn spawn(what: &str, argv: &[String], log: &Path) -> Result<Child, NodesError> {
    let spawn_err = |source| NodesError::Spawn {
        what: what.to_owned(),
        source,
    };
    let out = File::create(log).map_err(spawn_err)?;
    let err = out.try_clone().map_err(spawn_err)?;
    Command::new(SETPRIV)
        .args(["--pdeathsig", "KILL", "--"])
        .args(argv)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_err)
}

/// Runs `argv` to completion within `timeout`.
async fn run(what: &str, argv: &[String], timeout: Duration) -> Result<String, NodesError> {
    let (exe, args) = argv.split_first().ok_or_else(|| NodesError::Spawn {
        what: what.to_owned(),
        source: std::io::Error::other("empty command"),
    })?;
    let child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(timeout, child)
        .await
        .map_err(|_| NodesError::Spawn {
            what: what.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ),
        })?
        .map_err(|source| NodesError::Spawn {
            what: what.to_owned(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NodesError::Command {
            what: what.to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// One running kubelet node.
struct Node {
    layout: Layout,
    cgroup: CgroupTree,
    /// Held while the node lives (see [`sweep_stale`]).
    lock: Option<Lock>,
    lock_id: String,
    /// Holds the node's mount namespace (the pause program).
    holder: Child,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    /// The names each imported archive's images got.
    images: Vec<(PathBuf, Vec<String>)>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("name", &self.layout.name)
            .field("ip", &self.layout.ip)
            .field("cgroup", &self.cgroup.path)
            .finish_non_exhaustive()
    }
}

/// What [`Node::start`] needs from the cluster.
struct Cluster<'a> {
    config: &'a Config,
    count: usize,
    bridge: &'a Bridge,
    plane: &'a ControlPlane,
    work_dir: &'a Path,
    base: &'a str,
    run_id: &'a str,
}

impl Node {
    /// Sets up node `index` and starts its containerd (with the images
    /// imported) and kubelet; does not wait for the Node to be Ready.
    async fn start(index: usize, spec: &NodeSpec, c: &Cluster<'_>) -> Result<Self, NodesError> {
        let (subnet, _) = c.bridge.subnet();
        let count = c.count;
        let dir = c.work_dir.join("nodes").join(&spec.name);
        let lock_id = format!("{}-{index}", c.run_id);
        let layout = Layout {
            name: spec.name.clone(),
            zone: spec.zone.clone(),
            dir: dir.clone(),
            ip: node_ip(subnet, index),
            kubelet_port: KUBELET_PORT,
            cgroup_root: format!("{}/{CGROUP_PREFIX}{lock_id}", c.base),
            bridge: c.bridge.name().to_owned(),
            subnet,
            gateway: c.bridge.gateway(),
            pods: pod_range(subnet, index, count),
            runc: c.config.runc.clone(),
            cni_bin_dir: c.config.cni_bin_dir.clone(),
            ca_cert: c.plane.ca_cert().to_path_buf(),
            max_pods: pod_count(count),
        };
        for sub in [
            "containerd/root",
            "containerd/state",
            "runc",
            "kubelet",
            "pod-logs",
            "cni/net.d",
            "cni/ipam",
            "pki",
            "sysctl",
            "logs",
        ] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).map_err(|source| NodesError::Io {
                what: "creating",
                path: path.clone(),
                source,
            })?;
        }
        let write = |rel: &str, text: &str, secret: bool| pki::write_file(&dir.join(rel), text, secret);
        write("containerd/config.toml", &containerd_config(&layout), false)?;
        write("cni/net.d/10-skipper.conflist", &cni_config(&layout), false)?;
        write("kubelet/config.json", &kubelet_config(&layout), false)?;
        let serving = c
            .plane
            .pki()
            .ca
            .issue_serving(&spec.name, &[layout.ip.to_string(), spec.name.clone()])?;
        write("pki/kubelet.crt", &serving.cert_pem, false)?;
        write("pki/kubelet.key", &serving.key_pem, true)?;
        let kubeconfig = c.plane.kubeconfig_for(
            &format!("kubelet-{}", spec.name),
            &super::real_cluster::node_user(&spec.name),
            &[super::real_cluster::NODES_GROUP],
        )?;
        for (i, (_, value)) in KERNEL_DEFAULTS.iter().enumerate() {
            write(&format!("sysctl/{i}"), &format!("{value}\n"), false)?;
        }
        c.bridge.add_address(layout.ip)?;

        let lock = try_lock(&lock_id)?.ok_or_else(|| NodesError::Io {
            what: "locking",
            path: lock_path(&lock_id),
            source: std::io::Error::other("held by another process"),
        })?;
        let cgroup = CgroupTree {
            path: layout.cgroup_root.clone(),
        };
        cgroup.create()?;

        // The mount namespace: its holder, then what is mounted in it.
        let holder = spawn(
            "the node's mount namespace",
            &[
                UNSHARE.into(),
                "--mount".into(),
                "--propagation".into(),
                "private".into(),
                "--".into(),
                s(&c.config.bin_dir.join("pause")),
            ],
            &dir.join("logs/holder.log"),
        )?;
        let holder_pid = holder.id().unwrap_or_default();
        let mut node = Self {
            layout,
            cgroup,
            lock: Some(lock),
            lock_id,
            holder,
            containerd: None,
            kubelet: None,
            images: Vec::new(),
        };
        node.cgroup.join(holder_pid)?;
        let ns = |args: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = vec![
                NSENTER.into(),
                "--target".into(),
                holder_pid.to_string(),
                "--mount".into(),
                "--".into(),
            ];
            v.extend(args.iter().map(|a| (*a).to_owned()));
            v
        };
        // The namespace exists once unshare has exec'd the holder.
        await_namespace(holder_pid, Duration::from_secs(5)).await?;
        let mut mounts: Vec<Vec<String>> = vec![
            // What the kubelet, containerd and the CNI plugins write outside
            // their configured directories stays in the namespace: shim and
            // NRI sockets under /run, libcni's cache in /var/lib/cni.
            ns(&["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"]),
            ns(&["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/var/lib"]),
            // The kubelet links every container's log into /var/log/containers.
            ns(&["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/var/log"]),
            ns(&["mkdir", "-p", "/var/lib/cni"]),
        ];
        for (i, (file, _)) in KERNEL_DEFAULTS.iter().enumerate() {
            let value = s(&dir.join(format!("sysctl/{i}")));
            mounts.push(ns(&["mount", "--bind", &value, file]));
        }
        for argv in mounts {
            run(
                "setting up the node's mount namespace",
                &argv,
                Duration::from_secs(10),
            )
            .await?;
        }

        let bin = |b: &str| s(&c.config.bin_dir.join(b));
        let mut containerd = ns(&[]);
        containerd.extend([
            bin("containerd"),
            "--config".into(),
            s(&dir.join("containerd/config.toml")),
        ]);
        let child = spawn("containerd", &containerd, &dir.join("logs/containerd.log"))?;
        node.cgroup.join(child.id().unwrap_or_default())?;
        node.containerd = Some(child);
        node.await_containerd(Duration::from_secs(30)).await?;
        let mut archives = vec![c.config.bin_dir.join(PAUSE_ARCHIVE)];
        archives.extend(c.config.images.iter().cloned());
        for archive in archives {
            let names = node.import(&bin("ctr"), &archive).await?;
            node.images.push((archive, names));
        }

        let mut kubelet = ns(&[]);
        kubelet.extend([
            bin("kubelet"),
            format!("--config={}", dir.join("kubelet/config.json").display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={}", dir.join("kubelet/root").display()),
            format!("--node-ip={}", node.layout.ip),
            format!("--hostname-override={}", spec.name),
            format!("--node-labels=topology.kubernetes.io/zone={}", spec.zone),
        ]);
        let child = spawn("kubelet", &kubelet, &dir.join("logs/kubelet.log"))?;
        node.cgroup.join(child.id().unwrap_or_default())?;
        node.kubelet = Some(child);
        Ok(node)
    }

    async fn await_containerd(&mut self, timeout: Duration) -> Result<(), NodesError> {
        let begin = Instant::now();
        let socket = self.layout.containerd_socket();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            if let Some(Ok(Some(status))) = self.containerd.as_mut().map(Child::try_wait) {
                return Err(self.exited("containerd", status));
            }
            if socket.exists() {
                return Ok(());
            }
            if begin.elapsed() >= timeout {
                let log = self.layout.dir.join("logs/containerd.log");
                return Err(NodesError::NotReady {
                    what: format!("containerd of {} was not serving", self.layout.name),
                    waited: begin.elapsed(),
                    tail: log_tail(&log, 30),
                    log,
                });
            }
        }
    }

    /// Imports an OCI archive into the node's containerd; the names its
    /// images got (each manifest's `org.opencontainers.image.ref.name`).
    async fn import(&self, ctr: &str, archive: &Path) -> Result<Vec<String>, NodesError> {
        if !archive.is_file() {
            return Err(NodesError::MissingImage(archive.to_path_buf()));
        }
        let before = self.image_list(ctr).await?;
        let out = run(
            &format!("importing {} into {}", archive.display(), self.layout.name),
            &[
                ctr.to_owned(),
                "--address".into(),
                s(&self.layout.containerd_socket()),
                "--namespace".into(),
                "k8s.io".into(),
                "images".into(),
                "import".into(),
                "--platform".into(),
                "linux/amd64".into(),
                s(archive),
            ],
            Duration::from_secs(120),
        )
        .await?;
        let names = imported_names(&out);
        if !names.is_empty() {
            return Ok(names);
        }
        // ctr's progress display can stop before it prints its `saved`
        // lines: the names are then those the import added.
        let after = self.image_list(ctr).await?;
        Ok(added_names(&before, after))
    }

    /// The names of the node's images (`ctr images ls -q`).
    async fn image_list(&self, ctr: &str) -> Result<Vec<String>, NodesError> {
        let out = run(
            &format!("listing the images of {}", self.layout.name),
            &[
                ctr.to_owned(),
                "--address".into(),
                s(&self.layout.containerd_socket()),
                "--namespace".into(),
                "k8s.io".into(),
                "images".into(),
                "ls".into(),
                "-q".into(),
            ],
            Duration::from_secs(30),
        )
        .await?;
        Ok(out
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }

    fn exited(&self, name: &str, status: std::process::ExitStatus) -> NodesError {
        let log = self.layout.dir.join(format!("logs/{name}.log"));
        NodesError::Exited {
            name: format!("{name} of {}", self.layout.name),
            status,
            tail: log_tail(&log, 30),
            log,
        }
    }

    /// Fails when the kubelet or containerd has exited.
    fn check_running(&mut self) -> Result<(), NodesError> {
        if let Some(k) = self.kubelet.as_mut()
            && let Ok(Some(status)) = k.try_wait()
        {
            return Err(self.exited("kubelet", status));
        }
        if let Some(Ok(Some(status))) = self.containerd.as_mut().map(Child::try_wait) {
            return Err(self.exited("containerd", status));
        }
        Ok(())
    }

    /// Stops the node as a machine losing power stops: every process of its
    /// cgroup tree is killed (kubelet, containerd, shims, containers; the
    /// mount namespace and the pods' network namespaces go with the last),
    /// then the tree, the node's address and its lock are removed.
    async fn stop(mut self, timeout: Duration, bridge: &Bridge) {
        let gone = self.cgroup.destroy(timeout).await;
        for child in [
            Some(&mut self.holder),
            self.containerd.as_mut(),
            self.kubelet.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            let _ = tokio::time::timeout(Duration::from_secs(1), child.wait()).await;
        }
        bridge.remove_address(self.layout.ip);
        if gone && let Some(lock) = self.lock.take() {
            lock.remove();
        }
    }

    /// What [`Self::stop`] does, without waiting: kills what runs now; a
    /// process that starts meanwhile, or a directory that cannot be removed
    /// yet, is swept by the next start (the lock is released with this
    /// process).
    fn kill(&mut self) {
        for pid in self.cgroup.pids() {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// The image names in what `ctr images import` printed: its lines
/// `<name> saved`.
#[must_use]
pub fn imported_names(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?;
            (words.next() == Some("saved")).then(|| name.to_owned())
        })
        .collect()
}

/// The image names in `after` that `before` does not hold, names by tag
/// before names by digest.
#[must_use]
pub fn added_names(before: &[String], after: Vec<String>) -> Vec<String> {
    let mut added: Vec<String> = after.into_iter().filter(|n| !before.contains(n)).collect();
    added.sort_by_key(|n| n.contains('@'));
    added
}

/// The pods a node of `count` may run (its slice of the /24).
fn pod_count(count: usize) -> u32 {
    let total = u32::from(LAST_POD_HOST - FIRST_POD_HOST) + 1;
    #[allow(clippy::cast_possible_truncation)] // count ≤ MAX_NODES
    let per = total / count.max(1) as u32;
    per
}

/// Waits until `pid` has a mount namespace other than this process's (the
/// holder has unshared and exec'd).
async fn await_namespace(pid: u32, timeout: Duration) -> Result<(), NodesError> {
    let mine = std::fs::read_link("/proc/self/ns/mnt").ok();
    let begin = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if theirs.is_some() && theirs != mine && exe.is_some_and(|e| e.ends_with("pause")) {
            return Ok(());
        }
        if begin.elapsed() >= timeout {
            return Err(NodesError::NotReady {
                what: "the node's mount namespace was not created".into(),
                waited: begin.elapsed(),
                log: PathBuf::new(),
                tail: String::new(),
            });
        }
    }
}

/// The processes of the container `container_id` (`containerd://<id>` or
/// the bare id) in the cgroup trees `trees`: those of its cgroup, a
/// directory named by the id.
fn pids_of_container(trees: &[PathBuf], container_id: &str) -> Vec<i32> {
    let id = container_id.rsplit("://").next().unwrap_or(container_id);
    let mut pids = BTreeSet::new();
    for tree in trees {
        for d in walkdir(tree) {
            if d.file_name().is_some_and(|n| n == id) {
                let text = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
    }
    pids.into_iter().collect()
}

/// [`KubeletNodes::container_pids`] for a process that does not hold the
/// nodes (a test of `skipper dev --nodes kubelet`): the container's
/// processes in any kubelet node's cgroup tree on this host.
#[must_use]
pub fn host_container_pids(container_id: &str) -> Vec<i32> {
    let trees: Vec<PathBuf> = node_trees().into_iter().map(|(_, _, dir)| dir).collect();
    pids_of_container(&trees, container_id)
}

// ---------------------------------------------------------------------------
// The nodes.

/// Running kubelet nodes. Dropping the value kills their processes without
/// waiting; [`KubeletNodes::shutdown`] stops them and removes everything.
#[derive(Debug)]
pub struct KubeletNodes {
    nodes: Vec<Node>,
    bridge: Arc<Bridge>,
    stop_timeout: Duration,
    /// `ctr`, for what is done to every node's images.
    ctr: PathBuf,
}

/// Whether `path` is an executable file.
fn executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Fails, naming what is missing, unless everything the nodes run exists.
///
/// # Errors
/// [`NodesError::MissingBinary`], [`NodesError::MissingTool`],
/// [`NodesError::MissingImage`], [`NodesError::TooManyNodes`],
/// [`NodesError::Cgroups`], [`NodesError::Inotify`].
pub fn check(config: &Config, count: usize) -> Result<(), NodesError> {
    if count > MAX_NODES {
        return Err(NodesError::TooManyNodes { count });
    }
    for binary in BINARIES {
        if !executable(&config.bin_dir.join(binary)) {
            return Err(NodesError::MissingBinary {
                binary: binary.to_owned(),
                dir: config.bin_dir.clone(),
            });
        }
    }
    if !config.bin_dir.join(PAUSE_ARCHIVE).is_file() {
        return Err(NodesError::MissingBinary {
            binary: PAUSE_ARCHIVE.to_owned(),
            dir: config.bin_dir.clone(),
        });
    }
    let tools: [(&'static str, PathBuf, &'static str); 6] = [
        ("runc", config.runc.clone(), "apt-get install -y runc"),
        (
            "the CNI bridge plugin",
            config.cni_bin_dir.join("bridge"),
            "apt-get install -y containernetworking-plugins",
        ),
        (
            "the CNI host-local plugin",
            config.cni_bin_dir.join("host-local"),
            "apt-get install -y containernetworking-plugins",
        ),
        ("setpriv", PathBuf::from(SETPRIV), "apt-get install -y util-linux"),
        ("unshare", PathBuf::from(UNSHARE), "apt-get install -y util-linux"),
        ("nsenter", PathBuf::from(NSENTER), "apt-get install -y util-linux"),
    ];
    for (what, path, hint) in tools {
        if !executable(&path) {
            return Err(NodesError::MissingTool { what, path, hint });
        }
    }
    for image in &config.images {
        if !image.is_file() {
            return Err(NodesError::MissingImage(image.clone()));
        }
    }
    if hierarchies().is_empty() {
        return Err(NodesError::Cgroups("none is mounted".into()));
    }
    // A kubelet without an inotify instance exits at start ("Failed to
    // start cAdvisor"): the per-user limit is shared by every root process,
    // other clusters' nodes among them.
    if let Some(max) = read_usize("/proc/sys/fs/inotify/max_user_instances") {
        inotify_room(count, max, inotify_instances_of(0))?;
    }
    Ok(())
}

/// Whether `count` nodes and their control plane fit in `max` inotify
/// instances of which `used` are taken.
fn inotify_room(count: usize, max: usize, used: usize) -> Result<(), NodesError> {
    let need = count * INOTIFY_PER_NODE + INOTIFY_PER_CLUSTER;
    if used + need > max {
        return Err(NodesError::Inotify {
            count,
            need,
            max,
            used,
        });
    }
    Ok(())
}

/// The inotify instances one node's processes hold: its kubelet 6 (cAdvisor,
/// the volume plugin prober, the serving certificate, configuration), its
/// containerd 2.
pub const INOTIFY_PER_NODE: usize = 8;

/// The inotify instances the nodes' control plane holds: kube-apiserver 6,
/// kube-controller-manager and kube-scheduler 1 each, metrics-server 2.
pub const INOTIFY_PER_CLUSTER: usize = 10;

fn read_usize(path: &str) -> Option<usize> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The inotify instances the processes of user `uid` hold (the kernel
/// counts them against that user's `fs.inotify.max_user_instances`).
fn inotify_instances_of(uid: u32) -> usize {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .flatten()
        .filter(|p| {
            p.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|p| p.metadata().is_ok_and(|m| m.uid() == uid))
        .filter_map(|p| std::fs::read_dir(p.path().join("fd")).ok())
        .flat_map(|fds| fds.flatten())
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == "anon_inode:inotify")
        })
        .count()
}

/// Removes what kubelet nodes of SIGKILLed harnesses left (see the module
/// docs). [`KubeletNodes::start`] does it first; call it before creating
/// the pod bridge so a bridge slot is reused only once its old pods are gone.
///
/// # Errors
/// [`NodesError::Io`] when the lock directory cannot be used.
pub async fn sweep(stop_timeout: Duration) -> Result<(), NodesError> {
    sweep_stale(stop_timeout).await
}

impl KubeletNodes {
    /// Starts every node of `config` on `bridge` against `plane` (whose
    /// kube-apiserver serves on the bridge's gateway) and waits until each
    /// Node is Ready. Node directories go under `work_dir/nodes/`.
    ///
    /// # Errors
    /// [`NodesError`]; the nodes started so far are stopped again.
    pub async fn start(
        config: &Config,
        specs: &[NodeSpec],
        bridge: Arc<Bridge>,
        plane: &ControlPlane,
        work_dir: &Path,
    ) -> Result<Self, NodesError> {
        check(config, specs.len())?;
        sweep(config.stop_timeout).await?;
        let proc_cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let base = cgroup_base(&proc_cgroup);
        let run_id = format!("{:08x}", rand::random::<u32>());
        let mut nodes = Self {
            nodes: Vec::new(),
            bridge: bridge.clone(),
            stop_timeout: config.stop_timeout,
            ctr: config.bin_dir.join("ctr"),
        };
        let cluster = Cluster {
            config,
            count: specs.len(),
            bridge: &bridge,
            plane,
            work_dir,
            base: &base,
            run_id: &run_id,
        };
        for (index, spec) in specs.iter().enumerate() {
            match Node::start(index, spec, &cluster).await {
                Ok(node) => nodes.nodes.push(node),
                Err(e) => {
                    nodes.shutdown().await;
                    return Err(e);
                }
            }
        }
        if let Err(e) = nodes.await_ready(plane, config.ready_timeout).await {
            nodes.shutdown().await;
            return Err(e);
        }
        Ok(nodes)
    }

    async fn await_ready(&mut self, plane: &ControlPlane, timeout: Duration) -> Result<(), NodesError> {
        let api: Api<NodeObject> = Api::all(plane.client().await?);
        let begin = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let mut waiting = Vec::new();
            for node in &mut self.nodes {
                node.check_running()?;
                let ready = api
                    .get_opt(&node.layout.name)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|n| {
                        n.status
                            .and_then(|s| s.conditions)
                            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                    });
                if !ready {
                    waiting.push(node.layout.name.clone());
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if begin.elapsed() >= timeout {
                let first = &self.nodes[self
                    .nodes
                    .iter()
                    .position(|n| n.layout.name == waiting[0])
                    .unwrap_or(0)];
                let log = first.layout.dir.join("logs/kubelet.log");
                return Err(NodesError::NotReady {
                    what: format!("kubelet nodes {} were not Ready", waiting.join(", ")),
                    waited: begin.elapsed(),
                    tail: log_tail(&log, 30),
                    log,
                });
            }
        }
    }

    /// The names the images of `archive` (one of [`Config::images`]) have
    /// in the nodes (`localhost/skipper:0.1.0`).
    #[must_use]
    pub fn image_names(&self, archive: &Path) -> Vec<String> {
        self.nodes
            .first()
            .and_then(|n| n.images.iter().find(|(a, _)| a == archive))
            .map(|(_, names)| names.clone())
            .unwrap_or_default()
    }

    /// The ids of the nodes' cgroup trees and lock files
    /// (`<base>/skipper-kubelet-<id>`, `/run/skipper-kubelet/<id>.lock`).
    #[must_use]
    pub fn cgroup_ids(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.lock_id.clone()).collect()
    }

    /// The nodes' names.
    #[must_use]
    pub fn names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.layout.name.clone()).collect()
    }

    /// The directory of node `name` (configuration, logs in `logs/`, the
    /// kubelet's root and the pods' logs).
    #[must_use]
    pub fn node_dir(&self, name: &str) -> Option<&Path> {
        self.nodes
            .iter()
            .find(|n| n.layout.name == name)
            .map(|n| n.layout.dir.as_path())
    }

    /// The host pids of the container whose status names `container_id`
    /// (`containerd://<id>` or the bare id): the processes of its cgroup.
    #[must_use]
    pub fn container_pids(&self, container_id: &str) -> Vec<i32> {
        let trees: Vec<PathBuf> = self.nodes.iter().flat_map(|n| n.cgroup.dirs()).collect();
        pids_of_container(&trees, container_id)
    }

    /// Gives the image `source` (a name [`Self::image_names`] lists) the
    /// name `target` too, in every node (`ctr images tag`): a second tag of
    /// an imported image, as a registry would serve it.
    ///
    /// # Errors
    /// [`NodesError::Command`] with what `ctr` said.
    pub async fn tag_image(&self, source: &str, target: &str) -> Result<(), NodesError> {
        for node in &self.nodes {
            run(
                &format!("tagging {source} as {target} in {}", node.layout.name),
                &[
                    s(&self.ctr),
                    "--address".into(),
                    s(&node.layout.containerd_socket()),
                    "--namespace".into(),
                    "k8s.io".into(),
                    "images".into(),
                    "tag".into(),
                    "--force".into(),
                    source.into(),
                    target.into(),
                ],
                Duration::from_secs(30),
            )
            .await?;
        }
        Ok(())
    }

    /// The directory of volume `volume` of plugin `plugin`
    /// (`kubernetes.io~empty-dir`) of the pod with UID `uid`, on whichever
    /// node runs it.
    #[must_use]
    pub fn pod_volume(&self, uid: &str, plugin: &str, volume: &str) -> Option<PathBuf> {
        self.nodes
            .iter()
            .map(|n| {
                n.layout
                    .dir
                    .join("kubelet/root/pods")
                    .join(uid)
                    .join("volumes")
                    .join(plugin)
                    .join(volume)
            })
            .find(|d| d.is_dir())
    }

    /// Stops every node (see `Node::stop`), in reverse order.
    pub async fn shutdown(mut self) {
        let timeout = self.stop_timeout;
        while let Some(node) = self.nodes.pop() {
            node.stop(timeout, &self.bridge).await;
        }
    }
}

impl Drop for KubeletNodes {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

// ---------------------------------------------------------------------------
// metrics-server.

/// The user metrics-server authenticates as.
pub const METRICS_SERVER_USER: &str = "system:metrics-server";

/// metrics-server as a process of the host, serving `metrics.k8s.io` to
/// the aggregation layer from what it scrapes off the kubelets'
/// `/metrics/resource` (over their `InternalIP`, verified with the cluster
/// CA). Dropping it kills the process.
#[derive(Debug)]
pub struct MetricsServer {
    child: Child,
    port: u16,
}

impl MetricsServer {
    /// Grants metrics-server's identity what upstream's manifests grant it,
    /// starts it on a loopback port, registers it (`kube-system/metrics-server`
    /// and the `v1beta1.metrics.k8s.io` APIService) and waits until the
    /// APIService is Available.
    ///
    /// # Errors
    /// [`NodesError`].
    pub async fn start(
        plane: &ControlPlane,
        bin_dir: &Path,
        dir: &Path,
        available_within: Duration,
    ) -> Result<Self, NodesError> {
        std::fs::create_dir_all(dir).map_err(|source| NodesError::Io {
            what: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
        let admin = plane.client().await?;
        grant_metrics_server(&admin, METRICS_SERVER_USER).await?;
        let kubeconfig = plane.kubeconfig_for("metrics-server", METRICS_SERVER_USER, &[])?;
        let ca = pki::Ca::generate("skipper-metrics-server-ca")?;
        let serving = ca.issue_serving(
            "metrics-server",
            &[
                "metrics-server.kube-system.svc".into(),
                "localhost".into(),
                "127.0.0.1".into(),
            ],
        )?;
        pki::write_file(&dir.join("serving.crt"), &serving.cert_pem, false)?;
        pki::write_file(&dir.join("serving.key"), &serving.key_pem, true)?;
        let front_proxy_ca = dir.join("front-proxy-ca.crt");
        pki::write_file(&front_proxy_ca, &plane.front_proxy().ca_pem, false)?;
        let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|source| NodesError::Io {
                what: "choosing a port for",
                path: "metrics-server".into(),
                source,
            })?;
        let flag = |name: &str, value: String| format!("--{name}={value}");
        let argv = vec![
            s(&bin_dir.join("metrics-server")),
            flag("bind-address", "127.0.0.1".into()),
            flag("secure-port", port.to_string()),
            flag("tls-cert-file", s(&dir.join("serving.crt"))),
            flag("tls-private-key-file", s(&dir.join("serving.key"))),
            flag("kubeconfig", s(&kubeconfig)),
            flag("authentication-kubeconfig", s(&kubeconfig)),
            flag("authorization-kubeconfig", s(&kubeconfig)),
            flag("requestheader-client-ca-file", s(&front_proxy_ca)),
            flag(
                "requestheader-allowed-names",
                super::control_plane::FRONT_PROXY_CLIENT.into(),
            ),
            flag("requestheader-username-headers", "X-Remote-User".into()),
            flag("requestheader-group-headers", "X-Remote-Group".into()),
            flag("requestheader-extra-headers-prefix", "X-Remote-Extra-".into()),
            flag("kubelet-preferred-address-types", "InternalIP".into()),
            flag("kubelet-use-node-status-port", "true".into()),
            flag("kubelet-certificate-authority", s(plane.ca_cert())),
            // Its shortest scrape interval (it must exceed the request timeout).
            flag("metric-resolution", "10s".into()),
            flag("kubelet-request-timeout", "5s".into()),
            flag("profiling", "false".into()),
        ];
        let child = spawn("metrics-server", &argv, &dir.join("metrics-server.log"))?;
        let me = Self { child, port };
        super::metrics_api::register(
            &admin,
            "kube-system",
            "metrics-server",
            port,
            ca.cert_pem(),
            available_within,
        )
        .await?;
        Ok(me)
    }

    /// Its port on `127.0.0.1`.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops it (SIGTERM, then SIGKILL after `timeout`).
    pub async fn shutdown(mut self, timeout: Duration) {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        if tokio::time::timeout(timeout, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

/// What upstream's manifests grant metrics-server, for `user`: reading
/// pods, nodes and the kubelets' metrics, delegating authentication and
/// authorization (TokenReview, SubjectAccessReview), and reading the
/// requestheader configuration in `kube-system`.
async fn grant_metrics_server(client: &kube::Client, user: &str) -> Result<(), NodesError> {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
    use kube::api::PostParams;
    let subject = json!([{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]);
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": "system:metrics-server"},
        "rules": [
            {"apiGroups": [""], "resources": ["nodes/metrics"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]},
        ],
    }))
    .map_err(|e| NodesError::MetricsServer(e.to_string()))?;
    let bindings: Vec<ClusterRoleBinding> = [
        ("system:metrics-server", "system:metrics-server"),
        ("metrics-server:system:auth-delegator", "system:auth-delegator"),
    ]
    .into_iter()
    .map(|(name, role)| {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": subject,
        }))
    })
    .collect::<Result<_, _>>()
    .map_err(|e| NodesError::MetricsServer(e.to_string()))?;
    let reader: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "metrics-server-auth-reader", "namespace": "kube-system"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "extension-apiserver-authentication-reader"},
        "subjects": subject,
    }))
    .map_err(|e| NodesError::MetricsServer(e.to_string()))?;
    let create_err = |what: &str| {
        let what = what.to_owned();
        move |e: kube::Error| NodesError::MetricsServer(format!("creating {what}: {e}"))
    };
    let pp = PostParams::default();
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await
        .map_err(create_err("ClusterRole system:metrics-server"))?;
    for b in &bindings {
        Api::<ClusterRoleBinding>::all(client.clone())
            .create(&pp, b)
            .await
            .map_err(create_err("a ClusterRoleBinding of metrics-server"))?;
    }
    Api::<RoleBinding>::namespaced(client.clone(), "kube-system")
        .create(&pp, &reader)
        .await
        .map_err(create_err("RoleBinding kube-system/metrics-server-auth-reader"))?;
    Ok(())
}

#[cfg(test)]
mod inotify_tests {
    use super::*;

    #[test]
    fn nodes_that_would_exhaust_inotify_instances_name_the_sysctl() {
        // Two nodes and their control plane need 2 × 8 + 10 = 26.
        assert!(inotify_room(2, 128, 102).is_ok());
        let err = inotify_room(2, 128, 103).unwrap_err().to_string();
        assert!(err.contains("need about 26 inotify instances"), "{err}");
        assert!(
            err.contains("fs.inotify.max_user_instances is 128 and root's processes use 103"),
            "{err}"
        );
        assert!(
            err.contains("sysctl -w fs.inotify.max_user_instances=1024"),
            "{err}"
        );
    }
}

#[cfg(test)]
mod import_tests {
    use super::*;

    #[test]
    fn imported_images_are_named_from_ctrs_lines_or_from_what_the_import_added() {
        let printed = "localhost/skipper:0.1.0 saved\napplication/vnd.oci.image.manifest.v1+json sha256:ab\n\
                       Importing\telapsed: 0.5 s\ttotal: 0.0 B\t(0.0 B/s)\n";
        assert_eq!(imported_names(printed), ["localhost/skipper:0.1.0"]);
        // The progress display stopped before its `saved` lines.
        assert!(imported_names("Importing\telapsed: 0.5 s\n").is_empty());
        let before = vec!["registry.k8s.io/pause:3.10".to_owned()];
        let after = vec![
            "localhost/skipper@sha256:ab".to_owned(),
            "registry.k8s.io/pause:3.10".to_owned(),
            "localhost/skipper:0.1.0".to_owned(),
        ];
        assert_eq!(
            added_names(&before, after),
            ["localhost/skipper:0.1.0", "localhost/skipper@sha256:ab"]
        );
    }
}
