//! Shared helpers for the simulator and fixture tests: a cluster with short
//! intervals, condition waits with deadlines, keys and tokens, process checks.

use std::time::{Duration, SystemTime};

use skipper::token::{BOUND_TOKEN_LIFETIME, PodRef, SigningKey, Version};
use skipper_devcluster::{Cluster, Config};

pub use crate::process::{descendants, listener_pid, process_alive};

/// A cluster tuned for tests, with the given extra namespaces.
pub async fn cluster(namespaces: &[&str]) -> Cluster {
    cluster_with(namespaces, |_| {}).await
}

/// A cluster tuned for tests, after `tweak` edits its config.
pub async fn cluster_with(namespaces: &[&str], tweak: impl FnOnce(&mut Config)) -> Cluster {
    let mut config = Config {
        skipper_exe: crate::skipper_exe(),
        namespaces: namespaces.iter().map(|s| (*s).to_owned()).collect(),
        metrics_interval: Duration::from_millis(200),
        restart_backoff: skipper_devcluster::kubelet::BackoffPolicy {
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

pub use crate::eventually;

/// The JSON the API server answers a GET of `path` with when asked for
/// the representation `accept` (a Table, PartialObjectMetadata, ...).
pub async fn api_get_as(cluster: &Cluster, path: &str, accept: &str) -> serde_json::Value {
    api_http(cluster)
        .get(format!("{}{path}", cluster.base_url()))
        .header("Accept", accept)
        .send()
        .await
        .expect("API request")
        .json()
        .await
        .expect("a JSON answer")
}

/// A fresh signing key and its public key PEM.
pub fn keys() -> (SigningKey, String) {
    let key = SigningKey::generate();
    let pem = key.verifying_key().to_pem();
    (key, pem)
}

/// An unbound token for `tenant` (as Go controllers issue), valid now.
pub fn token(key: &SigningKey, version: Version, tenant: &str) -> String {
    key.sign(version, tenant, SystemTime::now()).expect("sign token")
}

/// A token for `tenant` bound to `pod`, valid now (as a controller issues).
pub fn bound_token(key: &SigningKey, version: Version, tenant: &str, pod: PodRef<'_>) -> String {
    key.sign_bound(version, tenant, pod, BOUND_TOKEN_LIFETIME, SystemTime::now())
        .expect("sign token")
        .0
}

/// A function header for `tenant`.
pub fn function_json(tenant: &str) -> String {
    format!(r#"{{"namespace":"fixtures","deployment":"fixture","tenant":"{tenant}"}}"#)
}

/// POSTs a v2 assignment for `tenant` to the fixture pod `pod` (JSON, as
/// the API serves it), with a token bound to it; returns the status.
pub async fn assign(pod: &serde_json::Value, key: &SigningKey, tenant: &str) -> reqwest::StatusCode {
    let text = |p: &str| {
        pod.pointer(p)
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
    };
    let target = PodRef {
        name: text("/metadata/name"),
        uid: text("/metadata/uid"),
    };
    let ip = text("/status/podIP");
    reqwest::Client::new()
        .post(format!("http://{ip}:8888/__skipper/assign"))
        .header("X-Skipper-Token", bound_token(key, Version::V2, tenant, target))
        .header("X-Skipper-Function", function_json(tenant))
        .send()
        .await
        .expect("assign request")
        .status()
}

pub use crate::backend::kubectl_available;
