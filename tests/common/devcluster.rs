//! Shared helpers for the simulator and fixture tests: a cluster with short
//! intervals, condition waits with deadlines, keys and tokens, process checks.

#![allow(dead_code)]

use std::future::Future;
use std::time::{Duration, SystemTime};

use skipper::devcluster::{Cluster, Config};
use skipper::token::{SigningKey, Version};

/// A cluster tuned for tests, with the given extra namespaces.
pub async fn cluster(namespaces: &[&str]) -> Cluster {
    cluster_with(namespaces, |_| {}).await
}

/// A cluster tuned for tests, after `tweak` edits its config.
pub async fn cluster_with(namespaces: &[&str], tweak: impl FnOnce(&mut Config)) -> Cluster {
    let mut config = Config {
        skipper_exe: env!("CARGO_BIN_EXE_skipper").into(),
        namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
        metrics_interval: Duration::from_millis(200),
        restart_backoff: skipper::devcluster::kubelet::BackoffPolicy {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(4),
        },
        bookmark_interval: Duration::from_millis(200),
        resync_interval: Duration::from_millis(200),
        ..Config::default()
    };
    tweak(&mut config);
    let cluster = Cluster::start(config).await.expect("start simulator");
    // As kube-controller-manager does shortly after a namespace appears:
    // the `default` ServiceAccount and the `kube-root-ca.crt` ConfigMap.
    for ns in namespaces {
        let c = &cluster;
        eventually(
            &format!("namespace {ns} set up"),
            Duration::from_secs(10),
            || async move {
                (c.get("ServiceAccount", ns, "default").is_some()
                    && c.get("ConfigMap", ns, "kube-root-ca.crt").is_some())
                .then_some(())
            },
        )
        .await;
    }
    cluster
}

/// An HTTP client that trusts the cluster's CA and presents the
/// administrator's client certificate (for raw API and `/_sim/` requests).
pub fn api_http(cluster: &Cluster) -> reqwest::Client {
    let admin = cluster.admin_cert();
    let identity = reqwest::Identity::from_pem(format!("{}{}", admin.cert_pem, admin.key_pem).as_bytes())
        .expect("admin identity");
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(cluster.ca_pem().as_bytes()).expect("CA"))
        .identity(identity)
        .build()
        .expect("HTTP client")
}

/// Polls `f` every 20ms until it yields a value; panics after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    tokio::time::timeout(timeout, async {
        loop {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// A fresh signing key and its public key PEM.
pub fn keys() -> (SigningKey, String) {
    let key = SigningKey::generate();
    let pem = key.verifying_key().to_pem();
    (key, pem)
}

/// A token for `tenant`, valid now.
pub fn token(key: &SigningKey, version: Version, tenant: &str) -> String {
    key.sign(version, tenant, SystemTime::now()).expect("sign token")
}

/// A function header for `tenant`.
pub fn function_json(tenant: &str) -> String {
    format!(r#"{{"namespace":"fixtures","deployment":"fixture","tenant":"{tenant}"}}"#)
}

/// POSTs a v2 assignment for `tenant` to the fixture pod at `ip`; returns the status.
pub async fn assign(ip: &str, key: &SigningKey, tenant: &str) -> reqwest::StatusCode {
    reqwest::Client::new()
        .post(format!("http://{ip}:8888/__skipper/assign"))
        .header("X-Skipper-Token", token(key, Version::V2, tenant))
        .header("X-Skipper-Function", function_json(tenant))
        .send()
        .await
        .expect("assign request")
        .status()
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// The pid of the process listening on `ip:port` (TCP), found the way `ss -p`
/// finds it: the socket in `/proc/net/tcp`, then the process holding it.
pub fn listener_pid(ip: std::net::Ipv4Addr, port: u16) -> Option<u32> {
    let want = format!("{:08X}:{port:04X}", u32::from_le_bytes(ip.octets()));
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let inode = table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // State 0A is LISTEN.
        (f.get(1) == Some(&want.as_str()) && f.get(3) == Some(&"0A"))
            .then(|| f.get(9).map(|s| (*s).to_owned()))?
    })?;
    let link = format!("socket:[{inode}]");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == link) {
                return Some(pid);
            }
        }
    }
    None
}

/// Every process descended from `pid` (children, grandchildren, ...).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(pp) = ppid {
            parent_of.insert(p, pp);
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(cur) = frontier.pop() {
        for (child, parent) in &parent_of {
            if *parent == cur {
                out.push(*child);
                frontier.push(*child);
            }
        }
    }
    out
}

/// Whether kubectl is installed (tests that need it skip with a message otherwise).
pub fn kubectl_available() -> bool {
    std::process::Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success())
}
