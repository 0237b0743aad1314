//! Test harness for the controller: a cluster (the simulator, or the real
//! control plane with our node agent when `SKIPPER_TEST_CONTROL_PLANE=real`)
//! with a fixture pool (real `skipper fixture` processes), in-process
//! controllers, and helpers that await conditions with a deadline. Pod state
//! is read through the Kubernetes API only; what only a node can see (a
//! pod's files, its process) goes through [`Backend`].
//!
//! One barrier, [`caught_up`], stands between a test's writes and what the
//! controllers answer from their caches: it lists what the controllers
//! watch from the API server and waits, woken by each event a cache applies
//! (never polling the caches), until every controller's caches hold each
//! object at least at its listed `resourceVersion` and no longer hold the
//! deleted ones. [`Ctl::start`] and every write helper of [`Sim`] end with
//! it ([`Sim::caught_up`] covers each controller the harness started), so a
//! test does not wait for its own writes to reach the informers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::Store;
use serde_json::json;
use skipper::api;
use skipper::api::controller_service_client::ControllerServiceClient;
use skipper::controller::core::Core;
use skipper::controller::kube::stores::Namespace;
use skipper::controller::{Config, RunError};
use skipper::domain::{Function, Scale};
use skipper::shutdown::Shutdown;
use skipper::token::{SigningKey, VerifyingKey};
use skipper_devcluster::{Cluster, pool_deployment_json};
use tokio::net::TcpListener;
use tonic::transport::Channel;

use crate::backend::Backend;
pub use crate::eventually;

/// Function namespace of the tests.
pub const NS: &str = "fns";
/// Namespace of the controller pods.
pub const CTL_NS: &str = "skipper";
/// Every namespace the tests use.
pub const NAMESPACES: [&str; 5] = [NS, CTL_NS, "ring-a", "ring-b", "other"];

/// The backend of a [`Sim`]: its own, or one a `differential!` scenario
/// lends it.
pub enum Held<'a> {
    Owned(Backend),
    Lent(&'a Backend),
}

impl std::ops::Deref for Held<'_> {
    type Target = Backend;
    fn deref(&self) -> &Backend {
        match self {
            Self::Owned(b) => b,
            Self::Lent(b) => b,
        }
    }
}

/// A cluster, an administrator's client and the signing key its pool trusts.
pub struct Sim<'a> {
    pub backend: Held<'a>,
    pub client: kube::Client,
    pub key: SigningKey,
    pub public_pem: String,
    /// The controllers [`Ctl::start`] ran on this cluster (the barrier's).
    controllers: Mutex<Vec<Weak<Core>>>,
}

/// Whether a pod is Ready (its `Ready` condition is `True`) and not being
/// deleted.
pub fn pod_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A pod's name.
pub fn name_of(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

impl Sim<'static> {
    /// Starts the backend `SKIPPER_TEST_CONTROL_PLANE` names with the
    /// function and controller namespaces.
    pub async fn start() -> Self {
        let backend = Backend::from_env_with_pods(&NAMESPACES)
            .await
            .expect("a backend (the real control plane is demanded, so a missing build fails)");
        Self::with(Held::Owned(backend)).await
    }

    /// [`Sim::start`] with the pool `name` of `replicas` pods deployed, every
    /// one of them Ready (within 60 s).
    pub async fn with_pool(name: &str, replicas: usize) -> Self {
        let sim = Self::start().await;
        sim.deploy_pool(name, i32::try_from(replicas).unwrap(), &[]).await;
        sim.wait_pool(name, replicas, Duration::from_secs(60)).await;
        sim
    }

    /// [`Sim::start`] on the simulator only, for a scenario that needs its
    /// fault injection: `None`, with a message naming `why`, when the real
    /// control plane was asked for.
    pub async fn simulator_only(why: &str) -> Option<Self> {
        if crate::backend::real_requested() {
            eprintln!("skipped on the real control plane: {why}");
            return None;
        }
        Some(Self::start().await)
    }
}

impl<'a> Sim<'a> {
    /// A harness over `backend` (of a `differential!` scenario), which must
    /// have the namespaces of [`NAMESPACES`].
    pub async fn lent(backend: &'a Backend) -> Self {
        Self::with(Held::Lent(backend)).await
    }

    async fn with(backend: Held<'a>) -> Self {
        let client = backend.client().await;
        let key = SigningKey::generate();
        let public_pem = key.verifying_key().to_pem();
        Self {
            backend,
            client,
            key,
            public_pem,
            controllers: Mutex::default(),
        }
    }

    /// [`caught_up`] for every controller started on this cluster that
    /// still runs.
    pub async fn caught_up(&self) {
        let cores: Vec<Arc<Core>> = {
            let mut list = self.controllers.lock().unwrap();
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for core in cores {
            if !core.shutdown.is_shutting_down() {
                caught_up(&self.client, &core).await;
            }
        }
    }

    /// The simulator (for a scenario that needs its fault injection).
    ///
    /// # Panics
    /// On the real control plane: start such a test with
    /// [`Sim::simulator_only`].
    pub fn cluster(&self) -> &Cluster {
        match &*self.backend {
            Backend::Sim(c) => c,
            Backend::Real(_) | Backend::Cluster(_) => {
                panic!("a simulator-only scenario runs on the real control plane")
            }
        }
    }

    /// Stops the backend when it is this harness's own.
    pub async fn shutdown(self) {
        if let Held::Owned(b) = self.backend {
            b.shutdown().await;
        }
    }

    /// Creates a pool Deployment with extra fixture environment.
    pub async fn deploy_pool(&self, name: &str, replicas: i32, env: &[(&str, &str)]) {
        self.deploy_pool_with(name, replicas, |d| {
            let list = d["spec"]["template"]["spec"]["containers"][0]["env"]
                .as_array_mut()
                .unwrap();
            for (k, v) in env {
                list.push(json!({"name": k, "value": v}));
            }
        })
        .await;
    }

    /// [`Sim::deploy_pool`] of the Deployment JSON as `tweak` leaves it.
    pub async fn deploy_pool_with(
        &self,
        name: &str,
        replicas: i32,
        tweak: impl FnOnce(&mut serde_json::Value),
    ) {
        let mut d = pool_deployment_json(NS, name, replicas, &self.public_pem);
        tweak(&mut d);
        let d: Deployment = serde_json::from_value(d).unwrap();
        Api::<Deployment>::namespaced(self.client.clone(), NS)
            .create(&PostParams::default(), &d)
            .await
            .unwrap();
        // Its ReplicaSet is what tells a controller that the pool exists.
        let sets = Api::<ReplicaSet>::namespaced(self.client.clone(), NS);
        let selector = format!("{}={name}", skipper::domain::LABEL_DEPLOYMENT);
        eventually("the pool's ReplicaSet", Duration::from_secs(30), || async {
            let list = sets.list(&ListParams::default().labels(&selector)).await.ok()?;
            (!list.items.is_empty()).then_some(())
        })
        .await;
        self.caught_up().await;
    }

    /// Merge-patches Deployment `name` of [`NS`].
    pub async fn patch_pool(&self, name: &str, patch: serde_json::Value) {
        Api::<Deployment>::namespaced(self.client.clone(), NS)
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
        self.caught_up().await;
    }

    /// Sets a Deployment's replica count.
    pub async fn scale_pool(&self, name: &str, replicas: i32) {
        self.patch_pool(name, json!({"spec": {"replicas": replicas}}))
            .await;
    }

    /// Ready pods of `ns` matching `selector` (through the API).
    pub async fn ready_pods(&self, ns: &str, selector: &str) -> Vec<Pod> {
        Api::<Pod>::namespaced(self.client.clone(), ns)
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(pod_ready)
            .collect()
    }

    /// Names of Ready, unassigned pool pods of a deployment.
    pub async fn free_pods(&self, deployment: &str) -> Vec<String> {
        self.ready_pods(NS, &format!("skipper/deployment={deployment},!skipper/tenant"))
            .await
            .iter()
            .map(name_of)
            .collect()
    }

    /// Waits until `n` pool pods are Ready, and the controllers' caches
    /// have them.
    pub async fn wait_pool(&self, deployment: &str, n: usize, limit: Duration) {
        eventually("pool pods to be Ready", limit, || async {
            (self.free_pods(deployment).await.len() >= n).then_some(())
        })
        .await;
        self.caught_up().await;
    }

    /// A pod, if it exists and is not being deleted.
    pub async fn live_pod(&self, name: &str) -> Option<Pod> {
        let pod = Api::<Pod>::namespaced(self.client.clone(), NS)
            .get_opt(name)
            .await
            .unwrap()?;
        pod.metadata.deletion_timestamp.is_none().then_some(pod)
    }

    /// Live pods assigned to `tenant`.
    pub async fn tenant_pods(&self, tenant: &str) -> Vec<Pod> {
        Api::<Pod>::namespaced(self.client.clone(), NS)
            .list(&ListParams::default().labels(&format!("skipper/tenant={tenant}")))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect()
    }

    /// Deletes a pod.
    pub async fn delete_pod(&self, ns: &str, name: &str) {
        let _ = Api::<Pod>::namespaced(self.client.clone(), ns)
            .delete(name, &DeleteParams::default())
            .await;
        self.caught_up().await;
    }

    /// The token a fixture pod accepted, if any.
    pub fn token_of(&self, pod: &str) -> Option<String> {
        // The pool keeps /tmp (where the fixture writes it) in an emptyDir.
        let dir = self.backend.pod_dir(NS, pod)?;
        std::fs::read_to_string(dir.join("volumes/tmp/token")).ok()
    }

    /// The public key pods verify with.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    /// A pod that stands in for a controller replica: Ready at once, no
    /// ports, labelled as a controller. Returns its IP once the running
    /// controllers' rings may have it.
    pub async fn controller_pod(&self, ns: &str, name: &str) -> String {
        let ip = self.stand_in(ns, name).await;
        self.caught_up().await;
        ip
    }

    async fn stand_in(&self, ns: &str, name: &str) -> String {
        if matches!(&*self.backend, Backend::Sim(_)) {
            return self.agent_controller_pod(ns, name).await;
        }
        // On the real control plane a pod's IP belongs to its network
        // namespace, where this process cannot listen. The stand-in is bound
        // to a node no agent serves, and its status — Ready on a loopback
        // address this process listens on — is written as a kubelet would
        // report it.
        static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(1);
        let ip = format!(
            "127.0.64.{}",
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {
                "app.kubernetes.io/name": "skipper", "app.kubernetes.io/component": "controller"}},
            "spec": {"terminationGracePeriodSeconds": 0, "nodeName": "controller-stand-ins",
                     "containers": [{"name": "c", "image": "x", "command": ["sleep", "3600"]}]},
        }))
        .unwrap();
        let api = Api::<Pod>::namespaced(self.client.clone(), ns);
        api.create(&PostParams::default(), &pod).await.unwrap();
        let now = jiff::Timestamp::now().to_string();
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                               {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}],
            }})),
        )
        .await
        .unwrap();
        ip
    }

    /// A controller stand-in run by the simulator's agent (it has a
    /// loopback IP of its own).
    async fn agent_controller_pod(&self, ns: &str, name: &str) -> String {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {
                "app.kubernetes.io/name": "skipper", "app.kubernetes.io/component": "controller"}},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "x", "command": ["sleep", "3600"]}]},
        }))
        .unwrap();
        let api = Api::<Pod>::namespaced(self.client.clone(), ns);
        api.create(&PostParams::default(), &pod).await.unwrap();
        eventually("controller pod to be Ready", Duration::from_secs(30), || async {
            let pod = api.get(name).await.unwrap();
            pod_ready(&pod).then_some(())?;
            pod.status?.pod_ip
        })
        .await
    }

    /// A controller configuration with short intervals for tests.
    pub fn config(&self, pod_ip: &str) -> Config {
        let mut c = Config::new(CTL_NS, pod_ip, &[NS], self.key.clone());
        c.single_controller_mode = true;
        c.scale_interval = Duration::from_millis(200);
        c.scale.heartbeat_timeout = Duration::from_secs(30);
        c.scale.downscale_stabilization = Duration::from_secs(1);
        c.scale.initial_readiness_delay = Duration::from_secs(1);
        c.scale.assign_timeout = Duration::from_secs(5);
        c.hash_ring_wait_time = Duration::from_secs(5);
        // These tests call with plain clients; tests/controller/auth.rs
        // runs controllers that require tokens.
        c.auth.allow_unauthenticated = true;
        c
    }

    /// [`Sim::config`] for a controller of a ring: its members are the Ready
    /// controller pods of [`CTL_NS`].
    pub fn ring_config(&self, pod_ip: &str) -> Config {
        let mut c = self.config(pod_ip);
        c.single_controller_mode = false;
        c
    }

    /// Two controllers of one ring, as two replicas run: the stand-in pods
    /// `controller-a` and `controller-b` of [`CTL_NS`] and a controller on
    /// each pod's IP, both on one port, with `config(pod_ip)`. Returns them
    /// once both rings have both members.
    pub async fn ring_of_two(&self, config: impl Fn(&str) -> Config) -> (Ctl, Ctl) {
        let ip1 = self.controller_pod(CTL_NS, "controller-a").await;
        let ip2 = self.controller_pod(CTL_NS, "controller-b").await;
        let (la, lb) = listeners(&ip1, &ip2).await;
        let (a, b) = tokio::join!(
            Ctl::start(self, config(&ip1), la),
            Ctl::start(self, config(&ip2), lb)
        );
        Ctl::await_rings(&[&a, &b], 2).await;
        (a, b)
    }

    /// Creates ServiceAccount `name` in `ns` (an existing one is fine).
    pub async fn service_account(&self, ns: &str, name: &str) {
        let sa: k8s_openapi::api::core::v1::ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns}})).unwrap();
        match Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(self.client.clone(), ns)
            .create(&PostParams::default(), &sa)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("failed to create ServiceAccount {ns}/{name}: {e}"),
        }
    }

    /// A token of ServiceAccount `ns/name` for `audience` (TokenRequest).
    pub async fn token(&self, ns: &str, name: &str, audience: &str) -> String {
        self.service_account(ns, name).await;
        let req = k8s_openapi::api::authentication::v1::TokenRequest {
            spec: k8s_openapi::api::authentication::v1::TokenRequestSpec {
                audiences: vec![audience.to_owned()],
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer: k8s_openapi::api::authentication::v1::TokenRequest =
            Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(self.client.clone(), ns)
                .create_subresource("token", name, &PostParams::default(), &req)
                .await
                .unwrap();
        answer.status.unwrap().token
    }
}

/// A controller running in this process.
pub struct Ctl {
    pub addr: SocketAddr,
    /// The web UI, when the configuration asked for one.
    pub web: Option<SocketAddr>,
    pub core: Arc<Core>,
    pub shutdown: Shutdown,
    pub task: tokio::task::JoinHandle<Result<(), RunError>>,
    pub grpc: ControllerServiceClient<Channel>,
}

impl Ctl {
    /// Starts a controller on `listener` and waits until it serves and its
    /// caches hold what the API server has at this moment ([`caught_up`]:
    /// every pool Deployment's ReplicaSet among it, so no call is NOT_FOUND
    /// by the missing-deployment fast path).
    pub async fn start(sim: &Sim<'_>, mut config: Config, listener: TcpListener) -> Self {
        let addr = listener.local_addr().unwrap();
        config.port = addr.port();
        let shutdown = Shutdown::new();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(skipper::controller::run(
            config,
            sim.client.clone(),
            listener,
            shutdown.clone(),
            move |running| {
                let _ = tx.send(running);
            },
        ));
        let running = tokio::time::timeout(Duration::from_secs(15), rx)
            .await
            .expect("controller did not become ready")
            .expect("controller stopped before becoming ready");
        sim.controllers
            .lock()
            .unwrap()
            .push(Arc::downgrade(&running.core));
        caught_up(&sim.client, &running.core).await;
        let grpc = ControllerServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            addr,
            web: running.web_addr,
            core: running.core,
            shutdown,
            task,
            grpc,
        }
    }

    /// The IP of the pod this controller stands for (its ring member).
    #[must_use]
    pub fn pod_ip(&self) -> &str {
        &self.core.config.pod_ip
    }

    /// Waits until the ring of each of `ctls` has `members` members
    /// (a ring follows the Ready controller pods); fails the test after
    /// 30 s.
    pub async fn await_rings(ctls: &[&Ctl], members: usize) {
        let what = format!("{} rings of {members}", ctls.len());
        eventually(&what, Duration::from_secs(30), || async {
            ctls.iter()
                .all(|c| c.core.cluster.ring.current().sorted_members().len() == members)
                .then_some(())
        })
        .await;
    }

    /// The cluster state this controller alone holds (`local_only`).
    pub async fn local_state(&mut self) -> api::ClusterState {
        self.grpc
            .get_cluster_state(api::GetClusterStateRequest {
                local_only: Some(true),
            })
            .await
            .unwrap()
            .into_inner()
            .cluster_state
            .unwrap()
    }

    /// Starts a single-controller-mode controller on 127.0.0.1:0.
    pub async fn single(sim: &Sim<'_>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start(sim, sim.config("127.0.0.1"), listener).await
    }

    /// `GetInstance` for `f` within `timeout`; panics when it fails.
    pub async fn instance(&mut self, f: &Function, timeout: Duration) -> api::Instance {
        self.grpc
            .get_instance(get_instance(f, timeout))
            .await
            .unwrap()
            .into_inner()
            .instance
            .unwrap()
    }

    /// The status `GetInstance` for `f` fails with within `timeout`; panics
    /// when it answers with an instance.
    pub async fn refusal(&mut self, f: &Function, timeout: Duration) -> tonic::Status {
        self.grpc
            .get_instance(get_instance(f, timeout))
            .await
            .expect_err("GetInstance failed")
    }

    /// Stops the controller.
    pub async fn stop(self) {
        self.shutdown.trigger();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
        self.shutdown.drain(Duration::from_secs(5)).await;
    }
}

/// What a controller's cache should hold: `resourceVersion` by name, and
/// whether the object is being deleted (then the cache may have dropped it).
type Listing = HashMap<String, (u64, bool)>;
/// A namespace's listings: its function pods and its ReplicaSets, each with
/// the list's `resourceVersion`.
type Listed = (Namespace, (Listing, u64), (Listing, u64));

/// Lists `api` with `selector`: the objects and the list's own
/// `resourceVersion`.
async fn listing<K>(api: Api<K>, selector: &str) -> (Listing, u64)
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    let list = api.list(&ListParams::default().labels(selector)).await.unwrap();
    let rv = |v: Option<&String>| v.and_then(|v| v.parse().ok()).unwrap_or(0);
    let objects = list
        .items
        .iter()
        .map(|o| {
            let m = o.meta();
            (
                m.name.clone().unwrap_or_default(),
                (rv(m.resource_version.as_ref()), m.deletion_timestamp.is_some()),
            )
        })
        .collect();
    (objects, rv(list.metadata.resource_version.as_ref()))
}

/// What keeps a cache from holding a listing.
struct Lag {
    what: String,
    /// The listed object the cache lacks: it may have been deleted since
    /// the list (the cache then rightly dropped it).
    missing: Option<String>,
}

/// What keeps `cached` from holding `listed` (listed at `at`): an object
/// missing or older, or one the list no longer has (deleted before it)
/// still cached. `None` once caught up.
fn lag(what: &str, listed: &(Listing, u64), cached: &HashMap<String, Option<u64>>) -> Option<Lag> {
    let (objects, at) = listed;
    for (name, (rv, deleting)) in objects {
        match cached.get(name).copied().flatten() {
            Some(have) if have >= *rv => {}
            None if *deleting => {}
            have => {
                return Some(Lag {
                    what: format!("{what} {name} at {rv} (cached: {have:?})"),
                    missing: have.is_none().then(|| name.clone()),
                });
            }
        }
    }
    cached
        .iter()
        .find(|(name, rv)| !objects.contains_key(*name) && rv.is_none_or(|rv| rv <= *at))
        .map(|(name, rv)| Lag {
            what: format!("{what} {name} gone by {at} (cached at {rv:?})"),
            missing: None,
        })
}

fn versions<K: kube::Resource>(objects: &[Arc<K>]) -> HashMap<String, Option<u64>> {
    objects
        .iter()
        .map(|o| {
            let m = o.meta();
            let rv = m.resource_version.as_deref().and_then(|v| v.parse().ok());
            (m.name.clone().unwrap_or_default(), rv)
        })
        .collect()
}

/// The barrier: lists what `core` watches from the API server now (function
/// pods and ReplicaSets of each namespace it follows, the controller pods of
/// its ring) and waits until its caches hold each object at least at the
/// listed `resourceVersion` and no longer hold the ones deleted before the
/// list. A listed object the cache lacks is asked for again: when the API
/// server no longer has it (or is deleting it), it was deleted after the
/// list and the cache is right to lack it. Event-driven: it checks again
/// only when a cache applied an event. A namespace whose watches the API server refuses is left out (its caches
/// stand still). Fails the test after 30 s, naming what lags.
pub async fn caught_up(client: &kube::Client, core: &Core) {
    if let Err(e) = caught_up_within(client, core, Duration::from_secs(30)).await {
        panic!("{e}");
    }
}

/// [`caught_up`] within `limit`; the error names what lags.
///
/// # Errors
/// When the caches do not catch up within `limit`.
pub async fn caught_up_within(client: &kube::Client, core: &Core, limit: Duration) -> Result<(), String> {
    let state = &core.cluster.state;
    let mut applied = state.applied();
    let selector = skipper::domain::LABEL_DEPLOYMENT;
    let mut listed: Vec<Listed> = Vec::new();
    for (ns, n) in state.namespaces.iter().filter(|(_, n)| n.is_synced()) {
        let pods = listing(Api::<Pod>::namespaced(client.clone(), ns), selector).await;
        let sets = listing(Api::<ReplicaSet>::namespaced(client.clone(), ns), selector).await;
        listed.push((n.clone(), pods, sets));
    }
    let mut controllers = match &state.controller_pods {
        Some(store) => Some((
            store,
            listing(
                Api::<Pod>::namespaced(client.clone(), &core.config.namespace),
                skipper::controller::kube::stores::CONTROLLER_SELECTOR,
            )
            .await,
        )),
        None => None,
    };
    let behind =
        |listed: &[Listed], controllers: &Option<(&Store<Pod>, (Listing, u64))>| -> Option<(Lag, Which)> {
            listed
                .iter()
                .enumerate()
                .find_map(|(i, (n, pods, sets))| {
                    lag("pod", pods, &n.pods.resource_versions())
                        .map(|l| (l, Which::Pods(i)))
                        .or_else(|| {
                            lag("replicaset", sets, &versions(&n.replica_sets.store().state()))
                                .map(|l| (l, Which::ReplicaSets(i)))
                        })
                })
                .or_else(|| {
                    let (store, pods) = controllers.as_ref()?;
                    lag("controller pod", pods, &versions(&store.state())).map(|l| (l, Which::ControllerPods))
                })
        };
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        applied.mark_unchanged();
        let Some((lagging, which)) = behind(&listed, &controllers) else {
            return Ok(());
        };
        // An object the cache lacks that the API server no longer has (or
        // is deleting) was deleted after the list: the cache is right.
        if let Some(name) = &lagging.missing {
            let (ns, listing) = match which {
                Which::Pods(i) => (listed[i].0.pods.namespace().to_owned(), &mut listed[i].1),
                Which::ReplicaSets(i) => (listed[i].0.pods.namespace().to_owned(), &mut listed[i].2),
                Which::ControllerPods => (
                    core.config.namespace.clone(),
                    &mut controllers.as_mut().expect("a controller pod lags").1,
                ),
            };
            let gone = match which {
                Which::ReplicaSets(_) => Api::<ReplicaSet>::namespaced(client.clone(), &ns)
                    .get_opt(name)
                    .await
                    .ok()
                    .map(|o| o.is_none_or(|o| o.metadata.deletion_timestamp.is_some())),
                Which::Pods(_) | Which::ControllerPods => Api::<Pod>::namespaced(client.clone(), &ns)
                    .get_opt(name)
                    .await
                    .ok()
                    .map(|o| o.is_none_or(|o| o.metadata.deletion_timestamp.is_some())),
            };
            if gone == Some(true) {
                listing.0.remove(name);
                continue;
            }
        }
        match tokio::time::timeout_at(deadline, applied.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(format!("controller {}'s watches stopped", core.config.pod_ip)),
            Err(_) => {
                return Err(format!(
                    "controller {}'s caches did not catch up with the API server within {limit:?}: {}",
                    core.config.pod_ip, lagging.what
                ));
            }
        }
    }
}

/// Which listing of [`caught_up_within`] lags.
#[derive(Debug, Clone, Copy)]
enum Which {
    Pods(usize),
    ReplicaSets(usize),
    ControllerPods,
}

/// Binds `ip1:0` and `ip2:<same port>` (peers are dialled on one port).
pub async fn listeners(ip1: &str, ip2: &str) -> (TcpListener, TcpListener) {
    for _ in 0..20 {
        let a = TcpListener::bind((ip1, 0)).await.unwrap();
        let port = a.local_addr().unwrap().port();
        if let Ok(b) = TcpListener::bind((ip2, port)).await {
            return (a, b);
        }
    }
    panic!("no common free port on {ip1} and {ip2}");
}

/// `SERVING`, as the health service answers it.
pub const SERVING: i32 = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;

/// The status the health service at `addr` gives `service` (`""`: the
/// controller's readiness), `None` when it does not answer.
pub async fn health_status(addr: SocketAddr, service: &str) -> Option<i32> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .ok()?;
    let resp = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .ok()?;
    Some(resp.into_inner().status)
}

/// A tenant whose function of the pool `deployment` the ring of `members`
/// gives to `owner`.
pub fn tenant_owned_by(deployment: &str, members: &[&str], owner: &str) -> String {
    let ring = skipper::ring::HashRing::new(members.iter().copied());
    (0..1000)
        .map(|i| format!("t{i}"))
        .find(|t| ring.owner(function(deployment, t, 1).id()) == Some(owner))
        .expect("one of 1000 tenants falls to each member")
}

/// A regular function of the pool `deployment`.
pub fn function(deployment: &str, tenant: &str, max: u32) -> Function {
    Function {
        namespace: NS.into(),
        deployment: deployment.into(),
        tenant: tenant.into(),
        metadata: Some("m".into()),
        scale: Some(Scale {
            min_instances: Some(0),
            max_instances: Some(max),
            ..Scale::default()
        }),
        oneshot: None,
    }
}

/// A GetInstance request with a deadline.
pub fn get_instance(f: &Function, timeout: Duration) -> tonic::Request<api::GetInstanceRequest> {
    let mut r = tonic::Request::new(api::GetInstanceRequest {
        function: Some(f.into()),
        exclude_instance_names: vec![],
    });
    r.set_timeout(timeout);
    r
}

/// A Scale request of `f` to `desired` instances (for in-flight
/// requests) with a deadline.
pub fn scale(f: &Function, desired: u32, timeout: Duration) -> tonic::Request<api::ScaleRequest> {
    let mut r = tonic::Request::new(api::ScaleRequest {
        function: Some(f.into()),
        desired_instances: Some(desired),
        reason: Some(api::ScaleReason::InFlightRequests as i32),
    });
    r.set_timeout(timeout);
    r
}

/// A heartbeat batch from `router` for `f`, stamped now.
pub fn heartbeat(router: &str, f: &Function, in_flight: u32) -> api::HeartbeatRequest {
    api::HeartbeatRequest {
        router_ip: Some(router.into()),
        heartbeats: vec![api::Heartbeat {
            function: Some(f.into()),
            timestamp: Some(std::time::SystemTime::now().into()),
            in_flight_requests: Some(in_flight),
        }],
        forwarded_for: vec![],
    }
}
