//! One switch for the tests that can run against either Kubernetes
//! backend: the embedded simulator (the default) or the real control plane
//! built by `make control-plane` (`SKIPPER_TEST_CONTROL_PLANE=real`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use skipper_devcluster::control_plane;

/// Where `make control-plane` puts the binaries (`SKIPPER_CONTROL_PLANE_DIR` overrides).
pub fn control_plane_dir() -> PathBuf {
    std::env::var_os("SKIPPER_CONTROL_PLANE_DIR").map_or_else(
        || crate::workspace_root().join("target/control-plane"),
        PathBuf::from,
    )
}

/// Whether the tests were asked to run against the real control plane.
pub fn real_requested() -> bool {
    std::env::var("SKIPPER_TEST_CONTROL_PLANE").is_ok_and(|v| v == "real")
}

/// The control plane configuration for tests, or `None` (with a message)
/// when the binaries are not built and nothing demands them: CI
/// (`CI=true`) and `SKIPPER_TEST_CONTROL_PLANE=real` make a missing build a
/// failure.
pub fn control_plane_config() -> Option<control_plane::Config> {
    let dir = control_plane_dir();
    let built = control_plane::BINARIES.iter().all(|b| dir.join(b).is_file());
    if !built {
        let demanded = real_requested() || std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(
            !demanded,
            "the real control plane is not built in {}: run `make control-plane`",
            dir.display()
        );
        eprintln!(
            "skipped: the real control plane is not built in {} (run `make control-plane`)",
            dir.display()
        );
        return None;
    }
    Some(control_plane::Config {
        bin_dir: dir,
        ..control_plane::Config::default()
    })
}

pub use crate::eventually;

pub use crate::process::process_alive;

/// Whether this process runs as root.
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next().map(|u| u == "0"))
        .unwrap_or(false)
}

/// The archive of Skipper's image that `make image` writes.
pub fn image_archive() -> PathBuf {
    crate::workspace_root().join("target/image/skipper.oci.tar")
}

/// The configuration of `nodes` kubelet nodes (`make nodes`, with the image
/// of `make image` imported), or `None` (with a message) when something they
/// need is missing and nothing demands it: under `CI=true` that is a failure.
pub fn kubelet_nodes_config(nodes: usize) -> Option<skipper_devcluster::kubelet_nodes::Config> {
    let config = skipper_devcluster::kubelet_nodes::Config {
        bin_dir: crate::workspace_root().join("target/nodes"),
        images: vec![image_archive()],
        ..skipper_devcluster::kubelet_nodes::Config::default()
    };
    let problem = if is_root() {
        skipper_devcluster::kubelet_nodes::check(&config, nodes)
            .err()
            .map(|e| e.to_string())
    } else {
        Some("kubelet nodes need root".to_owned())
    };
    if let Some(problem) = problem {
        assert!(std::env::var("CI").map_or(true, |v| v != "true"), "{problem}");
        eprintln!("skipped: {problem} (`make nodes image`)");
        return None;
    }
    Some(config)
}

/// The cgroup directories of the kubelet node `id` in every hierarchy
/// (`<base>/skipper-kubelet-<id>`, a few levels down): what a stopped node
/// must not leave.
pub fn kubelet_node_cgroups(id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for h in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let found = std::process::Command::new("find")
            .arg(h.path())
            .args(["-maxdepth", "4", "-type", "d", "-name"])
            .arg(format!(
                "{}{id}",
                skipper_devcluster::kubelet_nodes::CGROUP_PREFIX
            ))
            .output()
            .unwrap();
        out.extend(String::from_utf8_lossy(&found.stdout).lines().map(str::to_owned));
    }
    out
}

/// A Kubernetes API to test against: the simulator or the real control plane.
pub enum Backend {
    /// The in-process simulator.
    Sim(skipper_devcluster::Cluster),
    /// etcd, kube-apiserver, kube-controller-manager and kube-scheduler.
    Real(Box<control_plane::ControlPlane>),
    /// The real control plane with our node agent running its pods on a
    /// pod network (pod IPs reachable from this process).
    Cluster(Box<skipper_devcluster::real_cluster::RealCluster>),
}

/// What kubectl answered.
#[derive(Debug)]
pub struct Kubectl {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Backend {
    /// The simulator with test intervals and `namespaces` created.
    pub async fn sim(namespaces: &[&str]) -> Self {
        let config = skipper_devcluster::Config {
            skipper_exe: crate::skipper_exe(),
            namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
            metrics_interval: Duration::from_millis(200),
            bookmark_interval: Duration::from_millis(200),
            resync_interval: Duration::from_millis(200),
            ..skipper_devcluster::Config::default()
        };
        Self::Sim(
            skipper_devcluster::Cluster::start(config)
                .await
                .unwrap_or_else(|e| panic!("start the simulator: {e}")),
        )
    }

    /// The real control plane with `namespaces` created, or `None` when it
    /// is not built (see [`control_plane_config`]).
    pub async fn real(namespaces: &[&str]) -> Option<Self> {
        let config = control_plane_config()?;
        let plane = control_plane::ControlPlane::start(config)
            .await
            .unwrap_or_else(|e| panic!("start the control plane: {e}"));
        let me = Self::Real(Box::new(plane));
        for ns in namespaces {
            me.create_namespace(ns).await;
        }
        Some(me)
    }

    /// The real control plane with our node agent (one node, pod metrics
    /// through `metrics.k8s.io`) and `namespaces` created, or `None` when it
    /// is not built (see [`control_plane_config`]).
    pub async fn real_with_pods(namespaces: &[&str]) -> Option<Self> {
        use skipper_devcluster::real_cluster;
        let control_plane = control_plane_config()?;
        let cluster = real_cluster::RealCluster::start(real_cluster::Config {
            control_plane,
            skipper_exe: crate::skipper_exe(),
            metrics_interval: Duration::from_millis(200),
            restart_backoff: skipper_devcluster::kubelet::BackoffPolicy {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(4),
            },
            namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
            metrics_api: true,
            ..real_cluster::Config::default()
        })
        .await
        .unwrap_or_else(|e| panic!("start the real cluster: {e}"));
        Some(Self::Cluster(Box::new(cluster)))
    }

    /// The backend `SKIPPER_TEST_CONTROL_PLANE` names (`real`, or the simulator).
    pub async fn from_env(namespaces: &[&str]) -> Option<Self> {
        if real_requested() {
            Self::real(namespaces).await
        } else {
            Some(Self::sim(namespaces).await)
        }
    }

    /// [`Self::from_env`] for a scenario that needs pods: the real control
    /// plane comes with our node agent.
    pub async fn from_env_with_pods(namespaces: &[&str]) -> Option<Self> {
        if real_requested() {
            Self::real_with_pods(namespaces).await
        } else {
            Some(Self::sim(namespaces).await)
        }
    }

    /// `simulator` or `real`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sim(_) => "simulator",
            Self::Real(_) | Self::Cluster(_) => "real",
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self, Self::Real(_) | Self::Cluster(_))
    }

    /// The administrator's kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        match self {
            Self::Sim(c) => c.kubeconfig_path().to_path_buf(),
            Self::Real(p) => p.admin_kubeconfig().to_path_buf(),
            Self::Cluster(c) => c.admin_kubeconfig().to_path_buf(),
        }
    }

    async fn config(&self) -> kube::Config {
        let text = std::fs::read_to_string(self.kubeconfig()).unwrap();
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap()
    }

    /// A client as the administrator.
    pub async fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config().await).unwrap()
    }

    /// A client that acts as `user` in `groups` (impersonation by the
    /// administrator, as `kubectl --as` does).
    pub async fn client_as(&self, user: &str, groups: &[&str]) -> kube::Client {
        let mut config = self.config().await;
        config.auth_info.impersonate = Some(user.to_owned());
        if !groups.is_empty() {
            config.auth_info.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
        }
        kube::Client::try_from(config).unwrap()
    }

    /// A client that authenticates as ServiceAccount `ns/name` with a token
    /// from the TokenRequest API (default audiences, one hour), as a pod's
    /// projected token does.
    pub async fn service_account_client(&self, ns: &str, name: &str) -> kube::Client {
        kube::Client::try_from(self.service_account_config(ns, name).await).unwrap()
    }

    /// The configuration of [`Self::service_account_client`].
    pub async fn service_account_config(&self, ns: &str, name: &str) -> kube::Config {
        let sas: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
            kube::Api::namespaced(self.client().await, ns);
        let request =
            serde_json::from_value(serde_json::json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))
                .unwrap();
        let token = sas
            .create_token_request(name, &kube::api::PostParams::default(), &request)
            .await
            .unwrap_or_else(|e| panic!("token for {ns}/{name}: {e}"))
            .status
            .expect("a TokenRequest status")
            .token;
        let mut kubeconfig: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(self.kubeconfig()).unwrap()).unwrap();
        for user in kubeconfig["users"].as_sequence_mut().unwrap() {
            user["user"] = serde_yaml_ng::from_str(&format!("token: {token}")).unwrap();
        }
        let kubeconfig =
            kube::config::Kubeconfig::from_yaml(&serde_yaml_ng::to_string(&kubeconfig).unwrap()).unwrap();
        kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap()
    }

    /// Creates a namespace (as the administrator).
    pub async fn create_namespace(&self, name: &str) {
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
            kube::Api::all(self.client().await);
        namespaces
            .create(
                &kube::api::PostParams::default(),
                &serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap(),
            )
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
    }

    /// Runs kubectl with the administrator's kubeconfig and a private cache
    /// directory.
    pub async fn kubectl(&self, args: &[&str]) -> Kubectl {
        self.kubectl_with_stdin(args, None).await
    }

    /// [`Self::kubectl`] with `stdin` fed to it.
    pub async fn kubectl_with_stdin(&self, args: &[&str], stdin: Option<&str>) -> Kubectl {
        use tokio::io::AsyncWriteExt as _;
        let cache = std::env::temp_dir().join(format!(
            "skipper-kubectl-cache-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let mut child = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .arg("--cache-dir")
            .arg(&cache)
            .args(args)
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run kubectl");
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().unwrap();
            pipe.write_all(input.as_bytes()).await.unwrap();
            drop(pipe);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("kubectl finished within 60 s")
            .unwrap();
        let _ = std::fs::remove_dir_all(&cache);
        Kubectl {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Compacts the history: the simulator forgets its event history, the
    /// real control plane compacts etcd to its current revision.
    pub async fn compact(&self) {
        match self {
            Self::Sim(c) => c.compact(),
            Self::Real(p) => {
                p.compact().await.unwrap_or_else(|e| panic!("{e}"));
            }
            Self::Cluster(c) => {
                c.control_plane()
                    .compact()
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    /// Whether pods run on this backend (a node agent serves it).
    pub fn runs_pods(&self) -> bool {
        matches!(self, Self::Sim(_) | Self::Cluster(_))
    }

    /// The directory of pod `ns/name` on its node (its volumes under
    /// `volumes/<name>/`), when this backend runs pods and has it.
    pub fn pod_dir(&self, ns: &str, name: &str) -> Option<PathBuf> {
        match self {
            Self::Sim(c) => c.pod_dir(ns, name),
            Self::Real(_) => None,
            Self::Cluster(c) => Some(c.kubelet().pod_dir(ns, name)).filter(|d| d.is_dir()),
        }
    }

    /// Kills the main process of pod `ns/name` as a crash would (SIGKILL);
    /// its pid, or `None` when no such process runs here.
    pub fn kill_pod_process(&self, ns: &str, name: &str) -> Option<u32> {
        match self {
            Self::Sim(c) => c.kill_pod_process(ns, name).ok(),
            Self::Real(_) => None,
            Self::Cluster(c) => c.kubelet().kill_process(ns, name),
        }
    }

    /// Stops it (every process it started).
    pub async fn shutdown(self) {
        match self {
            Self::Sim(c) => c.shutdown().await,
            Self::Real(p) => p.shutdown().await,
            Self::Cluster(c) => c.shutdown().await,
        }
    }
}

/// Declares a scenario `async fn(&Backend)` as two tests, `<name>::simulator`
/// and `<name>::real`; `sim_deviation = "why"` marks the simulator's run as
/// ignored, naming a known difference (listed in the simulator's deviations);
/// `pods` gives the real run our node agent ([`Backend::real_with_pods`]).
#[macro_export]
macro_rules! differential {
    ($name:ident, $scenario:ident, namespaces = [$($ns:expr),*], pods) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn simulator() {
                let backend = $crate::backend::Backend::sim(&[$($ns),*]).await;
                super::$scenario(&backend).await;
                backend.shutdown().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn real() {
                let Some(backend) = $crate::backend::Backend::real_with_pods(&[$($ns),*]).await else { return };
                super::$scenario(&backend).await;
                backend.shutdown().await;
            }
        }
    };
    ($name:ident, $scenario:ident, namespaces = [$($ns:expr),*] $(, sim_deviation = $why:literal)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[ignore = $why])?
            async fn simulator() {
                let backend = $crate::backend::Backend::sim(&[$($ns),*]).await;
                super::$scenario(&backend).await;
                backend.shutdown().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn real() {
                let Some(backend) = $crate::backend::Backend::real(&[$($ns),*]).await else { return };
                super::$scenario(&backend).await;
                backend.shutdown().await;
            }
        }
    };
}

/// Whether kubectl is installed (its steps skip with a message otherwise).
pub fn kubectl_available() -> bool {
    std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
}
