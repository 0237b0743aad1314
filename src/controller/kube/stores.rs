//! The controller's watches and start-up: the per-namespace probe
//! (`--skip-forbidden-namespaces`), function pods and ReplicaSets per managed
//! namespace, controller pods → ring membership, and pod metrics
//! (`metrics.k8s.io/v1beta1`). A function namespace is ready once its
//! watches have listed once and while the API server lets them run; one it
//! refuses (its Role is not there yet, or lacks a verb) is retried with
//! back-off and does not hold up the others.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use futures::{FutureExt as _, StreamExt};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::cache::{Applied, PodCache};
use super::pods::PodWriter;
use super::{Instance, InvalidPod, is_ready, is_running};
use crate::controller::metrics::Metrics;
use crate::domain::{Function, LABEL_DEPLOYMENT, LABEL_TENANT};
use crate::ring::{HashRing, RingHandle};
use crate::shutdown::Shutdown;
use crate::watch_access::Refusals;

/// Label selector of the controller pods that form the ring.
pub const CONTROLLER_SELECTOR: &str = "app.kubernetes.io/name=skipper,app.kubernetes.io/component=controller";

/// Start-up failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("failed to list pods in namespace {namespace}: {source}")]
    Probe {
        namespace: String,
        #[source]
        source: Box<kube::Error>,
    },
}

/// The ReplicaSets of one namespace: a reflector store its watch fills.
#[derive(Debug, Clone)]
pub struct ReplicaSets {
    store: Store<ReplicaSet>,
    namespace: String,
}

impl ReplicaSets {
    /// An empty store of `namespace`'s ReplicaSets and the writer its watch
    /// applies events with.
    #[must_use]
    pub fn new(namespace: &str) -> (Self, Writer<ReplicaSet>) {
        let (store, writer) = reflector::store();
        let namespace = namespace.to_owned();
        (Self { store, namespace }, writer)
    }

    /// A ReplicaSet by name.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<Arc<ReplicaSet>> {
        self.store.get(&ObjectRef::new(name).within(&self.namespace))
    }

    /// Whether some ReplicaSet's pods carry `skipper/deployment=deployment`.
    #[must_use]
    pub fn knows_deployment(&self, deployment: &str) -> bool {
        let labelled = |rs: &ReplicaSet| {
            let template = rs
                .spec
                .as_ref()
                .and_then(|s| s.template.as_ref())
                .and_then(|t| t.metadata.as_ref())
                .and_then(|m| m.labels.as_ref());
            [rs.metadata.labels.as_ref(), template]
                .into_iter()
                .flatten()
                .any(|l| l.get(LABEL_DEPLOYMENT).is_some_and(|d| d == deployment))
        };
        self.store.find(labelled).is_some()
    }

    /// The newest ReplicaSet with replicas owned by Deployment `deployment`.
    #[must_use]
    pub fn active_for(&self, deployment: &str) -> Option<String> {
        self.store
            .state_filter(|rs| {
                rs.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.kind == "Deployment" && o.name == deployment)
                    && rs.status.as_ref().is_some_and(|s| s.replicas > 0)
            })
            .into_iter()
            .max_by_key(|rs| rs.metadata.creation_timestamp.as_ref().map(|t| t.0))
            .and_then(|rs| rs.metadata.name.clone())
    }

    /// Whether the first list has been applied.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        store_ready(&self.store)
    }

    /// The store itself (the test harness's barrier reads its versions).
    #[doc(hidden)]
    #[must_use]
    pub fn store(&self) -> &Store<ReplicaSet> {
        &self.store
    }

    /// Resolves once the first list has been applied (or the watch ended).
    pub async fn wait_synced(&self) {
        let _ = self.store.wait_until_ready().await;
    }
}

/// Whether a reflector store has applied its first list.
fn store_ready<K>(store: &Store<K>) -> bool
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// A managed function namespace.
#[derive(Debug, Clone)]
pub struct Namespace {
    pub pods: Arc<PodCache>,
    pub writer: PodWriter,
    pub replica_sets: Arc<ReplicaSets>,
}

impl Namespace {
    /// Whether both watches have listed once.
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.pods.is_synced() && self.replica_sets.is_synced()
    }

    async fn wait_synced(&self) {
        self.pods.wait_synced().await;
        self.replica_sets.wait_synced().await;
    }
}

/// What the watches of function namespace `ns` are called in [`Refusals`].
fn namespace_watches(ns: &str) -> [String; 2] {
    [
        format!("pods in namespace {ns}"),
        format!("replicasets in namespace {ns}"),
    ]
}

/// CPU (millicores) and memory (MiB) of assigned pods, by `namespace/name`.
#[derive(Debug, Default)]
pub struct Usage {
    // A std lock: replaced wholesale per namespace, read per instance; no awaits.
    by_pod: RwLock<HashMap<String, (u32, u32)>>,
}

impl Usage {
    /// Usage of a pod, `(0, 0)` when unknown.
    #[must_use]
    pub fn get(&self, namespace: &str, name: &str) -> (u32, u32) {
        self.by_pod
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&format!("{namespace}/{name}"))
            .copied()
            .unwrap_or_default()
    }

    fn replace_namespace(
        &self,
        namespace: &str,
        values: HashMap<String, (u32, u32)>,
        alive: impl Fn(&str) -> bool,
    ) {
        let mut map = self
            .by_pod
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let prefix = format!("{namespace}/");
        map.retain(|k, _| !k.starts_with(&prefix) || alive(&k[prefix.len()..]));
        for (name, v) in values {
            map.insert(format!("{prefix}{name}"), v);
        }
    }
}

/// A function's running instances, and its running pods that cannot be
/// read as instances (by name, with why).
pub type Instances = (Vec<Instance>, Vec<(String, InvalidPod)>);

/// Everything the controller reads from Kubernetes.
#[derive(Debug, Clone)]
pub struct State {
    pub namespaces: Arc<BTreeMap<String, Namespace>>,
    pub usage: Arc<Usage>,
    /// The watches the API server refuses (their caches stand still).
    pub refusals: Refusals,
    /// The controller pods the ring is made of (none with
    /// `--single-controller-mode`).
    pub controller_pods: Option<Store<Pod>>,
    /// Bumped by every watch once it applied an event to its cache.
    applied: Arc<watch::Sender<u64>>,
}

impl State {
    /// Woken each time a watch has applied an event to its cache (function
    /// pods, ReplicaSets, controller pods). The test harness's barrier waits
    /// on it until the caches hold what the API server lists; the
    /// controller itself never reads it.
    #[doc(hidden)]
    #[must_use]
    pub fn applied(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// A managed namespace.
    #[must_use]
    pub fn namespace(&self, ns: &str) -> Option<&Namespace> {
        self.namespaces.get(ns)
    }

    /// The running instances of `f` from the pod cache with their usage
    /// (spec §4.3); `None` when `f`'s namespace is not managed.
    #[must_use]
    pub fn instances(&self, f: &Function) -> Option<Instances> {
        let ns = self.namespace(&f.namespace)?;
        let mut instances = Vec::new();
        let mut invalid = Vec::new();
        for (pod, function) in ns.pods.of_function(f.id()) {
            if !is_running(&pod) {
                continue;
            }
            match Instance::from_pod(&pod, function) {
                Ok(mut i) => {
                    (i.cpu_milli, i.memory_mib) = self.usage.get(&i.namespace, &i.name);
                    instances.push(i);
                }
                Err(e) => invalid.push((pod.metadata.name.clone().unwrap_or_default(), e)),
            }
        }
        Some((instances, invalid))
    }

    /// Whether the ring's watch has listed once and every function
    /// namespace has listed once or is refused (see [`State::not_ready`]).
    #[must_use]
    pub fn is_synced(&self) -> bool {
        self.controller_pods.as_ref().is_none_or(store_ready) && self.settled()
    }

    fn settled(&self) -> bool {
        let refused = self.refusals.current();
        self.namespaces
            .iter()
            .all(|(name, n)| n.is_synced() || namespace_watches(name).iter().any(|w| refused.contains_key(w)))
    }

    /// Resolves once [`State::is_synced`] holds.
    pub async fn wait_synced(&self) {
        if let Some(pods) = &self.controller_pods {
            let _ = pods.wait_until_ready().await;
        }
        let mut refused = self.refusals.subscribe();
        while !self.settled() {
            let unsynced: Vec<_> = self
                .namespaces
                .values()
                .filter(|n| !n.is_synced())
                .map(|n| Box::pin(n.wait_synced()))
                .collect();
            if unsynced.is_empty() {
                // The last one listed since `settled` looked.
                continue;
            }
            tokio::select! {
                _ = futures::future::select_all(unsynced) => {}
                r = refused.changed() => if r.is_err() { return },
            }
        }
    }

    /// Why function namespace `ns` cannot be served now: its watches have not
    /// listed yet, or the API server refuses one (which permission is
    /// missing). `None` when it is ready or not managed here.
    #[must_use]
    pub fn not_ready(&self, ns: &str) -> Option<String> {
        let n = self.namespaces.get(ns)?;
        let refused = self.refusals.current();
        let mine: BTreeMap<String, crate::watch_access::Refusal> = namespace_watches(ns)
            .into_iter()
            .filter_map(|w| refused.get(&w).map(|r| (w, r.clone())))
            .collect();
        if !mine.is_empty() {
            Some(Refusals::describe(&mine))
        } else if !n.is_synced() {
            Some(format!("the watches of namespace {ns} have not listed yet"))
        } else {
            None
        }
    }

    /// The refused watches that are not a function namespace's (the ring's).
    #[must_use]
    pub fn ring_refusals(&self) -> BTreeMap<String, crate::watch_access::Refusal> {
        let mut refused = self.refusals.current();
        for ns in self.namespaces.keys() {
            for w in namespace_watches(ns) {
                refused.remove(&w);
            }
        }
        refused
    }

    /// Resolves at the next change of a namespace's readiness: a refusal
    /// appears or clears, or a namespace lists for the first time.
    pub async fn readiness_changed(
        &self,
        refused: &mut watch::Receiver<BTreeMap<String, crate::watch_access::Refusal>>,
    ) {
        let unsynced: Vec<_> = self
            .namespaces
            .values()
            .filter(|n| !n.is_synced())
            .map(|n| Box::pin(n.wait_synced()))
            .collect();
        if unsynced.is_empty() {
            let _ = refused.changed().await;
            return;
        }
        tokio::select! {
            _ = futures::future::select_all(unsynced) => {}
            _ = refused.changed() => {}
        }
    }
}

fn lag_since(t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Option<f64> {
    let t = SystemTime::from(t?.0);
    Some(
        SystemTime::now()
            .duration_since(t)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
    )
}

/// Runs one watch until `token` fires, handing each event to `on` and then
/// bumping `applied`.
async fn run_watch<K, F>(
    api: Api<K>,
    config: watcher::Config,
    token: CancellationToken,
    (resource, applied): (&'static str, Arc<watch::Sender<u64>>),
    mut on: F,
) where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: FnMut(Event<K>) + Send,
{
    let mut stream = std::pin::pin!(watcher::watcher(api, config).default_backoff());
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            next = stream.next() => match next {
                None => return,
                Some(Ok(ev)) => {
                    on(ev);
                    applied.send_modify(|n| *n = n.wrapping_add(1));
                }
                Some(Err(e)) => {
                    if matches!(&e, watcher::Error::WatchError(s) if s.code == 410) {
                        tracing::debug!(watch_resource = resource, error = %e, "informer watch error");
                    } else {
                        tracing::warn!(watch_resource = resource, error = %e, "informer watch error");
                    }
                }
            }
        }
    }
}

fn handle_pod_event(cache: &PodCache, metrics: &Metrics, ev: Event<Pod>) {
    match ev {
        Event::Apply(pod) => {
            let lag = lag_since(pod.metadata.creation_timestamp.as_ref());
            match cache.apply(pod, true) {
                Applied::Added => metrics.informer_event("pods", "add", lag),
                Applied::Updated | Applied::Ignored => metrics.informer_event("pods", "update", None),
            }
        }
        Event::Delete(pod) => {
            metrics.informer_event(
                "pods",
                "delete",
                lag_since(pod.metadata.deletion_timestamp.as_ref()),
            );
            if let Some(n) = pod.metadata.name.as_deref() {
                cache.remove(n);
            }
        }
        Event::Init => cache.relist_start(),
        Event::InitApply(pod) => cache.relist_apply(pod),
        Event::InitDone => cache.relist_done(),
    }
}

/// Keeps the store of controller pods and publishes the ring their Ready
/// ones form.
#[derive(Debug)]
struct Membership {
    writer: Writer<Pod>,
    ring: RingHandle,
}

impl Membership {
    /// An empty membership publishing into `ring`, and the store it fills.
    fn new(ring: RingHandle) -> (Self, Store<Pod>) {
        let (store, writer) = reflector::store();
        (Self { writer, ring }, store)
    }

    fn member(pod: &Pod) -> Option<String> {
        let ip = pod.status.as_ref()?.pod_ip.clone().filter(|ip| !ip.is_empty())?;
        is_ready(pod).then_some(ip)
    }

    /// Applies `ev` and publishes the ring once the store holds a whole
    /// list (not while a relist is under way).
    fn handle(&mut self, ev: &Event<Pod>) {
        self.writer.apply_watcher_event(ev);
        if let Event::Init | Event::InitApply(_) = ev {
            return;
        }
        let mut ips: Vec<String> = self
            .writer
            .as_reader()
            .state()
            .iter()
            .filter_map(|p| Self::member(p))
            .collect();
        ips.sort();
        ips.dedup();
        self.ring.publish(HashRing::new(ips.iter().map(String::as_str)));
    }
}

/// Parses a Kubernetes quantity into base units (cores, bytes).
#[must_use]
pub fn parse_quantity(q: &str) -> Option<f64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let n: f64 = num.parse().ok()?;
    let mult = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0_f64.powi(4),
        s if s.starts_with('e') || s.starts_with('E') => 10f64.powi(s[1..].parse().ok()?),
        _ => return None,
    };
    Some(n * mult)
}

/// `(cpu millicores, memory MiB)` of one PodMetrics object: summed over
/// containers, memory floored per container.
#[must_use]
pub fn pod_usage(obj: &serde_json::Value) -> (u32, u32) {
    let mut cpu = 0u32;
    let mut mem = 0u32;
    for c in obj["containers"].as_array().into_iter().flatten() {
        let usage = &c["usage"];
        // Saturating float-to-int conversions: usage figures are small and non-negative.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        if let Some(v) = usage["cpu"].as_str().and_then(parse_quantity) {
            cpu = cpu.saturating_add((v * 1000.0).round() as u32);
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        if let Some(v) = usage["memory"].as_str().and_then(parse_quantity) {
            mem = mem.saturating_add((v / 1024.0 / 1024.0).floor() as u32);
        }
    }
    (cpu, mem)
}

async fn refresh_usage(
    client: &kube::Client,
    ns: &Namespace,
    usage: &Usage,
    namespace: &str,
) -> Result<(), kube::Error> {
    let gvk = GroupVersionKind::gvk("metrics.k8s.io", "v1beta1", "PodMetrics");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "pods");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let mut values = HashMap::new();
    let mut lp = ListParams::default().labels(LABEL_TENANT).limit(100);
    loop {
        let list = api.list(&lp).await?;
        for obj in &list.items {
            if let Some(name) = obj.metadata.name.clone() {
                values.insert(name, pod_usage(&obj.data));
            }
        }
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    usage.replace_namespace(namespace, values, |name| ns.pods.get(name).is_some());
    Ok(())
}

/// Starts every watch and the pod-metrics refresh, and returns the state
/// they fill. Does not wait for the first lists (see [`State::wait_synced`]).
/// With `skip_forbidden`, a function namespace whose pods cannot be listed
/// at start-up is left out (as the Go implementation does); without it, the
/// namespace's watches retry with back-off until the API server lets them
/// run, and [`State::not_ready`] says what is missing meanwhile.
///
/// # Errors
/// [`StartError::Probe`] when `skip_forbidden` is set and the probe fails
/// for another reason than Forbidden.
#[allow(clippy::too_many_arguments)]
pub async fn start(
    client: &kube::Client,
    function_namespaces: &[String],
    skip_forbidden: bool,
    controller_namespace: &str,
    single_controller_ip: Option<&str>,
    ring: &RingHandle,
    metrics: &Metrics,
    scale_interval: Duration,
    shutdown: &Shutdown,
) -> Result<State, StartError> {
    let mut namespaces = BTreeMap::new();
    let refusals = Refusals::new();
    let applied = Arc::new(watch::channel(0).0);
    for ns in function_namespaces {
        if skip_forbidden {
            let probe: Api<Pod> = Api::namespaced(client.clone(), ns);
            match probe.list(&ListParams::default().limit(1)).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    tracing::warn!(namespace = %ns, "skipping namespace: listing pods is forbidden");
                    continue;
                }
                Err(e) => {
                    return Err(StartError::Probe {
                        namespace: ns.clone(),
                        source: Box::new(e),
                    });
                }
            }
        }
        let [pods_watch, replica_sets_watch] = namespace_watches(ns);
        let cache = Arc::new(PodCache::new(ns));
        let (replica_sets, mut rs_writer) = ReplicaSets::new(ns);
        let replica_sets = Arc::new(replica_sets);
        let config = watcher::Config::default().labels(LABEL_DEPLOYMENT);
        {
            let cache = cache.clone();
            let metrics = metrics.clone();
            shutdown.spawn(
                "watch-pods",
                run_watch(
                    Api::namespaced(refusals.client(client, pods_watch), ns),
                    config.clone(),
                    shutdown.token().clone(),
                    ("pods", applied.clone()),
                    move |ev| {
                        handle_pod_event(&cache, &metrics, ev);
                    },
                ),
            );
        }
        {
            let rs_api: Api<ReplicaSet> = Api::namespaced(refusals.client(client, replica_sets_watch), ns);
            let metrics = metrics.clone();
            shutdown.spawn(
                "watch-replicasets",
                run_watch(
                    rs_api,
                    config,
                    shutdown.token().clone(),
                    ("replicasets", applied.clone()),
                    move |ev| {
                        let kind = match &ev {
                            Event::Apply(_) => Some("update"),
                            Event::Delete(_) => Some("delete"),
                            _ => None,
                        };
                        if let Some(k) = kind {
                            metrics.informer_event("replicasets", k, None);
                        }
                        rs_writer.apply_watcher_event(&ev);
                    },
                ),
            );
        }
        let writer = PodWriter::new(client.clone(), cache.clone());
        namespaces.insert(
            ns.clone(),
            Namespace {
                pods: cache,
                writer,
                replica_sets,
            },
        );
    }

    let controller_pods = if let Some(ip) = single_controller_ip {
        ring.publish(HashRing::new([ip]));
        None
    } else {
        let api: Api<Pod> = Api::namespaced(
            refusals.client(
                client,
                format!("controller pods in namespace {controller_namespace}"),
            ),
            controller_namespace,
        );
        let (mut membership, store) = Membership::new(ring.clone());
        let metrics = metrics.clone();
        shutdown.spawn(
            "watch-controller-pods",
            run_watch(
                api,
                watcher::Config::default().labels(CONTROLLER_SELECTOR),
                shutdown.token().clone(),
                ("controller_pods", applied.clone()),
                move |ev| {
                    if let Event::Apply(_) | Event::Delete(_) = &ev {
                        metrics.informer_event("controller_pods", "update", None);
                    }
                    membership.handle(&ev);
                },
            ),
        );
        Some(store)
    };

    let state = State {
        namespaces: Arc::new(namespaces),
        usage: Arc::new(Usage::default()),
        refusals,
        controller_pods,
        applied,
    };
    {
        let state = state.clone();
        let client = client.clone();
        let token = shutdown.token().clone();
        shutdown.spawn("refresh-pod-metrics", async move {
            let mut ticker = tokio::time::interval(scale_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                for (name, ns) in state.namespaces.iter() {
                    if let Err(e) = refresh_usage(&client, ns, &state.usage, name).await {
                        tracing::warn!(namespace = %name, error = %e, "failed to get pod metrics");
                    }
                }
            }
        });
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    fn controller_pod(name: &str, ip: &str, ready: bool, terminating: bool) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        if terminating {
            p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                jiff::Timestamp::now(),
            ));
        }
        p.status = Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        p
    }

    #[test]
    fn ring_follows_ready_controller_pods() {
        let ring = RingHandle::default();
        let (mut m, store) = Membership::new(ring.clone());
        m.handle(&Event::Init);
        m.handle(&Event::InitApply(controller_pod("a", "10.0.0.1", true, false)));
        m.handle(&Event::InitApply(controller_pod("b", "10.0.0.2", false, false)));
        assert!(!store_ready(&store));
        assert!(
            ring.current().is_empty(),
            "nothing is published before the list is whole"
        );
        m.handle(&Event::InitDone);
        assert!(store_ready(&store));
        assert_eq!(ring.current().sorted_members().len(), 1);
        m.handle(&Event::Apply(controller_pod("b", "10.0.0.2", true, false)));
        assert_eq!(ring.current().sorted_members().len(), 2);
        m.handle(&Event::Apply(controller_pod("a", "10.0.0.1", true, true)));
        assert_eq!(
            &*ring.current().sorted_members()[0],
            "10.0.0.2",
            "terminating controller leaves at once"
        );
        m.handle(&Event::Delete(controller_pod("b", "10.0.0.2", true, false)));
        assert!(ring.current().is_empty());
        // A relist replaces the members only once it is whole.
        m.handle(&Event::Init);
        m.handle(&Event::InitApply(controller_pod("c", "10.0.0.3", true, false)));
        assert!(ring.current().is_empty());
        m.handle(&Event::InitDone);
        assert_eq!(&*ring.current().sorted_members()[0], "10.0.0.3");
    }

    #[test]
    fn quantities_and_usage() {
        assert_eq!(parse_quantity("250m"), Some(0.25));
        assert_eq!(parse_quantity("1"), Some(1.0));
        assert!((parse_quantity("1500000n").unwrap() - 0.0015).abs() < 1e-12);
        assert_eq!(parse_quantity("64Mi"), Some(64.0 * 1024.0 * 1024.0));
        assert_eq!(parse_quantity("lots"), None);
        let obj = serde_json::json!({"containers": [
            {"name": "a", "usage": {"cpu": "250m", "memory": "10Mi"}},
            {"name": "b", "usage": {"cpu": "125000000n", "memory": "1572864"}},
        ]});
        assert_eq!(pod_usage(&obj), (375, 11));
    }
}
