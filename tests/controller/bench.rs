//! Controller figures measured against the simulator (ignored by default;
//! `make bench-controller` runs them and prints the numbers):
//! - cold assignment: `GetInstance` for a new tenant with a free pool pod,
//!   next to the fixture's own assign time for the same kind of pod;
//! - warm `GetInstance` at 32 concurrent callers;
//! - idle supervisors at scale (100,000 functions on one controller): live
//!   heap bytes per supervisor (a counting global allocator), RSS per 10,000
//!   supervisors, converge CPU per tick, and what is returned once the
//!   supervisors stop.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use skipper_test_support::controller as harness;

use std::time::{Duration, SystemTime};

use harness::{Ctl, NS, Sim, eventually, function, get_instance};
use skipper::domain::{HEADER_FUNCTION, HEADER_TOKEN};
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
        let ip = p.status.unwrap().pod_ip.unwrap();
        let f = function("direct", &format!("direct-{i}"), 1);
        let token = sim
            .key
            .sign(skipper::token::Version::V2, &f.tenant, SystemTime::now())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run with make bench-controller"]
async fn idle_supervisors_at_scale() {
    const FUNCTIONS: usize = 100_000;
    const INTERVAL: Duration = Duration::from_secs(2);
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
    for i in 0..FUNCTIONS {
        let f = function("idle", &format!("idle-{i:06}"), 1);
        ctl.core.supervisor(&f, false).await;
    }
    assert_eq!(ctl.core.supervisors.len(), FUNCTIONS + 1);
    // Let every supervisor run its first ticks.
    tokio::time::sleep(INTERVAL * 2).await;
    let (bytes1, rss1) = (live_bytes(), rss());
    let per_supervisor = (bytes1 - bytes0) as f64 / FUNCTIONS as f64;
    let rss_per_10k = (rss1 - rss0) as f64 / FUNCTIONS as f64 * 10_000.0;

    let cpu0 = process_cpu();
    let t0 = Instant::now();
    tokio::time::sleep(INTERVAL * 5).await;
    let cpu = process_cpu() - cpu0;
    let ticks = t0.elapsed().as_secs_f64() / INTERVAL.as_secs_f64();
    assert_eq!(
        ctl.core.supervisors.len(),
        FUNCTIONS + 1,
        "idle supervisors keep running while protected"
    );

    ctl.core.supervisors.stop_all();
    eventually("every supervisor to stop", Duration::from_secs(60), || async {
        ctl.core.supervisors.is_empty().then_some(())
    })
    .await;
    let (bytes2, rss2) = (live_bytes(), rss());
    println!(
        "idle supervisors: {FUNCTIONS} functions: {per_supervisor:.0} heap bytes per supervisor, RSS {:.1} MiB per 10,000 supervisors",
        rss_per_10k / 1024.0 / 1024.0
    );
    println!(
        "converge: {:.1} ticks: {:.1} ms CPU per tick of all {FUNCTIONS} functions ({:.2} us per function tick), process CPU {:.1}% of one core",
        ticks,
        ms(cpu) / ticks,
        cpu.as_secs_f64() * 1e6 / ticks / FUNCTIONS as f64,
        cpu.as_secs_f64() / t0.elapsed().as_secs_f64() * 100.0
    );
    println!(
        "after every supervisor stopped: heap {:.1} MiB above the start (of {:.1} MiB); RSS {:.1} MiB above the start (peak {:.1} MiB)",
        (bytes2 - bytes0) as f64 / 1024.0 / 1024.0,
        (bytes1 - bytes0) as f64 / 1024.0 / 1024.0,
        (rss2 - rss0) as f64 / 1024.0 / 1024.0,
        (rss1 - rss0) as f64 / 1024.0 / 1024.0,
    );
    ctl.stop().await;
}
