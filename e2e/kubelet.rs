//! `skipper dev --control-plane real --nodes kubelet`: the nodes are
//! upstream kubelets with containerd 2, every Skipper pod is a container of
//! the image, the printed curl answers; and nothing of it stays on the host
//! after `skipper dev` is SIGKILLed and started again, then stopped with
//! Ctrl-C.
//!
//! Runs in `make e2e-kubelet`, after the scenarios there (it chooses its
//! own control plane and nodes, and needs the image); skipped with a
//! message when `make control-plane nodes image` has not run or this process
//! is not root (a failure under `CI=true`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use skipper_devcluster::kubelet_nodes;
use skipper_test_support::backend;

use crate::Timer;
use crate::harness::{Dev, Opts, real_control_plane};

/// The namespaces Skipper's pods run in: the controllers' and router's, the pool's.
const NAMESPACES: [&str; 2] = ["skipper", "default"];

/// `skipper dev` arguments for kubelet nodes.
fn kubelet_opts() -> Opts {
    Opts {
        extra: ["--control-plane", "real", "--nodes", "kubelet"]
            .map(str::to_owned)
            .to_vec(),
        ..Opts::default()
    }
}

/// What one `skipper dev --nodes kubelet` holds on the host: its work
/// directory (the processes started there: the control plane, containerd,
/// the kubelets, the shims), its nodes' cgroup ids and the pod network's
/// bridge.
struct Held {
    work_dir: PathBuf,
    node_ids: BTreeSet<String>,
    bridge: String,
}

/// Processes whose command line names `dir`.
fn processes_in(dir: &Path) -> BTreeSet<u32> {
    let dir = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&dir))
        })
        .collect()
}

/// The kubelet node ids of the cgroups `pids` are in.
fn node_ids(pids: &BTreeSet<u32>) -> BTreeSet<String> {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok())
        .flat_map(|text| {
            text.split('/')
                .filter_map(|part| {
                    part.trim()
                        .strip_prefix(kubelet_nodes::CGROUP_PREFIX)
                        .map(str::to_owned)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The link that holds the gateway (`.1`) of the /24 of `node_ip`.
fn bridge_of(node_ip: &str) -> String {
    let prefix = node_ip.rsplit_once('.').unwrap().0;
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains(&format!(" inet {prefix}.1/24 ")))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no link holds {prefix}.1/24"))
        .to_owned()
}

/// Links that are `bridge` or enslaved to it.
fn links_of(bridge: &str) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!(" {bridge}:")) || l.contains(&format!("master {bridge} ")))
        .map(str::to_owned)
        .collect()
}

/// Every node cgroup tree and lock file of `ids` still on the host.
fn node_leftovers(ids: &BTreeSet<String>) -> Vec<String> {
    let mut left = Vec::new();
    for id in ids {
        let lock = Path::new(kubelet_nodes::STATE_DIR).join(format!("{id}.lock"));
        if lock.exists() {
            left.push(lock.display().to_string());
        }
        left.extend(backend::kubelet_node_cgroups(id));
    }
    left
}

/// Mounts under `dir`.
fn mounts_in(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&dir))
        .map(str::to_owned)
        .collect()
}

/// The host settings the kubelet wants: sysctls and its iptables chains.
fn host_settings() -> Vec<String> {
    let mut out: Vec<String> = ["vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"]
        .iter()
        .map(|s| {
            format!(
                "{s}={}",
                std::fs::read_to_string(format!("/proc/sys/{s}")).unwrap().trim()
            )
        })
        .collect();
    if let Ok(o) = std::process::Command::new("iptables-save").output() {
        out.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with(':') && l.contains("KUBE"))
                .map(|l| l.split_whitespace().next().unwrap_or_default().to_owned()),
        );
    }
    out
}

/// What `held` left on the host (empty when nothing); its bridge is not
/// looked at when `reused` (a later `skipper dev` has the same /24).
fn leftovers(held: &Held, reused: bool) -> Vec<String> {
    let mut left: Vec<String> = processes_in(&held.work_dir)
        .iter()
        .map(|p| format!("process {p}"))
        .collect();
    if held.work_dir.exists() {
        left.push(held.work_dir.display().to_string());
    }
    left.extend(mounts_in(&held.work_dir));
    left.extend(node_leftovers(&held.node_ids));
    if !reused {
        left.extend(links_of(&held.bridge));
    }
    left
}

/// Checks what `skipper dev --nodes kubelet` runs and answers, and returns
/// what it holds on the host.
async fn check_running(dev: &Dev) -> Held {
    let nodes = Api::<Node>::all(dev.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(nodes.len(), backend_node_count(), "nodes");
    let mut node_ip = String::new();
    for n in &nodes {
        let status = n.status.as_ref().unwrap();
        let info = status.node_info.as_ref().unwrap();
        assert!(
            info.kubelet_version.starts_with("v1.37."),
            "kubelet {}",
            info.kubelet_version
        );
        assert!(
            info.container_runtime_version.starts_with("containerd://2."),
            "runtime {}",
            info.container_runtime_version
        );
        node_ip = status
            .addresses
            .iter()
            .flatten()
            .find(|a| a.type_ == "InternalIP")
            .unwrap()
            .address
            .clone();
    }
    let mut containers = 0;
    for ns in NAMESPACES {
        let pods = Api::<Pod>::namespaced(dev.client.clone(), ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items;
        assert!(!pods.is_empty(), "no pods in {ns}");
        for p in &pods {
            let name = p.metadata.name.clone().unwrap_or_default();
            let statuses = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.clone())
                .unwrap_or_default();
            assert!(!statuses.is_empty(), "{ns}/{name} has no container status");
            for c in &statuses {
                let id = c.container_id.as_deref().unwrap_or_default();
                assert!(
                    id.starts_with("containerd://"),
                    "{ns}/{name}: container id {id:?}"
                );
                assert!(c.image.contains("skipper"), "{ns}/{name} runs {}", c.image);
                containers += 1;
            }
        }
    }
    // The controller, the router and 3 pool pods (and a replacement as it starts).
    assert!(containers >= 5, "containers: {containers}");
    // The printed curl, as printed.
    let output = dev.output();
    let curl = output
        .lines()
        .find(|l| l.starts_with("curl "))
        .unwrap_or_else(|| panic!("no curl line:\n{output}"));
    let answer = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("sh").args(["-c", curl]).output(),
    )
    .await
    .expect("the printed curl did not finish within 60s")
    .unwrap();
    let body = String::from_utf8_lossy(&answer.stdout);
    assert!(answer.status.success(), "{curl}: {answer:?}");
    assert!(body.contains(r#""tenant":"t1""#), "{curl}: {body}");
    let work_dir = dev.work_dir();
    let pids = processes_in(&work_dir);
    let node_ids = node_ids(&pids);
    assert_eq!(
        node_ids.len(),
        nodes.len(),
        "node cgroups of {pids:?}: {node_ids:?}"
    );
    Held {
        work_dir,
        node_ids,
        bridge: bridge_of(&node_ip),
    }
}

fn backend_node_count() -> usize {
    skipper_devcluster::Config::default().zones.len()
}

/// Kubelet nodes show as kubelet v1.37 with containerd 2, every Skipper pod
/// is a containerd container of the image, the printed curl answers; a
/// SIGKILLed `skipper dev` leaves its nodes' shims and containers, which
/// the next start removes (with the work directory, cgroups and lock
/// files); Ctrl-C then leaves nothing and the kubelet's host settings as
/// they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_nodes_run_skipper_from_its_image_and_leave_nothing_after_sigkill() {
    if real_control_plane() {
        eprintln!(
            "e2e: the kubelet nodes scenario runs in `make e2e-kubelet` (it chooses its own control plane)"
        );
        return;
    }
    if backend::control_plane_config().is_none()
        || backend::kubelet_nodes_config(backend_node_count()).is_none()
    {
        return;
    }
    let _t = Timer::start("playground on kubelet nodes");
    let settings = host_settings();
    let dev = Dev::start(kubelet_opts()).await;
    eprintln!(
        "e2e: skipper dev --nodes kubelet ready in {:.1}s",
        dev.started.elapsed().as_secs_f64()
    );
    let first = check_running(&dev).await;
    dev.kill().await;
    // The control plane and the kubelets die with `skipper dev`; the shims
    // and containers outlive it (as containerd's do), until the next start.
    let second = Dev::start(kubelet_opts()).await;
    eprintln!(
        "e2e: skipper dev --nodes kubelet ready again (after a SIGKILL) in {:.1}s",
        second.started.elapsed().as_secs_f64()
    );
    let held = check_running(&second).await;
    let left = leftovers(&first, first.bridge == held.bridge);
    assert!(left.is_empty(), "the SIGKILLed skipper dev left: {left:#?}");
    assert_eq!(second.interrupt().await.code(), Some(0));
    let left = leftovers(&held, false);
    assert!(left.is_empty(), "skipper dev left after Ctrl-C: {left:#?}");
    assert_eq!(host_settings(), settings, "the kubelet's host settings");
}
