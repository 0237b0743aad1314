//! The steps an operator takes, shared by the install-order and uninstall
//! scenarios: the platform (`manifests/` with its Secret), a pool
//! (`example-pool.yaml` with its ConfigMap), Ready pods, a request through
//! a router pod, restart counts, and deleting what was applied.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use skipper::dev::playground::{
    CONTROLLER_YAML, EXAMPLE_POOL_YAML, NAMESPACE_YAML, NETWORK_POLICY_YAML, RBAC_YAML, ROUTER_YAML,
    create_object, manifest_documents,
};
use skipper::token::SigningKey;
use skipper_devcluster::real_cluster::{self, RealCluster};
use skipper_test_support::{backend, eventually};

pub const WAIT: Duration = Duration::from_secs(120);

/// The real control plane with 3 kubelet nodes (`make nodes`) that have
/// Skipper's image (`make image`) imported, and the image's name there; or
/// `None` (with a message) when they are not built.
pub async fn kubelet_cluster() -> Option<(RealCluster, String)> {
    let nodes = backend::kubelet_nodes_config(3)?;
    let control_plane = backend::control_plane_config()?;
    let cluster = RealCluster::start(real_cluster::Config {
        control_plane,
        skipper_exe: skipper_test_support::skipper_exe(),
        nodes: (0..3)
            .map(|i| skipper_devcluster::kubelet::NodeSpec {
                name: format!("node-{i}"),
                zone: format!("zone-{i}"),
            })
            .collect(),
        node_kind: real_cluster::Nodes::Kubelet(nodes),
        metrics_api: true,
        ..real_cluster::Config::default()
    })
    .await
    .unwrap_or_else(|e| panic!("start the real cluster with kubelet nodes: {e}"));
    let image = cluster
        .kubelet_nodes()
        .unwrap()
        .image_names(&backend::image_archive())
        .first()
        .cloned()
        .unwrap();
    Some((cluster, image))
}
pub const POOL_NS: &str = "skipper-functions";

/// The objects of `kubectl apply -k manifests/` and the PASETO Secret, in
/// the README's order.
pub fn platform(key: &SigningKey) -> Vec<Value> {
    let mut docs = Vec::new();
    for yaml in [
        NAMESPACE_YAML,
        RBAC_YAML,
        CONTROLLER_YAML,
        ROUTER_YAML,
        NETWORK_POLICY_YAML,
    ] {
        docs.extend(manifest_documents(yaml).unwrap());
    }
    // After the namespace, before the controllers.
    docs.insert(
        1,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "skipper-controller-paseto", "namespace": "skipper"},
               "stringData": {"SKIPPER_PASETO_PRIVATE_KEY": key.to_pem()}}),
    );
    docs
}

/// The objects of the README's pool steps: the namespace, the public key,
/// then `example-pool.yaml`.
pub fn pool(key: &SigningKey) -> Vec<Value> {
    let mut docs = manifest_documents(EXAMPLE_POOL_YAML).unwrap();
    let at = docs.iter().position(|d| d["kind"] == "Namespace").unwrap() + 1;
    docs.insert(
        at,
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "skipper-paseto-public", "namespace": POOL_NS},
               "data": {"SKIPPER_PUBLIC_KEY": key.verifying_key().to_pem()}}),
    );
    docs
}

pub async fn apply(client: &kube::Client, docs: &[Value]) {
    for d in docs {
        create_object(client, d)
            .await
            .unwrap_or_else(|e| panic!("create {} {}: {e}", d["kind"], d["metadata"]["name"]));
    }
}

fn api(client: &kube::Client, d: &Value) -> Api<DynamicObject> {
    let api_version = d["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        group,
        version,
        d["kind"].as_str().unwrap(),
    ));
    match d["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

/// Deletes each object as `kubectl delete -f` does (background propagation).
pub async fn delete(client: &kube::Client, docs: &[Value]) {
    for d in docs {
        let name = d["metadata"]["name"].as_str().unwrap();
        match api(client, d).delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => panic!("delete {} {name}: {e}", d["kind"]),
        }
    }
}

/// The objects of `docs` that still exist.
pub async fn remaining(client: &kube::Client, docs: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for d in docs {
        let name = d["metadata"]["name"].as_str().unwrap();
        if api(client, d).get_opt(name).await.ok().flatten().is_some() {
            out.push(format!(
                "{} {}/{name}",
                d["kind"],
                d["metadata"]["namespace"].as_str().unwrap_or("")
            ));
        }
    }
    out
}

pub fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub async fn pods(client: &kube::Client, ns: &str, selector: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.list(&ListParams::default().labels(selector))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// The IPs of the Ready pods of `ns` matching `selector`.
pub async fn ready_ips(client: &kube::Client, ns: &str, selector: &str) -> BTreeSet<String> {
    pods(client, ns, selector)
        .await
        .iter()
        .filter(|p| ready(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect()
}

/// Container restarts of the pods of `ns` matching `selector`.
pub async fn restarts(client: &kube::Client, ns: &str, selector: &str) -> i32 {
    pods(client, ns, selector)
        .await
        .iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .map(|c| c.restart_count)
        .sum()
}

pub const CONTROLLERS: &str = "app.kubernetes.io/component=controller";
pub const ROUTERS: &str = "app.kubernetes.io/component=router";

/// Waits for `n` Ready controllers, 2 Ready routers and 3 Ready pool pods,
/// then has tenant `tenant` served through a router pod; the router IP.
pub async fn serve(client: &kube::Client, controllers: usize, tenant: &str) -> String {
    eventually(&format!("{controllers} controllers Ready"), WAIT, || async {
        (ready_ips(client, "skipper", CONTROLLERS).await.len() == controllers).then_some(())
    })
    .await;
    let routers = eventually("2 routers Ready", WAIT, || async {
        let ips = ready_ips(client, "skipper", ROUTERS).await;
        (ips.len() == 2).then_some(ips)
    })
    .await;
    eventually("3 pool pods Ready", WAIT, || async {
        (ready_ips(client, POOL_NS, "skipper/deployment=fixture")
            .await
            .len()
            >= 3)
            .then_some(())
    })
    .await;
    let router = routers.into_iter().next().unwrap();
    request(&router, tenant).await;
    router
}

/// A request for `tenant` through the router at `router_ip` answered by a
/// pod that serves that tenant.
pub async fn request(router_ip: &str, tenant: &str) {
    request_in(router_ip, POOL_NS, tenant).await;
}

/// [`request`] for a tenant of the pool `fixture` in namespace `pool_ns`.
pub async fn request_in(router_ip: &str, pool_ns: &str, tenant: &str) {
    let function = format!(
        r#"{{"namespace":"{pool_ns}","deployment":"fixture","tenant":"{tenant}","scale":{{"max_instances":1}}}}"#
    );
    let http = reqwest::Client::new();
    let body: Value = eventually(
        &format!("an answer for {tenant} through the router"),
        WAIT,
        || {
            let req = http
                .get(format!("http://{router_ip}:8080/hello"))
                .header("X-Skipper-Function", &function)
                .send();
            async move {
                let resp = req.await.ok()?;
                if resp.status() != 200 {
                    return None;
                }
                resp.json().await.ok()
            }
        },
    )
    .await;
    assert_eq!(body["tenant"], tenant, "{body}");
}
