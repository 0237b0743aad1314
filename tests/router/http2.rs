//! HTTP/2 with prior knowledge (h2c) from clients on the router's port:
//! `curl --http2-prior-knowledge` gets the pod's answer with the same
//! header semantics as HTTP/1.1, and a client that opens every stream it
//! may and never reads them holds a bounded amount of router memory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::future::Future as _;
use std::time::Duration;

use harness::{function_header, world};
use skipper::domain::HEADER_FUNCTION;
use skipper::router::listener::{MAX_CONCURRENT_STREAMS, MAX_SEND_BUFFER};

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn curl_with_http2_prior_knowledge_gets_the_pods_answer() {
    let w = world(|_| {}).await;
    let header = format!("{HEADER_FUNCTION}: {}", function_header("app", "t1", false));
    let url = format!("http://{}/x", w.router.addr);
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--http2-prior-knowledge",
            "-o",
            "-",
            "-w",
            "\n%{http_version} %{http_code}",
        ])
        .args(["-H", &header, "-H", "x-forwarded-for: 10.6.6.6", &url])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap();
    assert_eq!(status, "2 200", "{text} {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let headers: Vec<(String, String)> = serde_json::from_value(v["headers"].clone()).unwrap();
    let values = |name: &str| -> Vec<String> {
        headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .collect()
    };
    // `:authority` stands for Host; the client's forwarding headers are replaced.
    assert_eq!(values("host"), [w.router.addr.to_string()]);
    assert_eq!(values("x-forwarded-for"), ["127.0.0.1"]);
    assert!(values(HEADER_FUNCTION).is_empty(), "{headers:?}");
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
    let w = world(|_| {}).await;
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
        "{streams} never-read streams of 100 MB each: process memory grew {:.1} MiB",
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
