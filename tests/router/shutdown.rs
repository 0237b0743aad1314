//! A router process stopped with SIGTERM under keep-alive load fails no
//! request. Ten clients keep one connection each and send 5 requests a
//! second through router A, as a Service's clients do; a watcher plays the
//! endpoints controller, sending new connections to router B once A's
//! `/healthz` stops answering 200. With `--shutdown-delay`, A keeps serving
//! for the delay and answers every request with `Connection: close`, so
//! each client reconnects (to B) after a complete answer; without it (0s,
//! the default), A closes idle kept-alive connections at once and each
//! client's next request on its connection fails with nothing read.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use skipper_test_support::router as harness;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const CLIENTS: usize = 10;
const PERIOD: Duration = Duration::from_millis(200);

/// A free port on 127.0.0.1 for a child process to bind.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `skipper router` process on `port` in front of the fake controller, on
/// one thread.
fn spawn_router(port: u16, controller: SocketAddr, delay: &str) -> tokio::process::Child {
    tokio::process::Command::new(skipper_test_support::skipper_exe())
        .args([
            "router",
            "--host",
            "127.0.0.1",
            "--pod-ip",
            "127.0.0.1",
            "--controller-service-host",
            "127.0.0.1",
        ])
        .args([
            "--port",
            &port.to_string(),
            "--controller-port",
            &controller.port().to_string(),
        ])
        .args([
            "--controller-token-file",
            "",
            "--pprof",
            "false",
            "--log-format",
            "text",
        ])
        .args(["--shutdown-delay", delay, "--shutdown-timeout", "5s"])
        // One CPU, as a router pod with a one-CPU limit has: the
        // one-thread runtime drains like the multi-threaded one (the
        // in-process suites run the router on the latter).
        .env("TOKIO_WORKER_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn healthy(addr: SocketAddr) -> bool {
    let Ok(s) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let Ok((mut send, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await else {
        return false;
    };
    tokio::spawn(conn);
    let req = http::Request::get("/healthz")
        .header("host", "router")
        .body(Empty::<Bytes>::new())
        .unwrap();
    matches!(send.send_request(req).await, Ok(r) if r.status() == 200)
}

#[derive(Debug, Default)]
struct Counts {
    sent: AtomicUsize,
    failed: AtomicUsize,
    closes: AtomicUsize,
    /// Requests answered by router B.
    moved: AtomicUsize,
}

/// One client: a kept-alive connection to A (B once A is unready), a new
/// one whenever an answer says `Connection: close`, until `stop`.
async fn client(
    a: SocketAddr,
    b: SocketAddr,
    a_unready: Arc<AtomicBool>,
    counts: Arc<Counts>,
    header: String,
    stop: CancellationToken,
) -> Vec<String> {
    let mut errors = Vec::new();
    let mut conn: Option<(hyper::client::conn::http1::SendRequest<Empty<Bytes>>, bool)> = None;
    let mut next = Instant::now();
    while !stop.is_cancelled() {
        tokio::time::sleep_until(next).await;
        next += PERIOD;
        if conn.is_none() {
            let to_b = a_unready.load(Ordering::SeqCst);
            let Ok(s) = tokio::net::TcpStream::connect(if to_b { b } else { a }).await else {
                counts.failed.fetch_add(1, Ordering::SeqCst);
                errors.push("connect refused".to_owned());
                continue;
            };
            let (send, c) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .unwrap();
            tokio::spawn(c);
            conn = Some((send, to_b));
        }
        let (send, to_b) = conn.as_mut().unwrap();
        let to_b = *to_b;
        let req = http::Request::get("/hello")
            .header("host", "tenant.example")
            .header("x-skipper-function", &header)
            .body(Empty::<Bytes>::new())
            .unwrap();
        counts.sent.fetch_add(1, Ordering::SeqCst);
        match send.send_request(req).await {
            Ok(resp) => {
                let close = resp
                    .headers()
                    .get(http::header::CONNECTION)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
                let status = resp.status();
                let body = resp.into_body().collect().await.map(|b| b.to_bytes());
                if status != 200 || body.as_deref().ok() != Some(&b"hello world"[..]) {
                    counts.failed.fetch_add(1, Ordering::SeqCst);
                    errors.push(format!("{status} {body:?}"));
                }
                if to_b {
                    counts.moved.fetch_add(1, Ordering::SeqCst);
                }
                if close {
                    counts.closes.fetch_add(1, Ordering::SeqCst);
                    conn = None;
                }
            }
            Err(e) => {
                // Sent on a connection the last answer kept alive: a failed request.
                counts.failed.fetch_add(1, Ordering::SeqCst);
                errors.push(e.to_string());
                conn = None;
            }
        }
    }
    errors
}

/// `(sent, failed, connection: close answers, answered by B, A's exit after SIGTERM)`.
async fn sigterm_under_keep_alive_load(delay: &str) -> (usize, usize, usize, usize, Duration, Vec<String>) {
    let upstream = harness::start_upstream().await;
    let fake = harness::FakeController::new();
    fake.add_instance("pod-1", upstream.addr);
    let stop_fake = CancellationToken::new();
    let controller = fake.serve(stop_fake.clone()).await;
    let (pa, pb) = (free_port(), free_port());
    let a: SocketAddr = format!("127.0.0.1:{pa}").parse().unwrap();
    let b: SocketAddr = format!("127.0.0.1:{pb}").parse().unwrap();
    let mut router_a = spawn_router(pa, controller, delay);
    let mut router_b = spawn_router(pb, controller, "0s");
    for addr in [a, b] {
        skipper_test_support::eventually(
            &format!("router {addr} healthy"),
            Duration::from_secs(30),
            || async move { healthy(addr).await.then_some(()) },
        )
        .await;
    }
    let header = harness::function_header("dep", "t1", false);

    // The endpoints controller: B only, once A stops answering /healthz 200.
    let a_unready = Arc::new(AtomicBool::new(false));
    let watcher_stop = CancellationToken::new();
    let watcher = {
        let (flag, stop) = (a_unready.clone(), watcher_stop.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(50));
            while !stop.is_cancelled() {
                every.tick().await;
                if !healthy(a).await {
                    flag.store(true, Ordering::SeqCst);
                    return;
                }
            }
        })
    };
    let counts = Arc::new(Counts::default());
    let stop = CancellationToken::new();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            tokio::spawn(client(
                a,
                b,
                a_unready.clone(),
                counts.clone(),
                header.clone(),
                stop.clone(),
            ))
        })
        .collect();
    // Every client has a kept-alive connection with answers behind it.
    skipper_test_support::eventually("three rounds of requests", Duration::from_secs(10), || {
        let counts = counts.clone();
        async move { (counts.sent.load(Ordering::SeqCst) >= 3 * CLIENTS).then_some(()) }
    })
    .await;

    let pid = nix::unistd::Pid::from_raw(i32::try_from(router_a.id().unwrap()).unwrap());
    let term = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), router_a.wait())
        .await
        .expect("router A exits within 30 s of SIGTERM")
        .unwrap();
    let exited = term.elapsed();
    assert!(status.success(), "router A exited with {status}");
    // Two more rounds after A is gone, all on B.
    let after = counts.sent.load(Ordering::SeqCst);
    skipper_test_support::eventually("two rounds on router B", Duration::from_secs(10), || {
        let counts = counts.clone();
        async move { (counts.sent.load(Ordering::SeqCst) >= after + 2 * CLIENTS).then_some(()) }
    })
    .await;
    stop.cancel();
    watcher_stop.cancel();
    let mut errors = Vec::new();
    for c in clients {
        errors.extend(
            tokio::time::timeout(Duration::from_secs(10), c)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let _ = watcher.await;
    let _ = router_b.start_kill();
    let _ = router_b.wait().await;
    stop_fake.cancel();
    (
        counts.sent.load(Ordering::SeqCst),
        counts.failed.load(Ordering::SeqCst),
        counts.closes.load(Ordering::SeqCst),
        counts.moved.load(Ordering::SeqCst),
        exited,
        errors,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_stopped_with_sigterm_under_keep_alive_load_fails_no_request() {
    let (sent0, failed0, _, _, exit0, _) = sigterm_under_keep_alive_load("0s").await;
    let (sent, failed, closes, moved, exited, errors) = sigterm_under_keep_alive_load("2s").await;
    println!(
        "router SIGTERM under keep-alive load ({CLIENTS} connections, {} req/s): \
         --shutdown-delay 0s: {failed0} of {sent0} requests failed (exit after {exit0:?}); \
         --shutdown-delay 2s: {failed} of {sent} failed, {closes} answers with Connection: close, \
         {moved} answered by the other router (exit after {exited:?})",
        CLIENTS * 5
    );
    assert_eq!(failed, 0, "failed requests with --shutdown-delay 2s: {errors:?}");
    assert!(closes >= CLIENTS, "every client was told to close: {closes}");
    assert!(moved >= 2 * CLIENTS, "the clients moved to router B: {moved}");
    assert!(
        exited >= Duration::from_secs(2) && exited < Duration::from_secs(10),
        "router A served through its delay and then stopped: {exited:?}"
    );
}
