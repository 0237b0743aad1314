//! Any install order reaches Ready with no controller restart: the README's
//! (Skipper, then the pool: the controllers start before their function
//! namespace exists or grants them anything) and the reverse (the pool
//! first). In the README's order the controllers keep running while the
//! namespace is refused: liveness `SERVING`, the namespace's health service
//! `NOT_SERVING`; once the pool's Role is there they serve it.
//!
//! On both backends: the simulator, and the real control plane with the
//! node agent (skipped with a message when `make control-plane` has not
//! built it; a failure under `CI=true`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use skipper::token::SigningKey;
use skipper_test_support::backend::Backend;
use skipper_test_support::{differential, eventually};
use tonic_health::pb::health_check_response::ServingStatus;

use super::steps::{self, CONTROLLERS, POOL_NS, ROUTERS, WAIT};

/// The status of health service `service` of the controller at `ip`.
async fn health(ip: &str, service: &str) -> Option<i32> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{ip}:50051"))
        .ok()?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .ok()?;
    let r = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .ok()?;
    Some(r.into_inner().status)
}

differential!(
    the_readme_order_skipper_before_its_pool_reaches_ready_with_no_restart,
    skipper_first,
    namespaces = [],
    pods
);

async fn skipper_first(b: &Backend) {
    let client = b.client().await;
    let key = SigningKey::generate();
    let begin = Instant::now();
    steps::apply(&client, &steps::platform(&key)).await;
    // Running, alive, and not serving the namespace that is not there yet.
    let controller = eventually("a controller pod with an IP", WAIT, || async {
        steps::pods(&client, "skipper", CONTROLLERS)
            .await
            .iter()
            .find_map(|p| p.status.as_ref()?.pod_ip.clone())
    })
    .await;
    let service = skipper::controller::namespace_service(POOL_NS);
    eventually(
        "the controller reports its function namespace not served",
        WAIT,
        || async {
            let live = health(&controller, skipper::controller::LIVENESS_SERVICE).await?;
            let ns = health(&controller, &service).await?;
            (live == ServingStatus::Serving as i32 && ns == ServingStatus::NotServing as i32).then_some(())
        },
    )
    .await;
    assert_eq!(
        health(&controller, "").await,
        Some(ServingStatus::NotServing as i32),
        "readiness while its only function namespace is refused"
    );
    steps::apply(&client, &steps::pool(&key)).await;
    steps::serve(&client, 2, "first").await;
    assert_eq!(
        health(&controller, &service).await,
        Some(ServingStatus::Serving as i32)
    );
    let restarts = steps::restarts(&client, "skipper", CONTROLLERS).await
        + steps::restarts(&client, "skipper", ROUTERS).await;
    println!(
        "install order skipper, then pool ({}): Ready and serving after {:?}, {restarts} restarts",
        b.name(),
        begin.elapsed()
    );
    assert_eq!(restarts, 0, "controller and router restarts");
}

differential!(
    the_reverse_order_pool_before_skipper_reaches_ready_with_no_restart,
    pool_first,
    namespaces = [],
    pods
);

async fn pool_first(b: &Backend) {
    let client = b.client().await;
    let key = SigningKey::generate();
    let begin = Instant::now();
    steps::apply(&client, &steps::pool(&key)).await;
    steps::apply(&client, &steps::platform(&key)).await;
    steps::serve(&client, 2, "first").await;
    let restarts = steps::restarts(&client, "skipper", CONTROLLERS).await
        + steps::restarts(&client, "skipper", ROUTERS).await;
    println!(
        "install order pool, then skipper ({}): Ready and serving after {:?}, {restarts} restarts",
        b.name(),
        begin.elapsed()
    );
    assert_eq!(restarts, 0, "controller and router restarts");
}
