//! The assignment back-off is about deployments: a pod that already serves
//! someone answers 409, which is evidence against that pod only (it is
//! deleted and the next one claimed, nothing counts toward the back-off), and
//! a back-off ends as soon as its cause can be gone: a ReplicaSet none of
//! whose pods failed has Ready pool pods (a rollout with the right key).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::Duration;

use harness::{Ctl, NS, Sim, function, get_instance, pod_ready};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use skipper::api::EventType;
use skipper::domain::{HEADER_FUNCTION, HEADER_TOKEN};
use skipper::token::{PodRef, SigningKey, Version};
use skipper_test_support::eventually;

/// The metric line of the deployment's back-off gauge.
fn backoff_gauge(ctl: &Ctl, deployment: &str) -> i64 {
    ctl.core
        .cluster
        .metrics
        .assignment_backoff_seconds
        .get_or_create(&skipper::controller::metrics::Metrics::function(deployment))
        .get()
}

/// Rolls the pool out to trust `pem` (its first environment variable is
/// `SKIPPER_PUBLIC_KEY`).
async fn trust(sim: &Sim<'_>, pem: &str) {
    let ops = serde_json::json!([
        {"op": "test", "path": "/spec/template/spec/containers/0/env/0/name", "value": "SKIPPER_PUBLIC_KEY"},
        {"op": "replace", "path": "/spec/template/spec/containers/0/env/0/value", "value": pem},
    ]);
    let patch: Patch<()> = Patch::Json(serde_json::from_value(ops).unwrap());
    Api::<Deployment>::namespaced(sim.client.clone(), NS)
        .patch("pool", &PatchParams::default(), &patch)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_that_already_serve_someone_are_replaced_without_backing_off() {
    let sim = Sim::with_pool("pool", 3).await;
    let mut ctl = Ctl::single(&sim).await;

    // Every pool pod is privately assigned (a valid token for each pod,
    // signed with the pool's key, as a controller that lost the claim's
    // label would have sent): each answers 409 to the controller.
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let list = pods
        .list(&ListParams::default().labels("skipper/deployment=pool"))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let squatter = function("pool", "squatter", 1);
    let mut squatted = Vec::new();
    for pod in list.items.iter().filter(|p| pod_ready(p)) {
        let name = pod.metadata.name.clone().unwrap();
        let uid = pod.metadata.uid.clone().unwrap();
        let ip = pod.status.as_ref().unwrap().pod_ip.clone().unwrap();
        let (token, _) = sim
            .key
            .sign_bound(
                Version::V2,
                &squatter.tenant,
                PodRef {
                    name: &name,
                    uid: &uid,
                },
                Duration::from_secs(600),
                std::time::SystemTime::now(),
            )
            .unwrap();
        let resp = http
            .post(format!("http://{ip}:8888/__skipper/assign"))
            .header(HEADER_TOKEN, token)
            .header(HEADER_FUNCTION, squatter.to_json())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "pod {name} takes the direct assignment");
        squatted.push(name);
    }
    assert_eq!(squatted.len(), 3);

    // New tenants: each claim of a squatted pod answers 409, that pod is
    // deleted and another claimed (a replacement the Deployment creates).
    for i in 0..4 {
        let f = function("pool", &format!("tenant-{i}"), 1);
        let got = ctl.instance(&f, Duration::from_secs(60)).await;
        let name = got.name.unwrap();
        assert!(!squatted.contains(&name), "tenant-{i} got squatted pod {name}");
    }
    let events = ctl.core.cluster.events.snapshot();
    let refusals: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventType::AssignmentFailed)
        .map(|e| e.message.clone())
        .collect();
    assert!(
        !refusals.is_empty() && refusals.iter().all(|m| m.contains("not counted")),
        "the squatted pods were claimed, refused and not counted: {refusals:?}"
    );
    assert!(refusals.iter().all(|m| !m.contains("backs off")), "{refusals:?}");
    for name in &squatted {
        if refusals.iter().any(|m| m.contains(name.as_str())) {
            eventually("the refusing pod to be gone", Duration::from_secs(30), || async {
                sim.live_pod(name).await.is_none().then_some(())
            })
            .await;
        }
    }
    assert_eq!(backoff_gauge(&ctl, "pool"), 0);
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollout_with_the_right_key_ends_the_back_off_at_once() {
    let sim = Sim::start().await;
    // The pool trusts a key the controller does not sign with.
    let wrong = SigningKey::generate().verifying_key().to_pem();
    sim.deploy_pool("pool", 4, &[]).await;
    trust(&sim, &wrong).await;
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let hashes = || async {
        let list = pods
            .list(&ListParams::default().labels("skipper/deployment=pool,!skipper/tenant"))
            .await
            .ok()?;
        let ready: Vec<String> = list
            .items
            .iter()
            .filter(|p| pod_ready(p))
            .filter_map(|p| p.metadata.labels.as_ref()?.get("pod-template-hash").cloned())
            .collect();
        Some(ready)
    };
    let mut ctl = Ctl::single(&sim).await;
    // Wait for the wrong-key ReplicaSet alone to be Ready.
    let wrong_hash = eventually("the wrong-key pool", Duration::from_secs(90), || async {
        let ready = hashes().await?;
        let first = ready.first()?.clone();
        (ready.len() == 4 && ready.iter().all(|h| *h == first)).then_some(first)
    })
    .await;
    sim.caught_up().await;

    // Eight new tenants at once: four claim the pods, four wait for their
    // replacements; all refuse (401), so the deployment backs off for the
    // longest period.
    let mut calls = Vec::new();
    for i in 0..8 {
        let f = function("pool", &format!("early-{i}"), 1);
        let mut grpc = ctl.grpc.clone();
        calls.push(tokio::spawn(async move {
            grpc.get_instance(get_instance(&f, Duration::from_secs(60))).await
        }));
    }
    for c in calls {
        assert!(c.await.unwrap().is_err(), "a wrong-key pod accepted");
    }
    let period = backoff_gauge(&ctl, "pool");
    assert!(period >= 16, "backing off for {period} s after 8 failures");
    let backing_off = tokio::time::Instant::now();
    let refusal = ctl
        .refusal(&function("pool", "during", 1), Duration::from_secs(5))
        .await;
    assert!(refusal.message().contains("backing off"), "{}", refusal.message());

    // The fix rolls out: the pool trusts the controller's key again.
    trust(&sim, &sim.public_pem).await;
    eventually(
        "the new ReplicaSet alone Ready",
        Duration::from_secs(90),
        || async {
            let ready = hashes().await?;
            (ready.len() == 4 && ready.iter().all(|h| *h != wrong_hash)).then_some(())
        },
    )
    .await;
    sim.caught_up().await;
    let served = ctl
        .instance(&function("pool", "after", 1), Duration::from_secs(30))
        .await;
    let waited = backing_off.elapsed();
    assert!(served.name.is_some());
    assert!(
        waited < Duration::from_secs(u64::try_from(period).unwrap()),
        "served {waited:?} after the back-off began, not before its {period} s ended"
    );
    let ended: Vec<_> = ctl
        .core
        .cluster
        .events
        .snapshot()
        .into_iter()
        .filter(|e| e.kind == EventType::AssignmentBackoffEnded)
        .map(|e| e.message)
        .collect();
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert!(ended[0].contains("ReplicaSet"), "{ended:?}");
    assert_eq!(backoff_gauge(&ctl, "pool"), 0);
    ctl.stop().await;
}
