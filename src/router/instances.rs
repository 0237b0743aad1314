//! Router-local instance tables: for each active function, the ready
//! instances a controller streams to the router (`WatchInstances`), the
//! local choice among them, the function's concurrency limit and the queue
//! of requests waiting under it.
//!
//! A [`Table`] is what the request path reads: a snapshot (newest first) of
//! the instances it may choose, swapped whole on every change and read
//! without a lock, and whether the stream behind it is live. A request
//! picks by power of two choices on in-flight count ([`pick`]) among the
//! instances below the function's `max_in_flight_requests` and holds a
//! [`SlotGuard`] on the instance it uses. When every candidate is at the
//! limit the request queues on the table ([`Table::enqueue`]); a guard that
//! ends, and every change of the table, hands the freed room to the oldest
//! queued request. The guard of the last request to a draining instance
//! wakes the subscription so it can report the instance idle.
//!
//! Each [`Slot`] keeps its instance's idle keep-alive connections, so they
//! live and go with the instance. Instances a controller names on the
//! fallback path (`GetInstance`) are kept too ([`Table::adopt`]): their
//! requests share one slot (its count, its limit, its connections) and the
//! stream's view takes the slot over once it lists the instance.
//!
//! A cold function's first requests share one `GetInstance` call
//! ([`Table::cold_call`]).
//!
//! [`View`] is the pure part: a stream message applied to the previous view
//! ([`View::apply`]) with the version check that proves nothing was missed.
//! The stream itself lives in [`super::subscription`].

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use futures::future::{BoxFuture, Shared};
use http::HeaderValue;
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

use super::proxy::upstream::IdleConnections;
use crate::api::{self, InstanceState};
use crate::domain::AssignTiming;

/// Instances named by a controller (not by the stream) kept per function.
pub const MAX_ADOPTED: usize = 16;

/// One instance as the router knows it. Shared by the table and by the
/// requests using it.
#[derive(Debug)]
pub struct Slot {
    pub name: String,
    pub addr: SocketAddr,
    /// How requests reach it (its pool's protocol).
    pub protocol: api::Protocol,
    /// `X-Skipper-Instance` for requests sent to it.
    pub header: HeaderValue,
    /// Idle keep-alive connections to the instance.
    pub connections: IdleConnections,
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
            protocol: instance.protocol(),
            header,
            connections: IdleConnections::default(),
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

    /// Counts one more request unless `limit` (0: none) are in flight.
    fn try_count(&self, limit: u32) -> bool {
        self.in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            })
            .is_ok()
    }
}

/// Counts one request on a slot until dropped.
///
/// The count is raised before the draining flag is read, and the
/// subscription sets the flag before it reads the count (both sequentially
/// consistent), so either a request sees the flag and backs off, or the
/// subscription sees the request and waits for it. Likewise a guard lowers
/// the count before it looks for queued requests, and a request queues
/// before it looks for room, so freed room never goes unseen.
#[derive(Debug)]
pub struct SlotGuard {
    slot: Arc<Slot>,
    table: Arc<Table>,
}

impl SlotGuard {
    /// The slot.
    #[must_use]
    pub fn slot(&self) -> &Arc<Slot> {
        &self.slot
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let before = self.slot.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.table.queued.load(Ordering::SeqCst) > 0 {
            self.table.serve_queue();
        }
        if before == 1 && self.slot.is_draining() {
            self.table.idle.notify_one();
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

/// The answer of a cold function's shared `GetInstance` call.
pub type ColdAnswer = Result<(api::GetInstanceResponse, Option<AssignTiming>), crate::client::Error>;

/// A `GetInstance` call that every request of a cold function awaits.
pub type ColdCall = Shared<BoxFuture<'static, ColdAnswer>>;

/// What choosing found.
#[derive(Debug)]
pub enum Choice {
    /// An instance, with the request counted on it.
    Chosen(SlotGuard),
    /// Every candidate is at the function's limit: the request may queue.
    Full,
    /// No candidate: the table is not in use, or every instance is
    /// excluded or draining.
    Empty,
}

/// What a queued request is woken with.
#[derive(Debug)]
pub enum Wake {
    /// Room on an instance, the request already counted on it.
    Chosen(SlotGuard),
    /// The table has nothing to offer any more (its stream went down, every
    /// candidate went away): the request chooses again from the start.
    Reselect,
}

/// A request waiting for room under the function's limit.
#[derive(Debug)]
struct Waiter {
    id: u64,
    max: usize,
    limit: u32,
    excluded: Vec<String>,
    wake: oneshot::Sender<Wake>,
}

/// A request's place in its function's queue; dropping it leaves.
#[derive(Debug)]
pub struct Queued {
    table: Arc<Table>,
    id: u64,
    woken: oneshot::Receiver<Wake>,
}

impl Queued {
    /// Completes when room was found for the request (or it must choose
    /// again).
    pub async fn woken(&mut self) -> Wake {
        // The sender is dropped unsent only when the entry was removed,
        // which only this handle does.
        (&mut self.woken).await.unwrap_or(Wake::Reselect)
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let mut q = self.table.lock_queue();
        if let Some(pos) = q.iter().position(|w| w.id == self.id) {
            q.remove(pos);
            self.table.queued.fetch_sub(1, Ordering::SeqCst);
        }
        drop(q);
        // A guard handed over but never taken goes back (and to the next
        // request in line).
        if let Ok(Wake::Chosen(g)) = self.woken.try_recv() {
            drop(g);
        }
    }
}

/// A function's table, shared by its subscription and its requests.
#[derive(Debug)]
pub struct Table {
    /// Swapped whole on every change; read without a lock.
    published: ArcSwap<Published>,
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
    /// Requests waiting for room under the limit, oldest first. A std
    /// mutex: the critical sections hand out guards, never across an
    /// await.
    queue: Mutex<VecDeque<Waiter>>,
    /// `queue`'s length, read without the lock on every guard's drop.
    queued: AtomicUsize,
    next_waiter: AtomicU64,
    /// Instances a controller named that the stream has not listed,
    /// newest last (at most [`MAX_ADOPTED`]). A std mutex: a short scan.
    adopted: Mutex<Vec<Arc<Slot>>>,
    /// The cold function's shared `GetInstance` call. A std mutex: a
    /// clone or a store.
    cold: Mutex<Option<ColdCall>>,
}

impl Table {
    /// An empty table for a function of `tenant` (a valid label value, so
    /// always a valid header value; an invalid one is sent empty).
    #[must_use]
    pub fn new(tenant: &str) -> Self {
        Self {
            published: ArcSwap::default(),
            live: AtomicBool::new(false),
            subscribed: AtomicBool::new(false),
            idle: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
            tenant: HeaderValue::from_str(tenant).unwrap_or_else(|_| HeaderValue::from_static("")),
            queue: Mutex::default(),
            queued: AtomicUsize::new(0),
            next_waiter: AtomicU64::new(0),
            adopted: Mutex::default(),
            cold: Mutex::default(),
        }
    }

    fn lock_queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Waiter>> {
        // Poisoning needs a panic inside a queue operation, which cannot happen.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_adopted(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Slot>>> {
        self.adopted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the stream is up (the table may be used).
    #[must_use]
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Marks the stream down: requests fall back to `GetInstance` until a
    /// new snapshot arrives; queued requests that no adopted instance can
    /// take choose again.
    pub fn set_down(self: &Arc<Self>) {
        self.live.store(false, Ordering::Release);
        self.serve_queue();
    }

    /// Publishes `view`, marks the table live and hands new room to
    /// queued requests.
    pub fn publish(self: &Arc<Self>, view: &View) {
        let next = Arc::new(Published {
            ready: view.choosable(),
            all: view.slots.clone(),
        });
        self.lock_adopted()
            .retain(|s| next.all.get(&s.name).is_none_or(|v| !Arc::ptr_eq(v, s)));
        self.published.store(next);
        self.live.store(true, Ordering::Release);
        self.serve_queue();
    }

    /// Every slot known (to reuse in-flight counts and connections across
    /// streams and from the fallback path).
    #[must_use]
    pub fn known(&self) -> HashMap<String, Arc<Slot>> {
        let mut all = self.published.load().all.clone();
        for s in self.lock_adopted().iter() {
            all.entry(s.name.clone()).or_insert_with(|| s.clone());
        }
        all
    }

    /// The slot of `instance`, named by a controller: the table's own when
    /// it knows the instance at that address, else one kept for the
    /// requests it is named to.
    ///
    /// # Errors
    /// [`BadInstance`] when the instance cannot be used.
    pub fn adopt(&self, instance: &api::Instance) -> Result<Arc<Slot>, BadInstance> {
        let fresh = Slot::new(instance)?;
        if let Some(s) = self.published.load().all.get(&fresh.name)
            && s.addr == fresh.addr
        {
            return Ok(s.clone());
        }
        let mut adopted = self.lock_adopted();
        if let Some(s) = adopted
            .iter()
            .find(|s| s.name == fresh.name && s.addr == fresh.addr)
        {
            return Ok(s.clone());
        }
        adopted.retain(|s| s.name != fresh.name);
        if adopted.len() >= MAX_ADOPTED {
            adopted.remove(0);
        }
        let slot = Arc::new(fresh);
        adopted.push(slot.clone());
        Ok(slot)
    }

    /// The instances a request may be sent to: the stream's ready ones
    /// while the table is live, else those controllers named.
    fn candidates(&self) -> Vec<Arc<Slot>> {
        if self.is_live() {
            self.published.load().ready.clone()
        } else {
            self.lock_adopted()
                .iter()
                .rev()
                .filter(|s| !s.is_draining())
                .cloned()
                .collect()
        }
    }

    /// Counts a request on `slot` unless it is at `limit` or draining.
    fn count_on(self: &Arc<Self>, slot: &Arc<Slot>, limit: u32) -> Option<SlotGuard> {
        if !slot.try_count(limit) {
            return None;
        }
        if slot.is_draining() {
            // It turned draining since the table was read. Undone by hand,
            // not by a guard's drop: this may run under the queue's lock,
            // and room on a draining instance is no room for the queue.
            if slot.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
                self.idle.notify_one();
            }
            return None;
        }
        Some(SlotGuard {
            slot: slot.clone(),
            table: self.clone(),
        })
    }

    /// Chooses among the newest `max` candidates that are not `excluded`:
    /// power of two choices on in-flight requests, else (near the limit)
    /// the newest with room.
    fn choose_among(
        self: &Arc<Self>,
        ready: &[Arc<Slot>],
        max: usize,
        limit: u32,
        excluded: &[String],
    ) -> Choice {
        let Some(slot) = pick(ready, max, excluded, |n| rand::random_range(0..n)) else {
            return Choice::Empty;
        };
        if let Some(g) = self.count_on(&slot, limit) {
            return Choice::Chosen(g);
        }
        let newest = &ready[..ready.len().min(max.max(1))];
        let mut any = false;
        for s in newest.iter().filter(|s| !excluded.contains(&s.name)) {
            if s.is_draining() {
                continue;
            }
            any = true;
            if let Some(g) = self.count_on(s, limit) {
                return Choice::Chosen(g);
            }
        }
        if any { Choice::Full } else { Choice::Empty }
    }

    /// A locally chosen instance with a request counted on it (see
    /// [`Choice`]); only while the table is live. Requests already queued
    /// for the function go first: a newcomer then gets [`Choice::Full`].
    #[must_use]
    pub fn choose(self: &Arc<Self>, max: usize, limit: u32, excluded: &[String]) -> Choice {
        if !self.is_live() {
            return Choice::Empty;
        }
        if limit > 0 && self.queued.load(Ordering::SeqCst) > 0 {
            return Choice::Full;
        }
        let current = self.published.load();
        self.choose_among(&current.ready, max, limit, excluded)
    }

    /// Counts a request on `slot` (an instance a controller named) within
    /// `limit`; `None` when it is at the limit (the request may queue).
    #[must_use]
    pub fn count_named(self: &Arc<Self>, slot: &Arc<Slot>, limit: u32) -> Option<SlotGuard> {
        if limit > 0 && self.queued.load(Ordering::SeqCst) > 0 {
            return None;
        }
        if slot.try_count(limit) {
            // Draining or not: the controller chose it for this request.
            return Some(SlotGuard {
                slot: slot.clone(),
                table: self.clone(),
            });
        }
        None
    }

    /// Queues a request for room on one of the newest `max` instances that
    /// are not `excluded`, under `limit`. The entry is served in order
    /// (oldest first) as guards end and the table changes.
    #[must_use]
    pub fn enqueue(self: &Arc<Self>, max: usize, limit: u32, excluded: &[String]) -> Queued {
        let (tx, rx) = oneshot::channel();
        let id = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        {
            let mut q = self.lock_queue();
            q.push_back(Waiter {
                id,
                max,
                limit,
                excluded: excluded.to_vec(),
                wake: tx,
            });
            self.queued.fetch_add(1, Ordering::SeqCst);
        }
        // Room freed before the entry was visible is handed out here.
        self.serve_queue();
        Queued {
            table: self.clone(),
            id,
            woken: rx,
        }
    }

    /// Requests queued for room now.
    #[must_use]
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Hands room to queued requests, oldest first, until the oldest finds
    /// none; requests the table has nothing for choose again.
    fn serve_queue(self: &Arc<Self>) {
        let mut unclaimed = Vec::new();
        {
            let mut q = self.lock_queue();
            let mut candidates = None;
            while let Some(front) = q.front() {
                let ready = candidates.get_or_insert_with(|| self.candidates());
                let wake = match self.choose_among(ready, front.max, front.limit, &front.excluded) {
                    Choice::Chosen(g) => Wake::Chosen(g),
                    Choice::Full => break,
                    Choice::Empty => Wake::Reselect,
                };
                if let Some(w) = q.pop_front() {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    if let Err(Wake::Chosen(g)) = w.wake.send(wake) {
                        unclaimed.push(g);
                    }
                }
            }
        }
        // Outside the lock: each dropped guard serves the queue again.
        drop(unclaimed);
    }

    /// The cold function's `GetInstance` call in progress, or `start()`
    /// made the shared one.
    pub fn cold_call(&self, start: impl FnOnce() -> BoxFuture<'static, ColdAnswer>) -> ColdCall {
        let mut cold = self
            .cold
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(call) = cold.as_ref()
            && call.peek().is_none()
        {
            return call.clone();
        }
        let call = futures::FutureExt::shared(start());
        *cold = Some(call.clone());
        call
    }

    /// Draining instances with nothing in flight that were not reported on
    /// this stream yet; each is marked reported.
    #[must_use]
    pub fn newly_idle(&self) -> Vec<String> {
        self.published
            .load()
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
    pub fn stop(self: &Arc<Self>) {
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
mod tests;
