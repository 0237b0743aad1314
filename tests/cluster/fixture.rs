//! `skipper fixture`: the assignment checks in the spec's order, tokens bound
//! to the pod and used once, several trusted keys, token persistence across
//! restarts, echo, WebSocket ping/pong and the test knobs.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use futures::{SinkExt as _, StreamExt as _};
use skipper::fixture::{Fixture, Settings};
use skipper::shutdown::Shutdown;
use skipper::token::{BOUND_TOKEN_LIFETIME, PodRef, SigningKey, TrustedKeys, Version};

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "skipper-fixture-{tag}-{}-{:x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The pod the fixtures of this file run as.
const POD_A: PodRef<'static> = PodRef {
    name: "pod-a",
    uid: "uid-a",
};

fn settings(key: &SigningKey, token_path: PathBuf) -> Settings {
    Settings {
        keys: TrustedKeys::from_pem(&key.verifying_key().to_pem()).unwrap(),
        addr: "127.0.0.1:0".parse().unwrap(),
        token_path,
        assign_delay: Duration::ZERO,
        assign_status: None,
        grpc_health: None,
        pod_name: Some(POD_A.name.into()),
        pod_uid: Some(POD_A.uid.into()),
        accept_unbound_tokens: false,
    }
}

/// A token for `tenant` bound to [`POD_A`], as a controller issues.
fn token(key: &SigningKey, version: Version, tenant: &str) -> String {
    common::bound_token(key, version, tenant, POD_A)
}

async fn start(s: Settings) -> (Fixture, String) {
    let f = Fixture::start(s, Shutdown::new()).await.unwrap();
    let base = format!("http://{}", f.addr());
    (f, base)
}

async fn assign(base: &str, token: Option<&str>, function: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().post(format!("{base}/__skipper/assign"));
    if let Some(t) = token {
        req = req.header("X-Skipper-Token", t);
    }
    if let Some(f) = function {
        req = req.header("X-Skipper-Function", f);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

#[tokio::test]
async fn assign_runs_the_checks_in_order_with_their_status_codes() {
    let (key, _) = common::keys();
    let dir = temp_dir("order");
    let (f, base) = start(settings(&key, dir.join("token"))).await;
    let good = token(&key, Version::V2, "t1");

    let resp = reqwest::get(format!("{base}/__skipper/assign")).await.unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["content-type"], "text/plain; charset=utf-8");
    assert_eq!(resp.text().await.unwrap(), "method not allowed\n");

    assert_eq!(
        assign(&base, None, Some(&common::function_json("t1"))).await,
        (400, "missing X-Skipper-Token\n".into())
    );
    assert_eq!(
        assign(&base, Some(&good), None).await,
        (400, "missing X-Skipper-Function\n".into())
    );
    assert_eq!(
        assign(
            &base,
            Some("v2.public.garbage"),
            Some(&common::function_json("t1"))
        )
        .await
        .0,
        401
    );
    // A token signed by another key is rejected.
    let (other, _) = common::keys();
    let foreign = common::token(&other, Version::V2, "t1");
    assert_eq!(
        assign(&base, Some(&foreign), Some(&common::function_json("t1"))).await,
        (401, "invalid token: token signature is invalid\n".into())
    );
    // The token's subject must be the function's tenant.
    assert_eq!(
        assign(&base, Some(&good), Some(&common::function_json("t2"))).await,
        (
            401,
            "invalid token: subject is not the function's tenant\n".into()
        )
    );
    assert!(
        !dir.join("token").exists(),
        "no rejected request persisted anything"
    );

    assert_eq!(
        assign(&base, Some(&good), Some(&common::function_json("t1")))
            .await
            .0,
        200
    );
    // Already assigned wins over every later check.
    assert_eq!(
        assign(&base, None, None).await,
        (409, "already assigned\n".into())
    );
    let resp = reqwest::get(format!("{base}/__skipper/assign")).await.unwrap();
    assert_eq!(resp.status(), 405, "method is checked first");
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn v4_tokens_are_accepted_and_an_unwritable_token_path_is_a_500() {
    let (key, _) = common::keys();
    let dir = temp_dir("v4");
    let (f, base) = start(settings(&key, dir.join("token"))).await;
    let v4 = token(&key, Version::V4, "t4");
    assert!(v4.starts_with("v4.public."));
    assert_eq!(
        assign(&base, Some(&v4), Some(&common::function_json("t4")))
            .await
            .0,
        200
    );
    f.stop().await;

    let (f, base) = start(settings(&key, dir.join("missing-dir/token"))).await;
    let t = token(&key, Version::V2, "t");
    assert_eq!(
        assign(&base, Some(&t), Some(&common::function_json("t"))).await,
        (500, "internal error\n".into())
    );
    // Still unassigned: a later assignment with a working path would be possible.
    let resp = reqwest::get(format!("{base}/x")).await.unwrap();
    assert_eq!(resp.status(), 503);
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn echo_answers_503_before_assignment_and_json_with_the_tenant_after() {
    let (key, _) = common::keys();
    let dir = temp_dir("echo");
    let (f, base) = start(settings(&key, dir.join("token"))).await;
    let resp = reqwest::get(format!("{base}/hello")).await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.text().await.unwrap(), "not assigned\n");
    assert_eq!(
        reqwest::get(format!("{base}/healthz")).await.unwrap().status(),
        200
    );

    let t = token(&key, Version::V2, "acme");
    assert_eq!(
        assign(&base, Some(&t), Some(&common::function_json("acme")))
            .await
            .0,
        200
    );
    let resp = reqwest::Client::new()
        .put(format!("{base}/some/path?a=1&b=two"))
        .header("x-custom", "v1")
        .header("X-Custom", "v2")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with('\n'));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["method"], "PUT");
    assert_eq!(v["url"], "/some/path?a=1&b=two");
    assert_eq!(v["body"], "payload");
    assert_eq!(v["tenant"], "acme");
    assert_eq!(v["headers"]["X-Custom"], "v1, v2");
    assert_eq!(v["headers"]["Host"], f.addr().to_string());
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn websocket_ping_gets_pong_even_before_assignment() {
    let (key, _) = common::keys();
    let dir = temp_dir("ws");
    let (f, _) = start(settings(&key, dir.join("token"))).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/socket", f.addr()))
        .await
        .unwrap();
    ws.send(tokio_tungstenite::tungstenite::Message::text("hello"))
        .await
        .unwrap();
    ws.send(tokio_tungstenite::tungstenite::Message::text("ping"))
        .await
        .unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        reply.into_text().unwrap().as_str(),
        "pong",
        "only ping is answered"
    );
    ws.close(None).await.unwrap();
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn the_token_is_persisted_0600_and_a_restart_stays_assigned() {
    let (key, _) = common::keys();
    let dir = temp_dir("restart");
    let path = dir.join("token");
    let (f, base) = start(settings(&key, path.clone())).await;
    let t = token(&key, Version::V2, "keep");
    assert_eq!(
        assign(&base, Some(&t), Some(&common::function_json("keep")))
            .await
            .0,
        200
    );
    f.stop().await;
    assert_eq!(std::fs::read_to_string(&path).unwrap(), t);
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let (f, base) = start(settings(&key, path.clone())).await;
    let resp = reqwest::get(format!("{base}/again")).await.unwrap();
    assert_eq!(resp.status(), 200, "assigned after restart");
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["tenant"], "keep");
    let t2 = token(&key, Version::V2, "other");
    assert_eq!(
        assign(&base, Some(&t2), Some(&common::function_json("other")))
            .await
            .0,
        409
    );
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn test_knobs_shape_the_response() {
    let (key, _) = common::keys();
    let dir = temp_dir("knobs");
    let (f, base) = start(settings(&key, dir.join("token"))).await;
    let t = token(&key, Version::V2, "k");
    assert_eq!(
        assign(&base, Some(&t), Some(&common::function_json("k"))).await.0,
        200
    );

    assert_eq!(
        skipper_test_support::get_status(format!("{base}/?status=418")).await,
        418
    );
    let body = reqwest::get(format!("{base}/?bytes=4096"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(body.len(), 4096);
    let started = Instant::now();
    assert_eq!(
        reqwest::get(format!("{base}/?delay_ms=150"))
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(started.elapsed() >= Duration::from_millis(150));
    let started = Instant::now();
    assert_eq!(
        reqwest::get(format!("{base}/?burn_ms=100"))
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
    let resp = reqwest::get(format!("{base}/sse?events=3&interval_ms=10"))
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let text = resp.text().await.unwrap();
    assert_eq!(text.matches("data: event").count(), 3, "{text}");
    f.stop().await;

    let mut s = settings(&key, dir.join("token2"));
    s.assign_status = Some(503);
    s.assign_delay = Duration::from_millis(150);
    let (f, base) = start(s).await;
    let started = Instant::now();
    let (status, _) = assign(&base, Some(&t), Some(&common::function_json("k"))).await;
    assert_eq!(status, 503);
    assert!(started.elapsed() >= Duration::from_millis(150));
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_flags_fail_at_start_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .arg("fixture")
            .args(args)
            .env_clear()
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["--fixture-port", "0", "--host", "127.0.0.1"]).contains("--public-key"));
    assert!(run(&["--public-key", "nonsense"]).contains("parsing public key: no PEM block found"));
    assert!(run(&["--public-key-file", "/nonexistent/key.pem"]).contains("--public-key-file"));
    assert!(run(&["--assign-status", "99"]).contains("--assign-status"));
    let bad_second = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----\n";
    let (_, good) = common::keys();
    assert!(
        run(&[&format!("--public-key={good}{bad_second}")]).contains("--public-key: parsing PKIX"),
        "every block of the key file must be a key"
    );
}

/// POSTs an assignment of `tenant` with `token`; returns status and body.
async fn assign_as(base: &str, token: &str, tenant: &str) -> (u16, String) {
    assign(base, Some(token), Some(&common::function_json(tenant))).await
}

#[tokio::test]
async fn a_token_is_accepted_only_by_the_pod_it_names_and_only_once() {
    let (key, _) = common::keys();
    let dir = temp_dir("bound");
    let (f, base) = start(settings(&key, dir.join("token"))).await;

    // A tenant's token for its own pod, replayed to this pool pod.
    let theirs = common::bound_token(
        &key,
        Version::V2,
        "t1",
        PodRef {
            name: "pod-b",
            uid: "uid-b",
        },
    );
    assert_eq!(
        assign_as(&base, &theirs, "t1").await,
        (
            401,
            "invalid token: token is for pod \"pod-b\", not this pod \"pod-a\"\n".into()
        )
    );
    // A pod of the same name that is not this one (a recreated pod).
    let recreated = common::bound_token(
        &key,
        Version::V4,
        "t1",
        PodRef {
            name: "pod-a",
            uid: "uid-old",
        },
    );
    let (status, body) = assign_as(&base, &recreated, "t1").await;
    assert_eq!(status, 401);
    assert!(body.contains("pod UID \"uid-old\""), "{body}");
    // What a Go controller issues is refused, naming the way to admit it.
    let (status, body) = assign_as(&base, &common::token(&key, Version::V2, "t1"), "t1").await;
    assert_eq!(status, 401);
    assert!(
        body.contains("not bound to a pod") && body.contains("--accept-unbound-tokens"),
        "{body}"
    );
    let resp = reqwest::get(format!("{base}/x")).await.unwrap();
    assert_eq!(resp.status(), 503, "no refused token assigned the pod");

    let mine = token(&key, Version::V2, "t1");
    assert_eq!(assign_as(&base, &mine, "t1").await, (200, String::new()));
    for replay in [&mine, &token(&key, Version::V2, "t1")] {
        assert_eq!(
            assign_as(&base, replay, "t1").await,
            (409, "already assigned\n".into()),
            "a second assignment, with the same token or a fresh one"
        );
    }
    f.stop().await;

    // A token whose assignment did not complete is used up all the same.
    let (f, base) = start(settings(&key, dir.join("missing-dir/token"))).await;
    let t = token(&key, Version::V2, "t2");
    assert_eq!(assign_as(&base, &t, "t2").await.0, 500);
    assert_eq!(
        assign_as(&base, &t, "t2").await,
        (409, "already assigned\n".into()),
        "the jti is not accepted twice"
    );
    assert_eq!(
        assign_as(&base, &token(&key, Version::V2, "t2"), "t2").await.0,
        500,
        "a fresh token is still checked"
    );
    f.stop().await;

    // A pod that does not know its name cannot check a bound token.
    let mut s = settings(&key, dir.join("token-noname"));
    s.pod_name = None;
    s.pod_uid = None;
    let (f, base) = start(s).await;
    let (status, body) = assign_as(&base, &token(&key, Version::V2, "t3"), "t3").await;
    assert_eq!(status, 401);
    assert!(body.contains("SKIPPER_POD_NAME"), "{body}");
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn unbound_tokens_are_admitted_only_when_asked_and_bound_ones_still_checked() {
    let (key, _) = common::keys();
    let dir = temp_dir("unbound");
    let mut s = settings(&key, dir.join("token"));
    s.accept_unbound_tokens = true;
    s.pod_uid = None;
    let (f, base) = start(s.clone()).await;
    let other = common::bound_token(
        &key,
        Version::V2,
        "go",
        PodRef {
            name: "pod-b",
            uid: "u",
        },
    );
    assert_eq!(
        assign_as(&base, &other, "go").await.0,
        401,
        "a bound token still names its pod"
    );
    let go = common::token(&key, Version::V2, "go");
    assert_eq!(assign_as(&base, &go, "go").await.0, 200);
    f.stop().await;

    // Without the UID, a token for this pod's name is accepted.
    s.token_path = dir.join("token2");
    let (f, base) = start(s).await;
    let any_uid = common::bound_token(
        &key,
        Version::V2,
        "t",
        PodRef {
            name: "pod-a",
            uid: "whatever",
        },
    );
    assert_eq!(assign_as(&base, &any_uid, "t").await.0, 200);
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn every_trusted_key_verifies_and_a_kept_token_outlives_its_lifetime() {
    let (old, _) = common::keys();
    let (new, _) = common::keys();
    let dir = temp_dir("keys");
    let pem = format!("{}{}", old.verifying_key().to_pem(), new.verifying_key().to_pem());
    let mut s = settings(&old, dir.join("token-old"));
    s.keys = TrustedKeys::from_pem(&pem).unwrap();
    for (key, path) in [(&old, "token-old"), (&new, "token-new")] {
        s.token_path = dir.join(path);
        let (f, base) = start(s.clone()).await;
        assert_eq!(assign_as(&base, &token(key, Version::V2, "t"), "t").await.0, 200);
        f.stop().await;
    }
    let (stranger, _) = common::keys();
    s.token_path = dir.join("token-stranger");
    let (f, base) = start(s.clone()).await;
    let (status, body) = assign_as(&base, &token(&stranger, Version::V2, "t"), "t").await;
    assert_eq!(status, 401);
    assert!(body.contains("not one of the trusted keys"), "{body}");
    f.stop().await;

    // A restarted pod still knows its tenant from a token past its expiry.
    let issued = SystemTime::now() - BOUND_TOKEN_LIFETIME - Duration::from_secs(60);
    let (expired, _) = new
        .sign_bound(Version::V2, "kept", POD_A, BOUND_TOKEN_LIFETIME, issued)
        .unwrap();
    s.token_path = dir.join("token-kept");
    std::fs::write(&s.token_path, &expired).unwrap();
    let (f, base) = start(s).await;
    let v: serde_json::Value = reqwest::get(format!("{base}/x"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["tenant"], "kept");
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn requests_for_another_instance_or_tenant_are_421_before_anything_else() {
    let (key, _) = common::keys();
    let dir = temp_dir("misdirected");
    let (f, base) = start(settings(&key, dir.join("token"))).await;
    let send = |instance: Option<&'static str>, tenant: Option<&'static str>, path: &'static str| {
        let base = base.clone();
        async move {
            let mut req = reqwest::Client::new()
                .post(format!("{base}{path}"))
                .body("payload");
            if let Some(i) = instance {
                req = req.header("x-skipper-instance", i);
            }
            if let Some(t) = tenant {
                req = req.header("x-skipper-tenant", t);
            }
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    // Unassigned: a request for any tenant is not for this pod.
    assert_eq!(
        send(Some("pod-a"), Some("acme"), "/x").await,
        (421, "this instance serves no tenant, not \"acme\"\n".into())
    );
    assert_eq!(
        send(None, None, "/x").await.0,
        503,
        "without the headers: as before"
    );

    let t = token(&key, Version::V2, "acme");
    assert_eq!(
        assign(&base, Some(&t), Some(&common::function_json("acme")))
            .await
            .0,
        200
    );
    assert_eq!(
        send(Some("pod-b"), Some("acme"), "/x").await,
        (421, "this is instance \"pod-a\", not \"pod-b\"\n".into())
    );
    assert_eq!(
        send(Some("pod-a"), Some("other"), "/x").await,
        (421, "this instance serves another tenant, not \"other\"\n".into())
    );
    // Checked before the test knobs run (no delay, no status).
    assert_eq!(
        send(None, Some("other"), "/x?status=200&delay_ms=60000").await.0,
        421
    );
    // A header given twice is refused even when its first value is right.
    let twice = |name: &'static str, first: &'static str, second: &'static str| {
        let base = base.clone();
        async move {
            let resp = reqwest::Client::new()
                .post(format!("{base}/x"))
                .header(name, first)
                .header(name, second)
                .body("payload")
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    assert_eq!(
        twice("x-skipper-tenant", "acme", "other").await,
        (
            421,
            "x-skipper-tenant is given 2 times; a request names one\n".into()
        )
    );
    assert_eq!(
        twice("x-skipper-tenant", "acme", "acme").await.0,
        421,
        "a repeated right value is refused too"
    );
    assert_eq!(
        twice("x-skipper-instance", "pod-a", "pod-b").await,
        (
            421,
            "x-skipper-instance is given 2 times; a request names one\n".into()
        )
    );
    for (instance, tenant) in [
        (Some("pod-a"), Some("acme")),
        (None, Some("acme")),
        (Some("pod-a"), None),
        (None, None),
    ] {
        let (status, body) = send(instance, tenant, "/x").await;
        assert_eq!(status, 200, "{instance:?} {tenant:?}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["body"], "payload");
    }
    f.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}
