//! HTTP/2 with prior knowledge (h2c) from clients on the router's port:
//! `curl --http2-prior-knowledge` gets the pod's answer with the same
//! header semantics as HTTP/1.1, and a client that opens every stream it
//! may and never reads them holds a bounded amount of router memory. To
//! instances of a pool that declares h2c the router speaks HTTP/2 over one
//! multiplexed connection, whatever the client speaks; upgrades to them go
//! over HTTP/1.1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::future::Future as _;
use std::time::Duration;

use harness::{echoed_header, function_header, world};
use skipper::api::Protocol;
use skipper::domain::HEADER_FUNCTION;
use skipper::router::listener::{MAX_CONCURRENT_STREAMS, MAX_SEND_BUFFER};

const LIMIT: Duration = Duration::from_secs(20);

/// `curl` through the router to `/x?y=1` with `args` (and `te: trailers`):
/// the echo's JSON and the HTTP version curl used; asserts a 200.
async fn curl_echo(router: std::net::SocketAddr, args: &[&str]) -> (serde_json::Value, String) {
    let header = format!("{HEADER_FUNCTION}: {}", function_header("app", "t1", false));
    let url = format!("http://{router}/x?y=1");
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-o", "-", "-w", "\n%{http_version} %{http_code}"])
        .args(args)
        .args(["-H", &header, "-H", "te: trailers", &url])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap();
    let (version, code) = status.split_once(' ').unwrap();
    assert_eq!(code, "200", "{text} {}", String::from_utf8_lossy(&out.stderr));
    let v = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (v, version.to_owned())
}

#[tokio::test]
async fn curl_with_http2_prior_knowledge_gets_the_pods_answer() {
    let w = world(|_| {}).await;
    let forwarded = ["--http2-prior-knowledge", "-H", "x-forwarded-for: 10.6.6.6"];
    let (v, version) = curl_echo(w.router.addr, &forwarded).await;
    assert_eq!(version, "2");
    let values = |name: &str| echoed_header(&v, name);
    // `:authority` stands for Host; the client's forwarding headers are
    // replaced; the pool speaks HTTP/1.1.
    assert_eq!(v["version"], "HTTP/1.1", "{v}");
    assert_eq!(values("host"), [w.router.addr.to_string()]);
    assert_eq!(values("x-forwarded-for"), ["127.0.0.1"]);
    assert!(values(HEADER_FUNCTION).is_empty(), "{v}");
    w.router.stop().await;
}

#[tokio::test]
async fn an_h2c_pool_gets_http2_whatever_the_client_speaks() {
    let w = world(|_| {}).await;
    w.fake.speak(Protocol::H2c);
    for (args, client_version) in [
        (&["--http1.1"][..], "1.1"),
        (&["--http2-prior-knowledge"][..], "2"),
    ] {
        let (v, version) = curl_echo(w.router.addr, args).await;
        assert_eq!(version, client_version);
        assert_eq!(v["version"], "HTTP/2.0", "{v}");
        // The client's Host is the `:authority`, the path and query stay.
        assert_eq!(v["uri"], format!("http://{}/x?y=1", w.router.addr), "{v}");
        let headers: Vec<(String, String)> = serde_json::from_value(v["headers"].clone()).unwrap();
        let names: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
        assert!(!names.contains(&"host"), "{headers:?}");
        assert!(headers.contains(&("te".into(), "trailers".into())), "{headers:?}");
        assert!(
            headers.contains(&("x-skipper-instance".into(), "pod-1".into())),
            "{headers:?}"
        );
        assert!(
            headers.contains(&("x-forwarded-for".into(), "127.0.0.1".into())),
            "{headers:?}"
        );
    }
    w.router.stop().await;
}

#[tokio::test]
async fn requests_to_an_h2c_instance_share_one_connection() {
    let w = world(|_| {}).await;
    w.fake.speak(Protocol::H2c);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let header = function_header("app", "t1", false);
    // Concurrent requests on separate client connections, the first ones
    // racing to open the instance's connection.
    let peers = futures::future::join_all((0..32).map(|_| {
        let client = client.clone();
        let (url, header) = (w.router.url("/peer"), header.clone());
        async move {
            let resp = client
                .get(url)
                .header(HEADER_FUNCTION, header)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap()
        }
    }))
    .await;
    let distinct: std::collections::BTreeSet<&String> = peers.iter().collect();
    assert_eq!(distinct.len(), 1, "connections the instance saw: {distinct:?}");
    w.router.stop().await;
}

#[tokio::test]
async fn a_websocket_to_an_h2c_pool_goes_over_http1() {
    let w = world(|_| {}).await;
    w.fake.speak(Protocol::H2c);
    crate::common::echoing_websocket(w.router.addr).await;
    w.router.stop().await;
}

#[tokio::test]
async fn a_refused_connect_to_an_h2c_instance_is_retried_on_another() {
    let w = world(|_| {}).await;
    w.fake.with(|s| s.instances.clear());
    w.fake
        .add_instance_speaking("dead", harness::refused_addr(), Protocol::H2c);
    w.fake
        .add_instance_speaking("pod-1", w.upstream.addr, Protocol::H2c);
    let (v, _) = curl_echo(w.router.addr, &["--http1.1"]).await;
    assert_eq!(v["version"], "HTTP/2.0", "{v}");
    w.router.stop().await;
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test]
async fn a_client_flooding_streams_it_never_reads_holds_bounded_router_memory() {
    flood_never_reading(Protocol::Unspecified).await;
}

#[tokio::test]
async fn a_client_flooding_streams_to_an_h2c_pool_holds_bounded_router_memory() {
    flood_never_reading(Protocol::H2c).await;
}

/// A client opens every stream the router allows, each asking the pool
/// (speaking `protocol`) for 100 MB, and reads none of them.
async fn flood_never_reading(protocol: Protocol) {
    let w = world(|_| {}).await;
    w.fake.speak(protocol);
    let tcp = tokio::net::TcpStream::connect(w.router.addr).await.unwrap();
    let (client, mut conn) = h2::client::handshake(tcp).await.unwrap();
    // The router's SETTINGS arrive with its first frames.
    let limit = tokio::time::timeout(
        LIMIT,
        std::future::poll_fn(|cx| {
            let _ = std::pin::Pin::new(&mut conn).poll(cx);
            match conn.max_concurrent_send_streams() {
                n if n == MAX_CONCURRENT_STREAMS as usize => std::task::Poll::Ready(n),
                _ => std::task::Poll::Pending,
            }
        }),
    )
    .await
    .expect("the router announces its stream limit");
    assert_eq!(limit, MAX_CONCURRENT_STREAMS as usize);
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.unwrap();
    let before = rss_bytes();
    let header = function_header("app", "t1", false);
    // Every stream the router allows, each asking for 100 MB, none read.
    let mut answers = Vec::new();
    for _ in 0..MAX_CONCURRENT_STREAMS {
        let req = http::Request::builder()
            .uri(format!("http://{}/download/100000000", w.router.addr))
            .header(HEADER_FUNCTION, &header)
            .body(())
            .unwrap();
        client = client.ready().await.unwrap();
        let (answer, _) = client.send_request(req, true).unwrap();
        answers.push(answer);
    }
    let mut bodies = Vec::new();
    for a in answers {
        let resp = tokio::time::timeout(LIMIT, a).await.unwrap().unwrap();
        assert_eq!(resp.status(), 200);
        bodies.push(resp.into_body());
    }
    // The client's connection window (64 KiB) fills: the router has sent
    // all it may and now holds what it buffers itself.
    let window = 65_535usize;
    skipper_test_support::eventually("the connection window full", LIMIT, || {
        let used: usize = bodies.iter_mut().map(|b| b.flow_control().used_capacity()).sum();
        let full = used >= window;
        async move { full.then_some(()) }
    })
    .await;
    let grown = rss_bytes().saturating_sub(before);
    let streams = u64::from(MAX_CONCURRENT_STREAMS);
    eprintln!(
        "{streams} never-read streams of 100 MB each from a {protocol:?} pool: process memory grew {:.1} MiB",
        grown as f64 / f64::from(1 << 20)
    );
    // The client holds 8 MiB of its windows; the router at most its send
    // buffer and an instance connection's buffers per stream. 12.8 GB were asked for.
    let bound = streams * (MAX_SEND_BUFFER as u64 + window as u64 + 512 * 1024) + (32 << 20);
    assert!(grown < bound, "grew {grown} bytes, bound {bound}");
    drop(bodies);
    drop(client);
    driver.abort();
    w.router.stop().await;
}
