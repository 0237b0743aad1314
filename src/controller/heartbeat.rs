//! Router heartbeats: per-router newest-wins storage with garbage collection
//! (spec §5.2), the combined heartbeat of a function (§5.3), and the
//! forwarding targets of the `forwarded_for` chain (§2.4).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use crate::controller::supervisor::converge::Combined;

/// One router's latest report for a function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub timestamp: SystemTime,
    pub in_flight: u32,
}

/// The latest report of every router for one function.
#[derive(Debug, Clone, Default)]
pub struct Store {
    by_router: HashMap<String, Report>,
}

impl Store {
    /// Stores `report` for `router` unless an equal or newer one is stored,
    /// then drops every report older than `timeout` at `now`.
    pub fn record(&mut self, router: &str, report: Report, now: SystemTime, timeout: Duration) {
        match self.by_router.get_mut(router) {
            Some(stored) if stored.timestamp >= report.timestamp => {}
            Some(stored) => *stored = report,
            None => {
                self.by_router.insert(router.to_owned(), report);
            }
        }
        self.by_router
            .retain(|_, r| now.duration_since(r.timestamp).unwrap_or(Duration::ZERO) <= timeout);
    }

    /// Forgets every report.
    pub fn clear(&mut self) {
        self.by_router.clear();
    }

    /// The stored reports, by router IP.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Report)> {
        self.by_router.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Whether no report is stored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_router.is_empty()
    }

    /// The combined heartbeat: summed in-flight counts and the newest of the
    /// router timestamps and the instances' assignment times.
    #[must_use]
    pub fn combined(&self, assigned_at: impl IntoIterator<Item = SystemTime>) -> Combined {
        let in_flight = self
            .by_router
            .values()
            .fold(0u32, |acc, r| acc.saturating_add(r.in_flight));
        let timestamp = self
            .by_router
            .values()
            .map(|r| r.timestamp)
            .chain(assigned_at)
            .max();
        Combined { timestamp, in_flight }
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

    #[test]
    fn newest_wins_per_router() {
        let mut s = Store::default();
        let to = Duration::from_secs(90);
        s.record(
            "r1",
            Report {
                timestamp: t(10),
                in_flight: 3,
            },
            t(10),
            to,
        );
        s.record(
            "r1",
            Report {
                timestamp: t(5),
                in_flight: 9,
            },
            t(11),
            to,
        );
        s.record(
            "r1",
            Report {
                timestamp: t(10),
                in_flight: 9,
            },
            t(11),
            to,
        );
        assert_eq!(s.combined([]).in_flight, 3, "older and equal reports are ignored");
        s.record(
            "r1",
            Report {
                timestamp: t(12),
                in_flight: 1,
            },
            t(12),
            to,
        );
        s.record(
            "r2",
            Report {
                timestamp: t(12),
                in_flight: 2,
            },
            t(12),
            to,
        );
        let c = s.combined([]);
        assert_eq!((c.in_flight, c.timestamp), (3, Some(t(12))));
    }

    #[test]
    fn old_reports_are_collected_when_a_heartbeat_arrives() {
        let mut s = Store::default();
        let to = Duration::from_secs(90);
        s.record(
            "dead",
            Report {
                timestamp: t(0),
                in_flight: 5,
            },
            t(0),
            to,
        );
        s.record(
            "live",
            Report {
                timestamp: t(100),
                in_flight: 1,
            },
            t(100),
            to,
        );
        assert_eq!(s.combined([]).in_flight, 1);
    }

    #[test]
    fn assignments_count_as_activity() {
        let s = Store::default();
        assert_eq!(s.combined([]).timestamp, None);
        assert_eq!(s.combined([t(3), t(7)]).timestamp, Some(t(7)));
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
