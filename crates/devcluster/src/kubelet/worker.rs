//! The pod worker: one task per pod bound to one of the agent's nodes. It
//! sets up the sandbox (pod IP and network, directories, volumes), runs the init
//! containers in order to completion, then every container and sidecar;
//! probes them; restarts them under the pod's `restartPolicy` with the
//! crash back-off; reports the pod status through `pods/{name}/status`;
//! and, once the pod is deleted, stops its containers (`preStop`, then
//! SIGTERM to each main process, SIGKILL at the deadline), reports the
//! final status and deletes the pod for good (grace 0, uid precondition).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ConfigMap, Container, LifecycleHandler, Pod, PodStatus, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::agent::Ctx;
use super::env::{self, PodFacts, Sources};
use super::network::{NetworkError, PodLink, PodNetwork};
use super::probe::{self, Kind};
use super::restart::{Backoff, RestartPolicy, Role, go_duration, restarts};
use super::runtime::{self, Exit, LaunchError};
use super::sandbox::{MountSpec, RunSpec};
use super::status::{self, ContainerView, State, Terminated};
use super::volumes::{Context as VolumeContext, Volumes};

/// The smallest grace a container gets after its `preStop` hook (the kubelet's).
const MIN_GRACE: Duration = Duration::from_secs(2);
/// How long a container whose configuration cannot be resolved waits before the next try.
const CONFIG_RETRY: Duration = Duration::from_secs(2);
/// The first wait before volumes that could not be set up are tried again
/// (doubling, as the kubelet's volume manager does, up to [`SANDBOX_RETRY_MAX`]).
const SANDBOX_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between two tries to set up volumes.
const SANDBOX_RETRY_MAX: Duration = Duration::from_secs(30);

/// What the worker learns from the API: the latest pod, or `None` once the
/// pod is gone from the API server.
pub type Update = Option<Arc<Pod>>;

/// Which container of the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotId {
    init: bool,
    index: usize,
}

enum Event {
    Exited { slot: SlotId, instance: u64, exit: Exit },
    Probe { slot: SlotId, change: probe::Change },
}

/// A running container instance.
struct Running {
    instance: u64,
    pid: u32,
    container_id: String,
    started_at: Timestamp,
    /// Cancels the probes of this instance.
    probes: CancellationToken,
    started_tx: watch::Sender<bool>,
    exit: watch::Receiver<Option<Exit>>,
    /// The environment it runs with (for `preStop` exec hooks).
    env: Arc<Vec<(String, String)>>,
    /// A stop (kill for restart or termination) is under way.
    stopping: bool,
}

/// One container of the pod and its history.
struct Slot {
    spec: Container,
    role: Role,
    restart_count: i32,
    state: State,
    last_terminated: Option<Terminated>,
    backoff: Backoff,
    running: Option<Running>,
    ready: bool,
    started: bool,
    /// Ran for the last time (a completed init container, or no restart due).
    done: bool,
    /// When the container may start (again); `None` while it runs or is done.
    start_at: Option<Instant>,
    /// The instant its last instance finished (back-off is counted from it).
    finished: Option<Instant>,
    /// Whether it has ever been started.
    ever_started: bool,
}

impl Slot {
    fn new(spec: Container, role: Role, waiting_reason: &str) -> Self {
        Self {
            spec,
            role,
            restart_count: 0,
            state: State::Waiting {
                reason: waiting_reason.into(),
                message: None,
            },
            last_terminated: None,
            backoff: Backoff::default(),
            running: None,
            ready: false,
            started: false,
            done: false,
            start_at: None,
            finished: None,
            ever_started: false,
        }
    }

    fn view(&self) -> ContainerView {
        ContainerView {
            name: self.spec.name.clone(),
            image: self.spec.image.clone().unwrap_or_default(),
            state: self.state.clone(),
            last_terminated: self.last_terminated.clone(),
            restart_count: self.restart_count,
            ready: self.ready,
            started: self.started,
            container_id: self.running.as_ref().map(|r| r.container_id.clone()).or_else(|| {
                match &self.state {
                    State::Terminated(t) => t.container_id.clone(),
                    _ => None,
                }
            }),
        }
    }
}

/// Probes run against this container through the shim.
#[derive(Clone)]
struct ContainerExec {
    shim: PathBuf,
    pid: u32,
    env: Arc<Vec<(String, String)>>,
    cwd: Option<PathBuf>,
}

impl probe::Exec for ContainerExec {
    async fn exec(&self, command: &[String], timeout: Duration) -> Result<i32, String> {
        runtime::exec(
            &self.shim,
            self.pid,
            &self.env,
            self.cwd.as_deref(),
            command,
            timeout,
        )
        .await
    }
}

/// The worker of one pod.
pub struct Worker {
    ctx: Arc<Ctx>,
    node: String,
    pod: Arc<Pod>,
    uid: String,
    ns: String,
    name: String,
    dir: PathBuf,
    ip: Option<Ipv4Addr>,
    /// The pod's network namespace and veth on a bridge network.
    link: Option<PodLink>,
    start_time: Timestamp,
    volumes: Volumes,
    sandbox_ready: bool,
    sandbox_message: Option<String>,
    /// The wait before the next try to set up the sandbox.
    sandbox_retry: Duration,
    init: Vec<Slot>,
    regular: Vec<Slot>,
    events_tx: mpsc::Sender<Event>,
    events: mpsc::Receiver<Event>,
    probe_tx: mpsc::Sender<(SlotId, probe::Change)>,
    probe_rx: mpsc::Receiver<(SlotId, probe::Change)>,
    next_instance: u64,
    terminating: bool,
    /// No container runs or will run again (the pod reached Succeeded/Failed).
    terminal: bool,
    written: Option<PodStatus>,
    dirty: bool,
}

impl Worker {
    /// A worker for `pod` on `node`.
    #[must_use]
    pub fn new(ctx: Arc<Ctx>, node: String, pod: Arc<Pod>) -> Self {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let dir = ctx.pod_dir(&ns, &name);
        let spec = pod.spec.clone().unwrap_or_default();
        let has_init = spec.init_containers.as_ref().is_some_and(|c| !c.is_empty());
        let waiting = if has_init {
            "PodInitializing"
        } else {
            "ContainerCreating"
        };
        let init = spec
            .init_containers
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                let role = if c.restart_policy.as_deref() == Some("Always") {
                    Role::Sidecar
                } else {
                    Role::Init
                };
                Slot::new(c, role, waiting)
            })
            .collect();
        let regular = spec
            .containers
            .into_iter()
            .map(|c| Slot::new(c, Role::Regular, waiting))
            .collect();
        let (events_tx, events) = mpsc::channel(64);
        let (probe_tx, probe_rx) = mpsc::channel(64);
        Self {
            volumes: Volumes::new(dir.join("volumes")),
            ctx,
            node,
            pod,
            uid,
            ns,
            name,
            dir,
            ip: None,
            link: None,
            start_time: Timestamp::now(),
            sandbox_ready: false,
            sandbox_message: None,
            sandbox_retry: SANDBOX_RETRY,
            init,
            regular,
            events_tx,
            events,
            probe_tx,
            probe_rx,
            next_instance: 1,
            terminating: false,
            terminal: false,
            written: None,
            dirty: true,
        }
    }

    fn slot(&mut self, id: SlotId) -> &mut Slot {
        if id.init {
            &mut self.init[id.index]
        } else {
            &mut self.regular[id.index]
        }
    }

    fn slot_ids(&self) -> Vec<SlotId> {
        (0..self.init.len())
            .map(|index| SlotId { init: true, index })
            .chain((0..self.regular.len()).map(|index| SlotId { init: false, index }))
            .collect()
    }

    fn policy(&self) -> RestartPolicy {
        RestartPolicy::parse(self.pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()))
    }

    fn facts(&self) -> PodFacts<'_> {
        let (cpu, memory) = self.ctx.node_allocatable();
        PodFacts {
            pod: &self.pod,
            pod_ip: self.ip.map(|ip| ip.to_string()).unwrap_or_default(),
            host_ip: self.ctx.host_ip().to_string(),
            node_name: self.node.clone(),
            node_cpu_milli: cpu,
            node_memory: memory,
        }
    }

    fn deletion_grace(&self) -> Duration {
        let secs = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30);
        Duration::from_secs(u64::try_from(secs).unwrap_or(0))
    }

    /// Runs the pod until it is deleted (or `kill` fires: everything stops at once).
    pub async fn run(mut self, mut updates: watch::Receiver<Update>, kill: CancellationToken) {
        let containers = self
            .init
            .iter()
            .chain(&self.regular)
            .map(|s| s.spec.name.clone())
            .collect();
        self.ctx.registry.add(&self.uid, &self.ns, &self.name, containers);
        self.ctx.registry.set_labels(
            &self.uid,
            self.pod.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()),
        );
        let removed = self.main_loop(&mut updates, &kill).await;
        if kill.is_cancelled() {
            self.kill_all();
        } else if removed {
            // Gone from the API (forced deletion): stop quickly, report nothing.
            self.terminate(MIN_GRACE, &mut updates, &kill, false).await;
        } else {
            let grace = self.deletion_grace();
            self.terminate(grace, &mut updates, &kill, true).await;
            if !kill.is_cancelled() {
                self.finish().await;
            }
        }
        self.release();
        // The veth and the network namespace go with the pod (`ip` runs off
        // the async workers).
        if let Some(link) = self.link.take() {
            let _ = tokio::task::spawn_blocking(move || drop(link)).await;
        }
    }

    /// Returns `true` when the pod disappeared from the API, `false` when it
    /// is being deleted (or `kill` fired).
    async fn main_loop(&mut self, updates: &mut watch::Receiver<Update>, kill: &CancellationToken) -> bool {
        let mut volume_tick = tokio::time::interval(self.ctx.settings.volume_resync);
        volume_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        volume_tick.tick().await;
        loop {
            // A cancelled node starts nothing more: a container due to
            // (re)start as the node stops would recreate the pod's
            // directories after the node removed them.
            if self.pod.metadata.deletion_timestamp.is_some() || kill.is_cancelled() {
                return false;
            }
            if !self.sandbox_ready {
                self.setup_sandbox().await;
            }
            let wake = if self.sandbox_ready && !self.terminal {
                self.start_due().await
            } else if self.sandbox_ready {
                None
            } else {
                let wait = self.sandbox_retry;
                self.sandbox_retry = (wait * 2).min(SANDBOX_RETRY_MAX);
                Some(Instant::now() + wait)
            };
            self.check_terminal();
            self.write_status().await;
            let retry_status = self.dirty.then(|| Instant::now() + Duration::from_millis(500));
            let wake = match (wake, retry_status) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            tokio::select! {
                biased;
                () = kill.cancelled() => return false,
                Some(ev) = self.events.recv() => self.handle(ev),
                Some((slot, change)) = self.probe_rx.recv() => self.handle(Event::Probe { slot, change }),
                changed = updates.changed() => {
                    let latest = updates.borrow_and_update().clone();
                    match (changed, latest) {
                        (Ok(()), Some(pod)) => {
                            if let Some(labels) = &pod.metadata.labels {
                                self.ctx.registry.set_labels(&self.uid, labels);
                            }
                            self.pod = pod;
                        }
                        _ => return true,
                    }
                }
                () = sleep_until(wake) => {}
                _ = volume_tick.tick(), if self.sandbox_ready && !self.terminal => self.refresh_volumes().await,
            }
        }
    }

    /// IP, directories, `/etc/hosts` and volumes.
    async fn setup_sandbox(&mut self) {
        if self.ip.is_none() {
            let ports: Vec<u16> = self
                .regular
                .iter()
                .chain(&self.init)
                .flat_map(|s| s.spec.ports.iter().flatten())
                .filter_map(|p| u16::try_from(p.container_port).ok())
                .collect();
            match &self.ctx.settings.network {
                PodNetwork::Loopback => {
                    self.ip = self.ctx.allocate_ip(&ports);
                    if self.ip.is_none() {
                        self.sandbox_message = Some("no free loopback address for the pod".into());
                        self.dirty = true;
                        return;
                    }
                }
                // `hostNetwork`: the host's namespace, the node's address.
                PodNetwork::Bridge(_)
                    if self.pod.spec.as_ref().and_then(|s| s.host_network) == Some(true) =>
                {
                    self.ip = Some(self.ctx.host_ip());
                }
                // `ip` runs off the async workers.
                PodNetwork::Bridge(bridge) => match tokio::task::spawn_blocking({
                    let bridge = bridge.clone();
                    move || bridge.attach()
                })
                .await
                .unwrap_or_else(|e| Err(NetworkError::Interrupted(e.to_string())))
                {
                    Ok(link) => {
                        self.ip = Some(link.ip());
                        self.link = Some(link);
                    }
                    Err(e) => {
                        tracing::warn!(pod = %self.name, namespace = %self.ns, error = %e, "pod network setup failed; retrying");
                        self.sandbox_message = Some(format!("failed to set up the pod's network: {e}"));
                        self.dirty = true;
                        return;
                    }
                },
            }
            // The pod's directory belongs to this incarnation.
            let _ = std::fs::remove_dir_all(&self.dir);
            if let Err(e) = std::fs::create_dir_all(self.dir.join("volumes")) {
                self.sandbox_message = Some(format!("creating {}: {e}", self.dir.display()));
                self.dirty = true;
                return;
            }
            let _ = std::fs::write(self.dir.join("etc-hosts"), self.hosts_file());
        }
        let ctx_client = self.ctx.client(&self.node);
        let facts_pod = self.pod.clone();
        let facts = PodFacts {
            pod: &facts_pod,
            ..self.facts()
        };
        let vctx = VolumeContext {
            client: &ctx_client,
            facts: &facts,
        };
        match self.volumes.sync(&vctx).await {
            Ok(()) => {
                self.sandbox_ready = true;
                self.sandbox_message = None;
            }
            Err(e) => {
                tracing::info!(pod = %self.name, namespace = %self.ns, error = %e, "volume setup failed; retrying");
                self.sandbox_message = Some(e.to_string());
            }
        }
        self.dirty = true;
    }

    async fn refresh_volumes(&mut self) {
        let client = self.ctx.client(&self.node);
        let pod = self.pod.clone();
        let facts = PodFacts {
            pod: &pod,
            ..self.facts()
        };
        let vctx = VolumeContext {
            client: &client,
            facts: &facts,
        };
        if let Err(e) = self.volumes.sync(&vctx).await {
            tracing::debug!(pod = %self.name, error = %e, "volume refresh failed");
        }
    }

    fn hosts_file(&self) -> String {
        let hostname = self.hostname();
        let mut s = String::from(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n\
             fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n",
        );
        if let Some(ip) = self.ip {
            s.push_str(&format!("{ip}\t{hostname}\n"));
        }
        for alias in self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.host_aliases.as_ref())
            .into_iter()
            .flatten()
        {
            s.push_str(&format!(
                "\n# Entries added by HostAliases.\n{}\t{}\n",
                alias.ip,
                alias.hostnames.clone().unwrap_or_default().join("\t")
            ));
        }
        s
    }

    fn hostname(&self) -> String {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.hostname.clone())
            .unwrap_or_else(|| self.name.clone())
    }

    /// Starts every container that is due now; returns when to look again.
    async fn start_due(&mut self) -> Option<Instant> {
        let now = Instant::now();
        let mut wake: Option<Instant> = None;
        let mut note = |t: Instant| wake = Some(wake.map_or(t, |w: Instant| w.min(t)));
        // Init containers, in order: sidecars keep running, the others run to completion.
        let mut initialized = true;
        for index in 0..self.init.len() {
            let id = SlotId { init: true, index };
            let slot = &self.init[index];
            let role = slot.role;
            if role == Role::Init && slot.done {
                continue;
            }
            if slot.running.is_none() && !slot.done {
                match slot.start_at {
                    Some(t) if t > now => note(t),
                    _ => {
                        if let Some(t) = self.start(id).await {
                            note(t);
                        }
                    }
                }
            }
            let slot = &self.init[index];
            if role == Role::Init || !slot.started {
                initialized = false;
                break;
            }
        }
        if !initialized {
            return wake;
        }
        for index in 0..self.regular.len() {
            let id = SlotId { init: false, index };
            let slot = &self.regular[index];
            if slot.running.is_some() || slot.done {
                continue;
            }
            match slot.start_at {
                Some(t) if t > now => note(t),
                _ => {
                    if let Some(t) = self.start(id).await {
                        note(t);
                    }
                }
            }
        }
        wake
    }

    fn container_dirs(&self, name: &str) -> PathBuf {
        self.dir.join("containers").join(name)
    }

    fn log_path(&self, name: &str, restart: i32) -> PathBuf {
        self.dir.join("logs").join(name).join(format!("{restart}.log"))
    }

    /// Starts one container; returns a time to retry when it cannot start yet.
    async fn start(&mut self, id: SlotId) -> Option<Instant> {
        let now = Instant::now();
        let policy = self.ctx.settings.backoff;
        let restart = {
            let slot = self.slot(id);
            if slot.ever_started {
                if let Some(finished) = slot.finished {
                    slot.backoff.restarted(&policy, finished);
                }
                slot.restart_count + 1
            } else {
                0
            }
        };
        let spec = self.slot(id).spec.clone();
        let env = match self.environment(&spec).await {
            Ok(env) => env,
            Err(message) => {
                let slot = self.slot(id);
                slot.state = State::Waiting {
                    reason: "CreateContainerConfigError".into(),
                    message: Some(message),
                };
                slot.start_at = Some(now + CONFIG_RETRY);
                self.dirty = true;
                return Some(now + CONFIG_RETRY);
            }
        };
        let mounts = match self.mounts(&spec) {
            Ok(m) => m,
            Err(message) => {
                let slot = self.slot(id);
                slot.state = State::Waiting {
                    reason: "CreateContainerConfigError".into(),
                    message: Some(message),
                };
                slot.start_at = Some(now + CONFIG_RETRY);
                self.dirty = true;
                return Some(now + CONFIG_RETRY);
            }
        };
        let instance = self.next_instance;
        self.next_instance += 1;
        let container_id = format!("skipper://{:016x}", rand::random::<u64>());
        let log = self.log_path(&spec.name, restart);
        let stage = self.dir.join("sandbox").join(format!("{}-{instance}", spec.name));
        if let Some(parent) = log.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::create_dir_all(&stage);
        // From here until its exit is handled, a followed log of this instance goes on.
        self.ctx
            .registry
            .set_log(&self.uid, &spec.name, id.init, Some(log.clone()));
        let (argv, exe) = self.command(&spec, &env);
        let run = RunSpec {
            parent: std::process::id(),
            hostname: self.hostname(),
            mounts,
            stage,
            argv,
            exe,
            env: env.clone(),
            cwd: spec
                .working_dir
                .clone()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
            log,
            netns: self.link.as_ref().map(PodLink::netns_path),
        };
        let started_at = Timestamp::now();
        let launched = runtime::launch(&self.ctx.settings.skipper_exe, &run, &self.ctx.tracker).await;
        let started = match launched {
            Ok(s) => s,
            Err(e) => {
                let message = match e {
                    LaunchError::Start(m) => m,
                    other => other.to_string(),
                };
                tracing::info!(pod = %self.name, container = %spec.name, error = %message, "container did not start");
                self.ctx.registry.set_log(&self.uid, &spec.name, id.init, None);
                let finished_at = Timestamp::now();
                let slot = self.slot(id);
                slot.ever_started = true;
                slot.restart_count = restart;
                self.exited(
                    id,
                    Terminated {
                        exit_code: 128,
                        signal: None,
                        reason: "StartError".into(),
                        message: Some(message),
                        started_at: Some(started_at),
                        finished_at,
                        container_id: Some(container_id),
                    },
                );
                return self.slot(id).start_at;
            }
        };
        self.ctx.registry.set_pid(
            &self.uid,
            &spec.name,
            id.init,
            Some(started.pid),
            Some(started.shim_pid),
        );
        let probes = CancellationToken::new();
        let has_startup = spec.startup_probe.is_some();
        let (started_tx, started_rx) = watch::channel(!has_startup);
        {
            let slot = self.slot(id);
            slot.ever_started = true;
            slot.restart_count = restart;
            slot.state = State::Running { started_at };
            slot.start_at = None;
            slot.started = !has_startup;
            slot.ready = !has_startup && spec.readiness_probe.is_none();
            slot.running = Some(Running {
                instance,
                pid: started.pid,
                container_id,
                started_at,
                probes: probes.clone(),
                started_tx,
                exit: started.exit.clone(),
                env: Arc::new(env.clone()),
                stopping: false,
            });
        }
        self.dirty = true;
        self.watch_exit(id, instance, started.exit);
        self.start_probes(id, instance, &spec, started.pid, &env, started_rx, &probes);
        None
    }

    fn watch_exit(&self, slot: SlotId, instance: u64, mut exit: watch::Receiver<Option<Exit>>) {
        let tx = self.events_tx.clone();
        self.ctx.tracker.spawn(async move {
            let exit = loop {
                if let Some(e) = *exit.borrow_and_update() {
                    break e;
                }
                if exit.changed().await.is_err() {
                    return;
                }
            };
            let _ = tx.send(Event::Exited { slot, instance, exit }).await;
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn start_probes(
        &self,
        id: SlotId,
        instance: u64,
        spec: &Container,
        pid: u32,
        env: &[(String, String)],
        started: watch::Receiver<bool>,
        stop: &CancellationToken,
    ) {
        let Some(ip) = self.ip else { return };
        let target = probe::Target {
            pod_ip: ip.into(),
            ports: spec.ports.clone().unwrap_or_default(),
        };
        let exec = ContainerExec {
            shim: self.ctx.settings.skipper_exe.clone(),
            pid,
            env: Arc::new(env.to_vec()),
            cwd: spec
                .working_dir
                .clone()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
        };
        let started_at = Instant::now();
        for (kind, probe) in [
            (Kind::Startup, &spec.startup_probe),
            (Kind::Liveness, &spec.liveness_probe),
            (Kind::Readiness, &spec.readiness_probe),
        ] {
            let Some(p) = probe else { continue };
            let parsed = match probe::Spec::from_api(kind, p) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(pod = %self.name, container = %spec.name, error = %e, "probe ignored");
                    continue;
                }
            };
            let (tx, mut rx) = mpsc::channel(8);
            let out = self.probe_tx.clone();
            let stop_fwd = stop.clone();
            // Forward changes with the slot attached.
            self.ctx.tracker.spawn(async move {
                loop {
                    tokio::select! {
                        () = stop_fwd.cancelled() => return,
                        change = rx.recv() => match change {
                            Some(c) => if out.send((id, c)).await.is_err() { return },
                            None => return,
                        },
                    }
                }
            });
            self.ctx.tracker.spawn(probe::probe_loop(
                kind,
                parsed,
                target.clone(),
                exec.clone(),
                instance,
                started_at,
                started.clone(),
                tx,
                stop.clone(),
            ));
        }
    }

    async fn environment(&self, spec: &Container) -> Result<Vec<(String, String)>, String> {
        let (cms, secrets) = env::referenced(spec);
        let mut sources = Sources::default();
        for name in cms {
            let got = Api::<ConfigMap>::namespaced(self.ctx.client(&self.node), &self.ns)
                .get_opt(&name)
                .await
                .map_err(|e| format!("getting configmap {name:?}: {e}"))?;
            sources.config_maps.insert(
                name,
                got.map(|cm| {
                    let mut d: BTreeMap<String, Vec<u8>> = cm
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.into_bytes()))
                        .collect();
                    for (k, v) in cm.binary_data.unwrap_or_default() {
                        d.insert(k, v.0);
                    }
                    d
                }),
            );
        }
        for name in secrets {
            let got = Api::<Secret>::namespaced(self.ctx.client(&self.node), &self.ns)
                .get_opt(&name)
                .await
                .map_err(|e| format!("getting secret {name:?}: {e}"))?;
            sources.secrets.insert(
                name,
                got.map(|s| {
                    s.data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect()
                }),
            );
        }
        let service = env::kubernetes_service(&self.ctx.api_host(), self.ctx.api_port());
        let mut built = env::build(&self.facts(), spec, &sources, &service).map_err(|e| e.to_string())?;
        built.entry("HOME".into()).or_insert_with(|| "/root".into());
        built.entry("HOSTNAME".into()).or_insert_with(|| self.hostname());
        built
            .entry("PATH".into())
            .or_insert_with(|| super::sandbox::DEFAULT_PATH.into());
        Ok(built.into_iter().collect())
    }

    /// `command` and `args` expanded; `skipper` (the image's binary) runs
    /// the agent's own executable; no command runs the image entrypoint
    /// `skipper` (with `fixture` when there are no args either).
    fn command(&self, spec: &Container, env: &[(String, String)]) -> (Vec<String>, Option<PathBuf>) {
        let map: BTreeMap<&str, &str> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let lookup = |n: &str| map.get(n).map(|v| (*v).to_owned());
        let expand = |s: &String| env::expand(s, &lookup);
        let mut argv: Vec<String> = match spec.command.as_ref().filter(|c| !c.is_empty()) {
            Some(c) => c.iter().map(expand).collect(),
            None => vec!["skipper".into()],
        };
        match spec.args.as_ref() {
            Some(a) => argv.extend(a.iter().map(expand)),
            None if spec.command.is_none() => argv.push("fixture".into()),
            None => {}
        }
        let exe = (argv[0] == "skipper").then(|| self.ctx.settings.skipper_exe.clone());
        (argv, exe)
    }

    /// The bind mounts of a container: private `/tmp` and home, its volume
    /// mounts and `/etc/hosts`, parents before children.
    fn mounts(&self, spec: &Container) -> Result<Vec<MountSpec>, String> {
        let mut mounts: Vec<MountSpec> = Vec::new();
        for m in spec.volume_mounts.iter().flatten() {
            let vol = self
                .volumes
                .mounted()
                .iter()
                .find(|v| v.name == m.name)
                .ok_or_else(|| format!("volume {:?} is not set up (no such volume in the pod)", m.name))?;
            let sub = m
                .sub_path_expr
                .as_ref()
                .filter(|s| !s.is_empty())
                .map(|e| env::expand(e, &|_| None))
                .or_else(|| m.sub_path.clone())
                .filter(|s| !s.is_empty());
            let source = match sub {
                Some(sub) => {
                    if Path::new(&sub).is_absolute() || sub.split('/').any(|c| c == "..") {
                        return Err(format!("subPath {sub:?} must be a relative path without '..'"));
                    }
                    let p = vol.path.join(&sub);
                    if !p.exists() && !vol.projected {
                        std::fs::create_dir_all(&p).map_err(|e| format!("creating subPath {sub:?}: {e}"))?;
                    }
                    let real = std::fs::canonicalize(&p).map_err(|e| format!("subPath {sub:?}: {e}"))?;
                    let root = std::fs::canonicalize(&vol.path).map_err(|e| e.to_string())?;
                    if !real.starts_with(&root) {
                        return Err(format!("subPath {sub:?} leaves the volume"));
                    }
                    real
                }
                None => vol.path.clone(),
            };
            mounts.push(MountSpec {
                source,
                target: PathBuf::from(&m.mount_path),
                read_only: m.read_only == Some(true) || vol.projected,
            });
        }
        let cdir = self.container_dirs(&spec.name);
        let _ = std::fs::remove_dir_all(&cdir);
        for (target, sub, mode) in [("/tmp", "tmp", 0o1777), ("/root", "home", 0o700)] {
            if mounts.iter().any(|m| m.target == Path::new(target)) {
                continue;
            }
            let dir = cdir.join(sub);
            std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            use std::os::unix::fs::PermissionsExt as _;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode));
            mounts.push(MountSpec {
                source: dir,
                target: PathBuf::from(target),
                read_only: false,
            });
        }
        if !mounts.iter().any(|m| m.target == Path::new("/etc/hosts")) {
            mounts.push(MountSpec {
                source: self.dir.join("etc-hosts"),
                target: PathBuf::from("/etc/hosts"),
                read_only: false,
            });
        }
        mounts.sort_by(|a, b| {
            a.target
                .components()
                .count()
                .cmp(&b.target.components().count())
                .then_with(|| a.target.cmp(&b.target))
        });
        Ok(mounts)
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Exited { slot, instance, exit } => {
                let s = self.slot(slot);
                let Some(running) = s.running.as_ref().filter(|r| r.instance == instance) else {
                    return;
                };
                running.probes.cancel();
                let term = Terminated {
                    exit_code: exit.code,
                    signal: None,
                    reason: if exit.code == 0 { "Completed" } else { "Error" }.into(),
                    message: None,
                    started_at: Some(running.started_at),
                    finished_at: exit.finished_at,
                    container_id: Some(running.container_id.clone()),
                };
                let name = s.spec.name.clone();
                self.ctx.registry.set_pid(&self.uid, &name, slot.init, None, None);
                self.ctx.registry.set_log(&self.uid, &name, slot.init, None);
                tracing::info!(pod = %self.name, namespace = %self.ns, container = %name, code = exit.code, "container exited");
                self.exited(slot, term);
            }
            Event::Probe { slot, change } => {
                let pod = self.name.clone();
                let s = self.slot(slot);
                let Some(running) = s.running.as_ref().filter(|r| r.instance == change.instance) else {
                    return;
                };
                let mut kill = None;
                match (change.kind, change.success) {
                    (Kind::Startup, true) => {
                        let _ = running.started_tx.send(true);
                        s.started = true;
                        if s.spec.readiness_probe.is_none() {
                            s.ready = true;
                        }
                    }
                    (Kind::Readiness, ok) => {
                        if !ok {
                            tracing::info!(pod = %pod, container = %s.spec.name,
                                message = change.message.as_deref().unwrap_or(""), "readiness probe failed");
                        }
                        s.ready = ok && s.started;
                    }
                    (Kind::Liveness | Kind::Startup, false) => {
                        tracing::info!(pod = %pod, container = %s.spec.name, probe = change.kind.field(),
                            message = change.message.as_deref().unwrap_or(""), "probe failed; restarting the container");
                        kill = Some(change.kind);
                    }
                    (Kind::Liveness, true) => {}
                }
                if let Some(kind) = kill {
                    let grace = self.kill_grace(slot, kind);
                    self.stop(slot, grace);
                }
                self.dirty = true;
            }
        }
    }

    /// The grace of a container killed by a failed probe.
    fn kill_grace(&mut self, slot: SlotId, kind: Kind) -> Duration {
        let s = self.slot(slot);
        let probe = match kind {
            Kind::Liveness => s.spec.liveness_probe.as_ref(),
            _ => s.spec.startup_probe.as_ref(),
        };
        let secs = probe
            .and_then(|p| p.termination_grace_period_seconds)
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30);
        Duration::from_secs(u64::try_from(secs).unwrap_or(0))
    }

    /// Records a finished instance and decides whether and when it runs again.
    fn exited(&mut self, id: SlotId, term: Terminated) {
        let policy = self.policy();
        let backoff_policy = self.ctx.settings.backoff;
        let terminating = self.terminating;
        let pod_label = format!("{}_{}({})", self.name, self.ns, self.uid);
        let slot = self.slot(id);
        slot.running = None;
        slot.ready = false;
        slot.started = false;
        let now = Instant::now();
        slot.finished = Some(now);
        if terminating || !restarts(policy, slot.role, term.exit_code) {
            slot.done = true;
            slot.start_at = None;
            slot.state = State::Terminated(term);
        } else {
            let hold = slot.backoff.hold_until(&backoff_policy, now).filter(|t| *t > now);
            slot.last_terminated = Some(term);
            match hold {
                Some(until) => {
                    let delay = slot.backoff.delay().unwrap_or_default();
                    slot.state = State::Waiting {
                        reason: "CrashLoopBackOff".into(),
                        message: Some(format!(
                            "back-off {} restarting failed container={} pod={pod_label}",
                            go_duration(delay),
                            slot.spec.name
                        )),
                    };
                    slot.start_at = Some(until);
                }
                None => {
                    slot.state = State::Waiting {
                        reason: "ContainerCreating".into(),
                        message: None,
                    };
                    slot.start_at = Some(now);
                }
            }
        }
        self.dirty = true;
    }

    /// Stops a running instance in the background: `preStop`, SIGTERM to the
    /// main process, SIGKILL after the grace. The exit arrives as an event.
    fn stop(&mut self, id: SlotId, grace: Duration) {
        let ip = self.ip;
        let shim = self.ctx.settings.skipper_exe.clone();
        let pod = self.name.clone();
        let slot = self.slot(id);
        let Some(running) = slot.running.as_mut() else {
            return;
        };
        if running.stopping {
            return;
        }
        running.stopping = true;
        let pid = running.pid;
        let exit = running.exit.clone();
        let hook = slot.spec.lifecycle.as_ref().and_then(|l| l.pre_stop.clone());
        let ports = slot.spec.ports.clone().unwrap_or_default();
        let cwd = slot
            .spec
            .working_dir
            .clone()
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        let name = slot.spec.name.clone();
        let env = running.env.as_ref().clone();
        self.ctx.tracker.spawn(async move {
            stop_container(StopArgs {
                pod,
                container: name,
                pid,
                exit,
                hook,
                grace,
                ip,
                ports,
                shim,
                env,
                cwd,
            })
            .await;
        });
    }

    fn any_running(&self) -> bool {
        self.init.iter().chain(&self.regular).any(|s| s.running.is_some())
    }

    /// A pod whose containers all finished for good is terminal.
    fn check_terminal(&mut self) {
        if self.terminal || !self.sandbox_ready {
            return;
        }
        let init_failed = self.policy() == RestartPolicy::Never
            && self.init.iter().any(|s| {
                s.role == Role::Init && matches!(&s.state, State::Terminated(t) if t.exit_code != 0)
            });
        let all_done = self.regular.iter().all(|s| s.done) && !self.regular.is_empty();
        if init_failed || all_done {
            self.terminal = true;
            // Sidecars and anything else still running stop now.
            for id in self.slot_ids() {
                let grace = self.deletion_grace();
                self.stop(id, grace);
            }
            self.dirty = true;
        }
    }

    /// Stops every container (regular ones first, then sidecars), waiting for
    /// them while still handling readiness changes and a shorter grace.
    async fn terminate(
        &mut self,
        grace: Duration,
        updates: &mut watch::Receiver<Update>,
        kill: &CancellationToken,
        report: bool,
    ) {
        self.terminating = true;
        let deadline = Instant::now() + grace + MIN_GRACE + Duration::from_secs(5);
        for s in self.init.iter_mut().chain(self.regular.iter_mut()) {
            s.start_at = None;
        }
        // Liveness and startup probes stop; readiness goes on.
        let mut phase_sidecars = false;
        let regular: Vec<SlotId> = (0..self.regular.len())
            .map(|index| SlotId { init: false, index })
            .collect();
        for id in &regular {
            self.stop(*id, grace);
        }
        let started = Instant::now();
        loop {
            let regular_left = self.regular.iter().any(|s| s.running.is_some());
            if !regular_left && !phase_sidecars {
                phase_sidecars = true;
                let left = grace.saturating_sub(started.elapsed()).max(MIN_GRACE);
                for index in (0..self.init.len()).rev() {
                    self.stop(SlotId { init: true, index }, left);
                }
            }
            if !self.any_running() {
                break;
            }
            if report {
                self.write_status().await;
            }
            tokio::select! {
                () = kill.cancelled() => return,
                Some(ev) = self.events.recv() => self.handle(ev),
                Some((slot, change)) = self.probe_rx.recv() => {
                    if change.kind == Kind::Readiness {
                        self.handle(Event::Probe { slot, change });
                    }
                }
                changed = updates.changed() => {
                    if changed.is_ok()
                        && let Some(pod) = updates.borrow_and_update().clone()
                    {
                        self.pod = pod;
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(pod = %self.name, "containers did not stop in time; killing them");
                    self.kill_all();
                    break;
                }
            }
        }
        self.terminal = true;
        self.dirty = true;
    }

    /// Final status, then the pod is deleted for good.
    async fn finish(&mut self) {
        for _ in 0..10 {
            self.write_status().await;
            if !self.dirty {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let api: Api<Pod> = Api::namespaced(self.ctx.client(&self.node), &self.ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        for attempt in 0..10u32 {
            match api.delete(&self.name, &params).await {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return,
                Err(e) => {
                    tracing::debug!(pod = %self.name, error = %e, attempt, "final delete failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt + 1))).await;
                }
            }
        }
    }

    /// SIGKILLs every container at once.
    fn kill_all(&mut self) {
        for s in self.init.iter_mut().chain(self.regular.iter_mut()) {
            if let Some(r) = s.running.take() {
                r.probes.cancel();
                runtime::signal(r.pid, Signal::SIGKILL);
            }
        }
    }

    fn release(&mut self) {
        for s in self.init.iter().chain(&self.regular) {
            if let Some(r) = &s.running {
                r.probes.cancel();
            }
        }
        self.ctx.registry.remove(&self.uid);
    }

    fn status(&self) -> PodStatus {
        let init: Vec<ContainerView> = self.init.iter().map(Slot::view).collect();
        let mut regular: Vec<ContainerView> = self.regular.iter().map(Slot::view).collect();
        if !self.sandbox_ready
            && let Some(message) = &self.sandbox_message
        {
            for v in &mut regular {
                if let State::Waiting { message: m, .. } = &mut v.state {
                    *m = Some(message.clone());
                }
            }
        }
        // Conditions keep their transition times from what was last written;
        // conditions owned by others come from the API.
        let mut pod = (*self.pod).clone();
        if let Some(written) = &self.written {
            let mut status = pod.status.clone().unwrap_or_default();
            let owned = |t: &str| {
                matches!(
                    t,
                    "PodReadyToStartContainers"
                        | "Initialized"
                        | "ContainersReady"
                        | "Ready"
                        | "PodScheduled"
                )
            };
            let mut conditions: Vec<_> = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .filter(|c| !owned(&c.type_))
                .collect();
            conditions.extend(
                written
                    .conditions
                    .iter()
                    .flatten()
                    .filter(|c| owned(&c.type_))
                    .cloned(),
            );
            status.conditions = Some(conditions);
            if matches!(written.phase.as_deref(), Some("Succeeded" | "Failed")) {
                status.phase = written.phase.clone();
            }
            pod.status = Some(status);
        }
        status::pod_status(&status::Input {
            pod: &pod,
            init: &init,
            containers: &regular,
            sandbox_ready: self.sandbox_ready,
            pod_ip: self.ip.map(|ip| ip.to_string()),
            host_ip: self.ctx.host_ip().to_string(),
            start_time: Some(self.start_time),
            terminal: self.terminal,
            now: Timestamp::now(),
        })
    }

    /// Writes the status through `pods/{name}/status` when it changed.
    async fn write_status(&mut self) {
        let status = self.status();
        if self.written.as_ref() == Some(&status) {
            self.dirty = false;
            return;
        }
        let patch = serde_json::json!([
            {"op": "test", "path": "/metadata/uid", "value": self.uid},
            {"op": "add", "path": "/status", "value": status},
        ]);
        let api: Api<Pod> = Api::namespaced(self.ctx.client(&self.node), &self.ns);
        let patch: Patch<()> = match serde_json::from_value(patch) {
            Ok(p) => Patch::Json(p),
            Err(_) => return,
        };
        match api
            .patch_status(&self.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => {
                self.written = Some(status);
                self.dirty = false;
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 422 => {
                // Gone, or another pod of the same name: nothing to report.
                self.written = Some(status);
                self.dirty = false;
            }
            Err(e) => {
                tracing::debug!(pod = %self.name, error = %e, "status update failed; retrying");
                self.dirty = true;
            }
        }
    }
}

async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

struct StopArgs {
    pod: String,
    container: String,
    pid: u32,
    exit: watch::Receiver<Option<Exit>>,
    hook: Option<LifecycleHandler>,
    grace: Duration,
    ip: Option<Ipv4Addr>,
    ports: Vec<k8s_openapi::api::core::v1::ContainerPort>,
    shim: PathBuf,
    env: Vec<(String, String)>,
    cwd: Option<PathBuf>,
}

async fn wait_exit(exit: &mut watch::Receiver<Option<Exit>>) {
    loop {
        if exit.borrow_and_update().is_some() {
            return;
        }
        if exit.changed().await.is_err() {
            return;
        }
    }
}

/// The kubelet's `killContainer`: the `preStop` hook within the grace
/// period, then SIGTERM with what is left (at least 2 s), then SIGKILL.
async fn stop_container(a: StopArgs) {
    let begin = Instant::now();
    let mut exit = a.exit.clone();
    if let Some(hook) = &a.hook {
        let run = run_hook(hook, &a);
        tokio::select! {
            r = tokio::time::timeout(a.grace, run) => {
                if let Ok(Err(e)) = r {
                    tracing::info!(pod = %a.pod, container = %a.container, error = %e, "preStop hook failed");
                }
            }
            () = wait_exit(&mut exit) => return,
        }
    }
    let left = a.grace.saturating_sub(begin.elapsed()).max(MIN_GRACE);
    runtime::signal(a.pid, Signal::SIGTERM);
    if tokio::time::timeout(left, wait_exit(&mut exit)).await.is_err() {
        runtime::signal(a.pid, Signal::SIGKILL);
        wait_exit(&mut exit).await;
    }
}

async fn run_hook(hook: &LifecycleHandler, a: &StopArgs) -> Result<(), String> {
    if let Some(sleep) = &hook.sleep {
        let secs = u64::try_from(sleep.seconds).unwrap_or(0);
        tokio::time::sleep(Duration::from_secs(secs)).await;
        return Ok(());
    }
    if let Some(e) = &hook.exec {
        let cmd = e.command.clone().unwrap_or_default();
        return match runtime::exec(&a.shim, a.pid, &a.env, a.cwd.as_deref(), &cmd, a.grace).await {
            Ok(0) => Ok(()),
            Ok(code) => Err(format!("command {cmd:?} exited with {code}")),
            Err(e) => Err(e),
        };
    }
    if let Some(h) = &hook.http_get {
        let Some(ip) = a.ip else {
            return Err("the pod has no IP".into());
        };
        let target = probe::Target {
            pod_ip: ip.into(),
            ports: a.ports.clone(),
        };
        let spec = probe::Spec {
            action: probe::Action::Http {
                host: h.host.clone().filter(|s| !s.is_empty()),
                port: h.port.clone(),
                path: h.path.clone().unwrap_or_else(|| "/".into()),
                scheme: h.scheme.clone().unwrap_or_else(|| "HTTP".into()),
                headers: h
                    .http_headers
                    .iter()
                    .flatten()
                    .map(|x| (x.name.clone(), x.value.clone()))
                    .collect(),
            },
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: a.grace,
            success_threshold: 1,
            failure_threshold: 1,
            termination_grace: None,
        };
        return match probe::run(&spec, &target, &NoExec).await {
            probe::Outcome::Success => Ok(()),
            probe::Outcome::Failure(m) | probe::Outcome::Unknown(m) => Err(m),
        };
    }
    Ok(())
}

struct NoExec;

impl probe::Exec for NoExec {
    async fn exec(&self, _: &[String], _: Duration) -> Result<i32, String> {
        Err("exec is not available here".into())
    }
}
