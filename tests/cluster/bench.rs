//! Measurements of the simulator (ignored by default; run with
//! `cargo test --release --test devcluster_bench -- --ignored --nocapture`):
//! time for a pool of 50 fixture pods to become Ready, RSS per fixture pod,
//! and watch event latency (write → event received by a kube-rs watcher).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use skipper_devcluster::pool_deployment;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run explicitly"]
async fn pool_of_50_ready_time_and_rss_per_pod() {
    let cluster = common::cluster(&["bench"]).await;
    let (_, pem) = common::keys();
    let deployments: Api<Deployment> = Api::namespaced(cluster.client().unwrap(), "bench");
    let started = Instant::now();
    deployments
        .create(
            &PostParams::default(),
            &pool_deployment("bench", "fixture", 50, &pem),
        )
        .await
        .unwrap();
    common::eventually("50 ready pods", Duration::from_secs(120), || {
        let n = cluster.ready_pods("bench", "skipper/deployment=fixture").len();
        async move { (n == 50).then_some(()) }
    })
    .await;
    let elapsed = started.elapsed();
    // (VmRSS, RssAnon) in KiB: RSS counts the shared pages of the skipper
    // binary in every process; RssAnon is what each pod adds.
    let field = |status: &str, name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let samples: Vec<(u64, u64)> = cluster
        .pod_pids()
        .iter()
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            Some((field(&status, "VmRSS:")?, field(&status, "RssAnon:")?))
        })
        .collect();
    let n = samples.len().max(1) as f64;
    let rss = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n / 1024.0;
    let anon = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n / 1024.0;
    println!(
        "pool of 50 fixture pods Ready in {elapsed:?}; per fixture pod: RSS avg {rss:.1} MiB, of which private (RssAnon) {anon:.1} MiB ({} samples)",
        samples.len()
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run explicitly"]
async fn watch_event_latency_with_kube_rs() {
    let cluster = common::cluster(&["bench"]).await;
    let api: Api<ConfigMap> = Api::namespaced(cluster.client().unwrap(), "bench");
    let mut w = watcher(api.clone(), watcher::Config::default()).boxed();
    // Initial list: Init, InitDone.
    while !matches!(w.next().await, Some(Ok(watcher::Event::InitDone))) {}
    let mut samples = Vec::new();
    for i in 0..500 {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(format!("c{i}"));
        let t0 = Instant::now();
        api.create(&PostParams::default(), &c).await.unwrap();
        loop {
            match tokio::time::timeout(Duration::from_secs(5), w.next())
                .await
                .unwrap()
            {
                Some(Ok(watcher::Event::Apply(o)))
                    if o.metadata.name.as_deref() == Some(&format!("c{i}")) =>
                {
                    break;
                }
                Some(_) => {}
                None => panic!("watch ended"),
            }
        }
        samples.push(t0.elapsed());
    }
    samples.sort();
    println!(
        "watch latency (create → kube-rs watcher event), {} samples: p50 {:?}, p99 {:?}, max {:?}",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}
