//! The warm path end to end against the simulator: two tenants' requests
//! run through a real router while their instances change — scale up,
//! scale down (with draining), a pod killed, a controller replaced. No
//! request fails that a retry could have saved, none reaches a pod of the
//! other tenant, and most are routed without asking a controller. And a
//! rolling update of the pool (`maxSurge: 1, maxUnavailable: 0`) on either
//! backend: stale instances are replaced one for one while the old
//! ReplicaSet is still there, and no request fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;
use skipper_test_support::controller as harness;
use skipper_test_support::differential;
use skipper_test_support::router as router_harness;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backend::Backend;
use harness::{CTL_NS, Ctl, NAMESPACES, NS, Sim, eventually, function};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use skipper::api;
use skipper::api::EventType;
use skipper::domain::{Function, HEADER_FUNCTION};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(30);
const LOADERS: usize = 6;

/// What the load saw.
#[derive(Debug, Default)]
struct Seen {
    ok: usize,
    /// `(method, tenant, status, body)` of every request that did not succeed.
    failed: Vec<(String, String, u16, String)>,
    /// `(asked, served)` for responses from another tenant's pod.
    crossed: Vec<(String, String)>,
}

/// `LOADERS` clients sending requests for both tenants back to back, each
/// with its own body, PUT and POST in turn, checking the answer, until
/// `stop`.
fn start_load(
    router: std::net::SocketAddr,
    functions: Vec<Function>,
    stop: CancellationToken,
) -> (Arc<Mutex<Seen>>, Vec<tokio::task::JoinHandle<()>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = Vec::new();
    for n in 0..LOADERS {
        let seen = seen.clone();
        let functions = functions.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let http = skipper_test_support::http();
            let mut i = 0usize;
            while !stop.is_cancelled() {
                let f = &functions[i % functions.len()];
                i += 1;
                let body = format!("loader {n} request {i} for {}", f.tenant).repeat(1 + i % 7);
                let method = if (i / 2).is_multiple_of(2) {
                    http::Method::PUT
                } else {
                    http::Method::POST
                };
                let resp = http
                    .request(method.clone(), format!("http://{router}/echo"))
                    .header(HEADER_FUNCTION, f.to_json())
                    .body(body.clone())
                    .send()
                    .await;
                let (status, text) = match resp {
                    Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                    Err(e) => (0, e.to_string()),
                };
                let mut s = seen.lock().unwrap();
                if status != 200 {
                    s.failed
                        .push((method.to_string(), f.tenant.clone(), status, text));
                    continue;
                }
                let echo: serde_json::Value = serde_json::from_str(&text).unwrap();
                let served = echo["tenant"].as_str().unwrap_or_default().to_owned();
                if served != f.tenant {
                    s.crossed.push((f.tenant.clone(), served));
                }
                assert_eq!(echo["body"], body, "the body arrives intact");
                s.ok += 1;
            }
        }));
    }
    (seen, tasks)
}

async fn more_requests(seen: &Arc<Mutex<Seen>>, n: usize, what: &str) {
    let target = seen.lock().unwrap().ok + n;
    eventually(what, LIMIT, || async {
        (seen.lock().unwrap().ok >= target).then_some(())
    })
    .await;
}

fn scale(f: &Function, desired: u32) -> tonic::Request<api::ScaleRequest> {
    harness::scale(f, desired, LIMIT)
}

/// A router in front of `controllers` that retries as a loaded machine
/// needs: every request under load must succeed.
async fn start_router(controllers: Vec<std::net::SocketAddr>) -> router_harness::RouterHandle {
    let mut config = router_harness::test_config(controllers);
    config.heartbeat_interval = Duration::from_millis(500);
    config.retry_min = Duration::from_millis(20);
    config.retry_max = Duration::from_millis(200);
    config.max_round_trip_attempts = 8;
    config.get_instance_timeout = Duration::from_secs(10);
    router_harness::start_router(config).await
}

fn ring_config(sim: &Sim<'_>, pod_ip: &str) -> skipper::controller::Config {
    let mut c = sim.ring_config(pod_ip);
    c.drain_timeout = Duration::from_secs(10);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_change_under_load_and_no_request_fails_or_crosses_tenants() {
    let sim = Sim::with_pool("pool", 6).await;
    let (a, mut b) = sim.ring_of_two(|ip| ring_config(&sim, ip)).await;
    let port = a.addr.port();

    let router = start_router(vec![a.addr, b.addr]).await;
    let red = function("pool", "red", 3);
    let blue = function("pool", "blue", 3);
    let stop = CancellationToken::new();
    let (seen, loaders) = start_load(router.addr, vec![red.clone(), blue.clone()], stop.clone());
    more_requests(&seen, 50, "requests to flow").await;

    // Scale up: two more red instances join the router's table.
    b.grpc.scale(scale(&red, 3)).await.unwrap();
    eventually("three red instances", LIMIT, || async {
        (sim.tenant_pods("red").await.len() == 3).then_some(())
    })
    .await;
    more_requests(&seen, 100, "requests after the scale-up").await;

    // Scale down: two red instances drain, then go.
    b.grpc.scale(scale(&red, 1)).await.unwrap();
    assert_eq!(sim.tenant_pods("red").await.len(), 1);
    more_requests(&seen, 100, "requests after the scale-down").await;

    // A blue pod's process is killed.
    let victim = sim.tenant_pods("blue").await[0].metadata.name.clone().unwrap();
    sim.backend
        .kill_pod_process(NS, &victim)
        .expect("the pod's process runs");
    more_requests(&seen, 100, "requests after the pod was killed").await;

    // Controller A is replaced by C: A's pod goes (it leaves the ring), the
    // process stops, C's pod comes and joins.
    sim.delete_pod(CTL_NS, "controller-a").await;
    a.stop().await;
    let ip_c = sim.controller_pod(CTL_NS, "controller-c").await;
    let lc = TcpListener::bind((ip_c.as_str(), port)).await.unwrap();
    let c = Ctl::start(&sim, ring_config(&sim, &ip_c), lc).await;
    Ctl::await_rings(&[&b, &c], 2).await;
    more_requests(&seen, 200, "requests after the controller was replaced").await;
    // The tables are warm again: a stretch of requests without a controller
    // call.
    tokio::time::timeout(LIMIT, async {
        loop {
            let before = router.metric("skipper_router_controller_calls_total").await;
            more_requests(&seen, 100, "a warm stretch").await;
            if router.metric("skipper_router_controller_calls_total").await == before {
                return;
            }
        }
    })
    .await
    .expect("the tables did not become warm again");

    stop.cancel();
    for t in loaders {
        t.await.unwrap();
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        seen.crossed.is_empty(),
        "answered by another tenant's pod: {:?}",
        seen.crossed
    );
    // Only POSTs already handed to the killed pod could not be saved (an
    // idempotent request goes to another instance).
    let unsaveable = |(method, tenant, status, body): &(String, String, u16, String)| {
        method == "POST"
            && tenant == "blue"
            && *status == 502
            && body.contains(&format!("instance {victim:?} failed"))
    };
    let lost: Vec<_> = seen.failed.iter().filter(|f| !unsaveable(f)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} requests failed: {lost:?}",
        lost.len(),
        seen.ok + seen.failed.len()
    );
    assert!(
        seen.failed.len() <= LOADERS,
        "at most one request per client was in flight: {:?}",
        seen.failed
    );
    let calls = router.metric("skipper_router_controller_calls_total").await;
    eprintln!(
        "{} requests, {} POSTs lost in the killed pod {:?}, {calls} controller calls",
        seen.ok,
        seen.failed.len(),
        seen.failed
    );
    router.stop().await;
    b.stop().await;
    c.stop().await;
}

/// The ReplicaSet a tenant pod was claimed from.
fn replica_set_of(pod: &Pod) -> String {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("skipper/replica-set"))
        .cloned()
        .unwrap_or_default()
}

/// A rolling update of the pool under load: the new ReplicaSet surges one
/// pod at a time while the old one keeps its pods (both have replicas at
/// once); Skipper replaces each tenant's instance claimed from the old
/// ReplicaSet by one from the new, while the old ReplicaSet is still
/// present, never with more than `max + 1` pods of a tenant, and no request
/// fails or reaches another tenant's pod.
async fn a_rolling_update_replaces_stale_instances(backend: &Backend) {
    if !backend.runs_pods() {
        eprintln!(
            "skipped: no node agent runs pods on the {} backend",
            backend.name()
        );
        return;
    }
    let sim = Sim::lent(backend).await;
    sim.deploy_pool("roll", 4, &[]).await;
    sim.patch_pool(
        "roll",
        serde_json::json!({"spec": {"strategy": {"type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}}),
    )
    .await;
    sim.wait_pool("roll", 4, LIMIT).await;
    let ctl = Ctl::single(&sim).await;
    let router = start_router(vec![ctl.addr]).await;
    let tenants = [function("roll", "red", 1), function("roll", "blue", 1)];
    let stop = CancellationToken::new();
    let (seen, loaders) = start_load(router.addr, tenants.to_vec(), stop.clone());
    more_requests(&seen, 50, "requests to flow").await;

    let old_rs = eventually("an instance of each tenant", LIMIT, || async {
        let mut sets = Vec::new();
        for f in &tenants {
            let pods = sim.tenant_pods(&f.tenant).await;
            sets.push(replica_set_of(pods.first()?));
        }
        sets.dedup();
        (sets.len() == 1).then(|| sets.remove(0))
    })
    .await;

    let sets = kube::Api::<ReplicaSet>::namespaced(sim.client.clone(), NS);
    sim.patch_pool(
        "roll",
        serde_json::json!({"spec": {"template": {"metadata": {"annotations": {"rollout": "2"}}}}}),
    )
    .await;
    // Until every tenant's instance comes from the new ReplicaSet: the
    // replicas of both sets, the tenants' pods, and the old set at the
    // first stale replacement.
    let mut coexisted = false;
    let mut old_present_at_replacement = None;
    let mut most_pods = 0;
    tokio::time::timeout(Duration::from_secs(90), async {
        loop {
            let listed = sets
                .list(&kube::api::ListParams::default().labels("skipper/deployment=roll"))
                .await
                .unwrap();
            let with_replicas = listed
                .items
                .iter()
                .filter(|rs| rs.status.as_ref().is_some_and(|s| s.replicas > 0))
                .count();
            coexisted |= with_replicas >= 2;
            if old_present_at_replacement.is_none()
                && ctl
                    .core
                    .cluster
                    .events
                    .snapshot()
                    .iter()
                    .any(|e| e.kind == EventType::StaleReplacement)
            {
                old_present_at_replacement = Some(sets.get_opt(&old_rs).await.unwrap().is_some());
            }
            let mut done = true;
            for f in &tenants {
                let pods = sim.tenant_pods(&f.tenant).await;
                most_pods = most_pods.max(pods.len());
                done &= !pods.is_empty() && pods.iter().all(|p| replica_set_of(p) != old_rs);
            }
            if done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every tenant's instance comes from the new ReplicaSet within 90 s");
    more_requests(&seen, 100, "requests after the rollout").await;
    stop.cancel();
    for t in loaders {
        t.await.unwrap();
    }

    assert!(coexisted, "the old and the new ReplicaSet never had pods at once");
    let replacements: Vec<String> = ctl
        .core
        .cluster
        .events
        .snapshot()
        .iter()
        .filter(|e| e.kind == EventType::StaleReplacement)
        .map(|e| e.message.clone())
        .collect();
    assert!(
        replacements.len() >= tenants.len(),
        "every tenant's stale instance was replaced: {replacements:?}"
    );
    assert_eq!(
        old_present_at_replacement,
        Some(true),
        "the old ReplicaSet {old_rs} is present when its stale instances are replaced"
    );
    assert!(
        sets.get_opt(&old_rs).await.unwrap().is_some(),
        "the old ReplicaSet {old_rs} stays (revision history)"
    );
    assert!(
        most_pods <= 2,
        "at most max + 1 pods of a tenant, saw {most_pods}"
    );
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        seen.crossed.is_empty(),
        "answered by another tenant's pod: {:?}",
        seen.crossed
    );
    assert!(
        seen.failed.is_empty(),
        "{} of {} requests failed: {:?}",
        seen.failed.len(),
        seen.ok + seen.failed.len(),
        seen.failed
    );
    eprintln!(
        "{} requests through a rolling update on the {} backend; replacements: {replacements:?}",
        seen.ok,
        backend.name()
    );
    router.stop().await;
    ctl.stop().await;
}

differential!(
    rolling_update_replaces_stale_instances,
    a_rolling_update_replaces_stale_instances,
    namespaces = [
        NAMESPACES[0],
        NAMESPACES[1],
        NAMESPACES[2],
        NAMESPACES[3],
        NAMESPACES[4]
    ],
    pods
);
