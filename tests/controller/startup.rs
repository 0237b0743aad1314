//! Controller start-up against the simulator: the per-namespace probe with
//! and without `--skip-forbidden-namespaces`, and gRPC health that says
//! `SERVING` once the caches have synced, before the ring has a member (a
//! controller joins the ring only when its pod is Ready, and readiness is
//! this health).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::Duration;

use harness::{CTL_NS, Ctl, NS, Sim, eventually, function};
use skipper::api;
use skipper::controller::RunError;
use skipper::shutdown::Shutdown;
use tokio::net::TcpListener;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

async fn health_of(addr: std::net::SocketAddr) -> Option<i32> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .ok()?;
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .ok()?;
    Some(resp.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_namespace_fails_start_up_unless_skipped() {
    let Some(sim) = Sim::simulator_only(
        "it forbids a namespace by the simulator's fault injection (the controller runs as the administrator)",
    )
    .await
    else {
        return;
    };
    sim.cluster().forbid_namespace(NS);

    // Without the flag: start-up fails, naming the namespace.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = sim.config("127.0.0.1");
    let shutdown = Shutdown::new();
    let result = tokio::time::timeout(
        Duration::from_secs(15),
        skipper::controller::run(config, sim.client.clone(), listener, shutdown.clone(), |_| {}),
    )
    .await
    .expect("start-up ends");
    let err = result.expect_err("a forbidden namespace is fatal without --skip-forbidden-namespaces");
    assert!(matches!(err, RunError::Start(_)), "{err:?}");
    assert!(
        err.to_string().contains(NS),
        "the error names the namespace: {err}"
    );
    shutdown.drain(Duration::from_secs(5)).await;

    // With the flag: the controller serves, and the skipped namespace is unmanaged.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.skip_forbidden_namespaces = true;
    let mut ctl = Ctl::start(&sim, config, listener).await;
    let f = function("pool", "tenant-a", 1);
    let err = ctl
        .grpc
        .get_instance(api::GetInstanceRequest {
            function: Some((&f).into()),
            exclude_instance_names: vec![],
        })
        .await
        .unwrap_err();
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
    assert_eq!(health_of(addr).await, Some(ServingStatus::Serving as i32));
    assert!(
        running.core.ring.current().sorted_members().is_empty(),
        "no ring yet"
    );

    // A controller pod becomes Ready: the ring forms.
    sim.controller_pod(CTL_NS, "controller-0").await;
    eventually(Duration::from_secs(10), "the ring has a member", || async {
        (!running.core.ring.current().sorted_members().is_empty()).then_some(())
    })
    .await;
    assert_eq!(health_of(addr).await, Some(ServingStatus::Serving as i32));

    shutdown.trigger();
    let result = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
}
