//! gRPC through the router to a tenant's gRPC server (the fixture's
//! `skipper.fixture.Echo`, in a pool that declares h2c): unary and
//! bidirectional streaming calls with the function header as metadata,
//! large messages, statuses and deadlines passed through, the router's own
//! refusals as gRPC statuses, and a pod killed mid-stream ending the call
//! with `UNAVAILABLE`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use skipper::api::Protocol;
use skipper::domain::HEADER_FUNCTION;
use skipper::fixture::echo::api::echo_client::EchoClient;
use skipper::fixture::echo::api::{EchoReply, EchoRequest};
use skipper::fixture::{Fixture, Settings};
use skipper::shutdown::Shutdown;
use skipper::token::{PodRef, SigningKey, TrustedKeys, Version};
use skipper_test_support::devcluster::{bound_token, function_json, keys};
use skipper_test_support::router::{self as harness, FakeController, RouterHandle, function_header};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const LIMIT: Duration = Duration::from_secs(20);
const TENANT: &str = "t1";

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "skipper-grpc-{tag}-{}-{:x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Assigns the fixture at `addr` (pod `name`) to [`TENANT`].
async fn assign(addr: SocketAddr, key: &SigningKey, name: &str) {
    let pod = PodRef { name, uid: "" };
    let status = reqwest::Client::new()
        .post(format!("http://{addr}/__skipper/assign"))
        .header("X-Skipper-Token", bound_token(key, Version::V2, TENANT, pod))
        .header("X-Skipper-Function", function_json(TENANT))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200, "assigning {name}");
}

/// A router in front of a fake controller whose only instance is an
/// assigned in-process fixture of an h2c pool.
struct World {
    router: RouterHandle,
    fake: FakeController,
    _fixture: Fixture,
    _stop: CancellationToken,
}

/// A router (configured as `tweak` says) in front of a fake controller whose
/// only instance is pod `pod` at `addr`, of an h2c pool. The fake serves
/// until the token is cancelled.
async fn route_to(
    pod: &str,
    addr: SocketAddr,
    tweak: impl FnOnce(&mut skipper::router::Config),
) -> (RouterHandle, FakeController, CancellationToken) {
    let fake = FakeController::new();
    let stop = CancellationToken::new();
    let ctrl = fake.serve(stop.clone()).await;
    fake.add_instance_speaking(pod, addr, Protocol::H2c);
    let mut config = harness::test_config(vec![ctrl]);
    tweak(&mut config);
    (harness::start_router(config).await, fake, stop)
}

async fn world() -> World {
    world_with(|_| {}).await
}

async fn world_with(tweak: impl FnOnce(&mut skipper::router::Config)) -> World {
    let (key, pem) = keys();
    let dir = temp_dir("world");
    let fixture = Fixture::start(
        Settings {
            keys: TrustedKeys::from_pem(&pem).unwrap(),
            addr: "127.0.0.1:0".parse().unwrap(),
            token_path: dir.join("token"),
            assign_delay: Duration::ZERO,
            assign_status: None,
            grpc_health: None,
            pod_name: Some("pod-a".into()),
            pod_uid: None,
            accept_unbound_tokens: false,
        },
        Shutdown::new(),
    )
    .await
    .unwrap();
    assign(fixture.addr(), &key, "pod-a").await;
    let (router, fake, stop) = route_to("pod-a", fixture.addr(), tweak).await;
    World {
        router,
        fake,
        _fixture: fixture,
        _stop: stop,
    }
}

/// An Echo client of `router` for [`TENANT`], reading messages up to 32 MiB.
async fn client(router: SocketAddr) -> EchoClient<Channel> {
    let channel = Channel::from_shared(format!("http://{router}"))
        .unwrap()
        .connect_timeout(LIMIT)
        .connect()
        .await
        .unwrap();
    EchoClient::new(channel).max_decoding_message_size(32 << 20)
}

/// `msg` as a call for [`TENANT`] (the function header as metadata).
fn call<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert(
        HEADER_FUNCTION,
        function_header("app", TENANT, false).parse().unwrap(),
    );
    req
}

fn echo(message: &str) -> EchoRequest {
    EchoRequest {
        message: message.into(),
        ..Default::default()
    }
}

/// A bidirectional call for [`TENANT`] on `c`: the sender of its requests
/// (the call's request stream ends when it is dropped) and its replies.
async fn bidi(c: &mut EchoClient<Channel>) -> (mpsc::Sender<EchoRequest>, tonic::Streaming<EchoReply>) {
    let (tx, rx) = mpsc::channel(4);
    let replies = c
        .bidi(call(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .await
        .unwrap()
        .into_inner();
    (tx, replies)
}

/// Ends the requests of a bidirectional call (drops `tx`) and asserts that
/// the call then ends with OK (within [`LIMIT`]).
async fn ends_ok(tx: mpsc::Sender<EchoRequest>, mut replies: tonic::Streaming<EchoReply>) {
    drop(tx);
    let end = tokio::time::timeout(LIMIT, replies.message()).await.unwrap();
    assert!(matches!(end, Ok(None)), "the call ends with OK: {end:?}");
}

/// The next message of `replies` (within [`LIMIT`]); panics when the call
/// ends or fails instead.
async fn next_reply(replies: &mut tonic::Streaming<EchoReply>) -> EchoReply {
    tokio::time::timeout(LIMIT, replies.message())
        .await
        .expect("a reply within the limit")
        .expect("the call goes on")
        .expect("a reply, not the end of the call")
}

#[tokio::test]
async fn unary_and_bidi_calls_reach_the_tenants_pod() {
    let w = world().await;
    let mut c = client(w.router.addr).await;
    let mut req = call(echo("hello"));
    req.set_timeout(Duration::from_secs(5));
    let reply = c.unary(req).await.unwrap().into_inner();
    assert_eq!(
        (reply.message.as_str(), reply.tenant.as_str(), reply.pod.as_str()),
        ("hello", TENANT, "pod-a")
    );
    // The deadline reaches the pod (gRPC sends what remains of it).
    assert!(
        reply.grpc_timeout.ends_with('u') || reply.grpc_timeout.ends_with('m'),
        "{reply:?}"
    );

    let (tx, mut replies) = bidi(&mut c).await;
    for n in 1..=3u32 {
        // Each reply comes before the next request is sent: the stream is
        // relayed message by message, not buffered to the end.
        tx.send(echo(&format!("m{n}"))).await.unwrap();
        let r = next_reply(&mut replies).await;
        assert_eq!((r.message, r.sequence), (format!("m{n}"), n));
    }
    ends_ok(tx, replies).await;
    w.router.stop().await;
}

#[tokio::test]
async fn a_quiet_client_keeps_its_stream_past_the_body_timeout() {
    // The body bound protects the router before the pod answers; a stream
    // the pod has answered is the pod's to keep.
    let w = world_with(|c| c.body_timeout = Some(Duration::from_millis(300))).await;
    let mut c = client(w.router.addr).await;
    let (tx, mut replies) = bidi(&mut c).await;
    for n in 1..=2u32 {
        tx.send(echo("tick")).await.unwrap();
        assert_eq!(next_reply(&mut replies).await.sequence, n);
        // A pause of three body timeouts: the pace the client keeps is
        // what is under test.
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    ends_ok(tx, replies).await;
    w.router.stop().await;
}

#[tokio::test]
async fn large_messages_pass_both_ways() {
    let w = world().await;
    let mut c = client(w.router.addr).await;
    let big = "y".repeat(3 << 20);
    let reply = c
        .unary(call(EchoRequest {
            message: big.clone(),
            reply_bytes: 12 << 20,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.message.len(), big.len());
    assert_eq!(reply.padding.len(), 12 << 20);
    w.router.stop().await;
}

#[tokio::test]
async fn statuses_and_deadlines_pass_through() {
    let w = world().await;
    let mut c = client(w.router.addr).await;
    // The pod's status and message arrive in its trailers.
    let status = c
        .unary(call(EchoRequest {
            fail_code: tonic::Code::FailedPrecondition as u32,
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert_eq!(status.message(), "fail_code 9 asked");
    // A deadline shorter than the pod's work ends the call at the client.
    let mut req = call(EchoRequest {
        delay_ms: 5_000,
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let status = c.unary(req).await.unwrap_err();
    // tonic's client ends the call at its deadline itself (`CANCELLED`,
    // "Timeout expired"); other clients report `DEADLINE_EXCEEDED`.
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The connection still serves.
    let reply = c.unary(call(echo("after"))).await.unwrap().into_inner();
    assert_eq!(reply.message, "after");
    w.router.stop().await;
}

#[tokio::test]
async fn the_routers_own_refusals_are_grpc_statuses() {
    let w = world().await;
    let mut c = client(w.router.addr).await;
    // No function header: INVALID_ARGUMENT naming it, not an HTTP 400.
    let status = c.unary(tonic::Request::new(echo("x"))).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), "missing X-Skipper-Function");
    // No controller can give an instance: UNAVAILABLE.
    w.fake.with(|s| s.instances.clear());
    let mut req = call(echo("x"));
    req.metadata_mut().insert(
        HEADER_FUNCTION,
        function_header("other", TENANT, false).parse().unwrap(),
    );
    let status = c.unary(req).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("no capacity"), "{status:?}");
    w.router.stop().await;
}

/// A `skipper fixture` process on a free loopback port, pod `pod-k`.
struct FixtureProcess {
    child: tokio::process::Child,
    addr: SocketAddr,
}

async fn fixture_process(pem: &str) -> FixtureProcess {
    let dir = temp_dir("process");
    std::fs::write(dir.join("key.pem"), pem).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = tokio::process::Command::new(skipper_test_support::skipper_exe())
        .arg("fixture")
        .env("SKIPPER_PUBLIC_KEY_FILE", dir.join("key.pem"))
        .env("SKIPPER_FIXTURE_PORT", port.to_string())
        .env("SKIPPER_FIXTURE_TOKEN_PATH", dir.join("token"))
        .env("SKIPPER_HOST", "127.0.0.1")
        .env("SKIPPER_POD_NAME", "pod-k")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    skipper_test_support::eventually("the fixture process serves", LIMIT, || async move {
        let r = reqwest::get(format!("http://{addr}/healthz")).await;
        r.ok().filter(|r| r.status() == 200).map(|_| ())
    })
    .await;
    FixtureProcess { child, addr }
}

#[tokio::test]
async fn a_pod_killed_mid_stream_ends_the_call_with_unavailable() {
    let (key, pem) = keys();
    let mut pod = fixture_process(&pem).await;
    assign(pod.addr, &key, "pod-k").await;
    let (router, _fake, _stop) = route_to("pod-k", pod.addr, |_| {}).await;
    let mut c = client(router.addr).await;
    let (tx, mut replies) = bidi(&mut c).await;
    tx.send(echo("before")).await.unwrap();
    assert_eq!(next_reply(&mut replies).await.pod, "pod-k");
    pod.child.kill().await.unwrap();
    let end = tokio::time::timeout(LIMIT, replies.message())
        .await
        .expect("the call ends, it does not hang");
    let status = end.expect_err("the call fails");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("pod-k"), "{status:?}");
    drop(tx);
    router.stop().await;
}
