//! The controller client against a fake `ControllerService` on 127.0.0.1:0:
//! per-method retry policies, deadlines and endpoint spreading.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::net::SocketAddr;
use std::time::Duration;

use harness::FakeController;
use skipper::api;
use skipper::client::{ChannelSettings, Client, Endpoints, Error};
use tokio_util::sync::CancellationToken;
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(5);

/// A fake controller whose GetInstance answers `pod`, serving on a fresh
/// port until the token is cancelled.
async fn serving(pod: &str) -> (FakeController, SocketAddr, CancellationToken) {
    let fake = FakeController::new();
    fake.add_instance(pod, "127.0.0.1:1".parse().unwrap());
    let stop = CancellationToken::new();
    let addr = fake.serve(stop.clone()).await;
    (fake, addr, stop)
}

/// A client of the controllers at `addrs`.
fn client_of(addrs: &[SocketAddr]) -> Client {
    Client::new(Endpoints::fixed(addrs, ChannelSettings::default()))
}

async fn setup() -> (FakeController, Client, CancellationToken) {
    let (fake, addr, stop) = serving("pod-a").await;
    (fake, client_of(&[addr]), stop)
}

fn function() -> api::Function {
    api::Function {
        namespace: Some("ns".into()),
        deployment: Some("dep".into()),
        tenant: Some("t".into()),
        ..Default::default()
    }
}

fn get_instance_req() -> api::GetInstanceRequest {
    api::GetInstanceRequest {
        function: Some(function()),
        exclude_instance_names: vec![],
    }
}

fn heartbeat_req() -> api::HeartbeatRequest {
    api::HeartbeatRequest {
        router_ip: Some("10.0.0.1".into()),
        heartbeats: vec![api::Heartbeat {
            function: Some(function()),
            ..Default::default()
        }],
        forwarded_for: vec![],
    }
}

fn scale_req() -> api::ScaleRequest {
    api::ScaleRequest {
        function: Some(function()),
        desired_instances: Some(1),
        reason: None,
    }
}

fn assert_code(e: &Error, code: Code) {
    assert_eq!(e.code(), code, "{e}");
}

/// One call of `method` (`GetInstance`, `Heartbeat`, `Scale` or
/// `ReleaseInstance`) through `client`.
async fn call(client: &Client, method: &str) -> Result<(), Error> {
    match method {
        "GetInstance" => client.get_instance(get_instance_req(), DEADLINE).await.map(|r| {
            assert_eq!(r.instance.unwrap().name.as_deref(), Some("pod-a"));
        }),
        "Heartbeat" => client.heartbeat(heartbeat_req(), DEADLINE).await.map(drop),
        "Scale" => client.scale(scale_req(), DEADLINE).await.map(drop),
        "ReleaseInstance" => {
            let req = api::ReleaseInstanceRequest {
                instance: Some(api::Instance::default()),
            };
            client.release_instance(req, DEADLINE).await.map(drop)
        }
        other => panic!("no RPC {other}"),
    }
}

#[tokio::test]
async fn each_method_is_tried_up_to_its_attempts_while_unavailable() {
    for (method, attempts) in [
        ("GetInstance", 3),
        ("Heartbeat", 2),
        ("Scale", 3),
        ("ReleaseInstance", 2),
    ] {
        let (fake, client, _stop) = setup().await;
        // One failure fewer than the attempts: the last attempt succeeds.
        fake.fail(method, Code::Unavailable, attempts - 1);
        call(&client, method)
            .await
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        assert_eq!(fake.calls(method), attempts, "{method}");
        // As many failures as attempts: the call fails with the last.
        fake.fail(method, Code::Unavailable, attempts);
        let err = call(&client, method).await.unwrap_err();
        assert_code(&err, Code::Unavailable);
        assert_eq!(fake.calls(method), 2 * attempts, "{method}");
    }
}

#[tokio::test]
async fn other_codes_are_not_retried() {
    let (fake, client, _stop) = setup().await;
    for (i, code) in [
        Code::Internal,
        Code::InvalidArgument,
        Code::ResourceExhausted,
        Code::DeadlineExceeded,
        Code::NotFound,
    ]
    .into_iter()
    .enumerate()
    {
        fake.fail("GetInstance", code, 1);
        let err = client
            .get_instance(get_instance_req(), DEADLINE)
            .await
            .unwrap_err();
        assert_code(&err, code);
        assert_eq!(fake.calls("GetInstance"), i + 1);
    }
}

#[tokio::test]
async fn empty_heartbeat_batch_sends_nothing() {
    let (fake, client, _stop) = setup().await;
    let mut req = heartbeat_req();
    req.heartbeats.clear();
    client.heartbeat(req, DEADLINE).await.unwrap();
    assert_eq!(fake.calls("Heartbeat"), 0);
}

#[tokio::test]
async fn no_endpoints_is_unavailable() {
    let client = Client::new(Endpoints::new(ChannelSettings::default()));
    let err = client
        .get_instance(get_instance_req(), DEADLINE)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NoEndpoints { .. }), "{err}");
    assert_code(&err, Code::Unavailable);
}

#[tokio::test]
async fn unreachable_controller_is_unavailable_and_fails_over_to_the_next() {
    let dead = harness::refused_addr();
    let (_fake, live, _stop) = serving("pod-a").await;

    let only_dead = client_of(&[dead]);
    let err = only_dead
        .get_instance(get_instance_req(), DEADLINE)
        .await
        .unwrap_err();
    assert_code(&err, Code::Unavailable);

    // Round-robin: the retry after the refused connection goes to the live one.
    let both = client_of(&[dead, live]);
    for _ in 0..4 {
        both.get_instance(get_instance_req(), DEADLINE).await.unwrap();
    }
}

#[tokio::test]
async fn a_single_attempt_whose_controller_refuses_the_connection_goes_to_another() {
    let dead = harness::refused_addr();
    let (fake, live, _stop) = serving("pod-a").await;
    // The refusing address is first in the round robin.
    let client = client_of(&[dead, live]);
    for i in 1..=4 {
        let resp = client
            .get_instance_once(get_instance_req(), DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert_eq!(resp.instance.unwrap().name.as_deref(), Some("pod-a"));
        assert_eq!(fake.calls("GetInstance"), i);
    }
    // Only the live controller's answer counts: a refused connection is not
    // an attempt of the method's retry policy.
    let only_dead = client_of(&[dead]);
    let err = only_dead
        .get_instance_once(get_instance_req(), DEADLINE)
        .await
        .unwrap_err();
    assert_code(&err, Code::Unavailable);
    assert!(err.to_string().contains("tcp connect error"), "{err}");
}

#[tokio::test]
async fn deadline_bounds_the_whole_call() {
    // A listener that accepts but never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let client = client_of(&[addr]);
    let started = tokio::time::Instant::now();
    let err = client
        .get_instance(get_instance_req(), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert_code(&err, Code::DeadlineExceeded);
    assert!(started.elapsed() < Duration::from_secs(3));
    drop(silent);
}

#[tokio::test]
async fn replaced_endpoints_take_effect() {
    let (fake, client, _stop) = setup().await;
    let (_other, other_addr, _other_stop) = serving("pod-b").await;

    client.endpoints().replace(&[other_addr]);
    let resp = client.get_instance(get_instance_req(), DEADLINE).await.unwrap();
    assert_eq!(resp.instance.unwrap().name.as_deref(), Some("pod-b"));
    assert_eq!(fake.calls("GetInstance"), 0);
}
