//! Kubelet nodes (`make nodes`): the real control plane with upstream
//! kubelets and containerd running Skipper's image (`make image`). Nodes
//! register as kubelet v1.37 with a `containerd://2.` runtime; pods from the
//! image run as a non-root UID with a read-only root and limits under Pod
//! Security `restricted`; a SIGKILLed container restarts under the kubelet;
//! metrics-server serves `metrics.k8s.io` from the kubelets; and nothing the
//! nodes changed on the host remains after a shutdown, or after the harness
//! is SIGKILLed and nodes start again.
//!
//! Skipped (with a message) when `target/control-plane`, `target/nodes` or
//! `target/image/skipper.oci.tar` is missing or this process is not root; a
//! failure under `CI=true`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, LogParams, PostParams};
use serde_json::{Value, json};
use skipper_devcluster::kubelet::NodeSpec;
use skipper_devcluster::kubelet_nodes;
use skipper_devcluster::real_cluster::{self, Nodes, RealCluster};
use skipper_test_support::{backend, eventually};

const WAIT: Duration = Duration::from_secs(120);
const NAMESPACE: &str = "skipper-functions";

/// The nodes' configuration, or `None` (with a message) when something they
/// need is not built.
fn nodes_config() -> Option<kubelet_nodes::Config> {
    backend::kubelet_nodes_config(2)
}

fn specs(n: usize) -> Vec<NodeSpec> {
    (0..n)
        .map(|i| NodeSpec {
            name: format!("node-{i}"),
            zone: format!("zone-{}", char::from(b'a' + u8::try_from(i).unwrap())),
        })
        .collect()
}

async fn start(nodes: usize) -> Option<RealCluster> {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let kubelet = nodes_config()?;
    let control_plane = backend::control_plane_config()?;
    let begin = Instant::now();
    let cluster = RealCluster::start(real_cluster::Config {
        control_plane,
        skipper_exe: env!("CARGO_BIN_EXE_skipper").into(),
        nodes: specs(nodes),
        node_kind: Nodes::Kubelet(kubelet),
        namespaces: vec![NAMESPACE.to_owned()],
        metrics_api: true,
        ..real_cluster::Config::default()
    })
    .await
    .unwrap_or_else(|e| panic!("start the real cluster with kubelet nodes: {e}"));
    println!(
        "kubelet nodes: a cluster of {nodes} started in {:.1}s",
        begin.elapsed().as_secs_f64()
    );
    Some(cluster)
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The image's name in the nodes (from the archive's reference annotation).
fn image_name(cluster: &RealCluster) -> String {
    let nodes = cluster.kubelet_nodes().unwrap();
    nodes
        .image_names(&backend::image_archive())
        .first()
        .cloned()
        .expect("the image was imported under a name")
}

/// A restricted pool of `skipper fixture` pods from the image.
fn pool(image: &str, replicas: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "fixture", "namespace": NAMESPACE},
        "spec": {"replicas": replicas,
            "selector": {"matchLabels": {"app": "fixture"}},
            "template": {"metadata": {"labels": {"app": "fixture"}},
                "spec": {
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 12345,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{"name": "fixture", "image": image, "imagePullPolicy": "Never",
                        "command": ["skipper", "fixture"],
                        "env": [
                            {"name": "SKIPPER_PUBLIC_KEY", "value": skipper::token::SigningKey::generate().verifying_key().to_pem()},
                            {"name": "SKIPPER_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "SKIPPER_PPROF", "value": "false"},
                        ],
                        "ports": [{"name": "http", "containerPort": 8888}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1},
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                                      "limits": {"cpu": "500m", "memory": "64Mi"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        "securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                                            "capabilities": {"drop": ["ALL"]}}}],
                    "volumes": [{"name": "tmp", "emptyDir": {}}]}}}
    })
}

/// What the host holds that kubelet nodes could leave: links on the
/// cluster's bridge (`bridge`) or named like it, mounts of the cluster's
/// work directory, node cgroup trees and lock files, the sysctls the
/// kubelet wants set, and iptables chains of the kubelet.
#[derive(Debug, PartialEq, Eq)]
struct HostState {
    links: BTreeSet<String>,
    mounts: BTreeSet<String>,
    cgroups: BTreeSet<String>,
    /// The hierarchies that have this process's base cgroup path (the nodes
    /// create it where it is missing and remove it again).
    bases: BTreeSet<String>,
    sysctls: Vec<String>,
    chains: BTreeSet<String>,
}

/// Whether node cgroup trees other than `ids`' live under this process's
/// base cgroup path in some hierarchy (another harness's nodes).
fn other_nodes_under_the_base(ids: &[String]) -> bool {
    let base = kubelet_nodes::cgroup_base(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
    std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .filter_map(|h| std::fs::read_dir(h.path().join(base.trim_start_matches('/'))).ok())
        .flat_map(|children| children.flatten())
        .any(|child| {
            let name = child.file_name();
            let id = name.to_str().and_then(kubelet_nodes::parse_cgroup_name);
            id.is_some_and(|id| !ids.iter().any(|mine| mine == id))
        })
}

fn host_state(bridge: &str, work_dir: &Path, cgroup_ids: &[String]) -> HostState {
    let links = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()
            .unwrap()
            .stdout,
    )
    .lines()
    .filter(|l| l.contains(&format!(" {bridge}:")) || l.contains(&format!("master {bridge} ")))
    .map(|l| l.split(':').nth(1).unwrap_or_default().trim().to_owned())
    .collect();
    let work = work_dir.display().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&work))
        .map(str::to_owned)
        .collect();
    let cgroups = cgroup_ids
        .iter()
        .flat_map(|id| backend::kubelet_node_cgroups(id))
        .collect();
    let base = kubelet_nodes::cgroup_base(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
    let bases = std::fs::read_dir("/sys/fs/cgroup")
        .unwrap()
        .flatten()
        .filter(|h| !base.is_empty() && h.path().join(base.trim_start_matches('/')).is_dir())
        .map(|h| h.path().display().to_string())
        .collect();
    let sysctls = [
        "vm/overcommit_memory",
        "kernel/panic",
        "kernel/panic_on_oops",
        "net/ipv4/ip_forward",
    ]
    .iter()
    .map(|s| {
        std::fs::read_to_string(format!("/proc/sys/{s}"))
            .unwrap()
            .trim()
            .to_owned()
    })
    .collect();
    let chains = std::process::Command::new("iptables-save")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with(':') && l.contains("KUBE"))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    HostState {
        links,
        mounts,
        cgroups,
        bases,
        sysctls,
        chains,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_nodes_run_the_image_restricted_restart_killed_containers_and_leave_nothing() {
    let before = host_state("-", Path::new("/nonexistent"), &[]);
    let shared_base = other_nodes_under_the_base(&[]);
    let Some(cluster) = start(2).await else {
        return;
    };
    let admin = cluster.client().await.unwrap();
    let nodes = cluster.kubelet_nodes().unwrap();
    let bridge = cluster.bridge().name().to_owned();
    let work_dir = cluster.work_dir().to_path_buf();
    let ids = nodes.cgroup_ids();

    // kubectl get nodes -o wide: kubelet v1.37, containerd 2, InternalIPs on the bridge.
    let list = Api::<Node>::all(admin.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(list.items.len(), 2);
    for node in &list.items {
        let info = node.status.as_ref().unwrap().node_info.as_ref().unwrap();
        assert!(info.kubelet_version.starts_with("v1.37."), "{info:?}");
        assert!(
            info.container_runtime_version.starts_with("containerd://2."),
            "{info:?}"
        );
        let ip = node.status.as_ref().unwrap().addresses.as_ref().unwrap()[0]
            .address
            .clone();
        let ip: std::net::Ipv4Addr = ip.parse().unwrap();
        assert!(!ip.is_loopback(), "{ip}");
    }

    // Pod Security restricted is enforced: a pod that does not meet it is refused.
    let ns = Api::<k8s_openapi::api::core::v1::Namespace>::all(admin.clone());
    let mut namespace = ns.get(NAMESPACE).await.unwrap();
    namespace
        .metadata
        .labels
        .get_or_insert_default()
        .insert("pod-security.kubernetes.io/enforce".into(), "restricted".into());
    ns.replace(NAMESPACE, &PostParams::default(), &namespace)
        .await
        .unwrap();
    let image = image_name(&cluster);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let privileged: Pod = serde_json::from_value(json!({
        "metadata": {"name": "privileged"},
        "spec": {"containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                                  "command": ["skipper", "fixture"]}]}
    }))
    .unwrap();
    let refused = pods
        .create(&PostParams::default(), &privileged)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("restricted"), "{refused}");

    // A pool from the image: Ready, run by containerd, as UID 12345 with its limits.
    let begin = Instant::now();
    skipper::dev::playground::create_object(&admin, &pool(&image, 3))
        .await
        .unwrap();
    let running = eventually("3 pool pods Ready", WAIT, || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("app=fixture"))
                .await
                .ok()?;
            let ready: Vec<Pod> = list.items.into_iter().filter(ready).collect();
            (ready.len() == 3).then_some(ready)
        }
    })
    .await;
    println!(
        "kubelet nodes: a pool of 3 from the image, Deployment created to every pod Ready: {:.2}s",
        begin.elapsed().as_secs_f64()
    );
    let on: BTreeSet<String> = running
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    assert_eq!(
        on.len(),
        2,
        "the scheduler spreads the pool over both nodes: {on:?}"
    );
    let pod = &running[0];
    let name = pod.metadata.name.clone().unwrap();
    let status = pod.status.as_ref().unwrap();
    let container_id = status.container_statuses.as_ref().unwrap()[0]
        .container_id
        .clone()
        .unwrap();
    assert!(container_id.starts_with("containerd://"), "{container_id}");
    let pids = nodes.container_pids(&container_id);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let proc_status = std::fs::read_to_string(format!("/proc/{}/status", pids[0])).unwrap();
    let field = |k: &str| {
        proc_status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned()
    };
    assert_eq!(field("Uid:"), "12345");
    assert_eq!(field("CapEff:"), "0000000000000000");
    let pod_ip = status.pod_ip.clone().unwrap();
    let body = reqwest::get(format!("http://{pod_ip}:8888/healthz"))
        .await
        .unwrap();
    assert_eq!(body.status(), 200, "the host reaches the pod on the bridge");

    // SIGKILL: the kubelet restarts the container.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let killed_at = Instant::now();
    eventually("the killed container restarted and Ready", WAIT, || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let p = pods.get(&name).await.ok()?;
            let c = &p.status.as_ref()?.container_statuses.as_ref()?[0];
            (c.restart_count == 1 && c.ready).then_some(())
        }
    })
    .await;
    println!(
        "kubelet nodes: a SIGKILLed container restarted and Ready again in {:.2}s",
        killed_at.elapsed().as_secs_f64()
    );
    // `kubectl logs` and `--previous`: kube-apiserver reads them from the kubelet.
    for previous in [false, true] {
        let params = LogParams {
            previous,
            ..LogParams::default()
        };
        let log = pods.logs(&name, &params).await.unwrap();
        assert!(log.contains("fixture listening"), "previous={previous}: {log}");
    }

    // metrics.k8s.io from metrics-server, from the kubelets.
    let metrics: Api<kube::api::DynamicObject> = Api::namespaced_with(
        admin.clone(),
        NAMESPACE,
        &kube::api::ApiResource {
            group: "metrics.k8s.io".into(),
            version: "v1beta1".into(),
            api_version: "metrics.k8s.io/v1beta1".into(),
            kind: "PodMetrics".into(),
            plural: "pods".into(),
        },
    );
    let usage = eventually("PodMetrics of the pool", WAIT, || {
        let metrics = metrics.clone();
        async move {
            let list = metrics.list(&ListParams::default()).await.ok()?;
            (list.items.len() >= 3).then_some(list.items)
        }
    })
    .await;
    let memory = usage[0].data["containers"][0]["usage"]["memory"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!memory.starts_with('0'), "{memory}");

    cluster.shutdown().await;
    let mut after = host_state(&bridge, &work_dir, &ids);
    // Another test process's nodes (two `make test` at once) share the base
    // cgroup path where they live: those directories are theirs to remove.
    let mut bases = before.bases.clone();
    if shared_base || other_nodes_under_the_base(&ids) {
        eprintln!(
            "kubelet nodes: another process's nodes share the base cgroup; its directories are not compared"
        );
        bases.clear();
        after.bases.clear();
    }
    assert_eq!(
        after,
        HostState {
            links: BTreeSet::new(),
            mounts: BTreeSet::new(),
            cgroups: BTreeSet::new(),
            bases,
            sysctls: before.sysctls.clone(),
            chains: before.chains.clone(),
        },
        "nothing of the nodes remains"
    );
    for id in &ids {
        assert!(
            !Path::new(kubelet_nodes::STATE_DIR)
                .join(format!("{id}.lock"))
                .exists(),
            "lock {id}"
        );
    }
}

/// Runs this test binary again as a child, for `test` with `mode` in
/// `SKIPPER_TEST_CHILD`.
fn child(test: &str, mode: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env("SKIPPER_TEST_CHILD", mode)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_harness_leaves_pods_running_and_the_next_start_removes_them() {
    use std::io::BufRead as _;
    const TEST: &str =
        "kubelet_nodes::a_sigkilled_harness_leaves_pods_running_and_the_next_start_removes_them";
    if std::env::var("SKIPPER_TEST_CHILD").as_deref() == Ok("hold") {
        // The harness that dies: a node with a running pod, then it waits to be killed.
        let Some(cluster) = start(1).await else {
            return;
        };
        let admin = cluster.client().await.unwrap();
        let image = image_name(&cluster);
        skipper::dev::playground::create_object(&admin, &pool(&image, 1))
            .await
            .unwrap();
        let pods: Api<Pod> = Api::namespaced(admin, NAMESPACE);
        eventually("the pod Ready", WAIT, || {
            let pods = pods.clone();
            async move {
                let list = pods.list(&ListParams::default()).await.ok()?;
                list.items.iter().any(ready).then_some(())
            }
        })
        .await;
        println!(
            "HOLDING {} {} {}",
            cluster.bridge().name(),
            cluster.work_dir().display(),
            cluster.kubelet_nodes().unwrap().cgroup_ids().join(",")
        );
        // Until the parent kills it.
        let _ = tokio::task::spawn_blocking(|| {
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())
        })
        .await;
        std::mem::forget(cluster);
        return;
    }
    if nodes_config().is_none() || backend::control_plane_config().is_none() {
        return;
    }
    let mut holder = child(TEST, "hold").spawn().unwrap();
    let stdout = holder.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.split_once("HOLDING ").map(|(_, rest)| rest.to_owned()))
    })
    .await
    .unwrap();
    let Some(line) = line else {
        let _ = holder.kill();
        panic!("the child did not start its nodes: {:?}", holder.wait());
    };
    let mut words = line.split_whitespace();
    let (bridge, work_dir, ids) = (
        words.next().unwrap().to_owned(),
        PathBuf::from(words.next().unwrap()),
        words
            .next()
            .unwrap()
            .split(',')
            .map(str::to_owned)
            .collect::<Vec<_>>(),
    );
    // SIGKILL: nothing of the child's cleanup runs.
    holder.kill().unwrap();
    holder.wait().unwrap();
    let left = host_state(&bridge, &work_dir, &ids);
    assert!(
        !left.cgroups.is_empty(),
        "a killed harness leaves its node's cgroups: {left:?}"
    );
    assert!(
        left.links.iter().any(|l| l.starts_with("veth")),
        "and its pod's veth (the shim and the container outlive it): {left:?}"
    );

    kubelet_nodes::sweep(Duration::from_secs(20)).await.unwrap();
    let after = host_state(&bridge, &work_dir, &ids);
    assert!(after.cgroups.is_empty(), "{after:?}");
    assert!(after.mounts.is_empty(), "{after:?}");
    // The pod's network namespace goes with its last process; the kernel
    // tears it down (and its veth with it) asynchronously, seconds later
    // on a loaded host.
    skipper_test_support::eventually(
        "the pod's veth gone with its network namespace",
        Duration::from_secs(15),
        || {
            let links = host_state(&bridge, &work_dir, &ids).links;
            std::future::ready((!links.iter().any(|l| l.starts_with("veth"))).then_some(()))
        },
    )
    .await;
    // The bridge itself goes when the next pod bridge is made (the node agent's sweep).
    let next = skipper_devcluster::kubelet::network::Bridge::create().unwrap();
    let after = host_state(&bridge, &work_dir, &ids);
    assert!(after.links.is_empty(), "{after:?}");
    drop(next);
    let _ = std::fs::remove_dir_all(&work_dir);
}
