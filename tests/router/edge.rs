//! The router as an edge, over raw TCP where the case needs it: honest
//! forwarding headers (client values replaced, trusted proxies extended),
//! `Host` (missing, twice, listed in `Connection`, absolute-form targets),
//! half-closed clients, slow uploads and slow readers, and the health of a
//! router whose controllers refuse its credentials.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::router as harness;

use std::time::Duration;

use harness::{function_header, world};
use skipper::domain::HEADER_FUNCTION;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const LIMIT: Duration = Duration::from_secs(10);

fn header() -> String {
    function_header("app", "t1", false)
}

/// An answer read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: String,
}

/// Sends `request` on a fresh connection, then half-closes it when `shut`
/// is set, and reads until the router closes or `LIMIT` passes.
async fn raw(addr: std::net::SocketAddr, request: &str, shut: bool) -> Answer {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    if shut {
        s.shutdown().await.unwrap();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(LIMIT, s.read_to_end(&mut out)).await;
    parse(&out)
}

fn parse(out: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    Answer {
        status,
        body: body.to_owned(),
    }
}

/// The headers the upstream saw, from its JSON echo (`Connection: close`
/// answers carry a plain body).
fn echoed(body: &str) -> Vec<(String, String)> {
    let json = body.trim_start_matches(|c: char| c.is_ascii_hexdigit() || c == '\r' || c == '\n');
    let end = json.rfind('}').map_or(json.len(), |i| i + 1);
    let v: serde_json::Value = serde_json::from_str(&json[..end]).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    serde_json::from_value(v["headers"].clone()).unwrap()
}

fn values<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

fn get(path: &str, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nhost: t.example\r\n{HEADER_FUNCTION}: {}\r\nconnection: close\r\n{extra}\r\n",
        header()
    )
}

#[tokio::test]
async fn client_written_forwarding_headers_are_replaced_by_the_real_peer() {
    let w = world(|_| {}).await;
    let lies = "x-forwarded-for: 10.6.6.6\r\nx-forwarded-for: 10.7.7.7\r\nx-forwarded-host: bank.example\r\n\
                x-forwarded-proto: https\r\nforwarded: for=10.6.6.6;proto=https\r\n";
    let a = raw(w.router.addr, &get("/x", lies), false).await;
    assert_eq!(a.status, 200, "{a:?}");
    let h = echoed(&a.body);
    assert_eq!(values(&h, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(values(&h, "x-forwarded-host"), ["t.example"]);
    assert_eq!(values(&h, "x-forwarded-proto"), ["http"]);
    assert_eq!(
        values(&h, "forwarded"),
        ["for=127.0.0.1;host=t.example;proto=http"]
    );
    assert_eq!(values(&h, "host"), ["t.example"]);
    w.router.stop().await;
}

#[tokio::test]
async fn a_trusted_proxy_chain_is_kept_and_the_peer_appended() {
    let w = world(|c| {
        c.trusted_proxies = skipper::router::proxy::TrustedProxies::parse("127.0.0.0/8").unwrap();
    })
    .await;
    let chain = "x-forwarded-for: 198.51.100.7, 10.0.0.1\r\nx-forwarded-host: shop.example\r\n\
                 x-forwarded-proto: https\r\nforwarded: for=1.1.1.1\r\n";
    let a = raw(w.router.addr, &get("/x", chain), false).await;
    assert_eq!(a.status, 200, "{a:?}");
    let h = echoed(&a.body);
    assert_eq!(
        values(&h, "x-forwarded-for"),
        ["198.51.100.7, 10.0.0.1, 127.0.0.1"]
    );
    assert_eq!(values(&h, "x-forwarded-host"), ["shop.example"]);
    assert_eq!(values(&h, "x-forwarded-proto"), ["https"]);
    assert_eq!(
        values(&h, "forwarded"),
        ["for=198.51.100.7, for=10.0.0.1, for=127.0.0.1;host=shop.example;proto=https"]
    );
    // A trusted proxy that sent nothing: the router describes the hop.
    let a = raw(w.router.addr, &get("/x", ""), false).await;
    let h = echoed(&a.body);
    assert_eq!(values(&h, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(values(&h, "x-forwarded-host"), ["t.example"]);
    w.router.stop().await;
}

#[tokio::test]
async fn host_is_required_once_never_stripped_and_an_absolute_target_wins() {
    let w = world(|_| {}).await;
    let f = header();
    let cases = [
        (
            "HTTP/1.1 without Host",
            format!("GET /x HTTP/1.1\r\n{HEADER_FUNCTION}: {f}\r\nconnection: close\r\n\r\n"),
            400,
            "missing Host header (HTTP/1.1 requires one)\n",
        ),
        (
            "two Host headers",
            format!(
                "GET /x HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\n{HEADER_FUNCTION}: {f}\r\nconnection: close\r\n\r\n"
            ),
            400,
            "more than one Host header\n",
        ),
        (
            "the same Host twice",
            format!(
                "GET /x HTTP/1.1\r\nhost: a.example\r\nhost: a.example\r\n{HEADER_FUNCTION}: {f}\r\nconnection: close\r\n\r\n"
            ),
            400,
            "more than one Host header\n",
        ),
        (
            "a Host with userinfo",
            format!(
                "GET /x HTTP/1.1\r\nhost: me@a.example\r\n{HEADER_FUNCTION}: {f}\r\nconnection: close\r\n\r\n"
            ),
            400,
            "invalid Host header \"me@a.example\": not a host and optional port\n",
        ),
        (
            "a health check without Host",
            "GET /healthz HTTP/1.1\r\nconnection: close\r\n\r\n".to_owned(),
            400,
            "missing Host header (HTTP/1.1 requires one)\n",
        ),
    ];
    for (what, request, status, body) in cases {
        let a = raw(w.router.addr, &request, false).await;
        assert_eq!(a.status, status, "{what}: {a:?}");
        assert_eq!(a.body, body, "{what}");
    }
    assert_eq!(
        w.fake.calls("GetInstance"),
        0,
        "refused before any instance is asked for"
    );

    // Connection: Host cannot strip Host on the way to the pod.
    let a = raw(
        w.router.addr,
        &get("/x", "connection: Host, x-drop\r\nx-drop: 1\r\n"),
        false,
    )
    .await;
    assert_eq!(a.status, 200, "{a:?}");
    let h = echoed(&a.body);
    assert_eq!(values(&h, "host"), ["t.example"]);
    assert_eq!(values(&h, "x-forwarded-host"), ["t.example"]);
    assert!(values(&h, "x-drop").is_empty());

    // An absolute-form target names the host (RFC 9112 §3.2.2).
    let request = format!(
        "GET http://target.example/x HTTP/1.1\r\nhost: other.example\r\n{HEADER_FUNCTION}: {f}\r\nconnection: close\r\n\r\n"
    );
    let a = raw(w.router.addr, &request, false).await;
    assert_eq!(a.status, 200, "{a:?}");
    let h = echoed(&a.body);
    assert_eq!(values(&h, "host"), ["target.example"]);
    assert_eq!(values(&h, "x-forwarded-host"), ["target.example"]);

    // HTTP/1.0 may omit Host.
    let request = format!("GET /x HTTP/1.0\r\n{HEADER_FUNCTION}: {f}\r\n\r\n");
    let a = raw(w.router.addr, &request, false).await;
    assert_eq!(a.status, 200, "{a:?}");
    w.router.stop().await;
}

#[tokio::test]
async fn a_client_that_half_closes_after_its_request_gets_the_answer() {
    let w = world(|_| {}).await;
    // Answered at once.
    let a = raw(w.router.addr, &get("/hello", ""), true).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.body, "hello world");
    // A cold request (first GetInstance) and a body, then the half-close.
    let body = "0123456789";
    let request = format!(
        "POST /sink HTTP/1.1\r\nhost: t.example\r\n{HEADER_FUNCTION}: {}\r\ncontent-length: {}\r\n\r\n{body}",
        function_header("app", "t2", false),
        body.len()
    );
    let a = raw(w.router.addr, &request, true).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.body, "10");
    w.router.stop().await;
}

#[tokio::test]
async fn a_client_resetting_its_connection_during_retries_ends_the_request() {
    let w = world(|c| {
        c.max_round_trip_attempts = 1000;
        c.retry_min = Duration::from_millis(20);
        c.retry_max = Duration::from_millis(20);
    })
    .await;
    w.fake.fail("GetInstance", tonic::Code::Internal, 100_000);
    let mut conn = tokio::net::TcpStream::connect(w.router.addr).await.unwrap();
    conn.write_all(get("/x", "").as_bytes()).await.unwrap();
    w.fake.wait_until(LIMIT, harness::in_flight(1)).await;
    // Close with a reset (SO_LINGER 0): the client is gone, not half-closed.
    conn.set_zero_linger().unwrap();
    drop(conn);
    // 1000 attempts would take 20 s; the request ends with the client.
    w.fake
        .wait_until(Duration::from_secs(5), harness::in_flight(0))
        .await;
    let calls = w.fake.calls("GetInstance");
    assert!(calls < 1000, "{calls}");
    w.router.stop().await;
}

/// The head of an upload of `len` bytes to the upstream's `/sink`.
fn upload_head(len: usize) -> String {
    format!(
        "POST /sink HTTP/1.1\r\nhost: x\r\n{HEADER_FUNCTION}: {}\r\ncontent-length: {len}\r\n\r\n",
        header()
    )
}

/// A connection sending `head` and then `drip` one byte every `every`
/// until the router answers; the answer and how long it took.
async fn drip(addr: std::net::SocketAddr, head: &str, every: Duration) -> (Answer, Duration) {
    let started = tokio::time::Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let mut tick = tokio::time::interval(every);
    let mut writing = true;
    loop {
        tokio::select! {
            _ = tick.tick(), if writing => {
                // The router may have answered and closed already: its
                // answer is still to be read.
                if s.write_all(b"x").await.is_err() {
                    writing = false;
                }
            }
            n = s.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"\n") {
                        break;
                    }
                }
            },
        }
        assert!(started.elapsed() < LIMIT * 3, "no answer within {:?}", LIMIT * 3);
    }
    (parse(&out), started.elapsed())
}

#[tokio::test]
async fn an_upload_dripping_below_the_minimum_rate_is_408_within_the_body_timeout() {
    let w = world(|c| {
        c.body_timeout = Some(Duration::from_secs(1));
        c.body_min_rate = std::num::NonZeroU32::new(1000);
    })
    .await;
    let head = upload_head(1000000);
    // One byte every 50 ms: never a pause as long as the timeout, far
    // below the rate.
    let (a, took) = drip(w.router.addr, &head, Duration::from_millis(50)).await;
    assert_eq!(a.status, 408, "{a:?}");
    assert!(
        a.body
            .starts_with("the client sent the request body slower than 1000 bytes/s"),
        "{a:?}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(4),
        "ended after {took:?}"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn a_request_still_uploading_at_the_request_timeout_is_408_and_one_waiting_for_the_pod_504() {
    let w = world(|c| {
        c.request_timeout = Some(Duration::from_millis(800));
        c.body_timeout = None;
    })
    .await;
    let head = upload_head(100);
    let (a, took) = drip(w.router.addr, &head, Duration::from_millis(100)).await;
    assert_eq!(a.status, 408, "{a:?}");
    assert_eq!(
        a.body,
        "the client did not send its request within the request timeout of 800ms\n"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
    let a = raw(w.router.addr, &get("/block", ""), false).await;
    assert_eq!(a.status, 504, "{a:?}");
    w.router.stop().await;
}

#[tokio::test]
async fn a_client_that_reads_nothing_is_cut_off_after_the_write_timeout() {
    let w = world(|c| c.write_timeout = Some(Duration::from_millis(500))).await;
    let mut s = tokio::net::TcpStream::connect(w.router.addr).await.unwrap();
    s.write_all(get("/download/200000000", "").as_bytes())
        .await
        .unwrap();
    w.fake.wait_until(LIMIT, harness::in_flight(1)).await;
    // Not reading: the socket buffers fill and the router's write stalls.
    w.fake.wait_until(LIMIT, harness::in_flight(0)).await;
    // What was buffered is readable, then the connection ends early.
    let mut total = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    let ended = tokio::time::timeout(LIMIT, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => total += n,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the connection is closed");
    assert!(total < 200_000_000, "the download was cut short ({total} bytes)");
    w.router.stop().await;
}

/// The answers read off one connection, in order: status and body (framed
/// by `content-length` or chunked; none where `head` says the request was
/// `HEAD` or the status has none).
fn answers(mut out: &[u8], head: &[bool]) -> Vec<(u16, String)> {
    let mut got = Vec::new();
    for &is_head in head {
        let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
            panic!("answer {} missing: {:?}", got.len(), String::from_utf8_lossy(out));
        };
        let text = String::from_utf8_lossy(&out[..end]).to_lowercase();
        out = &out[end + 4..];
        let status: u16 = text.split(' ').nth(1).unwrap().parse().unwrap();
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
        };
        let mut body = Vec::new();
        if is_head || status == 204 || status == 304 {
        } else if let Some(n) = field("content-length:") {
            let n: usize = n.parse().unwrap();
            body.extend_from_slice(&out[..n]);
            out = &out[n..];
        } else {
            assert_eq!(field("transfer-encoding:").as_deref(), Some("chunked"), "{text}");
            loop {
                let line = out.windows(2).position(|w| w == b"\r\n").unwrap();
                let size = usize::from_str_radix(std::str::from_utf8(&out[..line]).unwrap(), 16).unwrap();
                out = &out[line + 2..];
                if size == 0 {
                    out = &out[2..];
                    break;
                }
                body.extend_from_slice(&out[..size]);
                out = &out[size + 2..];
            }
        }
        got.push((status, String::from_utf8(body).unwrap()));
    }
    assert!(
        out.is_empty(),
        "more than {} answers: {:?}",
        head.len(),
        String::from_utf8_lossy(out)
    );
    got
}

/// Writes `requests` at once on one connection and reads until the router
/// closes it.
async fn pipelined(addr: std::net::SocketAddr, requests: &str) -> Vec<u8> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(requests.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut out))
        .await
        .expect("the router closes the connection after the last answer")
        .unwrap();
    out
}

#[tokio::test]
async fn requests_pipelined_on_one_connection_are_answered_in_order_across_an_upload() {
    let w = world(|_| {}).await;
    let f = header();
    let req = |method: &str, path: &str, extra: &str| {
        format!("{method} {path} HTTP/1.1\r\nhost: t.example\r\n{HEADER_FUNCTION}: {f}\r\n{extra}\r\n")
    };
    // Bodiless requests, then one with a body (from which hyper serves the
    // connection), then bodiless ones again, the last closing.
    let requests = [
        req("GET", "/hello", ""),
        req("GET", "/status/204", ""),
        req("HEAD", "/hello", ""),
        req("GET", "/download/70000", ""),
        req("POST", "/sink", "content-length: 10\r\n") + "0123456789",
        req("GET", "/hello", ""),
        req("GET", "/hello", "connection: close\r\n"),
    ]
    .concat();
    let out = pipelined(w.router.addr, &requests).await;
    let got = answers(&out, &[false, false, true, false, false, false, false]);
    let want: Vec<(u16, String)> = vec![
        (200, "hello world".into()),
        (204, String::new()),
        (200, String::new()),
        (200, "x".repeat(64 * 1024 * 2)),
        (200, "10".into()),
        (200, "hello world".into()),
        (200, "hello world".into()),
    ];
    assert_eq!(got, want);
    w.router.stop().await;
}

#[tokio::test]
async fn a_malformed_or_oversized_head_after_good_requests_is_refused_as_before() {
    let w = world(|_| {}).await;
    let good = format!(
        "GET /hello HTTP/1.1\r\nhost: t.example\r\n{HEADER_FUNCTION}: {}\r\n\r\n",
        header()
    );
    let out = pipelined(
        w.router.addr,
        &format!("{good}GET / HTTP/1.1\r\nbad header\r\n\r\n"),
    )
    .await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("hello world"), "{text}");
    assert!(text.contains("HTTP/1.1 400 Bad Request\r\n"), "{text}");

    let huge = format!("GET /hello HTTP/1.1\r\nx-big: {}\r\n\r\n", "a".repeat(70 * 1024));
    let out = pipelined(w.router.addr, &format!("{good}{huge}")).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(
        text.contains("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{text}"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_closes_after_the_idle_timeout() {
    let idle = Duration::from_millis(400);
    let w = world(|c| c.idle_timeout = idle).await;
    let mut s = tokio::net::TcpStream::connect(w.router.addr).await.unwrap();
    let good = format!(
        "GET /hello HTTP/1.1\r\nhost: t.example\r\n{HEADER_FUNCTION}: {}\r\n\r\n",
        header()
    );
    for _ in 0..3 {
        s.write_all(good.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        while !out.ends_with(b"hello world") {
            let n = tokio::time::timeout(LIMIT, s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(
                n > 0,
                "closed while answering: {:?}",
                String::from_utf8_lossy(&out)
            );
            out.extend_from_slice(&buf[..n]);
        }
    }
    let waited = tokio::time::Instant::now();
    let n = tokio::time::timeout(LIMIT, s.read(&mut [0u8; 16]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "closed, not answered");
    let waited = waited.elapsed();
    assert!(
        waited >= idle - Duration::from_millis(50),
        "closed after {waited:?}"
    );
    w.router.stop().await;
}

#[tokio::test]
async fn a_router_whose_controllers_refuse_its_token_is_unready_answers_503_and_recovers() {
    let w = world(|_| {}).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let health = || async {
        let r = http.get(w.router.url("/healthz")).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    let request = |function: String| {
        http.get(w.router.url("/x"))
            .header(HEADER_FUNCTION, function)
            .send()
    };
    assert_eq!(health().await.0, 200);
    w.fake.refuse(Some(tonic::Code::Unauthenticated));
    let r = request(header()).await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let body = r.text().await.unwrap();
    assert!(
        body.starts_with("the controllers refuse this router's credentials: failed to call GetInstance: ")
            && body.contains("scripted refusal"),
        "{body}"
    );
    let (status, why) = health().await;
    assert_eq!(status, 503);
    assert!(
        why.starts_with("the controller at 127.0.0.1:")
            && why.ends_with("refuses this caller's credentials (Unauthenticated: scripted refusal of the caller's token)\n"),
        "{why}"
    );
    // Accepted again: ready without any request, within a few checks.
    w.fake.refuse(None);
    skipper_test_support::eventually("the router turns ready again", LIMIT, || async {
        (health().await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(request(header()).await.unwrap().status(), 200);
    // PERMISSION_DENIED (another ServiceAccount) is the same.
    w.fake.refuse(Some(tonic::Code::PermissionDenied));
    let cold = function_header("app", "cold", false);
    assert_eq!(request(cold).await.unwrap().status(), 503);
    assert_eq!(health().await.0, 503);
    w.router.stop().await;
}
