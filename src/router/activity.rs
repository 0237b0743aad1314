//! Per-function activity and the batched heartbeat sender.
//!
//! Each function the router has seen recently has an [`Entry`]: its newest
//! function spec, an in-flight counter and the time of its last activity, all
//! updated with atomics on the request path (no per-request timers). An
//! [`InFlightGuard`] counts a request from arrival until its response body
//! (or tunnel) ends. One loop ([`run_heartbeats`]) sends every interval one
//! `Heartbeat` batch carrying each function's last activity and in-flight
//! count, and forgets a function idle for three intervals. The entry also
//! owns the function's instance [`Table`]; forgetting the function stops
//! the table's subscription.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::entry::Parsed;
use super::instances::Table;
use super::metrics::{Metrics, Series};
use crate::api;
use crate::client::Client;
use crate::domain::FunctionId;

/// Activity of one function, and everything its requests need that is
/// resolved once: the instance table and the metric series.
#[derive(Debug)]
pub struct Entry {
    /// The newest spec seen for this identity.
    parsed: ArcSwap<Parsed>,
    in_flight: AtomicI64,
    /// Milliseconds since `start`.
    last_active_ms: AtomicU64,
    /// [`Activity`]'s start.
    start: Instant,
    /// Set (under the map's bucket lock) when the entry is forgotten.
    evicted: AtomicBool,
    table: Arc<Table>,
    /// The series of deployments without their own.
    other: Series,
    /// The deployment's own series, once it has them ([`Metrics::learn`]).
    own: OnceLock<Series>,
    /// The label budget was spent when the deployment asked for its own
    /// series: it keeps the shared ones.
    unlearnable: AtomicBool,
}

impl Entry {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        let now = self.now_ms();
        // A read first: requests within the same millisecond write nothing.
        if self.last_active_ms.load(Ordering::Relaxed) < now {
            self.last_active_ms.fetch_max(now, Ordering::SeqCst);
        }
    }

    /// The function's instance table.
    #[must_use]
    pub fn table(&self) -> &Arc<Table> {
        &self.table
    }

    /// The series this function's requests count in now.
    #[must_use]
    pub fn series(&self) -> &Series {
        self.own.get().unwrap_or(&self.other)
    }

    /// Whether the entry was forgotten (its requests count on a new one).
    #[must_use]
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::SeqCst)
    }

    /// Gives the function its deployment's own series once a controller
    /// served an instance of it (see [`Metrics::learn`]).
    pub fn learn(&self, metrics: &Metrics) {
        if self.own.get().is_some() || self.unlearnable.load(Ordering::Relaxed) {
            return;
        }
        let deployment = &self.parsed.load().function.deployment;
        if metrics.learn(deployment) {
            let _ = self.own.set(metrics.series(deployment));
        } else {
            self.unlearnable.store(true, Ordering::Relaxed);
        }
    }
}

/// Activity of every function. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Activity {
    map: Arc<scc::HashMap<FunctionId, Arc<Entry>>>,
    start: Instant,
    start_wall: SystemTime,
    metrics: Metrics,
}

/// Counts one request as in flight until dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    entry: Arc<Entry>,
    /// Whether the gauge raised was the deployment's own (lowered in the
    /// same series).
    own: bool,
}

impl InFlightGuard {
    /// The function's instance table.
    #[must_use]
    pub fn table(&self) -> &Arc<Table> {
        &self.entry.table
    }

    /// The function's entry.
    #[must_use]
    pub fn entry(&self) -> &Arc<Entry> {
        &self.entry
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let e = &self.entry;
        e.in_flight.fetch_sub(1, Ordering::SeqCst);
        e.touch();
        match e.own.get() {
            Some(own) if self.own => own.in_flight().dec(),
            _ => e.other.in_flight().dec(),
        };
    }
}

impl Activity {
    /// No activity yet.
    #[must_use]
    pub fn new(metrics: Metrics) -> Self {
        Self {
            map: Arc::new(scc::HashMap::new()),
            start: Instant::now(),
            start_wall: SystemTime::now(),
            metrics,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The entry of `parsed`'s function, made on its first request.
    async fn entry(&self, parsed: &Arc<Parsed>) -> Arc<Entry> {
        if let Some(e) = self.map.read_async(&parsed.id, |_, e| e.clone()).await {
            return e;
        }
        self.map
            .entry_async(parsed.id)
            .await
            .or_insert_with(|| {
                let deployment = &parsed.function.deployment;
                let own = OnceLock::new();
                if self.metrics.is_known(deployment) {
                    let _ = own.set(self.metrics.series(deployment));
                }
                Arc::new(Entry {
                    parsed: ArcSwap::new(parsed.clone()),
                    in_flight: AtomicI64::new(0),
                    last_active_ms: AtomicU64::new(0),
                    start: self.start,
                    evicted: AtomicBool::new(false),
                    table: Arc::new(Table::new(&parsed.function.tenant)),
                    other: self.metrics.other().clone(),
                    own,
                    unlearnable: AtomicBool::new(false),
                })
            })
            .get()
            .clone()
    }

    /// Counts a request for `parsed` as in flight until the guard drops.
    pub async fn begin(&self, parsed: &Arc<Parsed>) -> InFlightGuard {
        loop {
            let entry = self.entry(parsed).await;
            if let Some(g) = Self::enter(&entry, parsed) {
                return g;
            }
        }
    }

    /// Counts a request for `parsed` on `entry` (one the caller kept from
    /// an earlier request), unless the entry was forgotten meanwhile.
    #[must_use]
    pub fn enter(entry: &Arc<Entry>, parsed: &Arc<Parsed>) -> Option<InFlightGuard> {
        entry.in_flight.fetch_add(1, Ordering::SeqCst);
        if entry.is_evicted() {
            // Forgotten between lookup and increment: count on a fresh entry.
            entry.in_flight.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        entry.touch();
        if !Arc::ptr_eq(&entry.parsed.load(), parsed) {
            entry.parsed.store(parsed.clone());
        }
        let own = match entry.own.get() {
            Some(s) => {
                s.in_flight().inc();
                true
            }
            None => {
                entry.other.in_flight().inc();
                false
            }
        };
        Some(InFlightGuard {
            entry: entry.clone(),
            own,
        })
    }

    /// Builds this tick's batch: forgets functions idle (and not in flight)
    /// for more than `idle_after`, reports every other one.
    pub async fn batch(&self, idle_after: Duration) -> Vec<api::Heartbeat> {
        let now = self.now_ms();
        let idle_ms = u64::try_from(idle_after.as_millis()).unwrap_or(u64::MAX);
        self.map
            .retain_async(|_, e| {
                let idle = now.saturating_sub(e.last_active_ms.load(Ordering::SeqCst)) > idle_ms;
                if idle && e.in_flight.load(Ordering::SeqCst) <= 0 {
                    e.evicted.store(true, Ordering::SeqCst);
                    if e.in_flight.load(Ordering::SeqCst) <= 0 {
                        e.table.stop();
                        return false;
                    }
                    e.evicted.store(false, Ordering::SeqCst);
                }
                true
            })
            .await;
        let mut out = Vec::new();
        self.map
            .iter_async(|_, e| {
                let in_flight = e.in_flight.load(Ordering::SeqCst).max(0);
                let last = if in_flight > 0 {
                    now
                } else {
                    e.last_active_ms.load(Ordering::SeqCst)
                };
                let ts = self.start_wall + Duration::from_millis(last);
                out.push(api::Heartbeat {
                    function: Some(e.parsed.load().api.clone()),
                    timestamp: Some(prost_types::Timestamp::from(ts)),
                    in_flight_requests: Some(u32::try_from(in_flight).unwrap_or(u32::MAX)),
                });
                e.series().heartbeats().inc();
                true
            })
            .await;
        out
    }

    /// Number of functions currently tracked.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no function is tracked.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Sends a heartbeat batch every `interval` (first one immediately) until
/// `stop` is cancelled. Each send is bounded by `interval`.
pub async fn run_heartbeats(
    activity: Activity,
    client: Client,
    router_ip: String,
    interval: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let heartbeats = activity.batch(interval * 3).await;
        if heartbeats.is_empty() {
            continue;
        }
        let count = heartbeats.len();
        let req = api::HeartbeatRequest {
            router_ip: Some(router_ip.clone()),
            heartbeats,
            forwarded_for: vec![],
        };
        tokio::select! {
            () = stop.cancelled() => return,
            r = client.heartbeat(req, interval) => match r {
                Ok(_) => tracing::debug!(functions = count, "sent heartbeats"),
                Err(e) => tracing::warn!(error = %e, functions = count, "failed to send heartbeats"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::router::entry::parse;

    fn parsed(tenant: &str, scale: u32) -> Arc<Parsed> {
        Arc::new(
            parse(&format!(
                r#"{{"namespace":"ns","deployment":"app","tenant":"{tenant}","scale":{{"max_instances":{scale}}}}}"#
            ))
            .unwrap(),
        )
    }

    fn activity() -> Activity {
        Activity::new(Metrics::register(&mut Registry::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn guards_count_in_flight_until_dropped() {
        let a = activity();
        let f = parsed("t1", 1);
        let g1 = a.begin(&f).await;
        let g2 = a.begin(&f).await;
        let batch = a.batch(Duration::from_secs(15)).await;
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].in_flight_requests, Some(2));
        drop(g1);
        drop(g2);
        let batch = a.batch(Duration::from_secs(15)).await;
        assert_eq!(batch[0].in_flight_requests, Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_functions_are_forgotten_after_the_idle_bound() {
        let a = activity();
        drop(a.begin(&parsed("t1", 1)).await);
        let busy = a.begin(&parsed("t2", 1)).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(a.batch(Duration::from_secs(15)).await.len(), 2);
        tokio::time::advance(Duration::from_secs(6)).await;
        let batch = a.batch(Duration::from_secs(15)).await;
        assert_eq!(batch.len(), 1, "the idle function is forgotten");
        assert_eq!(batch[0].function.as_ref().unwrap().tenant.as_deref(), Some("t2"));
        drop(busy);
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(a.batch(Duration::from_secs(15)).await.is_empty());
        assert!(a.is_empty());
        // A forgotten function comes back on its next request.
        let _g = a.begin(&parsed("t1", 1)).await;
        assert_eq!(a.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn timestamps_are_the_last_activity_and_the_newest_spec_wins() {
        let a = activity();
        drop(a.begin(&parsed("t1", 1)).await);
        let first = a.batch(Duration::from_secs(15)).await[0].timestamp.unwrap();
        tokio::time::advance(Duration::from_secs(3)).await;
        let idle = a.batch(Duration::from_secs(15)).await[0].timestamp.unwrap();
        assert_eq!(first, idle, "an idle function reports its last activity");
        drop(a.begin(&parsed("t1", 7)).await);
        let batch = a.batch(Duration::from_secs(15)).await;
        assert_eq!(batch.len(), 1);
        assert!(batch[0].timestamp.unwrap().seconds >= first.seconds + 3);
        let scale = batch[0].function.as_ref().unwrap().scale.unwrap();
        assert_eq!(scale.max_instances, Some(7));
    }
}
