//! Router load benchmark (`make bench-router`).
//!
//! Starts, on loopback, a fake controller (the generated tonic server, with
//! `WatchInstances` served) and a real HTTP upstream in this process, then
//! compares in one run `GET /hello` sent:
//!
//! - `direct`: to the upstream;
//! - `minimal`: through a minimal hyper reverse proxy written for this
//!   bench (a pooled `hyper-util` client, nothing else), run as a separate
//!   process (this executable with `--minimal-proxy`);
//! - `nginx`: through `nginx` with a keep-alive upstream, when `nginx` is
//!   installed (skipped with a note otherwise);
//! - `router`: through the real `skipper router` binary, its instance table
//!   warm;
//! - `baseline`: through another `skipper` binary, when
//!   `SKIPPER_BENCH_BASELINE=/path/to/skipper` names one (for before/after
//!   figures in the same run);
//!
//! at 1 and 32 keep-alive connections: req/s, p50, p99, and ratios against
//! the minimal proxy and nginx. Load comes from `wrk` when installed
//! (`SKIPPER_BENCH_LOADGEN=builtin` forces the in-process generator).
//! Rounds (`SKIPPER_BENCH_ROUNDS`, default 1) interleave the targets; the
//! table shows medians. The bench asserts that the router made no
//! controller RPC for requests during its warm runs (its
//! `skipper_router_controller_calls_total` and the fake's GetInstance
//! count), then reports the router's CPU per request and streams 1 GiB
//! each way with the router's peak RSS.
//!
//! `SKIPPER_BENCH_SECS` sets the measuring time per scenario (default 5).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::router as harness;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
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
const CONNS: [usize; 2] = [1, 32];

#[derive(Debug, Clone, Copy)]
struct Outcome {
    rps: f64,
    p50: Duration,
    p99: Duration,
    requests: usize,
    errors: usize,
}

// === load generators ===

async fn client(addr: SocketAddr) -> http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    sender
}

/// `conns` connections each sending requests back to back for `secs`.
async fn builtin(addr: SocketAddr, header: Option<&str>, conns: usize, secs: Duration) -> Outcome {
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
        rps: all.len() as f64 / elapsed.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
        requests: all.len(),
        errors,
    }
}

/// `12.34us`, `1.20ms`, `2.00s` → duration.
fn wrk_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
    let v: f64 = num.parse().ok()?;
    let secs = match unit {
        "us" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// Runs `wrk --latency` and reads its report.
async fn wrk(addr: SocketAddr, header: Option<&str>, conns: usize, secs: Duration) -> Outcome {
    let mut cmd = tokio::process::Command::new("wrk");
    cmd.args([
        "--latency",
        "-t",
        &conns.min(2).to_string(),
        "-c",
        &conns.to_string(),
        "-d",
        &format!("{}s", secs.as_secs()),
    ]);
    if let Some(h) = header {
        cmd.args(["-H", &format!("X-Skipper-Function: {h}")]);
    }
    cmd.arg(format!("http://{addr}/hello"));
    let out = cmd.stderr(Stdio::inherit()).output().await.expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut o = Outcome {
        rps: 0.0,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        requests: 0,
        errors: 0,
    };
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["50%", v] => o.p50 = wrk_duration(v).unwrap_or_default(),
            ["99%", v] => o.p99 = wrk_duration(v).unwrap_or_default(),
            ["Requests/sec:", v] => o.rps = v.parse().unwrap_or(0.0),
            [n, "requests", "in", ..] => o.requests = n.parse().unwrap_or(0),
            ["Non-2xx", "or", "3xx", "responses:", n] => o.errors += n.parse::<usize>().unwrap_or(0),
            ["Socket", "errors:", rest @ ..] => {
                o.errors += rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<usize>().ok())
                    .sum::<usize>();
            }
            _ => {}
        }
    }
    assert!(o.requests > 0, "wrk reported nothing:\n{text}");
    o
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadGen {
    Wrk,
    Builtin,
}

async fn load(
    loadgen: LoadGen,
    addr: SocketAddr,
    header: Option<&str>,
    conns: usize,
    secs: Duration,
) -> Outcome {
    match loadgen {
        LoadGen::Wrk => wrk(addr, header, conns, secs).await,
        LoadGen::Builtin => builtin(addr, header, conns, secs).await,
    }
}

// === the minimal proxy (this executable with `--minimal-proxy`) ===

/// A reverse proxy with nothing but a pooled hyper client: the lower bound
/// for a Rust proxy on this machine.
fn minimal_proxy(listen: SocketAddr, upstream: SocketAddr) {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_nodelay(true);
        let client: Client<_, hyper::body::Incoming> = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(256)
            .build(connector);
        let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            stream.set_nodelay(true).unwrap();
            let client = client.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                    let client = client.clone();
                    async move {
                        let path = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
                        *req.uri_mut() = format!("http://{upstream}{path}").parse().unwrap();
                        client.request(req).await
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

// === processes ===

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

async fn wait_healthy(addr: SocketAddr, what: &str) {
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
    .unwrap_or_else(|_| panic!("{what} did not become healthy"));
}

struct Router {
    child: tokio::process::Child,
    pid: u32,
    addr: SocketAddr,
    metrics: SocketAddr,
}

async fn start_router(exe: &str, controller: SocketAddr) -> Router {
    let port = free_port();
    let metrics_port = free_port();
    let child = tokio::process::Command::new(exe)
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
            &controller.port().to_string(),
            "--log-level",
            "warn",
            "--telemetry",
            "--telemetry-prometheus-host",
            "127.0.0.1",
            "--telemetry-prometheus-port",
            &metrics_port.to_string(),
        ])
        .env_clear()
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start skipper router");
    let pid = child.id().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_healthy(addr, "the router").await;
    Router {
        child,
        pid,
        addr,
        metrics: format!("127.0.0.1:{metrics_port}").parse().unwrap(),
    }
}

impl Router {
    /// The sum of `skipper_router_controller_calls_total`, `None` when the
    /// router does not export it.
    async fn controller_calls(&self) -> Option<f64> {
        let text = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("http://{}/metrics", self.metrics))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("skipper_router_controller_calls_total"))
            .collect();
        if !text.contains("skipper_router_controller_calls") {
            return None;
        }
        Some(
            lines
                .iter()
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
        )
    }

    async fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.pid).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("router did not exit after SIGTERM")
            .unwrap();
        println!("router exit after SIGTERM: {status}");
    }
}

/// nginx as a plain reverse proxy with a keep-alive upstream pool.
async fn start_nginx(upstream: SocketAddr) -> Option<(tokio::process::Child, SocketAddr, PathBuf)> {
    let exe = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("skipper-bench-nginx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = format!(
        "worker_processes 2;\n\
         error_log {d}/error.log warn;\n\
         pid {d}/nginx.pid;\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n\
           access_log off;\n\
           client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
           upstream up {{ server {upstream}; keepalive 64; }}\n\
           server {{\n\
             listen 127.0.0.1:{port};\n\
             location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n\
           }}\n\
         }}\n",
        d = dir.display()
    );
    std::fs::write(dir.join("nginx.conf"), conf).unwrap();
    let child = tokio::process::Command::new(exe)
        .args([
            "-p",
            &dir.display().to_string(),
            "-c",
            &dir.join("nginx.conf").display().to_string(),
        ])
        .args(["-g", "daemon off;"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .ok()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_healthy(addr, "nginx").await;
    Some((child, addr, dir))
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

// === report ===

fn median_by(v: &[Outcome], key: impl Fn(&Outcome) -> f64) -> f64 {
    let mut xs: Vec<f64> = v.iter().map(key).collect();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

struct Summary {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    errors: usize,
}

fn summarize(v: &[Outcome]) -> Summary {
    Summary {
        rps: median_by(v, |o| o.rps),
        p50_us: median_by(v, |o| o.p50.as_secs_f64() * 1e6),
        p99_us: median_by(v, |o| o.p99.as_secs_f64() * 1e6),
        errors: v.iter().map(|o| o.errors).sum(),
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(i) = argv.iter().position(|a| a == "--minimal-proxy") {
        minimal_proxy(argv[i + 1].parse().unwrap(), argv[i + 2].parse().unwrap());
        return;
    }
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let secs = Duration::from_secs(
        env("SKIPPER_BENCH_SECS")
            .and_then(|s| s.parse().ok())
            .unwrap_or(5),
    );
    let rounds: usize = env("SKIPPER_BENCH_ROUNDS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    let baseline = env("SKIPPER_BENCH_BASELINE");
    let have_wrk = std::process::Command::new("wrk")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    let loadgen = if env("SKIPPER_BENCH_LOADGEN").as_deref() == Some("builtin") || !have_wrk {
        LoadGen::Builtin
    } else {
        LoadGen::Wrk
    };
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
        let header = harness::function_header("bench", "t1", false);

        let minimal_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let _minimal = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--minimal-proxy", &minimal_addr.to_string(), &upstream.addr.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start the minimal proxy");
        wait_healthy(minimal_addr, "the minimal proxy").await;
        let nginx = start_nginx(upstream.addr).await;
        let router = start_router(env!("CARGO_BIN_EXE_skipper"), ctrl).await;
        let base = match &baseline {
            Some(exe) => Some(start_router(exe, ctrl).await),
            None => None,
        };

        let mut targets: Vec<(&str, SocketAddr, Option<&str>)> = vec![
            ("direct", upstream.addr, None),
            ("minimal", minimal_addr, None),
        ];
        if let Some((_, addr, _)) = &nginx {
            targets.push(("nginx", *addr, None));
        }
        targets.push(("router", router.addr, Some(header.as_str())));
        if let Some(b) = &base {
            targets.push(("baseline", b.addr, Some(header.as_str())));
        }

        // Warm up every path (the router's table fills from its stream).
        for (_, addr, h) in &targets {
            builtin(*addr, *h, 4, Duration::from_millis(500)).await;
        }
        let calls_before = router.controller_calls().await.expect("the router exports skipper_router_controller_calls");
        let fake_before = fake.calls("GetInstance");

        println!(
            "\nrouter load benchmark: GET /hello, {}s per scenario, {} round(s), load from {}, loopback; load average at start {}",
            secs.as_secs(),
            rounds,
            if loadgen == LoadGen::Wrk { "wrk" } else { "the in-process generator" },
            load_average()
        );
        if nginx.is_none() {
            println!("note: nginx is not installed; its rows are skipped (apt-get install -y nginx-light)");
        }
        let mut results: BTreeMap<(usize, usize), Vec<Outcome>> = BTreeMap::new();
        let mut router_requests = 0;
        let mut router_ticks = 0;
        let mut fake_during_base = 0;
        for _ in 0..rounds {
            for conns in CONNS {
                for (i, (name, addr, h)) in targets.iter().enumerate() {
                    let ticks = (*name == "router").then(|| proc_cpu_ticks(router.pid));
                    let fake0 = fake.calls("GetInstance");
                    let o = load(loadgen, *addr, *h, conns, secs).await;
                    if let Some(t) = ticks {
                        router_ticks += proc_cpu_ticks(router.pid) - t;
                        router_requests += o.requests;
                    }
                    if *name == "baseline" {
                        fake_during_base += fake.calls("GetInstance") - fake0;
                    }
                    results.entry((conns, i)).or_default().push(o);
                }
            }
        }
        let calls_after = router.controller_calls().await.unwrap();
        let fake_router = fake.calls("GetInstance") - fake_before - fake_during_base;
        println!("load average at end {}", load_average());

        println!(
            "\n{:<10} {:>3} {:>10} {:>9} {:>9} {:>9} {:>7}",
            "target", "c", "req/s", "p50 µs", "p99 µs", "+p50 µs", "errors"
        );
        let mut by: BTreeMap<(&str, usize), Summary> = BTreeMap::new();
        for conns in CONNS {
            let direct_p50 = summarize(&results[&(conns, 0)]).p50_us;
            for (i, (name, _, _)) in targets.iter().enumerate() {
                let s = summarize(&results[&(conns, i)]);
                println!(
                    "{:<10} {:>3} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>7}",
                    name,
                    conns,
                    s.rps,
                    s.p50_us,
                    s.p99_us,
                    s.p50_us - direct_p50,
                    s.errors
                );
                by.insert((name, conns), s);
            }
        }
        println!();
        let added = |name: &str, c: usize| by[&(name, c)].p50_us - by[&("direct", c)].p50_us;
        for proxy in ["router", "baseline"] {
            if !by.contains_key(&(proxy, 1)) {
                continue;
            }
            for reference in ["minimal", "nginx"] {
                if !by.contains_key(&(reference, 1)) {
                    continue;
                }
                println!(
                    "{proxy:<8} vs {reference:<7}: added p50 at c=1 {:.2}x ({:.0} vs {:.0} µs); throughput at c=1 {:.2}x, at c=32 {:.2}x",
                    added(proxy, 1) / added(reference, 1).max(1.0),
                    added(proxy, 1),
                    added(reference, 1),
                    by[&(proxy, 1)].rps / by[&(reference, 1)].rps,
                    by[&(proxy, 32)].rps / by[&(reference, 32)].rps,
                );
            }
        }
        println!(
            "targets (router vs minimal): added p50 at c=1 <= 1.5x, throughput at c=32 >= 0.8x"
        );
        let cpu = router_ticks as f64 / TICKS_PER_SEC;
        println!(
            "router CPU: {cpu:.2} s for {router_requests} requests = {:.1} µs per request",
            cpu / router_requests.max(1) as f64 * 1e6
        );
        let router_calls = calls_after - calls_before;
        println!(
            "controller RPCs for requests during the router's warm runs: {router_calls} (router metric), {fake_router} GetInstance at the fake controller"
        );
        if base.is_some() {
            println!("GetInstance calls during the baseline's runs: {fake_during_base}");
        }
        assert!(
            router_calls == 0.0 && fake_router == 0,
            "the warm path made controller RPCs: {router_calls} by the router's count, {fake_router} GetInstance at the fake"
        );

        let rss_before = proc_status_kib(router.pid, "VmRSS:");
        let (down, up) = stream_gib(router.addr, &header).await;
        let hwm = proc_status_kib(router.pid, "VmHWM:");
        let rss_after = proc_status_kib(router.pid, "VmRSS:");
        println!(
            "1 GiB through the router: download {:.2} s ({:.0} MiB/s), upload {:.2} s ({:.0} MiB/s)",
            down.as_secs_f64(),
            1024.0 / down.as_secs_f64(),
            up.as_secs_f64(),
            1024.0 / up.as_secs_f64()
        );
        println!("router RSS: {rss_before} KiB before, {rss_after} KiB after, peak {hwm} KiB");

        router.stop().await;
        if let Some(b) = base {
            b.stop().await;
        }
        if let Some((mut child, _, dir)) = nginx {
            let _ = child.kill().await;
            let _ = std::fs::remove_dir_all(dir);
        }
        stop.cancel();
    });
}
