//! The pod runtime ("kubelet"): schedules each pod on a simulated node,
//! gives it its own loopback IP, runs its first container's command as a
//! real process, marks it Running and Ready once its readiness probe (or its
//! first container port) answers, samples CPU and RSS from `/proc`, and stops
//! the process when the pod is deleted. Nothing is restarted: a process that
//! exits leaves its pod Running but unready (container waiting in
//! `CrashLoopBackOff`, exit in `lastState`), or `Failed`/`Succeeded` under
//! `restartPolicy: Never` — so a crashing Deployment does not churn pods.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::controllers::pod_ready;
use super::error::ApiError;
use super::resources::by_kind;
use super::store::{Store, is_terminating, name_of, namespace_of, now_rfc3339, uid_of};

/// Settings of the pod runtime.
#[derive(Debug, Clone)]
pub struct KubeletSettings {
    /// What `skipper` in a container command resolves to.
    pub skipper_exe: PathBuf,
    /// Per-pod directories (`POD_DIR`, logs) live here.
    pub pod_root: PathBuf,
    /// Handed to pods as `KUBECONFIG`.
    pub kubeconfig: PathBuf,
    /// How often a starting pod is probed.
    pub probe_interval: Duration,
    /// How often CPU and memory are sampled.
    pub metrics_interval: Duration,
    /// Node names, round-robin.
    pub nodes: Vec<String>,
}

/// Resource usage of a pod's process.
#[derive(Debug, Clone)]
pub struct Usage {
    /// Container name.
    pub container: String,
    /// CPU over the last interval, in millicores.
    pub cpu_millis: u64,
    /// Resident set size.
    pub memory_bytes: u64,
    /// When the sample was taken (RFC 3339).
    pub timestamp: String,
    /// The interval the CPU figure covers.
    pub window: Duration,
}

struct Runtime {
    namespace: String,
    name: String,
    stop: CancellationToken,
    /// Grace period to use when `stop` fires, in seconds.
    grace: Arc<AtomicI64>,
    pid: Arc<AtomicU32>,
}

/// Loopback addresses: a random 127.a.b.0/24 per allocator (a ≠ 0, so
/// 127.0.0.1 is never used), moving to another random /24 when one is used
/// up; every address is probe-bound on the pod's ports before it is handed out.
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

/// The pod runtime of one simulated cluster.
pub struct Kubelet {
    settings: KubeletSettings,
    runtimes: Mutex<HashMap<String, Runtime>>,
    metrics: Mutex<HashMap<(String, String), Usage>>,
    ips: Mutex<IpAllocator>,
    node_rr: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a single map operation, so a poisoned lock
    // still holds consistent data.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Signals a pod's whole process group (each pod process leads its own group).
fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if pid == 0 {
        return;
    }
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), sig);
    }
}

impl Kubelet {
    /// A runtime with no pods.
    #[must_use]
    pub fn new(settings: KubeletSettings) -> Self {
        Self {
            settings,
            runtimes: Mutex::new(HashMap::new()),
            metrics: Mutex::new(HashMap::new()),
            ips: Mutex::new(IpAllocator::new()),
            node_rr: AtomicUsize::new(0),
        }
    }

    /// Starts runtimes for new pods, stops those of deleted or terminating pods,
    /// and removes terminating pods that never ran.
    pub fn sync(self: &Arc<Self>, store: &Arc<Store>, tracker: &TaskTracker, root: &CancellationToken) {
        let podres = by_kind("Pod");
        let (pods, _) = store.list(podres, None);
        let mut seen = HashSet::new();
        let mut runtimes = lock(&self.runtimes);
        for pod in &pods {
            let uid = uid_of(pod).to_owned();
            seen.insert(uid.clone());
            if let Some(rt) = runtimes.get(&uid) {
                if is_terminating(pod) && !rt.stop.is_cancelled() {
                    let grace = pod
                        .pointer("/metadata/deletionGracePeriodSeconds")
                        .and_then(Value::as_i64)
                        .unwrap_or(30);
                    rt.grace.store(grace, Ordering::SeqCst);
                    rt.stop.cancel();
                }
                continue;
            }
            if is_terminating(pod) {
                let _ = store.remove(podres, namespace_of(pod), name_of(pod), Some(&uid));
                continue;
            }
            let phase = pod.pointer("/status/phase").and_then(Value::as_str).unwrap_or("");
            if phase == "Failed" || phase == "Succeeded" || root.is_cancelled() {
                continue;
            }
            let rt = Runtime {
                namespace: namespace_of(pod).to_owned(),
                name: name_of(pod).to_owned(),
                stop: root.child_token(),
                grace: Arc::new(AtomicI64::new(0)),
                pid: Arc::new(AtomicU32::new(0)),
            };
            let handles = (rt.stop.clone(), rt.grace.clone(), rt.pid.clone());
            runtimes.insert(uid, rt);
            let this = self.clone();
            let store = store.clone();
            let pod = pod.clone();
            tracker.spawn(async move { this.run_pod(store, pod, handles).await });
        }
        for (uid, rt) in runtimes.iter() {
            if !seen.contains(uid) && !rt.stop.is_cancelled() {
                rt.grace.store(0, Ordering::SeqCst);
                rt.stop.cancel();
            }
        }
    }

    /// Kills the process of a pod (SIGKILL), as a crash would.
    ///
    /// # Errors
    /// `NotFound` when the pod has no running process.
    pub fn kill_process(&self, ns: &str, name: &str) -> Result<u32, ApiError> {
        let runtimes = lock(&self.runtimes);
        let pid = runtimes
            .values()
            .find(|rt| rt.namespace == ns && rt.name == name)
            .map(|rt| rt.pid.load(Ordering::SeqCst))
            .filter(|pid| *pid != 0);
        match pid {
            Some(pid) => {
                signal(pid, nix::sys::signal::Signal::SIGKILL);
                Ok(pid)
            }
            None => Err(ApiError::NotFound {
                res: by_kind("Pod"),
                name: name.to_owned(),
            }),
        }
    }

    /// SIGKILLs every pod process at once (cluster shutdown and drop).
    pub fn kill_all(&self) {
        for rt in lock(&self.runtimes).values() {
            rt.grace.store(0, Ordering::SeqCst);
            rt.stop.cancel();
            signal(rt.pid.load(Ordering::SeqCst), nix::sys::signal::Signal::SIGKILL);
        }
    }

    /// Pids of the pod processes that are running now.
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        lock(&self.runtimes)
            .values()
            .map(|rt| rt.pid.load(Ordering::SeqCst))
            .filter(|p| *p != 0)
            .collect()
    }

    /// The pid of a pod's process, when it runs.
    #[must_use]
    pub fn pid_of(&self, ns: &str, name: &str) -> Option<u32> {
        lock(&self.runtimes)
            .values()
            .find(|rt| rt.namespace == ns && rt.name == name)
            .map(|rt| rt.pid.load(Ordering::SeqCst))
            .filter(|p| *p != 0)
    }

    /// Latest usage sample of a pod.
    #[must_use]
    pub fn usage(&self, ns: &str, name: &str) -> Option<Usage> {
        lock(&self.metrics)
            .get(&(ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Directory of a pod, `<work dir>/pods/<namespace>_<name>` (holds its
    /// `log` and whatever it writes to `POD_DIR`).
    #[must_use]
    pub fn pod_dir(&self, ns: &str, name: &str) -> PathBuf {
        self.settings.pod_root.join(format!("{ns}_{name}"))
    }

    async fn run_pod(
        self: Arc<Self>,
        store: Arc<Store>,
        pod: Value,
        handles: (CancellationToken, Arc<AtomicI64>, Arc<AtomicU32>),
    ) {
        let (stop, grace, pid_slot) = handles;
        let ns = namespace_of(&pod).to_owned();
        let name = name_of(&pod).to_owned();
        let uid = uid_of(&pod).to_owned();
        let exit = self.run_pod_inner(&store, &pod, &stop, &grace, &pid_slot).await;
        if let Err(e) = exit {
            tracing::warn!(pod = %name, namespace = %ns, error = %e, "pod failed to start");
            let never = pod.pointer("/spec/restartPolicy").and_then(Value::as_str) == Some("Never");
            let _ = update_pod(&store, &ns, &name, &uid, |st| {
                if never {
                    st["phase"] = json!("Failed");
                }
                st["message"] = json!(e);
                st["reason"] = json!("RunContainerError");
                if st["containerStatuses"][0].is_object() {
                    st["containerStatuses"][0]["state"] =
                        json!({"waiting": {"reason": "RunContainerError", "message": e}});
                }
            });
            stop.cancelled().await;
        }
        pid_slot.store(0, Ordering::SeqCst);
        lock(&self.metrics).remove(&(ns.clone(), name.clone()));
        // A deleted pod is removed from the store once its process is gone.
        // Its directory stays (logs and token remain readable for tests) until
        // a new pod of the same name starts or the cluster stops.
        if let Some(cur) = store.get(by_kind("Pod"), &ns, &name)
            && uid_of(&cur) == uid
            && is_terminating(&cur)
        {
            let _ = store.remove(by_kind("Pod"), &ns, &name, Some(&uid));
        }
        lock(&self.runtimes).remove(&uid);
    }

    #[allow(clippy::too_many_lines)]
    async fn run_pod_inner(
        &self,
        store: &Arc<Store>,
        pod: &Value,
        stop: &CancellationToken,
        grace: &AtomicI64,
        pid_slot: &AtomicU32,
    ) -> Result<(), String> {
        let ns = namespace_of(pod).to_owned();
        let name = name_of(pod).to_owned();
        let uid = uid_of(pod).to_owned();
        let container = pod
            .pointer("/spec/containers/0")
            .cloned()
            .ok_or_else(|| "pod has no containers".to_owned())?;
        let cname = container
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("main")
            .to_owned();
        let ports: Vec<(String, u16)> = container
            .get("ports")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| {
                        let n = u16::try_from(p.get("containerPort")?.as_u64()?).ok()?;
                        Some((p.get("name").and_then(Value::as_str).unwrap_or("").to_owned(), n))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let port_numbers: Vec<u16> = ports.iter().map(|(_, p)| *p).collect();
        let ip = lock(&self.ips)
            .allocate(&port_numbers)
            .ok_or_else(|| "no free loopback address".to_owned())?;
        let node = self.settings.nodes
            [self.node_rr.fetch_add(1, Ordering::Relaxed) % self.settings.nodes.len().max(1)]
        .clone();
        let now = now_rfc3339();
        let image = container.get("image").cloned().unwrap_or(json!(""));
        let scheduled = store.update(by_kind("Pod"), &ns, &name, |o| {
            if uid_of(o) != uid || is_terminating(o) {
                return Err(ApiError::Conflict {
                    res: by_kind("Pod"),
                    name: name.clone(),
                });
            }
            o["spec"]["nodeName"] = json!(node);
            o["status"] = json!({
                "phase": "Pending",
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": ip.to_string(),
                "podIPs": [{"ip": ip.to_string()}],
                "startTime": now,
                "qosClass": "BestEffort",
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": now},
                    {"type": "Ready", "status": "False", "lastTransitionTime": now},
                ],
                "containerStatuses": [{"name": cname, "image": image, "imageID": "", "ready": false,
                    "started": false, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}],
            });
            Ok(())
        });
        let pod = match scheduled {
            Ok(p) => p,
            Err(_) => {
                // Deleted before it was scheduled.
                stop.cancelled().await;
                return Ok(());
            }
        };
        // Like an emptyDir, the directory belongs to this pod incarnation: a
        // new pod with the same name starts empty (no stale token).
        let dir = self.pod_dir(&ns, &name);
        if stop.is_cancelled() {
            return Ok(());
        }
        let _ = std::fs::remove_dir_all(&dir);
        // `create_dir`, not `create_dir_all`: once the cluster removed its work
        // directory, a late pod must not recreate it.
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let env = self.environment(store, &pod, &container, ip, &dir);
        let expand = |s: &str| expand_vars(s, &env);
        let mut argv: Vec<String> = match container.get("command").and_then(Value::as_array) {
            Some(c) if !c.is_empty() => c.iter().filter_map(Value::as_str).map(&expand).collect(),
            _ => vec!["skipper".into()],
        };
        match container.get("args").and_then(Value::as_array) {
            Some(a) => argv.extend(a.iter().filter_map(Value::as_str).map(&expand)),
            None if container.get("command").is_none() => argv.push("fixture".into()),
            None => {}
        }
        let program = if argv[0] == "skipper" {
            self.settings.skipper_exe.clone()
        } else {
            PathBuf::from(&argv[0])
        };
        let log = std::fs::File::create(dir.join("log")).map_err(|e| format!("creating log: {e}"))?;
        let log2 = log.try_clone().map_err(|e| format!("creating log: {e}"))?;
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(&env)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", program.display()))?;
        let pid = child.id().unwrap_or(0);
        pid_slot.store(pid, Ordering::SeqCst);
        let started = now_rfc3339();
        let _ = update_pod(store, &ns, &name, &uid, |st| {
            st["phase"] = json!("Running");
            st["containerStatuses"][0]["started"] = json!(true);
            st["containerStatuses"][0]["containerID"] = json!(format!("sim://{pid}"));
            st["containerStatuses"][0]["state"] = json!({"running": {"startedAt": started}});
        });
        let probe = Probe::of(&container, &ports, ip);
        // An explicit readinessProbe keeps running after Ready (every
        // periodSeconds; failureThreshold failures make the pod unready).
        let recheck = container.get("readinessProbe").is_some_and(Value::is_object);
        let period = Duration::from_secs(
            container
                .pointer("/readinessProbe/periodSeconds")
                .and_then(Value::as_u64)
                .unwrap_or(10)
                .max(1),
        );
        let failure_threshold = container
            .pointer("/readinessProbe/failureThreshold")
            .and_then(Value::as_u64)
            .unwrap_or(3)
            .max(1);
        let probe_timeout = Duration::from_secs(
            container
                .pointer("/readinessProbe/timeoutSeconds")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .max(1),
        );
        let mut failures = 0u64;
        let mut ready = false;
        let mut next_probe = tokio::time::Instant::now();
        let mut metrics_tick = tokio::time::interval(self.settings.metrics_interval);
        let mut last_sample: Option<(u64, Instant)> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => {
                    let grace = Duration::from_secs(u64::try_from(grace.load(Ordering::SeqCst)).unwrap_or(0));
                    if !grace.is_zero() {
                        signal(pid, nix::sys::signal::Signal::SIGTERM);
                        if tokio::time::timeout(grace, child.wait()).await.is_ok() {
                            signal(pid, nix::sys::signal::Signal::SIGKILL);
                            return Ok(());
                        }
                    }
                    signal(pid, nix::sys::signal::Signal::SIGKILL);
                    let _ = child.kill().await;
                    return Ok(());
                }
                status = child.wait() => {
                    let code = status.ok().and_then(|s| s.code()).unwrap_or(137);
                    tracing::info!(pod = %name, namespace = %ns, code, "pod process exited");
                    // Whatever the process left behind in its group goes with it.
                    signal(pid, nix::sys::signal::Signal::SIGKILL);
                    pid_slot.store(0, Ordering::SeqCst);
                    let finished = now_rfc3339();
                    let restart_policy = pod.pointer("/spec/restartPolicy").and_then(Value::as_str).unwrap_or("Always");
                    let _ = update_pod(store, &ns, &name, &uid, |st| {
                        let terminated = json!({"terminated": {
                            "exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" },
                            "finishedAt": finished}});
                        set_condition(st, "Ready", false);
                        set_condition(st, "ContainersReady", false);
                        st["containerStatuses"][0]["ready"] = json!(false);
                        st["containerStatuses"][0]["started"] = json!(false);
                        if restart_policy == "Never" || (restart_policy == "OnFailure" && code == 0) {
                            st["phase"] = json!(if code == 0 { "Succeeded" } else { "Failed" });
                            st["containerStatuses"][0]["state"] = terminated;
                        } else {
                            // The kubelet would restart it; the simulator restarts
                            // nothing, so the pod stays Running and unready.
                            st["containerStatuses"][0]["lastState"] = terminated;
                            st["containerStatuses"][0]["state"] = json!({"waiting": {
                                "reason": "CrashLoopBackOff",
                                "message": "the simulator does not restart containers"}});
                        }
                    });
                    stop.cancelled().await;
                    return Ok(());
                }
                () = tokio::time::sleep_until(next_probe), if !ready || recheck => {
                    let ok = probe.check(probe_timeout).await;
                    failures = if ok { 0 } else { failures + 1 };
                    let flip = if ready { failures >= failure_threshold } else { ok };
                    if flip {
                        ready = !ready;
                        let _ = update_pod(store, &ns, &name, &uid, |st| {
                            set_condition(st, "Ready", ready);
                            set_condition(st, "ContainersReady", ready);
                            st["containerStatuses"][0]["ready"] = json!(ready);
                        });
                    }
                    next_probe = tokio::time::Instant::now()
                        + if ready { period } else { self.settings.probe_interval };
                }
                _ = metrics_tick.tick() => {
                    if let Some(sample) = sample_proc(pid) {
                        let now = Instant::now();
                        if let Some((ticks, at)) = last_sample {
                            let elapsed = now.duration_since(at);
                            let used_ms = sample.0.saturating_sub(ticks) * 10;
                            let cpu_millis = if elapsed.as_millis() == 0 { 0 } else {
                                u64::try_from(u128::from(used_ms) * 1000 / elapsed.as_millis()).unwrap_or(u64::MAX)
                            };
                            lock(&self.metrics).insert((ns.clone(), name.clone()), Usage {
                                container: cname.clone(),
                                cpu_millis,
                                memory_bytes: sample.1,
                                timestamp: now_rfc3339(),
                                window: elapsed,
                            });
                        }
                        last_sample = Some((sample.0, now));
                    }
                }
            }
        }
    }

    fn environment(
        &self,
        store: &Store,
        pod: &Value,
        container: &Value,
        ip: Ipv4Addr,
        dir: &std::path::Path,
    ) -> BTreeMap<String, String> {
        let ns = namespace_of(pod);
        let mut env = BTreeMap::new();
        for var in ["PATH", "HOME", "LANG", "RUST_BACKTRACE"] {
            if let Ok(v) = std::env::var(var) {
                env.insert(var.to_owned(), v);
            }
        }
        let dir = dir.display().to_string();
        env.insert("POD_DIR".into(), dir.clone());
        env.insert("TMPDIR".into(), dir);
        env.insert("POD_IP".into(), ip.to_string());
        env.insert("POD_NAME".into(), name_of(pod).to_owned());
        env.insert("POD_NAMESPACE".into(), ns.to_owned());
        env.insert("SKIPPER_HOST".into(), ip.to_string());
        env.insert(
            "KUBECONFIG".into(),
            self.settings.kubeconfig.display().to_string(),
        );
        // `skipper fixture` exits when the simulator is gone (even after SIGKILL).
        env.insert("SKIPPER_EXIT_WITH_PARENT".into(), std::process::id().to_string());
        let data_of = |kind: &str, name: &str| -> BTreeMap<String, String> {
            let Some(obj) = store.get(by_kind(kind), ns, name) else {
                return BTreeMap::new();
            };
            let mut out = BTreeMap::new();
            if let Some(d) = obj.get("data").and_then(Value::as_object) {
                for (k, v) in d {
                    let v = v.as_str().unwrap_or("");
                    let v = if kind == "Secret" {
                        base64::engine::general_purpose::STANDARD
                            .decode(v)
                            .ok()
                            .and_then(|b| String::from_utf8(b).ok())
                            .unwrap_or_default()
                    } else {
                        v.to_owned()
                    };
                    out.insert(k.clone(), v);
                }
            }
            if let Some(d) = obj.get("stringData").and_then(Value::as_object) {
                for (k, v) in d {
                    out.insert(k.clone(), v.as_str().unwrap_or("").to_owned());
                }
            }
            out
        };
        if let Some(from) = container.get("envFrom").and_then(Value::as_array) {
            for src in from {
                let prefix = src.get("prefix").and_then(Value::as_str).unwrap_or("");
                let (kind, r) = if let Some(r) = src.get("configMapRef") {
                    ("ConfigMap", r)
                } else if let Some(r) = src.get("secretRef") {
                    ("Secret", r)
                } else {
                    continue;
                };
                let name = r.get("name").and_then(Value::as_str).unwrap_or("");
                for (k, v) in data_of(kind, name) {
                    env.insert(format!("{prefix}{k}"), v);
                }
            }
        }
        if let Some(vars) = container.get("env").and_then(Value::as_array) {
            for var in vars {
                let Some(name) = var.get("name").and_then(Value::as_str) else {
                    continue;
                };
                let value = if let Some(v) = var.get("value").and_then(Value::as_str) {
                    expand_vars(v, &env)
                } else if let Some(path) = var
                    .pointer("/valueFrom/fieldRef/fieldPath")
                    .and_then(Value::as_str)
                {
                    match path {
                        "status.podIP" => ip.to_string(),
                        "status.hostIP" => "127.0.0.1".into(),
                        "metadata.name" => name_of(pod).to_owned(),
                        "metadata.namespace" => ns.to_owned(),
                        "metadata.uid" => uid_of(pod).to_owned(),
                        "spec.nodeName" => pod
                            .pointer("/spec/nodeName")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                        "spec.serviceAccountName" => pod
                            .pointer("/spec/serviceAccountName")
                            .and_then(Value::as_str)
                            .unwrap_or("default")
                            .to_owned(),
                        other => label_field(pod, other).unwrap_or_default(),
                    }
                } else if let Some(r) = var.pointer("/valueFrom/secretKeyRef") {
                    let n = r.get("name").and_then(Value::as_str).unwrap_or("");
                    let k = r.get("key").and_then(Value::as_str).unwrap_or("");
                    data_of("Secret", n).remove(k).unwrap_or_default()
                } else if let Some(r) = var.pointer("/valueFrom/configMapKeyRef") {
                    let n = r.get("name").and_then(Value::as_str).unwrap_or("");
                    let k = r.get("key").and_then(Value::as_str).unwrap_or("");
                    data_of("ConfigMap", n).remove(k).unwrap_or_default()
                } else {
                    String::new()
                };
                env.insert(name.to_owned(), value);
            }
        }
        env
    }
}

/// `metadata.labels['k']` / `metadata.annotations['k']` field paths.
fn label_field(pod: &Value, path: &str) -> Option<String> {
    let (map, rest) = if let Some(r) = path.strip_prefix("metadata.labels['") {
        ("labels", r)
    } else if let Some(r) = path.strip_prefix("metadata.annotations['") {
        ("annotations", r)
    } else {
        return None;
    };
    let key = rest.strip_suffix("']")?;
    pod.get("metadata")?
        .get(map)?
        .get(key)?
        .as_str()
        .map(str::to_owned)
}

/// Kubernetes `$(VAR)` expansion; `$$` escapes; unknown references stay as written.
fn expand_vars(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(a) = after.strip_prefix('(')
            && let Some(end) = a.find(')')
        {
            let name = &a[..end];
            match env.get(name) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &a[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn set_condition(status: &mut Value, kind: &str, ok: bool) {
    let now = now_rfc3339();
    let value = if ok { "True" } else { "False" };
    if let Some(cs) = status["conditions"].as_array_mut() {
        for c in cs.iter_mut() {
            if c["type"] == kind && c["status"] != value {
                c["status"] = json!(value);
                c["lastTransitionTime"] = json!(now);
            }
        }
    }
}

/// Edits the status of the pod with this uid.
fn update_pod(
    store: &Store,
    ns: &str,
    name: &str,
    uid: &str,
    f: impl FnOnce(&mut Value),
) -> Result<Value, ApiError> {
    store.update(by_kind("Pod"), ns, name, |o| {
        if uid_of(o) != uid {
            return Err(ApiError::NotFound {
                res: by_kind("Pod"),
                name: name.to_owned(),
            });
        }
        f(&mut o["status"]);
        Ok(())
    })
}

/// `(utime + stime ticks, RSS bytes)` of a process.
fn sample_proc(pid: u32) -> Option<(u64, u64)> {
    if pid == 0 {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    Some((ticks, rss_kb * 1024))
}

/// How readiness is checked.
enum Probe {
    Http { addr: SocketAddr, path: String },
    Tcp(SocketAddr),
    Started,
}

impl Probe {
    fn of(container: &Value, ports: &[(String, u16)], ip: Ipv4Addr) -> Self {
        let port_of = |v: &Value| -> Option<u16> {
            if let Some(n) = v.as_u64() {
                return u16::try_from(n).ok();
            }
            let s = v.as_str()?;
            s.parse()
                .ok()
                .or_else(|| ports.iter().find(|(n, _)| n == s).map(|(_, p)| *p))
        };
        if let Some(h) = container.pointer("/readinessProbe/httpGet")
            && let Some(port) = h.get("port").and_then(port_of)
        {
            return Self::Http {
                addr: SocketAddr::from((ip, port)),
                path: h.get("path").and_then(Value::as_str).unwrap_or("/").to_owned(),
            };
        }
        if let Some(port) = container
            .pointer("/readinessProbe/tcpSocket/port")
            .and_then(port_of)
        {
            return Self::Tcp(SocketAddr::from((ip, port)));
        }
        match ports.first() {
            Some((_, p)) => Self::Tcp(SocketAddr::from((ip, *p))),
            None => Self::Started,
        }
    }

    async fn check(&self, timeout: Duration) -> bool {
        let attempt = async {
            match self {
                Self::Started => true,
                Self::Tcp(addr) => tokio::net::TcpStream::connect(addr).await.is_ok(),
                Self::Http { addr, path } => {
                    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
                        return false;
                    };
                    let req =
                        format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.33\r\n\r\n");
                    if s.write_all(req.as_bytes()).await.is_err() {
                        return false;
                    }
                    let mut buf = [0u8; 32];
                    let mut n = 0;
                    while n < 12 {
                        match s.read(&mut buf[n..]).await {
                            Ok(0) | Err(_) => return false,
                            Ok(k) => n += k,
                        }
                    }
                    let line = String::from_utf8_lossy(&buf[..n]);
                    line.get(9..12)
                        .and_then(|c| c.parse::<u16>().ok())
                        .is_some_and(|c| (200..400).contains(&c))
                }
            }
        };
        tokio::time::timeout(timeout, attempt).await.unwrap_or(false)
    }
}

/// Whether the pod is Ready (re-exported for tests and helpers).
#[must_use]
pub fn is_ready(pod: &Value) -> bool {
    pod_ready(pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_like_kubernetes() {
        let env: BTreeMap<String, String> = [("A".to_owned(), "x".to_owned())].into();
        assert_eq!(expand_vars("$(A)/t $(B) $$(A)", &env), "x/t $(B) $(A)");
    }

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
}
