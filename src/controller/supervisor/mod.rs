//! Supervisors: one actor task per function.
//!
//! A supervisor sees the rest of the controller only through its
//! [`Context`]: the function's instances, the writes it makes (assign,
//! delete), ring ownership, events and metrics, the clock. The controller's
//! implementation is [`crate::controller::context::Cluster`]; tests use
//! in-memory fakes on paused time.
//!
//! The [`Registry`] holds only [`Handle`]s in an `scc::HashMap`; each actor
//! owns its stabilization window and runs the converge tick every
//! `--scale-interval`, serialised with the `Scale` commands in its mailbox
//! (the per-function lock of the spec, without a lock held across any
//! remote call). The spec, the router heartbeats and the mailbox live in the
//! handle's shared part so ingestion never waits for a tick. A task that
//! exits removes only its own handle (generation check); a panic in one
//! actor is caught, logged and ends only that supervisor.
//!
//! Memory: an idle supervisor is its map entry, its shared part and a small
//! task (the tick and the `Scale` execution are boxed while they run, the
//! mailbox holds no allocation while empty); all of it is freed when the
//! supervisor stops. A function whose pool has no pod spends its ticks
//! waiting for one: the tick waits before it acts, so what it holds while
//! waiting is the tick's own small frame, without a span or the frames of
//! the assignment (`make bench-controller` measures both cases).

pub mod converge;
mod mailbox;
mod task;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedSemaphorePermit, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::error::{Error, Result};
use super::heartbeat;
use super::kube::Instance;
use crate::api::{EventSeverity, EventType};
use crate::domain::{Function, FunctionId};
use converge::{Decision, ScaleConfig};
use mailbox::Mailbox;

pub use mailbox::CAPACITY as MAILBOX_CAPACITY;

/// The timing a supervisor runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Period of the converge tick.
    pub scale_interval: Duration,
    /// The autoscaler settings of the pure plan.
    pub scale: ScaleConfig,
}

/// A counted scaling action (the controller's `scale_ups`/`scale_downs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaled {
    Up,
    Down,
}

/// What a supervisor needs from the controller. Every method is about the
/// supervisor's own function; none holds a lock across an await.
pub trait Context: Send + Sync + 'static {
    /// Tick period and autoscaler settings.
    fn settings(&self) -> &Settings;

    /// Wall-clock time (annotations and heartbeats carry wall-clock times).
    fn now(&self) -> SystemTime;

    /// When this controller started; the protection period runs from here.
    fn started_at(&self) -> SystemTime;

    /// Whether this controller owns `id` on the ring.
    fn is_owner(&self, id: FunctionId) -> bool;

    /// The running instances of `f` (pods that cannot be read as instances
    /// are deleted).
    fn instances(&self, f: &Function) -> impl Future<Output = Result<Vec<Instance>>> + Send;

    /// Whether the ReplicaSet `name` was scaled to zero or is gone (its
    /// instances are stale).
    fn replica_set_retired(&self, f: &Function, name: &str) -> bool;

    /// Claims a pool pod for `f` and assigns it, waiting for one until
    /// `deadline`.
    fn assign(&self, f: &Function, deadline: Instant) -> impl Future<Output = Result<Instance>> + Send;

    /// Waits until `f`'s pool has a pod [`Context::assign`] could claim, at
    /// most until `deadline` (and not at all when the assignment would fail
    /// at once). A tick that only scales up waits here, before it acts.
    /// Without a pool to wait for there is nothing to wait for.
    fn wait_for_pool_pod(&self, f: &Function, deadline: Instant) -> impl Future<Output = ()> + Send {
        let _ = (f, deadline);
        std::future::ready(())
    }

    /// Deletes pod `name` of `f`'s namespace; `false` when it was gone.
    fn delete(&self, f: &Function, name: &str) -> impl Future<Output = Result<bool>> + Send;

    /// A permit for one stale-instance replacement, `None` while the
    /// controller-wide limit is reached.
    fn stale_permit(&self) -> Option<OwnedSemaphorePermit>;

    /// Records an event of `f`.
    fn event(&self, f: &Function, kind: EventType, severity: EventSeverity, message: String);

    /// Counts `n` scaling actions of `f`.
    fn count(&self, f: &Function, what: Scaled, n: u64);

    /// Marks the ready instances `names` of `f` draining for the routers
    /// watching `f` and waits until they report them idle, at most the
    /// controller's drain bound and not past `deadline`. The marks stay
    /// until [`Context::undrain`]. Without routers' tables there is nothing
    /// to wait for.
    fn drain(
        &self,
        f: &Function,
        names: &[String],
        deadline: Option<Instant>,
    ) -> impl Future<Output = ()> + Send {
        let _ = (f, names, deadline);
        std::future::ready(())
    }

    /// Clears the drain marks of `names` (their pods are deleted, or the
    /// deletion failed and they serve on).
    fn undrain(&self, f: &Function, names: &[String]) {
        let _ = (f, names);
    }
}

/// Commands an actor accepts.
#[derive(Debug)]
pub(crate) enum Command {
    /// Execute a decision now and answer with the ready instances.
    Scale {
        decision: Decision,
        deadline: Instant,
        reply: oneshot::Sender<Result<Vec<Instance>>>,
        /// The caller's span: the execution is part of its trace.
        span: tracing::Span,
    },
}

/// How many of the autoscaler's recommendations a supervisor keeps.
pub const RECOMMENDATIONS: usize = 20;

/// The autoscaler's recommendation at consecutive converge ticks that
/// agreed, kept for the operator surface.
#[derive(Debug, Clone, PartialEq)]
pub struct Recommendation {
    /// The latest tick.
    pub at: SystemTime,
    pub decision: Decision,
    /// Whether this controller acted on it (ring owner, not held back).
    pub acted: bool,
    /// Consecutive ticks with this recommendation, the first at `since`.
    pub ticks: u32,
    pub since: SystemTime,
}

impl Recommendation {
    /// One tick's recommendation.
    #[must_use]
    pub fn new(at: SystemTime, decision: Decision, acted: bool) -> Self {
        Self {
            at,
            decision,
            acted,
            ticks: 1,
            since: at,
        }
    }
}

impl Recommendation {
    /// The wire form.
    #[must_use]
    pub fn to_api(&self) -> crate::api::ScaleRecommendation {
        let d = &self.decision;
        crate::api::ScaleRecommendation {
            timestamp: Some(self.at.into()),
            decision: Some(crate::api::ScaleDecision {
                desired_instances: Some(d.desired),
                unclamped_desired_instances: Some(d.unclamped),
                reason: Some(d.reason as i32),
                metrics: d
                    .metrics
                    .iter()
                    .map(|(name, value)| crate::api::ScaleMetric {
                        name: Some((*name).to_owned()),
                        value: Some(*value),
                    })
                    .collect(),
            }),
            acted: Some(self.acted),
            ticks: Some(self.ticks),
            since: Some(self.since.into()),
        }
    }
}

/// State shared between the actor and the RPC handlers. Std mutexes: every
/// critical section is a copy or a map update, never an await.
#[derive(Debug)]
pub struct Shared {
    spec: Mutex<Arc<Function>>,
    heartbeats: Mutex<heartbeat::Store>,
    mailbox: Mailbox,
    recommendations: Mutex<VecDeque<Recommendation>>,
}

impl Shared {
    fn new(spec: Function) -> Self {
        Self {
            spec: Mutex::new(Arc::new(spec)),
            heartbeats: Mutex::new(heartbeat::Store::default()),
            mailbox: Mailbox::default(),
            // Empty until the first tick; an idle function holds one entry.
            recommendations: Mutex::new(VecDeque::new()),
        }
    }

    /// The current spec.
    #[must_use]
    pub fn spec(&self) -> Arc<Function> {
        self.spec
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_spec_if_changed(&self, f: &Function) {
        let mut spec = self
            .spec
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !spec.same_config(f) {
            *spec = Arc::new(f.clone());
            drop(spec);
            // A tick waiting for a pool pod plans again with the new spec.
            self.mailbox.wake();
        }
    }

    /// Records a converge tick's recommendation: a repeat of the latest
    /// one ([`Decision::same_as`], the same `acted`) extends it, anything
    /// else is appended (the oldest beyond [`RECOMMENDATIONS`] is dropped).
    pub fn record_recommendation(&self, r: Recommendation) {
        let mut recs = self
            .recommendations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(last) = recs.back_mut()
            && last.decision.same_as(&r.decision)
            && last.acted == r.acted
        {
            last.at = r.at;
            last.ticks = last.ticks.saturating_add(r.ticks);
            return;
        }
        if recs.len() == RECOMMENDATIONS {
            recs.pop_front();
        }
        // Grow one at a time: most supervisors keep a single entry.
        recs.reserve_exact(1);
        recs.push_back(r);
    }

    /// The latest recommendations, oldest first.
    #[must_use]
    pub fn recommendations(&self) -> Vec<Recommendation> {
        self.recommendations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// Runs `f` on the heartbeat store.
    pub fn with_heartbeats<R>(&self, f: impl FnOnce(&mut heartbeat::Store) -> R) -> R {
        f(&mut self
            .heartbeats
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

/// A supervisor as the rest of the controller sees it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Handle {
    pub id: FunctionId,
    generation: u64,
    pub shared: Arc<Shared>,
}

impl Handle {
    /// Asks the actor to execute `decision` locally.
    ///
    /// # Errors
    /// [`Error::SupervisorStopped`] when the actor has exited (get a fresh
    /// handle and retry), [`Error::MailboxFull`] when
    /// [`MAILBOX_CAPACITY`] commands are already waiting,
    /// [`Error::NoReadyInstance`] at the deadline, or the execution's own
    /// error.
    pub async fn scale(&self, decision: Decision, deadline: Instant) -> Result<Vec<Instance>> {
        let (reply, rx) = oneshot::channel();
        let cmd = Command::Scale {
            decision,
            deadline,
            reply,
            span: tracing::Span::current(),
        };
        self.shared
            .mailbox
            .push(cmd)
            .map_err(|e| e.into_error(&self.shared.spec()))?;
        match tokio::time::timeout_at(deadline, rx).await {
            Err(_) => Err(Error::NoReadyInstance),
            Ok(Err(_)) => Err(Error::SupervisorStopped),
            Ok(Ok(r)) => r,
        }
    }

    /// Whether the actor has exited.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.shared.mailbox.is_closed()
    }
}

/// All supervisors of this controller, and what they run with.
pub struct Registry<C> {
    inner: Arc<Inner<C>>,
}

struct Inner<C> {
    ctx: Arc<C>,
    map: scc::HashMap<FunctionId, Handle>,
    generation: AtomicU64,
    /// Cancels every supervisor (a child of the controller's root token).
    token: CancellationToken,
    tracker: TaskTracker,
}

impl<C> Clone for Registry<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C> std::fmt::Debug for Registry<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("supervisors", &self.inner.map.len())
            .finish_non_exhaustive()
    }
}

impl<C: Context> Registry<C> {
    /// An empty registry whose actors run with `ctx`, stop when `token` is
    /// cancelled and are owned by `tracker`.
    #[must_use]
    pub fn new(ctx: Arc<C>, token: CancellationToken, tracker: TaskTracker) -> Self {
        Self {
            inner: Arc::new(Inner {
                ctx,
                map: scc::HashMap::new(),
                generation: AtomicU64::new(0),
                token,
                tracker,
            }),
        }
    }

    /// The context the actors run with.
    #[must_use]
    pub fn context(&self) -> &Arc<C> {
        &self.inner.ctx
    }

    /// The supervisor of `function`, created (and its actor spawned) when
    /// missing. With `update_spec`, a different configuration replaces the
    /// supervisor's spec. The caller checks that the namespace is managed.
    pub async fn get_or_spawn(&self, function: &Function, update_spec: bool) -> Handle {
        let id = function.id();
        match self.inner.map.entry_async(id).await {
            scc::hash_map::Entry::Occupied(o) if !o.get().is_stopped() => {
                let h = o.get().clone();
                drop(o);
                if update_spec {
                    h.shared.set_spec_if_changed(function);
                }
                h
            }
            scc::hash_map::Entry::Occupied(mut o) => {
                let h = self.spawn(function, id);
                *o.get_mut() = h.clone();
                h
            }
            scc::hash_map::Entry::Vacant(v) => {
                let h = self.spawn(function, id);
                v.insert_entry(h.clone());
                h
            }
        }
    }

    fn spawn(&self, function: &Function, id: FunctionId) -> Handle {
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed);
        let handle = Handle {
            id,
            generation,
            shared: Arc::new(Shared::new(function.clone())),
        };
        // No span per actor: an idle supervisor would hold one for its whole
        // life. Each tick and each command runs in its own span instead.
        self.inner.tracker.spawn(task::run(self.clone(), handle.clone()));
        handle
    }

    /// A supervisor, if one exists.
    #[must_use]
    pub fn get(&self, id: FunctionId) -> Option<Handle> {
        self.inner.map.read_sync(&id, |_, h| h.clone())
    }

    /// Removes `handle` unless it was already replaced.
    async fn remove(&self, handle: &Handle) {
        let generation = handle.generation;
        self.inner
            .map
            .remove_if_async(&handle.id, |h| h.generation == generation)
            .await;
    }

    /// Every supervisor handle.
    #[must_use]
    pub fn handles(&self) -> Vec<Handle> {
        let mut out = Vec::with_capacity(self.inner.map.len());
        self.inner.map.iter_sync(|_, h| {
            out.push(h.clone());
            true
        });
        out
    }

    /// Number of supervisors.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.map.len()
    }

    /// Reads the number of supervisors without keeping the registry alive
    /// (0 once it is gone): for the metrics, which the context holds.
    pub fn len_source(&self) -> impl Fn() -> usize + Send + Sync + 'static
    where
        C: Send + Sync + 'static,
    {
        let inner = Arc::downgrade(&self.inner);
        move || inner.upgrade().map_or(0, |i| i.map.len())
    }

    /// Whether there is no supervisor.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.inner.map.is_empty()
    }

    /// Stops every supervisor (they remove themselves as they exit).
    pub fn stop_all(&self) {
        self.inner.token.cancel();
    }
}

#[cfg(test)]
mod recommendation_tests {
    use super::*;
    use crate::api::ScaleReason;

    fn shared() -> Shared {
        Shared::new(Function::default())
    }

    #[test]
    fn repeats_extend_the_latest_and_the_list_is_bounded() {
        let s = shared();
        let t = |n: u64| SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(n);
        let one = Decision::new(1, ScaleReason::Cpu);
        s.record_recommendation(Recommendation::new(t(1), one.clone(), true));
        s.record_recommendation(Recommendation::new(t(2), one.clone(), true));
        s.record_recommendation(Recommendation::new(t(3), one.clone(), false));
        let recs = s.recommendations();
        assert_eq!(recs.len(), 2);
        assert_eq!((recs[0].ticks, recs[0].since, recs[0].at), (2, t(1), t(2)));
        for n in 0..100 {
            s.record_recommendation(Recommendation::new(
                t(10 + n),
                Decision::new(u32::try_from(n).unwrap(), ScaleReason::Cpu),
                true,
            ));
        }
        let recs = s.recommendations();
        assert_eq!(recs.len(), RECOMMENDATIONS);
        assert_eq!(recs.last().unwrap().decision.desired, 99);
    }

    #[test]
    fn a_repeat_with_a_nan_metric_extends_the_latest() {
        // A function scaled on in-flight requests without instances: the
        // per-instance metric is 0/0 at every tick.
        let s = shared();
        let t = |n: u64| SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(n);
        let nan = Decision {
            metrics: vec![("in_flight_requests", f64::NAN)],
            ..Decision::new(1, ScaleReason::Unspecified)
        };
        for n in 0..30 {
            s.record_recommendation(Recommendation::new(t(n), nan.clone(), true));
        }
        let recs = s.recommendations();
        assert_eq!(recs.len(), 1, "{recs:?}");
        assert_eq!((recs[0].ticks, recs[0].since, recs[0].at), (30, t(0), t(29)));
        let other = Decision {
            metrics: vec![("in_flight_requests", 2.0)],
            ..Decision::new(1, ScaleReason::Unspecified)
        };
        s.record_recommendation(Recommendation::new(t(30), other, true));
        assert_eq!(
            s.recommendations().len(),
            2,
            "another value is another recommendation"
        );
    }
}
