//! Router heartbeats: per-router newest-wins storage with garbage collection
//! (spec §5.2), the combined heartbeat of a function (§5.3), the bound on
//! how many functions one router keeps active on this controller, and the
//! forwarding targets of the `forwarded_for` chain (§2.4).
//!
//! Routers are interned in [`Routers`]: every report of a router points at
//! one [`Router`], whose counter is the number of stored reports (functions
//! the router keeps active here). A report is counted when it is stored and
//! uncounted when it expires, is cleared, or its supervisor goes away, so
//! the count is exact by construction. A router at its limit gets no new
//! function; the number of routers is bounded too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// The activity of a function across every router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Combined {
    /// Newest router activity or instance assignment; `None` when neither exists.
    pub timestamp: Option<SystemTime>,
    /// Sum of the routers' in-flight request counts.
    pub in_flight: u32,
}

/// One router's latest report for a function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub timestamp: SystemTime,
    pub in_flight: u32,
}

/// A router that reports heartbeats (directly or through a peer
/// controller), with the number of functions it keeps active here.
#[derive(Debug)]
pub struct Router {
    ip: Box<str>,
    active: AtomicUsize,
    limit: usize,
}

/// Why a heartbeat entry was not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "router {router} keeps {limit} functions active on this controller, the limit (--max-functions-per-router)"
    )]
    RouterLimit { router: String, limit: usize },
    #[error("{limit} routers keep functions active on this controller, the limit (--max-heartbeat-routers)")]
    Routers { limit: usize },
}

impl Refused {
    /// The metric label of this refusal (a fixed set).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::RouterLimit { .. } => "router-limit",
            Self::Routers { .. } => "routers",
        }
    }
}

impl Router {
    /// The router's IP, as its heartbeats name it.
    #[must_use]
    pub fn ip(&self) -> &str {
        &self.ip
    }

    /// Functions this router keeps active on this controller.
    #[must_use]
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Whether a new function would be refused.
    #[must_use]
    pub fn is_at_limit(&self) -> bool {
        self.active() >= self.limit
    }

    fn acquire(&self) -> Result<(), Refused> {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .map(drop)
            .map_err(|_| Refused::RouterLimit {
                router: self.ip.to_string(),
                limit: self.limit,
            })
    }

    fn release(&self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The routers that keep functions active on this controller.
#[derive(Debug)]
pub struct Routers {
    // A std mutex: a lookup or insert per heartbeat call, never across an await.
    by_ip: Mutex<HashMap<Box<str>, Arc<Router>>>,
    max_routers: usize,
    max_functions: usize,
}

impl Routers {
    /// At most `max_routers` routers, each keeping at most `max_functions`
    /// functions active.
    #[must_use]
    pub fn new(max_routers: usize, max_functions: usize) -> Self {
        Self {
            by_ip: Mutex::default(),
            max_routers,
            max_functions,
        }
    }

    /// The router named `ip`, interned.
    ///
    /// # Errors
    /// [`Refused::Routers`] when `max_routers` other routers keep functions
    /// active.
    pub fn get(&self, ip: &str) -> Result<Arc<Router>, Refused> {
        let mut by_ip = self
            .by_ip
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = by_ip.get(ip) {
            return Ok(r.clone());
        }
        if by_ip.len() >= self.max_routers {
            // Forget routers no stored report points at any more.
            by_ip.retain(|_, r| Arc::strong_count(r) > 1);
            if by_ip.len() >= self.max_routers {
                return Err(Refused::Routers {
                    limit: self.max_routers,
                });
            }
        }
        let router = Arc::new(Router {
            ip: ip.into(),
            active: AtomicUsize::new(0),
            limit: self.max_functions,
        });
        by_ip.insert(ip.into(), router.clone());
        Ok(router)
    }

    /// Number of interned routers.
    #[must_use]
    pub fn len(&self) -> usize {
        self.by_ip
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Whether no router is interned.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The latest report of every router for one function. Small: most
/// functions hear from a few routers, so a vector beats a map.
#[derive(Debug, Default)]
pub struct Store {
    reports: Vec<(Arc<Router>, Report)>,
}

fn expired(r: &Report, now: SystemTime, timeout: Duration) -> bool {
    now.duration_since(r.timestamp).unwrap_or(Duration::ZERO) > timeout
}

impl Store {
    /// Stores `report` for `router` unless an equal or newer one is stored,
    /// then drops every report older than `timeout` at `now`.
    ///
    /// # Errors
    /// [`Refused::RouterLimit`] when the router has no report here yet and
    /// keeps its limit of functions active (nothing is stored).
    pub fn record(
        &mut self,
        router: &Arc<Router>,
        report: Report,
        now: SystemTime,
        timeout: Duration,
    ) -> Result<(), Refused> {
        match self.reports.iter_mut().find(|(r, _)| Arc::ptr_eq(r, router)) {
            Some((_, stored)) if stored.timestamp >= report.timestamp => {}
            Some((_, stored)) => *stored = report,
            None => {
                router.acquire()?;
                // Grow one at a time while small: most functions hear from
                // one or a few routers.
                if self.reports.len() == self.reports.capacity() && self.reports.len() < 4 {
                    self.reports.reserve_exact(1);
                }
                self.reports.push((router.clone(), report));
            }
        }
        self.expire(now, timeout);
        Ok(())
    }

    /// Drops every report older than `timeout` at `now`.
    pub fn expire(&mut self, now: SystemTime, timeout: Duration) {
        self.reports.retain(|(router, r)| {
            let keep = !expired(r, now, timeout);
            if !keep {
                router.release();
            }
            keep
        });
        if self.reports.is_empty() {
            self.reports = Vec::new();
        }
    }

    /// Whether `router` has a report here.
    #[must_use]
    pub fn has(&self, router: &Arc<Router>) -> bool {
        self.reports.iter().any(|(r, _)| Arc::ptr_eq(r, router))
    }

    /// Forgets every report.
    pub fn clear(&mut self) {
        for (router, _) in self.reports.drain(..) {
            router.release();
        }
        self.reports = Vec::new();
    }

    /// The stored reports, by router IP.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Report)> {
        self.reports.iter().map(|(k, v)| (k.ip(), v))
    }

    /// Whether no report is stored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    /// The combined heartbeat: summed in-flight counts and the newest of the
    /// router timestamps and the instances' assignment times.
    #[must_use]
    pub fn combined(&self, assigned_at: impl IntoIterator<Item = SystemTime>) -> Combined {
        let in_flight = self
            .reports
            .iter()
            .fold(0u32, |acc, (_, r)| acc.saturating_add(r.in_flight));
        let timestamp = self
            .reports
            .iter()
            .map(|(_, r)| r.timestamp)
            .chain(assigned_at)
            .max();
        Combined { timestamp, in_flight }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Forwarding plan for a heartbeat batch: the peers to send to and the chain
/// to send along (`forwarded_for`, then this controller, then the targets).
#[must_use]
pub fn forward_plan(
    ring_members: &[impl AsRef<str>],
    forwarded_for: &[String],
    self_ip: &str,
) -> (Vec<String>, Vec<String>) {
    let targets: Vec<String> = ring_members
        .iter()
        .map(AsRef::as_ref)
        .filter(|ip| *ip != self_ip && !forwarded_for.iter().any(|f| f == ip))
        .map(str::to_owned)
        .collect();
    if targets.is_empty() {
        return (targets, Vec::new());
    }
    let mut chain = forwarded_for.to_vec();
    chain.push(self_ip.to_owned());
    chain.extend(targets.iter().cloned());
    (targets, chain)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn report(at: u64, in_flight: u32) -> Report {
        Report {
            timestamp: t(at),
            in_flight,
        }
    }

    const TO: Duration = Duration::from_secs(90);

    #[test]
    fn newest_wins_per_router() {
        let routers = Routers::new(10, 10);
        let (r1, r2) = (routers.get("r1").unwrap(), routers.get("r2").unwrap());
        let mut s = Store::default();
        s.record(&r1, report(10, 3), t(10), TO).unwrap();
        s.record(&r1, report(5, 9), t(11), TO).unwrap();
        s.record(&r1, report(10, 9), t(11), TO).unwrap();
        assert_eq!(s.combined([]).in_flight, 3, "older and equal reports are ignored");
        s.record(&r1, report(12, 1), t(12), TO).unwrap();
        s.record(&r2, report(12, 2), t(12), TO).unwrap();
        let c = s.combined([]);
        assert_eq!((c.in_flight, c.timestamp), (3, Some(t(12))));
        assert_eq!((r1.active(), r2.active()), (1, 1), "one function each");
    }

    #[test]
    fn old_reports_are_collected_when_a_heartbeat_arrives() {
        let routers = Routers::new(10, 10);
        let (dead, live) = (routers.get("dead").unwrap(), routers.get("live").unwrap());
        let mut s = Store::default();
        s.record(&dead, report(0, 5), t(0), TO).unwrap();
        s.record(&live, report(100, 1), t(100), TO).unwrap();
        assert_eq!(s.combined([]).in_flight, 1);
        assert_eq!(dead.active(), 0, "an expired report no longer counts");
    }

    #[test]
    fn assignments_count_as_activity() {
        let s = Store::default();
        assert_eq!(s.combined([]).timestamp, None);
        assert_eq!(s.combined([t(3), t(7)]).timestamp, Some(t(7)));
    }

    #[test]
    fn a_router_keeps_at_most_its_limit_of_functions_active_and_the_count_is_exact() {
        let routers = Routers::new(10, 3);
        let r = routers.get("10.0.0.1").unwrap();
        let mut stores: Vec<Store> = (0..5).map(|_| Store::default()).collect();
        let results: Vec<_> = stores
            .iter_mut()
            .map(|s| s.record(&r, report(1, 0), t(1), TO))
            .collect();
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 3);
        let refused = results[4].clone().unwrap_err();
        assert_eq!(refused.reason(), "router-limit");
        assert!(refused.to_string().contains("10.0.0.1") && refused.to_string().contains('3'));
        assert!(stores[4].is_empty(), "a refused entry stores nothing");
        // A function the router already keeps active is refreshed freely.
        stores[0].record(&r, report(2, 1), t(2), TO).unwrap();
        // Clearing, expiry and dropping a store each free a slot.
        stores[0].clear();
        assert_eq!(r.active(), 2);
        stores[1].expire(t(200), TO);
        assert_eq!(r.active(), 1);
        stores.truncate(2);
        assert_eq!(r.active(), 0);
        stores[0].record(&r, report(3, 0), t(3), TO).unwrap();
        assert_eq!(r.active(), 1);
    }

    #[test]
    fn the_number_of_routers_is_bounded_and_idle_ones_are_forgotten() {
        let routers = Routers::new(2, 5);
        let a = routers.get("a").unwrap();
        let mut s = Store::default();
        s.record(&a, report(1, 0), t(1), TO).unwrap();
        drop(routers.get("b").unwrap());
        assert_eq!(routers.len(), 2);
        // "b" keeps nothing active, so it makes room; "a" does not.
        let c = routers.get("c").unwrap();
        assert_eq!(routers.len(), 2);
        s.record(&c, report(1, 0), t(1), TO).unwrap();
        let err = routers.get("d").unwrap_err();
        assert_eq!(err, Refused::Routers { limit: 2 });
        assert!(
            Arc::ptr_eq(&routers.get("a").unwrap(), &a),
            "known routers are found"
        );
    }

    #[test]
    fn forwarding_examples_of_the_spec() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            forward_plan(&["1", "2", "3"], &s(&["1"]), "2"),
            (s(&["3"]), s(&["1", "2", "3"]))
        );
        assert_eq!(forward_plan(&["1", "2"], &s(&["1"]), "2"), (vec![], vec![]));
        assert_eq!(
            forward_plan(&["1", "2", "3"], &[], "4"),
            (s(&["1", "2", "3"]), s(&["4", "1", "2", "3"]))
        );
        assert_eq!(forward_plan(&Vec::<String>::new(), &[], "4"), (vec![], vec![]));
    }
}
