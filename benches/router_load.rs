//! Router load benchmark (`make bench-router`).
//!
//! Starts, on loopback, a fake controller (the generated tonic server) and a
//! real HTTP upstream in this process, and the real `skipper router` binary
//! as a child process. Then measures, side by side in the same run, latency
//! (p50, p99) and throughput of `GET /hello` sent directly to the upstream
//! and through the router, at 1 and 32 keep-alive connections, plus the
//! router's CPU time per request (from `/proc/<pid>/stat`). Finally streams
//! 1 GiB down and 1 GiB up through the router and reports its peak RSS.
//!
//! `SKIPPER_BENCH_SECS` sets the measuring time per scenario (default 5).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

#[path = "../tests/common/router.rs"]
mod harness;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Linux reports process CPU times in USER_HZ ticks, 100 per second.
const TICKS_PER_SEC: f64 = 100.0;

struct Outcome {
    requests: usize,
    errors: usize,
    p50: Duration,
    p99: Duration,
    elapsed: Duration,
}

async fn client(addr: SocketAddr) -> http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    sender
}

/// `conns` connections each sending requests back to back for `secs`.
async fn load(addr: SocketAddr, header: Option<&str>, conns: usize, secs: Duration) -> Outcome {
    let start = Instant::now();
    let end = start + secs;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let header = header.map(str::to_owned);
        tasks.push(tokio::spawn(async move {
            let mut sender = client(addr).await;
            let mut lat = Vec::with_capacity(100_000);
            let mut errors = 0;
            while Instant::now() < end {
                let mut req = http::Request::get("/hello").header("host", addr.to_string());
                if let Some(h) = &header {
                    req = req.header("x-skipper-function", h.as_str());
                }
                let req = req.body(Full::new(Bytes::new())).unwrap();
                let t0 = Instant::now();
                if sender.ready().await.is_err() {
                    sender = client(addr).await;
                    errors += 1;
                    continue;
                }
                match sender.send_request(req).await {
                    Ok(resp) => {
                        let ok = resp.status().is_success();
                        let _ = resp.into_body().collect().await;
                        if ok {
                            lat.push(t0.elapsed());
                        } else {
                            errors += 1;
                        }
                    }
                    Err(_) => {
                        errors += 1;
                        sender = client(addr).await;
                    }
                }
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (lat, e) = t.await.unwrap();
        all.extend(lat);
        errors += e;
    }
    let elapsed = start.elapsed();
    all.sort();
    let pct = |p: f64| {
        if all.is_empty() {
            Duration::ZERO
        } else {
            let i = ((all.len() as f64 * p).ceil() as usize).clamp(1, all.len()) - 1;
            all[i]
        }
    };
    Outcome {
        requests: all.len(),
        errors,
        p50: pct(0.50),
        p99: pct(0.99),
        elapsed,
    }
}

fn proc_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn proc_status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_healthy(addr: SocketAddr) {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(stream) = tokio::net::TcpStream::connect(addr).await
                && let Ok((mut s, conn)) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await
            {
                tokio::spawn(conn);
                let req = http::Request::get("/healthz")
                    .header("host", "x")
                    .body(Empty::new())
                    .unwrap();
                if s.send_request(req).await.is_ok_and(|r| r.status() == 200) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("router did not become healthy");
}

async fn stream_gib(router: SocketAddr, header: &str) -> (Duration, Duration) {
    const GIB: usize = 1 << 30;
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let t0 = Instant::now();
    let resp = c
        .get(format!("http://{router}/download/{GIB}"))
        .header("x-skipper-function", header)
        .send()
        .await
        .unwrap();
    let mut s = resp.bytes_stream();
    let mut n = 0;
    while let Some(chunk) = futures::StreamExt::next(&mut s).await {
        n += chunk.unwrap().len();
    }
    assert_eq!(n, GIB);
    let down = t0.elapsed();

    let chunk = Bytes::from(vec![7u8; 1 << 20]);
    let body = futures::stream::iter((0..1024).map(move |_| Ok::<_, std::io::Error>(chunk.clone())));
    let t0 = Instant::now();
    let resp = c
        .post(format!("http://{router}/sink"))
        .header("x-skipper-function", header)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.text().await.unwrap(), GIB.to_string());
    (down, t0.elapsed())
}

fn row(name: &str, o: &Outcome) -> f64 {
    let rps = o.requests as f64 / o.elapsed.as_secs_f64();
    println!(
        "{name:<24} {:>10.0} {:>10.1} {:>10.1} {:>10} {:>7}",
        rps,
        o.p50.as_secs_f64() * 1e6,
        o.p99.as_secs_f64() * 1e6,
        o.requests,
        o.errors
    );
    rps
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let secs = std::env::var("SKIPPER_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5u64);
    let secs = Duration::from_secs(secs);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let stop = CancellationToken::new();
        let fake = harness::FakeController::new();
        let ctrl = fake.serve(stop.clone()).await;
        let upstream = harness::start_upstream().await;
        fake.add_instance("pod-1", upstream.addr);

        let port = free_port();
        let router_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .args([
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--pod-ip",
                "127.0.0.1",
                "--controller-service-host",
                "127.0.0.1",
                "--controller-port",
                &ctrl.port().to_string(),
                "--log-level",
                "warn",
            ])
            .env_clear()
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start skipper router");
        let pid = child.id().unwrap();
        wait_healthy(router_addr).await;
        let header = harness::function_header("bench", "t1", false);

        // Warm up both paths.
        load(upstream.addr, None, 4, Duration::from_millis(500)).await;
        load(router_addr, Some(&header), 4, Duration::from_millis(500)).await;

        println!(
            "\nrouter load benchmark: GET /hello, {}s per scenario, loopback, in-process load generator",
            secs.as_secs()
        );
        println!(
            "{:<24} {:>10} {:>10} {:>10} {:>10} {:>7}",
            "scenario", "req/s", "p50 µs", "p99 µs", "requests", "errors"
        );
        let mut router_requests = 0;
        let mut router_ticks = 0;
        for conns in [1usize, 32] {
            let direct = load(upstream.addr, None, conns, secs).await;
            let d = row(&format!("direct  c={conns}"), &direct);
            let before = proc_cpu_ticks(pid);
            let via = load(router_addr, Some(&header), conns, secs).await;
            router_ticks += proc_cpu_ticks(pid) - before;
            router_requests += via.requests;
            let r = row(&format!("router  c={conns}"), &via);
            println!(
                "{:<24} throughput {:.2}x of direct, p50 +{:.0} µs, p99 +{:.0} µs",
                format!("ratio   c={conns}"),
                r / d,
                (via.p50.as_secs_f64() - direct.p50.as_secs_f64()) * 1e6,
                (via.p99.as_secs_f64() - direct.p99.as_secs_f64()) * 1e6,
            );
        }
        let cpu = router_ticks as f64 / TICKS_PER_SEC;
        println!(
            "router CPU: {cpu:.2} s for {router_requests} requests = {:.1} µs per request (incl. one GetInstance RPC each)",
            cpu / router_requests.max(1) as f64 * 1e6
        );
        println!(
            "fake controller GetInstance calls: {}",
            fake.calls("GetInstance")
        );

        let rss_before = proc_status_kib(pid, "VmRSS:");
        let (down, up) = stream_gib(router_addr, &header).await;
        let hwm = proc_status_kib(pid, "VmHWM:");
        let rss_after = proc_status_kib(pid, "VmRSS:");
        println!(
            "1 GiB through the router: download {:.2} s ({:.0} MiB/s), upload {:.2} s ({:.0} MiB/s)",
            down.as_secs_f64(),
            1024.0 / down.as_secs_f64(),
            up.as_secs_f64(),
            1024.0 / up.as_secs_f64()
        );
        println!(
            "router RSS: {} KiB before, {} KiB after, peak {} KiB",
            rss_before, rss_after, hwm
        );

        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("router did not exit after SIGTERM")
            .unwrap();
        println!("router exit after SIGTERM: {status}");
        stop.cancel();
    });
}
