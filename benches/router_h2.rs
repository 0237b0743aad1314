//! HTTP/2 and gRPC load benchmark (`make bench-router`, after the HTTP/1.1
//! one).
//!
//! On loopback, one pod — the fixture, in this process, assigned to a
//! tenant — and in front of it, in one run:
//!
//! - `nginx`: `listen … http2` (prior knowledge), `proxy_pass` to the pod
//!   over HTTP/1.1 keep-alive for `GET /hello` and `grpc_pass` over h2c for
//!   the gRPC call (when `nginx` is installed);
//! - `router→h1`: the real `skipper router` binary, the pod in an HTTP/1.1
//!   pool (`GET` only: gRPC needs HTTP/2 to the pod);
//! - `router→h2c`: the same binary, the pod in a pool that declares h2c.
//!
//! Load: `h2load` with prior knowledge on one connection at 1 and 100
//! concurrent streams, `GET /hello` and a unary `skipper.fixture.Echo/Unary`
//! call (every target is first checked to answer the call with gRPC `OK`).
//! Rounds (`SKIPPER_BENCH_ROUNDS`, default 1) interleave the targets; the
//! table shows medians of req/s, mean latency and the proxy's CPU per
//! request (its processes' user and system time; nginx's workers
//! included), and the router's ratio to nginx. `SKIPPER_BENCH_SECS` sets
//! the measuring time per scenario (default 5). Needs `h2load`
//! (`apt-get install -y nghttp2-client`); says so and stops without it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::devcluster::{bound_token, function_json, keys};
use skipper_test_support::router as harness;
use skipper_test_support::router_process::{
    TICKS_PER_SEC, free_port, start_router, tree_cpu_ticks, wait_healthy,
};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use prost::Message as _;
use skipper::api::Protocol;
use skipper::fixture::echo::api::EchoRequest;
use skipper::fixture::echo::api::echo_client::EchoClient;
use skipper::fixture::{Fixture, Settings};
use skipper::shutdown::Shutdown;
use skipper::token::{PodRef, TrustedKeys, Version};
use tokio_util::sync::CancellationToken;

const STREAMS: [usize; 2] = [1, 100];
const TENANT: &str = "t1";
const UNARY: &str = "/skipper.fixture.Echo/Unary";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Call {
    Get,
    Grpc,
}

impl Call {
    fn label(self) -> &'static str {
        match self {
            Self::Get => "GET /hello",
            Self::Grpc => "gRPC Echo/Unary",
        }
    }
}

/// A proxy under load: name, address, function header, its process, the
/// calls it serves.
type Target<'a> = (&'static str, SocketAddr, Option<&'a str>, u32, &'static [Call]);

/// One h2load run.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    rps: f64,
    mean: Duration,
    requests: u64,
    /// Proxy CPU per request (µs).
    cpu_us: Option<f64>,
}

/// `h2load` durations: `123us`, `1.5ms`, `2s`.
fn h2load_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
    let v: f64 = num.parse().ok()?;
    let secs = match unit {
        "us" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// Runs `h2load` against `url` and reads its report; every request must
/// succeed with a 2xx.
async fn h2load(
    url: &str,
    call: Call,
    header: Option<&str>,
    streams: usize,
    secs: Duration,
    body: &Path,
) -> Outcome {
    let mut cmd = tokio::process::Command::new("h2load");
    cmd.args(["-c", "1", "-t", "1", "-m", &streams.to_string()])
        .args(["-D", &secs.as_secs().to_string()]);
    if let Some(h) = header {
        cmd.args(["-H", &format!("x-skipper-function: {h}")]);
    }
    if call == Call::Grpc {
        cmd.args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .args(["-d", &body.display().to_string()]);
    }
    let out = cmd
        .arg(url)
        .stderr(Stdio::inherit())
        .output()
        .await
        .expect("run h2load");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut o = Outcome::default();
    // (succeeded, failed, errored, 2xx); the 2xx count also takes responses
    // whose headers arrived as the time ran out.
    let (mut succeeded, mut failed, mut errored, mut ok) = (0u64, u64::MAX, u64::MAX, 0u64);
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["finished", "in", _, rps, "req/s,", ..] => o.rps = rps.parse().unwrap_or(0.0),
            [
                "requests:",
                total,
                "total,",
                _,
                "started,",
                _,
                "done,",
                s,
                "succeeded,",
                f,
                "failed,",
                e,
                "errored,",
                ..,
            ] => {
                o.requests = total.parse().unwrap_or(0);
                succeeded = s.parse().unwrap_or(0);
                failed = f.parse().unwrap_or(u64::MAX);
                errored = e.parse().unwrap_or(u64::MAX);
            }
            ["status", "codes:", two, "2xx,", ..] => ok = two.parse().unwrap_or(0),
            ["time", "for", "request:", _min, _max, mean, ..] => {
                o.mean = h2load_duration(mean).unwrap_or_default()
            }
            _ => {}
        }
    }
    assert!(
        o.requests > 0 && succeeded == o.requests && failed == 0 && errored == 0 && ok >= succeeded,
        "h2load against {url}: {succeeded} of {} succeeded, {ok} answered 2xx:\n{text}",
        o.requests
    );
    o
}

/// nginx with plaintext HTTP/2: `proxy_pass` over HTTP/1.1 keep-alive and
/// `grpc_pass` over h2c, both to `pod`.
async fn start_nginx(pod: SocketAddr) -> Option<(tokio::process::Child, SocketAddr, PathBuf)> {
    let exe = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("skipper-bench-nginx-h2-{}", std::process::id()));
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
           http2_max_concurrent_streams 128; keepalive_requests 100000000;\n\
           upstream h1 {{ server {pod}; keepalive 64; }}\n\
           upstream h2 {{ server {pod}; keepalive 64; }}\n\
           server {{\n\
             listen 127.0.0.1:{port} http2;\n\
             location /skipper.fixture.Echo/ {{ grpc_pass grpc://h2; }}\n\
             location / {{ proxy_pass http://h1; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n\
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
    // nginx's port speaks HTTP/2 only: wait for it to accept.
    skipper_test_support::eventually("nginx accepts", Duration::from_secs(20), || async move {
        tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
    })
    .await;
    Some((child, addr, dir))
}

/// One gRPC call through `addr` must come back `OK` from the pod.
async fn check_grpc(addr: SocketAddr, header: Option<&str>) {
    let mut c = EchoClient::connect(format!("http://{addr}")).await.unwrap();
    let mut req = tonic::Request::new(EchoRequest {
        message: "check".into(),
        ..Default::default()
    });
    if let Some(h) = header {
        req.metadata_mut()
            .insert("x-skipper-function", h.parse().unwrap());
    }
    let reply = c
        .unary(req)
        .await
        .unwrap_or_else(|e| panic!("gRPC through {addr}: {e}"));
    assert_eq!(reply.into_inner().tenant, TENANT);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
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
    if std::process::Command::new("h2load")
        .arg("--version")
        .output()
        .is_err()
    {
        println!(
            "router HTTP/2 benchmark skipped: h2load is not installed (apt-get install -y nghttp2-client)"
        );
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (key, pem) = keys();
        let dir = std::env::temp_dir().join(format!("skipper-bench-h2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fixture = Fixture::start(
            Settings {
                keys: TrustedKeys::from_pem(&pem).unwrap(),
                addr: "127.0.0.1:0".parse().unwrap(),
                token_path: dir.join("token"),
                assign_delay: Duration::ZERO,
                assign_status: None,
                grpc_health: None,
                pod_name: Some("pod-1".into()),
                pod_uid: None,
                accept_unbound_tokens: false,
            },
            Shutdown::new(),
        )
        .await
        .unwrap();
        let pod = fixture.addr();
        let token = bound_token(&key, Version::V2, TENANT, PodRef { name: "pod-1", uid: "" });
        let status = reqwest::Client::new()
            .post(format!("http://{pod}/__skipper/assign"))
            .header("X-Skipper-Token", token)
            .header("X-Skipper-Function", function_json(TENANT))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "assigning the fixture");
        let body = dir.join("unary.bin");
        let msg = EchoRequest {
            message: "hello".into(),
            ..Default::default()
        }
        .encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
        framed.extend_from_slice(&msg);
        std::fs::write(&body, framed).unwrap();

        let stop = CancellationToken::new();
        let exe = env!("CARGO_BIN_EXE_skipper");
        let mut routers = Vec::new();
        for protocol in [Protocol::Unspecified, Protocol::H2c] {
            let fake = harness::FakeController::new();
            fake.enable_streams();
            let ctrl = fake.serve(stop.clone()).await;
            fake.add_instance_speaking("pod-1", pod, protocol);
            routers.push((fake, start_router(exe, ctrl, &[]).await));
        }
        let header = harness::function_header("bench", TENANT, false);
        let nginx = start_nginx(pod).await;

        let mut targets: Vec<Target<'_>> = Vec::new();
        if let Some((child, addr, _)) = &nginx {
            targets.push(("nginx", *addr, None, child.id().unwrap(), &[Call::Get, Call::Grpc]));
        }
        targets.push(("router→h1", routers[0].1.addr, Some(header.as_str()), routers[0].1.pid, &[Call::Get]));
        targets.push(("router→h2c", routers[1].1.addr, Some(header.as_str()), routers[1].1.pid, &[Call::Get, Call::Grpc]));
        wait_healthy(pod, "the fixture").await;
        for (_, addr, h, _, calls) in &targets {
            if calls.contains(&Call::Grpc) {
                check_grpc(*addr, *h).await;
            }
        }

        println!(
            "\nrouter HTTP/2 benchmark: h2load, 1 connection (prior knowledge), {}s per scenario, {rounds} round(s), loopback; one pod (the fixture){}",
            secs.as_secs(),
            if nginx.is_none() { "; nginx is not installed, its rows are skipped (apt-get install -y nginx-light)" } else { "" }
        );
        let mut results: BTreeMap<(Call, usize, &str), Vec<Outcome>> = BTreeMap::new();
        for _ in 0..rounds {
            for call in [Call::Get, Call::Grpc] {
                for streams in STREAMS {
                    for (name, addr, h, pid, calls) in &targets {
                        if !calls.contains(&call) {
                            continue;
                        }
                        let path = if call == Call::Get { "/hello" } else { UNARY };
                        let ticks = tree_cpu_ticks(*pid);
                        let mut o = h2load(&format!("http://{addr}{path}"), call, *h, streams, secs, &body).await;
                        let used = tree_cpu_ticks(*pid) - ticks;
                        o.cpu_us = Some(used as f64 / TICKS_PER_SEC / o.requests.max(1) as f64 * 1e6);
                        results.entry((call, streams, name)).or_default().push(o);
                    }
                }
            }
        }
        println!("{:<16} {:>7} {:<11} {:>10} {:>10} {:>11}  router/nginx", "call", "streams", "target", "req/s", "mean", "CPU µs/req");
        for call in [Call::Get, Call::Grpc] {
            for streams in STREAMS {
                let nginx_rps = results
                    .get(&(call, streams, "nginx"))
                    .map(|v| median(v.iter().map(|o| o.rps).collect()));
                for (name, ..) in &targets {
                    let Some(runs) = results.get(&(call, streams, *name)) else { continue };
                    let rps = median(runs.iter().map(|o| o.rps).collect());
                    let mean = median(runs.iter().map(|o| o.mean.as_secs_f64() * 1e3).collect());
                    let cpu = median(runs.iter().filter_map(|o| o.cpu_us).collect());
                    let ratio = match (nginx_rps, name.starts_with("router")) {
                        (Some(n), true) => format!("{:.2}x", rps / n),
                        _ => String::new(),
                    };
                    println!(
                        "{:<16} {streams:>7} {name:<11} {rps:>10.0} {:>8.3}ms {cpu:>11.1}  {ratio}",
                        call.label(),
                        mean
                    );
                }
            }
        }
        for (fake, router) in routers {
            router.stop().await;
            drop(fake);
        }
        if let Some((mut child, _, dir)) = nginx {
            skipper_test_support::router_process::terminate(&mut child).await;
            let _ = std::fs::remove_dir_all(dir);
        }
        stop.cancel();
        fixture.stop().await;
        let _ = std::fs::remove_dir_all(dir);
    });
}
