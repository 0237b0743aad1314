//! Slow-client benchmark (`make bench-slow`).
//!
//! Starts, on loopback, a fake controller and a real HTTP upstream in this
//! process and the real `skipper router` binary with its default bounds
//! (`--body-min-rate 256` B/s within `--body-timeout 30s`,
//! `--request-timeout 5m`), then measures in one run:
//!
//! - `idle`: 50 requests per second, open loop (each sent on time whatever
//!   the others do), to 10 tenants: p50, p99, errors;
//! - `slow`: the same load while 50 uploads, each on its own connection,
//!   announce `Content-Length: 1048576` and send one byte every 5 s:
//!   p50, p99, errors, and for the uploads how long each stayed open and
//!   what ended it (the router's `408`, or the connection closing).
//!
//! It prints the p99 ratio `slow / idle` and the router's open file
//! descriptors and RSS before, during and after the uploads, and fails when
//! an upload is not ended within `--body-timeout` and 5 s, or when the p99
//! ratio is above 2 (`SKIPPER_BENCH_SECS` sets the idle measurement, default
//! 20 s; the slow one lasts until every upload has ended).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::router as harness;
use skipper_test_support::router_process::start_router;

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Tenants of the steady load.
const TENANTS: usize = 10;
/// Requests per second of the steady load.
const RATE: u64 = 50;
/// Dripping uploads.
const UPLOADS: usize = 50;
/// What each upload announces.
const UPLOAD_LEN: usize = 1 << 20;
/// One byte this often.
const DRIP_EVERY: Duration = Duration::from_secs(5);
/// The router's default `--body-timeout`: a dripping body ends about this
/// long after it started.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Slack on that bound for a loaded machine.
const END_SLACK: Duration = Duration::from_secs(5);
/// Bound on p99 under the uploads, as a multiple of the idle p99.
const P99_RATIO: f64 = 2.0;

/// Latencies and errors of a steady load.
#[derive(Debug, Default)]
struct Steady {
    latencies: Vec<Duration>,
    errors: usize,
}

impl Steady {
    fn quantile(&self, q: f64) -> Duration {
        let mut v = self.latencies.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    }

    fn line(&self, name: &str) -> String {
        format!(
            "{name:<6} {:>6} requests  p50 {:>8.2?}  p99 {:>8.2?}  errors {}",
            self.latencies.len(),
            self.quantile(0.5),
            self.quantile(0.99),
            self.errors
        )
    }
}

/// `RATE` requests per second, each on time, until `stop`; each request's
/// time to its whole answer.
async fn steady(router: std::net::SocketAddr, stop: CancellationToken) -> Steady {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let headers: Arc<Vec<String>> = Arc::new(
        (0..TENANTS)
            .map(|i| harness::function_header("bench", &format!("steady-{i}"), false))
            .collect(),
    );
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut set = tokio::task::JoinSet::new();
    for i in 0.. {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (http, headers) = (http.clone(), headers.clone());
        set.spawn(async move {
            let t0 = Instant::now();
            let sent = http
                .get(format!("http://{router}/hello"))
                .header("X-Skipper-Function", &headers[i % TENANTS])
                .timeout(Duration::from_secs(30))
                .send()
                .await;
            let ok = match sent {
                Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                _ => false,
            };
            (ok, t0.elapsed())
        });
    }
    let mut out = Steady::default();
    while let Some(r) = set.join_next().await {
        let (ok, took) = r.unwrap();
        if ok {
            out.latencies.push(took);
        } else {
            out.errors += 1;
        }
    }
    out
}

/// How an upload ended: after how long, and the status line the router
/// sent (empty when the connection closed without one).
async fn upload(router: std::net::SocketAddr, i: usize) -> (Duration, String) {
    let header = harness::function_header("bench", &format!("slow-{}", i % TENANTS), false);
    let mut s = tokio::net::TcpStream::connect(router).await.unwrap();
    let t0 = Instant::now();
    let head = format!(
        "POST /sink HTTP/1.1\r\nHost: bench\r\nX-Skipper-Function: {header}\r\nContent-Length: {UPLOAD_LEN}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut r, mut w) = s.into_split();
    let answer = async {
        let mut buf = vec![0u8; 4096];
        let n = r.read(&mut buf).await.unwrap_or(0);
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let drip = async {
        loop {
            tokio::time::sleep(DRIP_EVERY).await;
            if w.write_all(b"x").await.is_err() {
                // The router closed its side; the answer (if any) is read.
                std::future::pending::<()>().await;
            }
        }
    };
    let limit = BODY_TIMEOUT + END_SLACK + Duration::from_secs(60);
    let line = tokio::time::timeout(limit, async {
        tokio::select! {
            line = answer => line,
            () = drip => unreachable!(),
        }
    })
    .await
    .unwrap_or_else(|_| "still open".to_owned());
    (t0.elapsed(), line)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn main() {
    let secs = std::env::var("SKIPPER_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(20), Duration::from_secs);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let stop = CancellationToken::new();
        let fake = harness::FakeController::new();
        fake.enable_streams();
        let ctrl = fake.serve(stop.clone()).await;
        let upstream = harness::start_upstream().await;
        fake.add_instance("pod-1", upstream.addr);
        let router = start_router(env!("CARGO_BIN_EXE_skipper"), ctrl, &[]).await;
        let pid = router.pid;

        // Warm every tenant's instance.
        let warm = CancellationToken::new();
        let w = tokio::spawn(steady(router.addr, warm.clone()));
        tokio::time::sleep(Duration::from_secs(2)).await;
        warm.cancel();
        w.await.unwrap();

        let (fds_idle, rss_idle) = (open_fds(pid), rss_mib(pid));
        let done = CancellationToken::new();
        let idle = tokio::spawn(steady(router.addr, done.clone()));
        tokio::time::sleep(secs).await;
        done.cancel();
        let idle = idle.await.unwrap();

        let done = CancellationToken::new();
        let load = tokio::spawn(steady(router.addr, done.clone()));
        let uploads: Vec<_> = (0..UPLOADS)
            .map(|i| tokio::spawn(upload(router.addr, i)))
            .collect();
        // Sampled while every upload is open (well before the first can end).
        tokio::time::sleep(Duration::from_secs(10)).await;
        let (fds_slow, rss_slow) = (open_fds(pid), rss_mib(pid));
        let mut ended = Vec::new();
        for u in uploads {
            ended.push(u.await.unwrap());
        }
        done.cancel();
        let slow = load.await.unwrap();
        let (fds_after, rss_after) = (open_fds(pid), rss_mib(pid));

        println!("slow clients: {RATE} req/s to {TENANTS} tenants, {UPLOADS} uploads of one byte every {DRIP_EVERY:?}");
        println!("{}", idle.line("idle"));
        println!("{}", slow.line("slow"));
        let ratio = slow.quantile(0.99).as_secs_f64() / idle.quantile(0.99).as_secs_f64().max(1e-6);
        println!("p99 slow / idle: {ratio:.2} (bound {P99_RATIO})");
        let longest = ended.iter().map(|(d, _)| *d).max().unwrap_or_default();
        let shortest = ended.iter().map(|(d, _)| *d).min().unwrap_or_default();
        let mut how: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
        for (_, line) in &ended {
            *how.entry(if line.is_empty() { "closed without an answer" } else { line.as_str() })
                .or_default() += 1;
        }
        println!("uploads ended after {shortest:.1?} to {longest:.1?}: {how:?}");
        println!(
            "router: {fds_idle} fds {rss_idle:.1} MiB idle, {fds_slow} fds {rss_slow:.1} MiB with the uploads open, \
             {fds_after} fds {rss_after:.1} MiB after"
        );
        router.stop().await;
        stop.cancel();

        assert!(
            longest <= BODY_TIMEOUT + END_SLACK,
            "an upload stayed open {longest:?}, bound {:?}",
            BODY_TIMEOUT + END_SLACK
        );
        assert_eq!(idle.errors + slow.errors, 0, "steady requests failed");
        assert!(ratio <= P99_RATIO, "p99 under the uploads is {ratio:.2}× the idle p99");
    });
}
