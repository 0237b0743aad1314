//! Supervisors: one actor task per function.
//!
//! The [`Registry`] holds only [`Handle`]s in an `scc::HashMap`; each actor
//! owns its stabilization window and runs the converge tick every
//! `--scale-interval`, serialised with the `Scale` commands it receives (the
//! per-function lock of the spec, without a lock held across any remote
//! call). The spec and the router heartbeats live in the handle's shared part
//! so ingestion never waits for a tick. A task that exits removes only its
//! own handle (generation check); a panic in one actor is caught, logged and
//! ends only that supervisor.

pub mod converge;
mod task;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::core::Core;
use super::error::{Error, Result};
use super::heartbeat;
use super::kube::Instance;
use crate::domain::{Function, FunctionId};
use converge::Decision;

/// Commands an actor accepts.
#[derive(Debug)]
pub(crate) enum Command {
    /// Execute a decision now and answer with the ready instances.
    Scale {
        decision: Decision,
        deadline: Instant,
        reply: oneshot::Sender<Result<Vec<Instance>>>,
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
    recommendations: Mutex<VecDeque<Recommendation>>,
}

impl Shared {
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
        }
    }

    /// Records a converge tick's recommendation: a repeat of the latest
    /// one extends it, anything else is appended (the oldest beyond
    /// [`RECOMMENDATIONS`] is dropped).
    pub fn record_recommendation(&self, r: Recommendation) {
        let mut recs = self
            .recommendations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(last) = recs.back_mut()
            && last.decision == r.decision
            && last.acted == r.acted
        {
            last.at = r.at;
            last.ticks = last.ticks.saturating_add(r.ticks);
            return;
        }
        if recs.len() == RECOMMENDATIONS {
            recs.pop_front();
        }
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
    tx: mpsc::Sender<Command>,
    cancel: CancellationToken,
}

impl Handle {
    /// Asks the actor to execute `decision` locally.
    ///
    /// # Errors
    /// [`Error::SupervisorStopped`] when the actor has exited (get a fresh
    /// handle and retry), [`Error::NoReadyInstance`] at the deadline, or
    /// the execution's own error.
    pub async fn scale(&self, decision: Decision, deadline: Instant) -> Result<Vec<Instance>> {
        let (reply, rx) = oneshot::channel();
        let cmd = Command::Scale {
            decision,
            deadline,
            reply,
        };
        match tokio::time::timeout_at(deadline, self.tx.send(cmd)).await {
            Err(_) => return Err(Error::NoReadyInstance),
            Ok(Err(_)) => return Err(Error::SupervisorStopped),
            Ok(Ok(())) => {}
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Err(_) => Err(Error::NoReadyInstance),
            Ok(Err(_)) => Err(Error::SupervisorStopped),
            Ok(Ok(r)) => r,
        }
    }

    /// Whether the actor has exited.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.tx.is_closed()
    }
}

/// All supervisors of this controller.
#[derive(Debug, Default)]
pub struct Registry {
    map: scc::HashMap<FunctionId, Handle>,
    generation: AtomicU64,
}

impl Registry {
    /// The supervisor of `function`, created (and its actor spawned) when
    /// missing. With `update_spec`, a different configuration replaces the
    /// supervisor's spec. The caller checks that the namespace is managed.
    pub async fn get_or_spawn(&self, core: &Arc<Core>, function: &Function, update_spec: bool) -> Handle {
        let id = function.id();
        match self.map.entry_async(id).await {
            scc::hash_map::Entry::Occupied(o) if !o.get().is_stopped() => {
                let h = o.get().clone();
                drop(o);
                if update_spec {
                    h.shared.set_spec_if_changed(function);
                }
                h
            }
            scc::hash_map::Entry::Occupied(mut o) => {
                let h = self.spawn(core, function, id);
                *o.get_mut() = h.clone();
                h
            }
            scc::hash_map::Entry::Vacant(v) => {
                let h = self.spawn(core, function, id);
                v.insert_entry(h.clone());
                h
            }
        }
    }

    fn spawn(&self, core: &Arc<Core>, function: &Function, id: FunctionId) -> Handle {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(64);
        let cancel = core.shutdown.token().child_token();
        let shared = Arc::new(Shared {
            spec: Mutex::new(Arc::new(function.clone())),
            heartbeats: Mutex::new(heartbeat::Store::default()),
            recommendations: Mutex::new(VecDeque::with_capacity(RECOMMENDATIONS)),
        });
        let handle = Handle {
            id,
            generation,
            shared,
            tx,
            cancel: cancel.clone(),
        };
        core.shutdown
            .spawn("supervisor", task::run(core.clone(), handle.clone(), rx, cancel));
        handle
    }

    /// A supervisor, if one exists.
    #[must_use]
    pub fn get(&self, id: FunctionId) -> Option<Handle> {
        self.map.read_sync(&id, |_, h| h.clone())
    }

    /// Removes `handle` unless it was already replaced.
    pub async fn remove(&self, handle: &Handle) {
        let generation = handle.generation;
        self.map
            .remove_if_async(&handle.id, |h| h.generation == generation)
            .await;
    }

    /// Every supervisor handle.
    #[must_use]
    pub fn handles(&self) -> Vec<Handle> {
        let mut out = Vec::with_capacity(self.map.len());
        self.map.iter_sync(|_, h| {
            out.push(h.clone());
            true
        });
        out
    }

    /// Number of supervisors.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there is no supervisor.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Stops every supervisor.
    pub fn stop_all(&self) {
        self.map.iter_sync(|_, h| {
            h.cancel.cancel();
            true
        });
    }
}

/// Current wall-clock time (annotations and heartbeats carry wall-clock times).
#[must_use]
pub(crate) fn now() -> SystemTime {
    SystemTime::now()
}

#[cfg(test)]
mod recommendation_tests {
    use super::*;
    use crate::api::ScaleReason;

    fn shared() -> Shared {
        Shared {
            spec: Mutex::new(Arc::new(Function::default())),
            heartbeats: Mutex::new(heartbeat::Store::default()),
            recommendations: Mutex::new(VecDeque::new()),
        }
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
}
