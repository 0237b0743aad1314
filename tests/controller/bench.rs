//! Controller figures measured against the simulator (ignored by default;
//! `make bench-controller` runs them and prints the numbers):
//! - cold assignment: `GetInstance` for a new tenant with a free pool pod,
//!   next to the fixture's own assign time for the same kind of pod;
//! - warm `GetInstance` at 32 concurrent callers;
//! - idle supervisors (10,000 and 100,000 functions on one controller, no
//!   heartbeats): live heap bytes per supervisor (a counting global
//!   allocator), RSS per 10,000 supervisors, converge CPU per tick, and what
//!   is returned once the supervisors stop;
//! - active functions (10,000 and 100,000 functions routers keep active,
//!   whose pool has no pod): the same figures after several converge ticks,
//!   each of which decides an instance and waits for a pool pod; at most
//!   3 KiB of heap per active function.
//!
//! The controllers log as in production (JSON at `info`, into a sink).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::controller as harness;

use std::sync::Once;
use std::time::{Duration, SystemTime};

use harness::{Ctl, NS, Sim, eventually, function, get_instance};
use skipper::api;
use skipper::controller::metrics::Metrics;
use skipper::domain::{Function, HEADER_FUNCTION, HEADER_TOKEN};
use tokio::time::Instant;

use crate::live_bytes;

/// Resident set size of this process, in bytes.
fn rss() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// CPU time (user + system) of this process.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz = 100; // USER_HZ on Linux
    Duration::from_millis(ticks * 1000 / hz)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: run with make bench-controller"]
async fn cold_and_warm_get_instance_latency() {
    const COLD: usize = 30;
    log_as_the_controller();
    let sim = Sim::start().await;
    sim.deploy_pool("bench", 6, &[]).await;
    // The direct measurements consume pods of their own pool.
    sim.deploy_pool("direct", 3, &[]).await;
    sim.wait_pool("bench", 6, Duration::from_secs(60)).await;
    let ctl = Ctl::single(&sim).await;

    // The fixture's own assign time: POST a valid assignment straight to
    // free pool pods (which are then deleted).
    let http = reqwest::Client::new();
    let mut direct = Vec::new();
    for i in 0..COLD {
        let pod = eventually("a free pool pod", Duration::from_secs(30), || async {
            sim.free_pods("direct").await.first().cloned()
        })
        .await;
        let p = sim.live_pod(&pod).await.unwrap();
        let uid = p.metadata.uid.clone().unwrap();
        let ip = p.status.unwrap().pod_ip.unwrap();
        let f = function("direct", &format!("direct-{i}"), 1);
        // Bound to the pod, as a controller signs an assignment.
        let (token, _) = sim
            .key
            .sign_bound(
                skipper::token::Version::V2,
                &f.tenant,
                skipper::token::PodRef {
                    name: &pod,
                    uid: &uid,
                },
                skipper::token::BOUND_TOKEN_LIFETIME,
                SystemTime::now(),
            )
            .unwrap();
        let started = Instant::now();
        let resp = http
            .post(format!("http://{ip}:8888/__skipper/assign"))
            .header(HEADER_TOKEN, token)
            .header(HEADER_FUNCTION, f.to_json())
            .send()
            .await
            .unwrap();
        direct.push(started.elapsed());
        assert_eq!(resp.status(), 200);
        // Take it out of the pool (as a claim would) and delete it.
        sim.delete_pod(NS, &pod).await;
        eventually("pod gone from the pool", Duration::from_secs(10), || async {
            (!sim.free_pods("direct").await.contains(&pod)).then_some(())
        })
        .await;
    }

    let mut cold = Vec::new();
    let mut grpc = ctl.grpc.clone();
    let mut warm_tenant = None;
    for i in 0..COLD {
        // A free pool pod, in the controller's cache too.
        sim.wait_pool("bench", 1, Duration::from_secs(30)).await;
        let f = function("bench", &format!("cold-{i}"), 1);
        let started = Instant::now();
        grpc.get_instance(get_instance(&f, Duration::from_secs(30)))
            .await
            .unwrap();
        cold.push(started.elapsed());
        warm_tenant.get_or_insert(f);
    }
    direct.sort();
    cold.sort();
    let (d50, d95) = (percentile(&direct, 0.5), percentile(&direct, 0.95));
    let (c50, c95) = (percentile(&cold, 0.5), percentile(&cold, 0.95));
    println!(
        "cold GetInstance ({COLD} tenants): p50 {:.2} ms, p95 {:.2} ms; fixture assign alone: p50 {:.2} ms, p95 {:.2} ms; controller share: p50 {:.2} ms, p95 {:.2} ms",
        ms(c50),
        ms(c95),
        ms(d50),
        ms(d95),
        ms(c50.saturating_sub(d50)),
        ms(c95.saturating_sub(d95))
    );

    // Warm: 32 concurrent callers on a function with a ready instance.
    let f = warm_tenant.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    let until = Instant::now() + Duration::from_secs(3);
    for _ in 0..32 {
        let mut grpc = ctl.grpc.clone();
        let f = f.clone();
        tasks.spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < until {
                let started = Instant::now();
                grpc.get_instance(get_instance(&f, Duration::from_secs(5)))
                    .await
                    .unwrap();
                lat.push(started.elapsed());
            }
            lat
        });
    }
    let mut warm = Vec::new();
    while let Some(r) = tasks.join_next().await {
        warm.extend(r.unwrap());
    }
    warm.sort();
    println!(
        "warm GetInstance, 32 concurrent callers: {} calls in 3 s, p50 {:.3} ms, p99 {:.3} ms",
        warm.len(),
        ms(percentile(&warm, 0.5)),
        ms(percentile(&warm, 0.99))
    );
    ctl.stop().await;
}

/// Logs as the controller does (JSON at `info`, here into a sink) for the
/// rest of the process: spans and events cost what they cost in a
/// controller.
fn log_as_the_controller() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_max_level(tracing::Level::INFO)
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
    });
}

/// 10,000 idle supervisors, then 100,000, in one test (the order of
/// [`active_functions_10k_then_100k`], for the same reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with make bench-controller"]
async fn idle_supervisors_10k_then_100k() {
    idle_supervisors(10_000).await;
    idle_supervisors(100_000).await;
}

/// `functions` supervisors without heartbeats: every tick runs the whole
/// plan and decides nothing.
async fn idle_supervisors(functions: usize) {
    const INTERVAL: Duration = Duration::from_secs(2);
    log_as_the_controller();
    let sim = Sim::start().await;
    sim.deploy_pool("idle", 0, &[]).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.scale_interval = INTERVAL;
    // Idle and protected: every tick runs the whole plan and decides nothing.
    config.scale.heartbeat_timeout = Duration::from_secs(3600);
    let ctl = Ctl::start(&sim, config, listener).await;
    // One supervisor first so one-off allocations (the map's first buckets,
    // metric series) are outside the measurement.
    ctl.core.supervisor(&function("idle", "warm-up", 1), false).await;
    tokio::time::sleep(INTERVAL * 2).await;
    let (bytes0, rss0) = (live_bytes(), rss());
    for i in 0..functions {
        let f = function("idle", &format!("idle-{i:06}"), 1);
        ctl.core.supervisor(&f, false).await;
    }
    assert_eq!(ctl.core.supervisors.len(), functions + 1);
    // Let every supervisor run its first ticks.
    tokio::time::sleep(INTERVAL * 2).await;
    let (bytes1, rss1) = (live_bytes(), rss());
    let per_supervisor = (bytes1 - bytes0) as f64 / functions as f64;
    let rss_per_10k = (rss1 - rss0) as f64 / functions as f64 * 10_000.0;

    let cpu0 = process_cpu();
    let t0 = Instant::now();
    tokio::time::sleep(INTERVAL * 5).await;
    let cpu = process_cpu() - cpu0;
    let ticks = t0.elapsed().as_secs_f64() / INTERVAL.as_secs_f64();
    assert_eq!(
        ctl.core.supervisors.len(),
        functions + 1,
        "idle supervisors keep running while protected"
    );

    ctl.core.supervisors.stop_all();
    eventually("every supervisor to stop", Duration::from_secs(60), || async {
        ctl.core.supervisors.is_empty().then_some(())
    })
    .await;
    let (bytes2, rss2) = (live_bytes(), rss());
    println!(
        "idle supervisors: {functions} functions: {per_supervisor:.0} heap bytes per supervisor, RSS {:.1} MiB per 10,000 supervisors",
        rss_per_10k / MIB
    );
    println!(
        "idle converge: {ticks:.1} ticks: {:.1} ms CPU per tick of all {functions} functions ({:.2} us per function tick), process CPU {:.1}% of one core",
        ms(cpu) / ticks,
        cpu.as_secs_f64() * 1e6 / ticks / functions as f64,
        cpu.as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0
    );
    println!(
        "after every idle supervisor stopped: heap {:.1} MiB above the start (of {:.1} MiB); RSS {:.1} MiB above the start (peak {:.1} MiB)",
        (bytes2 - bytes0) as f64 / MIB,
        (bytes1 - bytes0) as f64 / MIB,
        (rss2 - rss0) as f64 / MIB,
        (rss1 - rss0) as f64 / MIB,
    );
    ctl.stop().await;
}

const MIB: f64 = 1024.0 * 1024.0;

/// The bound `active_functions` keeps: heap bytes per active function.
const MAX_BYTES_PER_ACTIVE_FUNCTION: f64 = 3072.0;

/// The pool of the active functions: a Deployment with no pods.
const ACTIVE_POOL: &str = "active";

/// Routers the active functions' heartbeats come from (each keeps at most
/// `--max-functions-per-router` functions active).
const ROUTERS: usize = 4;

/// The function a warm-up heartbeat keeps active (outside the measured
/// ones).
const WARM_UP: usize = 999_999;

/// 10,000 active functions, then 100,000, in one test: in this order the
/// smaller run's RSS is not hidden by memory a larger run freed (the
/// allocator keeps it for the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with make bench-controller"]
async fn active_functions_10k_then_100k() {
    let mut over = Vec::new();
    for functions in [10_000, 100_000] {
        let peak = active_functions(functions).await;
        if peak > MAX_BYTES_PER_ACTIVE_FUNCTION {
            over.push(format!(
                "{peak:.0} heap bytes per active function at {functions} functions"
            ));
        }
    }
    assert!(
        over.is_empty(),
        "over {MAX_BYTES_PER_ACTIVE_FUNCTION} bytes: {}",
        over.join(", ")
    );
}

/// Active function `i`: scaled on in-flight requests, at most one instance.
fn active_function(i: usize) -> Function {
    let mut f = function(ACTIVE_POOL, &format!("active-{i:06}"), 1);
    if let Some(scale) = f.scale.as_mut() {
        scale.target_in_flight_requests = Some(1);
    }
    f
}

/// Entries in one heartbeat batch.
const BATCH: usize = 10_000;

/// Heartbeats for active functions `ids` as routers send them: batches of
/// [`BATCH`] entries, each batch from one of [`ROUTERS`] routers, nothing
/// in flight right now.
async fn send_heartbeats(ctl: &Ctl, ids: impl IntoIterator<Item = usize>) {
    let mut grpc = ctl.grpc.clone();
    let ids: Vec<usize> = ids.into_iter().collect();
    for (k, batch) in ids.chunks(BATCH).enumerate() {
        let now = SystemTime::now();
        let req = api::HeartbeatRequest {
            router_ip: Some(format!("10.2.0.{}", k % ROUTERS + 1)),
            heartbeats: batch
                .iter()
                .map(|&i| api::Heartbeat {
                    function: Some((&active_function(i)).into()),
                    timestamp: Some(now.into()),
                    in_flight_requests: Some(0),
                })
                .collect(),
            forwarded_for: vec![],
        };
        grpc.heartbeat(req).await.unwrap();
    }
}

/// Converge ticks the active functions have acted in: each decides one
/// instance, waits for a pool pod and counts one scale-up when it acts.
fn active_ticks(ctl: &Ctl) -> u64 {
    ctl.core
        .cluster
        .metrics
        .scale_ups_total
        .get_or_create(&Metrics::function(ACTIVE_POOL))
        .get()
}

/// `functions` functions that routers keep active (heartbeats through the
/// gRPC API) whose pool Deployment has no pod: every converge tick decides
/// one instance, finds no pool pod and waits for one until the assign
/// timeout. Prints the heap per active function (mean and peak over a
/// window of several ticks), RSS per 10,000 functions and converge CPU per
/// tick; returns the peak.
async fn active_functions(functions: usize) -> f64 {
    const INTERVAL: Duration = Duration::from_millis(500);
    const ASSIGN_TIMEOUT: Duration = Duration::from_secs(2);
    /// Converge ticks of every function before the figures are taken.
    const TICKS: u64 = 3;
    log_as_the_controller();
    let sim = Sim::start().await;
    sim.deploy_pool(ACTIVE_POOL, 0, &[]).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = sim.config("127.0.0.1");
    config.scale_interval = INTERVAL;
    // A tick waits this long for a pool pod (none comes), then fails; a
    // function spends most of its time waiting.
    config.scale.assign_timeout = ASSIGN_TIMEOUT;
    // The routers' reports stay fresh for the whole run.
    config.scale.heartbeat_timeout = Duration::from_secs(3600);
    let ctl = Ctl::start(&sim, config, listener).await;

    // One active function through two ticks first, its heartbeats in a
    // full batch from every router, so one-off allocations (metric series,
    // the routers, the gRPC connection and its buffers, the first events)
    // are outside the measurement.
    send_heartbeats(&ctl, std::iter::repeat_n(WARM_UP, BATCH * ROUTERS)).await;
    eventually(
        "two ticks of the first active function",
        Duration::from_secs(30),
        || async { (active_ticks(&ctl) >= 2).then_some(()) },
    )
    .await;
    let (bytes0, rss0) = (live_bytes(), rss());

    let ingest = Instant::now();
    send_heartbeats(&ctl, 0..functions).await;
    let ingest = ingest.elapsed();
    assert_eq!(ctl.core.supervisors.len(), functions + 1);

    let ticks0 = active_ticks(&ctl);
    let wanted = ticks0 + TICKS * functions as u64;
    skipper_test_support::eventually_every(
        "several converge ticks of every active function",
        Duration::from_secs(600),
        Duration::from_millis(100),
        || async { (active_ticks(&ctl) >= wanted).then_some(()) },
    )
    .await;

    // A window of two tick periods: heap and RSS sampled, CPU and ticks
    // counted.
    let window = (INTERVAL + ASSIGN_TIMEOUT) * 2;
    let (cpu0, n0, t0) = (process_cpu(), active_ticks(&ctl), Instant::now());
    let mut heap = Vec::new();
    let mut rss_peak = 0;
    while t0.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(100)).await;
        heap.push(live_bytes() - bytes0);
        rss_peak = rss_peak.max(rss() - rss0);
    }
    let (cpu, ticks, elapsed) = (process_cpu() - cpu0, active_ticks(&ctl) - n0, t0.elapsed());

    let mean = heap.iter().sum::<i64>() as f64 / heap.len() as f64 / functions as f64;
    let peak = *heap.iter().max().unwrap() as f64 / functions as f64;
    let handles = ctl.core.supervisors.handles();
    let recommendations = handles
        .iter()
        .map(|h| h.shared.recommendations().len())
        .sum::<usize>() as f64
        / handles.len() as f64;
    drop(handles);
    assert_eq!(
        ctl.core.supervisors.len(),
        functions + 1,
        "active functions keep their supervisors"
    );

    ctl.core.supervisors.stop_all();
    eventually("every supervisor to stop", Duration::from_secs(120), || async {
        ctl.core.supervisors.is_empty().then_some(())
    })
    .await;
    let (bytes2, rss2) = (live_bytes(), rss());
    println!(
        "active functions: {functions} functions (heartbeats of {ROUTERS} routers, recorded in {:.1} s), a pool with no pod: \
         {mean:.0} heap bytes per active function ({peak:.0} at the peak), RSS {:.1} MiB per 10,000 functions, \
         {recommendations:.1} recommendations kept per supervisor",
        ingest.as_secs_f64(),
        rss_peak as f64 / functions as f64 * 10_000.0 / MIB,
    );
    let per_function_tick = cpu.as_secs_f64() * 1e6 / ticks as f64;
    println!(
        "active converge: {ticks} function ticks in {:.1} s ({:.2} per function): {:.1} ms CPU per tick of all {functions} functions \
         ({per_function_tick:.1} us per function tick), process CPU {:.0}% of one core",
        elapsed.as_secs_f64(),
        ticks as f64 / functions as f64,
        per_function_tick * functions as f64 / 1000.0,
        cpu.as_secs_f64() / elapsed.as_secs_f64() * 100.0
    );
    println!(
        "after every active supervisor stopped: heap {:.1} MiB above the start (of {:.1} MiB at the peak); RSS {:.1} MiB above the start",
        (bytes2 - bytes0) as f64 / MIB,
        peak * functions as f64 / MIB,
        (rss2 - rss0) as f64 / MIB,
    );
    ctl.stop().await;
    peak
}
