//! The scenarios of the end-to-end suite.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::Timer;
use crate::harness::{
    Dev, NS, Opts, TENANT, control_plane_name, function, load, pod_ready, single, skipped_on_real, wait_for,
};

const WAIT: Duration = Duration::from_secs(60);

/// 1. A request for `t1` returns the fixture's echo naming `t1`; a second
///    request reaches the same (only) pod of `t1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s01_echo_and_affinity() {
    let _t = Timer::start("s01 echo and affinity");
    let dev = Dev::start(Opts {
        heartbeat_timeout: "60s",
        ..Opts::default()
    })
    .await;
    assert!(
        dev.output().contains("X-Skipper-Function"),
        "no curl in:\n{}",
        dev.output()
    );
    let f = single("t1");
    assert_eq!(dev.echo_tenant(&f, "/hello?x=1").await, "t1");
    eprintln!(
        "e2e: s01 start-up of skipper dev to the first request served: {:.1}s (control plane: {})",
        dev.started.elapsed().as_secs_f64(),
        control_plane_name()
    );
    let first = dev.tenant_pods("t1").await;
    assert_eq!(first.len(), 1, "t1 pods: {first:?}");
    assert_eq!(dev.echo_tenant(&f, "/again").await, "t1");
    assert_eq!(dev.tenant_pods("t1").await, first);
}

/// 2. 20 tenants in parallel get 20 distinct pods; each response names its tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s02_twenty_tenants_twenty_pods() {
    let _t = Timer::start("s02 20 tenants");
    // No scale to zero while the 20 assignments are checked. The pool of 5
    // refills in waves, each new pod Ready after its first passing readiness
    // probe (every second): the claims get time for three waves.
    let dev = Dev::start(Opts {
        pool: 5,
        heartbeat_timeout: "60s",
        controller_env: vec![
            "SKIPPER_HPA_DOWNSCALE_STABILIZATION=2s",
            "SKIPPER_HPA_INITIAL_READINESS_DELAY=1s",
            "SKIPPER_FUNCTION_ASSIGN_TIMEOUT=20s",
        ],
        ..Opts::default()
    })
    .await;
    let rec = dev.record_assignments();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (http, router) = (dev.http.clone(), dev.router.clone());
        set.spawn(async move {
            let tenant = format!("tenant-{i}");
            let sent = std::time::Instant::now();
            let resp = http
                .get(format!("{router}/who"))
                .header("X-Skipper-Function", single(&tenant))
                .send()
                .await
                .unwrap();
            let status = resp.status();
            let body = resp.text().await.unwrap();
            let took = sent.elapsed();
            assert_eq!(status, 200, "{tenant} after {took:?}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["tenant"], tenant.as_str());
            took
        });
    }
    let mut took = Vec::new();
    while let Some(r) = set.join_next().await {
        took.push(r.unwrap());
    }
    took.sort();
    eprintln!(
        "e2e: s02 first requests answered in {:.2?} (median) to {:.2?} (slowest)",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    let mut pods = BTreeSet::new();
    for i in 0..20 {
        let p = dev.tenant_pods(&format!("tenant-{i}")).await;
        assert_eq!(p.len(), 1, "tenant-{i}: {p:?}");
        pods.extend(p);
    }
    assert_eq!(pods.len(), 20, "pods: {pods:?}");
    let seen = rec.snapshot();
    assert!(seen.tenants_of_pod.values().all(|t| t.len() == 1), "{seen:?}");
}

/// 3. Oneshot: 10 requests get 10 distinct pods, each deleted after its
///    response; the pool refills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s03_oneshot() {
    let _t = Timer::start("s03 oneshot");
    let dev = Dev::start(Opts::default()).await;
    let rec = dev.record_assignments();
    let f = function("once", r#"{"max_instances":10}"#, true);
    for _ in 0..10 {
        assert_eq!(dev.echo_tenant(&f, "/job").await, "once");
    }
    let seen = wait_for("10 oneshot pods recorded", WAIT, || {
        let s = rec.snapshot();
        let n = s.tenants_of_pod.values().filter(|t| t.contains("once")).count();
        async move { (n >= 10).then_some(s) }
    })
    .await;
    let once: Vec<_> = seen
        .tenants_of_pod
        .iter()
        .filter(|(_, t)| t.contains("once"))
        .collect();
    assert_eq!(once.len(), 10, "oneshot pods: {once:?}");
    assert!(once.iter().all(|(_, t)| t.len() == 1));
    wait_for("every oneshot pod deleted", WAIT, || async {
        dev.tenant_pods("once").await.is_empty().then_some(())
    })
    .await;
    wait_for("the pool refilled to 3 Ready pods", WAIT, || async {
        (dev.idle_pool_pods().await == 3).then_some(())
    })
    .await;
}

/// 4. Slow requests with `target_in_flight_requests: 1` scale the function
///    up to `max_instances` (3) and never above; idle, it returns to zero
///    after the heartbeat timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s04_scale_on_in_flight() {
    let _t = Timer::start("s04 scale on in-flight");
    let dev = Dev::start(Opts {
        pool: 4,
        ..Opts::default()
    })
    .await;
    let rec = dev.record_assignments();
    let f = function(
        "busy",
        r#"{"max_instances":3,"target_in_flight_requests":1}"#,
        false,
    );
    let stop = CancellationToken::new();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let (http, router, f, stop) = (dev.http.clone(), dev.router.clone(), f.clone(), stop.clone());
        set.spawn(async move {
            let mut failures = 0u32;
            while !stop.is_cancelled() {
                let r = http
                    .get(format!("{router}/slow?delay_ms=1000"))
                    .header("X-Skipper-Function", f.as_str())
                    .send()
                    .await;
                if !r.is_ok_and(|r| r.status().is_success()) {
                    failures += 1;
                }
            }
            failures
        });
    }
    wait_for("3 instances of busy", WAIT, || async {
        (dev.tenant_pods("busy").await.len() == 3).then_some(())
    })
    .await;
    stop.cancel();
    let mut failures = 0;
    while let Some(r) = set.join_next().await {
        failures += r.unwrap();
    }
    assert_eq!(failures, 0);
    let started = std::time::Instant::now();
    wait_for("busy scaled to zero", WAIT, || async {
        dev.tenant_pods("busy").await.is_empty().then_some(())
    })
    .await;
    let idle = started.elapsed();
    assert!(
        idle >= Duration::from_secs(3),
        "scaled to zero after only {idle:?}"
    );
    assert_eq!(rec.snapshot().max_pods_of_tenant.get("busy"), Some(&3));
}

/// 5. Three controllers: each function's supervisor runs on the owner that
///    `ring-inspect` names. Killing one controller's process under steady
///    load: its container restarts (restartPolicy Always), it leaves the ring
///    while it is not Ready and rejoins when it is, its functions come back
///    to it; no request fails (client retries counted) and no pod is
///    assigned twice. Deleting a controller pod moves its functions to the
///    others and to its replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s05_three_controllers_failover() {
    let _t = Timer::start("s05 three controllers");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 6,
        ..Opts::default()
    })
    .await;
    assert_eq!(dev.controller_ips.len(), 3);
    let rec = dev.record_assignments();
    let tenants: Vec<String> = (0..9).map(|i| format!("ring-{i}")).collect();
    let functions: Vec<String> = tenants.iter().map(|t| single(t)).collect();
    for f in &functions {
        let (status, body) = dev.request(f, "/warm").await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let running = load(&dev, functions.clone(), 6);
    let owners = ring_owners(&["--members", &dev.controller_ips.join(",")], &functions);
    let live = ring_owners(
        &[
            "--controller",
            &format!("{}:50051", dev.controller_ips[0]),
            "--token-file",
            &dev.token_file.display().to_string(),
        ],
        &functions,
    );
    assert_eq!(live, owners, "ring-inspect --controller disagrees with --members");
    check_supervisors(&dev, &dev.controller_ips, &functions, &owners).await;
    // Kill the controller that owns the most functions.
    let victim = dev
        .controller_ips
        .iter()
        .max_by_key(|ip| owners.iter().filter(|o| o == ip).count())
        .unwrap()
        .clone();
    let pod = controller_pod(&dev, &victim).await;
    running.progress(50).await;
    let before = rec.snapshot();
    dev.kill_pod_process("skipper", &pod, 50051).await;
    wait_for("the killed controller restarted and Ready", WAIT, || async {
        let p = controller_pod_status(&dev, &pod).await?;
        let cs = p.container_statuses?.into_iter().next()?;
        (cs.restart_count >= 1 && cs.ready).then_some(())
    })
    .await;
    check_supervisors(&dev, &dev.controller_ips, &functions, &owners).await;
    running.progress(100).await;

    // Deleting the victim's pod: its functions move to the others and to
    // the replacement the Deployment makes (the preStop keeps the old one
    // terminating, out of the ring, for a while).
    use k8s_openapi::api::core::v1::Pod;
    let pods: kube::Api<Pod> = kube::Api::namespaced(dev.client.clone(), "skipper");
    pods.delete(&pod, &kube::api::DeleteParams::default())
        .await
        .unwrap();
    // The controllers only: on kubelet nodes the router is a pod of this
    // namespace too.
    let controllers = kube::api::ListParams::default().labels(CONTROLLER_SELECTOR);
    let members = wait_for("a replacement controller is Ready", WAIT, || async {
        let list = pods.list(&controllers).await.ok()?;
        let ips: Vec<String> = list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .collect();
        (ips.len() == 3 && !ips.contains(&victim)).then_some(ips)
    })
    .await;
    let moved = ring_owners(&["--members", &members.join(",")], &functions);
    check_supervisors(&dev, &members, &functions, &moved).await;
    running.progress(150).await;
    let (stats, errors) = running.finish().await;
    eprintln!(
        "e2e: s05 load: sent {} failed {} retried {} (victim {victim}, {} functions moved)",
        stats.sent,
        stats.failed,
        stats.retried,
        owners.iter().filter(|o| **o == victim).count()
    );
    assert_eq!(stats.failed, 0, "failed requests: {errors:?}");
    let after = rec.snapshot();
    for (uid, t) in &after.tenants_of_pod {
        assert_eq!(t.len(), 1, "pod {uid} assigned to {t:?}");
    }
    for t in &tenants {
        assert!(
            after.max_pods_of_tenant.get(t).copied().unwrap_or(0) <= 1,
            "{t} had more than one pod at once: {after:?} (before the kill: {before:?})"
        );
    }
}

async fn controller_pod_status(dev: &Dev, name: &str) -> Option<k8s_openapi::api::core::v1::PodStatus> {
    use k8s_openapi::api::core::v1::Pod;
    let api: kube::Api<Pod> = kube::Api::namespaced(dev.client.clone(), "skipper");
    api.get_opt(name).await.ok()??.status
}

/// The owner `ring-inspect` names for each function, with `members` flags.
fn ring_owners(members: &[&str], functions: &[String]) -> Vec<String> {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_skipper"));
    cmd.arg("ring-inspect").args(members).args(["--output", "json"]);
    for f in functions {
        cmd.args(["--function", f]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let lookups = v["functions"]
        .as_array()
        .unwrap_or_else(|| panic!("ring-inspect output: {v}"));
    assert_eq!(lookups.len(), functions.len());
    lookups
        .iter()
        .map(|l| l["owner"].as_str().unwrap().to_owned())
        .collect()
}

/// Every member sees the ring `members`, and the aggregated cluster state
/// from each member lists every function once, owned by the controller
/// `ring-inspect` names.
async fn check_supervisors(dev: &Dev, members: &[String], functions: &[String], owners: &[String]) {
    let want_members: BTreeSet<&str> = members.iter().map(String::as_str).collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut wrong = Vec::new();
        for ip in members {
            let local = dev.controller_state(ip).await;
            let seen: BTreeSet<&str> = local.controller_ips.iter().map(String::as_str).collect();
            if seen != want_members {
                wrong.push(format!("{ip} sees ring {seen:?}"));
            }
            let st = dev.aggregated_state(ip).await;
            for (f, owner) in functions.iter().zip(owners) {
                let tenant = serde_json::from_str::<Value>(f).unwrap()["tenant"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let resp: Vec<&str> = st
                    .supervisors
                    .iter()
                    .filter(|s| {
                        s.function.as_ref().and_then(|f| f.tenant.as_deref()) == Some(tenant.as_str())
                    })
                    .map(|s| s.responsible_controller_ip.as_deref().unwrap_or(""))
                    .collect();
                if resp != [owner.as_str()] {
                    wrong.push(format!(
                        "via {ip}: {tenant} owned by {resp:?}, ring-inspect says {owner}"
                    ));
                }
            }
        }
        if wrong.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "ownership differs from ring-inspect: {wrong:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The label selector of the controller pods (`manifests/controller.yaml`).
const CONTROLLER_SELECTOR: &str = "app.kubernetes.io/name=skipper,app.kubernetes.io/component=controller";

async fn controller_pod(dev: &Dev, ip: &str) -> String {
    use k8s_openapi::api::core::v1::Pod;
    let api: kube::Api<Pod> = kube::Api::namespaced(dev.client.clone(), "skipper");
    api.list(&kube::api::ListParams::default().labels(CONTROLLER_SELECTOR))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_deref()) == Some(ip))
        .and_then(|p| p.metadata.name)
        .unwrap()
}

/// 6. Killing a tenant pod's process under load: its container restarts in
///    place (restartPolicy Always) and, its token kept in the pool's `/tmp`
///    emptyDir, serves the same tenant again; no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s06_pod_crash_under_load() {
    use k8s_openapi::api::core::v1::Pod;
    let _t = Timer::start("s06 pod crash");
    let dev = Dev::start(Opts::default()).await;
    let f = single("crashy");
    assert_eq!(dev.echo_tenant(&f, "/").await, "crashy");
    let old = dev.tenant_pods("crashy").await;
    assert_eq!(old.len(), 1);
    let old = old.into_iter().next().unwrap();
    let running = load(&dev, vec![f.clone()], 4);
    dev.kill_pod_process(NS, &old, 8888).await;
    let pods: kube::Api<Pod> = kube::Api::namespaced(dev.client.clone(), NS);
    wait_for("the crashed container restarted and Ready", WAIT, || async {
        let p = pods.get_opt(&old).await.ok()??;
        let cs = p.status?.container_statuses?.into_iter().next()?;
        (cs.restart_count >= 1 && cs.ready).then_some(())
    })
    .await;
    // Requests after the restart are served by the same, still assigned, pod.
    for _ in 0..5 {
        assert_eq!(dev.echo_tenant(&f, "/after").await, "crashy");
    }
    let (stats, errors) = running.finish().await;
    eprintln!(
        "e2e: s06 load: sent {} failed {} retried {} (first-attempt errors: {errors:?})",
        stats.sent, stats.failed, stats.retried
    );
    assert_eq!(stats.failed, 0, "{errors:?}");
    assert!(dev.tenant_pods("crashy").await.contains(&old));
}

/// 7. A WebSocket held open longer than the heartbeat timeout keeps its pod;
///    after it closes the pod is reclaimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s07_websocket_keeps_pod() {
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let _t = Timer::start("s07 websocket");
    let dev = Dev::start(Opts::default()).await;
    let f = single("ws");
    let mut req = format!("{}/socket", dev.router.replace("http://", "ws://"))
        .into_client_request()
        .unwrap();
    req.headers_mut().insert("X-Skipper-Function", f.parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    ws.send(Message::Text("ping".into())).await.unwrap();
    let pong = ws.next().await.unwrap().unwrap();
    assert_eq!(pong, Message::Text("pong".into()));
    let pod = dev.tenant_pods("ws").await;
    assert_eq!(pod.len(), 1);
    // Hold it for twice the heartbeat timeout (5s), pinging.
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < until {
        ws.send(Message::Text("ping".into())).await.unwrap();
        assert_eq!(ws.next().await.unwrap().unwrap(), Message::Text("pong".into()));
        assert_eq!(
            dev.tenant_pods("ws").await,
            pod,
            "pod changed while the socket was open"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    ws.close(None).await.unwrap();
    drop(ws);
    wait_for("the websocket's pod reclaimed", WAIT, || async {
        dev.tenant_pods("ws").await.is_empty().then_some(())
    })
    .await;
}

/// 8. A pool template rollout (`maxSurge: 1, maxUnavailable: 0`: the old
///    and new ReplicaSets run side by side) replaces stale instances with no
///    failed requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s08_rollout() {
    use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
    use kube::api::{ListParams, Patch, PatchParams};
    let _t = Timer::start("s08 rollout");
    let dev = Dev::start(Opts {
        pool: 4,
        ..Opts::default()
    })
    .await;
    let functions: Vec<String> = (0..3).map(|i| single(&format!("roll-{i}"))).collect();
    for f in &functions {
        dev.request(f, "/").await.unwrap();
    }
    let mut old = BTreeSet::new();
    for i in 0..3 {
        old.extend(dev.tenant_pods(&format!("roll-{i}")).await);
    }
    assert_eq!(old.len(), 3);
    let running = load(&dev, functions.clone(), 3);
    let api: kube::Api<Deployment> = kube::Api::namespaced(dev.client.clone(), NS);
    api.patch(
        "fixture",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"annotations": {"rollout": "2"}}},
        }})),
    )
    .await
    .unwrap();
    let replicasets: kube::Api<ReplicaSet> = kube::Api::namespaced(dev.client.clone(), NS);
    // (old ReplicaSet's pods, new ReplicaSet's pods) of the pool.
    let pool_sets = || async {
        let sets = replicasets.list(&ListParams::default()).await.ok()?.items;
        let size = |rollout: Option<&str>| -> i32 {
            sets.iter()
                .filter(|rs| {
                    rs.metadata
                        .owner_references
                        .as_ref()
                        .is_some_and(|o| o.iter().any(|o| o.name == "fixture"))
                })
                .filter(|rs| {
                    rs.spec
                        .as_ref()
                        .and_then(|s| s.template.as_ref()?.metadata.as_ref()?.annotations.as_ref())
                        .and_then(|a| a.get("rollout"))
                        .map(String::as_str)
                        == rollout
                })
                .filter_map(|rs| rs.status.as_ref().map(|s| s.replicas))
                .sum()
        };
        Some((size(None), size(Some("2"))))
    };
    wait_for("the old and new ReplicaSets side by side", WAIT, || async {
        let (old, new) = pool_sets().await?;
        (old > 0 && new > 0).then_some(())
    })
    .await;
    wait_for(
        "every stale instance replaced",
        Duration::from_secs(90),
        || async {
            let mut now = BTreeSet::new();
            for i in 0..3 {
                let p = dev.tenant_pods(&format!("roll-{i}")).await;
                if p.len() != 1 {
                    return None;
                }
                now.extend(p);
            }
            now.is_disjoint(&old).then_some(())
        },
    )
    .await;
    wait_for("the rollout to finish", Duration::from_secs(90), || async {
        let (old, new) = pool_sets().await?;
        (old == 0 && new == 4).then_some(())
    })
    .await;
    let (stats, errors) = running.finish().await;
    eprintln!(
        "e2e: s08 load: sent {} failed {} retried {}",
        stats.sent, stats.failed, stats.retried
    );
    assert_eq!(stats.failed, 0, "{errors:?}");
    // Pods being deleted may still read Ready while they stop.
    for p in dev.pods().await {
        if p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(TENANT))
            && p.metadata.deletion_timestamp.is_none()
            && pod_ready(&p)
        {
            assert_eq!(
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("rollout"))
                    .map(String::as_str),
                Some("2"),
                "stale pod {:?}",
                p.metadata.name
            );
        }
    }
}

/// 9. The simulator drops every watch (and compacts, so re-watches get 410):
///    controllers resync and traffic continues, for old and new tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s09_watches_dropped() {
    if skipped_on_real(
        "s09 watches dropped",
        "dropping every watch and compacting are the simulator's fault endpoints (/_sim/drop-watches, /_sim/compact)",
    ) {
        return;
    }
    let _t = Timer::start("s09 watches dropped");
    let dev = Dev::start(Opts::default()).await;
    assert_eq!(dev.echo_tenant(&single("before"), "/").await, "before");
    let running = load(&dev, vec![single("before")], 2);
    dev.fault("compact").await;
    dev.fault("drop-watches").await;
    // New tenants need the controllers' pod caches, rebuilt after the drop.
    for i in 0..3 {
        let t = format!("after-{i}");
        assert_eq!(dev.echo_tenant(&single(&t), "/").await, t);
    }
    // The pool refills (the controllers see the claimed pods leave the pool).
    wait_for("the pool refilled", WAIT, || async {
        (dev.idle_pool_pods().await == 3).then_some(())
    })
    .await;
    // A claim after the refill uses a pod the controller learned of after the drop.
    assert_eq!(dev.echo_tenant(&single("late"), "/").await, "late");
    running.progress(20).await;
    let (stats, errors) = running.finish().await;
    assert_eq!(stats.failed, 0, "{errors:?}");
}

/// 10. 200 malformed or invalid function headers (and functions of an
///     unmanaged namespace): all 400, no pod touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_bad_headers() {
    let _t = Timer::start("s10 bad headers");
    let dev = Dev::start(Opts::default()).await;
    let snapshot = |pods: Vec<k8s_openapi::api::core::v1::Pod>| -> BTreeSet<(String, String)> {
        pods.into_iter()
            .map(|p| {
                (
                    p.metadata.name.unwrap_or_default(),
                    p.metadata.resource_version.unwrap_or_default(),
                )
            })
            .collect()
    };
    let before = snapshot(dev.pods().await);
    let bad = [
        String::new(),
        "not json".into(),
        "{".into(),
        "[]".into(),
        r#"{"namespace":"default","deployment":"fixture"}"#.into(),
        r#"{"namespace":"default","tenant":"t"}"#.into(),
        r#"{"deployment":"fixture","tenant":"t"}"#.into(),
        r#"{"namespace":"default","deployment":"fixture","tenant":"t"}"#.into(),
        function("t", r#"{"max_instances":0}"#, false),
        function("t", r#"{"min_instances":3,"max_instances":1}"#, false),
        function("Bad Tenant!", r#"{"max_instances":1}"#, false),
        r#"{"namespace":"NOT_A_NS","deployment":"fixture","tenant":"t","scale":{"max_instances":1}}"#.into(),
        r#"{"namespace":"default","deployment":"fix ture","tenant":"t","scale":{"max_instances":1}}"#.into(),
        r#"{"namespace":"default","deployment":"fixture","tenant":"t","scale":{"max_instances":-1}}"#.into(),
        r#"{"namespace":7,"deployment":"fixture","tenant":"t","scale":{"max_instances":1}}"#.into(),
        // Valid, but in a namespace no controller manages.
        r#"{"namespace":"nowhere","deployment":"fixture","tenant":"t","scale":{"max_instances":1}}"#.into(),
    ];
    let mut statuses = Vec::new();
    for i in 0..200 {
        let h = &bad[i % bad.len()];
        let mut req = dev.http.get(format!("{}/x", dev.router));
        if !(h.is_empty() && i % 2 == 0) {
            req = req.header("X-Skipper-Function", h.as_str());
        }
        let resp = req.send().await.unwrap();
        statuses.push((resp.status().as_u16(), h.clone()));
    }
    let not_400: Vec<_> = statuses.iter().filter(|(s, _)| *s != 400).collect();
    assert!(not_400.is_empty(), "{not_400:?}");
    assert_eq!(statuses.len(), 200);
    assert_eq!(snapshot(dev.pods().await), before, "pods changed");
}

/// 11. A pool that declares h2c (`skipper/app-protocol: kubernetes.io/h2c`
///     on its template) gets HTTP/2 from the router whatever the client
///     speaks; a gRPC client calls the fixture's Echo service (unary and
///     bidi streaming) through the router, and the pod's process killed in
///     the middle of a stream ends the call with `UNAVAILABLE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_grpc_to_an_h2c_pool() {
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::api::{Patch, PatchParams};
    use skipper::fixture::echo::api::EchoRequest;
    use skipper::fixture::echo::api::echo_client::EchoClient;
    let _t = Timer::start("s11 gRPC to an h2c pool");
    let dev = Dev::start(Opts {
        heartbeat_timeout: "60s",
        ..Opts::default()
    })
    .await;
    let deployments: kube::Api<Deployment> = kube::Api::namespaced(dev.client.clone(), NS);
    deployments
        .patch(
            "fixture",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
                    skipper::domain::ANNOTATION_APP_PROTOCOL: "kubernetes.io/h2c"
                }}}}}),
            ),
        )
        .await
        .unwrap();
    wait_for("the pool's pods rolled to the h2c template", WAIT, || async {
        let pool: Vec<_> = dev
            .pods()
            .await
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| !p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(TENANT)))
            .collect();
        let h2c = |p: &k8s_openapi::api::core::v1::Pod| {
            p.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(skipper::domain::ANNOTATION_APP_PROTOCOL))
        };
        (!pool.is_empty() && pool.iter().all(|p| h2c(p) && pod_ready(p))).then_some(())
    })
    .await;

    // HTTP/1.1 and HTTP/2 clients alike: the pod receives HTTP/2.
    let f = single("g1");
    for args in [&["--http1.1"][..], &["--http2-prior-knowledge"][..]] {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "-H", &format!("X-Skipper-Function: {f}")])
            .args(args)
            .arg(format!("{}/proto", dev.router))
            .output()
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(body["proto"], "HTTP/2.0", "{args:?}: {body}");
        assert_eq!(body["tenant"], "g1", "{body}");
    }

    let call = |msg: &str| {
        let mut req = tonic::Request::new(EchoRequest {
            message: msg.into(),
            ..Default::default()
        });
        req.metadata_mut()
            .insert("x-skipper-function", f.parse().unwrap());
        req
    };
    let mut client = EchoClient::connect(dev.router.clone()).await.unwrap();
    let reply = client.unary(call("unary")).await.unwrap().into_inner();
    assert_eq!((reply.message.as_str(), reply.tenant.as_str()), ("unary", "g1"));
    let pods = dev.tenant_pods("g1").await;
    assert_eq!(pods.len(), 1, "{pods:?}");
    let pod = pods.into_iter().next().unwrap();
    assert_eq!(reply.pod, pod);

    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("x-skipper-function", f.parse().unwrap());
    let mut replies = client.bidi(req).await.unwrap().into_inner();
    for n in 1..=3u32 {
        tx.send(EchoRequest {
            message: format!("m{n}"),
            ..Default::default()
        })
        .await
        .unwrap();
        let r = tokio::time::timeout(WAIT, replies.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!((r.sequence, r.pod.as_str()), (n, pod.as_str()));
    }
    dev.kill_pod_process(NS, &pod, 8888).await;
    let status = tokio::time::timeout(WAIT, replies.message())
        .await
        .expect("the call ends when its pod dies, it does not hang")
        .expect_err("the call fails");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains(&pod), "{status:?}");
    drop(tx);
}
