//! Pod assignment against the simulator: claims, the assign request, tokens,
//! failures, waiting for the pool, and input rejected up front.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::{Duration, SystemTime};

use harness::{Ctl, NS, Sim, eventually, function, get_instance};
use skipper::api;
use skipper::api::controller_service_client::ControllerServiceClient;
use skipper::domain::LABEL_TENANT;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn get_instance_claims_a_pool_pod_and_the_pod_verifies_the_token() {
    let sim = Sim::with_pool("pool", 2).await;
    let mut ctl = Ctl::single(&sim).await;

    let f = function("pool", "tenant-a", 3);
    let inst = ctl.instance(&f, Duration::from_secs(10)).await;
    let name = inst.name.clone().unwrap();
    assert!(inst.ready_at.is_some(), "ready in memory at once");
    assert!(inst.addr.as_deref().unwrap().ends_with(":8888"));
    let pod = sim.live_pod(&name).await.unwrap();
    let labels = pod.metadata.labels.clone().unwrap();
    assert_eq!(labels.get(LABEL_TENANT).map(String::as_str), Some("tenant-a"));
    let ann = pod.metadata.annotations.clone().unwrap();
    assert!(ann.contains_key("skipper/replica-set"));
    assert_eq!(
        skipper::domain::Function::from_json(&ann["skipper/function"]).unwrap(),
        f
    );
    let token = sim.token_of(&name).expect("the fixture accepted a token");
    assert!(token.starts_with("v2.public."));
    let claims = sim.verifying_key().verify(&token, SystemTime::now()).unwrap();
    assert_eq!(claims.sub, "tenant-a");

    // ready-at lands on the pod in the background.
    eventually("ready-at annotation", Duration::from_secs(5), || async {
        let p = sim.live_pod(&name).await?;
        p.metadata.annotations?.get("skipper/ready-at").cloned()
    })
    .await;

    // A second call reuses the ready instance.
    let again = ctl.instance(&f, Duration::from_secs(10)).await;
    assert_eq!(again.name, inst.name);
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn invalid_tenant_and_unmanaged_namespace_are_rejected_at_once() {
    let sim = Sim::start().await;
    let mut ctl = Ctl::single(&sim).await;
    let started = tokio::time::Instant::now();

    let bad_tenant = function("pool", "not a label value!", 1);
    let err = ctl.refusal(&bad_tenant, Duration::from_secs(30)).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().starts_with("invalid function: invalid tenant"),
        "{}",
        err.message()
    );

    let mut missing = function("pool", "t", 1);
    missing.scale = None;
    let err = ctl.refusal(&missing, Duration::from_secs(30)).await;
    assert_eq!(
        (err.code(), err.message()),
        (Code::InvalidArgument, "invalid function: missing scale")
    );

    let mut other = function("pool", "t", 1);
    other.namespace = "other".into();
    let err = ctl.refusal(&other, Duration::from_secs(30)).await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("other"),
        "the message names the namespace: {err:?}"
    );
    let err = ctl
        .grpc
        .scale(api::ScaleRequest {
            function: Some((&other).into()),
            desired_instances: Some(1),
            reason: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // A heartbeat for an unmanaged namespace is accepted but creates nothing.
    ctl.grpc
        .heartbeat(harness::heartbeat("10.1.1.1", &other, 3))
        .await
        .unwrap();
    let err = ctl
        .grpc
        .heartbeat(api::HeartbeatRequest::default())
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::InvalidArgument, "missing router_ip")
    );

    assert!(
        started.elapsed() < Duration::from_secs(2),
        "rejections are immediate"
    );
    assert!(
        ctl.core.supervisors.is_empty(),
        "no supervisor for rejected input"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_assign_deletes_the_pod_and_reports_the_error() {
    let sim = Sim::start().await;
    sim.deploy_pool("broken", 1, &[("SKIPPER_ASSIGN_STATUS", "500")])
        .await;
    sim.deploy_pool("slow", 1, &[("SKIPPER_ASSIGN_DELAY", "30s")])
        .await;
    sim.wait_pool("broken", 1, Duration::from_secs(20)).await;
    sim.wait_pool("slow", 1, Duration::from_secs(20)).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.scale.assign_timeout = Duration::from_millis(500);
    let mut ctl = Ctl::start(&sim, config, listener).await;

    for (deployment, expect) in [("broken", "status=500"), ("slow", "timed out")] {
        let victim = sim.free_pods(deployment).await[0].clone();
        let f = function(deployment, "t1", 1);
        // The answer comes once the failed pod's delete returns, which on a
        // loaded machine can take longer than the assign timeout itself.
        let err = ctl.refusal(&f, Duration::from_secs(10)).await;
        assert_eq!(err.code(), Code::Aborted, "not retried by clients: {err:?}");
        eventually("claimed pod to be deleted", Duration::from_secs(5), || async {
            sim.live_pod(&victim).await.is_none().then_some(())
        })
        .await;
        let events = ctl.core.cluster.events.snapshot();
        assert!(
            events
                .iter()
                .filter(|e| e.message.contains(&victim))
                .all(|e| e.kind == api::EventType::AssignmentFailed),
            "a failed pod is never reported as assigned: {events:?}"
        );
        assert!(
            events
                .iter()
                .any(|e| e.kind == api::EventType::AssignmentFailed && e.message.contains(&victim)),
            "the failure is an event: {events:?}"
        );
        let _ = expect;
    }
    // The direct error text names the cause.
    sim.wait_pool("broken", 1, Duration::from_secs(20)).await;
    let ns = ctl.core.cluster.namespace(NS).unwrap();
    let f = function("broken", "t2", 1);
    let err = ctl
        .core
        .cluster
        .assigner
        .assign(ns, &f, tokio::time::Instant::now() + Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("assign request failed: status=500"),
        "{err}"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn empty_pool_wait_wakes_when_a_pool_pod_becomes_ready() {
    let sim = Sim::start().await;
    let ctl = Ctl::single(&sim).await;
    // The best of three trials: the wake-up is event driven, so one trial
    // not starved by a busy machine shows it. Each trial has its own empty
    // pool (scaling a pool back down would make its claimed pods stale).
    let mut best = Duration::MAX;
    for trial in 0..3 {
        let deployment = format!("empty-{trial}");
        sim.deploy_pool(&deployment, 0, &[]).await;
        let gauge = || {
            ctl.core
                .cluster
                .metrics
                .waiting_for_unassigned_pods
                .get_or_create(&skipper::controller::metrics::Metrics::function(&deployment))
                .get()
        };
        let f = function(&deployment, "waiter", 1);
        let core = ctl.core.clone();
        let waiting = tokio::spawn(async move {
            let ns = core.cluster.namespace(NS).unwrap();
            let r = core
                .cluster
                .assigner
                .assign(ns, &f, tokio::time::Instant::now() + Duration::from_secs(30))
                .await;
            (r, tokio::time::Instant::now())
        });
        eventually("waiting gauge", Duration::from_secs(5), || async {
            (gauge() == 1).then_some(())
        })
        .await;
        // A watch of the pool records when its pod turns Ready.
        let selector = format!("skipper/deployment={deployment}");
        let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(sim.client.clone(), NS);
        let ready_seen = tokio::spawn(async move {
            use futures::StreamExt as _;
            use kube::runtime::WatchStreamExt as _;
            let config = kube::runtime::watcher::Config::default().labels(&selector);
            let mut events = std::pin::pin!(kube::runtime::watcher(pods, config).applied_objects());
            while let Some(event) = events.next().await {
                if event.is_ok_and(|p| harness::pod_ready(&p)) {
                    return tokio::time::Instant::now();
                }
            }
            panic!("the pod watch ended");
        });
        sim.scale_pool(&deployment, 1).await;
        let ready_at = tokio::time::timeout(Duration::from_secs(20), ready_seen)
            .await
            .expect("the pool's pod turns Ready")
            .unwrap();
        let (result, done_at) = waiting.await.unwrap();
        let instance = result.unwrap();
        assert!(instance.ready_at.is_some());
        // The claim (the patch of the pod) completed before the assign
        // request; the assigner reports how long that request took. (The
        // gauge is no completion signal: the controller discovers the
        // claimed pod and its supervisor may claim another while this one
        // is not yet Ready in its cache.)
        let timing = instance.assign_timing.expect("the assigner's timing");
        let claimed_at = done_at - timing.assign;
        best = best.min(claimed_at.saturating_duration_since(ready_at));
    }
    assert!(
        best < Duration::from_millis(100),
        "claim completed {best:?} after the pod became Ready"
    );

    // With no pool pod at all the wait ends at the deadline with an honest code.
    sim.deploy_pool("drained", 0, &[]).await;
    // A client that sends the deadline (`grpc-timeout`) but does not enforce
    // it itself, so the answer comes from the controller: its handler's
    // code, answered 30 ms before the deadline, or — when a loaded machine
    // delays the handler past the deadline — the server's own deadline
    // enforcement (CANCELLED "Timeout expired" from tonic).
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<tonic::body::Body>();
    let mut grpc =
        ControllerServiceClient::with_origin(http, format!("http://{}", ctl.addr).parse().unwrap());
    let asked = Duration::from_millis(300);
    let started = tokio::time::Instant::now();
    let err = grpc
        .get_instance(get_instance(&function("drained", "late", 1), asked))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err.code(), Code::ResourceExhausted | Code::DeadlineExceeded)
            || (err.code() == Code::Cancelled && err.message() == "Timeout expired"),
        "{err:?}"
    );
    assert!(
        took >= asked - Duration::from_millis(30) && took < asked + Duration::from_secs(5),
        "the wait ended {took:?} after a call with a deadline of {asked:?}"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_controllers_claim_concurrently_without_double_assignment() {
    // Twice the pool: half the claims race for pods that replace claimed
    // ones. Every replacement is a real process that must pass its
    // readiness probe, so the last claim waits for all of them: 20 of them
    // keep the race (both controllers claim from one pool at once) within
    // its deadline on a loaded machine, where 50 took up to two minutes.
    const TENANTS: usize = 40;
    const POOL: i32 = 20;
    let sim = std::sync::Arc::new(Sim::start().await);
    sim.deploy_pool("race", POOL, &[]).await;
    sim.wait_pool("race", POOL as usize, Duration::from_secs(60))
        .await;
    // Oneshot functions: any controller assigns them (no ring owner), so
    // both controllers race for the same pool.
    // Waiting for the pool to refill may take a while on a busy machine: the
    // server-side cap on a wait is twice the assign timeout.
    let mut config = sim.config("127.0.0.1");
    config.scale.assign_timeout = Duration::from_secs(60);
    let la = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lb = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = Ctl::start(&sim, config.clone(), la).await;
    let b = Ctl::start(&sim, config, lb).await;

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..TENANTS {
        let mut grpc = if i % 2 == 0 {
            a.grpc.clone()
        } else {
            b.grpc.clone()
        };
        let sim = sim.clone();
        tasks.spawn(async move {
            let mut f = function("race", &format!("tenant-{i}"), 1);
            f.oneshot = Some(true);
            let inst = grpc
                .get_instance(get_instance(&f, Duration::from_secs(120)))
                .await
                .unwrap()
                .into_inner()
                .instance
                .unwrap();
            let pod = inst.name.clone().unwrap();
            let token = sim.token_of(&pod).expect("pod accepted a token");
            let claims = sim.verifying_key().verify(&token, SystemTime::now()).unwrap();
            assert_eq!(
                claims.sub, f.tenant,
                "pod {pod} holds the token of its own tenant"
            );
            // Release at once so the pool's processes stay bounded.
            grpc.release_instance(api::ReleaseInstanceRequest { instance: Some(inst) })
                .await
                .unwrap();
            (f.tenant.clone(), pod)
        });
    }
    let mut seen = std::collections::HashMap::new();
    while let Some(r) = tasks.join_next().await {
        let (tenant, pod) = r.unwrap();
        assert!(
            seen.insert(pod.clone(), tenant).is_none(),
            "pod {pod} assigned twice"
        );
    }
    assert_eq!(seen.len(), TENANTS);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_created_a_moment_ago_is_served() {
    let sim = Sim::start().await;
    let ctl = Ctl::single(&sim).await;
    let mut grpc = ctl.grpc.clone();
    // The request follows the Deployment's creation at once: the caches
    // have seen neither its ReplicaSet nor its pods.
    sim.deploy_pool("fresh", 1, &[]).await;
    let known = ctl
        .core
        .cluster
        .namespace(NS)
        .unwrap()
        .replica_sets
        .knows_deployment("fresh");
    let got = grpc
        .get_instance(get_instance(&function("fresh", "t1", 1), Duration::from_secs(30)))
        .await;
    let instance = got
        .unwrap_or_else(|e| panic!("known to the caches at the call: {known}; {e:?}"))
        .into_inner()
        .instance
        .unwrap();
    assert!(instance.name.is_some_and(|n| n.starts_with("fresh-")));
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_of_an_h2c_pool_says_so_and_others_say_nothing() {
    let sim = Sim::start().await;
    sim.deploy_pool_with("h2", 1, |d| {
        d["spec"]["template"]["metadata"]["annotations"][skipper::domain::ANNOTATION_APP_PROTOCOL] =
            serde_json::json!("kubernetes.io/h2c");
    })
    .await;
    sim.deploy_pool("h1", 1, &[]).await;
    sim.wait_pool("h2", 1, Duration::from_secs(60)).await;
    sim.wait_pool("h1", 1, Duration::from_secs(60)).await;
    let mut ctl = Ctl::single(&sim).await;
    let h2 = ctl
        .instance(&function("h2", "t1", 1), Duration::from_secs(30))
        .await;
    assert_eq!(h2.protocol, Some(api::Protocol::H2c as i32), "{h2:?}");
    // HTTP/1.1 leaves the field out: the wire is what Go controllers send.
    let h1 = ctl
        .instance(&function("h1", "t1", 1), Duration::from_secs(30))
        .await;
    assert_eq!(h1.protocol, None, "{h1:?}");
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_deployment_is_not_found_at_once() {
    let sim = Sim::with_pool("pool", 1).await;
    let ctl = Ctl::single(&sim).await;
    let mut grpc = ctl.grpc.clone();
    let started = tokio::time::Instant::now();
    let err = grpc
        .get_instance(get_instance(&function("nope", "t1", 1), Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("fns/nope"), "{}", err.message());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Heartbeats for it create nothing either.
    grpc.heartbeat(harness::heartbeat("10.1.1.1", &function("nope", "t2", 1), 1))
        .await
        .unwrap();
    assert!(
        ctl.core.supervisors.is_empty(),
        "no supervisor for a made-up deployment"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_deletes_the_pod_whatever_this_controller_has_seen() {
    let sim = Sim::with_pool("pool", 3).await;
    let mut ctl = Ctl::single(&sim).await;
    let ns = ctl.core.cluster.namespace(NS).unwrap().clone();
    let release = |name: &str, f: &skipper::domain::Function| api::ReleaseInstanceRequest {
        instance: Some(api::Instance {
            name: Some(name.to_owned()),
            function: Some(f.into()),
            ..Default::default()
        }),
    };

    // The claim is not in this controller's cache at all.
    let fa = function("pool", "ta", 1);
    let a = ctl.instance(&fa, Duration::from_secs(10)).await.name.unwrap();
    ns.pods.remove(&a);
    ctl.grpc.release_instance(release(&a, &fa)).await.unwrap();
    eventually("released pod to be deleted", Duration::from_secs(5), || async {
        sim.live_pod(&a).await.is_none().then_some(())
    })
    .await;

    // The cache still shows the pool pod the claim was made on.
    let fb = function("pool", "tb", 1);
    let b = ctl.instance(&fb, Duration::from_secs(10)).await.name.unwrap();
    let mut stale = sim.live_pod(&b).await.unwrap();
    stale.metadata.labels.as_mut().unwrap().remove(LABEL_TENANT);
    stale.metadata.annotations = None;
    let rv: u64 = stale.metadata.resource_version.clone().unwrap().parse().unwrap();
    stale.metadata.resource_version = Some((rv + 1_000_000).to_string());
    ns.pods.remove(&b);
    ns.pods.apply(stale, false);
    // Another tenant's name on it is refused and changes nothing.
    let err = ctl
        .grpc
        .release_instance(release(&b, &function("pool", "someone-else", 1)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(sim.live_pod(&b).await.is_some());
    ctl.grpc.release_instance(release(&b, &fb)).await.unwrap();
    eventually("released pod to be deleted", Duration::from_secs(5), || async {
        sim.live_pod(&b).await.is_none().then_some(())
    })
    .await;
    // A pod that is gone is released already.
    ctl.grpc.release_instance(release(&b, &fb)).await.unwrap();
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_that_refuses_every_assignment_backs_off() {
    use skipper::controller::assign::FAILURES_BEFORE_BACKOFF;
    use skipper::controller::metrics::AssignFailureLabels;
    let sim = Sim::start().await;
    sim.deploy_pool("locked", 6, &[("SKIPPER_ASSIGN_STATUS", "401")])
        .await;
    sim.wait_pool("locked", 6, Duration::from_secs(30)).await;
    let ctl = Ctl::single(&sim).await;
    let mut codes = Vec::new();
    for i in 0..10 {
        let mut grpc = ctl.grpc.clone();
        let f = function("locked", &format!("t{i}"), 1);
        let err = grpc
            .get_instance(get_instance(&f, Duration::from_secs(5)))
            .await
            .unwrap_err();
        codes.push(err.code());
        if i >= FAILURES_BEFORE_BACKOFF as usize {
            assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
            assert!(err.message().contains("backing off"), "{}", err.message());
            assert!(err.message().contains("status=401"), "{}", err.message());
        }
    }
    let failures = ctl
        .core
        .cluster
        .metrics
        .assignment_failures_total
        .get_or_create(&AssignFailureLabels {
            function_deployment: "locked".into(),
            status: "401".into(),
            reason: "refused",
        })
        .get();
    assert_eq!(
        failures,
        u64::from(FAILURES_BEFORE_BACKOFF),
        "only the pods before the back-off are lost: {codes:?}"
    );
    let events = ctl.core.cluster.events.snapshot();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == api::EventType::AssignmentFailed)
            .count(),
        FAILURES_BEFORE_BACKOFF as usize
    );
    assert!(events.iter().any(|e| e.message.contains("backs off")));
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_heartbeat_batch_is_refused_whole() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    let ctl = Ctl::single(&sim).await;
    let one = harness::heartbeat("10.1.1.1", &function("pool", "t", 1), 0).heartbeats[0].clone();
    let req = api::HeartbeatRequest {
        router_ip: Some("10.1.1.1".into()),
        heartbeats: vec![one; ctl.core.config.limits.heartbeat_entries + 1],
        forwarded_for: vec![],
    };
    let err = ctl.grpc.clone().heartbeat(req).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("over the limit of 20000"),
        "{}",
        err.message()
    );
    assert!(
        ctl.core.supervisors.is_empty(),
        "nothing of a refused batch is recorded"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_router_keeps_at_most_its_limit_of_functions_active() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.limits.functions_per_router = 3;
    config.limits.heartbeat_routers = 2;
    let ctl = Ctl::start(&sim, config, listener).await;
    let batch = |router: &str, tenants: std::ops::Range<usize>| api::HeartbeatRequest {
        router_ip: Some(router.into()),
        heartbeats: tenants
            .flat_map(|i| harness::heartbeat(router, &function("pool", &format!("t{i}"), 1), 0).heartbeats)
            .collect(),
        forwarded_for: vec![],
    };
    let refused = || {
        ctl.core
            .cluster
            .metrics
            .heartbeats_refused_total
            .get_or_create(&skipper::controller::metrics::HeartbeatRefusedLabels {
                reason: "router-limit",
            })
            .get()
    };
    let mut grpc = ctl.grpc.clone();
    let err = grpc.heartbeat(batch("10.1.1.1", 0..5)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("2 of 5 heartbeat entries refused")
            && err.message().contains("router 10.1.1.1 keeps 3 functions active")
            && err.message().contains("--max-functions-per-router"),
        "{}",
        err.message()
    );
    assert_eq!(ctl.core.supervisors.len(), 3, "no supervisor for a refused entry");
    assert_eq!(refused(), 2);
    // Functions the router already keeps active are refreshed freely.
    grpc.heartbeat(batch("10.1.1.1", 0..3)).await.unwrap();
    // Another router has its own budget.
    grpc.heartbeat(batch("10.1.1.2", 3..6)).await.unwrap();
    assert_eq!(ctl.core.supervisors.len(), 6);
    // A third router is over the number of routers.
    let err = grpc.heartbeat(batch("10.1.1.3", 6..7)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("--max-heartbeat-routers"),
        "{}",
        err.message()
    );
    assert_eq!(ctl.core.supervisors.len(), 6);
    ctl.stop().await;
}
