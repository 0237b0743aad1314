//! The router end to end: a fake controller (the generated tonic server on
//! 127.0.0.1:0), real upstream servers on 127.0.0.1:0 and the router between.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::time::Duration;

use futures::StreamExt;
use harness::{
    FakeController, app_header as header, echo_of, echoed_header, function_header, pattern_body,
    refused_addr, start_router, start_upstream, test_config, world,
};
use reqwest::Method;
use skipper::domain::HEADER_FUNCTION;
use skipper::router::Discovery;
use skipper_test_support::http;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn bad_function_headers_get_400_naming_the_problem() {
    let w = world(|_| {}).await;
    let c = http();
    let cases: &[(reqwest::Method, &str, Option<&str>, u16, &str)] = &[
        (
            reqwest::Method::GET,
            "/x",
            None,
            400,
            "missing X-Skipper-Function\n",
        ),
        (
            reqwest::Method::GET,
            "/x",
            Some("{not json"),
            400,
            "failed to unmarshal X-Skipper-Function header: ",
        ),
        (
            reqwest::Method::GET,
            "/x",
            Some(
                r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"max_instances":4294967296}}"#,
            ),
            400,
            "failed to unmarshal X-Skipper-Function header: ",
        ),
        (
            reqwest::Method::GET,
            "/x",
            Some(r#"{"namespace":"ns","deployment":"app","scale":{"max_instances":1}}"#),
            400,
            "missing tenant\n",
        ),
        (
            reqwest::Method::GET,
            "/x",
            Some(r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"max_instances":0}}"#),
            400,
            "scale.max_instances must be >= 1\n",
        ),
        (reqwest::Method::GET, "/healthz", None, 200, ""),
        (reqwest::Method::GET, "/healthz", Some("{bad"), 200, ""),
        (reqwest::Method::HEAD, "/healthz", None, 400, ""),
        (
            reqwest::Method::POST,
            "/healthz",
            None,
            400,
            "missing X-Skipper-Function\n",
        ),
    ];
    for (method, path, value, status, body_prefix) in cases {
        let mut req = c.request(method.clone(), w.router.url(path));
        if let Some(v) = value {
            req = req.header(HEADER_FUNCTION, *v);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), *status, "{method} {path} {value:?}");
        if *status == 400 && *method != reqwest::Method::HEAD {
            assert_eq!(
                resp.headers()["content-type"],
                "text/plain; charset=utf-8",
                "{value:?}"
            );
            let body = resp.text().await.unwrap();
            assert!(body.starts_with(body_prefix), "{value:?}: {body:?}");
            assert_eq!(body.matches('\n').count(), 1, "one line: {body:?}");
        }
    }
    // GET /healthz with a valid header is proxied.
    let echo = echo_of(w.router.get("/healthz").await).await;
    assert_eq!(echo["uri"], "/healthz");
    assert_eq!(w.fake.calls("GetInstance"), 1);
    w.router.stop().await;
}

#[tokio::test]
async fn headers_are_rewritten_and_path_and_query_kept_byte_for_byte() {
    let w = world(|_| {}).await;
    let path = "/a/b%2Fc?foo=bar&baz=qux&special=%20encoded";
    let resp = w
        .router
        .request(Method::PUT, path)
        .header("x-multi", "1")
        .header("x-multi", "2")
        .header("connection", "x-hop")
        .header("x-hop", "secret")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert!(resp.headers().contains_key("x-skipper-get-instance-duration-ms"));
    let echo = echo_of(resp).await;
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["uri"], path);
    let get = |k: &str| echoed_header(&echo, k);
    let host = w.router.addr.to_string();
    assert_eq!(get("host"), [host.as_str()]);
    assert_eq!(get("x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(get("x-forwarded-host"), [host.as_str()]);
    assert_eq!(get("x-forwarded-proto"), ["http"]);
    let forwarded = format!("for=127.0.0.1;host=\"{host}\";proto=http");
    assert_eq!(get("forwarded"), [forwarded.as_str()]);
    assert_eq!(get("x-multi"), ["1", "2"]);
    assert!(get(HEADER_FUNCTION).is_empty());
    assert!(get("x-hop").is_empty());
    assert_eq!(echo["body_len"], 7);
    w.router.stop().await;
}

#[tokio::test]
async fn backend_error_statuses_pass_through() {
    let w = world(|_| {}).await;
    for code in [404u16, 500, 503] {
        let resp = w.router.get(&format!("/status/{code}")).await;
        assert_eq!(resp.status().as_u16(), code);
        assert_eq!(resp.headers()["x-upstream"], "yes");
        assert_eq!(resp.text().await.unwrap(), format!("status {code} from upstream"));
    }
    assert_eq!(w.fake.calls("GetInstance"), 3);
    w.router.stop().await;
}

#[tokio::test]
async fn connect_refused_is_retried_on_another_instance_with_the_body_intact() {
    let w = world(|_| {}).await;
    // The first instance refuses connections; the second is the upstream.
    w.fake.add_instance_first("pod-dead", &refused_addr().to_string());
    let body = pattern_body(1024 * 1024);
    w.router.upload(Method::POST, &body).await;
    assert_eq!(w.fake.exclusions(), [vec![], vec!["pod-dead".to_owned()]]);
    w.router.stop().await;
}

/// An instance that reads the request head and hangs up.
async fn rude_instance() -> std::net::SocketAddr {
    let rude = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rude_addr = rude.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = rude.accept().await else {
                return;
            };
            let mut buf = [0u8; 1024];
            let _ = tokio::io::AsyncReadExt::read(&mut s, &mut buf).await;
            drop(s);
        }
    });
    rude_addr
}

#[tokio::test]
async fn upstream_reset_after_sending_a_post_is_502_after_one_attempt() {
    let w = world(|_| {}).await;
    let rude_addr = rude_instance().await;
    w.fake.with(|s| {
        s.instances[0].addr = Some(rude_addr.to_string());
    });
    let resp = w.router.post("/x", "once").await;
    assert_eq!(resp.status(), 502);
    let body = resp.text().await.unwrap();
    assert!(body.contains("pod-1"), "{body}");
    assert_eq!(
        w.fake.calls("GetInstance"),
        1,
        "a POST the instance had is not sent again"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn an_idempotent_request_whose_instance_hung_up_before_answering_goes_elsewhere() {
    let w = world(|_| {}).await;
    let rude_addr = rude_instance().await;
    w.fake.add_instance_first("pod-rude", &rude_addr.to_string());
    for method in [Method::GET, Method::PUT, Method::DELETE] {
        let before = w.fake.exclusions().len();
        let resp = w
            .router
            .request(method.clone(), "/x")
            .body("same bytes")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{method}");
        let echo: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(echo["body_len"], 10);
        let exclusions = w.fake.exclusions().split_off(before);
        assert_eq!(exclusions.len(), 2, "{method}");
        assert_eq!(exclusions[1], ["pod-rude".to_owned()]);
    }
    w.router.stop().await;
}

#[tokio::test]
async fn controller_down_is_503_with_retry_after_within_the_budget() {
    let upstream = start_upstream().await;
    let _ = upstream;
    let mut config = test_config(vec![refused_addr()]);
    config.max_round_trip_attempts = 3;
    let router = start_router(config).await;
    let started = tokio::time::Instant::now();
    let resp = router.get("/x").await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body = resp.text().await.unwrap();
    assert!(
        body.starts_with("gave up after 3 attempts: no controller available"),
        "{body}"
    );
    // 3 attempts with backoffs of at most 20 ms each, GetInstance retries of
    // at most 100 ms each: far below this bound.
    assert!(started.elapsed() < Duration::from_secs(3));
    router.stop().await;
}

#[tokio::test]
async fn a_controller_refusing_connections_costs_no_attempt_of_a_request() {
    // A replaced controller: discovery still lists its address, its port is
    // closed. Each request has one attempt and needs a `GetInstance` call.
    let w = world(|c| {
        c.max_round_trip_attempts = 1;
        let Discovery::Static(controllers) = &mut c.discovery else {
            unreachable!("the harness lists its controllers")
        };
        controllers.insert(0, refused_addr());
    })
    .await;
    let oneshot = function_header("app", "t1", true);
    for i in 0..8 {
        let resp = w.router.get_as("/hello", &oneshot).await;
        let status = resp.status();
        let body = resp.text().await.unwrap();
        assert_eq!(
            (status.as_u16(), body.as_str()),
            (200, "hello world"),
            "request {i}"
        );
    }
    assert!(w.fake.calls("GetInstance") >= 8);
    w.router.stop().await;
}

#[tokio::test]
async fn no_capacity_is_503_and_controller_errors_are_502() {
    let w = world(|c| c.max_round_trip_attempts = 2).await;
    w.fake.fail("GetInstance", tonic::Code::ResourceExhausted, 1);
    let resp = w.router.get("/x").await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));

    w.fake.fail("GetInstance", tonic::Code::Internal, 2);
    let resp = w.router.get("/x").await;
    assert_eq!(resp.status(), 502);
    w.router.stop().await;
}

#[tokio::test]
async fn refusals_no_retry_can_fix_are_answered_after_one_call() {
    let w = world(|c| c.max_round_trip_attempts = 6).await;
    for (code, status) in [
        (tonic::Code::InvalidArgument, 400),
        (tonic::Code::NotFound, 404),
        (tonic::Code::ResourceExhausted, 503),
        (tonic::Code::DeadlineExceeded, 503),
    ] {
        let before = w.fake.calls("GetInstance");
        w.fake.fail("GetInstance", code, 1);
        let resp = w.router.get("/x").await;
        assert_eq!(resp.status(), status, "{code:?}");
        assert_eq!(
            w.fake.calls("GetInstance") - before,
            1,
            "{code:?}: one GetInstance call"
        );
        let body = resp.text().await.unwrap();
        assert_eq!(body.lines().count(), 1, "{body}");
    }
    w.router.stop().await;
}

#[tokio::test]
async fn an_unusable_instance_address_is_excluded_and_retried() {
    let w = world(|_| {}).await;
    w.fake.add_instance_first("pod-noaddr", "");
    let resp = w.router.get("/x").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(w.fake.exclusions()[1], ["pod-noaddr".to_owned()]);
    w.router.stop().await;
}

#[tokio::test]
async fn every_connect_failing_is_502() {
    let w = world(|c| c.max_round_trip_attempts = 3).await;
    w.fake
        .with(|s| s.instances[0].addr = Some(refused_addr().to_string()));
    let resp = w.router.get("/x").await;
    assert_eq!(resp.status(), 502);
    let body = resp.text().await.unwrap();
    assert!(body.contains("failed to connect to instance"), "{body}");
    assert_eq!(w.fake.calls("GetInstance"), 3);
    w.router.stop().await;
}

#[tokio::test]
async fn response_header_and_request_timeouts_are_504() {
    // Each bound alone, and what the answer's body says (if it is checked).
    type Bound = fn(&mut skipper::router::Config);
    let cases: [(Bound, Option<&str>); 2] = [
        (
            |c| c.response_header_timeout = Some(Duration::from_millis(100)),
            None,
        ),
        (
            |c| c.request_timeout = Some(Duration::from_millis(100)),
            Some("request timeout"),
        ),
    ];
    for (bound, says) in cases {
        let w = world(bound).await;
        let resp = w.router.get("/block").await;
        assert_eq!(resp.status(), 504);
        let body = resp.text().await.unwrap();
        assert!(says.is_none_or(|s| body.contains(s)), "{body}");
        w.upstream.open();
        w.router.stop().await;
    }
}

#[tokio::test]
async fn oneshot_instance_is_released_after_an_upstream_failure() {
    let w = world(|_| {}).await;
    let rude_addr = rude_instance().await;
    w.fake.with(|s| s.instances[0].addr = Some(rude_addr.to_string()));
    // A POST: once the instance has it, the request is not sent again.
    let oneshot = function_header("app", "t1", true);
    let resp = w
        .router
        .request_as(Method::POST, "/x", &oneshot)
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let fake = w.fake.clone();
    w.router.stop().await;
    assert_eq!(fake.released(), ["pod-1".to_owned()]);
}

#[tokio::test]
async fn sse_first_event_arrives_before_the_response_ends() {
    let w = world(|_| {}).await;
    let resp = w.router.get("/sse").await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(LIMIT, stream.next())
        .await
        .expect("first event not flushed")
        .unwrap()
        .unwrap();
    assert_eq!(&first[..], b"data: first\n\n");
    // The upstream has not finished: the second event waits for the gate.
    w.upstream.open();
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(LIMIT, stream.next()).await.unwrap() {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(rest, b"data: second\n\n");
    w.router.stop().await;
}

#[tokio::test]
async fn large_download_streams_through() {
    let w = world(|_| {}).await;
    let n = 64 * 1024 * 1024;
    let resp = w.router.get(&format!("/download/{n}")).await;
    let mut stream = resp.bytes_stream();
    let mut total = 0;
    while let Some(chunk) = stream.next().await {
        total += chunk.unwrap().len();
    }
    assert_eq!(total, n);
    w.router.stop().await;
}

#[tokio::test]
async fn instance_connections_are_kept_alive_and_reused() {
    let w = world(|_| {}).await;
    let mut peers = Vec::new();
    for _ in 0..5 {
        // A fresh client connection each time; the router's side is pooled.
        let peer = w.router.get("/peer").await.text().await.unwrap();
        peers.push(peer);
    }
    peers.dedup();
    assert_eq!(peers.len(), 1, "one upstream connection serves all: {peers:?}");
    w.router.stop().await;
}

#[tokio::test]
async fn metrics_count_requests_and_durations() {
    let w = world(|_| {}).await;
    for _ in 0..5 {
        let resp = w.router.get("/x").await;
        resp.bytes().await.unwrap();
    }
    let metrics = w.router.metrics().await;
    assert!(
        metrics.contains("skipper_router_requests_total{function_deployment=\"app\"} 5"),
        "{metrics}"
    );
    assert!(metrics.contains("skipper_router_request_duration_seconds_count{function_deployment=\"app\",status_class=\"2xx\"} 5"), "{metrics}");
    // A deployment no controller served gets no series of its own.
    w.fake.fail("GetInstance", tonic::Code::NotFound, 1);
    let made_up = function_header("made-up-deployment", "t", false);
    let resp = w.router.get_as("/x", &made_up).await;
    assert_eq!(resp.status(), 404);
    let metrics = w.router.metrics().await;
    assert!(!metrics.contains("made-up-deployment"), "{metrics}");
    assert!(
        metrics.contains("skipper_router_requests_total{function_deployment=\"other\"} 1"),
        "{metrics}"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn websocket_echo_counts_in_flight_for_the_tunnel() {
    let w = world(|_| {}).await;
    let mut ws = crate::common::echoing_websocket(w.router.addr).await;
    w.fake.wait_until(LIMIT, harness::in_flight(1)).await;
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = tokio::time::timeout(LIMIT, ws.next()).await.unwrap() {}
    drop(ws);
    w.fake.wait_until(LIMIT, harness::in_flight(0)).await;
    w.router.stop().await;
}

#[tokio::test]
async fn oneshot_instances_are_released_exactly_once() {
    let w = world(|_| {}).await;
    // First instance refuses (released right away), second serves.
    w.fake.add_instance_first("pod-dead", &refused_addr().to_string());
    let oneshot = function_header("app", "t1", true);
    let resp = w.router.get_as("/x", &oneshot).await;
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    w.fake.wait_until(LIMIT, |s| s.releases.len() >= 2).await;
    let fake = w.fake.clone();
    // Stopping drains every tracked task: no release can still be pending.
    w.router.stop().await;
    let mut names = fake.released();
    names.sort();
    assert_eq!(names, vec!["pod-1".to_owned(), "pod-dead".to_owned()]);
}

#[tokio::test]
async fn heartbeat_batch_reports_50_concurrent_requests() {
    let w = world(|_| {}).await;
    let c = http();
    let mut requests = Vec::new();
    for i in 0..50 {
        let deployment = if i < 30 { "app-a" } else { "app-b" };
        let req = c
            .get(w.router.url("/block"))
            .header(HEADER_FUNCTION, function_header(deployment, "t1", false));
        requests.push(tokio::spawn(async move { req.send().await.unwrap().status() }));
    }
    w.upstream.wait_arrived(50).await;
    let counts = |a: u32, b: u32| {
        move |s: &harness::State| {
            s.heartbeats.last().is_some_and(|h| {
                let of = |d: &str| {
                    h.heartbeats
                        .iter()
                        .find(|x| x.function.as_ref().unwrap().deployment.as_deref() == Some(d))
                        .and_then(|x| x.in_flight_requests)
                };
                h.router_ip.as_deref() == Some("10.1.2.3")
                    && h.heartbeats.len() == 2
                    && of("app-a") == Some(a)
                    && of("app-b") == Some(b)
            })
        }
    };
    w.fake.wait_until(LIMIT, counts(30, 20)).await;
    let hb = w.fake.with(|s| s.heartbeats.last().cloned().unwrap());
    for h in &hb.heartbeats {
        assert!(h.timestamp.is_some());
        assert_eq!(h.function.as_ref().unwrap().tenant.as_deref(), Some("t1"));
    }
    w.upstream.open();
    for r in requests {
        assert_eq!(r.await.unwrap(), 200);
    }
    w.fake.wait_until(LIMIT, counts(0, 0)).await;
    w.router.stop().await;
}

#[tokio::test]
async fn graceful_drain_finishes_a_slow_request() {
    let w = world(|c| c.shutdown_timeout = Duration::from_secs(10)).await;
    let req = w.router.request(Method::GET, "/block");
    let pending = tokio::spawn(async move {
        let r = req.send().await.unwrap();
        (r.status(), r.text().await.unwrap())
    });
    w.upstream.wait_arrived(1).await;
    w.router.shutdown.trigger();
    // New connections are refused once shutdown has begun.
    let refused = tokio::time::timeout(LIMIT, async {
        loop {
            if tokio::net::TcpStream::connect(w.router.addr).await.is_err() {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(refused.is_ok());
    assert!(!w.router.done.is_finished());
    w.upstream.open();
    let (status, body) = tokio::time::timeout(LIMIT, pending).await.unwrap().unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, "unblocked");
    w.router.stop().await;
}

/// Sends `head` (and then `body`) on a raw connection to the router and
/// returns the status line and body of the answer.
async fn raw_exchange(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut out))
        .await
        .expect("the router answered and closed")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn oversized_headers_are_431_and_bad_values_are_cut_in_the_answer() {
    let w = world(|_| {}).await;
    let big = format!(
        r#"{{"namespace":"ns","deployment":"app","tenant":"t","x":"{}","scale":{{"max_instances":1}}}}"#,
        "y".repeat(9000)
    );
    let resp = w.router.get_as("/x", &big).await;
    assert_eq!(resp.status(), 431);
    let body = resp.text().await.unwrap();
    assert_eq!(
        body,
        format!("X-Skipper-Function is {} bytes; the limit is 8192\n", big.len())
    );
    // A request head beyond the router's buffer never reaches the handler.
    let resp = w
        .router
        .request(Method::GET, "/x")
        .header("x-padding", "p".repeat(70 * 1024))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 431);
    // A bad value is quoted, but the answer stays one short line.
    let long_tenant = format!(
        r#"{{"namespace":"ns","deployment":"app","tenant":"{}!","scale":{{"max_instances":1}}}}"#,
        "t".repeat(7000)
    );
    let resp = w.router.get_as("/x", &long_tenant).await;
    assert_eq!(resp.status(), 400);
    let body = resp.text().await.unwrap();
    assert!(body.starts_with("invalid tenant \"ttt"), "{body}");
    assert!(
        body.len() <= skipper::router::proxy::MAX_BODY_LINE + 1,
        "{}",
        body.len()
    );
    assert!(body.ends_with("…\n"), "{body}");
    assert_eq!(w.fake.calls("GetInstance"), 0);
    w.router.stop().await;
}

#[tokio::test]
async fn a_stalled_upload_is_408_after_the_body_timeout() {
    let w = world(|c| c.body_timeout = Some(Duration::from_millis(300))).await;
    let head = format!(
        "POST /sink HTTP/1.1\r\nhost: x\r\nx-skipper-function: {}\r\ncontent-length: 100\r\n\r\n",
        header()
    );
    let started = tokio::time::Instant::now();
    // 10 of the announced 100 bytes, then nothing (the socket stays open).
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(w.router.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&[b'a'; 10]).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(LIMIT, s.read(&mut buf))
        .await
        .expect("an answer within the limit")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("the client sent no request body data for 300ms"),
        "{text}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    // The in-flight count is released with the request.
    let metrics = w.router.metrics().await;
    assert!(
        metrics.contains("skipper_router_requests_in_flight{function_deployment=\"other\"} 0"),
        "{metrics}"
    );
    assert!(metrics.contains("status_class=\"4xx\"} 1"), "{metrics}");
    w.router.stop().await;
}

#[tokio::test]
async fn malformed_chunked_framing_from_the_client_is_400() {
    let w = world(|_| {}).await;
    let head = format!(
        "POST /sink HTTP/1.1\r\nhost: x\r\nx-skipper-function: {}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        header()
    );
    let (status, body) = raw_exchange(w.router.addr, &head, b"5\r\nhello\r\nzz\r\nnot a chunk\r\n").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("failed to read the request body from the client"),
        "{body}"
    );
    w.router.stop().await;
}

/// An instance transport that looks alive until `closed` is set, then reads
/// EOF (without waking anyone, like a FIN the connection has not yet read).
struct ClosesWhenTold {
    closed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl tokio::io::AsyncRead for ClosesWhenTold {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        _buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            std::task::Poll::Ready(Ok(()))
        } else {
            std::task::Poll::Pending
        }
    }
}

impl tokio::io::AsyncWrite for ClosesWhenTold {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_pooled_connection_to_a_dead_instance_is_excluded_and_retried() {
    use skipper::router::proxy::{Proxy, Settings, upstream::Pool};
    let fake = FakeController::new();
    let stop = CancellationToken::new();
    let ctrl = fake.serve(stop.clone()).await;
    let upstream = start_upstream().await;
    // pod-dead: its pooled connection closes under the request and nothing
    // listens on its address any more.
    let dead = refused_addr();
    fake.add_instance("pod-dead", dead);
    fake.add_instance("pod-2", upstream.addr);
    let closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    fake.with(|s| s.get_instance_flags.push(closed.clone()));

    let tracker = tokio_util::task::TaskTracker::new();
    let pool = Pool::new(Duration::from_millis(500), tracker.clone(), stop.clone());
    let metrics =
        skipper::router::metrics::Metrics::register(&mut prometheus_client::registry::Registry::default());
    let activity = skipper::router::activity::Activity::new(metrics.clone());
    let parsed = std::sync::Arc::new(skipper::router::entry::parse(&header()).unwrap());
    let guard = activity.begin(&parsed).await;
    // The instance's slot, as the controller will name it, with one idle
    // connection.
    let slot = guard
        .table()
        .adopt(&skipper::api::Instance {
            name: Some("pod-dead".into()),
            addr: Some(dead.to_string()),
            ..Default::default()
        })
        .unwrap();
    pool.adopt(
        &slot,
        ClosesWhenTold {
            closed: closed.clone(),
        },
    )
    .await
    .unwrap();
    assert_eq!(slot.connections.len(), 1);
    let client = skipper::client::Client::new(skipper::client::Endpoints::fixed(
        &[ctrl],
        skipper::client::ChannelSettings::default(),
    ));
    let proxy = Proxy::new(
        client,
        pool,
        Settings {
            retry: skipper::router::proxy::retry::Policy {
                max_attempts: 6,
                min: Duration::from_millis(5),
                max: Duration::from_millis(20),
            },
            response_header_timeout: None,
            get_instance_timeout: Duration::from_secs(2),
            body_pace: None,
            trusted_proxies: skipper::router::proxy::TrustedProxies::none(),
            router_ip: "10.1.2.3".into(),
            waiting: skipper::router::proxy::admission::Limits {
                total: 16,
                per_function: 16,
            },
        },
        metrics,
        tracker,
        stop.clone(),
    );
    // A request with a body: it goes over hyper's pooled connections (a
    // request without one is a direct exchange, tested below).
    let req = http::Request::put("/hello")
        .header("host", "x")
        .body(http_body_util::BodyExt::map_err(
            http_body_util::Full::new(bytes::Bytes::from_static(b"x")),
            |e| match e {},
        ))
        .unwrap();
    let resp = proxy
        .forward(
            &parsed,
            req,
            &skipper::router::proxy::Peer::new(
                "127.0.0.1:9".parse().unwrap(),
                &skipper::router::proxy::TrustedProxies::none(),
            ),
            guard,
            skipper::router::proxy::Progress::default(),
        )
        .await
        .expect("the request is retried on another instance");
    assert_eq!(resp.status(), 200);
    assert_eq!(fake.exclusions(), [vec![], vec!["pod-dead".to_owned()]]);
    stop.cancel();
}

/// An instance that answers the first request on each connection and
/// closes the connection when the second request's head arrives (its
/// keep-alive timeout firing as the request comes); counts connections.
async fn closes_kept_connections() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                // The next head closes the connection unanswered.
                let _ = s.read(&mut chunk).await;
            });
        }
    });
    (addr, conns)
}

#[tokio::test]
async fn a_kept_connection_closed_under_a_get_gets_one_fresh_connection_to_the_same_instance() {
    let w = world(|_| {}).await;
    let (addr, conns) = closes_kept_connections().await;
    w.fake.add_instance_first("pod-keeps", &addr.to_string());
    for i in 0..3 {
        let resp = w.router.get("/hello").await;
        assert_eq!(resp.status(), 200, "request {i}");
        assert_eq!(resp.text().await.unwrap(), "ok");
    }
    // One connection per request: the kept one closed under requests 2
    // and 3, each sent again on a fresh one; the instance is never
    // excluded.
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert!(
        w.fake.exclusions().iter().all(Vec::is_empty),
        "{:?}",
        w.fake.exclusions()
    );
    w.router.stop().await;
}

/// An instance that reads each request head and closes the connection
/// without answering (a pod that dies with the request in flight); counts
/// the heads it read.
async fn dies_with_the_request() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = heads.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    (addr, heads)
}

#[tokio::test]
async fn an_idempotent_request_is_retried_when_its_instance_dies_with_it() {
    let w = world(|_| {}).await;
    let (dying, heads) = dies_with_the_request().await;
    w.fake.add_instance_first("pod-dies", &dying.to_string());

    // A GET without a body goes to the next instance.
    let resp = w.router.get("/hello").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "hello world");
    assert_eq!(
        heads.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "pod-dies had the request"
    );
    assert_eq!(w.fake.exclusions(), [vec![], vec!["pod-dies".to_owned()]]);

    // A POST is not replayed: the instance may have acted on it.
    let resp = w.router.post("/hello", "payload").await;
    assert_eq!(resp.status(), 502);
    assert_eq!(heads.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(w.fake.exclusions().len(), 3);
    w.router.stop().await;
}
