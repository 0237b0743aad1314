//! Converge against the simulator: scale up on in-flight load with clamping,
//! scale to zero when idle, the stabilization maximum, stale replacement on
//! a template rollout, stuck-instance cleanup, and oneshot functions.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use harness::{Ctl, NS, Sim, eventually, function, get_instance, heartbeat};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use skipper::api::{self, EventType};
use skipper::controller::metrics::{FunctionLabels, Metrics};
use skipper::domain::Function;
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// Sends a heartbeat for `f` every 200 ms with the current in-flight value.
fn keep_alive(ctl: &Ctl, f: &Function, in_flight: Arc<AtomicU32>) -> CancellationToken {
    let stop = CancellationToken::new();
    let mut grpc = ctl.grpc.clone();
    let f = f.clone();
    let token = stop.clone();
    tokio::spawn(async move {
        loop {
            let _ = grpc
                .heartbeat(heartbeat("10.9.9.9", &f, in_flight.load(Ordering::SeqCst)))
                .await;
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    });
    stop
}

fn in_flight_function(deployment: &str, tenant: &str, max: u32, target: u32) -> Function {
    let mut f = function(deployment, tenant, max);
    f.scale.as_mut().unwrap().target_in_flight_requests = Some(target);
    f
}

/// A controller on the simulator that scales a function to zero after
/// `heartbeat_timeout` without a heartbeat and scales down only after
/// `stabilization`.
async fn ctl_scaling_down(sim: &Sim<'_>, heartbeat_timeout: Duration, stabilization: Duration) -> Ctl {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.scale.heartbeat_timeout = heartbeat_timeout;
    config.scale.downscale_stabilization = stabilization;
    Ctl::start(sim, config, listener).await
}

/// Waits (at most `limit`) until `tenant` has exactly `n` pods.
async fn tenant_pods_reach(sim: &Sim<'_>, tenant: &str, n: usize, limit: Duration) {
    eventually(&format!("{n} pods of {tenant}"), limit, || async {
        (sim.tenant_pods(tenant).await.len() == n).then_some(())
    })
    .await;
}

/// Asserts, reading every 50 ms until `until`, that the number of pods of
/// `tenant` satisfies `ok`.
async fn tenant_pods_hold(
    sim: &Sim<'_>,
    tenant: &str,
    until: tokio::time::Instant,
    ok: impl Fn(usize) -> bool,
    what: &str,
) {
    while tokio::time::Instant::now() < until {
        let n = sim.tenant_pods(tenant).await.len();
        assert!(ok(n), "{what}: {n} pods of {tenant}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most `limit`) until pod `name` is gone.
async fn pod_gone(sim: &Sim<'_>, name: &str, limit: Duration) {
    eventually(&format!("pod {name} deleted"), limit, || async {
        sim.live_pod(name).await.is_none().then_some(())
    })
    .await;
}

/// Whether the controller recorded an event of `kind` (with `message`, when
/// given).
fn recorded(ctl: &Ctl, kind: EventType, message: Option<&str>) -> bool {
    ctl.core
        .cluster
        .events
        .snapshot()
        .iter()
        .any(|e| e.kind == kind && message.is_none_or(|m| e.message == m))
}

/// Claims `pod` for `f` the way a controller does before its assign
/// request, as if at `at`, and never assigns it.
async fn claim(sim: &Sim<'_>, f: &Function, pod: &str, at: SystemTime) {
    let ops = skipper::controller::kube::pods::claim_ops(f, at, None);
    let patch: Patch<()> = Patch::Json(serde_json::from_value(ops).unwrap());
    Api::<Pod>::namespaced(sim.client.clone(), NS)
        .patch(pod, &PatchParams::default(), &patch)
        .await
        .unwrap();
}

/// A per-deployment count of the controller's metrics: `count` reads it
/// from the metrics for the functions of `deployment`.
fn counted(ctl: &Ctl, deployment: &str, count: impl FnOnce(&Metrics, &FunctionLabels) -> u64) -> u64 {
    count(&ctl.core.cluster.metrics, &Metrics::function(deployment))
}

/// Releases `instance` through the controller's gRPC API.
async fn release(ctl: &mut Ctl, instance: Option<api::Instance>) -> Result<(), tonic::Status> {
    ctl.grpc
        .release_instance(api::ReleaseInstanceRequest { instance })
        .await
        .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_flight_load_scales_up_and_clamps_at_max() {
    let sim = Sim::with_pool("load", 4).await;
    let ctl = Ctl::single(&sim).await;
    let f = in_flight_function("load", "busy", 2, 10);
    let load = Arc::new(AtomicU32::new(25));
    let stop = keep_alive(&ctl, &f, load);

    tenant_pods_reach(&sim, "busy", 2, Duration::from_secs(10)).await;
    // Desired 3 is clamped at max 2: the count stays at 2 over several ticks.
    let until = tokio::time::Instant::now() + Duration::from_secs(1);
    tenant_pods_hold(&sim, "busy", until, |n| n <= 2, "clamped at max_instances").await;
    let ups = counted(&ctl, "load", |m, f| m.scale_ups_total.get_or_create(f).get());
    assert_eq!(ups, 2);
    assert!(recorded(
        &ctl,
        EventType::ScaleUp,
        Some("scaling up from 0 to 2 instances")
    ));
    stop.cancel();
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_function_scales_to_zero_after_the_heartbeat_timeout() {
    let sim = Sim::with_pool("idle", 1).await;
    let mut ctl = ctl_scaling_down(&sim, Duration::from_secs(1), Duration::from_millis(500)).await;

    let f = function("idle", "sleepy", 1);
    let inst = ctl.instance(&f, Duration::from_secs(10)).await;
    pod_gone(&sim, &inst.name.unwrap(), Duration::from_secs(10)).await;
    eventually("supervisor stopped", Duration::from_secs(5), || async {
        ctl.core.supervisors.get(f.id()).is_none().then_some(())
    })
    .await;
    assert!(recorded(
        &ctl,
        EventType::HeartbeatTimeout,
        Some("heartbeat timeout, scaling to 0")
    ));
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stabilization_keeps_the_maximum_before_scaling_down() {
    let sim = Sim::with_pool("wave", 4).await;
    let ctl = ctl_scaling_down(&sim, Duration::from_secs(2), Duration::from_secs(2)).await;
    let f = in_flight_function("wave", "surfer", 3, 10);
    let load = Arc::new(AtomicU32::new(20));
    let stop = keep_alive(&ctl, &f, load.clone());
    tenant_pods_reach(&sim, "surfer", 2, Duration::from_secs(10)).await;
    // Let the protection period pass, then drop the load.
    let started = ctl.core.cluster.started_at;
    eventually("protection period over", Duration::from_secs(5), || async {
        (started.elapsed().unwrap_or_default() > Duration::from_secs(2)).then_some(())
    })
    .await;
    load.store(0, Ordering::SeqCst);
    let dropped = tokio::time::Instant::now();
    // Within the window the earlier recommendation of 2 holds.
    let until = dropped + Duration::from_millis(1200);
    tenant_pods_hold(
        &sim,
        "surfer",
        until,
        |n| n == 2,
        "stabilized at the window maximum",
    )
    .await;
    tenant_pods_reach(&sim, "surfer", 1, Duration::from_secs(10)).await;
    // The last recommendation of 2 was made at most one heartbeat period plus
    // one tick (about 400 ms) before the drop; it expires 2 s after that.
    assert!(
        dropped.elapsed() >= Duration::from_millis(1500),
        "not before the window expired"
    );
    stop.cancel();
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn template_rollout_replaces_stale_instances_one_for_one() {
    let sim = Sim::with_pool("roll", 2).await;
    let mut ctl = Ctl::single(&sim).await;
    let f = function("roll", "rider", 2);
    let stop = keep_alive(&ctl, &f, Arc::new(AtomicU32::new(0)));
    let inst = ctl.instance(&f, Duration::from_secs(10)).await;
    let old_rs = inst.replica_set.clone().unwrap();
    sim.patch_pool(
        "roll",
        json!({"spec": {"template": {"metadata": {"annotations": {"rollout": "2"}}}}}),
    )
    .await;
    let replaced = skipper_test_support::try_eventually(
        "replacement from the new ReplicaSet",
        Duration::from_secs(30),
        || async {
            let pods = sim.tenant_pods("rider").await;
            assert!(pods.len() <= 3, "never more than max_instances + 1");
            let rs = |p: &Pod| {
                p.metadata
                    .annotations
                    .as_ref()?
                    .get("skipper/replica-set")
                    .cloned()
            };
            (pods.len() == 1 && rs(&pods[0]).is_some_and(|r| r != old_rs)).then(|| pods[0].clone())
        },
    )
    .await;
    let replaced = match replaced {
        Ok(pod) => pod,
        Err(e) => panic!(
            "{e} (old ReplicaSet {old_rs})\n{}",
            rollout_state(&sim, &ctl).await
        ),
    };
    assert_ne!(replaced.metadata.name, inst.name);
    assert!(recorded(&ctl, EventType::StaleReplacement, None));
    stop.cancel();
    ctl.stop().await;
}

/// The namespace's pods and ReplicaSets and the controller's events, for a
/// rollout test's failure message.
async fn rollout_state(sim: &Sim<'_>, ctl: &Ctl) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let pods = Api::<Pod>::namespaced(sim.client.clone(), NS)
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for p in pods {
        let owner = p
            .metadata
            .owner_references
            .iter()
            .flatten()
            .next()
            .map(|o| o.name.clone());
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let _ = writeln!(
            out,
            "pod {} owner={owner:?} labels={:?} phase={:?} ready={ready} deleting={}",
            p.metadata.name.unwrap_or_default(),
            p.metadata.labels.unwrap_or_default(),
            p.status.and_then(|s| s.phase),
            p.metadata.deletion_timestamp.is_some(),
        );
    }
    let sets = Api::<k8s_openapi::api::apps::v1::ReplicaSet>::namespaced(sim.client.clone(), NS)
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for rs in sets {
        let _ = writeln!(
            out,
            "replica set {} desired={:?} observed={:?}",
            rs.metadata.name.unwrap_or_default(),
            rs.spec.and_then(|s| s.replicas),
            rs.status.map(|s| s.replicas),
        );
    }
    for e in ctl.core.cluster.events.snapshot().iter() {
        let _ = writeln!(out, "event {:?}: {}", e.kind, e.message);
    }
    out
}

/// Waits until the supervisor of `f` has started `n` converge ticks after
/// this call: every tick but the last has then also finished acting.
async fn ticks(ctl: &Ctl, f: &Function, n: usize) {
    let mut seen = SystemTime::now();
    for _ in 0..n {
        let after = seen;
        seen = eventually("a converge tick", Duration::from_secs(10), || async move {
            let at = ctl
                .core
                .supervisors
                .get(f.id())?
                .shared
                .recommendations()
                .last()?
                .at;
            (at > after).then_some(at)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scale_only_change_keeps_a_warm_tenants_pod_and_a_metadata_change_replaces_it() {
    let sim = Sim::start().await;
    sim.deploy_pool("keep", 3, &[]).await;
    sim.wait_pool("keep", 3, Duration::from_secs(20)).await;
    let mut ctl = Ctl::single(&sim).await;
    let one = function("keep", "warm", 1);
    let first = ctl.instance(&one, Duration::from_secs(10)).await.name.unwrap();
    // Two callers send the tenant's header with different scale blocks:
    // the supervisor's spec changes with every other heartbeat.
    let two = function("keep", "warm", 2);
    let again = ctl.instance(&two, Duration::from_secs(10)).await.name.unwrap();
    assert_eq!(again, first, "a warm tenant answers with its pod");
    let stop_one = keep_alive(&ctl, &one, Arc::new(AtomicU32::new(0)));
    let stop_two = keep_alive(&ctl, &two, Arc::new(AtomicU32::new(0)));
    ticks(&ctl, &one, 6).await;
    let pods: Vec<_> = sim
        .tenant_pods("warm")
        .await
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(pods, std::slice::from_ref(&first), "the same pod serves");
    assert!(
        !recorded(&ctl, EventType::StaleReplacement, None),
        "no stale replacement for a scale change"
    );
    stop_one.cancel();
    stop_two.cancel();
    // New metadata: the pod was assigned with the old one.
    let mut relabelled = two.clone();
    relabelled.metadata = Some("m2".into());
    let stop = keep_alive(&ctl, &relabelled, Arc::new(AtomicU32::new(0)));
    let replacement = eventually("the pod replaced", Duration::from_secs(30), || async {
        let pods = sim.tenant_pods("warm").await;
        assert!(pods.len() <= 3, "never more than max_instances + 1");
        (pods.len() == 1 && pods[0].metadata.name.as_ref() != Some(&first)).then(|| pods[0].clone())
    })
    .await;
    assert!(recorded(&ctl, EventType::StaleReplacement, None));
    let annotation = replacement
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("skipper/function"))
        .cloned()
        .unwrap_or_default();
    assert!(
        annotation.contains("m2"),
        "assigned with the new metadata: {annotation}"
    );
    stop.cancel();
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stuck_instance_is_cleaned_up() {
    let sim = Sim::with_pool("stuck", 2).await;
    let ctl = Ctl::single(&sim).await;
    let f = function("stuck", "frozen", 1);
    // Claim a pod the way a controller that crashed before the assign
    // request would have left it: assigned an hour ago, never ready.
    let victim = sim.free_pods("stuck").await[0].clone();
    claim(&sim, &f, &victim, SystemTime::now() - Duration::from_secs(3600)).await;
    // The first heartbeat must find the claim in the controller's pod cache:
    // a tick that saw the heartbeat but not the claim would assign a second
    // pod, and with two instances (scaling down) the start-up protection
    // period holds the stuck cleanup back for 30 s.
    sim.caught_up().await;
    let stop = keep_alive(&ctl, &f, Arc::new(AtomicU32::new(0)));
    // The event is recorded once the delete has returned, which may be after
    // the test already sees the pod gone: wait for both.
    let message = format!("terminated stuck instance {victim}");
    eventually(
        "stuck pod deleted and its event",
        Duration::from_secs(10),
        || async {
            let event = recorded(&ctl, EventType::StuckInstanceCleanup, Some(message.as_str()));
            (event && sim.live_pod(&victim).await.is_none()).then_some(())
        },
    )
    .await;
    // The function is served by a fresh instance.
    eventually("fresh instance", Duration::from_secs(10), || async {
        let pods = sim.tenant_pods("frozen").await;
        (pods.len() == 1 && pods[0].metadata.name.as_deref() != Some(victim.as_str())).then_some(())
    })
    .await;
    stop.cancel();
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oneshot_gets_a_pod_per_request_and_release_deletes_it() {
    let sim = Sim::with_pool("once", 3).await;
    let mut ctl = Ctl::single(&sim).await;
    let mut f = function("once", "burst", 5);
    f.oneshot = Some(true);
    let mut names = Vec::new();
    for _ in 0..2 {
        let inst = ctl.instance(&f, Duration::from_secs(10)).await;
        names.push(inst);
    }
    assert_ne!(names[0].name, names[1].name, "one pod per request");
    for inst in &names {
        release(&mut ctl, Some(inst.clone())).await.unwrap();
        pod_gone(&sim, inst.name.as_deref().unwrap(), Duration::from_secs(5)).await;
        // Idempotent.
        release(&mut ctl, Some(inst.clone())).await.unwrap();
    }
    // A pool pod is not Skipper-assigned: refused.
    let pool_pod = sim.free_pods("once").await[0].clone();
    let pool_instance = api::Instance {
        function: Some((&f).into()),
        name: Some(pool_pod.clone()),
        ..Default::default()
    };
    let err = release(&mut ctl, Some(pool_instance)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(sim.live_pod(&pool_pod).await.is_some());
    let err = release(&mut ctl, None).await.unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::InvalidArgument, "missing instance name or namespace")
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_ready_instance_at_max_plus_one_waits_instead_of_spinning() {
    let sim = Sim::with_pool("full", 3).await;
    let mut ctl = Ctl::single(&sim).await;
    let f = function("full", "jammed", 1);
    // Two claimed, never-ready instances (max 1 → max + 1 = 2 exist).
    for pod in sim.free_pods("full").await.into_iter().take(2) {
        claim(&sim, &f, &pod, SystemTime::now()).await;
    }
    sim.caught_up().await;
    let started = tokio::time::Instant::now();
    let err = ctl.refusal(&f, Duration::from_millis(800)).await;
    // The server's DEADLINE_EXCEEDED and the client's own timer (tonic
    // enforces grpc-timeout too) end the call at the same moment; on a
    // loaded machine either may come first. Both mean it waited.
    assert!(
        err.code() == Code::DeadlineExceeded
            || (err.code() == Code::Cancelled && err.message().contains("Timeout expired")),
        "{err:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(600));
    let assigned = counted(&ctl, "full", |m, f| m.assignments_total.get_or_create(f).get());
    assert_eq!(assigned, 0, "the max + 1 rule held");
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn discovery_deletes_tenant_pods_without_a_valid_function() {
    let sim = Sim::with_pool("junk", 2).await;
    let ctl = Ctl::single(&sim).await;
    let victim = sim.free_pods("junk").await[0].clone();
    Api::<Pod>::namespaced(sim.client.clone(), NS)
        .patch(
            &victim,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"skipper/tenant": "nobody"},
                                  "annotations": {"skipper/function": "{not json"}}})),
        )
        .await
        .unwrap();
    pod_gone(&sim, &victim, Duration::from_secs(5)).await;
    assert!(ctl.core.supervisors.is_empty());
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_metrics_drive_memory_scaling() {
    let sim = Sim::with_pool("mem", 3).await;
    let mut ctl = Ctl::single(&sim).await;
    // Every fixture process uses more than 1 MiB, so a 1 MiB target wants
    // more instances than max_instances allows.
    let mut f = function("mem", "hungry", 2);
    f.scale.as_mut().unwrap().target_memory_usage_mib = Some(1);
    let stop = keep_alive(&ctl, &f, Arc::new(AtomicU32::new(0)));
    ctl.grpc
        .get_instance(get_instance(&f, Duration::from_secs(10)))
        .await
        .unwrap();
    eventually(
        "memory-driven scale up to max",
        Duration::from_secs(20),
        || async { (sim.tenant_pods("hungry").await.len() == 2).then_some(()) },
    )
    .await;
    let state = ctl.local_state().await;
    let sup = state
        .supervisors
        .iter()
        .find(|s| s.function.as_ref().and_then(|f| f.tenant.as_deref()) == Some("hungry"))
        .unwrap();
    assert!(
        sup.instances.iter().any(|i| i.memory_usage_mib.unwrap_or(0) > 0),
        "instances report their memory from metrics.k8s.io"
    );
    stop.cancel();
    ctl.stop().await;
}
