//! The node agent loop: registers the agent's Nodes, renews their heartbeat
//! Leases in `kube-node-lease`, watches the pods bound to each node
//! (`spec.nodeName`) and keeps one [`Worker`] per pod; samples container
//! CPU and memory for pod metrics.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt as _;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::runtime::{Sample, sample_containers};
use super::worker::{Update, Worker};
use super::{ContainerUsage, PodSample, PodUsage, Settings};
use crate::quantity::{parse_milli, parse_units};

/// The namespace of node heartbeat Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a few map operations with no await: a
    // poisoned lock still holds consistent data.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One container's processes, for fault hooks and metrics, and the log of
/// its current instance, for following logs.
#[derive(Debug, Clone)]
struct ContainerPids {
    name: String,
    init: bool,
    main: Option<u32>,
    shim: Option<u32>,
    /// The log file of the instance that is starting or running.
    log: Option<PathBuf>,
}

#[derive(Debug, Clone)]
struct PodEntry {
    ns: String,
    name: String,
    labels: BTreeMap<String, String>,
    /// Every container of the spec (init containers included), by name.
    spec_containers: Vec<String>,
    containers: Vec<ContainerPids>,
}

impl PodEntry {
    fn container(&mut self, name: &str, init: bool) -> &mut ContainerPids {
        let at = match self.containers.iter().position(|c| c.name == name) {
            Some(i) => i,
            None => {
                self.containers.push(ContainerPids {
                    name: name.to_owned(),
                    init,
                    main: None,
                    shim: None,
                    log: None,
                });
                self.containers.len() - 1
            }
        };
        &mut self.containers[at]
    }
}

/// What runs where, shared by the workers and the fault hooks.
#[derive(Debug, Default)]
pub struct Registry {
    pods: Mutex<HashMap<String, PodEntry>>,
    usage: Mutex<HashMap<(String, String), PodUsage>>,
}

impl Registry {
    /// A pod worker started, for a pod with `containers` (every container
    /// of its spec, init containers included).
    pub fn add(&self, uid: &str, ns: &str, name: &str, containers: Vec<String>) {
        lock(&self.pods).insert(
            uid.to_owned(),
            PodEntry {
                ns: ns.to_owned(),
                name: name.to_owned(),
                labels: BTreeMap::new(),
                spec_containers: containers,
                containers: Vec::new(),
            },
        );
    }

    /// The containers of pod `ns/name` (every one of its spec), when it
    /// runs here.
    #[must_use]
    pub fn pod_containers(&self, ns: &str, name: &str) -> Option<Vec<String>> {
        lock(&self.pods)
            .values()
            .find(|e| e.ns == ns && e.name == name)
            .map(|e| e.spec_containers.clone())
    }

    /// Records (or clears) the log file of a container's starting or
    /// running instance.
    pub fn set_log(&self, uid: &str, container: &str, init: bool, log: Option<PathBuf>) {
        if let Some(entry) = lock(&self.pods).get_mut(uid) {
            entry.container(container, init).log = log;
        }
    }

    /// Whether an instance of container `container` of pod `ns/name` that
    /// logs to `log` is starting or running.
    #[must_use]
    pub fn writes_log(&self, ns: &str, name: &str, container: &str, log: &Path) -> bool {
        lock(&self.pods)
            .values()
            .filter(|e| e.ns == ns && e.name == name)
            .flat_map(|e| &e.containers)
            .any(|c| c.name == container && c.log.as_deref() == Some(log))
    }

    /// The pod's current labels (for pod metrics).
    pub fn set_labels(&self, uid: &str, labels: &BTreeMap<String, String>) {
        if let Some(entry) = lock(&self.pods).get_mut(uid)
            && entry.labels != *labels
        {
            entry.labels.clone_from(labels);
        }
    }

    /// Latest usage of every pod of `namespace` (every namespace when
    /// `None`) with its labels.
    #[must_use]
    pub fn usages(&self, namespace: Option<&str>) -> Vec<PodSample> {
        let pods = lock(&self.pods);
        let usage = lock(&self.usage);
        let mut out: Vec<_> = pods
            .values()
            .filter(|e| namespace.is_none_or(|n| n == e.ns))
            .filter_map(|e| {
                let u = usage.get(&(e.ns.clone(), e.name.clone()))?;
                Some(PodSample {
                    namespace: e.ns.clone(),
                    name: e.name.clone(),
                    labels: e.labels.clone(),
                    usage: u.clone(),
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        out
    }

    /// Records (or clears) the processes of a container.
    pub fn set_pid(&self, uid: &str, container: &str, init: bool, main: Option<u32>, shim: Option<u32>) {
        let mut pods = lock(&self.pods);
        let Some(entry) = pods.get_mut(uid) else { return };
        let c = entry.container(container, init);
        c.main = main;
        c.shim = shim;
    }

    /// A pod worker ended.
    pub fn remove(&self, uid: &str) {
        if let Some(e) = lock(&self.pods).remove(uid) {
            lock(&self.usage).remove(&(e.ns, e.name));
        }
    }

    /// The main process of a pod: its first running regular container's
    /// (an init container's while it initializes).
    #[must_use]
    pub fn main_pid(&self, ns: &str, name: &str) -> Option<u32> {
        let pods = lock(&self.pods);
        let entry = pods.values().find(|e| e.ns == ns && e.name == name)?;
        entry
            .containers
            .iter()
            .filter(|c| !c.init)
            .chain(entry.containers.iter().filter(|c| c.init))
            .find_map(|c| c.main)
    }

    /// Main processes of every running container.
    #[must_use]
    pub fn main_pids(&self) -> Vec<u32> {
        lock(&self.pods)
            .values()
            .flat_map(|e| e.containers.iter().filter_map(|c| c.main))
            .collect()
    }

    /// SIGKILLs every container at once (its shim then reaps it and exits;
    /// a shim whose container has not started yet is killed itself).
    pub fn kill_everything(&self) {
        for e in lock(&self.pods).values() {
            for c in &e.containers {
                if let Some(pid) = c.main.or(c.shim) {
                    super::runtime::signal(pid, nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }

    /// Latest usage of a pod.
    #[must_use]
    pub fn usage(&self, ns: &str, name: &str) -> Option<PodUsage> {
        lock(&self.usage).get(&(ns.to_owned(), name.to_owned())).cloned()
    }

    fn containers(&self) -> Vec<((String, String, String), u32)> {
        lock(&self.pods)
            .values()
            .flat_map(|e| {
                e.containers
                    .iter()
                    .filter_map(|c| Some(((e.ns.clone(), e.name.clone(), c.name.clone()), c.main?)))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn set_usage(&self, usage: HashMap<(String, String), PodUsage>) {
        let pods: HashSet<(String, String)> = lock(&self.pods)
            .values()
            .map(|e| (e.ns.clone(), e.name.clone()))
            .collect();
        let mut current = lock(&self.usage);
        current.retain(|k, _| pods.contains(k));
        current.extend(usage);
    }
}

/// Loopback addresses: a random 127.a.b.0/24 (a ≠ 0, so 127.0.0.1 is never
/// used), moving to another random /24 when one is used up; an address is
/// handed out only when the pod's ports are free on it.
struct IpAllocator {
    prefix: (u8, u8),
    next: u16,
}

impl IpAllocator {
    fn new() -> Self {
        Self {
            prefix: Self::random_prefix(),
            next: 1,
        }
    }

    fn random_prefix() -> (u8, u8) {
        (rand::random_range(1..=254), rand::random_range(0..=255))
    }

    fn allocate(&mut self, ports: &[u16]) -> Option<Ipv4Addr> {
        for _ in 0..2048 {
            if self.next >= 255 {
                self.prefix = Self::random_prefix();
                self.next = 1;
            }
            #[allow(clippy::cast_possible_truncation)] // next < 255
            let ip = Ipv4Addr::new(127, self.prefix.0, self.prefix.1, self.next as u8);
            self.next += 1;
            let free = ports
                .iter()
                .all(|p| std::net::TcpListener::bind(SocketAddr::from((ip, *p))).is_ok());
            if free {
                return Some(ip);
            }
        }
        None
    }
}

/// What every worker shares.
pub struct Ctx {
    /// One client per node, each with that node's credential.
    clients: BTreeMap<String, kube::Client>,
    pub settings: Arc<Settings>,
    pub tracker: TaskTracker,
    pub registry: Arc<Registry>,
    ips: Mutex<IpAllocator>,
}

impl Ctx {
    /// The client of `node`.
    ///
    /// # Panics
    /// Never: the agent only serves nodes it has a client for.
    #[must_use]
    pub fn client(&self, node: &str) -> kube::Client {
        #[allow(clippy::expect_used)] // `context` gets a client for every node of the settings
        self.clients.get(node).cloned().expect("a client for every node")
    }

    /// `<pod root>/<namespace>_<name>`.
    #[must_use]
    pub fn pod_dir(&self, ns: &str, name: &str) -> PathBuf {
        self.settings.pod_dir(ns, name)
    }

    /// Node allocatable CPU (millicores) and memory (bytes).
    #[must_use]
    pub fn node_allocatable(&self) -> (i128, i128) {
        (
            parse_milli(&self.settings.capacity.cpu).unwrap_or(0),
            parse_units(&self.settings.capacity.memory).unwrap_or(0),
        )
    }

    /// The address of every node (and `hostIP` of its pods).
    #[must_use]
    pub fn host_ip(&self) -> Ipv4Addr {
        self.settings.network.host_ip()
    }

    /// `KUBERNETES_SERVICE_HOST` for pods.
    #[must_use]
    pub fn api_host(&self) -> String {
        self.settings.api_server.ip().to_string()
    }

    /// `KUBERNETES_SERVICE_PORT` for pods.
    #[must_use]
    pub fn api_port(&self) -> u16 {
        self.settings.api_server.port()
    }

    /// A loopback address for a new pod whose containers listen on `ports`.
    pub fn allocate_ip(&self, ports: &[u16]) -> Option<Ipv4Addr> {
        lock(&self.ips).allocate(ports)
    }
}

/// A worker's mailbox.
struct WorkerHandle {
    node: String,
    tx: watch::Sender<Update>,
}

/// The running agent.
pub struct Agent {
    ctx: Arc<Ctx>,
    workers: Mutex<HashMap<String, WorkerHandle>>,
    /// Pods whose worker ended; later events of them are stale.
    finished: Mutex<VecDeque<String>>,
    kill: CancellationToken,
}

/// The Node object the agent registers.
#[must_use]
pub fn node_object(settings: &Settings, name: &str, zone: &str) -> Node {
    let now = Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let cap = &settings.capacity;
    let condition = |kind: &str, status: &str, reason: &str, message: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": message,
               "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let v = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": arch,
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": arch,
            "topology.kubernetes.io/zone": zone,
        }},
        "spec": {},
        "status": {
            "capacity": {"cpu": cap.cpu, "memory": cap.memory, "pods": cap.pods.to_string(), "ephemeral-storage": "100Gi"},
            "allocatable": {"cpu": cap.cpu, "memory": cap.memory, "pods": cap.pods.to_string(), "ephemeral-storage": "100Gi"},
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": settings.network.host_ip().to_string()},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": settings.api.as_ref().map_or(super::api::KUBELET_PORT, |a| a.port)}},
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "",
                "kernelVersion": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
                "osImage": "skipper node agent",
                "containerRuntimeVersion": "skipper://0.1.0",
                "kubeletVersion": "v1.33.0-skipper",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": arch,
            },
        },
    });
    #[allow(clippy::expect_used)] // a fixed, valid Node document
    serde_json::from_value(v).expect("node object is a valid Node")
}

impl Agent {
    /// An agent on `ctx`'s client; `kill` stops every pod at once.
    #[must_use]
    pub fn new(ctx: Arc<Ctx>, kill: CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            workers: Mutex::new(HashMap::new()),
            finished: Mutex::new(VecDeque::new()),
            kill,
        })
    }

    /// Registers every node (creating it, or reporting its status when it exists).
    ///
    /// # Errors
    /// The API error of the node that could not be registered.
    pub async fn register_nodes(&self) -> Result<(), (String, kube::Error)> {
        for n in &self.ctx.settings.nodes {
            let api: Api<Node> = Api::all(self.ctx.client(&n.name));
            let node = node_object(&self.ctx.settings, &n.name, &n.zone);
            match api.create(&PostParams::default(), &node).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    let patch = Patch::Merge(json!({"status": node.status}));
                    api.patch_status(&n.name, &PatchParams::default(), &patch)
                        .await
                        .map_err(|e| (n.name.clone(), e))?;
                }
                Err(e) => return Err((n.name.clone(), e)),
            }
        }
        Ok(())
    }

    /// Spawns the lease, node status, watch and metrics loops on `tracker`.
    pub fn spawn(self: &Arc<Self>, tracker: &TaskTracker, stop: &CancellationToken) {
        for n in &self.ctx.settings.nodes {
            let (this, token, name) = (self.clone(), stop.clone(), n.name.clone());
            tracker.spawn(async move { this.heartbeat(&name, &token).await });
            let (this, token, name) = (self.clone(), stop.clone(), n.name.clone());
            tracker.spawn(async move { this.watch_pods(&name, &token).await });
        }
        let (this, token) = (self.clone(), stop.clone());
        tracker.spawn(async move { this.sample_metrics(&token).await });
    }

    /// Renews the node's Lease every quarter of its duration and reports
    /// node status every `node_status_interval`.
    async fn heartbeat(&self, node: &str, stop: &CancellationToken) {
        let leases: Api<Lease> = Api::namespaced(self.ctx.client(node), NODE_LEASE_NAMESPACE);
        let nodes: Api<Node> = Api::all(self.ctx.client(node));
        let duration = self.ctx.settings.lease_duration;
        let mut renew = tokio::time::interval((duration / 4).max(Duration::from_millis(100)));
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut report = tokio::time::interval(self.ctx.settings.node_status_interval);
        report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        report.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = renew.tick() => {
                    if let Err(e) = self.renew_lease(&leases, &nodes, node, duration).await {
                        tracing::debug!(node, error = %e, "lease renewal failed");
                    }
                }
                _ = report.tick() => {
                    let status = node_object(&self.ctx.settings, node, "").status;
                    let conditions = status.and_then(|s| s.conditions);
                    let patch = Patch::Merge(json!({"status": {"conditions": conditions}}));
                    if let Err(e) = nodes.patch_status(node, &PatchParams::default(), &patch).await {
                        tracing::debug!(node, error = %e, "node status update failed");
                    }
                }
            }
        }
    }

    async fn renew_lease(
        &self,
        leases: &Api<Lease>,
        nodes: &Api<Node>,
        node: &str,
        duration: Duration,
    ) -> Result<(), kube::Error> {
        let now = MicroTime(Timestamp::now());
        let seconds = i32::try_from(duration.as_secs()).unwrap_or(40);
        match leases.get_opt(node).await? {
            Some(mut lease) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                spec.renew_time = Some(now);
                spec.holder_identity = Some(node.to_owned());
                spec.lease_duration_seconds = Some(seconds);
                leases.replace(node, &PostParams::default(), &lease).await?;
            }
            None => {
                let owner = nodes.get_opt(node).await?.map(|n| OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: node.to_owned(),
                    uid: n.metadata.uid.unwrap_or_default(),
                    ..OwnerReference::default()
                });
                let lease = Lease {
                    metadata: kube::api::ObjectMeta {
                        name: Some(node.to_owned()),
                        namespace: Some(NODE_LEASE_NAMESPACE.to_owned()),
                        owner_references: owner.map(|o| vec![o]),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(node.to_owned()),
                        lease_duration_seconds: Some(seconds),
                        renew_time: Some(now),
                        ..LeaseSpec::default()
                    }),
                };
                leases.create(&PostParams::default(), &lease).await?;
            }
        }
        Ok(())
    }

    /// Watches the pods bound to `node` and keeps their workers informed.
    async fn watch_pods(self: &Arc<Self>, node: &str, stop: &CancellationToken) {
        let api: Api<Pod> = Api::all(self.ctx.client(node));
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let mut stream = watcher(api, config).default_backoff().boxed();
        let mut relisted: Option<HashSet<String>> = None;
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                e = stream.next() => e,
            };
            let Some(event) = event else { return };
            match event {
                Ok(watcher::Event::Apply(pod)) => self.dispatch(node, pod),
                Ok(watcher::Event::Delete(pod)) => self.removed(&pod),
                Ok(watcher::Event::Init) => relisted = Some(HashSet::new()),
                Ok(watcher::Event::InitApply(pod)) => {
                    if let (Some(seen), Some(uid)) = (relisted.as_mut(), pod.metadata.uid.clone()) {
                        seen.insert(uid);
                    }
                    self.dispatch(node, pod);
                }
                Ok(watcher::Event::InitDone) => {
                    // Pods deleted while the watch was down are gone.
                    if let Some(seen) = relisted.take() {
                        let gone: Vec<String> = lock(&self.workers)
                            .iter()
                            .filter(|(uid, w)| w.node == node && !seen.contains(*uid))
                            .map(|(uid, _)| uid.clone())
                            .collect();
                        for uid in gone {
                            if let Some(w) = lock(&self.workers).get(&uid) {
                                w.tx.send_replace(None);
                            }
                        }
                    }
                }
                Err(e) => tracing::debug!(node, error = %e, "pod watch error"),
            }
        }
    }

    fn dispatch(self: &Arc<Self>, node: &str, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        if lock(&self.finished).contains(&uid) {
            return;
        }
        let pod = Arc::new(pod);
        let mut workers = lock(&self.workers);
        if let Some(w) = workers.get(&uid) {
            w.tx.send_replace(Some(pod));
            return;
        }
        if self.kill.is_cancelled() {
            return;
        }
        let terminal = matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        );
        if pod.metadata.deletion_timestamp.is_some() || terminal {
            drop(workers);
            if pod.metadata.deletion_timestamp.is_some() {
                // Nothing of it runs here: delete it for good.
                let (this, node) = (self.clone(), node.to_owned());
                self.ctx
                    .tracker
                    .spawn(async move { this.delete_for_good(&node, &pod).await });
            }
            return;
        }
        let (tx, rx) = watch::channel(Some(pod.clone()));
        workers.insert(
            uid.clone(),
            WorkerHandle {
                node: node.to_owned(),
                tx,
            },
        );
        drop(workers);
        let worker = Worker::new(self.ctx.clone(), node.to_owned(), pod);
        let (this, kill) = (self.clone(), self.kill.child_token());
        self.ctx.tracker.spawn(async move {
            worker.run(rx, kill).await;
            lock(&this.workers).remove(&uid);
            let mut finished = lock(&this.finished);
            finished.push_back(uid);
            while finished.len() > 4096 {
                finished.pop_front();
            }
        });
    }

    fn removed(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        if let Some(w) = lock(&self.workers).get(uid) {
            w.tx.send_replace(None);
        }
        lock(&self.finished).retain(|u| u != uid);
    }

    async fn delete_for_good(&self, node: &str, pod: &Pod) {
        let (Some(ns), Some(name)) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref()) else {
            return;
        };
        let api: Api<Pod> = Api::namespaced(self.ctx.client(node), ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        if let Err(e) = api.delete(name, &params).await {
            tracing::debug!(pod = name, error = %e, "deleting a pod that never ran here");
        }
    }

    /// Samples every container every `metrics_interval`.
    async fn sample_metrics(&self, stop: &CancellationToken) {
        let mut tick = tokio::time::interval(self.ctx.settings.metrics_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: HashMap<(String, String, String), (Sample, tokio::time::Instant)> = HashMap::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let mains = self.ctx.registry.containers();
            let samples = sample_containers(&mains);
            let now = tokio::time::Instant::now();
            let stamp = Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
            let mut pods: BTreeMap<(String, String), PodUsage> = BTreeMap::new();
            let mut next = HashMap::new();
            for (key, sample) in samples {
                if let Some((prev, at)) = last.get(&key) {
                    let elapsed = now.duration_since(*at);
                    // Clock ticks are 10 ms.
                    let used_ms = u128::from(sample.ticks.saturating_sub(prev.ticks)) * 10;
                    let cpu_millis = if elapsed.as_millis() == 0 {
                        0
                    } else {
                        u64::try_from(used_ms * 1000 / elapsed.as_millis()).unwrap_or(u64::MAX)
                    };
                    let entry = pods
                        .entry((key.0.clone(), key.1.clone()))
                        .or_insert_with(|| PodUsage {
                            containers: Vec::new(),
                            timestamp: stamp.clone(),
                            window: elapsed,
                        });
                    entry.containers.push(ContainerUsage {
                        name: key.2.clone(),
                        cpu_millis,
                        memory_bytes: sample.rss,
                    });
                }
                next.insert(key, (sample, now));
            }
            last = next;
            self.ctx.registry.set_usage(pods.into_iter().collect());
        }
    }
}

/// Builds the shared context (`clients` has one client per node).
#[must_use]
pub fn context(
    clients: BTreeMap<String, kube::Client>,
    settings: Arc<Settings>,
    tracker: TaskTracker,
    registry: Arc<Registry>,
) -> Arc<Ctx> {
    Arc::new(Ctx {
        clients,
        settings,
        tracker,
        registry,
        ips: Mutex::new(IpAllocator::new()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_skips_127_0_and_hands_out_distinct_addresses() {
        let mut a = IpAllocator::new();
        let ips: HashSet<Ipv4Addr> = (0..300).filter_map(|_| a.allocate(&[])).collect();
        assert_eq!(ips.len(), 300);
        assert!(
            ips.iter()
                .all(|ip| ip.octets()[0] == 127 && ip.octets()[1] != 0 && ip.octets()[3] != 0)
        );
    }

    #[test]
    fn the_registry_finds_a_pods_main_process() {
        let r = Registry::default();
        r.add("u1", "ns", "p", vec!["init".into(), "main".into()]);
        r.set_pid("u1", "init", true, Some(10), Some(9));
        assert_eq!(
            r.main_pid("ns", "p"),
            Some(10),
            "the init container while it runs"
        );
        r.set_pid("u1", "main", false, Some(20), Some(19));
        assert_eq!(r.main_pid("ns", "p"), Some(20));
        r.set_pid("u1", "init", true, None, None);
        assert_eq!(r.main_pids(), [20]);
        r.remove("u1");
        assert_eq!(r.main_pid("ns", "p"), None);
    }

    #[test]
    fn the_registry_knows_which_log_a_running_instance_writes() {
        let r = Registry::default();
        assert_eq!(r.pod_containers("ns", "p"), None);
        r.add("u1", "ns", "p", vec!["main".into()]);
        assert_eq!(r.pod_containers("ns", "p"), Some(vec!["main".to_owned()]));
        let (first, second) = (
            Path::new("/pods/ns_p/logs/main/0.log"),
            Path::new("/pods/ns_p/logs/main/1.log"),
        );
        assert!(!r.writes_log("ns", "p", "main", first), "nothing started yet");
        r.set_log("u1", "main", false, Some(first.to_path_buf()));
        assert!(r.writes_log("ns", "p", "main", first), "starting");
        r.set_pid("u1", "main", false, Some(20), Some(19));
        assert!(r.writes_log("ns", "p", "main", first), "running");
        assert!(!r.writes_log("ns", "p", "other", first));
        assert!(!r.writes_log("ns", "q", "main", first));
        r.set_log("u1", "main", false, Some(second.to_path_buf()));
        assert!(
            !r.writes_log("ns", "p", "main", first),
            "restarted: the first instance ended"
        );
        assert!(r.writes_log("ns", "p", "main", second));
        r.set_log("u1", "main", false, None);
        assert!(!r.writes_log("ns", "p", "main", second), "exited");
        r.set_log("u1", "main", false, Some(second.to_path_buf()));
        r.remove("u1");
        assert!(!r.writes_log("ns", "p", "main", second), "the pod's worker ended");
        assert_eq!(r.pod_containers("ns", "p"), None);
    }
}
