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
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::entry::Parsed;
use super::instances::Table;
use super::metrics::{DeploymentLabel, Metrics};
use crate::api;
use crate::client::Client;
use crate::domain::FunctionId;

/// Activity of one function.
#[derive(Debug)]
pub struct Entry {
    /// The newest spec seen for this identity. A std mutex: the critical
    /// sections are a pointer swap or clone, never across an await.
    parsed: Mutex<Arc<Parsed>>,
    in_flight: AtomicI64,
    /// Milliseconds since [`Activity`]'s start.
    last_active_ms: AtomicU64,
    /// Set (under the map's bucket lock) when the entry is forgotten.
    evicted: AtomicBool,
    table: Arc<Table>,
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
    activity: Activity,
    /// The gauge series raised at the start (lowered with the same one).
    label: DeploymentLabel,
}

impl InFlightGuard {
    /// The function's instance table.
    #[must_use]
    pub fn table(&self) -> &Arc<Table> {
        &self.entry.table
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.entry.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.activity.touch(&self.entry);
        self.activity.metrics.in_flight.get_or_create(&self.label).dec();
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

    fn touch(&self, e: &Entry) {
        e.last_active_ms.fetch_max(self.now_ms(), Ordering::SeqCst);
    }

    /// Counts a request for `parsed` as in flight until the guard drops.
    pub async fn begin(&self, parsed: &Arc<Parsed>) -> InFlightGuard {
        loop {
            let entry = match self.map.get_async(&parsed.id).await {
                Some(e) => e.get().clone(),
                None => self
                    .map
                    .entry_async(parsed.id)
                    .await
                    .or_insert_with(|| {
                        Arc::new(Entry {
                            parsed: Mutex::new(parsed.clone()),
                            in_flight: AtomicI64::new(0),
                            last_active_ms: AtomicU64::new(0),
                            evicted: AtomicBool::new(false),
                            table: Arc::new(Table::new(&parsed.function.tenant)),
                        })
                    })
                    .get()
                    .clone(),
            };
            entry.in_flight.fetch_add(1, Ordering::SeqCst);
            if entry.evicted.load(Ordering::SeqCst) {
                // Forgotten between lookup and increment: count on a fresh entry.
                entry.in_flight.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            self.touch(&entry);
            {
                // Poisoning needs a panic inside the two-line critical
                // sections below, which cannot happen.
                let mut p = entry
                    .parsed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if !Arc::ptr_eq(&p, parsed) {
                    *p = parsed.clone();
                }
            }
            let label = self.metrics.deployment(&parsed.function.deployment);
            self.metrics.in_flight.get_or_create(&label).inc();
            return InFlightGuard {
                entry,
                activity: self.clone(),
                label,
            };
        }
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
                let (function, label) = {
                    let p = e.parsed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    (p.api.clone(), self.metrics.deployment(&p.function.deployment))
                };
                let ts = self.start_wall + Duration::from_millis(last);
                out.push(api::Heartbeat {
                    function: Some(function),
                    timestamp: Some(prost_types::Timestamp::from(ts)),
                    in_flight_requests: Some(u32::try_from(in_flight).unwrap_or(u32::MAX)),
                });
                self.metrics.heartbeats.get_or_create(&label).inc();
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
