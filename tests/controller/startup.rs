//! Controller start-up against the simulator: a function namespace the API
//! server refuses is retried while the others are served (and left out with
//! `--skip-forbidden-namespaces`), and gRPC health that says
//! `SERVING` once the caches have synced, before the ring has a member (a
//! controller joins the ring only when its pod is Ready, and readiness is
//! this health).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::Duration;

use harness::{CTL_NS, Ctl, NS, Sim, eventually, function};
use skipper::api;
use skipper::controller::namespace_service;
use skipper::shutdown::Shutdown;
use tokio::net::TcpListener;
use tonic_health::pb::health_check_response::ServingStatus;

/// A second function namespace.
const OTHER: &str = "other";

/// Why the forbidden-namespace tests run on the simulator alone.
const FORBIDS: &str =
    "it forbids a namespace by the simulator's fault injection (the controller runs as the administrator)";

/// Stops a controller this file's test runs by hand (it never becomes
/// Ready, or the test holds its start-up callback): it returns `Ok` within
/// 10 s.
async fn stopped(
    shutdown: &Shutdown,
    task: tokio::task::JoinHandle<Result<(), skipper::controller::RunError>>,
) {
    shutdown.trigger();
    let result = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_namespace_is_retried_while_the_others_are_served_and_served_once_allowed() {
    let Some(sim) = Sim::simulator_only(FORBIDS).await else {
        return;
    };
    sim.deploy_pool("pool", 2, &[]).await;
    sim.cluster().forbid_namespace(OTHER);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = sim.config("127.0.0.1");
    config.function_namespaces = vec![NS.to_owned(), OTHER.to_owned()];
    let mut ctl = Ctl::start(&sim, config, listener).await;
    let other = namespace_service(OTHER);
    // Running and Ready: it serves NS, not OTHER, and says so.
    assert_eq!(
        harness::health_status(addr, "").await,
        Some(ServingStatus::Serving as i32)
    );
    assert_eq!(
        harness::health_status(addr, &namespace_service(NS)).await,
        Some(ServingStatus::Serving as i32)
    );
    assert_eq!(
        harness::health_status(addr, &other).await,
        Some(ServingStatus::NotServing as i32)
    );
    let served = ctl
        .instance(&function("pool", "tenant-a", 1), Duration::from_secs(10))
        .await;
    assert!(served.name.is_some());
    let refused = ctl
        .grpc
        .get_instance(api::GetInstanceRequest {
            function: Some(
                (&skipper::domain::Function {
                    namespace: OTHER.to_owned(),
                    ..function("pool", "tenant-b", 1)
                })
                    .into(),
            ),
            exclude_instance_names: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains(&format!(
            "namespace {OTHER} is not served yet: watch of pods in namespace {OTHER} refused (403 Forbidden)"
        )),
        "{refused:?}"
    );
    // Allowed: the next retry of its watches lists it, and it is served.
    sim.cluster().allow_namespace(OTHER);
    eventually(
        "the namespace served once allowed",
        Duration::from_secs(60),
        || async {
            (harness::health_status(addr, &other).await == Some(ServingStatus::Serving as i32)).then_some(())
        },
    )
    .await;
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_whose_only_namespace_is_forbidden_keeps_running_not_ready_and_skips_it_when_told() {
    let Some(sim) = Sim::simulator_only(FORBIDS).await else {
        return;
    };
    sim.cluster().forbid_namespace(NS);

    // Without the flag: running, alive, not ready; it retries.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = sim.config("127.0.0.1");
    config.port = addr.port();
    let shutdown = Shutdown::new();
    let task = tokio::spawn(skipper::controller::run(
        config,
        sim.client.clone(),
        listener,
        shutdown.clone(),
        |_| {},
    ));
    eventually(
        "the namespace reported not served",
        Duration::from_secs(15),
        || async {
            (harness::health_status(addr, &namespace_service(NS)).await
                == Some(ServingStatus::NotServing as i32))
            .then_some(())
        },
    )
    .await;
    assert_eq!(
        harness::health_status(addr, "").await,
        Some(ServingStatus::NotServing as i32)
    );
    assert_eq!(
        harness::health_status(addr, skipper::controller::LIVENESS_SERVICE).await,
        Some(ServingStatus::Serving as i32)
    );
    assert!(!task.is_finished(), "the controller keeps running");
    sim.cluster().allow_namespace(NS);
    eventually(
        "ready once the namespace is allowed",
        Duration::from_secs(60),
        || async {
            (harness::health_status(addr, "").await == Some(ServingStatus::Serving as i32)).then_some(())
        },
    )
    .await;
    stopped(&shutdown, task).await;
    shutdown.drain(Duration::from_secs(5)).await;

    // With the flag: the controller serves, and the skipped namespace is unmanaged.
    sim.cluster().forbid_namespace(NS);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.skip_forbidden_namespaces = true;
    let mut ctl = Ctl::start(&sim, config, listener).await;
    let f = function("pool", "tenant-a", 1);
    let err = ctl.refusal(&f, Duration::from_secs(10)).await;
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains(NS), "{err:?}");
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_serving_once_caches_sync_before_the_ring_forms() {
    let sim = Sim::start().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = sim.config("127.0.0.1");
    // Ring membership comes from Ready controller pods; there are none yet.
    config.single_controller_mode = false;
    config.hash_ring_wait_time = Duration::from_secs(30);
    config.port = addr.port();
    let shutdown = Shutdown::new();
    let (tx, ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(skipper::controller::run(
        config,
        sim.client.clone(),
        listener,
        shutdown.clone(),
        move |r| {
            let _ = tx.send(r);
        },
    ));
    let running = tokio::time::timeout(Duration::from_secs(10), ready)
        .await
        .expect("ready in time")
        .expect("ready");
    assert_eq!(
        harness::health_status(addr, "").await,
        Some(ServingStatus::Serving as i32)
    );
    assert!(
        running.core.cluster.ring.current().sorted_members().is_empty(),
        "no ring yet"
    );

    // A controller pod becomes Ready: the ring forms.
    sim.controller_pod(CTL_NS, "controller-0").await;
    eventually("the ring has a member", Duration::from_secs(10), || async {
        (!running.core.cluster.ring.current().sorted_members().is_empty()).then_some(())
    })
    .await;
    assert_eq!(
        harness::health_status(addr, "").await,
        Some(ServingStatus::Serving as i32)
    );

    stopped(&shutdown, task).await;
}
