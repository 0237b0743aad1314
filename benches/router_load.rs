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
//!   warm, Prometheus metrics on and trace export off (the references
//!   trace nothing either);
//! - `traced`: the same with trace export on, every request sampled, to a
//!   collector that is not there (what tracing costs);
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
//! count), reports the CPU per request of every proxy (its processes' user
//! and system time over its runs; nginx's workers included) and the
//! router's ratio to nginx's, then streams 1 GiB each way with the
//! router's peak RSS, and measures the router's memory per request waiting
//! for a cold start (`SKIPPER_BENCH_WAITING`, default 1000, held waiting on
//! the fake controller).
//!
//! `SKIPPER_BENCH_SECS` sets the measuring time per scenario (default 5);
//! `SKIPPER_BENCH_CORES` the threads of every proxy (tokio workers, nginx
//! worker processes; default 1, as a router pod with a one-CPU limit runs).
//! `SKIPPER_BENCH_PROFILE=DIR` saves a CPU profile of each router under the
//! first round's 32 connections (`/debug/pprof/profile`, pprof's format) as
//! `DIR/<target>.pb`; `go tool pprof -top DIR/router.pb` reads it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::router as harness;
use skipper_test_support::router_process::{
    RouterProcess, TICKS_PER_SEC, free_port, start_router, tree_cpu_ticks, wait_healthy,
};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const CONNS: [usize; 2] = [1, 32];
/// The environment of a router under test: room for the waiting-memory
/// measurement (a binary without these flags ignores them), `cores`
/// runtime threads, trace export on or off.
fn router_env(cores: &str, traces: bool) -> Vec<(&str, &str)> {
    vec![
        ("SKIPPER_MAX_WAITING_REQUESTS", "4096"),
        ("SKIPPER_MAX_WAITING_REQUESTS_PER_FUNCTION", "4096"),
        ("SKIPPER_TELEMETRY_TRACE", if traces { "true" } else { "false" }),
        ("TOKIO_WORKER_THREADS", cores),
    ]
}

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

fn proc_status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The sum of `skipper_router_controller_calls_total`, `None` when the
/// router does not export it.
async fn controller_calls(router: &RouterProcess) -> Option<f64> {
    router.metric("skipper_router_controller_calls").await
}

/// Saves a CPU profile of the process serving pprof at `pprof`, over
/// `secs` less one second, to `to`.
async fn profile(pprof: SocketAddr, secs: Duration, to: PathBuf) {
    let seconds = secs.as_secs().saturating_sub(1).max(1);
    let body = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://{pprof}/debug/pprof/profile?seconds={seconds}"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .expect("the router serves /debug/pprof/profile")
        .bytes()
        .await
        .unwrap();
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(&to, body).unwrap();
    println!("CPU profile: {}", to.display());
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Each request the first of a new tenant, its GetInstance held.
    Cold,
    /// One tenant at `max_in_flight_requests` 1, its one request held by
    /// the upstream.
    Queued,
}

/// Holds `n` requests waiting in the router and returns the router's RSS
/// growth per request (KiB); then lets them finish.
async fn waiting_memory(
    router: &RouterProcess,
    n: usize,
    how: Waiting,
    fake: &harness::FakeController,
    upstream: &harness::Upstream,
) -> f64 {
    use tokio::io::AsyncWriteExt as _;
    let request = |tenant: &str, path: &str, limit: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nhost: bench\r\nx-skipper-function: {{\"namespace\":\"ns\",\"deployment\":\"bench\",\"tenant\":\"{tenant}\",\"scale\":{{\"max_instances\":1{limit}}}}}\r\n\r\n"
        )
    };
    let mut held = Vec::new();
    if how == Waiting::Queued {
        let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
        s.write_all(request("queue", "/block", ",\"max_in_flight_requests\":1").as_bytes())
            .await
            .unwrap();
        held.push(s);
        upstream.wait_arrived(1).await;
    } else {
        fake.close_get_instance();
    }
    let rss_before = proc_status_kib(router.pid, "VmRSS:");
    for i in 0..n {
        let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
        let text = match how {
            Waiting::Cold => request(&format!("waiting-{i}"), "/hello", ""),
            Waiting::Queued => request("queue", "/block", ",\"max_in_flight_requests\":1"),
        };
        s.write_all(text.as_bytes()).await.unwrap();
        held.push(s);
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        while router
            .metric("skipper_router_requests_waiting")
            .await
            .unwrap_or(0.0)
            < n as f64
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the requests did not all wait");
    let rss = proc_status_kib(router.pid, "VmRSS:");
    match how {
        Waiting::Cold => fake.open_get_instance(),
        Waiting::Queued => upstream.open(),
    }
    drop(held);
    rss.saturating_sub(rss_before) as f64 / n as f64
}

/// nginx as a plain reverse proxy with a keep-alive upstream pool.
async fn start_nginx(
    upstream: SocketAddr,
    cores: usize,
) -> Option<(tokio::process::Child, SocketAddr, PathBuf)> {
    let exe = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("skipper-bench-nginx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = format!(
        "worker_processes {cores};\n\
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
    // Threads (nginx: worker processes) each proxy runs: one core each by
    // default, as a router pod with a one-CPU limit runs.
    let cores: usize = env("SKIPPER_BENCH_CORES")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    let cores_s = cores.to_string();
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
            .env("TOKIO_WORKER_THREADS", &cores_s)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start the minimal proxy");
        wait_healthy(minimal_addr, "the minimal proxy").await;
        let nginx = start_nginx(upstream.addr, cores).await;
        let router = start_router(env!("CARGO_BIN_EXE_skipper"), ctrl, &router_env(&cores_s, false)).await;
        // Every request traced (sampling always on) and exported to a
        // collector that is not there: what tracing costs.
        let traced = start_router(env!("CARGO_BIN_EXE_skipper"), ctrl, &router_env(&cores_s, true)).await;
        let base = match &baseline {
            Some(exe) => Some(start_router(exe, ctrl, &router_env(&cores_s, false)).await),
            None => None,
        };

        // (name, address, function header, the proxy's process for its CPU)
        let mut targets: Vec<(&str, SocketAddr, Option<&str>, Option<u32>)> = vec![
            ("direct", upstream.addr, None, None),
            ("minimal", minimal_addr, None, _minimal.id()),
        ];
        if let Some((child, addr, _)) = &nginx {
            targets.push(("nginx", *addr, None, child.id()));
        }
        targets.push(("router", router.addr, Some(header.as_str()), Some(router.pid)));
        targets.push(("traced", traced.addr, Some(header.as_str()), Some(traced.pid)));
        if let Some(b) = &base {
            targets.push(("baseline", b.addr, Some(header.as_str()), Some(b.pid)));
        }

        // Warm up every path (the router's table fills from its stream).
        for (_, addr, h, _) in &targets {
            builtin(*addr, *h, 4, Duration::from_millis(500)).await;
        }
        controller_calls(&router).await.expect("the router exports skipper_router_controller_calls");
        // Controller RPCs during the router's measured runs: by its own
        // count and the fake controller's.
        let mut router_calls = 0.0;
        let mut fake_router = 0;

        println!(
            "\nrouter load benchmark: GET /hello, {}s per scenario, {} round(s), {cores} core(s) per proxy (runtime threads; nginx worker processes), load from {}, loopback; load average at start {}",
            secs.as_secs(),
            rounds,
            if loadgen == LoadGen::Wrk { "wrk" } else { "the in-process generator" },
            load_average()
        );
        if nginx.is_none() {
            println!("note: nginx is not installed; its rows are skipped (apt-get install -y nginx-light)");
        }
        let mut results: BTreeMap<(usize, usize), Vec<Outcome>> = BTreeMap::new();
        // (ticks, requests) per (conns, target)
        let mut cpu: BTreeMap<(usize, usize), (u64, usize)> = BTreeMap::new();
        let profile_dir = env("SKIPPER_BENCH_PROFILE").map(PathBuf::from);
        for round in 0..rounds {
            for conns in CONNS {
                for (i, (name, addr, h, pid)) in targets.iter().enumerate() {
                    // Each run starts warm: a router forgets a function
                    // idle for longer than the other targets' runs take.
                    builtin(*addr, *h, 4, Duration::from_millis(200)).await;
                    let ticks = pid.map(tree_cpu_ticks);
                    let fake0 = fake.calls("GetInstance");
                    let calls0 = if *name == "router" { controller_calls(&router).await } else { None };
                    let pprof = match *name {
                        "router" => Some(router.pprof),
                        "traced" => Some(traced.pprof),
                        "baseline" => base.as_ref().map(|b| b.pprof),
                        _ => None,
                    };
                    let profiling = match (&profile_dir, pprof) {
                        (Some(dir), Some(pprof)) if round == 0 && conns == 32 => {
                            Some(tokio::spawn(profile(pprof, secs, dir.join(format!("{name}.pb")))))
                        }
                        _ => None,
                    };
                    let o = load(loadgen, *addr, *h, conns, secs).await;
                    if let Some(p) = profiling {
                        p.await.unwrap();
                    }
                    if let (Some(t), Some(pid)) = (ticks, pid) {
                        let c = cpu.entry((conns, i)).or_default();
                        c.0 += tree_cpu_ticks(*pid) - t;
                        c.1 += o.requests;
                    }
                    if let Some(c0) = calls0 {
                        router_calls += controller_calls(&router).await.unwrap() - c0;
                        fake_router += fake.calls("GetInstance") - fake0;
                    }
                    results.entry((conns, i)).or_default().push(o);
                }
            }
        }
        println!("load average at end {}", load_average());

        println!(
            "\n{:<10} {:>3} {:>10} {:>9} {:>9} {:>9} {:>7}",
            "target", "c", "req/s", "p50 µs", "p99 µs", "+p50 µs", "errors"
        );
        let mut by: BTreeMap<(&str, usize), Summary> = BTreeMap::new();
        for conns in CONNS {
            let direct_p50 = summarize(&results[&(conns, 0)]).p50_us;
            for (i, (name, _, _, _)) in targets.iter().enumerate() {
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
        for proxy in ["router", "traced", "baseline"] {
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
        // CPU per request: user + system time of the proxy's processes
        // over its runs, divided by the requests they served.
        let us_per_request = |conns: usize, name: &str| {
            let i = targets.iter().position(|t| t.0 == name)?;
            let (ticks, requests) = cpu.get(&(conns, i))?;
            Some(*ticks as f64 / TICKS_PER_SEC / (*requests).max(1) as f64 * 1e6)
        };
        for conns in CONNS {
            let mut line = format!("CPU µs per request at c={conns}:");
            for name in ["minimal", "nginx", "router", "traced", "baseline"] {
                if let Some(us) = us_per_request(conns, name) {
                    line.push_str(&format!(" {name} {us:.1}"));
                }
            }
            if let (Some(r), Some(n)) = (us_per_request(conns, "router"), us_per_request(conns, "nginx")) {
                line.push_str(&format!("; router/nginx {:.2}x", r / n));
            }
            if let (Some(r), Some(b)) = (us_per_request(conns, "router"), us_per_request(conns, "baseline")) {
                line.push_str(&format!("; router/baseline {:.2}x", r / b));
            }
            println!("{line}");
        }
        println!(
            "controller RPCs for requests during the router's measured runs: {router_calls} (router metric), {fake_router} GetInstance at the fake controller"
        );
        assert!(
            router_calls == 0.0 && fake_router == 0,
            "the warm path made controller RPCs: {router_calls} by the router's count, {fake_router} GetInstance at the fake"
        );

        println!(
            "traced router RSS after its runs: {} KiB (untraced: {} KiB)",
            proc_status_kib(traced.pid, "VmRSS:"),
            proc_status_kib(router.pid, "VmRSS:")
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

        let waiting: usize = env("SKIPPER_BENCH_WAITING").and_then(|s| s.parse().ok()).unwrap_or(1000);
        if waiting > 0 {
            let cold = waiting_memory(&router, waiting, Waiting::Cold, &fake, &upstream).await;
            let queued = waiting_memory(&router, waiting, Waiting::Queued, &fake, &upstream).await;
            println!(
                "router memory per waiting request ({waiting} at once, RSS growth): first request of a new tenant waiting for GetInstance {cold:.1} KiB; queued under a function's max_in_flight_requests {queued:.1} KiB"
            );
        }

        router.stop().await;
        traced.stop().await;
        if let Some(b) = base {
            b.stop().await;
        }
        if let Some((mut child, _, dir)) = nginx {
            skipper_test_support::router_process::terminate(&mut child).await;
            let _ = std::fs::remove_dir_all(dir);
        }
        stop.cancel();
    });
}
