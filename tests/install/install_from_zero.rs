//! A fresh install: `manifests/` applied to an empty cluster as an
//! operator applies them (the README's steps, with 3 controllers), every
//! pod run by the node agent with its real probes, RBAC and ServiceAccount
//! identity. All controllers become Ready, form one ring of 3, the routers
//! find them, and a request through a router pod reaches a pool pod that
//! verified its assignment token.
//!
//! On both backends: the simulator, and the real control plane (kube-apiserver,
//! kube-controller-manager's controllers, kube-scheduler, real RBAC) with the
//! node agent as its node and pods on a bridge network (skipped with a message
//! when `make control-plane` has not built it; a failure under `CI=true`);
//! and the real control plane with kubelet nodes (`make nodes`) running
//! Skipper's image (`make image`), as an operator's cluster runs it: the
//! manifests' image set to the imported one, as `kustomization.yaml` sets it.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use skipper_test_support::backend;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};
use skipper::client::{ChannelSettings, Client, Endpoints};
use skipper::dev::playground::{
    CONTROLLER_YAML, EXAMPLE_POOL_YAML, NAMESPACE_YAML, RBAC_YAML, ROUTER_YAML, create_object,
    manifest_documents,
};
use skipper::token::SigningKey;
use skipper_devcluster::real_cluster::{self, RealCluster};

use crate::steps::{self, ready_ips};

const WAIT: Duration = Duration::from_secs(120);
const CONTROLLERS: i64 = 3;

fn docs(yaml: &str) -> Vec<Value> {
    manifest_documents(yaml).unwrap()
}

mod manifests_install_from_zero_with_three_controllers_and_serve_a_request {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn simulator() {
        let cluster = common::cluster_with(&[], |_| {}).await;
        let client = cluster.client().unwrap();
        let begin = Instant::now();
        install_and_serve(&client, None).await;
        println!("install from zero on the simulator: {:?}", begin.elapsed());
        cluster.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn real() {
        let Some(control_plane) = backend::control_plane_config() else {
            return;
        };
        let cluster = RealCluster::start(real_cluster::Config {
            control_plane,
            skipper_exe: env!("CARGO_BIN_EXE_skipper").into(),
            metrics_interval: Duration::from_millis(200),
            restart_backoff: skipper_devcluster::kubelet::BackoffPolicy {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(4),
            },
            metrics_api: true,
            ..real_cluster::Config::default()
        })
        .await
        .unwrap_or_else(|e| panic!("start the real cluster: {e}"));
        let client = cluster.client().await.unwrap();
        let begin = Instant::now();
        install_and_serve(&client, None).await;
        println!(
            "install from zero on the real control plane: {:?}",
            begin.elapsed()
        );
        cluster.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kubelet_nodes() {
        let Some((cluster, image)) = crate::steps::kubelet_cluster().await else {
            return;
        };
        let client = cluster.client().await.unwrap();
        let begin = Instant::now();
        install_and_serve(&client, Some(&image)).await;
        println!(
            "install from zero on kubelet nodes ({image}): {:?}",
            begin.elapsed()
        );
        // Every running Skipper container runs in containerd.
        let pods: Api<Pod> = Api::all(client.clone());
        let mut running = 0;
        for p in pods.list(&ListParams::default()).await.unwrap().items {
            for c in p.status.and_then(|s| s.container_statuses).unwrap_or_default() {
                if let Some(id) = c.container_id.filter(|_| c.ready) {
                    assert!(id.starts_with("containerd://"), "{id}");
                    running += 1;
                }
            }
        }
        assert!(running >= 8, "3 controllers, 2 routers, 3 pool pods: {running}");
        cluster.shutdown().await;
    }
}

/// `d` as it runs on kubelet nodes when `image` is given: every container
/// that names `skipper` runs `image`, never pulled, and Namespaces enforce
/// Pod Security `restricted` (`skipper::dev::kubelet::for_image`).
fn with_image(mut d: Value, image: Option<&str>) -> Value {
    if let Some(image) = image {
        skipper::dev::kubelet::for_image(&mut d, image);
    }
    d
}

async fn install_and_serve(client: &kube::Client, image: Option<&str>) {
    let key = SigningKey::generate();
    // kubectl apply -f manifests/namespace.yaml; the PASETO Secret; kubectl apply -k manifests/
    for d in docs(NAMESPACE_YAML) {
        create_object(client, &with_image(d, image)).await.unwrap();
    }
    create_object(
        client,
        &json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "skipper-controller-paseto", "namespace": "skipper"},
                "stringData": {"SKIPPER_PASETO_PRIVATE_KEY": key.to_pem()}}),
    )
    .await
    .unwrap();
    for yaml in [RBAC_YAML, CONTROLLER_YAML, ROUTER_YAML] {
        for mut d in docs(yaml) {
            if d["kind"] == "Deployment" && d["metadata"]["name"] == "skipper-controller" {
                d["spec"]["replicas"] = json!(CONTROLLERS);
            }
            create_object(client, &with_image(d, image)).await.unwrap();
        }
    }
    // The pool: its namespace, the public key, then the pool itself.
    let pool = docs(EXAMPLE_POOL_YAML);
    let pool_ns = pool
        .iter()
        .find(|d| d["kind"] == "Namespace")
        .and_then(|d| d["metadata"]["name"].as_str())
        .unwrap()
        .to_owned();
    for d in pool.iter().filter(|d| d["kind"] == "Namespace") {
        create_object(client, &with_image(d.clone(), image))
            .await
            .unwrap();
    }
    create_object(
        client,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "skipper-paseto-public", "namespace": pool_ns},
                "data": {"SKIPPER_PUBLIC_KEY": key.verifying_key().to_pem()}}),
    )
    .await
    .unwrap();
    for d in pool.iter().filter(|d| d["kind"] != "Namespace") {
        create_object(client, &with_image(d.clone(), image))
            .await
            .unwrap();
    }

    let controllers = common::eventually("3 controllers Ready", WAIT, || async {
        let ips = ready_ips(client, "skipper", "app.kubernetes.io/component=controller").await;
        (ips.len() == 3).then_some(ips)
    })
    .await;
    // One ring of all three, as every controller sees it (asked with a
    // router's token: controllers refuse calls without one).
    let token = skipper::dev::playground::router_token(client, 3600)
        .await
        .unwrap();
    for ip in &controllers {
        let addr = format!("{ip}:50051").parse().unwrap();
        let credentials = skipper::credentials::Credentials::fixed(&token).unwrap();
        let c =
            Client::new(Endpoints::fixed(&[addr], ChannelSettings::default()).with_credentials(credentials));
        let want = controllers.clone();
        common::eventually(&format!("{ip} sees a ring of 3"), WAIT, || {
            let c = c.clone();
            let want = want.clone();
            async move {
                let st = c
                    .get_cluster_state(
                        skipper::api::GetClusterStateRequest {
                            local_only: Some(true),
                        },
                        Duration::from_secs(5),
                    )
                    .await
                    .ok()?
                    .cluster_state?;
                let seen: BTreeSet<String> = st.controller_ips.into_iter().collect();
                (seen == want).then_some(())
            }
        })
        .await;
    }
    let routers = common::eventually("2 routers Ready", WAIT, || async {
        let ips = ready_ips(client, "skipper", "app.kubernetes.io/component=router").await;
        (ips.len() == 2).then_some(ips)
    })
    .await;
    common::eventually("3 pool pods Ready", WAIT, || async {
        let n = ready_ips(client, &pool_ns, "skipper/deployment=fixture")
            .await
            .len();
        (n >= 3).then_some(())
    })
    .await;
    // A request through a router pod reaches a pool pod assigned to the tenant.
    let router = routers.iter().next().unwrap();
    steps::request_in(router, &pool_ns, "first").await;
    let assigned = ready_ips(client, &pool_ns, "skipper/tenant=first").await;
    assert_eq!(assigned.len(), 1, "{assigned:?}");
}
