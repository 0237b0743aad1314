//! Router-local instance tables: for each active function, the ready
//! instances a controller streams to the router (`WatchInstances`), and the
//! local choice among them.
//!
//! A [`Table`] is what the request path reads: a snapshot (newest first) of
//! the instances it may choose, swapped whole on every change, and whether
//! the stream behind it is live. A request picks by power of two choices on
//! in-flight count ([`pick`]) and holds a [`SlotGuard`] on the instance it
//! uses; the guard of the last request to a draining instance wakes the
//! subscription so it can report the instance idle.
//!
//! [`View`] is the pure part: a stream message applied to the previous view
//! ([`View::apply`]) with the version check that proves nothing was missed.
//! The stream itself lives in [`super::subscription`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use http::HeaderValue;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::api::{self, InstanceState};

/// One instance as the router knows it. Shared by the table and by the
/// requests using it.
#[derive(Debug)]
pub struct Slot {
    pub name: String,
    pub addr: SocketAddr,
    /// `X-Skipper-Instance` for requests sent to it.
    pub header: HeaderValue,
    assigned_at: SystemTime,
    in_flight: AtomicU32,
    draining: AtomicBool,
    /// Reported idle on the current stream.
    reported: AtomicBool,
}

/// Why an instance from a controller cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadInstance {
    #[error("instance without a name")]
    NoName,
    #[error("instance {name:?} has an unusable address {addr:?}")]
    Address { name: String, addr: String },
}

impl Slot {
    /// A slot for `instance` (name and an IP socket address required).
    ///
    /// # Errors
    /// [`BadInstance`] when the name is missing or the address does not
    /// parse.
    pub fn new(instance: &api::Instance) -> Result<Self, BadInstance> {
        let name = instance
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(BadInstance::NoName)?;
        let addr_text = instance.addr.as_deref().unwrap_or_default();
        let bad = || BadInstance::Address {
            name: name.clone(),
            addr: addr_text.to_owned(),
        };
        let addr: SocketAddr = addr_text.parse().map_err(|_| bad())?;
        let header = HeaderValue::from_str(&name).map_err(|_| bad())?;
        let assigned_at = instance
            .assigned_at
            .and_then(|t| SystemTime::try_from(t).ok())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Ok(Self {
            name,
            addr,
            header,
            assigned_at,
            in_flight: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            reported: AtomicBool::new(false),
        })
    }

    /// Requests in flight to this instance.
    #[must_use]
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether the controller is about to delete this instance.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// Counts one request on a slot until dropped.
#[derive(Debug)]
pub struct SlotGuard {
    slot: Arc<Slot>,
    idle: Arc<Notify>,
}

impl SlotGuard {
    /// Counts a request on `slot`, unless it is draining. `idle` is woken
    /// when the last request to a draining slot ends.
    ///
    /// The count is raised before the draining flag is read, and the
    /// subscription sets the flag before it reads the count (both
    /// sequentially consistent), so either this request sees the flag and
    /// backs off, or the subscription sees the request and waits for it.
    #[must_use]
    pub fn acquire(slot: &Arc<Slot>, idle: &Arc<Notify>) -> Option<Self> {
        slot.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = Self {
            slot: slot.clone(),
            idle: idle.clone(),
        };
        if slot.is_draining() {
            drop(guard);
            return None;
        }
        Some(guard)
    }

    /// The slot.
    #[must_use]
    pub fn slot(&self) -> &Arc<Slot> {
        &self.slot
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.slot.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 && self.slot.is_draining() {
            self.idle.notify_one();
        }
    }
}

/// The instances of a function after the last applied stream message.
#[derive(Debug, Clone, Default)]
pub struct View {
    /// `None` until a snapshot arrived.
    pub version: Option<u64>,
    pub slots: HashMap<String, Arc<Slot>>,
}

/// A stream message that does not fit the view.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("changes for version {previous:?} arrived while the table is at version {have:?}")]
    VersionGap {
        have: Option<u64>,
        previous: Option<u64>,
    },
    #[error("message without a version")]
    NoVersion,
}

impl View {
    /// The view after `msg`. A snapshot replaces everything; changes apply
    /// only to the version they name. Slots of instances already known
    /// (`known`, by name, same address) are reused so in-flight counts
    /// carry over. Instances that cannot be used are left out (and
    /// returned, to be logged).
    ///
    /// # Errors
    /// [`ApplyError`] when the message does not continue this view.
    pub fn apply(
        &self,
        msg: &api::WatchInstancesResponse,
        known: &HashMap<String, Arc<Slot>>,
    ) -> Result<(View, Vec<BadInstance>), ApplyError> {
        let version = msg.version.ok_or(ApplyError::NoVersion)?;
        let snapshot = msg.snapshot.unwrap_or(false);
        let mut slots = if snapshot {
            HashMap::new()
        } else {
            if self.version.is_none() || msg.previous_version != self.version {
                return Err(ApplyError::VersionGap {
                    have: self.version,
                    previous: msg.previous_version,
                });
            }
            self.slots.clone()
        };
        let mut bad = Vec::new();
        for change in &msg.changes {
            let Some(instance) = change.instance.as_ref() else {
                continue;
            };
            let state = change
                .state
                .and_then(|s| InstanceState::try_from(s).ok())
                .unwrap_or(InstanceState::Unspecified);
            let name = instance.name.clone().unwrap_or_default();
            if state == InstanceState::Removed {
                slots.remove(&name);
                continue;
            }
            let draining = state == InstanceState::Draining;
            let fresh = match Slot::new(instance) {
                Ok(s) => s,
                Err(e) => {
                    slots.remove(&name);
                    bad.push(e);
                    continue;
                }
            };
            let slot = match slots.get(&name).or_else(|| known.get(&name)) {
                Some(old) if old.addr == fresh.addr => old.clone(),
                _ => Arc::new(fresh),
            };
            if snapshot {
                // Idle reports belong to a stream: a new one asks again.
                slot.reported.store(false, Ordering::SeqCst);
            }
            if slot.draining.swap(draining, Ordering::SeqCst) && !draining {
                slot.reported.store(false, Ordering::SeqCst);
            }
            slots.insert(name, slot);
        }
        Ok((
            View {
                version: Some(version),
                slots,
            },
            bad,
        ))
    }

    /// The slots that may be chosen, newest first.
    #[must_use]
    pub fn choosable(&self) -> Vec<Arc<Slot>> {
        let mut ready: Vec<Arc<Slot>> = self
            .slots
            .values()
            .filter(|s| !s.is_draining())
            .cloned()
            .collect();
        ready.sort_by(|a, b| {
            b.assigned_at
                .cmp(&a.assigned_at)
                .then_with(|| a.name.cmp(&b.name))
        });
        ready
    }
}

/// Power of two choices among the newest `max` of `ready` (newest first)
/// that are not `excluded`: two distinct candidates drawn with `draw(n)`
/// (uniform in `0..n`), the one with fewer requests in flight wins (the
/// first drawn on a tie). `None` when no candidate is left.
pub fn pick(
    ready: &[Arc<Slot>],
    max: usize,
    excluded: &[String],
    draw: impl FnMut(usize) -> usize,
) -> Option<Arc<Slot>> {
    let newest = &ready[..ready.len().min(max.max(1))];
    if excluded.is_empty() {
        return two_choices(newest.len(), |i| &newest[i], draw);
    }
    let kept: Vec<&Arc<Slot>> = newest.iter().filter(|s| !excluded.contains(&s.name)).collect();
    two_choices(kept.len(), |i| kept[i], draw)
}

fn two_choices<'a>(
    n: usize,
    at: impl Fn(usize) -> &'a Arc<Slot>,
    mut draw: impl FnMut(usize) -> usize,
) -> Option<Arc<Slot>> {
    match n {
        0 => None,
        1 => Some(at(0).clone()),
        n => {
            let a = draw(n);
            let mut b = draw(n - 1);
            if b >= a {
                b += 1;
            }
            let (x, y) = (at(a), at(b));
            Some(if y.in_flight() < x.in_flight() { y } else { x }.clone())
        }
    }
}

/// What the request path sees of a table.
#[derive(Debug, Default)]
struct Published {
    ready: Vec<Arc<Slot>>,
    all: HashMap<String, Arc<Slot>>,
}

/// A function's table, shared by its subscription and its requests.
#[derive(Debug)]
pub struct Table {
    /// Swapped whole on every change. A std lock: the critical sections are
    /// a pointer clone or swap, never across an await.
    published: RwLock<Arc<Published>>,
    /// Whether the stream is up and the table is current.
    live: AtomicBool,
    /// Set once a subscription has been started.
    subscribed: AtomicBool,
    /// Woken when the last request to a draining instance ends.
    idle: Arc<Notify>,
    /// Stops the subscription.
    stop: CancellationToken,
    /// `X-Skipper-Tenant` for requests of this function.
    pub tenant: HeaderValue,
}

impl Table {
    /// An empty table for a function of `tenant` (a valid label value, so
    /// always a valid header value; an invalid one is sent empty).
    #[must_use]
    pub fn new(tenant: &str) -> Self {
        Self {
            published: RwLock::default(),
            live: AtomicBool::new(false),
            subscribed: AtomicBool::new(false),
            idle: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
            tenant: HeaderValue::from_str(tenant).unwrap_or_else(|_| HeaderValue::from_static("")),
        }
    }

    fn current(&self) -> Arc<Published> {
        self.published
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether the stream is up (the table may be used).
    #[must_use]
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Marks the stream down: requests fall back to `GetInstance` until a
    /// new snapshot arrives.
    pub fn set_down(&self) {
        self.live.store(false, Ordering::Release);
    }

    /// Publishes `view` and marks the table live.
    pub fn publish(&self, view: &View) {
        let next = Arc::new(Published {
            ready: view.choosable(),
            all: view.slots.clone(),
        });
        *self
            .published
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        self.live.store(true, Ordering::Release);
    }

    /// Every slot known (to reuse in-flight counts across streams).
    #[must_use]
    pub fn known(&self) -> HashMap<String, Arc<Slot>> {
        self.current().all.clone()
    }

    /// A locally chosen instance with a request counted on it, when the
    /// table is live and has a candidate that is not excluded.
    #[must_use]
    pub fn choose(&self, max: usize, excluded: &[String]) -> Option<SlotGuard> {
        if !self.is_live() {
            return None;
        }
        let current = self.current();
        for _ in 0..2 {
            let slot = pick(&current.ready, max, excluded, |n| rand::random_range(0..n))?;
            // `None`: it turned draining since the table was read.
            if let Some(g) = SlotGuard::acquire(&slot, &self.idle) {
                return Some(g);
            }
        }
        None
    }

    /// Counts a request on the known instance `name`, if the table holds
    /// it (an instance the controller returned to the fallback path).
    #[must_use]
    pub fn guard_for(&self, name: &str) -> Option<SlotGuard> {
        let slot = self.current().all.get(name).cloned()?;
        SlotGuard::acquire(&slot, &self.idle)
    }

    /// Draining instances with nothing in flight that were not reported on
    /// this stream yet; each is marked reported.
    #[must_use]
    pub fn newly_idle(&self) -> Vec<String> {
        self.current()
            .all
            .values()
            .filter(|s| s.is_draining() && s.in_flight.load(Ordering::SeqCst) == 0)
            .filter(|s| !s.reported.swap(true, Ordering::SeqCst))
            .map(|s| s.name.clone())
            .collect()
    }

    /// Notified when a draining instance may have become idle.
    #[must_use]
    pub fn idle_signal(&self) -> Arc<Notify> {
        self.idle.clone()
    }

    /// Claims the right to start this table's subscription (true once).
    pub fn claim_subscription(&self) -> bool {
        // A plain read first: every request asks, and a read shares the
        // cache line where a swap would bounce it between cores.
        !self.subscribed.load(Ordering::Acquire) && !self.subscribed.swap(true, Ordering::AcqRel)
    }

    /// Stops the subscription (the function went idle).
    pub fn stop(&self) {
        self.stop.cancel();
        self.set_down();
    }

    /// Cancelled when the subscription must stop.
    #[must_use]
    pub fn stopped(&self) -> &CancellationToken {
        &self.stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(name: &str, port: u16, age_s: u64) -> api::Instance {
        api::Instance {
            name: Some(name.into()),
            addr: Some(format!("127.0.0.1:{port}")),
            assigned_at: Some((SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 - age_s)).into()),
            ..Default::default()
        }
    }

    fn change(i: api::Instance, state: InstanceState) -> api::InstanceChange {
        api::InstanceChange {
            instance: Some(i),
            state: Some(state as i32),
        }
    }

    fn snapshot(version: u64, changes: Vec<api::InstanceChange>) -> api::WatchInstancesResponse {
        api::WatchInstancesResponse {
            version: Some(version),
            previous_version: None,
            snapshot: Some(true),
            changes,
        }
    }

    fn delta(previous: u64, version: u64, changes: Vec<api::InstanceChange>) -> api::WatchInstancesResponse {
        api::WatchInstancesResponse {
            version: Some(version),
            previous_version: Some(previous),
            snapshot: Some(false),
            changes,
        }
    }

    fn names(slots: &[Arc<Slot>]) -> Vec<&str> {
        slots.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn snapshot_then_changes_in_version_order() {
        let none = HashMap::new();
        let v0 = View::default();
        let (v1, bad) = v0
            .apply(
                &snapshot(
                    7,
                    vec![
                        change(inst("a", 1, 10), InstanceState::Ready),
                        change(inst("b", 2, 5), InstanceState::Ready),
                    ],
                ),
                &none,
            )
            .unwrap();
        assert!(bad.is_empty());
        assert_eq!(v1.version, Some(7));
        assert_eq!(names(&v1.choosable()), ["b", "a"], "newest first");

        let (v2, _) = v1
            .apply(
                &delta(
                    7,
                    9,
                    vec![
                        change(inst("c", 3, 1), InstanceState::Ready),
                        change(inst("a", 1, 10), InstanceState::Draining),
                    ],
                ),
                &none,
            )
            .unwrap();
        assert_eq!(
            names(&v2.choosable()),
            ["c", "b"],
            "a draining instance is not chosen"
        );
        assert_eq!(v2.slots.len(), 3, "but stays known until removed");

        let removed = api::Instance {
            name: Some("a".into()),
            ..Default::default()
        };
        let (v3, _) = v2
            .apply(
                &delta(9, 10, vec![change(removed, InstanceState::Removed)]),
                &none,
            )
            .unwrap();
        assert_eq!(v3.slots.len(), 2);

        // A gap, a repeated version or changes before any snapshot: refused.
        for (view, msg) in [
            (&v3, delta(9, 11, vec![])),
            (&v3, delta(11, 12, vec![])),
            (&v0, delta(0, 1, vec![])),
        ] {
            assert!(matches!(
                view.apply(&msg, &none),
                Err(ApplyError::VersionGap { .. })
            ));
        }
        let mut unversioned = snapshot(1, vec![]);
        unversioned.version = None;
        assert_eq!(v0.apply(&unversioned, &none).unwrap_err(), ApplyError::NoVersion);
    }

    #[test]
    fn slots_carry_over_and_bad_instances_are_left_out() {
        let none = HashMap::new();
        let (v1, _) = View::default()
            .apply(
                &snapshot(1, vec![change(inst("a", 1, 1), InstanceState::Ready)]),
                &none,
            )
            .unwrap();
        let a = v1.slots["a"].clone();
        a.in_flight.fetch_add(2, Ordering::SeqCst);
        // A new stream's snapshot keeps the slot (and its count) of a known
        // instance at the same address; another address is a new slot.
        let (v2, _) = View::default()
            .apply(
                &snapshot(1, vec![change(inst("a", 1, 1), InstanceState::Ready)]),
                &v1.slots,
            )
            .unwrap();
        assert!(Arc::ptr_eq(&v2.slots["a"], &a));
        let (v3, _) = View::default()
            .apply(
                &snapshot(1, vec![change(inst("a", 9, 1), InstanceState::Ready)]),
                &v1.slots,
            )
            .unwrap();
        assert_eq!(v3.slots["a"].in_flight(), 0);

        let mut no_addr = inst("x", 1, 1);
        no_addr.addr = Some("nowhere".into());
        let (v4, bad) = v2
            .apply(
                &delta(
                    1,
                    2,
                    vec![
                        change(no_addr, InstanceState::Ready),
                        change(inst("", 1, 1), InstanceState::Ready),
                    ],
                ),
                &none,
            )
            .unwrap();
        assert_eq!(v4.slots.len(), 1);
        assert_eq!(bad.len(), 2);
    }

    fn slots(loads: &[u32]) -> Vec<Arc<Slot>> {
        loads
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let s = Slot::new(&inst(&format!("s{i}"), 1, i as u64)).unwrap();
                s.in_flight.store(*l, Ordering::SeqCst);
                Arc::new(s)
            })
            .collect()
    }

    #[test]
    fn two_choices_prefer_the_less_loaded() {
        let ready = slots(&[5, 1, 3]);
        // Draws (0, then 0 of the remaining two → index 1): s0 vs s1.
        let mut draws = [0usize, 0].into_iter();
        let got = pick(&ready, 3, &[], |_| draws.next().unwrap()).unwrap();
        assert_eq!(got.name, "s1");
        // s2 vs s0 (draw 2, then 0): s2 has 3 < 5.
        let mut draws = [2usize, 0].into_iter();
        assert_eq!(
            pick(&ready, 3, &[], |_| draws.next().unwrap()).unwrap().name,
            "s2"
        );
        // Ties keep the first drawn.
        let even = slots(&[1, 1]);
        let mut draws = [1usize, 0].into_iter();
        assert_eq!(pick(&even, 3, &[], |_| draws.next().unwrap()).unwrap().name, "s1");
    }

    #[test]
    fn max_instances_and_exclusions_narrow_the_candidates() {
        let ready = slots(&[0, 0, 0]);
        // Only the newest `max` (here one) are candidates.
        for _ in 0..50 {
            let got = pick(&ready, 1, &[], |n| rand::random_range(0..n)).unwrap();
            assert_eq!(got.name, "s0");
        }
        let got = pick(&ready, 3, &["s0".into(), "s2".into()], |n| {
            rand::random_range(0..n)
        })
        .unwrap();
        assert_eq!(got.name, "s1");
        assert!(
            pick(&ready, 2, &["s0".into(), "s1".into()], |n| rand::random_range(
                0..n
            ))
            .is_none()
        );
        assert!(pick(&[], 3, &[], |n| rand::random_range(0..n)).is_none());
        // Both candidates are always distinct.
        for _ in 0..200 {
            let two = slots(&[0, 9]);
            assert_eq!(
                pick(&two, 2, &[], |n| rand::random_range(0..n)).unwrap().name,
                "s0"
            );
        }
    }

    #[test]
    fn draining_slots_refuse_new_requests_and_report_idle_once() {
        let table = Table::new("t1");
        let (v, _) = View::default()
            .apply(
                &snapshot(
                    1,
                    vec![
                        change(inst("a", 1, 1), InstanceState::Ready),
                        change(inst("b", 2, 2), InstanceState::Ready),
                    ],
                ),
                &HashMap::new(),
            )
            .unwrap();
        assert!(
            table.choose(3, &[]).is_none(),
            "not live before a snapshot is published"
        );
        table.publish(&v);
        let held = table.guard_for("a").unwrap();
        let (v2, _) = v
            .apply(
                &delta(1, 2, vec![change(inst("a", 1, 1), InstanceState::Draining)]),
                &HashMap::new(),
            )
            .unwrap();
        table.publish(&v2);
        assert!(
            table.guard_for("a").is_none(),
            "a draining instance takes no new request"
        );
        for _ in 0..20 {
            assert_eq!(table.choose(3, &[]).unwrap().slot().name, "b");
        }
        assert!(table.newly_idle().is_empty(), "a request is still in flight");
        drop(held);
        assert_eq!(table.newly_idle(), ["a"]);
        assert!(table.newly_idle().is_empty(), "reported once per stream");
        table.set_down();
        assert!(
            table.choose(3, &[]).is_none(),
            "a table whose stream is down is not used"
        );
    }
}
