//! Authenticated callers against the simulator: controllers that require a
//! ServiceAccount token with the `skipper-controller` audience, verified by
//! TokenReview; the migration flag; the health service open for probes; an
//! authenticated router served end to end; peers authenticating to each
//! other.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;
use skipper_test_support::router as router_harness;

use std::path::PathBuf;
use std::time::Duration;

use harness::{CTL_NS, Ctl, Sim, eventually, function, get_instance, heartbeat};
use skipper::controller::Config;
use skipper::controller::metrics::AuthFailureLabels;
use skipper::credentials::AUDIENCE;
use skipper::domain::HEADER_FUNCTION;
use tokio::net::TcpListener;
use tonic::Code;

/// A controller configuration as shipped: callers must authenticate.
fn secured(sim: &Sim<'_>, pod_ip: &str) -> Config {
    let mut c = sim.config(pod_ip);
    c.auth.allow_unauthenticated = false;
    c
}

/// Starts a controller on its pod IP once the test's `pool` Deployment
/// exists.
async fn start(sim: &Sim<'_>, config: Config) -> Ctl {
    let listener = TcpListener::bind((config.pod_ip.as_str(), 0)).await.unwrap();
    Ctl::start(sim, config, listener).await
}

/// A cluster with the one-pod `pool` and a [`secured`] controller.
async fn secured_with_pool() -> (Sim<'static>, Ctl) {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    let ctl = start(&sim, secured(&sim, "127.0.0.1")).await;
    (sim, ctl)
}

/// `req` carrying `token`.
fn with<T>(mut req: tonic::Request<T>, token: &str) -> tonic::Request<T> {
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

/// A token written where a projected volume would put it.
fn token_file(name: &str, token: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("skipper-auth-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("token");
    std::fs::write(&path, token).unwrap();
    path
}

fn failures(ctl: &Ctl, reason: &'static str) -> u64 {
    ctl.core
        .cluster
        .metrics
        .authentication_failures_total
        .get_or_create(&AuthFailureLabels { reason })
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_without_a_token_is_unauthenticated_and_health_stays_open() {
    let (_sim, ctl) = secured_with_pool().await;
    let f = function("pool", "t", 1);
    let mut grpc = ctl.grpc.clone();
    let err = grpc
        .get_instance(get_instance(&f, Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("skipper-controller"), "{}", err.message());
    let err = grpc.heartbeat(heartbeat("10.1.1.1", &f, 0)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(
        ctl.core.supervisors.is_empty(),
        "nothing of a refused call is recorded"
    );
    assert_eq!(failures(&ctl, "missing"), 2);
    // Probes need no token.
    assert_eq!(harness::health_status(ctl.addr, "").await, Some(harness::SERVING));
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_for_another_audience_or_service_account_are_refused() {
    let (sim, ctl) = secured_with_pool().await;
    let f = function("pool", "t", 1);
    let mut grpc = ctl.grpc.clone();
    let call = |token: String| {
        let mut grpc = ctl.grpc.clone();
        let req = with(get_instance(&f, Duration::from_secs(5)), &token);
        async move { grpc.get_instance(req).await.unwrap_err() }
    };
    // A router's token for the API server's audience.
    let api_token = sim
        .token(
            CTL_NS,
            "skipper-router",
            "https://kubernetes.default.svc.cluster.local",
        )
        .await;
    let err = call(api_token).await;
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("audience"), "{}", err.message());
    // The right audience, but a ServiceAccount that may not call.
    for (ns, sa) in [(CTL_NS, "intruder"), ("other", "skipper-router")] {
        let err = call(sim.token(ns, sa, AUDIENCE).await).await;
        assert_eq!(err.code(), Code::PermissionDenied, "{ns}/{sa}: {err:?}");
        assert!(
            err.message()
                .contains(&format!("system:serviceaccount:{ns}:{sa} may not call")),
            "{}",
            err.message()
        );
    }
    // Not a token at all, and a forged one (the review refuses it).
    let err = call("nonsense".into()).await;
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let good = sim.token(CTL_NS, "skipper-router", AUDIENCE).await;
    let mut parts: Vec<&str> = good.split('.').collect();
    parts[2] = "AAAA";
    let err = call(parts.join(".")).await;
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    // The router's own token works.
    let ok = grpc
        .get_instance(with(get_instance(&f, Duration::from_secs(10)), &good))
        .await
        .unwrap();
    assert!(ok.into_inner().instance.is_some());
    assert_eq!(failures(&ctl, "forbidden"), 2);
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_migration_flag_admits_callers_without_a_token_and_still_checks_tokens() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    let mut config = secured(&sim, "127.0.0.1");
    config.auth.allow_unauthenticated = true;
    let ctl = start(&sim, config).await;
    let mut grpc = ctl.grpc.clone();
    let f = function("pool", "go-router-tenant", 1);
    grpc.get_instance(get_instance(&f, Duration::from_secs(10)))
        .await
        .unwrap();
    let err = grpc
        .heartbeat(with(
            tonic::Request::new(heartbeat("10.1.1.1", &f, 0)),
            "nonsense",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_authenticated_router_is_served_end_to_end() {
    let (sim, ctl) = secured_with_pool().await;
    let token = sim.token(CTL_NS, "skipper-router", AUDIENCE).await;
    let mut config = router_harness::test_config(vec![ctl.addr]);
    config.get_instance_timeout = Duration::from_secs(15);
    config.controller_token_file = Some(token_file("router", &token));
    let router = router_harness::start_router(config).await;
    let f = function("pool", "served", 1);
    let resp = reqwest::Client::new()
        .get(router.url("/hello"))
        .header(HEADER_FUNCTION, f.to_json())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    assert_eq!(sim.tenant_pods("served").await.len(), 1);
    // The router's heartbeats are admitted too.
    eventually("the router's heartbeat", Duration::from_secs(5), || async {
        let h = ctl.core.supervisors.get(f.id())?;
        (!h.shared.with_heartbeats(|s| s.is_empty())).then_some(())
    })
    .await;
    assert_eq!(failures(&ctl, "missing") + failures(&ctl, "refused"), 0);
    router.stop().await;
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_router_without_its_token_file_does_not_start() {
    let mut config = router_harness::test_config(vec!["127.0.0.1:1".parse().unwrap()]);
    config.controller_token_file = Some(PathBuf::from("/nonexistent/skipper/token"));
    let router = router_harness::start_router(config).await;
    let err = tokio::time::timeout(Duration::from_secs(5), router.done)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("--controller-token-file: failed to read token file"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peer_controllers_authenticate_to_each_other() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 3, &[]).await;
    let peer_token = sim.token(CTL_NS, "skipper-controller", AUDIENCE).await;
    let file = token_file("peer", &peer_token);
    let ring = |ip: &str| {
        let mut c = secured(&sim, ip);
        c.single_controller_mode = false;
        c.token_file = Some(file.clone());
        c
    };
    let (a, b) = sim.ring_of_two(ring).await;
    // A router's heartbeat to A reaches B through A's authenticated forward.
    let router_token = sim.token(CTL_NS, "skipper-router", AUDIENCE).await;
    let f = function("pool", "forwarded", 1);
    a.grpc
        .clone()
        .heartbeat(with(
            tonic::Request::new(heartbeat("10.7.7.7", &f, 3)),
            &router_token,
        ))
        .await
        .unwrap();
    eventually("the forwarded heartbeat on B", Duration::from_secs(5), || async {
        let h = b.core.supervisors.get(f.id())?;
        (h.shared.with_heartbeats(|s| s.combined([]).in_flight) == 3).then_some(())
    })
    .await;
    // GetInstance through either controller: the non-owner forwards Scale.
    for ctl in [&a, &b] {
        let g = function("pool", &format!("via-{}", ctl.addr.ip()), 1);
        ctl.grpc
            .clone()
            .get_instance(with(get_instance(&g, Duration::from_secs(15)), &router_token))
            .await
            .unwrap();
    }
    assert_eq!(failures(&a, "missing") + failures(&b, "missing"), 0);
    a.stop().await;
    b.stop().await;
}
