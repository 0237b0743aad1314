//! Supervisor actors over an in-memory [`Context`] on paused time: no
//! Kubernetes client, signing key or peers.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize};

use tokio::sync::{Notify, Semaphore};

use super::*;
use crate::api::ScaleReason;
use crate::controller::heartbeat::{Report, Router, Routers};
use crate::domain::Scale;

/// A cluster in memory. Its wall clock follows tokio's (paused) clock.
struct Fake {
    settings: Settings,
    epoch: SystemTime,
    origin: Instant,
    owner: AtomicBool,
    instances: Mutex<Vec<Instance>>,
    assigned: AtomicUsize,
    /// While set, `assign` waits for a notification before it answers.
    hold_assign: AtomicBool,
    release_assign: Notify,
    deleted: Mutex<Vec<String>>,
    events: Mutex<Vec<(EventType, String)>>,
    scaled: Mutex<Vec<(Scaled, u64)>>,
    permits: Arc<Semaphore>,
    panic_on_read: AtomicBool,
    /// While set, the pool has no pod: `wait_for_pool_pod` waits for a
    /// notification (or its deadline).
    empty_pool: AtomicBool,
    pool_pod: Notify,
    /// The metadata and deadline of each `wait_for_pool_pod`, and the
    /// deadlines `assign` was called with.
    waited: Mutex<Vec<(Option<String>, Instant)>>,
    assign_deadlines: Mutex<Vec<Instant>>,
}

impl Fake {
    fn new() -> Arc<Self> {
        Self::with(Settings {
            scale_interval: Duration::from_secs(1),
            scale: ScaleConfig {
                heartbeat_timeout: Duration::from_secs(30),
                downscale_stabilization: Duration::from_secs(5),
                assign_timeout: Duration::from_secs(5),
                ..ScaleConfig::default()
            },
        })
    }

    /// A cluster whose controller started now, with `settings`.
    fn with(settings: Settings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            epoch: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            origin: Instant::now(),
            owner: AtomicBool::new(true),
            instances: Mutex::default(),
            assigned: AtomicUsize::new(0),
            hold_assign: AtomicBool::new(false),
            release_assign: Notify::new(),
            deleted: Mutex::default(),
            events: Mutex::default(),
            scaled: Mutex::default(),
            permits: Arc::new(Semaphore::new(10)),
            panic_on_read: AtomicBool::new(false),
            empty_pool: AtomicBool::new(false),
            pool_pod: Notify::new(),
            waited: Mutex::default(),
            assign_deadlines: Mutex::default(),
        })
    }

    fn instance(&self, f: &Function, name: &str) -> Instance {
        let now = self.now();
        Instance {
            namespace: f.namespace.clone(),
            name: name.into(),
            function: Arc::new(f.clone()),
            replica_set: "rs".into(),
            assigned_at: now,
            ready_at: Some(now),
            addr: "10.0.0.1:8080".into(),
            cpu_milli: 0,
            memory_mib: 0,
            protocol: Default::default(),
            assign_timing: None,
        }
    }

    /// The deadlines `wait_for_pool_pod` was called with.
    fn waited(&self) -> Vec<Instant> {
        self.waited.lock().unwrap().iter().map(|(_, d)| *d).collect()
    }

    fn events(&self) -> Vec<EventType> {
        self.events.lock().unwrap().iter().map(|(k, _)| *k).collect()
    }
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
        self.owner.load(Ordering::SeqCst)
    }

    async fn instances(&self, _: &Function) -> Result<Vec<Instance>> {
        assert!(!self.panic_on_read.load(Ordering::SeqCst), "bug in a context");
        Ok(self.instances.lock().unwrap().clone())
    }

    fn replica_set_retired(&self, _: &Function, _: &str) -> bool {
        false
    }

    async fn wait_for_pool_pod(&self, f: &Function, deadline: Instant) {
        self.waited.lock().unwrap().push((f.metadata.clone(), deadline));
        if self.empty_pool.load(Ordering::SeqCst) {
            let _ = tokio::time::timeout_at(deadline, self.pool_pod.notified()).await;
        }
    }

    async fn assign(&self, f: &Function, deadline: Instant) -> Result<Instance> {
        self.assign_deadlines.lock().unwrap().push(deadline);
        if self.hold_assign.load(Ordering::SeqCst)
            && tokio::time::timeout_at(deadline, self.release_assign.notified())
                .await
                .is_err()
        {
            return Err(crate::controller::assign::Error::NoPoolPod {
                namespace: f.namespace.clone(),
                deployment: f.deployment.clone(),
            }
            .into());
        }
        let n = self.assigned.fetch_add(1, Ordering::SeqCst);
        let i = self.instance(f, &format!("pod-{n}"));
        self.instances.lock().unwrap().push(i.clone());
        Ok(i)
    }

    async fn delete(&self, _: &Function, name: &str) -> Result<bool> {
        let mut instances = self.instances.lock().unwrap();
        let before = instances.len();
        instances.retain(|i| i.name != name);
        self.deleted.lock().unwrap().push(name.to_owned());
        Ok(instances.len() < before)
    }

    fn stale_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    fn event(&self, _: &Function, kind: EventType, _: EventSeverity, message: String) {
        self.events.lock().unwrap().push((kind, message));
    }

    fn count(&self, _: &Function, what: Scaled, n: u64) {
        self.scaled.lock().unwrap().push((what, n));
    }
}

fn function(tenant: &str) -> Function {
    Function {
        namespace: "ns".into(),
        deployment: "dep".into(),
        tenant: tenant.into(),
        metadata: None,
        scale: Some(Scale {
            min_instances: Some(0),
            max_instances: Some(1),
            ..Scale::default()
        }),
        oneshot: None,
    }
}

fn registry(ctx: &Arc<Fake>) -> Registry<Fake> {
    Registry::new(ctx.clone(), CancellationToken::new(), TaskTracker::new())
}

fn router() -> Arc<Router> {
    Routers::new(4, 1000).get("10.1.0.1").unwrap()
}

fn beat(ctx: &Fake, h: &Handle, in_flight: u32) {
    let now = ctx.now();
    let timeout = ctx.settings.scale.heartbeat_timeout;
    let report = Report {
        timestamp: now,
        in_flight,
    };
    h.shared
        .with_heartbeats(|s| s.record(&router(), report, now, timeout))
        .unwrap();
}

/// Lets every ready task run (paused time stands still meanwhile).
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_scale_command_assigns_and_answers_the_ready_instance() {
    let ctx = Fake::new();
    let reg = registry(&ctx);
    let f = function("t");
    let h = reg.get_or_spawn(&f, false).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let ready = h
        .scale(Decision::new(1, ScaleReason::NoReadyInstances), deadline)
        .await
        .unwrap();
    assert_eq!(ready.len(), 1);
    assert_eq!(ready[0].name, "pod-0");
    assert_eq!(ctx.events(), [EventType::ScaleUp, EventType::PodAssigned]);
    assert_eq!(*ctx.scaled.lock().unwrap(), [(Scaled::Up, 1)]);
    // A second identical command finds the instance and assigns nothing.
    let again = h
        .scale(Decision::new(1, ScaleReason::NoReadyInstances), deadline)
        .await
        .unwrap();
    assert_eq!(again[0].name, "pod-0");
    assert_eq!(ctx.assigned.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_full_mailbox_is_refused_as_such_not_as_no_ready_instance() {
    let ctx = Fake::new();
    ctx.hold_assign.store(true, Ordering::SeqCst);
    let reg = registry(&ctx);
    let f = function("busy");
    let h = reg.get_or_spawn(&f, false).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let decision = Decision::new(1, ScaleReason::NoReadyInstances);
    // The first command holds the actor inside assign; the rest wait.
    let mut waiting = tokio::task::JoinSet::new();
    for _ in 0..=MAILBOX_CAPACITY {
        let h = h.clone();
        let d = decision.clone();
        waiting.spawn(async move { h.scale(d, deadline).await });
        settle().await;
    }
    assert_eq!(h.shared.mailbox.len(), MAILBOX_CAPACITY);
    let err = h.scale(decision.clone(), deadline).await.unwrap_err();
    assert!(matches!(err, Error::MailboxFull { .. }), "{err}");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.to_string().contains("ns/dep") && err.to_string().contains(&MAILBOX_CAPACITY.to_string()),
        "{err}"
    );
    // Once the assignment completes, every waiting caller is answered.
    ctx.release_assign.notify_one();
    let mut answered = 0;
    while let Some(r) = waiting.join_next().await {
        assert_eq!(r.unwrap().unwrap()[0].name, "pod-0");
        answered += 1;
    }
    assert_eq!(answered, MAILBOX_CAPACITY + 1);
    assert_eq!(ctx.assigned.load(Ordering::SeqCst), 1);
    assert_eq!(h.shared.mailbox.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_idle_function_scales_to_zero_after_the_heartbeat_timeout_and_its_supervisor_stops() {
    let ctx = Fake::new();
    let reg = registry(&ctx);
    let f = function("idle");
    let h = reg.get_or_spawn(&f, false).await;
    beat(&ctx, &h, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    h.scale(Decision::new(1, ScaleReason::NoReadyInstances), deadline)
        .await
        .unwrap();
    // Active within the timeout: ticks keep the instance.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(ctx.deleted.lock().unwrap().is_empty());
    assert_eq!(reg.len(), 1);
    // No heartbeat for longer than the timeout: scale to zero, then stop.
    tokio::time::sleep(Duration::from_secs(15)).await;
    settle().await;
    assert_eq!(*ctx.deleted.lock().unwrap(), ["pod-0"]);
    assert!(ctx.events().contains(&EventType::HeartbeatTimeout));
    assert!(reg.is_empty(), "the supervisor removed its own handle");
    assert!(h.is_stopped());
    // A later call gets a fresh supervisor.
    let h2 = reg.get_or_spawn(&f, false).await;
    assert!(!h2.is_stopped());
    assert_ne!(h2.generation, h.generation);
}

#[tokio::test(start_paused = true)]
async fn a_supervisor_that_does_not_own_its_function_never_acts() {
    let ctx = Fake::new();
    ctx.owner.store(false, Ordering::SeqCst);
    let reg = registry(&ctx);
    let f = function("elsewhere");
    let h = reg.get_or_spawn(&f, false).await;
    ctx.instances.lock().unwrap().push(ctx.instance(&f, "theirs"));
    tokio::time::sleep(Duration::from_secs(60)).await;
    settle().await;
    assert!(ctx.deleted.lock().unwrap().is_empty(), "only the owner deletes");
    assert!(ctx.events().is_empty());
    // It stops on its own once the function is idle everywhere.
    assert!(reg.is_empty());
    assert!(h.is_stopped());
}

#[tokio::test(start_paused = true)]
async fn a_panic_in_one_supervisor_ends_only_that_one() {
    let ctx = Fake::new();
    let reg = registry(&ctx);
    let a = reg.get_or_spawn(&function("a"), false).await;
    ctx.panic_on_read.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert!(a.is_stopped(), "the panicking actor ended");
    assert!(reg.is_empty());
    ctx.panic_on_read.store(false, Ordering::SeqCst);
    let b = reg.get_or_spawn(&function("b"), false).await;
    beat(&ctx, &b, 0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!b.is_stopped());
}

#[tokio::test(start_paused = true)]
async fn stopping_answers_waiting_commands_and_frees_every_handle() {
    let ctx = Fake::new();
    ctx.hold_assign.store(true, Ordering::SeqCst);
    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    let reg = Registry::new(ctx.clone(), token.clone(), tracker.clone());
    let h = reg.get_or_spawn(&function("t"), false).await;
    for i in 0..10 {
        let other = reg.get_or_spawn(&function(&format!("idle-{i}")), false).await;
        beat(&ctx, &other, 0);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let d = Decision::new(1, ScaleReason::NoReadyInstances);
    let (h1, h2) = (h.clone(), h.clone());
    let (d1, d2) = (d.clone(), d);
    let first = tokio::spawn(async move { h1.scale(d1, deadline).await });
    settle().await;
    let second = tokio::spawn(async move { h2.scale(d2, deadline).await });
    settle().await;
    reg.stop_all();
    tracker.close();
    tokio::time::timeout(Duration::from_secs(1), tracker.wait())
        .await
        .expect("every actor stops promptly, even one inside a command");
    assert!(reg.is_empty());
    assert!(matches!(first.await.unwrap(), Err(Error::ShuttingDown)));
    assert!(matches!(second.await.unwrap(), Err(Error::SupervisorStopped)));
    assert!(matches!(
        h.scale(Decision::new(1, ScaleReason::NoReadyInstances), deadline)
            .await,
        Err(Error::SupervisorStopped)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_scale_only_change_keeps_the_instance_and_a_metadata_change_replaces_it() {
    let ctx = Fake::new();
    let reg = registry(&ctx);
    let f = function("warm");
    let h = reg.get_or_spawn(&f, true).await;
    beat(&ctx, &h, 0);
    h.scale(
        Decision::new(1, ScaleReason::NoReadyInstances),
        Instant::now() + Duration::from_secs(5),
    )
    .await
    .unwrap();
    let names = || {
        ctx.instances
            .lock()
            .unwrap()
            .iter()
            .map(|i| i.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(), ["pod-0"]);
    // Another caller's header for the same tenant: other scale settings.
    let mut wider = f.clone();
    wider.scale = Some(Scale {
        min_instances: Some(0),
        max_instances: Some(3),
        target_cpu_usage_milli: Some(500),
        target_in_flight_requests: Some(10),
        ..Scale::default()
    });
    reg.get_or_spawn(&wider, true).await;
    assert_eq!(*h.shared.spec(), wider, "the supervisor follows the new scale");
    for _ in 0..10 {
        beat(&ctx, &h, 0);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    settle().await;
    assert_eq!(names(), ["pod-0"], "ten ticks later the same pod serves");
    assert!(ctx.deleted.lock().unwrap().is_empty());
    assert!(!ctx.events().contains(&EventType::StaleReplacement));
    // New metadata: what the pod got at assignment no longer holds.
    let mut relabelled = wider.clone();
    relabelled.metadata = Some("v2".into());
    reg.get_or_spawn(&relabelled, true).await;
    beat(&ctx, &h, 0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(names(), ["pod-1"]);
    assert_eq!(*ctx.deleted.lock().unwrap(), ["pod-0"]);
    assert!(ctx.events().contains(&EventType::StaleReplacement));
    let replacement = ctx.instances.lock().unwrap()[0].function.clone();
    assert_eq!(replacement.metadata.as_deref(), Some("v2"));
}

/// An idle function's pod goes at the first tick once `--heartbeat-timeout`
/// has passed since its last activity, and never within the start-up
/// protection, `max(--hpa-downscale-stabilization, --heartbeat-timeout)`
/// after the controller started (spec §5.5).
#[tokio::test(start_paused = true)]
async fn an_idle_pod_goes_a_heartbeat_timeout_after_its_last_activity_once_the_protection_is_over() {
    let s = Duration::from_secs;
    // (stabilization, last activity, the pod goes within [from, to]), in
    // seconds after the controller started; 30 s timeout, 5 s ticks.
    let table = [
        // `skipper dev`: the window is the heartbeat timeout.
        (30, 5, 35, 41),
        (30, 60, 90, 96),
        // The product's default 90 s window: a tenant used soon after the
        // controller started waits out the protection.
        (90, 5, 90, 96),
        (90, 100, 130, 136),
    ];
    for (stabilization, active, from, to) in table {
        let ctx = Fake::with(Settings {
            scale_interval: s(5),
            scale: ScaleConfig {
                heartbeat_timeout: s(30),
                downscale_stabilization: s(stabilization),
                assign_timeout: s(5),
                ..ScaleConfig::default()
            },
        });
        let reg = registry(&ctx);
        tokio::time::sleep(s(active)).await;
        let f = function("idle");
        let h = reg.get_or_spawn(&f, false).await;
        beat(&ctx, &h, 0);
        h.scale(
            Decision::new(1, ScaleReason::NoReadyInstances),
            Instant::now() + s(5),
        )
        .await
        .unwrap();
        // Step the paused clock until the pod is deleted.
        let gone = loop {
            if !ctx.deleted.lock().unwrap().is_empty() {
                break ctx.origin.elapsed();
            }
            assert!(
                ctx.origin.elapsed() < s(to + 30),
                "window {stabilization}s, active at {active}s: the pod stays"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            gone >= s(from) && gone <= s(to),
            "window {stabilization}s, active at {active}s: the pod went {gone:?} after the start, not within {from}–{to}s"
        );
        assert!(ctx.events().contains(&EventType::HeartbeatTimeout));
    }
}

/// A tick whose only work is a scale-up waits for a pool pod before it acts
/// (no event, no count, no assignment meanwhile), and its assignment keeps
/// the deadline the wait started with.
#[tokio::test(start_paused = true)]
async fn a_scale_up_waits_for_a_pool_pod_before_it_acts() {
    let ctx = Fake::new();
    ctx.empty_pool.store(true, Ordering::SeqCst);
    let reg = registry(&ctx);
    let h = reg.get_or_spawn(&function("waiting"), false).await;
    beat(&ctx, &h, 1);
    // The first tick (after about 1 s) decides one instance and waits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(ctx.waited.lock().unwrap().len(), 1, "one tick waits");
    assert!(ctx.events().is_empty(), "nothing happens while it waits");
    assert!(ctx.scaled.lock().unwrap().is_empty());
    assert_eq!(ctx.assigned.load(Ordering::SeqCst), 0);
    // A pool pod: the tick acts at once, with the wait's deadline.
    ctx.empty_pool.store(false, Ordering::SeqCst);
    ctx.pool_pod.notify_one();
    settle().await;
    assert_eq!(ctx.events(), [EventType::ScaleUp, EventType::PodAssigned]);
    assert_eq!(*ctx.scaled.lock().unwrap(), [(Scaled::Up, 1)]);
    assert_eq!(ctx.assigned.load(Ordering::SeqCst), 1);
    assert_eq!(*ctx.assign_deadlines.lock().unwrap(), [ctx.waited()[0]]);

    // No pool pod comes: at the deadline the tick acts and its assignment
    // fails at once (the deadline has passed), one assign timeout after the
    // wait started, not two.
    let ctx = Fake::new();
    ctx.empty_pool.store(true, Ordering::SeqCst);
    ctx.hold_assign.store(true, Ordering::SeqCst);
    let reg = registry(&ctx);
    let h = reg.get_or_spawn(&function("starved"), false).await;
    beat(&ctx, &h, 1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    let waited = ctx.waited()[0];
    tokio::time::sleep_until(waited).await;
    settle().await;
    assert_eq!(ctx.events(), [EventType::ScaleUp], "scaled up, nothing assigned");
    assert_eq!(*ctx.assign_deadlines.lock().unwrap(), [waited]);
    assert_eq!(ctx.assigned.load(Ordering::SeqCst), 0);
    assert!(!h.is_stopped(), "a failed tick leaves the supervisor running");
}

/// What happens while a tick waits for a pool pod.
#[derive(Debug, Clone, Copy)]
enum WhileWaiting {
    /// A `Scale` command arrives.
    Command,
    /// A caller's header brings new metadata.
    NewSpec,
    /// The ring moves the function to another controller, then a pool pod
    /// appears.
    RingMoves,
    /// The controller shuts down.
    Stop,
}

/// A waiting scale-up has done nothing yet: a command is served at once,
/// a new spec is planned again at once, a controller that lost the
/// function does not act once the wait ends, and stopping ends the wait.
#[tokio::test(start_paused = true)]
async fn a_waiting_scale_up_gives_way_to_commands_new_specs_the_ring_and_stopping() {
    use WhileWaiting::*;
    // (what happens, metadata of each wait, events, pods assigned)
    let table = [
        (
            Command,
            vec![None],
            vec![EventType::ScaleUp, EventType::PodAssigned],
            1,
        ),
        (NewSpec, vec![None, Some("v2")], vec![], 0),
        (RingMoves, vec![None], vec![], 0),
        (Stop, vec![None], vec![], 0),
    ];
    for (what, waits, events, assigned) in table {
        let ctx = Fake::new();
        ctx.empty_pool.store(true, Ordering::SeqCst);
        let token = CancellationToken::new();
        let tracker = TaskTracker::new();
        let reg = Registry::new(ctx.clone(), token, tracker.clone());
        let f = function("waiting");
        let h = reg.get_or_spawn(&f, true).await;
        beat(&ctx, &h, 1);
        tokio::time::sleep(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(ctx.waited().len(), 1, "{what:?}: the tick waits");
        let started = Instant::now();
        match what {
            Command => {
                let ready = h
                    .scale(
                        Decision::new(1, ScaleReason::NoReadyInstances),
                        Instant::now() + Duration::from_secs(30),
                    )
                    .await
                    .unwrap();
                assert_eq!(ready.len(), 1);
                // The tick that runs again finds the instance.
                settle().await;
            }
            NewSpec => {
                let mut relabelled = f.clone();
                relabelled.metadata = Some("v2".into());
                reg.get_or_spawn(&relabelled, true).await;
                settle().await;
            }
            RingMoves => {
                ctx.owner.store(false, Ordering::SeqCst);
                ctx.empty_pool.store(false, Ordering::SeqCst);
                ctx.pool_pod.notify_one();
                settle().await;
            }
            Stop => {
                reg.stop_all();
                tracker.close();
                tokio::time::timeout(Duration::from_secs(1), tracker.wait())
                    .await
                    .expect("the waiting actor stops");
                assert!(reg.is_empty(), "{what:?}");
            }
        }
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "{what:?}: at once, not at the wait's deadline"
        );
        let metadata: Vec<Option<String>> = ctx
            .waited
            .lock()
            .unwrap()
            .iter()
            .map(|(m, _)| m.clone())
            .collect();
        assert_eq!(
            metadata.iter().map(Option::as_deref).collect::<Vec<_>>(),
            waits,
            "{what:?}"
        );
        assert_eq!(ctx.events(), events, "{what:?}");
        assert_eq!(ctx.assigned.load(Ordering::SeqCst), assigned, "{what:?}");
    }
}
