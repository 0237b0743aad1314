//! `skipper dev --control-plane real --nodes kubelet`: the playground on
//! kubelet nodes (the fidelity mode). The real control plane's nodes are
//! upstream kubelets with containerd (built by `make nodes`), and every part
//! of Skipper — the controllers, the router and the pool — is a pod from the
//! image `make image` builds, imported into each node: run by runc as the
//! manifests' non-root user with a read-only root, its resource limits in
//! cgroups, its probes the kubelet's, under Pod Security `restricted`
//! (enforced on the controllers' and the pools' namespaces).
//!
//! The router is the manifest's Deployment (one replica); the playground
//! forwards `--listen` and `--metrics-listen` to the Ready router pods (as
//! a Service would), so the printed curl works as on the other backends.
//!
//! Everything is checked before anything starts: the nodes' build, the
//! image archive, runc and the CNI plugins; a missing one fails in one line
//! naming what to run.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use serde_json::{Value, json};
use skipper_devcluster::kubelet_nodes;
use tokio::net::{TcpListener, TcpStream};

use super::playground::{CONTROLLER_NAMESPACE, ControlPlaneKind, PlaygroundArgs};
use crate::shutdown::Shutdown;

/// Where `make nodes` puts the nodes' binaries, relative to the repository.
pub const DEFAULT_NODES_DIR: &str = "target/nodes";
/// Where `make image` writes the image archive, relative to the repository.
pub const DEFAULT_IMAGE_ARCHIVE: &str = "target/image/skipper.oci.tar";
/// The router pods' HTTP and metrics ports (`manifests/router.yaml`).
pub const ROUTER_PORT: u16 = 8080;
pub const ROUTER_METRICS_PORT: u16 = 9090;
/// Label selector of the router pods.
pub const ROUTER_SELECTOR: &str = "app.kubernetes.io/name=skipper,app.kubernetes.io/component=router";
/// The Pod Security admission label the playground sets on its namespaces.
pub const POD_SECURITY_ENFORCE: &str = "pod-security.kubernetes.io/enforce";
/// How long a connection to a router pod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How many nodes the playground runs: one per zone of the simulator's
/// nodes.
#[must_use]
pub fn node_count() -> usize {
    skipper_devcluster::Config::default().zones.len()
}

/// Who runs the pods of `skipper dev --control-plane real`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum NodeKind {
    /// Skipper's node agent: pods are processes of the host.
    #[default]
    Agent,
    /// Upstream kubelets and containerd (`make nodes`): pods from the image (`make image`).
    Kubelet,
}

/// Why the playground cannot run on kubelet nodes, or stopped serving there.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("--nodes kubelet runs on the real control plane: add --control-plane real")]
    NeedsRealControlPlane,
    #[error(
        "--command runs a shell command as a pod process of the host; kubelet nodes run pods from the image, \
         which has no shell: drop --command or --nodes kubelet"
    )]
    CommandNeedsAgent,
    #[error(
        "{flag}: no {binary} in {looked_in}; build the kubelet nodes with `make nodes` (needs Go, gcc and buildah){}",
        if *flag == "--nodes-dir" { "" } else { " or name their directory with --nodes-dir" }
    )]
    NodesMissing {
        flag: &'static str,
        binary: String,
        looked_in: String,
    },
    #[error(
        "{flag}: no image archive at {looked_in}; build it with `make image` (needs buildah){}",
        if *flag == "--image-archive" { "" } else { " or name it with --image-archive" }
    )]
    ImageMissing { flag: &'static str, looked_in: String },
    #[error("--nodes kubelet: {0}")]
    Nodes(#[from] kubelet_nodes::NodesError),
    #[error("--nodes kubelet: the image {0} has no name in the nodes")]
    ImageUnnamed(PathBuf),
    #[error("{flag} {addr}: cannot listen there ({source}); choose another address with {flag}")]
    Listen {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("labelling namespace {namespace}: {source}")]
    Label {
        namespace: String,
        #[source]
        source: Box<kube::Error>,
    },
}

/// What `--nodes kubelet` runs, found before anything starts.
#[derive(Debug, Clone)]
pub struct Build {
    /// `make nodes`' directory.
    pub nodes_dir: PathBuf,
    /// `make image`'s archive.
    pub image_archive: PathBuf,
}

impl Build {
    /// The nodes' configuration: `make nodes`' binaries, the image imported.
    #[must_use]
    pub fn nodes_config(&self) -> kubelet_nodes::Config {
        kubelet_nodes::Config {
            bin_dir: self.nodes_dir.clone(),
            images: vec![self.image_archive.clone()],
            ..kubelet_nodes::Config::default()
        }
    }
}

/// `candidates` in order: the first that `has` accepts, or every one looked
/// at (for the error).
fn first_of(candidates: &[PathBuf], has: impl Fn(&Path) -> bool) -> Result<PathBuf, String> {
    candidates.iter().find(|c| has(c)).cloned().ok_or_else(|| {
        candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" and ")
    })
}

/// `flag` when given, else `default` and `beside` in the parent of `exe`'s
/// directory (`target/debug/skipper` → `target/<beside>`).
fn candidates(flag: Option<&Path>, default: &Path, exe: &Path, beside: &str) -> Vec<PathBuf> {
    if let Some(p) = flag {
        return vec![p.to_path_buf()];
    }
    let mut c = vec![default.to_path_buf()];
    if let Some(b) = exe.parent().and_then(Path::parent).map(|p| p.join(beside))
        && !c.contains(&b)
    {
        c.push(b);
    }
    c
}

/// What `--nodes kubelet` needs, checked: the flags that go with it, the
/// nodes' binaries (`--nodes-dir`, default [`DEFAULT_NODES_DIR`], else
/// `nodes` beside the executable's directory), the image archive
/// (`--image-archive`, default [`DEFAULT_IMAGE_ARCHIVE`], else
/// `image/skipper.oci.tar` there), runc, the CNI plugins and cgroups.
///
/// # Errors
/// [`KubeletError`], one line naming the flag, what is missing and what to run.
pub fn find_build(args: &PlaygroundArgs, exe: &Path) -> Result<Build, KubeletError> {
    if args.control_plane != ControlPlaneKind::Real {
        return Err(KubeletError::NeedsRealControlPlane);
    }
    if args.pod_command.is_some() {
        return Err(KubeletError::CommandNeedsAgent);
    }
    let flag = |given: bool, name: &'static str| if given { name } else { "--nodes kubelet" };
    let dirs = candidates(
        args.nodes_dir.as_deref(),
        Path::new(DEFAULT_NODES_DIR),
        exe,
        "nodes",
    );
    let missing = |dir: &Path| {
        kubelet_nodes::BINARIES
            .iter()
            .map(|b| (*b, true))
            .chain([(kubelet_nodes::PAUSE_ARCHIVE, false)])
            .find(|(b, exec)| {
                let path = dir.join(b);
                if *exec {
                    !is_executable(&path)
                } else {
                    !path.is_file()
                }
            })
            .map(|(b, _)| b.to_owned())
    };
    let nodes_dir =
        first_of(&dirs, |d| missing(d).is_none()).map_err(|looked_in| KubeletError::NodesMissing {
            flag: flag(args.nodes_dir.is_some(), "--nodes-dir"),
            binary: missing(&dirs[0]).unwrap_or_default(),
            looked_in,
        })?;
    let archives = candidates(
        args.image_archive.as_deref(),
        Path::new(DEFAULT_IMAGE_ARCHIVE),
        exe,
        "image/skipper.oci.tar",
    );
    let image_archive =
        first_of(&archives, |a| a.is_file()).map_err(|looked_in| KubeletError::ImageMissing {
            flag: flag(args.image_archive.is_some(), "--image-archive"),
            looked_in,
        })?;
    // Absolute: the nodes run their binaries from directories of their own.
    let absolute = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    let build = Build {
        nodes_dir: absolute(nodes_dir),
        image_archive: absolute(image_archive),
    };
    kubelet_nodes::check(&build.nodes_config(), node_count())?;
    Ok(build)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The name the nodes gave the image of `archive`.
///
/// # Errors
/// [`KubeletError::ImageUnnamed`] when the archive named none.
pub fn image_name(nodes: &kubelet_nodes::KubeletNodes, archive: &Path) -> Result<String, KubeletError> {
    nodes
        .image_names(archive)
        .into_iter()
        .next()
        .ok_or_else(|| KubeletError::ImageUnnamed(archive.to_path_buf()))
}

/// One manifest object as it runs on kubelet nodes: every container of a
/// Deployment that names `skipper` runs `image`, never pulled (there is no
/// registry), as `kustomization.yaml`'s `images:` sets an operator's; a
/// Namespace enforces Pod Security `restricted`, as the README's `kubectl
/// label` does.
pub fn for_image(doc: &mut Value, image: &str) {
    match doc["kind"].as_str() {
        Some("Namespace") => {
            doc["metadata"]["labels"][POD_SECURITY_ENFORCE] = json!("restricted");
        }
        Some("Deployment") => {
            for c in doc["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .into_iter()
                .flatten()
            {
                if c["image"] == "skipper" {
                    c["image"] = json!(image);
                    c["imagePullPolicy"] = json!("Never");
                }
            }
        }
        _ => {}
    }
}

/// Enforces Pod Security `restricted` on an existing namespace (the pools'
/// `default`).
///
/// # Errors
/// [`KubeletError::Label`] with the API's answer.
pub async fn enforce_restricted(client: &kube::Client, namespace: &str) -> Result<(), KubeletError> {
    Api::<Namespace>::all(client.clone())
        .patch(
            namespace,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {POD_SECURITY_ENFORCE: "restricted"}}})),
        )
        .await
        .map_err(|e| KubeletError::Label {
            namespace: namespace.to_owned(),
            source: Box::new(e),
        })?;
    Ok(())
}

/// The router Deployment of `manifests/router.yaml` as the playground runs
/// it on kubelet nodes: one replica, heartbeats every `heartbeat`, text logs,
/// and `env` added (telemetry).
pub fn router_deployment(doc: &mut Value, heartbeat: Duration, env: &[(String, String)]) {
    if doc["kind"] != "Deployment" {
        return;
    }
    doc["spec"]["replicas"] = json!(1);
    let container = &mut doc["spec"]["template"]["spec"]["containers"][0];
    let mut vars: Vec<(String, String)> = vec![
        (
            "SKIPPER_HEARTBEAT_INTERVAL".into(),
            crate::config::format_duration(heartbeat),
        ),
        ("SKIPPER_LOG_FORMAT".into(), "text".into()),
    ];
    vars.extend(env.iter().cloned());
    let list = container["env"].as_array_mut();
    if let Some(list) = list {
        for (name, value) in vars {
            list.retain(|e| e["name"] != name.as_str());
            list.push(json!({"name": name, "value": value}));
        }
    }
}

/// Serves `--listen` and `--metrics-listen` by forwarding each connection
/// to a Ready router pod (the next one in turn), as a Service would:
/// tasks of `shutdown` that stop with it.
///
/// # Errors
/// [`KubeletError::Listen`] when an address is taken.
pub async fn forward_to_router_pods(
    client: kube::Client,
    listen: SocketAddr,
    metrics_listen: SocketAddr,
    shutdown: &Shutdown,
) -> Result<(), KubeletError> {
    let mut listeners = Vec::new();
    for (flag, addr, port) in [
        ("--listen", listen, ROUTER_PORT),
        ("--metrics-listen", metrics_listen, ROUTER_METRICS_PORT),
    ] {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| KubeletError::Listen { flag, addr, source })?;
        listeners.push((listener, port));
    }
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    let token = shutdown.token().clone();
    shutdown.spawn("router-pods", async move {
        tokio::select! {
            () = follow_router_pods(client, tx) => {}
            () = token.cancelled() => {}
        }
    });
    for (listener, port) in listeners {
        let (rx, forwarder) = (rx.clone(), shutdown.clone());
        shutdown.spawn("router-forward", async move {
            accept(listener, port, rx, forwarder).await;
        });
    }
    Ok(())
}

/// Sends the IPs of the Ready, not terminating router pods to `tx` each time
/// they change (a watch of the router pods); ends when nobody listens.
async fn follow_router_pods(client: kube::Client, tx: tokio::sync::watch::Sender<Vec<Ipv4Addr>>) {
    let api: Api<Pod> = Api::namespaced(client, CONTROLLER_NAMESPACE);
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default().labels(ROUTER_SELECTOR))
        .default_backoff()
        .reflect(writer);
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        if let Err(e) = event {
            tracing::debug!(error = %e, "watching the router pods");
            continue;
        }
        let ready: BTreeMap<String, Ipv4Addr> = reader
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && super::playground::pod_ready(p))
            .filter_map(|p| {
                let ip = p.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?;
                Some((p.metadata.name.clone()?, ip))
            })
            .collect();
        let ips: Vec<Ipv4Addr> = ready.into_values().collect();
        tx.send_if_modified(|now| {
            let changed = *now != ips;
            if changed {
                now.clone_from(&ips);
            }
            changed
        });
        if tx.is_closed() {
            return;
        }
    }
}

/// Accepts connections until shutdown, each forwarded by a task of its own.
async fn accept(
    listener: TcpListener,
    port: u16,
    pods: tokio::sync::watch::Receiver<Vec<Ipv4Addr>>,
    shutdown: Shutdown,
) {
    let turn = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((conn, _)) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection for the router pods");
                    continue;
                }
            },
        };
        let ips = pods.borrow().clone();
        let first = turn.fetch_add(1, Ordering::Relaxed);
        let token = shutdown.token().clone();
        shutdown.spawn("router-connection", async move {
            tokio::select! {
                () = token.cancelled() => {}
                () = forward(conn, &ips, first, port) => {}
            }
        });
    }
}

/// Connects to the first router pod of `ips` (from index `first` on) that
/// answers, and copies both ways until either side closes. Without one the
/// client's connection is closed.
async fn forward(mut conn: TcpStream, ips: &[Ipv4Addr], first: usize, port: u16) {
    for i in 0..ips.len() {
        let ip = ips[(first + i) % ips.len()];
        let Ok(Ok(mut upstream)) =
            tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((ip, port))).await
        else {
            continue;
        };
        let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
        return;
    }
    tracing::debug!(port, "no Ready router pod to forward to");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_run_the_image_never_pulled_under_restricted() {
        let mut ns = json!({"kind": "Namespace", "metadata": {"name": "skipper"}});
        for_image(&mut ns, "localhost/skipper:0.1.0");
        assert_eq!(ns["metadata"]["labels"][POD_SECURITY_ENFORCE], "restricted");
        let mut d = json!({"kind": "Deployment", "spec": {"template": {"spec": {"containers": [
            {"name": "a", "image": "skipper", "imagePullPolicy": "IfNotPresent"},
            {"name": "b", "image": "other"},
        ]}}}});
        for_image(&mut d, "localhost/skipper:0.1.0");
        let c = &d["spec"]["template"]["spec"]["containers"];
        assert_eq!(c[0]["image"], "localhost/skipper:0.1.0");
        assert_eq!(c[0]["imagePullPolicy"], "Never");
        assert_eq!(c[1], json!({"name": "b", "image": "other"}));
    }

    #[test]
    fn the_router_deployment_has_one_replica_and_the_playgrounds_settings() {
        let mut d = super::super::playground::manifest_documents(super::super::playground::ROUTER_YAML)
            .unwrap()
            .into_iter()
            .find(|d| d["kind"] == "Deployment")
            .unwrap();
        router_deployment(
            &mut d,
            Duration::from_secs(2),
            &[("SKIPPER_TELEMETRY".into(), "false".into())],
        );
        assert_eq!(d["spec"]["replicas"], 1);
        let env = d["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap();
        let value = |n: &str| {
            let found: Vec<&Value> = env.iter().filter(|e| e["name"] == n).collect();
            assert_eq!(found.len(), 1, "{n} once: {env:?}");
            found[0]["value"].clone()
        };
        assert_eq!(value("SKIPPER_HEARTBEAT_INTERVAL"), "2s");
        assert_eq!(value("SKIPPER_LOG_FORMAT"), "text");
        assert_eq!(value("SKIPPER_TELEMETRY"), "false");
    }

    #[test]
    fn the_build_is_the_flag_or_the_first_default_that_has_it_all() {
        let root = std::env::temp_dir().join(format!("skipper-kubelet-build-{:016x}", rand::random::<u64>()));
        let exe = root.join("install/bin/skipper");
        let (default, beside) = (root.join("target/nodes"), root.join("install/nodes"));
        let c = candidates(None, &default, &exe, "nodes");
        assert_eq!(c, vec![default.clone(), beside.clone()]);
        let flagged = root.join("mine");
        assert_eq!(candidates(Some(&flagged), &default, &exe, "nodes"), vec![flagged]);
        std::fs::create_dir_all(&beside).unwrap();
        assert_eq!(first_of(&c, Path::is_dir), Ok(beside.clone()));
        std::fs::remove_dir_all(&beside).unwrap();
        let err = first_of(&c, Path::is_dir).unwrap_err();
        assert_eq!(err, format!("{} and {}", default.display(), beside.display()));
        let _ = std::fs::remove_dir_all(&root);
    }
}
