//! Per-instance concurrency and bounded, fair waiting: a function at its
//! `max_in_flight_requests` queues and then serves; a full queue is
//! answered 503 with `Retry-After` at once; a burst of first requests for
//! many tenants shares the router's waiting places fairly and leaves
//! nothing behind.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::router as harness;

use std::collections::BTreeMap;
use std::time::Duration;

use harness::{FakeController, World, start_router, start_upstream, test_config};
use reqwest::Method;
use skipper::domain::HEADER_FUNCTION;
use skipper_test_support::http;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(10);

fn limited(tenant: &str, limit: u32) -> String {
    format!(
        r#"{{"namespace":"ns","deployment":"app","tenant":"{tenant}","scale":{{"max_instances":1,"max_in_flight_requests":{limit}}}}}"#
    )
}

/// A router whose fake controller streams its one instance, `pod-1` (the
/// test upstream); `tweak` adjusts the router's config.
async fn streaming_world(tweak: impl FnOnce(&mut skipper::router::Config)) -> World {
    let w = harness::world(tweak).await;
    w.fake.enable_streams();
    w
}

/// `n` requests of `header`'s function to `/block`, each on a task of its
/// own.
fn blocked_requests(
    router: &harness::RouterHandle,
    header: &str,
    n: usize,
) -> Vec<tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>> {
    (0..n)
        .map(|_| tokio::spawn(router.request_as(Method::GET, "/block", header).send()))
        .collect()
}

/// Waits (bounded) until `header`'s function is warm: the table is live
/// once a request is served without a GetInstance call.
async fn warm(router: &harness::RouterHandle, fake: &FakeController, header: &str) {
    skipper_test_support::eventually("a warm table", LIMIT, || async {
        let before = fake.calls("GetInstance");
        let r = router.get_as("/hello", header).await;
        assert_eq!(r.status(), 200);
        (fake.calls("GetInstance") == before).then_some(())
    })
    .await;
}

/// Waits (bounded) until the router metric `name` reads `want`.
async fn metric_reaches(router: &harness::RouterHandle, name: &str, want: f64) {
    skipper_test_support::eventually(&format!("{name} = {want}"), LIMIT, || async {
        ((router.metric(name).await - want).abs() < f64::EPSILON).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_function_at_its_concurrency_limit_queues_then_serves() {
    let World {
        fake,
        router,
        upstream,
        ..
    } = streaming_world(|_| {}).await;
    let header = limited("t1", 2);
    warm(&router, &fake, &header).await;

    let requests = blocked_requests(&router, &header, 5);
    // Two reach the instance; three wait in the router.
    upstream.wait_arrived(2).await;
    metric_reaches(&router, "skipper_router_requests_waiting", 3.0).await;
    assert_eq!(*upstream.arrived.borrow(), 2, "the limit holds the others back");
    assert_eq!(
        router.metric("skipper_router_requests_in_flight").await,
        5.0,
        "queued requests count as in flight"
    );
    upstream.open();
    for r in requests {
        let r = r.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "unblocked");
    }
    assert_eq!(*upstream.arrived.borrow(), 5, "every queued request was served");
    assert_eq!(upstream.peak(), 2, "never more than the limit at the instance");
    metric_reaches(&router, "skipper_router_requests_waiting", 0.0).await;
    router.stop().await;
}

#[tokio::test]
async fn a_full_queue_answers_503_with_retry_after_at_once() {
    let World {
        fake,
        router,
        upstream,
        ..
    } = streaming_world(|c| c.waiting.per_function = 2).await;
    let header = limited("t1", 1);
    warm(&router, &fake, &header).await;

    // One at the instance, two queued (the function's bound).
    let held = blocked_requests(&router, &header, 3);
    upstream.wait_arrived(1).await;
    metric_reaches(&router, "skipper_router_requests_waiting", 2.0).await;
    // The queue is full: answered while the instance is still blocked.
    for _ in 0..2 {
        let r = router.get_as("/block", &header).await;
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
        let body = r.text().await.unwrap();
        assert!(body.contains("--max-waiting-requests-per-function"), "{body}");
    }
    assert_eq!(*upstream.arrived.borrow(), 1);
    assert_eq!(router.metric("skipper_router_requests_refused_total").await, 2.0);
    upstream.open();
    for r in held {
        assert_eq!(r.await.unwrap().unwrap().status(), 200);
    }
    router.stop().await;
}

#[tokio::test]
async fn a_burst_of_first_requests_for_many_tenants_is_shared_fairly_and_leaves_nothing_behind() {
    const TENANTS: usize = 40;
    const EACH: usize = 8;
    const BOUND: usize = 64;
    let upstream = start_upstream().await;
    // No instance stream: every request asks the controller, and every
    // GetInstance waits (a cold start) until the gate opens.
    let fake = FakeController::new();
    fake.add_instance("pod-1", upstream.addr);
    fake.close_get_instance();
    let stop = CancellationToken::new();
    let ctrl = fake.serve(stop.clone()).await;
    let mut config = test_config(vec![ctrl]);
    config.waiting.total = BOUND;
    config.get_instance_timeout = Duration::from_secs(30);
    let router = start_router(config).await;

    let t0 = Instant::now();
    // Requests answered 503 at least once.
    let refused_once = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut requests = Vec::new();
    for t in 0..TENANTS {
        for _ in 0..EACH {
            let url = router.url("/hello");
            let header = harness::function_header("app", &format!("t{t}"), false);
            let refused_once = refused_once.clone();
            requests.push((
                t,
                tokio::spawn(async move {
                    let c = http();
                    let mut refused = 0;
                    loop {
                        let r = c.get(&url).header(HEADER_FUNCTION, &header).send().await.unwrap();
                        if r.status() == 200 {
                            return (refused, t0.elapsed());
                        }
                        assert_eq!(r.status(), 503);
                        // A client that honours the answer comes back later.
                        let after: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
                        if refused == 0 {
                            refused_once.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        refused += 1;
                        tokio::time::sleep(Duration::from_secs(after)).await;
                    }
                }),
            ));
        }
    }
    // The burst settles: the bound is full and the rest was refused.
    metric_reaches(&router, "skipper_router_requests_waiting", BOUND as f64).await;
    skipper_test_support::eventually("every request waiting or refused", LIMIT, || async {
        (refused_once.load(std::sync::atomic::Ordering::SeqCst) == TENANTS * EACH - BOUND).then_some(())
    })
    .await;
    assert_eq!(
        router.metric("skipper_router_requests_waiting").await,
        BOUND as f64,
        "never more than the bound"
    );
    // One shared GetInstance per tenant: every tenant holds a place.
    fake.wait_until(LIMIT, |s| s.get_instance_requests.len() == TENANTS)
        .await;
    fake.open_get_instance();

    let mut first_served: BTreeMap<usize, Duration> = BTreeMap::new();
    let mut refused_of: BTreeMap<usize, usize> = BTreeMap::new();
    for (t, r) in requests {
        let (refused, at) = r.await.unwrap();
        let e = first_served.entry(t).or_insert(at);
        *e = (*e).min(at);
        *refused_of.entry(t).or_default() += usize::from(refused > 0);
    }
    // Shared max-min fairly: 64 places over 40 tenants are 1 or 2 each.
    for (t, n) in &refused_of {
        assert!(
            (EACH - 2..=EACH - 1).contains(n),
            "tenant {t}: {n} of {EACH} refused"
        );
    }
    let mut waits: Vec<Duration> = first_served.values().copied().collect();
    waits.sort();
    let median = waits[waits.len() / 2];
    let worst = *waits.last().unwrap();
    assert!(
        worst <= median * 2,
        "a tenant waited {worst:?} for its first answer, the median {median:?}"
    );
    // Nothing stays behind.
    metric_reaches(&router, "skipper_router_requests_waiting", 0.0).await;
    router.stop().await;
    stop.cancel();
}
