//! The scenarios of the reliability suite. Bounds are constants next to
//! each scenario; every figure is printed whether or not it holds.

use std::time::Duration;

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use skipper::api::{self, controller_service_client::ControllerServiceClient};
use skipper::client::Transport;
use skipper::credentials::Credentials;
use skipper::domain::{Function, Scale};
use tonic::transport::Channel;

use crate::Timer;
use crate::harness::{Dev, NS, Opts, TENANT, pod_ready, single};
use crate::probe::{self, Load, MIB, figure, mib};

/// Bound on waiting for claimed pods to go once the tenants are idle: the
/// playground's 5 s heartbeat timeout, converge ticks of 1 s, and slack for
/// a loaded machine.
const IDLE_CLEANUP: Duration = Duration::from_secs(45);
/// Bound on waiting for a condition of the playground.
const WAIT: Duration = Duration::from_secs(60);

/// A gRPC client of the controller at `ip`, presenting the playground
/// router's token (controllers refuse calls without one).
async fn grpc(dev: &Dev, ip: &str) -> ControllerServiceClient<Transport> {
    let channel = Channel::from_shared(format!("http://{ip}:50051"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let credentials = Credentials::from_file(&dev.token_file).unwrap();
    ControllerServiceClient::with_interceptor(channel, credentials)
        .max_decoding_message_size(64 * 1024 * 1024)
}

/// `(header, tenant)` of a function with `max_instances: 1`.
fn single_of(tenant: &str) -> (String, String) {
    (single(tenant), tenant.to_owned())
}

/// Asserts that no claimed pod is left once the tenants are idle.
async fn assert_no_leaks(dev: &Dev, scenario: &str) {
    let left = probe::leaked_pods(dev, scenario, IDLE_CLEANUP).await;
    assert!(
        left.is_empty(),
        "{scenario}: claimed pods left {IDLE_CLEANUP:?} after the tenants went idle: {left:?}"
    );
}

/// Peak router RSS allowed under the header flood (the manifest's limit is 256 Mi).
const ROUTER_PEAK_RSS: u64 = 64 * MIB;

/// `header` with an unknown field of about `size` bytes (distinct per `i`):
/// valid, and a different cache key for every request.
fn padded(header: &str, i: usize, size: usize) -> String {
    let body = header.strip_suffix('}').unwrap();
    format!(r#"{body},"padding":"{i}-{}"}}"#, "x".repeat(size))
}

/// Problem 1: 5,000 requests with large headers carrying an unknown field
/// (each a different cache key): 4,000 of 7.5 KB are served, 1,000 of 200 KB
/// are refused (431), and the router's peak RSS stays well under the
/// manifest's 256 Mi. (Baseline: 5,000 such requests took the router from
/// 37 MiB to 979 MiB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_rss_is_bounded_under_a_header_flood() {
    let _t = Timer::start("header flood");
    let dev = Dev::start(Opts {
        pool: 2,
        heartbeat_timeout: "60s",
        ..Opts::default()
    })
    .await;
    let f = single("flood");
    assert_eq!(dev.echo_tenant(&f, "/").await, "flood");
    let pid = probe::router_pid(&dev);
    let before = probe::rss(pid);
    let g = f.clone();
    let served = probe::burst(&dev, 4_000, 16, move |i| (padded(&g, i, 7_500), "flood".into())).await;
    let g = f.clone();
    let refused = probe::burst(&dev, 1_000, 8, move |i| (padded(&g, i, 200_000), "flood".into())).await;
    let after = probe::rss(pid);
    figure("header flood: router RSS before", mib(before.now));
    figure("header flood: router RSS peak", mib(after.peak));
    figure("header flood: router RSS after", mib(after.now));
    figure("header flood: 7.5 KB headers", &served);
    figure("header flood: 200 KB headers", &refused);
    assert_eq!(served.count("200"), 4_000, "7.5 KB headers: {served}");
    assert_eq!(
        refused.0.keys().filter(|k| k.starts_with('2')).count(),
        0,
        "200 KB headers must be refused: {refused}"
    );
    assert!(
        after.peak <= ROUTER_PEAK_RSS,
        "router peak RSS {} above {}",
        mib(after.peak),
        mib(ROUTER_PEAK_RSS)
    );
}

/// Functions in the heartbeat flood.
const FLOOD_FUNCTIONS: usize = 40_000;
/// Entries per flood call (under the per-call limit).
const FLOOD_BATCH: usize = 10_000;
/// RSS one controller may grow by per 10,000 live supervisors: the issue's
/// target of at most 2 KiB per idle supervisor, with room for the allocator.
const RSS_PER_10K_SUPERVISORS: u64 = 32 * MIB;
/// How much more a second flood may take than the first left, at least: the
/// memory of the first flood's supervisors is free again and reused. The
/// allowance is the larger of this and half of what the first flood added,
/// so allocator noise between threads' arenas passes while a second flood
/// that reuses nothing (and adds the whole first flood again) fails.
const SECOND_FLOOD_SLACK: u64 = 16 * MIB;

fn flood_entry(i: usize) -> api::Heartbeat {
    let f = Function {
        namespace: NS.into(),
        deployment: "fixture".into(),
        tenant: format!("hb-{i}"),
        metadata: None,
        scale: Some(Scale {
            max_instances: Some(1),
            ..Scale::default()
        }),
        oneshot: None,
    };
    api::Heartbeat {
        function: Some((&f).into()),
        timestamp: Some(std::time::SystemTime::now().into()),
        in_flight_requests: Some(0),
    }
}

/// Sends the flood to every controller; returns each one's RSS once its
/// 40,000 supervisors exist. Each controller records the batches itself (the
/// others are named in `forwarded_for`, so nothing is forwarded): when a
/// call returns, its supervisors exist, and they live until their first
/// tick.
async fn flood(dev: &Dev, ctls: &[(String, String, u32)], round: usize) -> Vec<u64> {
    let ips: Vec<&String> = ctls.iter().map(|(_, ip, _)| ip).collect();
    let mut with = Vec::new();
    for (k, (_, ip, pid)) in ctls.iter().enumerate() {
        let mut c = grpc(dev, ip).await;
        let others: Vec<String> = ips.iter().filter(|o| **o != ip).map(|o| (*o).clone()).collect();
        let t0 = std::time::Instant::now();
        for start in (0..FLOOD_FUNCTIONS).step_by(FLOOD_BATCH) {
            let req = api::HeartbeatRequest {
                router_ip: Some(format!("10.255.{k}.{}", start / FLOOD_BATCH + 2)),
                heartbeats: (start..start + FLOOD_BATCH).map(flood_entry).collect(),
                forwarded_for: others.clone(),
            };
            c.heartbeat(req).await.unwrap();
        }
        let took = t0.elapsed();
        with.push(probe::rss(*pid).now);
        let n = supervisors(dev, ip).await;
        figure(
            &format!("heartbeat flood {round}: controller {ip}"),
            format!(
                "{n} supervisors after {:.1}s of Heartbeat calls",
                took.as_secs_f64()
            ),
        );
        assert!(n >= FLOOD_FUNCTIONS, "{ip} holds {n} supervisors");
    }
    // Every flood supervisor stops at its first tick (heartbeat timed out).
    // The wait reads the controller's supervisor gauge: a GetClusterState of
    // 40,000 supervisors every 100 ms would be the load, not the flood.
    for ip in ips {
        crate::harness::wait_for(
            "the flood supervisors stopped",
            Duration::from_secs(90),
            || async { (supervisor_gauge(dev, ip).await == Some(0)).then_some(()) },
        )
        .await;
    }
    // The same processes hold them: a restarted controller would measure a
    // fresh process, not what the flood left.
    let now = probe::controllers(dev).await;
    for ((name, ip, pid), (_, _, pid_now)) in ctls.iter().zip(&now) {
        if pid != pid_now {
            let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
                kube::Api::namespaced(dev.client.clone(), "skipper");
            let status = pods
                .get(name)
                .await
                .ok()
                .and_then(|p| p.status)
                .and_then(|s| s.container_statuses)
                .unwrap_or_default();
            let why: Vec<String> = status
                .iter()
                .map(|c| format!("restarts {}, last state {:?}", c.restart_count, c.last_state))
                .collect();
            panic!(
                "controller {name} ({ip}) restarted during heartbeat flood {round} (pid {pid} → {pid_now}): {why:?}"
            );
        }
    }
    with
}

/// Problem 2: 40,000 functions in Heartbeat calls of 10,000 entries to
/// each of 3 controllers (a batch over the per-call limit is refused whole):
/// every controller holds 40,000 supervisors and its RSS per 10,000
/// supervisors is bounded; once they have stopped, the same flood again
/// takes no more memory than the first (what the first took is free again).
/// The RSS kept after the supervisors stop is printed. (Baseline: one
/// 1.5 MB call took each controller from 20 MB to ~750 MB, not returned.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_rss_is_bounded_after_a_heartbeat_flood() {
    let _t = Timer::start("heartbeat flood");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 1,
        // One converge tick per supervisor, after the measurements: the
        // first tick finds the heartbeat timed out and stops it. A
        // controller's 40,000 heartbeats take 8-11 s on a loaded 2-core
        // machine, so the first tick comes well after its flood is counted.
        scale_interval: "25s",
        heartbeat_timeout: "5s",
        ..Opts::default()
    })
    .await;
    let ctls = probe::controllers(&dev).await;
    assert_eq!(ctls.len(), 3, "{ctls:?}");
    let before: Vec<u64> = ctls.iter().map(|(_, _, pid)| probe::rss(*pid).now).collect();

    let mut c0 = grpc(&dev, &ctls[0].1).await;
    let over = api::HeartbeatRequest {
        router_ip: Some("10.255.0.1".into()),
        heartbeats: (0..20_001).map(flood_entry).collect(),
        forwarded_for: Vec::new(),
    };
    let err = c0.heartbeat(over).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");

    let first = flood(&dev, &ctls, 1).await;
    let kept: Vec<u64> = ctls.iter().map(|(_, _, pid)| probe::rss(*pid).now).collect();
    let second = flood(&dev, &ctls, 2).await;
    let per_10k_of = |i: usize| first[i].saturating_sub(before[i]) * 10_000 / FLOOD_FUNCTIONS as u64;
    for (i, (_, ip, _)) in ctls.iter().enumerate() {
        figure(
            &format!("heartbeat flood: controller {ip} RSS"),
            format!(
                "{} before, {} with {FLOOD_FUNCTIONS} supervisors ({} per 10k supervisors), {} after they \
                 stopped, {} with the second flood",
                mib(before[i]),
                mib(first[i]),
                mib(per_10k_of(i)),
                mib(kept[i]),
                mib(second[i])
            ),
        );
    }
    for (i, (_, ip, _)) in ctls.iter().enumerate() {
        assert!(
            per_10k_of(i) <= RSS_PER_10K_SUPERVISORS,
            "{ip}: {} per 10k supervisors, bound {}",
            mib(per_10k_of(i)),
            mib(RSS_PER_10K_SUPERVISORS)
        );
        let peak = first[i].max(kept[i]);
        let allowance = SECOND_FLOOD_SLACK.max(first[i].saturating_sub(before[i]) / 2);
        assert!(
            second[i] <= peak + allowance,
            "{ip}: the second flood took {} where the first left {} (allowance {}): its memory was not reused",
            mib(second[i]),
            mib(peak),
            mib(allowance)
        );
    }
}

/// Supervisors the controller at `ip` holds (its local state).
/// `skipper_controller_supervisors` of the controller at `ip` (None while
/// its metrics do not answer).
async fn supervisor_gauge(dev: &Dev, ip: &str) -> Option<usize> {
    let body = dev
        .http
        .get(format!("http://{ip}:9090/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix("skipper_controller_supervisors "))
        .and_then(|v| v.trim().parse().ok())
}

async fn supervisors(dev: &Dev, ip: &str) -> usize {
    let mut c = grpc(dev, ip).await;
    c.get_cluster_state(api::GetClusterStateRequest {
        local_only: Some(true),
    })
    .await
    .unwrap()
    .into_inner()
    .cluster_state
    .unwrap()
    .supervisors
    .len()
}

/// Oneshot claims released through another controller.
const RELEASES: usize = 200;

/// Problem 3: 200 oneshot instances, each claimed on one controller and
/// released at once through the next one (which has not necessarily seen
/// the claim): no release fails and every released pod is deleted within
/// seconds, not at the heartbeat-timeout clean-up. (Baseline: 54 of 200
/// failed with FAILED_PRECONDITION.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oneshot_releases_succeed_on_any_controller() {
    let _t = Timer::start("oneshot releases");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 8,
        heartbeat_timeout: "60s",
        // Four callers claim and release back to back, so a claim waits for
        // the pool to refill: give it the callers' 30 s rather than the
        // suite's 5 s (a loaded 2-core machine starts a replacement pod in
        // more than 5 s), so what is measured is the releases.
        controller_env: vec![
            "SKIPPER_HPA_DOWNSCALE_STABILIZATION=2s",
            "SKIPPER_HPA_INITIAL_READINESS_DELAY=1s",
            "SKIPPER_FUNCTION_ASSIGN_TIMEOUT=25s",
        ],
        ..Opts::default()
    })
    .await;
    let ctls = probe::controllers(&dev).await;
    let mut clients = Vec::new();
    for (_, ip, _) in &ctls {
        clients.push(grpc(&dev, ip).await);
    }
    let clients = std::sync::Arc::new(clients);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (clients, next) = (clients.clone(), next.clone());
        set.spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= RELEASES {
                    return out;
                }
                let f = Function {
                    namespace: NS.into(),
                    deployment: "fixture".into(),
                    tenant: format!("rel-{i}"),
                    metadata: None,
                    scale: Some(Scale {
                        max_instances: Some(1),
                        ..Scale::default()
                    }),
                    oneshot: Some(true),
                };
                let mut req = tonic::Request::new(api::GetInstanceRequest {
                    function: Some((&f).into()),
                    exclude_instance_names: Vec::new(),
                });
                req.set_timeout(Duration::from_secs(30));
                let mut claim = clients[i % clients.len()].clone();
                let instance = claim
                    .get_instance(req)
                    .await
                    .unwrap()
                    .into_inner()
                    .instance
                    .unwrap();
                let mut release = clients[(i + 1) % clients.len()].clone();
                let r = release
                    .release_instance(api::ReleaseInstanceRequest {
                        instance: Some(instance.clone()),
                    })
                    .await;
                out.push((instance.name.unwrap_or_default(), r.err()));
            }
        });
    }
    let mut results = Vec::new();
    while let Some(r) = set.join_next().await {
        results.extend(r.unwrap());
    }
    let failed: Vec<_> = results.iter().filter(|(_, e)| e.is_some()).collect();
    figure(
        "oneshot releases: failed",
        format!("{} of {}", failed.len(), results.len()),
    );
    assert!(failed.is_empty(), "failed releases: {failed:?}");
    // Released pods go at once (the heartbeat timeout here is 60 s).
    let released: Vec<String> = results.into_iter().map(|(n, _)| n).collect();
    crate::harness::wait_for("released pods deleted", Duration::from_secs(15), || async {
        let claimed = probe::claimed_pods(&dev).await;
        (!released.iter().any(|n| claimed.contains(n))).then_some(())
    })
    .await;
    assert_no_leaks(&dev, "oneshot releases").await;
}

/// New tenants in the burst, and concurrent first requests for each.
const BURST_TENANTS: usize = 40;
const BURST_REQUESTS_PER_TENANT: usize = 8;

/// Problem 4: 8 concurrent first requests for each of 40 new tenants with
/// `max_instances: 1` through the router of a 3-controller playground: no
/// tenant gets a second pod while its first is live and has been Ready
/// since its claim. (A pod that turns unready — a readiness probe timing
/// out on a loaded machine — is replaced, which the `max_instances + 1`
/// rule allows; those are counted apart.) (Baseline: 5 tenants held 2 ready
/// pods after one scale-up assigned two.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_first_requests_holds_max_instances() {
    let _t = Timer::start("burst vs max_instances");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 40,
        ..Opts::default()
    })
    .await;
    let claims = probe::Claims::start(&dev).await;
    let n = BURST_TENANTS * BURST_REQUESTS_PER_TENANT;
    let outcomes = probe::burst(&dev, n, n, |i| single_of(&format!("burst-{}", i % BURST_TENANTS))).await;
    let seen = claims.snapshot();
    figure("burst: requests", &outcomes);
    figure(
        "burst: tenants above max_instances 1",
        format!("{} of {BURST_TENANTS}", seen.over_claims.len()),
    );
    let replaced = seen
        .max_live
        .iter()
        .filter(|(t, n)| **n > 1 && !seen.over_claims.contains_key(*t))
        .count();
    figure(
        "burst: tenants whose unready pod was replaced",
        format!("{replaced} ({} claimed pods turned unready)", seen.unready_flips),
    );
    if !seen.over_claims.is_empty() {
        print_events(&dev, |t| seen.over_claims.contains_key(t)).await;
    }
    assert!(
        seen.over_claims.is_empty(),
        "pods claimed while the tenant's pod was live and Ready: {:?}",
        seen.over_claims
    );
    // A pod that turns unready burns a pool pod for its replacement; when
    // the pool runs dry a request may be answered 503 (no capacity, with
    // Retry-After), never anything else.
    let other: u64 = outcomes
        .0
        .iter()
        .filter(|(k, _)| k.as_str() != "200" && !k.starts_with("503 no capacity"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(other, 0, "{outcomes}");
    drop(claims);
    assert_no_leaks(&dev, "burst").await;
}

/// Prints every controller's events about tenants that `pick` selects (to
/// explain a failure).
async fn print_events(dev: &Dev, pick: impl Fn(&str) -> bool) {
    for (_, ip, _) in probe::controllers(dev).await {
        let state = dev.controller_state(&ip).await;
        let mut events: Vec<&api::Event> = state
            .events
            .iter()
            .filter(|e| {
                pick(
                    e.function
                        .as_ref()
                        .and_then(|f| f.tenant.as_deref())
                        .unwrap_or_default(),
                )
            })
            .collect();
        events.sort_by_key(|e| e.timestamp.map(|t| (t.seconds, t.nanos)));
        for e in events {
            let t = e.timestamp.unwrap_or_default();
            eprintln!(
                "chaos: event on {ip} at {}.{:03}: {} {:?} {}",
                t.seconds,
                t.nanos / 1_000_000,
                e.function
                    .as_ref()
                    .and_then(|f| f.tenant.as_deref())
                    .unwrap_or_default(),
                api::EventType::try_from(e.r#type.unwrap_or_default()).unwrap_or_default(),
                e.message.as_deref().unwrap_or_default()
            );
        }
    }
}

/// Problem 5: tenant pods killed (SIGKILL through the simulator) one after
/// another under steady load: no request is answered 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_502_while_pods_are_killed_under_load() {
    let _t = Timer::start("pod kills");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 6,
        ..Opts::default()
    })
    .await;
    let functions: Vec<(String, String)> = (0..4).map(|i| single_of(&format!("kill-{i}"))).collect();
    for (f, t) in &functions {
        assert_eq!(&dev.echo_tenant(f, "/").await, t);
    }
    let load = Load::start(&dev, functions.clone(), 4);
    load.progress(40).await;
    let mut killed = 0;
    for round in 0..6 {
        // A Ready pod of the tenant (an earlier victim may still be there, dead).
        let tenant = &functions[round % functions.len()].1;
        let pod = crate::harness::wait_for("a Ready pod of the tenant", WAIT, || async {
            dev.pods().await.into_iter().find_map(|p| {
                let serves = p.metadata.labels.as_ref()?.get(TENANT) == Some(tenant);
                (serves && p.metadata.deletion_timestamp.is_none() && pod_ready(&p))
                    .then_some(p.metadata.name?)
            })
        })
        .await;
        dev.fault(&format!("pods/{NS}/{pod}/kill")).await;
        killed += 1;
        load.progress(60).await;
    }
    let outcomes = load.finish().await;
    figure(
        "pod kills: requests",
        format!("{outcomes} ({killed} pods killed)"),
    );
    figure("pod kills: 502s", outcomes.count("502"));
    assert!(killed >= 4, "only {killed} pods killed");
    assert_eq!(outcomes.count("502"), 0, "{outcomes}");
    assert_no_leaks(&dev, "pod kills").await;
}

/// Problem 7 (controller loss): under steady load, one controller is
/// `kill -9`'d and another force-deleted: no request fails (each is sent
/// once, no client retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_failed_request_while_controllers_are_killed() {
    let _t = Timer::start("controller kills");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 6,
        ..Opts::default()
    })
    .await;
    let functions: Vec<(String, String)> = (0..6).map(|i| single_of(&format!("ring-{i}"))).collect();
    for (f, t) in &functions {
        assert_eq!(&dev.echo_tenant(f, "/").await, t);
    }
    let ctls = probe::controllers(&dev).await;
    assert_eq!(ctls.len(), 3, "{ctls:?}");
    let load = Load::start(&dev, functions.clone(), 6);
    load.progress(100).await;
    let (_, ip, pid) = &ctls[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(*pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    figure("controller kills: kill -9", ip);
    load.progress(200).await;
    let (name, ip, _) = &ctls[1];
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(dev.client.clone(), "skipper");
    pods.delete(name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    figure("controller kills: force-deleted", ip);
    load.progress(200).await;
    // A tenant new after the losses is served too.
    let late = single_of("after-kills");
    assert_eq!(dev.echo_tenant(&late.0, "/").await, late.1);
    load.progress(100).await;
    let outcomes = load.finish().await;
    figure("controller kills: requests", &outcomes);
    figure("controller kills: failed requests", outcomes.failed());
    assert_eq!(outcomes.failed(), 0, "{outcomes}");
    assert_no_leaks(&dev, "controller kills").await;
}

/// A new tenant arrives this often during the key rotation.
const NEW_TENANT_EVERY: Duration = Duration::from_secs(2);
/// Bound on one rollout of the playground (pool or controllers).
const ROLLOUT: Duration = Duration::from_secs(120);
/// The template annotation a rollout changes.
const ROTATION: &str = "chaos.skipper.dev/rotation";

/// Sets the pool namespace's trusted public keys (PEM blocks).
async fn trust(dev: &Dev, pem: &str) {
    use skipper::dev::playground::PUBLIC_KEY_CONFIG_MAP;
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(dev.client.clone(), NS);
    maps.patch(
        PUBLIC_KEY_CONFIG_MAP,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"SKIPPER_PUBLIC_KEY": pem}})),
    )
    .await
    .unwrap();
}

/// How far a rollout of [`roll`] must have gone.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rolled {
    /// Every pod is of the new template and Ready, and no pod of an earlier
    /// one is left, not even terminating: what controllers must reach
    /// before pods stop trusting the key the old ones sign with.
    AllReady,
    /// No pod that a controller could claim (unclaimed, not terminating) is
    /// of an earlier template: what a pool must reach before controllers
    /// sign with a key only the new template trusts. Pods the ReplicaSet is
    /// still starting, to refill what new tenants claim, are of the new
    /// template and need not be Ready (new tenants arrive faster than a
    /// loaded machine starts a pod, so the pool is seldom full at once).
    NoneOld,
}

/// Rolls Deployment `namespace/name` out (its template's [`ROTATION`]
/// annotation becomes `step`) and waits until it has gone as far as `until`
/// says (claimed pods aside). Returns how long the rollout took.
async fn roll(dev: &Dev, namespace: &str, name: &str, step: &str, until: Rolled) -> Duration {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Pod;
    let t0 = std::time::Instant::now();
    let deployments: Api<Deployment> = Api::namespaced(dev.client.clone(), namespace);
    let d = deployments
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"template": {"metadata": {
                "annotations": {ROTATION: step}}}}})),
        )
        .await
        .unwrap();
    let spec = d.spec.unwrap();
    let replicas = usize::try_from(spec.replicas.unwrap_or(1)).unwrap();
    let selector: Vec<String> = spec
        .selector
        .match_labels
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let pods: Api<Pod> = Api::namespaced(dev.client.clone(), namespace);
    let lp = kube::api::ListParams::default().labels(&selector.join(","));
    crate::harness::wait_for(
        &format!("the rollout of {namespace}/{name} to step {step}"),
        ROLLOUT,
        || async {
            // Claimed pods keep the pool's labels; they are the tenants', not
            // the rollout's (a rollout of the pool replaces them as stale
            // instances).
            let items: Vec<Pod> = pods
                .list(&lp)
                .await
                .ok()?
                .items
                .into_iter()
                .filter(|p| !p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(TENANT)))
                .collect();
            let current = |p: &Pod| {
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ROTATION))
                    .map(String::as_str)
                    == Some(step)
            };
            let done = match until {
                Rolled::AllReady => {
                    items.iter().all(current)
                        && items.len() == replicas
                        && items
                            .iter()
                            .all(|p| p.metadata.deletion_timestamp.is_none() && pod_ready(p))
                }
                Rolled::NoneOld => {
                    let claimable: Vec<&Pod> = items
                        .iter()
                        .filter(|p| p.metadata.deletion_timestamp.is_none())
                        .collect();
                    !claimable.is_empty() && claimable.into_iter().all(current)
                }
            };
            done.then_some(())
        },
    )
    .await;
    t0.elapsed()
}

/// Problem 8 (key rotation): under steady load of warm tenants and a new
/// tenant every 2 s, the assignment key pair is rotated as the README
/// describes: the pool trusts the old and the new public key (rolled out),
/// the controllers sign with the new private key (rolled out), the pool
/// trusts the new key only (rolled out). No request fails (each is sent
/// once, no client retry), and tenants new after the last step are served
/// by pods that trust the new key only. (Baseline: rotating the controllers
/// first gave 64 consecutive new-tenant 503s over 68 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_failed_request_while_the_assignment_key_rotates() {
    use skipper::dev::playground::{CONTROLLER_NAMESPACE, PASETO_SECRET, PUBLIC_KEY_CONFIG_MAP};
    use skipper::token::SigningKey;
    let _t = Timer::start("key rotation");
    let dev = Dev::start(Opts {
        controllers: 3,
        pool: 6,
        ..Opts::default()
    })
    .await;
    let warm: Vec<(String, String)> = (0..4).map(|i| single_of(&format!("warm-{i}"))).collect();
    for (f, t) in &warm {
        assert_eq!(&dev.echo_tenant(f, "/").await, t);
    }
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(dev.client.clone(), NS);
    let old = maps.get(PUBLIC_KEY_CONFIG_MAP).await.unwrap().data.unwrap()["SKIPPER_PUBLIC_KEY"].clone();
    let next = SigningKey::generate();
    let next_public = next.verifying_key().to_pem();
    let old_kid = skipper::token::VerifyingKey::from_pem(&old)
        .unwrap()
        .key_id(skipper::token::Version::V2);
    figure(
        "key rotation: key ids",
        format!("old {old_kid}, new {}", next.key_id(skipper::token::Version::V2)),
    );

    let load = Load::start(&dev, warm.clone(), 4);
    let arrivals = probe::Arrivals::start(&dev, "new", NEW_TENANT_EVERY);
    load.progress(50).await;
    // 1. Trust the new key beside the old one; roll the pool.
    trust(&dev, &format!("{}\n{next_public}", old.trim_end())).await;
    let took = roll(&dev, NS, "fixture", "1", Rolled::NoneOld).await;
    figure(
        "key rotation: pool trusts both keys",
        format!("rolled out in {:.1}s", took.as_secs_f64()),
    );
    // 2. Sign with the new key; roll the controllers.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(dev.client.clone(), CONTROLLER_NAMESPACE);
    secrets
        .patch(
            PASETO_SECRET,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"SKIPPER_PASETO_PRIVATE_KEY": next.to_pem()}})),
        )
        .await
        .unwrap();
    let took = roll(
        &dev,
        CONTROLLER_NAMESPACE,
        "skipper-controller",
        "1",
        Rolled::AllReady,
    )
    .await;
    figure(
        "key rotation: controllers sign with the new key",
        format!("rolled out in {:.1}s", took.as_secs_f64()),
    );
    // 3. Trust the new key only; roll the pool.
    trust(&dev, &next_public).await;
    let took = roll(&dev, NS, "fixture", "2", Rolled::NoneOld).await;
    figure(
        "key rotation: pool trusts the new key only",
        format!("rolled out in {:.1}s", took.as_secs_f64()),
    );
    // Tenants new after the last step are claimed from pods that trust the
    // new key only.
    let after = single_of("after-rotation");
    assert_eq!(dev.echo_tenant(&after.0, "/").await, after.1);
    load.progress(50).await;
    let new = arrivals.finish().await;
    let warm = load.finish().await;
    figure("key rotation: warm tenants", &warm);
    figure("key rotation: new tenants", &new);
    assert_eq!(warm.failed(), 0, "warm tenants: {warm}");
    assert_eq!(new.failed(), 0, "new tenants: {new}");
    assert!(new.count("200") >= 8, "too few new tenants arrived: {new}");
    assert_no_leaks(&dev, "key rotation").await;
}
