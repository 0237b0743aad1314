//! The router's warm path against a fake controller that serves
//! `WatchInstances`: local choice without controller calls, power of two
//! choices, draining, stream loss and re-subscription, idle unsubscription,
//! and `421 Misdirected Request` handling with the body intact.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use harness::{
    FakeController, echo_of, echoed_header, pattern_body, start_router, start_upstream, test_config,
};
use reqwest::Method;
use skipper::domain::{HEADER_INSTANCE, HEADER_TENANT};
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(10);

struct World {
    fake: FakeController,
    router: harness::RouterHandle,
    _stop: CancellationToken,
}

/// A router whose fake controller streams `instances`; heartbeats every
/// second so the function stays active between requests.
async fn world(instances: &[(&str, SocketAddr)], tweak: impl FnOnce(&mut skipper::router::Config)) -> World {
    let fake = FakeController::new();
    fake.enable_streams();
    for (name, addr) in instances {
        fake.add_instance(name, *addr);
    }
    let stop = CancellationToken::new();
    let ctrl = fake.serve(stop.clone()).await;
    let mut config = test_config(vec![ctrl]);
    config.heartbeat_interval = Duration::from_secs(1);
    tweak(&mut config);
    let router = start_router(config).await;
    World {
        fake,
        router,
        _stop: stop,
    }
}

/// A [`world`] whose one instance, `pod-1`, is a test upstream of its own.
async fn world_of_one(tweak: impl FnOnce(&mut skipper::router::Config)) -> World {
    let up = start_upstream().await;
    world(&[("pod-1", up.addr)], tweak).await
}

impl World {
    async fn get(&self, path: &str) -> reqwest::Response {
        self.router.get(path).await
    }

    /// The instance the upstream echo says the router named.
    async fn instance_of(&self, path: &str) -> String {
        let echo = echo_of(self.get(path).await).await;
        let mut named = echoed_header(&echo, HEADER_INSTANCE);
        assert_eq!(named.len(), 1, "the router names the instance once: {named:?}");
        named.remove(0)
    }

    /// Sends requests until one is served from the table (no GetInstance).
    async fn warm_up(&self) {
        tokio::time::timeout(LIMIT, async {
            loop {
                let before = self.fake.calls("GetInstance");
                assert_eq!(self.get("/warm").await.status(), 200);
                if self.fake.calls("GetInstance") == before {
                    return;
                }
            }
        })
        .await
        .expect("the table did not become warm");
    }

    async fn metric(&self, line_prefix: &str) -> f64 {
        self.router.metric(line_prefix).await
    }
}

#[tokio::test]
async fn warm_requests_are_routed_without_controller_calls() {
    let w = world_of_one(|_| {}).await;
    w.warm_up().await;
    let calls = w.fake.calls("GetInstance");
    let counted = w.metric("skipper_router_controller_calls_total").await;
    assert!(counted >= 1.0, "the cold request is counted");
    for _ in 0..50 {
        let resp = w.get("/x").await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-skipper-get-instance-duration-ms"], "0");
    }
    assert_eq!(w.fake.calls("GetInstance"), calls, "no GetInstance while warm");
    assert_eq!(w.metric("skipper_router_controller_calls_total").await, counted);
    let subs = w.fake.with(|s| s.subscriptions.clone());
    assert_eq!(subs.len(), 1, "one stream per function");
    assert_eq!(subs[0].router_ip.as_deref(), Some("10.1.2.3"));
    assert_eq!(subs[0].function.as_ref().unwrap().tenant.as_deref(), Some("t1"));
    w.router.stop().await;
}

#[tokio::test]
async fn the_router_names_the_instance_and_tenant_and_drops_client_copies() {
    let w = world_of_one(|_| {}).await;
    let resp = w
        .router
        .request(Method::GET, "/x")
        .header(HEADER_INSTANCE, "spoofed")
        .header(HEADER_TENANT, "someone-else")
        .send()
        .await
        .unwrap();
    let echo = echo_of(resp).await;
    assert_eq!(echoed_header(&echo, HEADER_INSTANCE), ["pod-1"]);
    assert_eq!(echoed_header(&echo, HEADER_TENANT), ["t1"]);
    w.router.stop().await;
}

#[tokio::test]
async fn two_choices_send_new_requests_to_the_less_busy_instance() {
    let a = start_upstream().await;
    let b = start_upstream().await;
    let w = world(&[("pod-a", a.addr), ("pod-b", b.addr)], |_| {}).await;
    w.warm_up().await;
    // One request stays in flight on whichever instance it lands on.
    let blocked = w.router.get_in_background("/block");
    tokio::time::timeout(LIMIT, async {
        loop {
            if *a.arrived.borrow() + *b.arrived.borrow() == 1 {
                return;
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    let busy = if *a.arrived.borrow() == 1 {
        "pod-a"
    } else {
        "pod-b"
    };
    // With two instances both are always compared: the idle one wins.
    for _ in 0..20 {
        assert_ne!(w.instance_of("/x").await, busy);
    }
    a.open();
    b.open();
    assert_eq!(blocked.await.unwrap(), 200);
    w.router.stop().await;
}

#[tokio::test]
async fn a_draining_instance_gets_no_new_requests_and_is_reported_idle_once_its_last_ends() {
    let a = start_upstream().await;
    let b = start_upstream().await;
    let w = world(&[("pod-a", a.addr)], |_| {}).await;
    w.warm_up().await;
    let blocked = w.router.get_in_background("/block");
    a.wait_arrived(1).await;
    w.fake.with(|s| {
        s.instances.push(skipper::api::Instance {
            name: Some("pod-b".into()),
            addr: Some(b.addr.to_string()),
            ..Default::default()
        });
        s.draining.insert("pod-a".into());
    });
    // From the moment the change arrives, pod-a takes no new request.
    tokio::time::timeout(LIMIT, async { while w.instance_of("/x").await != "pod-b" {} })
        .await
        .unwrap();
    let calls = w.fake.calls("GetInstance");
    for _ in 0..20 {
        assert_eq!(w.instance_of("/x").await, "pod-b");
    }
    assert_eq!(w.fake.calls("GetInstance"), calls);
    assert!(
        w.fake.with(|s| s.idle_reports.is_empty()),
        "pod-a still has a request in flight"
    );
    a.open();
    assert_eq!(blocked.await.unwrap(), 200);
    w.fake
        .wait_until(LIMIT, |s| s.idle_reports == ["pod-a".to_owned()])
        .await;
    w.router.stop().await;
}

#[tokio::test]
async fn a_lost_stream_falls_back_to_get_instance_and_an_aborted_one_resubscribes_at_once() {
    let w = world_of_one(|c| c.heartbeat_interval = Duration::from_secs(5)).await;
    w.warm_up().await;

    // The controller moved the function: the router subscribes again.
    w.fake.end_streams(tonic::Code::Aborted);
    w.fake.wait_until(LIMIT, |s| s.subscriptions.len() == 2).await;
    w.warm_up().await;

    // The stream fails and the controller refuses new ones for a while:
    // requests ask GetInstance (the per-request fallback), and succeed.
    w.fake.fail("WatchInstances", tonic::Code::Unavailable, 2);
    w.fake.end_streams(tonic::Code::Unavailable);
    // The router noticed (it marks the table down before it asks again).
    w.fake
        .wait_until(LIMIT, |s| s.called("WatchInstances") >= 3)
        .await;
    let calls = w.fake.calls("GetInstance");
    let resp = w.get("/x").await;
    assert_eq!(resp.status(), 200);
    assert!(
        w.fake.calls("GetInstance") > calls,
        "the fallback asked the controller"
    );
    // After the refusals the router subscribes again and the table is warm.
    w.fake
        .wait_until(LIMIT, |s| s.called("WatchInstances") >= 5)
        .await;
    w.warm_up().await;
    w.router.stop().await;
}

#[tokio::test]
async fn a_controller_without_the_stream_is_asked_per_request_and_not_hammered() {
    let w = world_of_one(|_| {}).await;
    w.fake.with(|s| s.streams = false);
    for _ in 0..20 {
        assert_eq!(w.get("/x").await.status(), 200);
    }
    assert_eq!(w.fake.calls("GetInstance"), 20);
    assert_eq!(
        w.fake.calls("WatchInstances"),
        1,
        "UNIMPLEMENTED is not asked again at once"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn an_idle_function_unsubscribes() {
    let w = world_of_one(|c| c.heartbeat_interval = Duration::from_millis(50)).await;
    assert_eq!(w.get("/x").await.status(), 200);
    w.fake.wait_until(LIMIT, |s| s.subscriptions.len() == 1).await;
    // Three heartbeat intervals without a request: the function is
    // forgotten and its stream closed.
    w.fake.wait_until(LIMIT, |s| s.open_streams == 0).await;
    assert_eq!(w.get("/x").await.status(), 200);
    w.fake.wait_until(LIMIT, |s| s.subscriptions.len() == 2).await;
    w.router.stop().await;
}

/// An instance that answers every request `421 Misdirected Request`;
/// `read_body` makes it read the whole request body first.
async fn misdirected_instance(read_body: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    use axum::body::Body;
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let app = axum::Router::new().fallback(move |body: Body| {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            if read_body {
                let _ = axum::body::to_bytes(body, usize::MAX).await;
            }
            (http::StatusCode::MISDIRECTED_REQUEST, "not this instance")
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, hits)
}

#[tokio::test]
async fn an_instance_answering_421_is_excluded_and_the_request_succeeds_elsewhere_with_its_body() {
    // From the controller (no stream): the 421 instance comes first.
    let up = start_upstream().await;
    let (wrong, hits) = misdirected_instance(false).await;
    let w = world(&[("pod-wrong", wrong), ("pod-1", up.addr)], |c| {
        c.max_round_trip_attempts = 3;
    })
    .await;
    w.fake.with(|s| s.streams = false);
    let body = pattern_body(32 * 1024);
    w.router.upload(Method::POST, &body).await;
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    assert_eq!(w.fake.exclusions(), [vec![], vec!["pod-wrong".to_owned()]]);
    w.router.stop().await;

    // From the table: whichever instance is picked, every request succeeds
    // with its body, and a misdirected one goes to the other instance.
    let (wrong, hits) = misdirected_instance(true).await;
    let w = world(&[("pod-wrong", wrong), ("pod-1", up.addr)], |_| {}).await;
    w.warm_up().await;
    let calls = w.fake.calls("GetInstance");
    for i in 0..30 {
        let body = pattern_body(1000 + i * 100);
        w.router.upload(Method::PUT, &body).await;
    }
    assert!(
        hits.load(Ordering::SeqCst) > 0,
        "the 421 instance was chosen at least once"
    );
    assert_eq!(w.fake.calls("GetInstance"), calls, "retried from the table");
    w.router.stop().await;
}

#[tokio::test]
async fn a_421_after_more_body_than_is_kept_is_a_503() {
    let (wrong, _) = misdirected_instance(true).await;
    let up = start_upstream().await;
    let w = world(&[("pod-wrong", wrong), ("pod-1", up.addr)], |_| {}).await;
    w.fake.with(|s| s.streams = false);
    let body = pattern_body(skipper::router::proxy::replay::MAX_REPLAY_BYTES + 1);
    let resp = w
        .router
        .request(Method::POST, "/upload")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let text = resp.text().await.unwrap();
    assert!(text.contains("larger than the 65536 bytes kept"), "{text}");
    assert!(text.contains("pod-wrong"), "{text}");
    w.router.stop().await;
}
