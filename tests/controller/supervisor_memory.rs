//! Memory of supervisors, counted by a global allocator: what one idle
//! supervisor holds (its map entry, shared part, task and one router's
//! heartbeat) and that all of it is freed when the supervisors stop, and
//! what one holds while its function is active and its ticks wait for a
//! pool pod that does not come. The actors run over an in-memory context on
//! paused time, with the same tracing subscriber as the controller (JSON at
//! `info`).
//!
//! The counts are the process's: under a runner that runs the tests of a
//! binary side by side in one process (plain `cargo test`), the test runs
//! itself again, alone, in a process of its own.

#![allow(clippy::unwrap_used, clippy::cast_precision_loss, clippy::cast_possible_wrap)]

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use skipper::api::{EventSeverity, EventType};
use skipper::controller::error::Result;
use skipper::controller::heartbeat::{Report, Routers};
use skipper::controller::kube::Instance;
use skipper::controller::supervisor::converge::ScaleConfig;
use skipper::controller::supervisor::{Context, Registry, Scaled, Settings};
use skipper::domain::{Function, FunctionId, Scale};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::live_bytes;

/// The bounds these tests keep: heap bytes per idle supervisor, and per
/// supervisor of an active function (what the controller's context adds
/// fits in the 3 KiB per active function `make bench-controller` keeps).
const MAX_BYTES_PER_SUPERVISOR: f64 = 2048.0;
const MAX_BYTES_PER_ACTIVE_SUPERVISOR: f64 = 2560.0;

/// A cluster where every function has one ready instance and no traffic
/// (each tick plans, finds nothing to do and acts on nothing), or, when
/// `active`, no instance and a pool with no pod (each tick decides an
/// instance and waits for a pool pod until its deadline).
struct Fake {
    settings: Settings,
    epoch: SystemTime,
    origin: Instant,
    active: bool,
}

impl Context for Fake {
    fn settings(&self) -> &Settings {
        &self.settings
    }
    fn now(&self) -> SystemTime {
        self.epoch + self.origin.elapsed()
    }
    fn started_at(&self) -> SystemTime {
        self.epoch
    }
    fn is_owner(&self, _: FunctionId) -> bool {
        true
    }
    async fn instances(&self, f: &Function) -> Result<Vec<Instance>> {
        if self.active {
            return Ok(Vec::new());
        }
        Ok(vec![Instance {
            namespace: f.namespace.clone(),
            name: f.tenant.clone(),
            function: Arc::new(f.clone()),
            replica_set: "pool-1".into(),
            assigned_at: self.epoch,
            ready_at: Some(self.epoch),
            addr: "10.0.0.1:8080".into(),
            cpu_milli: 0,
            memory_mib: 0,
            protocol: Default::default(),
            assign_timing: None,
        }])
    }
    fn replica_set_retired(&self, _: &Function, _: &str) -> bool {
        false
    }
    async fn wait_for_pool_pod(&self, _: &Function, deadline: Instant) {
        tokio::time::sleep_until(deadline).await;
    }
    async fn assign(&self, f: &Function, deadline: Instant) -> Result<Instance> {
        // No pool pod comes.
        tokio::time::sleep_until(deadline).await;
        Err(skipper::controller::assign::Error::NoPoolPod {
            namespace: f.namespace.clone(),
            deployment: f.deployment.clone(),
        }
        .into())
    }
    async fn delete(&self, _: &Function, _: &str) -> Result<bool> {
        Ok(false)
    }
    fn stale_permit(&self) -> Option<OwnedSemaphorePermit> {
        None
    }
    fn event(&self, _: &Function, _: EventType, _: EventSeverity, _: String) {}
    fn count(&self, _: &Function, _: Scaled, _: u64) {}
}

fn function(i: usize) -> Function {
    Function {
        namespace: "functions".into(),
        deployment: "pool".into(),
        tenant: format!("tenant-{i:06}"),
        metadata: None,
        scale: Some(Scale {
            min_instances: Some(0),
            max_instances: Some(1),
            ..Scale::default()
        }),
        oneshot: None,
    }
}

/// Set in the process the test runs alone in.
const ALONE: &str = "SKIPPER_TEST_SUPERVISOR_MEMORY_ALONE";

/// Runs `test` (the test `name` of this module) on paused time in a
/// process of its own.
fn alone<F: std::future::Future<Output = ()>>(name: &str, test: impl FnOnce() -> F) {
    let name = format!("supervisor_memory::{name}");
    if std::env::var_os(ALONE).is_some() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(test());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &name, "--nocapture", "--test-threads", "1"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8(skipper_test_support::process::succeeded(&name, out)).unwrap();
    print!("{stdout}");
    assert!(stdout.contains("1 passed"), "the test ran alone: {stdout}");
}

/// Logs as the controller does (JSON at `info`, into a sink) while the
/// guard lives.
fn log_as_the_controller() -> tracing::subscriber::DefaultGuard {
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::sink)
        .finish();
    tracing::subscriber::set_default(subscriber)
}

/// Supervisors over a [`Fake`] cluster, with one router reporting.
struct Supervisors {
    ctx: Arc<Fake>,
    registry: Registry<Fake>,
    tracker: TaskTracker,
    router: Arc<skipper::controller::heartbeat::Router>,
    /// How long a report counts.
    heartbeat_timeout: Duration,
}

impl Supervisors {
    fn new(active: bool) -> Self {
        let mut scale = ScaleConfig::default();
        if active {
            // The routers' reports stay fresh for the whole test.
            scale.heartbeat_timeout = Duration::from_secs(3600);
        }
        let heartbeat_timeout = scale.heartbeat_timeout;
        let ctx = Arc::new(Fake {
            settings: Settings {
                scale_interval: Duration::from_secs(15),
                scale,
            },
            epoch: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            origin: Instant::now(),
            active,
        });
        let tracker = TaskTracker::new();
        let registry = Registry::new(ctx.clone(), CancellationToken::new(), tracker.clone());
        let router = Routers::new(16, 1_000_000).get("10.1.0.1").unwrap();
        Self {
            ctx,
            registry,
            tracker,
            router,
            heartbeat_timeout,
        }
    }

    /// Starts `f`'s supervisor with one report of the router, nothing in
    /// flight.
    async fn start_active(&self, f: &Function) {
        let h = self.registry.get_or_spawn(f, false).await;
        let now = self.ctx.now();
        let report = Report {
            timestamp: now,
            in_flight: 0,
        };
        h.shared
            .with_heartbeats(|s| s.record(&self.router, report, now, self.heartbeat_timeout))
            .unwrap();
    }

    /// Stops every supervisor and waits for their tasks.
    async fn stop(&self) {
        self.registry.stop_all();
        self.tracker.close();
        tokio::time::timeout(Duration::from_secs(5), self.tracker.wait())
            .await
            .unwrap();
        assert!(self.registry.is_empty());
    }
}

#[test]
fn an_idle_supervisor_holds_at_most_two_kib_and_gives_it_back_when_it_stops() {
    alone(
        "an_idle_supervisor_holds_at_most_two_kib_and_gives_it_back_when_it_stops",
        idle_supervisors,
    );
}

#[test]
fn an_active_supervisor_waiting_for_a_pool_pod_holds_at_most_two_and_a_half_kib() {
    alone(
        "an_active_supervisor_waiting_for_a_pool_pod_holds_at_most_two_and_a_half_kib",
        active_supervisors,
    );
}

async fn idle_supervisors() {
    const N: usize = 10_000;
    let _log = log_as_the_controller();
    let world = Supervisors::new(false);
    let functions: Vec<Function> = (0..N).map(function).collect();
    // Warm up one-off allocations (the map's first buckets, the runtime).
    let warm = world.registry.get_or_spawn(&function(N), false).await;
    drop(warm);
    tokio::time::sleep(Duration::from_millis(1)).await;

    let before = live_bytes();
    for f in &functions {
        world.start_active(f).await;
    }
    // Two converge ticks of every supervisor (protected: nothing happens).
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(world.registry.len(), N + 1);
    let held = live_bytes() - before;
    let per_supervisor = held as f64 / N as f64;
    println!("{per_supervisor:.0} heap bytes per idle supervisor ({N} supervisors, {held} bytes)");
    assert!(
        per_supervisor <= MAX_BYTES_PER_SUPERVISOR,
        "{per_supervisor:.0} bytes per idle supervisor, over {MAX_BYTES_PER_SUPERVISOR}"
    );
    assert_eq!(world.router.active(), N, "one report per function");

    world.stop().await;
    assert_eq!(
        world.router.active(),
        0,
        "stopped supervisors release their router's slots"
    );
    // What stays is capacity: the map's buckets and the runtime's queues
    // (about 45 bytes per supervisor that ever ran).
    let left = live_bytes() - before;
    println!("{left} bytes left after every supervisor stopped");
    assert!(
        left < (N as i64) * 64,
        "stopped supervisors keep {left} bytes ({} per supervisor)",
        left / N as i64
    );
}

/// Functions scaled on in-flight requests (their per-instance metric is
/// NaN without instances) that routers keep active, whose pool has no pod:
/// each tick decides an instance, waits for a pool pod until the assign
/// timeout, then fails to assign one.
async fn active_supervisors() {
    const N: usize = 10_000;
    let _log = log_as_the_controller();
    let world = Supervisors::new(true);
    let active_function = |i| {
        let mut f = function(i);
        f.scale.as_mut().unwrap().target_in_flight_requests = Some(1);
        f
    };
    let functions: Vec<Function> = (0..N).map(active_function).collect();
    // Warm up one-off allocations (the map's first buckets, the runtime,
    // the first span and events) with one function through a tick.
    world.start_active(&active_function(N)).await;
    tokio::time::sleep(Duration::from_secs(60)).await;

    let before = live_bytes();
    for f in &functions {
        world.start_active(f).await;
    }
    // Ticks at about 15 s, 45 s and 75 s each wait 30 s for a pool pod;
    // at 100 s every supervisor waits in its third.
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(world.registry.len(), N + 1);
    let held = live_bytes() - before;
    let per_supervisor = held as f64 / N as f64;
    let recommendations = world
        .registry
        .handles()
        .iter()
        .map(|h| h.shared.recommendations().len())
        .max()
        .unwrap();
    println!(
        "{per_supervisor:.0} heap bytes per active supervisor ({N} supervisors waiting for a pool pod, {held} bytes)"
    );
    assert_eq!(
        recommendations, 1,
        "ticks that recommend the same extend one recommendation"
    );
    assert!(
        per_supervisor <= MAX_BYTES_PER_ACTIVE_SUPERVISOR,
        "{per_supervisor:.0} bytes per active supervisor, over {MAX_BYTES_PER_ACTIVE_SUPERVISOR}"
    );

    world.stop().await;
}
