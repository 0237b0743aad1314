//! Cold-start benchmark (`make bench-cold`).
//!
//! Starts the real `skipper dev` (the simulated cluster, a controller pod,
//! the router process and a pool of fixture pods), waits until the pool has
//! a free pod for every tenant, then measures, one tenant at a time, the
//! first request of `SKIPPER_BENCH_TENANTS` (default 30) new tenants
//! through the router: the client's time to the response, and the parts
//! the response's `Server-Timing` names (`claim`, `assign`, `ready`). It
//! does so twice: back to back (each claim makes the pool start a
//! replacement pod, on the same two cores as everything else), then each
//! after the pool is whole again (the cold path alone, as on a cluster
//! whose pods start on other nodes).
//! Then it calls `GetInstance` on the controller directly for a warm
//! tenant, one call at a time (`SKIPPER_BENCH_CALLS`, default 2000), with a
//! client that writes the way Go's and C-core's gRPC clients do: every
//! HTTP/2 frame in its own write, and a BDP `PING` after the data it
//! receives (so the server's small `PING` acknowledgements precede its
//! replies — the pattern that stalls on a server without `TCP_NODELAY`).
//!
//! `SKIPPER_BENCH_BASELINE=/path/to/skipper` runs the same against another
//! binary in the same run (rounds interleave, `SKIPPER_BENCH_ROUNDS`,
//! default 1), for before/after figures. `SKIPPER_BENCH_SAMPLES=1` also
//! prints every cold start on stderr (its parts, the part of `ready` outside
//! the claim and the assign POST, and the time after `ready`), to tell
//! which part a slow one spent its time in.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use skipper::api;
use skipper::api::controller_service_client::ControllerServiceClient;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::time::Instant;

/// Namespace of the playground's pool.
const NS: &str = "default";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn function(tenant: &str) -> String {
    format!(
        r#"{{"namespace":"{NS}","deployment":"fixture","tenant":"{tenant}","scale":{{"max_instances":1}}}}"#
    )
}

/// A running `skipper dev`; killed (with its tree, by its process group
/// leader's SIGINT handling) when dropped.
struct Dev {
    child: tokio::process::Child,
    router: String,
    client: kube::Client,
    controller: std::net::SocketAddr,
    token: String,
    dir: PathBuf,
}

impl Dev {
    async fn start(exe: &Path, pool: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "skipper-bench-cold-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        let listen = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        let stderr = std::fs::File::create(dir.join("dev.stderr")).unwrap();
        let mut child = tokio::process::Command::new(exe)
            .arg("dev")
            .args(["--listen", &listen, "--metrics-listen", &metrics])
            .arg("--kubeconfig-out")
            .arg(&kubeconfig)
            .args(["--pool", &format!("fixture={pool}")])
            .args(["--heartbeat-timeout", "120s", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .expect("start skipper dev");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let controllers = tokio::time::timeout(Duration::from_secs(180), async {
            let mut ready = false;
            while let Some(line) = lines.next_line().await.unwrap() {
                ready |= line.starts_with("skipper dev ready");
                if ready && let Some(rest) = line.trim_start().strip_prefix("controllers:") {
                    return rest.split_whitespace().next().unwrap().to_owned();
                }
            }
            panic!("skipper dev exited before its ready block; see {}", dir.display());
        })
        .await
        .expect("skipper dev did not get ready within 180 s");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let ip = controllers.split(',').next().unwrap();
        let config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&kubeconfig).unwrap(),
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        let client = kube::Client::try_from(config).unwrap();
        let token = skipper::dev::playground::router_token(&client, 3600)
            .await
            .unwrap();
        Self {
            child,
            router: format!("http://{listen}"),
            client,
            controller: format!("{ip}:50051").parse().unwrap(),
            token,
            dir,
        }
    }

    /// Waits until `n` pool pods are Ready and unassigned.
    async fn wait_free(&self, n: usize) {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        tokio::time::timeout(Duration::from_secs(300), async {
            loop {
                let free = api
                    .list(&ListParams::default().labels("!skipper/tenant"))
                    .await
                    .unwrap()
                    .items
                    .iter()
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| {
                        p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                    })
                    .count();
                if free >= n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{n} free pool pods did not appear within 300 s"));
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                nix::sys::signal::Signal::SIGINT,
            );
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One cold start as the client saw it.
#[derive(Debug, Clone, Copy, Default)]
struct Cold {
    total: Duration,
    claim: Duration,
    assign: Duration,
    ready: Duration,
}

/// A binary's name, its cold starts back to back and settled, and its
/// `GetInstance` latencies.
type Results = (&'static str, Vec<Cold>, Vec<Cold>, Vec<Duration>);

/// `claim;dur=1.2;desc=".."` parts by name, in milliseconds.
fn server_timing(v: &str, name: &str) -> Option<Duration> {
    v.split(',').find_map(|part| {
        let mut fields = part.trim().split(';');
        (fields.next()? == name).then_some(())?;
        let ms: f64 = fields.find_map(|f| f.trim().strip_prefix("dur="))?.parse().ok()?;
        Some(Duration::from_secs_f64(ms / 1000.0))
    })
}

/// `tenants` first requests of new tenants, one at a time. With `settle`,
/// each waits until that many pool pods are free again (the claimed pod's
/// replacement is up), so it measures the cold path alone; without, they
/// follow each other and share the machine with the replacements' start.
async fn cold_starts(dev: &Dev, label: &str, tenants: usize, settle: Option<usize>) -> Vec<Cold> {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let samples = std::env::var_os("SKIPPER_BENCH_SAMPLES").is_some_and(|v| !v.is_empty() && v != "0");
    let mut out = Vec::new();
    for i in 0..tenants {
        if let Some(n) = settle {
            dev.wait_free(n).await;
        }
        let f = function(&format!("{label}-cold-{i}"));
        let t0 = Instant::now();
        let resp = http
            .get(format!("{}/hello", dev.router))
            .header("x-skipper-function", &f)
            .send()
            .await
            .unwrap();
        let total = t0.elapsed();
        assert_eq!(resp.status(), 200, "tenant {i}: {:?}", resp.text().await);
        let timing = resp
            .headers()
            .get("server-timing")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_default();
        let _ = resp.bytes().await;
        out.push(Cold {
            total,
            claim: server_timing(&timing, "claim").unwrap_or_default(),
            assign: server_timing(&timing, "assign").unwrap_or_default(),
            ready: server_timing(&timing, "ready").unwrap_or_default(),
        });
        if samples {
            let c = out.last().unwrap();
            eprintln!(
                "sample {label} {i}: total {:.2} claim {:.2} assign {:.2} ready {:.2} (rest of ready {:.2}, after ready {:.2})",
                ms(c.total),
                ms(c.claim),
                ms(c.assign),
                ms(c.ready),
                ms(c.ready.saturating_sub(c.claim + c.assign)),
                ms(c.total.saturating_sub(c.ready))
            );
        }
    }
    out
}

/// `calls` GetInstance calls, one at a time, for the warm `function`.
async fn get_instance_latency(dev: &Dev, function: &str, calls: usize) -> Vec<Duration> {
    let f = skipper::domain::Function::from_json(function).unwrap();
    let channel = skipper_test_support::grpc::go_style_channel(dev.controller).await;
    let mut client = ControllerServiceClient::new(channel);
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {}", dev.token).parse().unwrap();
    let mut out = Vec::with_capacity(calls);
    for i in 0..calls + 50 {
        let mut req = tonic::Request::new(api::GetInstanceRequest {
            function: Some(api::Function::from(&f)),
            exclude_instance_names: vec![],
        });
        req.metadata_mut().insert("authorization", bearer.clone());
        req.set_timeout(Duration::from_secs(10));
        let t0 = Instant::now();
        client.get_instance(req).await.unwrap();
        // The first calls open the connection and fill the token cache.
        if i >= 50 {
            out.push(t0.elapsed());
        }
    }
    out
}

// === report ===

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn line(name: &str, mut v: Vec<Duration>) -> String {
    v.sort();
    format!(
        "{name:<8} p50 {:>7.2}  p95 {:>7.2}  max {:>7.2}  ({} near 40 ms or more)",
        ms(pct(&v, 0.5)),
        ms(pct(&v, 0.95)),
        ms(*v.last().unwrap()),
        v.iter().filter(|d| **d >= Duration::from_millis(35)).count()
    )
}

fn main() {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let tenants: usize = env("SKIPPER_BENCH_TENANTS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let calls: usize = env("SKIPPER_BENCH_CALLS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let rounds: usize = env("SKIPPER_BENCH_ROUNDS")
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    let mut binaries = vec![("current", PathBuf::from(env!("CARGO_BIN_EXE_skipper")))];
    if let Some(b) = env("SKIPPER_BENCH_BASELINE") {
        binaries.push(("baseline", PathBuf::from(b)));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        println!(
            "\ncold-start benchmark: {tenants} new tenants one at a time through the router, free pool pods, simulator (twice: back to back, then each after the pool is whole again); then {calls} GetInstance calls at c=1 with a Go-style client (frame per write, BDP pings)"
        );
        let mut results: Vec<Results> = binaries
            .iter()
            .map(|(n, _)| (*n, Vec::new(), Vec::new(), Vec::new()))
            .collect();
        for round in 0..rounds {
            for (i, (name, exe)) in binaries.iter().enumerate() {
                let dev = Dev::start(exe, tenants + 2).await;
                dev.wait_free(tenants + 1).await;
                let label = format!("{name}{round}");
                let cold = cold_starts(&dev, &label, tenants, None).await;
                let settled = cold_starts(&dev, &format!("{label}-settled"), tenants, Some(tenants + 2)).await;
                let warm = function(&format!("{label}-cold-0"));
                let lat = get_instance_latency(&dev, &warm, calls).await;
                results[i].1.extend(cold);
                results[i].2.extend(settled);
                results[i].3.extend(lat);
                dev.stop().await;
            }
        }
        for (name, cold, settled, grpc) in results {
            for (how, cold) in [
                ("back to back, beside the replacements' start", cold),
                ("each after the pool is whole again", settled),
            ] {
                println!("\n{name}: first request of a new tenant through the router, {how} (ms)");
                println!("{}", line("total", cold.iter().map(|c| c.total).collect()));
                println!("{}", line("claim", cold.iter().map(|c| c.claim).collect()));
                println!("{}", line("assign", cold.iter().map(|c| c.assign).collect()));
                println!("{}", line("ready", cold.iter().map(|c| c.ready).collect()));
            }
            let mut g = grpc.clone();
            g.sort();
            println!(
                "{name}: GetInstance at c=1, Go-style client (ms): p50 {:.3}  p99 {:.3}  max {:.3}  ({} of {} at 35 ms or more)",
                ms(pct(&g, 0.5)),
                ms(pct(&g, 0.99)),
                ms(*g.last().unwrap()),
                g.iter().filter(|d| **d >= Duration::from_millis(35)).count(),
                g.len()
            );
        }
    });
}
