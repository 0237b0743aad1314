//! Uninstalling leaves nothing behind. After an install that served three
//! tenants, each claimed pod is owned by its pool's Deployment (not as its
//! controller: the ReplicaSet released it); deleting what was applied —
//! `manifests/` and `example-pool.yaml`, the function namespace kept — has
//! the garbage collector delete the tenants' pods: no Skipper object and no
//! tenant pod is left.
//!
//! On both backends: the simulator, and the real control plane with the
//! node agent and kube-controller-manager's garbage collector (skipped with
//! a message when `make control-plane` has not built it; a failure under
//! `CI=true`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use serde_json::Value;
use skipper::token::SigningKey;
use skipper_test_support::backend::Backend;
use skipper_test_support::{differential, eventually};

use super::steps::{self, POOL_NS, WAIT};

const TENANTS: [&str; 3] = ["t1", "t2", "t3"];

differential!(
    uninstalling_skipper_and_its_pool_leaves_no_object_and_no_tenant_pod,
    uninstall,
    namespaces = [],
    pods
);

async fn uninstall(b: &Backend) {
    let client = b.client().await;
    let key = SigningKey::generate();
    let platform = steps::platform(&key);
    let pool = steps::pool(&key);
    steps::apply(&client, &platform).await;
    steps::apply(&client, &pool).await;
    let router = steps::serve(&client, 2, TENANTS[0]).await;
    for t in &TENANTS[1..] {
        steps::request(&router, t).await;
    }
    // Each tenant's pod: released by the ReplicaSet, owned by the Deployment.
    let tenant_pods = eventually(
        "3 tenant pods owned by the pool's Deployment only",
        WAIT,
        || async {
            let pods = steps::pods(&client, POOL_NS, "skipper/tenant").await;
            let owned = pods.iter().all(|p| {
                let refs = p.metadata.owner_references.as_deref().unwrap_or_default();
                refs.len() == 1
                    && refs[0].kind == "Deployment"
                    && refs[0].name == "fixture"
                    && refs[0].controller != Some(true)
            });
            (pods.len() == TENANTS.len() && owned).then_some(pods.len())
        },
    )
    .await;

    let begin = Instant::now();
    // kubectl delete -k manifests/; kubectl delete -f example-pool.yaml (but
    // its namespace, so that only owner references can remove the pods).
    let mut objects: Vec<Value> = platform.into_iter().rev().collect();
    objects.extend(
        pool.into_iter()
            .filter(|d| d["kind"] != "Namespace" && d["kind"] != "ConfigMap"),
    );
    steps::delete(&client, &objects).await;
    eventually(
        "no tenant pod, no Skipper pod, no Skipper object",
        WAIT,
        || async {
            let tenants = steps::pods(&client, POOL_NS, "skipper/tenant").await.len();
            let pool = steps::pods(&client, POOL_NS, "skipper/deployment").await.len();
            let skipper = steps::pods(&client, "skipper", "app.kubernetes.io/name=skipper")
                .await
                .len();
            let left = steps::remaining(&client, &objects).await;
            (tenants == 0 && pool == 0 && skipper == 0 && left.is_empty()).then_some(())
        },
    )
    .await;
    println!(
        "uninstall ({}): {tenant_pods} tenant pods, 0 left after {:?}; 0 Skipper objects left",
        b.name(),
        begin.elapsed()
    );
}
