//! Where the pages get their data: snapshots of the cluster state, built
//! off the request path and shared by every viewer.
//!
//! - Every [`SAMPLE_EVERY`] the instance counts of the local supervisors are
//!   sampled into the [`History`] (from the pod cache; cheap, always on, so
//!   a chart has data when a page is first opened).
//! - While at least one live view is open, a snapshot is built every
//!   [`REFRESH`] (stretched to four times the last build's duration on a
//!   large cluster): `GetClusterState` aggregated across the ring, turned
//!   into a [`Model`] once, published on a `watch` channel. With nobody
//!   watching, nothing is built.
//! - A page request uses the latest snapshot when it is fresh, else builds
//!   one (single flight: concurrent requests share the build).
//!
//! Nothing here runs on the controller's request paths: the RPC handlers
//! never wait for the UI.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::history::History;
use super::model::{Input, Model, Pool, unix};
use crate::controller::core::Core;

/// Period of the history samples.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Window the charts cover.
pub const HISTORY_WINDOW: Duration = Duration::from_secs(15 * 60);
/// Period of live snapshots while someone watches.
pub const REFRESH: Duration = Duration::from_secs(1);
/// Longest period between live snapshots, however slow a build is.
const MAX_REFRESH: Duration = Duration::from_secs(30);
/// A page request reuses a snapshot younger than this.
const FRESH: Duration = Duration::from_secs(2);

/// The shared source of snapshots.
#[derive(Debug)]
pub struct Hub {
    core: Arc<Core>,
    latest: watch::Sender<Option<Arc<Model>>>,
    /// When `latest` was built.
    built: Mutex<Option<Instant>>,
    history: Mutex<History>,
    building: tokio::sync::Mutex<()>,
    wake: Notify,
    generation: AtomicU64,
}

impl Hub {
    /// A hub over `core`; [`Hub::run`] drives it.
    #[must_use]
    pub fn new(core: Arc<Core>) -> Arc<Self> {
        Arc::new(Self {
            core,
            latest: watch::Sender::new(None),
            built: Mutex::new(None),
            history: Mutex::new(History::new(HISTORY_WINDOW)),
            building: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            generation: AtomicU64::new(0),
        })
    }

    /// The controller this hub reads.
    #[must_use]
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// A live view's subscription: changes whenever a snapshot is published.
    /// Holding it keeps live snapshots coming.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Model>>> {
        let rx = self.latest.subscribe();
        self.wake.notify_one();
        rx
    }

    /// Number of open live views.
    #[must_use]
    pub fn watchers(&self) -> usize {
        self.latest.receiver_count()
    }

    /// A snapshot no older than [`FRESH`], built now if needed.
    pub async fn fresh(&self) -> Arc<Model> {
        if let Some(m) = self.current(FRESH) {
            return m;
        }
        let _building = self.building.lock().await;
        if let Some(m) = self.current(FRESH) {
            return m;
        }
        self.build().await
    }

    fn current(&self, max_age: Duration) -> Option<Arc<Model>> {
        let built = *self
            .built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let model = self.latest.borrow().clone()?;
        built.filter(|b| b.elapsed() <= max_age).map(|_| model)
    }

    /// Builds and publishes a snapshot.
    async fn build(&self) -> Arc<Model> {
        let state = self.core.cluster_state(false).await;
        let pools = self.pools(&state);
        let now = SystemTime::now();
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let model = {
            let history = self
                .history
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::new(Model::build(&Input {
                state: &state,
                now,
                generation,
                history: &history.functions,
                totals: &history.totals,
                pools: &pools,
                window: history.window,
            }))
        };
        *self
            .built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
        self.latest.send_replace(Some(model.clone()));
        model
    }

    /// The pools of the deployments the functions in `state` use, from this
    /// controller's caches (every controller watches every pod of the
    /// function namespaces).
    fn pools(&self, state: &crate::api::ClusterState) -> HashMap<String, Pool> {
        use crate::controller::kube::{is_ready, is_running, label};
        let mut seen = std::collections::BTreeSet::new();
        for s in &state.supervisors {
            if let Some(f) = &s.function {
                seen.insert((
                    f.namespace.clone().unwrap_or_default(),
                    f.deployment.clone().unwrap_or_default(),
                ));
            }
        }
        let mut pools: HashMap<String, Pool> = HashMap::new();
        let mut assigned_by_ns: HashMap<String, HashMap<String, usize>> = HashMap::new();
        for (ns_name, deployment) in seen {
            let Some(ns) = self.core.cluster.state.namespace(&ns_name) else {
                continue;
            };
            let assigned = assigned_by_ns.entry(ns_name.clone()).or_insert_with(|| {
                let mut by: HashMap<String, usize> = HashMap::new();
                for (pod, _) in ns.pods.assigned() {
                    if let Some(d) = label(&pod, crate::domain::LABEL_DEPLOYMENT) {
                        *by.entry(d.to_owned()).or_default() += 1;
                    }
                }
                by
            });
            let size = ns
                .replica_sets
                .active_for(&deployment)
                .and_then(|rs| ns.replica_sets.get(&rs))
                .and_then(|rs| rs.spec.as_ref().and_then(|s| s.replicas))
                .and_then(|r| u32::try_from(r).ok())
                .unwrap_or(0);
            let pool = pools.entry(deployment.clone()).or_default();
            pool.size += size;
            pool.unassigned_ready += ns
                .pods
                .pool(&deployment)
                .iter()
                .filter(|p| is_running(p) && is_ready(p))
                .count();
            pool.assigned += assigned.get(&deployment).copied().unwrap_or(0);
        }
        pools
    }

    /// Samples the local supervisors' instance counts into the history.
    async fn sample(&self) {
        let mut counts = Vec::new();
        for h in self.core.supervisors.handles() {
            let f = h.shared.spec();
            if let Ok(instances) = self.core.cluster.read_instances(&f, false).await {
                let ready = instances.iter().filter(|i| i.ready_at.is_some()).count();
                counts.push((h.id, ready, instances.len()));
            }
        }
        let at = unix(SystemTime::now());
        self.history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .sample(at, &counts);
    }

    /// Samples and refreshes until the controller shuts down.
    pub async fn run(self: Arc<Self>) {
        let token = self.core.shutdown.token().clone();
        let mut sample = tokio::time::interval(SAMPLE_EVERY);
        sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next = Instant::now();
        loop {
            let watching = self.watchers() > 0;
            tokio::select! {
                () = token.cancelled() => return,
                _ = sample.tick() => self.sample().await,
                () = tokio::time::sleep_until(next), if watching => {
                    let started = Instant::now();
                    {
                        let _building = self.building.lock().await;
                        self.build().await;
                    }
                    next = Instant::now() + (started.elapsed() * 4).clamp(REFRESH, MAX_REFRESH);
                }
                () = self.wake.notified(), if !watching => next = Instant::now(),
            }
        }
    }
}
