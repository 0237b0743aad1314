//! The real control plane harness: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler start on loopback, enforce
//! authentication and RBAC, run their controllers, and stop without leaving
//! a process behind.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::json;
use skipper_devcluster::control_plane::ControlPlane;

/// A control plane, when `make control-plane` has built one.
async fn start() -> Option<ControlPlane> {
    let config = backend::control_plane_config()?;
    Some(
        ControlPlane::start(config)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

#[tokio::test]
async fn starts_enforces_rbac_runs_controllers_and_stops_clean() {
    let Some(plane) = start().await else {
        return;
    };
    println!("control plane started in {:?}", plane.startup());
    let admin = plane.client().await.unwrap();

    // The version is the pinned one.
    let version = admin.apiserver_version().await.unwrap();
    assert_eq!(version.major, "1");

    // kube-controller-manager's serviceaccount and root-ca-cert-publisher
    // controllers fill a new namespace.
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "rbac"}})).unwrap(),
        )
        .await
        .unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), "rbac");
    backend::eventually("the default ServiceAccount", Duration::from_secs(30), || async {
        sas.get_opt("default").await.unwrap()
    })
    .await;
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), "rbac");
    backend::eventually("kube-root-ca.crt", Duration::from_secs(30), || async {
        cms.get_opt("kube-root-ca.crt").await.unwrap()
    })
    .await;

    // An unprivileged user is authenticated but forbidden.
    let alice = plane.client_for("alice", &[]).await.unwrap();
    let err = Api::<ConfigMap>::namespaced(alice, "rbac")
        .list(&Default::default())
        .await
        .unwrap_err();
    let (code, _, message) = skipper_test_support::api_error(err);
    assert_eq!(code, 403);
    assert_eq!(
        message,
        "configmaps is forbidden: User \"alice\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"rbac\""
    );

    let pids: Vec<u32> = process_ids(&plane);
    assert_eq!(pids.len(), 4, "four processes: {pids:?}");
    let work_dir = plane.work_dir().to_path_buf();
    plane.shutdown().await;
    for pid in pids {
        assert!(!backend::process_alive(pid), "process {pid} still runs");
    }
    assert!(!work_dir.exists(), "work directory removed");
}

#[tokio::test]
async fn dropping_it_kills_every_process() {
    let Some(plane) = start().await else {
        return;
    };
    let pids = process_ids(&plane);
    drop(plane);
    backend::eventually("every process to exit", Duration::from_secs(10), || async {
        pids.iter().all(|p| !backend::process_alive(*p)).then_some(())
    })
    .await;
}

fn process_ids(plane: &ControlPlane) -> Vec<u32> {
    plane.pids()
}
