//! Instance feeds: what routers' tables are made of, fed from the pod cache.
//!
//! A [`Feed`] per watched function holds the function's current [`View`]
//! (its ready instances, each READY or DRAINING, and a version that grows
//! with every change). One task per feed recomputes the view when the pod
//! cache reports a change to the function's pods or a drain mark changes
//! (event-driven: [`PodCache::watch_function`]), and ends with the last
//! subscriber. The `WatchInstances` streams that send the views are
//! [`super::watch`]'s.
//!
//! Scale-down: [`Feeds::drain`] marks instances DRAINING, waits until every
//! subscribed router reported them idle (or the deadline), and returns; the
//! caller then deletes the pods. Draining instances are never chosen by
//! `GetInstance` on this controller either.
//!
//! [`PodCache::watch_function`]: super::kube::cache::PodCache::watch_function

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

use super::kube::Instance;
use super::kube::stores::State;
use crate::api::{self, InstanceState};
use crate::domain::{Function, FunctionId};
use crate::shutdown::Shutdown;

/// Most instance streams a controller serves at once (its own and those
/// it forwards); more are refused with `RESOURCE_EXHAUSTED`.
pub const MAX_STREAMS: usize = 100_000;
/// Longest list of idle instances taken from one router message.
const MAX_IDLE_NAMES: usize = 1024;

/// A function's instances as routers see them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    pub version: u64,
    pub instances: BTreeMap<String, (api::Instance, InstanceState)>,
}

impl View {
    /// The view of `ready` instances, those in `draining` marked so.
    #[must_use]
    pub fn of(version: u64, ready: &[Instance], draining: &HashSet<String>) -> Self {
        let instances = ready
            .iter()
            .map(|i| {
                let mut wire = i.to_api();
                // Usage figures change every metrics refresh; routers do
                // not use them.
                wire.cpu_usage_milli = None;
                wire.memory_usage_mib = None;
                let state = if draining.contains(&i.name) {
                    InstanceState::Draining
                } else {
                    InstanceState::Ready
                };
                (i.name.clone(), (wire, state))
            })
            .collect();
        Self { version, instances }
    }

    /// The whole view as a snapshot message.
    #[must_use]
    pub fn snapshot(&self) -> api::WatchInstancesResponse {
        api::WatchInstancesResponse {
            version: Some(self.version),
            previous_version: None,
            snapshot: Some(true),
            changes: self
                .instances
                .values()
                .map(|(i, s)| change(i.clone(), *s))
                .collect(),
        }
    }

    /// The changes from `self` to `next`, or `None` when there are none.
    #[must_use]
    pub fn diff(&self, next: &View) -> Option<api::WatchInstancesResponse> {
        let mut changes = Vec::new();
        for (name, (i, s)) in &next.instances {
            if self.instances.get(name) != Some(&(i.clone(), *s)) {
                changes.push(change(i.clone(), *s));
            }
        }
        for name in self.instances.keys() {
            if !next.instances.contains_key(name) {
                let gone = api::Instance {
                    name: Some(name.clone()),
                    ..Default::default()
                };
                changes.push(change(gone, InstanceState::Removed));
            }
        }
        if changes.is_empty() {
            return None;
        }
        Some(api::WatchInstancesResponse {
            version: Some(next.version),
            previous_version: Some(self.version),
            snapshot: Some(false),
            changes,
        })
    }
}

fn change(instance: api::Instance, state: InstanceState) -> api::InstanceChange {
    api::InstanceChange {
        instance: Some(instance),
        state: Some(state as i32),
    }
}

/// Drain marks and who reported what, under one lock.
#[derive(Debug, Default)]
struct Marks {
    draining: HashSet<String>,
    /// Per subscribed stream: the draining instances it reported idle.
    idle: HashMap<u64, HashSet<String>>,
}

/// The instance feed of one function.
#[derive(Debug)]
pub struct Feed {
    id: FunctionId,
    view: watch::Sender<Arc<View>>,
    /// A std mutex: set updates only, never across an await.
    marks: Mutex<Marks>,
    /// Bumped when drain marks change (the feed task recomputes the view).
    marks_changed: watch::Sender<u64>,
    /// Bumped when a stream reports instances idle or leaves.
    reports: watch::Sender<u64>,
    next_stream: AtomicU64,
}

impl Feed {
    fn new(id: FunctionId) -> Self {
        Self {
            id,
            view: watch::channel(Arc::new(View::default())).0,
            marks: Mutex::default(),
            marks_changed: watch::channel(0).0,
            reports: watch::channel(0).0,
            next_stream: AtomicU64::new(1),
        }
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.marks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Recomputes the view from the pod cache; publishes a new version when
    /// it changed.
    fn refresh(&self, state: &State, f: &Function) {
        let Some((instances, _invalid)) = state.instances(f) else {
            return;
        };
        let ready: Vec<Instance> = instances.into_iter().filter(|i| i.ready_at.is_some()).collect();
        let draining = self.marks().draining.clone();
        self.view.send_if_modified(|current| {
            let next = View::of(current.version + 1, &ready, &draining);
            if next.instances == current.instances && current.version > 0 {
                return false;
            }
            *current = Arc::new(next);
            true
        });
    }

    /// Registers a stream; its reports are kept until the guard drops.
    fn join(self: &Arc<Self>) -> Subscription {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.marks().idle.insert(id, HashSet::new());
        Subscription {
            feed: self.clone(),
            id,
        }
    }

    fn report_idle(&self, stream: u64, names: Vec<String>) {
        {
            let mut m = self.marks();
            let Marks { draining, idle } = &mut *m;
            if let Some(set) = idle.get_mut(&stream) {
                set.extend(
                    names
                        .into_iter()
                        .take(MAX_IDLE_NAMES)
                        .filter(|n| draining.contains(n)),
                );
            }
        }
        self.reports.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Whether every subscribed stream reported all of `names` idle.
    fn all_idle(&self, names: &[String]) -> bool {
        self.marks()
            .idle
            .values()
            .all(|set| names.iter().all(|n| set.contains(n)))
    }

    fn set_draining(&self, names: &[String], on: bool) {
        {
            let mut m = self.marks();
            for n in names {
                if on {
                    m.draining.insert(n.clone());
                } else {
                    m.draining.remove(n);
                    for set in m.idle.values_mut() {
                        set.remove(n);
                    }
                }
            }
        }
        self.marks_changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Names currently marked draining.
    #[must_use]
    pub fn draining(&self) -> HashSet<String> {
        self.marks().draining.clone()
    }
}

/// A stream's membership in a feed.
#[derive(Debug)]
pub struct Subscription {
    feed: Arc<Feed>,
    id: u64,
}

impl Subscription {
    /// Records that this stream's router reports `names` idle (only the
    /// draining ones count).
    pub fn report_idle(&self, names: Vec<String>) {
        self.feed.report_idle(self.id, names);
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.feed.marks().idle.remove(&self.id);
        self.feed.reports.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Every feed of this controller.
#[derive(Debug)]
pub struct Feeds {
    map: scc::HashMap<FunctionId, Arc<Feed>>,
    /// Streams served or forwarded now.
    open: Arc<AtomicUsize>,
    limit: usize,
}

impl Default for Feeds {
    fn default() -> Self {
        Self::with_limit(MAX_STREAMS)
    }
}

/// One open stream counted against [`MAX_STREAMS`] until dropped.
#[derive(Debug)]
pub struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// No router watches the function.
    Unwatched,
    /// Every router watching reported the instances idle.
    Idle,
    /// The deadline passed first.
    TimedOut,
}

impl Feeds {
    /// No feed yet; at most `limit` streams at once.
    #[must_use]
    pub fn with_limit(limit: usize) -> Self {
        Self {
            map: scc::HashMap::new(),
            open: Arc::default(),
            limit,
        }
    }

    /// Counts one more open stream, unless the limit is reached.
    #[must_use]
    pub fn open_stream(&self) -> Option<StreamSlot> {
        let slot = StreamSlot(self.open.clone());
        (self.open.fetch_add(1, Ordering::Relaxed) < self.limit).then_some(slot)
    }

    /// Most streams open at once.
    #[must_use]
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Streams open now.
    #[must_use]
    pub fn open_streams(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// The feed of `id`, if the function is watched.
    #[must_use]
    pub fn get(&self, id: FunctionId) -> Option<Arc<Feed>> {
        self.map.read_sync(&id, |_, f| f.clone())
    }

    /// Instances of `id` marked draining.
    #[must_use]
    pub fn draining(&self, id: FunctionId) -> HashSet<String> {
        self.get(id).map(|f| f.draining()).unwrap_or_default()
    }

    /// A stream's membership in the feed of `f` and a receiver of its
    /// view, creating the feed (and its task, reading `state` until
    /// `shutdown`) when missing. Both are taken under the map entry, so a
    /// feed task retiring at the same moment cannot miss them.
    pub async fn subscribe(
        self: &Arc<Self>,
        state: &State,
        shutdown: &Shutdown,
        f: &Function,
    ) -> (Subscription, watch::Receiver<Arc<View>>) {
        let id = f.id();
        let (member, rx, fresh) = match self.map.entry_async(id).await {
            scc::hash_map::Entry::Occupied(o) => {
                let feed = o.get().clone();
                (feed.join(), feed.view.subscribe(), false)
            }
            scc::hash_map::Entry::Vacant(v) => {
                let feed = Arc::new(Feed::new(id));
                let joined = (feed.join(), feed.view.subscribe());
                v.insert_entry(feed);
                (joined.0, joined.1, true)
            }
        };
        if fresh {
            member.feed.refresh(state, f);
            shutdown.spawn(
                "instance-feed",
                run_feed(
                    self.clone(),
                    state.clone(),
                    member.feed.clone(),
                    f.clone(),
                    shutdown.token().clone(),
                ),
            );
        }
        (member, rx)
    }

    /// Removes `feed` if nobody watches it and nothing drains.
    async fn retire(&self, feed: &Arc<Feed>) -> bool {
        self.map
            .remove_if_async(&feed.id, |f| {
                Arc::ptr_eq(f, feed) && f.view.receiver_count() == 0 && f.marks().draining.is_empty()
            })
            .await
            .is_some()
    }

    /// Marks `names` draining, and waits until every router watching the
    /// function reported them idle or `deadline` passes. The marks stay
    /// until [`Feeds::undrain`].
    pub async fn drain(&self, id: FunctionId, names: &[String], deadline: Instant) -> Drained {
        let Some(feed) = self.get(id) else {
            return Drained::Unwatched;
        };
        if names.is_empty() {
            return Drained::Idle;
        }
        feed.set_draining(names, true);
        let mut reports = feed.reports.subscribe();
        loop {
            reports.mark_unchanged();
            if feed.all_idle(names) {
                return Drained::Idle;
            }
            tokio::select! {
                r = reports.changed() => if r.is_err() { return Drained::Idle },
                () = tokio::time::sleep_until(deadline) => return Drained::TimedOut,
            }
        }
    }

    /// Clears the drain marks of `names` (their pods are deleted, or the
    /// deletion failed and they serve on).
    pub fn undrain(&self, id: FunctionId, names: &[String]) {
        if let Some(feed) = self.get(id) {
            feed.set_draining(names, false);
        }
    }
}

/// Keeps a feed's view current until nobody watches it (and nothing
/// drains): wakes on the function's pod changes, on drain marks and when
/// the last stream leaves.
async fn run_feed(
    feeds: Arc<Feeds>,
    state: State,
    feed: Arc<Feed>,
    f: Function,
    stop: tokio_util::sync::CancellationToken,
) {
    let Some(ns) = state.namespace(&f.namespace) else {
        return;
    };
    let mut pods = ns.pods.watch_function(feed.id);
    let mut marks = feed.marks_changed.subscribe();
    loop {
        let watched = feed.view.receiver_count() > 0;
        if !watched && feeds.retire(&feed).await {
            return;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            r = pods.changed() => if r.is_err() { return },
            r = marks.changed() => if r.is_err() { return },
            () = feed.view.closed(), if watched => continue,
        }
        feed.refresh(&state, &f);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    fn inst(name: &str, port: u16) -> Instance {
        Instance {
            namespace: "ns".into(),
            name: name.into(),
            function: Arc::new(Function::default()),
            replica_set: "rs".into(),
            assigned_at: SystemTime::UNIX_EPOCH,
            ready_at: Some(SystemTime::UNIX_EPOCH),
            addr: format!("127.0.0.1:{port}"),
            cpu_milli: 7,
            memory_mib: 9,
            protocol: Default::default(),
            assign_timing: None,
        }
    }

    fn states(msg: &api::WatchInstancesResponse) -> Vec<(String, InstanceState)> {
        msg.changes
            .iter()
            .map(|c| {
                (
                    c.instance.as_ref().unwrap().name.clone().unwrap(),
                    InstanceState::try_from(c.state.unwrap()).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn views_diff_into_changes_that_name_their_base() {
        let none = HashSet::new();
        let v1 = View::of(1, &[inst("a", 1), inst("b", 2)], &none);
        let snap = v1.snapshot();
        assert_eq!(snap.snapshot, Some(true));
        assert_eq!(snap.previous_version, None);
        assert_eq!(
            states(&snap),
            [
                ("a".into(), InstanceState::Ready),
                ("b".into(), InstanceState::Ready)
            ]
        );
        assert_eq!(
            snap.changes[0].instance.as_ref().unwrap().cpu_usage_milli,
            None,
            "no usage figures"
        );

        let draining: HashSet<String> = ["a".to_owned()].into();
        let v2 = View::of(2, &[inst("a", 1), inst("c", 3)], &draining);
        let d = v1.diff(&v2).unwrap();
        assert_eq!(
            (d.previous_version, d.version, d.snapshot),
            (Some(1), Some(2), Some(false))
        );
        assert_eq!(
            states(&d),
            [
                ("a".into(), InstanceState::Draining),
                ("c".into(), InstanceState::Ready),
                ("b".into(), InstanceState::Removed),
            ]
        );
        assert!(
            v2.diff(&View::of(3, &[inst("a", 1), inst("c", 3)], &draining))
                .is_none()
        );
        // Usage figures alone are no change.
        let mut busy = inst("a", 1);
        busy.cpu_milli = 900;
        assert_eq!(
            View::of(5, &[busy], &none).instances,
            View::of(5, &[inst("a", 1)], &none).instances
        );
    }

    #[test]
    fn open_streams_are_bounded() {
        let feeds = Feeds::with_limit(2);
        let a = feeds.open_stream().unwrap();
        let b = feeds.open_stream().unwrap();
        assert!(feeds.open_stream().is_none());
        assert_eq!(feeds.open_streams(), 2, "a refused stream is not counted");
        drop(a);
        let c = feeds.open_stream().unwrap();
        drop((b, c));
        assert_eq!(feeds.open_streams(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn drains_wait_for_every_watching_stream() {
        let feeds = Feeds::default();
        let id = FunctionId(1);
        let names = vec!["a".to_owned()];
        assert_eq!(
            feeds
                .drain(id, &names, Instant::now() + Duration::from_secs(1))
                .await,
            Drained::Unwatched
        );
        let feed = Arc::new(Feed::new(id));
        let _ = feeds.map.insert_async(id, feed.clone()).await;
        let one = feed.join();
        let two = feed.join();
        let waiting = {
            let feed = feed.clone();
            tokio::spawn(async move {
                let feeds = Feeds::default();
                let _ = feeds.map.insert_async(id, feed).await;
                feeds
                    .drain(id, &["a".to_owned()], Instant::now() + Duration::from_secs(60))
                    .await
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(feed.draining(), ["a".to_owned()].into());
        feed.report_idle(one.id, vec!["a".into(), "not-draining".into()]);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the second stream has not reported");
        drop(two);
        assert_eq!(
            waiting.await.unwrap(),
            Drained::Idle,
            "a stream that left counts as done"
        );

        let three = feed.join();
        let r = feeds
            .drain(id, &["b".to_owned()], Instant::now() + Duration::from_secs(5))
            .await;
        assert_eq!(r, Drained::TimedOut);
        feeds.undrain(id, &["a".to_owned(), "b".to_owned()]);
        assert!(feed.draining().is_empty());
        drop((one, three));
    }
}
