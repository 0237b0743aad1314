//! [`PodCache`]: the controller's view of the function pods of one namespace.
//!
//! Fed by the pod watch and by the controller's own writes (a claimed pod is
//! visible at once, a deleted one disappears at once, an assignment is ready
//! in memory before its `skipper/ready-at` patch lands). Objects only move
//! forward: an update carrying an older `resourceVersion` than the cached one
//! is ignored. Two indexes keep reads cheap: assigned pods by function and
//! pool pods by deployment. Every change bumps a `watch` counter so a claim
//! waiting for a pool pod wakes on the event instead of polling; a change to
//! a function's pods also bumps that function's own counter
//! ([`PodCache::watch_function`]), so instance streams wake only for their
//! function.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;

use super::{label, pod_function};
use crate::domain::{ANNOTATION_READY_AT, Function, FunctionId, LABEL_DEPLOYMENT, LABEL_TENANT};

#[derive(Debug, Clone)]
struct Entry {
    pod: Arc<Pod>,
    rv: Option<u64>,
    /// The parsed, valid function annotation of an assigned pod.
    function: Option<Arc<Function>>,
}

#[derive(Debug, Default)]
struct Inner {
    pods: HashMap<String, Entry>,
    by_function: HashMap<FunctionId, HashSet<String>>,
    pool: HashMap<String, HashSet<String>>,
    relist: Option<Vec<Pod>>,
    /// Pods this controller deleted, with the last version it saw: a late
    /// watch event at or below that version must not bring them back.
    tombstones: HashMap<String, u64>,
    /// `skipper/ready-at` values this controller marked in memory whose
    /// patch has not yet come back: a newer version of the pod without the
    /// annotation keeps it (read your own writes), so an assignment never
    /// looks unready and a burst never claims a second pod for it.
    ready_marks: HashMap<String, String>,
}

/// Bound on remembered deletions (cleared wholesale beyond it; a relist
/// also clears them).
const MAX_TOMBSTONES: usize = 10_000;

/// What applying an object did (for informer metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Added,
    Updated,
    Ignored,
}

fn rv_of(pod: &Pod) -> Option<u64> {
    pod.metadata.resource_version.as_deref()?.parse().ok()
}

fn pool_key(pod: &Pod) -> Option<String> {
    if label(pod, LABEL_TENANT).is_some() {
        return None;
    }
    label(pod, LABEL_DEPLOYMENT).map(str::to_owned)
}

impl Entry {
    fn function_id(&self) -> Option<FunctionId> {
        self.function.as_ref().map(|f| f.id())
    }
}

impl Inner {
    fn unindex(&mut self, name: &str) -> Option<Entry> {
        let old = self.pods.remove(name)?;
        if let Some(f) = &old.function {
            let id = f.id();
            if let Some(set) = self.by_function.get_mut(&id) {
                set.remove(name);
                if set.is_empty() {
                    self.by_function.remove(&id);
                }
            }
        }
        if let Some(d) = pool_key(&old.pod)
            && let Some(set) = self.pool.get_mut(&d)
        {
            set.remove(name);
            if set.is_empty() {
                self.pool.remove(&d);
            }
        }
        Some(old)
    }

    /// Indexes `pod`; returns the function it is assigned to.
    fn index(&mut self, name: String, mut pod: Pod) -> Option<FunctionId> {
        if let Some(mark) = self.ready_marks.get(&name).cloned() {
            let assigned = label(&pod, LABEL_TENANT).is_some();
            let annotations = pod.metadata.annotations.get_or_insert_with(Default::default);
            if annotations.contains_key(ANNOTATION_READY_AT) || !assigned {
                // The write landed, or the pod is no longer assigned.
                self.ready_marks.remove(&name);
            } else {
                annotations.insert(ANNOTATION_READY_AT.to_owned(), mark);
            }
        }
        let function = if label(&pod, LABEL_TENANT).is_some() {
            pod_function(&pod).ok().map(Arc::new)
        } else {
            None
        };
        if let Some(f) = &function {
            self.by_function.entry(f.id()).or_default().insert(name.clone());
        }
        if let Some(d) = pool_key(&pod) {
            self.pool.entry(d).or_default().insert(name.clone());
        }
        let rv = rv_of(&pod);
        let id = function.as_ref().map(|f| f.id());
        self.pods.insert(
            name,
            Entry {
                pod: Arc::new(pod),
                rv,
                function,
            },
        );
        id
    }
}

/// The function pods of one namespace.
#[derive(Debug)]
pub struct PodCache {
    namespace: String,
    // A std lock: every critical section is a map update or copy, never an await.
    inner: RwLock<Inner>,
    changed: watch::Sender<u64>,
    synced: watch::Sender<bool>,
    /// Per-function change counters, for functions someone watches. A std
    /// mutex: lookups and bumps only, never across an await.
    functions: Mutex<HashMap<FunctionId, watch::Sender<u64>>>,
}

impl PodCache {
    /// An empty, not yet synced cache for `namespace`.
    #[must_use]
    pub fn new(namespace: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            inner: RwLock::default(),
            changed: watch::channel(0).0,
            synced: watch::channel(false).0,
            functions: Mutex::default(),
        }
    }

    /// The namespace this cache holds.
    #[must_use]
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn functions(&self) -> std::sync::MutexGuard<'_, HashMap<FunctionId, watch::Sender<u64>>> {
        self.functions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bumps the counters of `ids` (all of them with `None`), forgetting
    /// counters nobody watches any more.
    fn bump_functions(&self, ids: Option<&[FunctionId]>) {
        let mut map = self.functions();
        map.retain(|_, tx| tx.receiver_count() > 0);
        match ids {
            None => {
                for tx in map.values() {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            Some(ids) => {
                for id in ids {
                    if let Some(tx) = map.get(id) {
                        tx.send_modify(|n| *n = n.wrapping_add(1));
                    }
                }
            }
        }
    }

    /// A receiver notified whenever a pod of function `id` changes (is
    /// claimed, updated, marked ready or removed) and after every relist.
    #[must_use]
    pub fn watch_function(&self, id: FunctionId) -> watch::Receiver<u64> {
        self.functions()
            .entry(id)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// A receiver notified on every change.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Whether the first full list has been applied.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Resolves once the first full list has been applied.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Applies an object unless the cached one is newer. With `strict`, an
    /// object with the same `resourceVersion` is ignored too (it carries
    /// nothing new; the cached copy may hold an in-memory ready-at).
    pub fn apply(&self, pod: Pod, strict: bool) -> Applied {
        let Some(name) = pod.metadata.name.clone() else {
            return Applied::Ignored;
        };
        let new_rv = rv_of(&pod);
        let result = {
            let mut inner = self.write();
            if let Some(dead) = inner.tombstones.get(&name).copied() {
                if new_rv.is_some_and(|n| n <= dead) {
                    return Applied::Ignored;
                }
                inner.tombstones.remove(&name);
            }
            let existed = match inner.pods.get(&name) {
                Some(old) => {
                    if let (Some(o), Some(n)) = (old.rv, new_rv)
                        && (n < o || (strict && n == o))
                    {
                        return Applied::Ignored;
                    }
                    true
                }
                None => false,
            };
            let before = inner.unindex(&name).and_then(|e| e.function_id());
            let after = inner.index(name, pod);
            let touched = [before, after];
            (if existed { Applied::Updated } else { Applied::Added }, touched)
        };
        let (result, touched) = result;
        self.bump();
        self.bump_touched(&touched);
        result
    }

    fn bump_touched(&self, touched: &[Option<FunctionId>]) {
        let ids: Vec<FunctionId> = touched.iter().flatten().copied().collect();
        if !ids.is_empty() {
            self.bump_functions(Some(&ids));
        }
    }

    /// Removes a pod. Returns whether it was cached.
    pub fn remove(&self, name: &str) -> bool {
        let (removed, touched) = {
            let mut inner = self.write();
            inner.ready_marks.remove(name);
            let old = inner.unindex(name);
            if let Some(rv) = old.as_ref().and_then(|e| e.rv) {
                if inner.tombstones.len() >= MAX_TOMBSTONES {
                    inner.tombstones.clear();
                }
                inner.tombstones.insert(name.to_owned(), rv);
            }
            (old.is_some(), old.and_then(|e| e.function_id()))
        };
        if removed {
            self.bump();
            self.bump_touched(&[touched]);
        }
        removed
    }

    /// Starts a relist: objects arrive with [`PodCache::relist_apply`] and
    /// replace the contents at [`PodCache::relist_done`].
    pub fn relist_start(&self) {
        self.write().relist = Some(Vec::new());
    }

    /// One object of a relist.
    pub fn relist_apply(&self, pod: Pod) {
        if let Some(buf) = self.write().relist.as_mut() {
            buf.push(pod);
        }
    }

    /// Ends a relist: the listed objects replace the cache, and the cache
    /// counts as synced.
    pub fn relist_done(&self) {
        {
            let mut inner = self.write();
            let listed = inner.relist.take().unwrap_or_default();
            inner.tombstones.clear();
            let keep: HashSet<String> = listed.iter().filter_map(|p| p.metadata.name.clone()).collect();
            let stale: Vec<String> = inner
                .pods
                .keys()
                .filter(|n| !keep.contains(*n))
                .cloned()
                .collect();
            for n in stale {
                inner.unindex(&n);
                inner.ready_marks.remove(&n);
            }
            for pod in listed {
                let Some(name) = pod.metadata.name.clone() else {
                    continue;
                };
                let newer = match (inner.pods.get(&name).and_then(|e| e.rv), rv_of(&pod)) {
                    (Some(o), Some(n)) => n > o,
                    _ => true,
                };
                if newer {
                    inner.unindex(&name);
                    inner.index(name, pod);
                }
            }
        }
        self.synced.send_replace(true);
        self.bump();
        self.bump_functions(None);
    }

    /// Marks an assigned pod ready in memory (its ready-at patch is on the way).
    pub fn mark_ready(&self, name: &str, ready_at: &str) {
        let touched = {
            let mut inner = self.write();
            if !inner.pods.contains_key(name) {
                return;
            }
            inner.ready_marks.insert(name.to_owned(), ready_at.to_owned());
            let Some(entry) = inner.pods.get_mut(name) else {
                return;
            };
            let mut pod = (*entry.pod).clone();
            pod.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(ANNOTATION_READY_AT.to_owned(), ready_at.to_owned());
            entry.pod = Arc::new(pod);
            entry.function_id()
        };
        self.bump();
        self.bump_touched(&[touched]);
    }

    /// A cached pod.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<Arc<Pod>> {
        self.read().pods.get(name).map(|e| e.pod.clone())
    }

    /// Assigned pods of a function with their parsed function.
    #[must_use]
    pub fn of_function(&self, id: FunctionId) -> Vec<(Arc<Pod>, Arc<Function>)> {
        let inner = self.read();
        let Some(names) = inner.by_function.get(&id) else {
            return Vec::new();
        };
        names
            .iter()
            .filter_map(|n| inner.pods.get(n))
            .filter_map(|e| Some((e.pod.clone(), e.function.clone()?)))
            .collect()
    }

    /// Unassigned pods of a deployment (not filtered for readiness).
    #[must_use]
    pub fn pool(&self, deployment: &str) -> Vec<Arc<Pod>> {
        let inner = self.read();
        inner
            .pool
            .get(deployment)
            .map(|names| {
                names
                    .iter()
                    .filter_map(|n| inner.pods.get(n))
                    .map(|e| e.pod.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every pod carrying the tenant label, with its parsed function (`None`
    /// when the annotation is missing or invalid).
    #[must_use]
    pub fn assigned(&self) -> Vec<(Arc<Pod>, Option<Arc<Function>>)> {
        self.read()
            .pods
            .values()
            .filter(|e| label(&e.pod, LABEL_TENANT).is_some())
            .map(|e| (e.pod.clone(), e.function.clone()))
            .collect()
    }

    /// The `resourceVersion` of every cached pod, by name (the test
    /// harness's barrier compares them with what the API server lists).
    #[doc(hidden)]
    #[must_use]
    pub fn resource_versions(&self) -> HashMap<String, Option<u64>> {
        self.read().pods.iter().map(|(n, e)| (n.clone(), e.rv)).collect()
    }

    /// Number of cached pods.
    #[must_use]
    pub fn len(&self) -> usize {
        self.read().pods.len()
    }

    /// Whether the cache is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::ANNOTATION_FUNCTION;

    fn pod(name: &str, rv: u64, tenant: Option<&str>) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.resource_version = Some(rv.to_string());
        let mut labels = std::collections::BTreeMap::from([(LABEL_DEPLOYMENT.to_owned(), "dep".to_owned())]);
        if let Some(t) = tenant {
            labels.insert(LABEL_TENANT.into(), t.into());
            let f = format!(
                r#"{{"namespace":"ns","deployment":"dep","tenant":"{t}","scale":{{"max_instances":1}}}}"#
            );
            p.metadata.annotations = Some([(ANNOTATION_FUNCTION.to_owned(), f)].into());
        }
        p.metadata.labels = Some(labels);
        p
    }

    #[test]
    fn indexes_follow_claims_and_deletes() {
        let c = PodCache::new("ns");
        c.apply(pod("a", 1, None), true);
        c.apply(pod("b", 2, None), true);
        assert_eq!(c.pool("dep").len(), 2);
        c.apply(pod("a", 3, Some("t1")), false);
        assert_eq!(c.pool("dep").len(), 1);
        let id = FunctionId::of("ns", "dep", "t1", false);
        assert_eq!(c.of_function(id).len(), 1);
        assert_eq!(
            c.apply(pod("a", 1, None), true),
            Applied::Ignored,
            "older objects never win"
        );
        assert_eq!(c.of_function(id).len(), 1);
        assert!(c.remove("a"));
        assert!(c.of_function(id).is_empty());
        assert_eq!(
            c.apply(pod("a", 3, Some("t1")), true),
            Applied::Ignored,
            "a late event does not resurrect a deleted pod"
        );
        assert_eq!(c.apply(pod("a", 4, Some("t1")), true), Applied::Added);
    }

    #[test]
    fn same_version_keeps_in_memory_ready_at() {
        let c = PodCache::new("ns");
        c.apply(pod("a", 5, Some("t")), false);
        c.mark_ready("a", "2024-01-15T10:30:00Z");
        assert_eq!(c.apply(pod("a", 5, Some("t")), true), Applied::Ignored);
        let p = c.get("a").unwrap();
        assert!(super::super::annotation(&p, ANNOTATION_READY_AT).is_some());
    }

    #[test]
    fn function_watchers_wake_only_for_their_function() {
        let c = PodCache::new("ns");
        let t1 = FunctionId::of("ns", "dep", "t1", false);
        let mut w1 = c.watch_function(t1);
        let w2 = c.watch_function(FunctionId::of("ns", "dep", "t2", false));
        c.apply(pod("pool", 1, None), true);
        assert!(!w1.has_changed().unwrap(), "a pool pod is nobody's");
        c.apply(pod("pool", 2, Some("t1")), false);
        assert!(w1.has_changed().unwrap(), "claimed for t1");
        assert!(!w2.has_changed().unwrap());
        w1.mark_unchanged();
        c.mark_ready("pool", "2024-01-15T10:30:00Z");
        assert!(w1.has_changed().unwrap(), "marked ready");
        w1.mark_unchanged();
        c.remove("pool");
        assert!(w1.has_changed().unwrap(), "removed");
        w1.mark_unchanged();
        c.relist_start();
        c.relist_done();
        assert!(
            w1.has_changed().unwrap() && w2.has_changed().unwrap(),
            "a relist may change anything"
        );
        drop(w2);
        c.apply(pod("x", 9, Some("t2")), true);
        assert_eq!(c.functions().len(), 1, "unwatched counters are forgotten");
    }

    #[test]
    fn an_in_memory_ready_mark_survives_newer_watch_versions_until_the_patch_lands() {
        let c = PodCache::new("ns");
        c.apply(pod("a", 5, Some("t")), false);
        c.mark_ready("a", "2024-01-15T10:30:00Z");
        // The ReplicaSet releases the pod (a newer version without ready-at)
        // before the ready-at patch comes back.
        assert_eq!(c.apply(pod("a", 6, Some("t")), true), Applied::Updated);
        let p = c.get("a").unwrap();
        assert_eq!(
            super::super::annotation(&p, ANNOTATION_READY_AT),
            Some("2024-01-15T10:30:00Z"),
            "the assignment still reads as ready"
        );
        // The patch lands with its own value; the mark is dropped.
        let mut patched = pod("a", 7, Some("t"));
        patched
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ANNOTATION_READY_AT.into(), "2024-01-15T10:30:01Z".into());
        c.apply(patched, true);
        c.apply(pod("a", 8, Some("t")), true);
        let p = c.get("a").unwrap();
        assert_eq!(
            super::super::annotation(&p, ANNOTATION_READY_AT),
            None,
            "once persisted, the object is the truth"
        );
    }

    #[tokio::test]
    async fn changes_wake_subscribers_and_relist_replaces() {
        let c = PodCache::new("ns");
        let mut rx = c.subscribe();
        c.apply(pod("gone", 1, None), true);
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        c.relist_start();
        c.relist_apply(pod("x", 7, None));
        assert!(!c.is_synced());
        c.relist_done();
        assert!(c.is_synced());
        assert!(c.get("gone").is_none());
        assert!(c.get("x").is_some());
        assert!(rx.has_changed().unwrap());
        tokio::time::timeout(std::time::Duration::from_secs(1), c.wait_synced())
            .await
            .unwrap();
    }
}
