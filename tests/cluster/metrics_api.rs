//! `metrics.k8s.io` through an APIService on the real control plane: the
//! aggregation layer proxies to the extension server, RBAC applies to
//! `pods.metrics.k8s.io`, and `kubectl top` reads it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use backend::Backend;
use serde_json::{Value, json};
use skipper_devcluster::metrics_api::{self, ContainerUsage, PodUsage, UsageSource};

struct Fixed;

impl UsageSource for Fixed {
    fn pods(&self, namespace: Option<&str>) -> Vec<PodUsage> {
        ["a", "b"]
            .iter()
            .enumerate()
            .map(|(i, app)| PodUsage {
                namespace: "m".into(),
                name: format!("pod-{app}"),
                labels: BTreeMap::from([("app".to_owned(), (*app).to_owned())]),
                timestamp: "2026-11-30T12:00:00Z".into(),
                window: Duration::from_secs(10),
                containers: vec![ContainerUsage {
                    name: "c".into(),
                    cpu_millis: 100 * (i as u64 + 1),
                    memory_bytes: 64 * 1024 * 1024,
                }],
            })
            .filter(|p| namespace.is_none_or(|ns| ns == p.namespace))
            .collect()
    }
}

async fn get(client: &kube::Client, path: &str) -> Result<Value, kube::Error> {
    client
        .request::<Value>(http::Request::get(path).body(Vec::new()).unwrap())
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_metrics_are_served_through_an_api_service() {
    let Some(b) = Backend::real(&["m"]).await else {
        return;
    };
    let Backend::Real(plane) = &b else { unreachable!() };
    let admin = b.client().await;
    let tracker = tokio_util::task::TaskTracker::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let registration = metrics_api::Registration {
        namespace: "kube-system".into(),
        service: "skipper-metrics".into(),
        port: 0,
        front_proxy: plane.front_proxy(),
        available_within: Duration::from_secs(60),
    };
    let registered = metrics_api::register_and_serve(&admin, &registration, Arc::new(Fixed), &tracker, &stop)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(registered.addr.ip().is_loopback(), "{registered:?}");

    let list = get(&admin, "/apis/metrics.k8s.io/v1beta1/namespaces/m/pods")
        .await
        .unwrap();
    assert_eq!(list["kind"], "PodMetricsList");
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["pod-a", "pod-b"]);
    assert_eq!(
        list["items"][1]["containers"][0]["usage"],
        json!({"cpu": "200m", "memory": "65536Ki"})
    );
    let only_a = get(
        &admin,
        "/apis/metrics.k8s.io/v1beta1/namespaces/m/pods?labelSelector=app%3Da",
    )
    .await
    .unwrap();
    assert_eq!(only_a["items"].as_array().unwrap().len(), 1);
    let one = get(&admin, "/apis/metrics.k8s.io/v1beta1/namespaces/m/pods/pod-b")
        .await
        .unwrap();
    assert_eq!(one["kind"], "PodMetrics");

    // RBAC applies at the aggregation layer.
    let alice = b.client_as("alice", &[]).await;
    match get(&alice, "/apis/metrics.k8s.io/v1beta1/namespaces/m/pods").await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403);
            assert_eq!(
                s.message,
                "pods.metrics.k8s.io is forbidden: User \"alice\" cannot list resource \"pods\" in API group \"metrics.k8s.io\" in the namespace \"m\""
            );
        }
        other => panic!("expected 403, got {other:?}"),
    }

    if backend::kubectl_available() {
        let top = b.kubectl(&["-n", "m", "top", "pods"]).await;
        assert!(top.ok, "{top:?}");
        assert!(
            top.stdout.contains("pod-a") && top.stdout.contains("200m"),
            "{}",
            top.stdout
        );
    }

    stop.cancel();
    tracker.close();
    tokio::time::timeout(Duration::from_secs(10), tracker.wait())
        .await
        .unwrap();
    b.shutdown().await;
}
