//! Memory of idle supervisors, counted by a global allocator: what one idle
//! supervisor holds (its map entry, shared part, task and one router's
//! heartbeat) and that all of it is freed when the supervisors stop. The
//! actors run over an in-memory context on paused time, with the same
//! tracing subscriber as the controller (JSON at `info`).
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

/// The bound this test keeps: heap bytes per idle supervisor.
const MAX_BYTES_PER_SUPERVISOR: f64 = 2048.0;

/// A cluster where every function has one ready instance and no traffic:
/// each tick plans, finds nothing to do and acts on nothing.
struct Idle {
    settings: Settings,
    epoch: SystemTime,
    origin: Instant,
}

impl Context for Idle {
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
    async fn assign(&self, f: &Function, _: Instant) -> Result<Instance> {
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

#[test]
fn an_idle_supervisor_holds_at_most_two_kib_and_gives_it_back_when_it_stops() {
    const NAME: &str =
        "supervisor_memory::an_idle_supervisor_holds_at_most_two_kib_and_gives_it_back_when_it_stops";
    if std::env::var_os(ALONE).is_some() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(idle_supervisors());
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8(skipper_test_support::process::succeeded(NAME, out)).unwrap();
    print!("{stdout}");
    assert!(stdout.contains("1 passed"), "the test ran alone: {stdout}");
}

async fn idle_supervisors() {
    const N: usize = 10_000;
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::sink)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let ctx = Arc::new(Idle {
        settings: Settings {
            scale_interval: Duration::from_secs(15),
            scale: ScaleConfig::default(),
        },
        epoch: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        origin: Instant::now(),
    });
    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    let registry = Registry::new(ctx.clone(), token.clone(), tracker.clone());
    let routers = Routers::new(16, 1_000_000);
    let router = routers.get("10.1.0.1").unwrap();
    let functions: Vec<Function> = (0..N).map(function).collect();
    // Warm up one-off allocations (the map's first buckets, the runtime).
    let warm = registry.get_or_spawn(&function(N), false).await;
    drop(warm);
    tokio::time::sleep(Duration::from_millis(1)).await;

    let before = live_bytes();
    for f in &functions {
        let h = registry.get_or_spawn(f, false).await;
        let now = ctx.now();
        h.shared.with_heartbeats(|s| {
            s.record(
                &router,
                Report {
                    timestamp: now,
                    in_flight: 0,
                },
                now,
                Duration::from_secs(90),
            )
            .unwrap();
        });
    }
    // Two converge ticks of every supervisor (protected: nothing happens).
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(registry.len(), N + 1);
    let held = live_bytes() - before;
    let per_supervisor = held as f64 / N as f64;
    println!("{per_supervisor:.0} heap bytes per idle supervisor ({N} supervisors, {held} bytes)");
    assert!(
        per_supervisor <= MAX_BYTES_PER_SUPERVISOR,
        "{per_supervisor:.0} bytes per idle supervisor, over {MAX_BYTES_PER_SUPERVISOR}"
    );
    assert_eq!(router.active(), N, "one report per function");

    registry.stop_all();
    tracker.close();
    tokio::time::timeout(Duration::from_secs(5), tracker.wait())
        .await
        .unwrap();
    assert!(registry.is_empty());
    assert_eq!(
        router.active(),
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
