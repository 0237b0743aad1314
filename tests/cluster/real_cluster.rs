//! The node agent running the pods of the real control plane on a bridge
//! pod network: pods get routable (non-loopback) IPs in their own network
//! namespaces, Services publish them in EndpointSlices, the host reaches
//! them, they reach the API server in-cluster, and their namespaces,
//! veths and the bridge go away with them.
//!
//! Skipped (with a message) when `target/control-plane` is not built; a
//! failure under `CI=true` or `SKIPPER_TEST_CONTROL_PLANE=real`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use skipper::token::SigningKey;
use skipper_devcluster::kubelet::network::overlaps;
use skipper_devcluster::real_cluster::{self, RealCluster};

const WAIT: Duration = Duration::from_secs(60);

async fn start(namespaces: &[&str], metrics_api: bool) -> Option<RealCluster> {
    // RUST_LOG shows the agent's and the cluster's logs.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    let control_plane = backend::control_plane_config()?;
    let config = real_cluster::Config {
        control_plane,
        skipper_exe: env!("CARGO_BIN_EXE_skipper").into(),
        namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
        metrics_interval: Duration::from_millis(200),
        metrics_api,
        ..real_cluster::Config::default()
    };
    let begin = Instant::now();
    let cluster = RealCluster::start(config)
        .await
        .unwrap_or_else(|e| panic!("start the real cluster: {e}"));
    println!(
        "real cluster (bridge {}, gateway {}) started in {:?}",
        cluster.bridge().name(),
        cluster.bridge().gateway(),
        begin.elapsed()
    );
    Some(cluster)
}

/// Waits until `f` yields a value from the pods of `namespace`; on timeout
/// panics with their status (what the agent and the scheduler wrote).
async fn wait_pods<T>(
    admin: &kube::Client,
    namespace: &str,
    what: &str,
    f: impl Fn(&[Pod]) -> Option<T>,
) -> T {
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let begin = Instant::now();
    loop {
        let list = pods.list(&ListParams::default()).await.unwrap().items;
        if let Some(v) = f(&list) {
            return v;
        }
        if begin.elapsed() > WAIT {
            let status: Vec<_> = list
                .iter()
                .map(|p| {
                    (
                        p.metadata.name.clone(),
                        p.spec.as_ref().and_then(|s| s.node_name.clone()),
                        p.status.clone(),
                    )
                })
                .collect();
            panic!("timed out after {WAIT:?} waiting for {what}; pods: {status:#?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ip(pod: &Pod) -> Option<Ipv4Addr> {
    pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()
}

/// `GET http://addr/path` over a plain socket; the status code.
fn http_status(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    String::from_utf8_lossy(&head[9..12])
        .parse()
        .map_err(|_| std::io::Error::other("no status line"))
}

fn links() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_routable_ips_in_their_own_network_and_services_publish_them() {
    let Some(cluster) = start(&["net"], true).await else {
        return;
    };
    let admin = cluster.client().await.unwrap();
    let key = SigningKey::generate();
    // Two replicas of a server on the wildcard address and one port: each
    // pod has its own network namespace. The startup probe connects to the
    // pod's own 127.0.0.1 from inside; readiness connects from the host to
    // the pod IP, as a kubelet does.
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "net"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "web",
                        "image": "skipper",
                        "command": ["skipper", "fixture"],
                        "ports": [{"name": "http", "containerPort": 8888}],
                        "env": [
                            {"name": "SKIPPER_PUBLIC_KEY", "value": key.verifying_key().to_pem()},
                            {"name": "SKIPPER_HOST", "value": "0.0.0.0"},
                        ],
                        "startupProbe": {"exec": {"command": ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8888"]},
                                         "periodSeconds": 1, "failureThreshold": 30},
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1},
                    }],
                },
            },
        },
    }))
    .unwrap();
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "net"},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }))
    .unwrap();
    let created = Instant::now();
    Api::<Service>::namespaced(admin.clone(), "net")
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    Api::<Deployment>::namespaced(admin.clone(), "net")
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();

    let pods: Api<Pod> = Api::namespaced(admin.clone(), "net");
    let ips: Vec<Ipv4Addr> = wait_pods(&admin, "net", "2 Ready pods", |list| {
        let ips: Vec<Ipv4Addr> = list.iter().filter(|p| ready(p)).filter_map(pod_ip).collect();
        (ips.len() == 2).then_some(ips)
    })
    .await;
    println!(
        "Deployment created → 2 pods Ready on the real control plane: {:?}",
        created.elapsed()
    );
    let subnet = cluster.bridge().subnet();
    for ip in &ips {
        assert!(!ip.is_loopback(), "{ip}");
        assert!(
            overlaps((*ip, 32), subnet),
            "{ip} is on the bridge's /24 {subnet:?}"
        );
    }
    assert_ne!(ips[0], ips[1]);
    let host_ip = pods.list(&ListParams::default()).await.unwrap().items[0]
        .status
        .as_ref()
        .and_then(|s| s.host_ip.clone());
    assert_eq!(host_ip, Some(cluster.bridge().gateway().to_string()));

    // The real EndpointSlice controller lists both pods, ready.
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), "net");
    backend::eventually(
        "the Service's EndpointSlice to list both pods ready",
        WAIT,
        || async {
            let list = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                .await
                .unwrap();
            let mut ready: Vec<Ipv4Addr> = list
                .items
                .iter()
                .flat_map(|s| s.endpoints.iter())
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                .flat_map(|e| e.addresses.iter().filter_map(|a| a.parse().ok()))
                .collect();
            ready.sort_unstable();
            let mut want = ips.clone();
            want.sort_unstable();
            (ready == want).then_some(())
        },
    )
    .await;

    // The test process reaches each pod at its IP.
    for ip in &ips {
        let status = http_status(SocketAddr::from((*ip, 8888)), "/healthz").unwrap();
        assert_eq!(status, 200, "GET http://{ip}:8888/healthz");
    }

    // Pod metrics of the agent's samples, through kube-apiserver's
    // aggregation layer (metrics.k8s.io as an APIService).
    let metrics = kube::api::ApiResource {
        group: "metrics.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "metrics.k8s.io/v1beta1".into(),
        kind: "PodMetrics".into(),
        plural: "pods".into(),
    };
    let pod_metrics: Api<kube::api::DynamicObject> = Api::namespaced_with(admin.clone(), "net", &metrics);
    backend::eventually("metrics of both pods", WAIT, || async {
        let list = pod_metrics
            .list(&ListParams::default().labels("app=web"))
            .await
            .ok()?;
        let measured = list
            .items
            .iter()
            .filter(|m| {
                let c = &m.data["containers"][0];
                c["name"] == "web" && c["usage"]["memory"].as_str().is_some_and(|v| v != "0")
            })
            .count();
        (measured == 2).then_some(())
    })
    .await;

    // The `kubernetes` Service has the API server's (non-loopback) address
    // as its endpoint, published by kube-apiserver's endpoint reconciler.
    let default_slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), "default");
    backend::eventually("the kubernetes Service's endpoint", WAIT, || async {
        let slice = default_slices.get_opt("kubernetes").await.unwrap()?;
        let addresses: Vec<String> = slice.endpoints.iter().flat_map(|e| e.addresses.clone()).collect();
        (addresses == [cluster.bridge().gateway().to_string()]).then_some(())
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_reaches_the_api_server_in_cluster_with_its_service_account_token() {
    if which("curl").is_none() {
        assert!(
            !backend::real_requested() && std::env::var("CI").as_deref() != Ok("true"),
            "curl is not installed"
        );
        eprintln!("skipped: curl is not installed");
        return;
    }
    let Some(cluster) = start(&["net"], false).await else {
        return;
    };
    let admin = cluster.client().await.unwrap();
    let script = r#"SA=/var/run/secrets/kubernetes.io/serviceaccount
curl -sS --fail --cacert "$SA/ca.crt" -H "Authorization: Bearer $(cat "$SA/token")" \
  -H 'Content-Type: application/json' -X POST \
  -d '{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}' \
  "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/apis/authentication.k8s.io/v1/selfsubjectreviews""#;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "whoami", "namespace": "net"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "debian", "command": ["sh", "-c", script]}],
        },
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "net");
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let phase = wait_pods(&admin, "net", "the pod to finish", |list| {
        list.first()?
            .status
            .as_ref()?
            .phase
            .clone()
            .filter(|p| p == "Succeeded" || p == "Failed")
    })
    .await;
    let log = cluster
        .kubelet()
        .log_file("net", "whoami", "main", false)
        .unwrap();
    let out = std::fs::read_to_string(&log).unwrap();
    assert_eq!(phase, "Succeeded", "the pod's output: {out}");
    let review: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        review["status"]["userInfo"]["username"], "system:serviceaccount:net:default",
        "{review}"
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_network_goes_with_it_and_the_bridge_with_the_cluster() {
    let Some(cluster) = start(&["net"], false).await else {
        return;
    };
    let admin = cluster.client().await.unwrap();
    let bridge = cluster.bridge().name().to_owned();
    let slot = bridge.trim_start_matches("skpod").to_owned();
    let veths = || {
        links()
            .into_iter()
            .filter(|l| l.starts_with(&format!("skv{slot}-")))
            .collect::<Vec<_>>()
    };
    assert!(links().contains(&bridge));
    assert!(veths().is_empty());
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "sleeper", "namespace": "net"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "debian", "command": ["sleep", "3600"]}],
        },
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "net");
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let ip = wait_pods(&admin, "net", "the pod to run with an IP", |list| {
        let p = list
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some("sleeper"))?;
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if running { pod_ip(p) } else { None }
    })
    .await;
    // A `hostNetwork` pod stays in the host's namespace, with the node's address.
    let host: Pod = serde_json::from_value(json!({
        "metadata": {"name": "host", "namespace": "net"},
        "spec": {
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "debian", "command": ["sleep", "3600"]}],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &host).await.unwrap();
    let host_ip = wait_pods(&admin, "net", "the hostNetwork pod to run", |list| {
        let p = list.iter().find(|p| p.metadata.name.as_deref() == Some("host"))?;
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if running { pod_ip(p) } else { None }
    })
    .await;
    assert_eq!(host_ip, cluster.bridge().gateway());
    let host_pid = cluster.kubelet().pid_of("net", "host").unwrap();
    assert_eq!(
        std::fs::read_link(format!("/proc/{host_pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap()
    );
    pods.delete("host", &DeleteParams::default()).await.unwrap();

    let namespaces = cluster.bridge().namespaces();
    assert_eq!(namespaces.len(), 1, "{namespaces:?}");
    assert!(Path::new("/run/netns").join(&namespaces[0]).exists());
    assert_eq!(veths().len(), 1, "{:?}", veths());
    // The sleeper's process is in the pod's network namespace.
    let pid = cluster.kubelet().pid_of("net", "sleeper").unwrap();
    let net_of = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_ne!(net_of(&pid.to_string()), net_of("self"));

    pods.delete("sleeper", &DeleteParams::default()).await.unwrap();
    backend::eventually("the pod's namespace and veth to go", WAIT, || async {
        (cluster.bridge().namespaces().is_empty() && veths().is_empty()).then_some(())
    })
    .await;
    assert!(
        TcpStream::connect_timeout(&SocketAddr::from((ip, 9)), Duration::from_millis(500)).is_err(),
        "nothing answers at the deleted pod's IP"
    );

    cluster.shutdown().await;
    assert!(!links().contains(&bridge), "the bridge {bridge} is removed");
    let left: Vec<String> = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| n.starts_with(&format!("{bridge}-")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

/// Runs this test binary again as a child, for `test` with `mode` in
/// `SKIPPER_TEST_CHILD`, under `prefix` (e.g. `setpriv ...`).
fn child(test: &str, mode: &str, prefix: &[&str]) -> std::process::Command {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match prefix.split_first() {
        Some((p, rest)) => {
            let mut c = std::process::Command::new(p);
            c.args(rest).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    // The test's name in this binary: its path below the crate root.
    let name = format!("real_cluster::{test}");
    cmd.args(["--exact", &name, "--nocapture", "--test-threads", "1"])
        .env("SKIPPER_TEST_CHILD", mode)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

fn child_mode() -> Option<String> {
    std::env::var("SKIPPER_TEST_CHILD").ok()
}

#[test]
fn a_dead_agents_bridge_and_pod_namespaces_are_removed_when_an_agent_starts() {
    use skipper_devcluster::kubelet::network::Bridge;
    use std::io::BufRead as _;
    use std::sync::Arc;
    const TEST: &str = "a_dead_agents_bridge_and_pod_namespaces_are_removed_when_an_agent_starts";
    if child_mode().as_deref() == Some("hold") {
        // The agent that dies: a bridge with a pod namespace, then it waits to be killed.
        let bridge = Arc::new(Bridge::create().unwrap());
        let link = bridge.attach().unwrap();
        println!("HOLDING {} {}", bridge.name(), link.netns());
        // Until the parent kills it (or goes away and closes stdin).
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return;
    }
    if !nix_is_root() {
        eprintln!("skipped: bridge pod networking needs root");
        return;
    }
    let mut holder = child(TEST, "hold", &[])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let line = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_once("HOLDING ").map(|(_, rest)| rest.to_owned()));
    let Some(line) = line else {
        let _ = holder.kill();
        panic!(
            "the child did not create a bridge: {:?}",
            holder.wait_with_output()
        );
    };
    let mut words = line.split_whitespace();
    let (bridge, netns) = (words.next().unwrap().to_owned(), words.next().unwrap().to_owned());
    assert!(links().contains(&bridge));
    assert!(Path::new("/run/netns").join(&netns).exists());
    // SIGKILL: nothing of the child's cleanup runs.
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(links().contains(&bridge), "a killed agent leaves its bridge");

    let mine = Bridge::create().unwrap();
    assert!(
        !links().contains(&bridge),
        "the dead agent's bridge {bridge} is removed"
    );
    assert!(
        !Path::new("/run/netns").join(&netns).exists(),
        "its pod namespace {netns} is removed"
    );
    assert!(links().contains(&mine.name().to_owned()));
    let name = mine.name().to_owned();
    drop(mine);
    assert!(!links().contains(&name), "dropping a bridge removes it");
}

#[test]
fn the_bridges_address_stays_as_pods_come_and_go() {
    use skipper_devcluster::kubelet::network::{Bridge, bridge_mac, parse_bridge_name};
    use std::sync::Arc;
    if !nix_is_root() {
        eprintln!("skipped: bridge pod networking needs root");
        return;
    }
    let bridge = Arc::new(Bridge::create().unwrap());
    let sys = Path::new("/sys/class/net").join(bridge.name());
    let read = |f: &str| std::fs::read_to_string(sys.join(f)).unwrap().trim().to_owned();
    let want = bridge_mac(parse_bridge_name(bridge.name()).unwrap());
    // NET_ADDR_SET: the kernel never replaces it with a port's MAC.
    assert_eq!(read("addr_assign_type"), "3");
    assert_eq!(read("address"), want);
    // A bridge without a set address would take the lowest port MAC as
    // ports join (the first one at once) and another as they leave.
    let mut links: Vec<_> = (0..4).map(|_| bridge.attach().unwrap()).collect();
    assert_eq!(read("address"), want, "after pods joined");
    while let Some(link) = links.pop() {
        drop(link);
        assert_eq!(read("address"), want, "after a pod left");
    }
}

#[test]
fn bridge_mode_without_cap_net_admin_fails_with_one_line_naming_it() {
    use skipper_devcluster::kubelet::network::Bridge;
    const TEST: &str = "bridge_mode_without_cap_net_admin_fails_with_one_line_naming_it";
    if child_mode().as_deref() == Some("no-net-admin") {
        let err = Bridge::create().unwrap_err().to_string();
        println!("ERROR {err}");
        return;
    }
    if !nix_is_root() || which("setpriv").is_none() {
        eprintln!("skipped: needs root and setpriv to drop a capability");
        return;
    }
    let out = child(
        TEST,
        "no-net-admin",
        &[
            "setpriv",
            "--inh-caps=-net_admin",
            "--bounding-set=-net_admin",
            "--",
        ],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("ERROR ").map(|(_, rest)| rest))
        .unwrap_or_else(|| {
            panic!(
                "no error from the child: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(line.contains("CAP_NET_ADMIN"), "{line}");
    assert!(!line.contains("CAP_SYS_ADMIN"), "only what is missing: {line}");
    assert!(line.contains("root"), "{line}");
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false)
}
