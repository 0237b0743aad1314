//! Runs the real `skipper dev` (cluster, controller pods, router process,
//! pool pods) and talks to it the way users do: HTTP through the router,
//! kube-rs (and the simulator's fault endpoints) through the kubeconfig it
//! writes, gRPC to the controllers. [`Dev`] stops the whole tree on drop,
//! also when a test fails.
//!
//! `SKIPPER_TEST_CONTROL_PLANE=real` runs every `skipper dev` with
//! `--control-plane real` (the control plane `make control-plane` builds;
//! `make e2e-real`); scenarios that need the simulator say why and skip
//! ([`skipped_on_real`]). `SKIPPER_TEST_NODES=kubelet` runs them with
//! `--control-plane real --nodes kubelet` (`make e2e-kubelet`): every part
//! of Skipper a pod of the image on kubelet nodes; the same scenarios skip.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::Value;
use skipper::api;
use skipper::client::{ChannelSettings, Client, Endpoints};
use tokio::io::{AsyncBufReadExt as _, BufReader};

#[allow(unused_imports)] // the reliability suite uses part of it
pub use process::{listener_pid, process_alive};
use skipper_test_support::process;

/// Namespace of the playground's pools.
pub const NS: &str = "default";
/// Label carrying the tenant of an assigned pod.
pub const TENANT: &str = "skipper/tenant";

/// How a scenario's playground is started.
pub struct Opts {
    /// `--controllers`.
    pub controllers: u16,
    /// Replicas of the `fixture` pool.
    pub pool: u16,
    /// `--scale-interval`.
    pub scale_interval: &'static str,
    /// `--heartbeat-timeout`.
    pub heartbeat_timeout: &'static str,
    /// `--controller-env` values.
    pub controller_env: Vec<&'static str>,
    /// More `skipper dev` arguments.
    pub extra: Vec<String>,
    /// A program (and its arguments) that runs `skipper dev`, e.g.
    /// `setpriv --reuid=65534 ...`; `skipper dev` runs directly when empty.
    pub wrapper: Vec<String>,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            controllers: 1,
            pool: 3,
            scale_interval: "1s",
            heartbeat_timeout: "5s",
            controller_env: vec![
                "SKIPPER_HPA_DOWNSCALE_STABILIZATION=2s",
                "SKIPPER_HPA_INITIAL_READINESS_DELAY=1s",
                "SKIPPER_FUNCTION_ASSIGN_TIMEOUT=5s",
            ],
            extra: Vec::new(),
            wrapper: Vec::new(),
        }
    }
}

/// Whether the suite runs on the real control plane
/// (`SKIPPER_TEST_CONTROL_PLANE=real`, or kubelet nodes).
pub fn real_control_plane() -> bool {
    std::env::var("SKIPPER_TEST_CONTROL_PLANE").is_ok_and(|v| v == "real") || kubelet_nodes()
}

/// Whether the suite runs on kubelet nodes (`SKIPPER_TEST_NODES=kubelet`).
pub fn kubelet_nodes() -> bool {
    std::env::var("SKIPPER_TEST_NODES").is_ok_and(|v| v == "kubelet")
}

/// The name of the control plane the suite runs on, for printed figures.
pub fn control_plane_name() -> &'static str {
    if kubelet_nodes() {
        "real, kubelet nodes"
    } else if real_control_plane() {
        "real"
    } else {
        "sim"
    }
}

/// On the real control plane: prints why `scenario` does not run there and
/// answers true (the caller returns).
pub fn skipped_on_real(scenario: &str, reason: &str) -> bool {
    let skip = real_control_plane();
    if skip {
        eprintln!("e2e: {scenario} skipped on the real control plane: {reason}");
    }
    skip
}

/// `skipper dev` arguments selecting the suite's control plane.
pub fn control_plane_args() -> Vec<&'static str> {
    if kubelet_nodes() {
        vec!["--control-plane", "real", "--nodes", "kubelet"]
    } else if real_control_plane() {
        vec!["--control-plane", "real"]
    } else {
        Vec::new()
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A running `skipper dev`.
pub struct Dev {
    child: Option<tokio::process::Child>,
    /// `http://` address of the router.
    pub router: String,
    /// `https://` address of the simulated API server.
    pub api_server: String,
    /// A kube-rs client of the simulated cluster.
    pub client: kube::Client,
    /// The HTTP client requests go through.
    pub http: reqwest::Client,
    /// Controller pod IPs as printed by `skipper dev`.
    pub controller_ips: Vec<String>,
    /// Lines `skipper dev` printed.
    pub stdout: Arc<Mutex<Vec<String>>>,
    /// A router's token for calling controllers directly (a file, for
    /// `ring-inspect --token-file`).
    pub token_file: PathBuf,
    /// When `skipper dev` was started.
    pub started: std::time::Instant,
    dir: PathBuf,
}

impl Dev {
    /// Starts `skipper dev` and waits (at most 120s) for its ready line.
    /// The router's port is picked free just before it starts; when another
    /// process takes it first (`skipper dev` then stops at once naming the
    /// flag), it starts again on another port, up to three times.
    pub async fn start(opts: Opts) -> Self {
        const ATTEMPTS: usize = 3;
        for attempt in 1..=ATTEMPTS {
            match Self::launch(&opts).await {
                Ok(dev) => return dev,
                Err(stderr) if attempt < ATTEMPTS && stderr.contains("Address already in use") => {
                    eprintln!(
                        "skipper dev: a port was taken before it started, trying other ports: {stderr}"
                    );
                }
                Err(stderr) => {
                    panic!("skipper dev did not get ready within 120s (or exited); stderr:\n{stderr}")
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// One start of `skipper dev`; its stderr when it is not ready within
    /// 120 s (or exits).
    async fn launch(opts: &Opts) -> Result<Self, String> {
        let dir = std::env::temp_dir().join(format!(
            "skipper-e2e-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if !opts.wrapper.is_empty() {
            // The wrapped `skipper dev` may run as another user; it writes
            // its kubeconfig here.
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        }
        let kubeconfig = dir.join("kubeconfig");
        let listen = format!("127.0.0.1:{}", free_port());
        let started = std::time::Instant::now();
        let mut cmd = match opts.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = tokio::process::Command::new(program);
                c.args(args).arg(env!("CARGO_BIN_EXE_skipper"));
                c
            }
            None => tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper")),
        };
        cmd.arg("dev")
            .args(control_plane_args())
            // The router's port is picked here (requests go there); the
            // metrics port is any free one.
            .args(["--listen", &listen, "--metrics-listen", "127.0.0.1:0"])
            .arg("--kubeconfig-out")
            .arg(&kubeconfig)
            .args(["--controllers", &opts.controllers.to_string()])
            .args(["--pool", &format!("fixture={}", opts.pool)])
            .args(["--scale-interval", opts.scale_interval])
            .args(["--heartbeat-timeout", opts.heartbeat_timeout])
            .args(["--log-level", "info"]);
        for e in &opts.controller_env {
            cmd.args(["--controller-env", e]);
        }
        cmd.args(&opts.extra);
        let stderr = std::fs::File::create(dir.join("dev.stderr")).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let lines = stdout.clone();
        let mut reader = BufReader::new(child.stdout.take().unwrap()).lines();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut ready_tx = Some(ready_tx);
            while let Ok(Some(line)) = reader.next_line().await {
                if line.starts_with("skipper dev ready")
                    && let Some(tx) = ready_tx.take()
                {
                    let _ = tx.send(());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let mut dev = Self {
            child: Some(child),
            router: format!("http://{listen}"),
            api_server: String::new(),
            client: kube::Client::try_from(kube::Config::new("https://127.0.0.1:1".parse().unwrap()))
                .unwrap(),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            controller_ips: Vec::new(),
            stdout,
            token_file: dir.join("router-token"),
            started,
            dir,
        };
        // The sender goes away without a ready line when `skipper dev` exits.
        if !matches!(
            tokio::time::timeout(Duration::from_secs(120), ready_rx).await,
            Ok(Ok(()))
        ) {
            return Err(std::fs::read_to_string(dev.dir.join("dev.stderr")).unwrap_or_default());
        }
        // Wait for the rest of the ready block (controllers line).
        let controllers = wait_until("the controllers line", Duration::from_secs(5), || {
            let l = dev.stdout.lock().unwrap();
            let line = l.iter().find(|l| l.trim_start().starts_with("controllers:"))?;
            let ips = line.split_whitespace().nth(1)?.to_owned();
            Some(ips)
        })
        .await;
        dev.controller_ips = controllers.split(',').map(str::to_owned).collect();
        let config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&kubeconfig).unwrap(),
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        dev.api_server = config.cluster_url.to_string().trim_end_matches('/').to_owned();
        dev.client = kube::Client::try_from(config).unwrap();
        let token = skipper::dev::playground::router_token(&dev.client, 3600)
            .await
            .unwrap();
        std::fs::write(&dev.token_file, token).unwrap();
        Ok(dev)
    }

    /// A client of the controller at `ip`, presenting the router's token.
    fn controller(&self, ip: &str) -> Client {
        let addr: SocketAddr = format!("{ip}:50051").parse().unwrap();
        let credentials = skipper::credentials::Credentials::from_file(&self.token_file).unwrap();
        Client::new(Endpoints::fixed(&[addr], ChannelSettings::default()).with_credentials(credentials))
    }

    /// The pid of the `skipper dev` process.
    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .and_then(tokio::process::Child::id)
            .unwrap_or(0)
    }

    /// The output of `skipper dev` so far.
    pub fn output(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    /// What `skipper dev` wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("dev.stderr")).unwrap_or_default()
    }

    /// Sends one request for `function` through the router.
    pub async fn request(&self, function: &str, path: &str) -> Result<(u16, String), reqwest::Error> {
        let resp = self
            .http
            .get(format!("{}{path}", self.router))
            .header("X-Skipper-Function", function)
            .send()
            .await?;
        let status = resp.status().as_u16();
        let body = resp.text().await?;
        Ok((status, body))
    }

    /// One request that must succeed; returns the tenant the echo names.
    pub async fn echo_tenant(&self, function: &str, path: &str) -> String {
        let (status, body) = self.request(function, path).await.unwrap();
        assert_eq!(status, 200, "body: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["tenant"].as_str().unwrap().to_owned()
    }

    /// Every pod in the pool namespace.
    pub async fn pods(&self) -> Vec<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        api.list(&ListParams::default()).await.unwrap().items
    }

    /// Running, non-terminating pods serving `tenant`, by name.
    pub async fn tenant_pods(&self, tenant: &str) -> BTreeSet<String> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        api.list(&ListParams::default().labels(&format!("{TENANT}={tenant}")))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.name)
            .collect()
    }

    /// Ready, unassigned pool pods.
    pub async fn idle_pool_pods(&self) -> usize {
        self.pods()
            .await
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| !p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(TENANT)))
            .filter(|p| pod_ready(p))
            .count()
    }

    /// Crashes a pod: SIGKILLs the process listening on the pod's IP and
    /// `port` (its container's main process), as an out-of-memory kill or
    /// a segfault would. Returns the pid.
    pub async fn kill_pod_process(&self, ns: &str, name: &str, port: u16) -> u32 {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let pod = api.get(name).await.unwrap();
        let ip: std::net::Ipv4Addr = pod
            .status
            .and_then(|s| s.pod_ip)
            .unwrap_or_else(|| panic!("pod {ns}/{name} has no IP"))
            .parse()
            .unwrap();
        let pid = listener_pid(ip, port).unwrap_or_else(|| panic!("nothing listens on {ip}:{port}"));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        pid
    }

    /// POSTs a fault to the simulator (`/_sim/...`) as the administrator.
    pub async fn fault(&self, path: &str) {
        let req = http::Request::post(format!("/_sim/{path}"))
            .body(Vec::new())
            .unwrap();
        if let Err(e) = self.client.request_text(req).await {
            panic!("fault {path}: {e}");
        }
    }

    /// The local state of the controller at `ip`.
    pub async fn controller_state(&self, ip: &str) -> api::ClusterState {
        self.controller(ip)
            .get_cluster_state(
                api::GetClusterStateRequest {
                    local_only: Some(true),
                },
                Duration::from_secs(5),
            )
            .await
            .unwrap()
            .cluster_state
            .unwrap()
    }

    /// The cluster state aggregated across the ring by the controller at `ip`.
    pub async fn aggregated_state(&self, ip: &str) -> api::ClusterState {
        self.controller(ip)
            .get_cluster_state(
                api::GetClusterStateRequest { local_only: None },
                Duration::from_secs(5),
            )
            .await
            .unwrap()
            .cluster_state
            .unwrap()
    }

    /// Records, for every pod, each tenant label it ever carried, and for
    /// each tenant the most pods it had at once, until dropped.
    pub fn record_assignments(&self) -> Recorder {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        let seen = Arc::new(Mutex::new(Assignments::default()));
        let state = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
            let mut live: BTreeMap<String, String> = BTreeMap::new();
            while let Some(ev) = stream.next().await {
                let (pod, deleted) = match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => (p, false),
                    Ok(watcher::Event::Delete(p)) => (p, true),
                    _ => continue,
                };
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let tenant = pod.metadata.labels.as_ref().and_then(|l| l.get(TENANT)).cloned();
                let alive = !deleted
                    && pod.metadata.deletion_timestamp.is_none()
                    && pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed");
                let mut s = state.lock().unwrap();
                match tenant {
                    Some(t) if alive => {
                        s.tenants_of_pod.entry(uid.clone()).or_default().insert(t.clone());
                        live.insert(uid, t);
                    }
                    Some(t) => {
                        s.tenants_of_pod.entry(uid.clone()).or_default().insert(t);
                        live.remove(&uid);
                    }
                    None => {
                        live.remove(&uid);
                    }
                }
                let mut per: BTreeMap<&str, u32> = BTreeMap::new();
                for t in live.values() {
                    *per.entry(t.as_str()).or_default() += 1;
                }
                for (t, n) in per {
                    let max = s.max_pods_of_tenant.entry(t.to_owned()).or_default();
                    *max = (*max).max(n);
                }
            }
        });
        Recorder { seen, task }
    }
}

/// What [`Dev::record_assignments`] saw.
#[derive(Debug, Default, Clone)]
pub struct Assignments {
    /// Pod uid → tenants it carried.
    pub tenants_of_pod: BTreeMap<String, BTreeSet<String>>,
    /// Tenant → most live (not terminating) pods at once.
    pub max_pods_of_tenant: BTreeMap<String, u32>,
}

/// A running assignment recorder.
pub struct Recorder {
    seen: Arc<Mutex<Assignments>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    /// What was seen so far.
    pub fn snapshot(&self) -> Assignments {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Dev {
    /// Sends SIGINT (Ctrl-C) and waits at most 30s for the exit status.
    pub async fn interrupt(mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("skipper dev did not exit within 30s of SIGINT")
            .unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
        status
    }

    /// SIGKILLs `skipper dev` (nothing of its cleanup runs) and waits for it.
    pub async fn kill(mut self) {
        let mut child = self.child.take().unwrap();
        child.start_kill().unwrap();
        tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("skipper dev did not exit within 10s of SIGKILL")
            .unwrap();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// The work directory `skipper dev` printed (where its ring-inspect
    /// line's token file is).
    pub fn work_dir(&self) -> PathBuf {
        let out = self.output();
        let mut words = out.split_whitespace();
        words
            .find(|w| *w == "--token-file")
            .and_then(|_| words.next())
            .and_then(|token| std::path::Path::new(token).parent())
            .unwrap_or_else(|| panic!("no --token-file in the output:\n{out}"))
            .to_path_buf()
    }

    /// Prints the last warnings and errors and the last lines of `skipper
    /// dev`'s own log (the simulated cluster's), the router's and each
    /// controller's (in its work directory) on stderr.
    fn print_warnings(&self) {
        const LAST: usize = 40;
        const TAIL: usize = 15;
        let Some(work) = self
            .output()
            .split_whitespace()
            .skip_while(|w| *w != "--token-file")
            .nth(1)
            .and_then(|t| std::path::Path::new(t).parent().map(std::path::Path::to_path_buf))
        else {
            return;
        };
        let mut logs = vec![self.dir.join("dev.stderr"), work.join("router.log")];
        if let Ok(pods) = std::fs::read_dir(work.join("pods")) {
            let mut controllers: Vec<PathBuf> = pods
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("skipper_"))
                .flat_map(|e| walk_logs(&e.path().join("logs")))
                .collect();
            controllers.sort();
            logs.extend(controllers);
        }
        for log in logs {
            let Ok(text) = std::fs::read_to_string(&log) else {
                continue;
            };
            let all: Vec<&str> = text.lines().collect();
            let tail = all.len().saturating_sub(TAIL);
            let lines: Vec<&str> = all[..tail]
                .iter()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                .copied()
                .collect();
            eprintln!(
                "--- {}: the last {} of {} warnings and errors before its last {} lines",
                log.display(),
                lines.len().min(LAST),
                lines.len(),
                all.len() - tail
            );
            for l in lines[lines.len().saturating_sub(LAST)..]
                .iter()
                .chain(&all[tail..])
            {
                eprintln!("{l}");
            }
        }
    }

    /// Every process `skipper dev` started, directly or not: the router,
    /// and each pod's shims, main processes and their children.
    pub fn process_tree(&self) -> Vec<u32> {
        self.child
            .as_ref()
            .and_then(tokio::process::Child::id)
            .map(process::descendants)
            .unwrap_or_default()
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if std::thread::panicking() {
            // Before the stop removes them: what the router and the
            // controllers warned about, for the failed test's output.
            self.print_warnings();
        }
        if let Some(pid) = child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        // `skipper dev` stops the router and every pod; give it 20s.
        let handle = tokio::runtime::Handle::current();
        let exited = tokio::task::block_in_place(|| {
            handle.block_on(async { tokio::time::timeout(Duration::from_secs(20), child.wait()).await })
        });
        if exited.is_err() {
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `*.log` files under `dir`, one level of container directories deep.
fn walk_logs(dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|c| std::fs::read_dir(c.path()).ok())
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect()
}

/// Whether a pod's Ready condition is True.
pub fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// [`wait_for`] with a synchronous check.
pub async fn wait_until<T, F>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Option<T>,
{
    wait_for(what, limit, || std::future::ready(check())).await
}

/// [`skipper_test_support::eventually`] (same arguments) polling every
/// 100 ms: each poll may list pods.
pub async fn wait_for<T, F, Fut>(what: &str, limit: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    skipper_test_support::eventually_every(what, limit, Duration::from_millis(100), check).await
}

/// Prints a scenario's wall time when it ends (also on failure), as a
/// `<suite>: <scenario> ok|FAILED in <seconds>s` line.
pub struct Timer {
    name: &'static str,
    start: std::time::Instant,
}

impl Timer {
    /// Starts timing scenario `name`.
    pub fn start(name: &'static str) -> Self {
        Self {
            name,
            start: std::time::Instant::now(),
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let outcome = if std::thread::panicking() { "FAILED" } else { "ok" };
        // The suite is the test binary including this file: `e2e` or `chaos`.
        eprintln!(
            "{}: {} {outcome} in {:.1}s",
            env!("CARGO_CRATE_NAME"),
            self.name,
            self.start.elapsed().as_secs_f64()
        );
    }
}

/// A function header value.
pub fn function(tenant: &str, scale: &str, oneshot: bool) -> String {
    let oneshot = if oneshot { r#","oneshot":true"# } else { "" };
    format!(r#"{{"namespace":"{NS}","deployment":"fixture","tenant":"{tenant}","scale":{scale}{oneshot}}}"#)
}

/// A function with at most one instance.
pub fn single(tenant: &str) -> String {
    function(tenant, r#"{"max_instances":1}"#, false)
}

/// Counts of a load run.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoadStats {
    /// Requests issued.
    pub sent: u64,
    /// Requests whose first attempt failed and that the client retried.
    pub retried: u64,
    /// Requests that failed after every retry.
    pub failed: u64,
}

/// A running load.
pub struct Load {
    /// Requests completed (successfully or not) so far.
    pub done: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
    handle: tokio::task::JoinHandle<(LoadStats, Vec<String>)>,
}

impl Load {
    /// Waits until `n` more requests have completed.
    pub async fn progress(&self, n: u64) {
        let target = self.done.load(Ordering::SeqCst) + n;
        wait_until(&format!("{n} more requests"), Duration::from_secs(60), || {
            (self.done.load(Ordering::SeqCst) >= target).then_some(())
        })
        .await;
    }

    /// Stops the load; its counts and the errors seen.
    pub async fn finish(self) -> (LoadStats, Vec<String>) {
        self.stop.cancel();
        self.handle.await.unwrap()
    }
}

/// Steady load: `workers` loops over `functions` (each request retried at
/// most twice by the client) until [`Load::finish`].
pub fn load(dev: &Dev, functions: Vec<String>, workers: usize) -> Load {
    let http = dev.http.clone();
    let router = dev.router.clone();
    let stop = tokio_util::sync::CancellationToken::new();
    let done = Arc::new(AtomicU64::new(0));
    let (stop2, done2) = (stop.clone(), done.clone());
    let handle = tokio::spawn(async move {
        let (stop, done) = (stop2, done2);
        let functions = Arc::new(functions);
        let mut set = tokio::task::JoinSet::new();
        for w in 0..workers {
            let (http, router, functions, stop, done) = (
                http.clone(),
                router.clone(),
                functions.clone(),
                stop.clone(),
                done.clone(),
            );
            set.spawn(async move {
                let mut stats = LoadStats::default();
                let mut errors = Vec::new();
                let mut i = w;
                while !stop.is_cancelled() {
                    let f = &functions[i % functions.len()];
                    i += 1;
                    stats.sent += 1;
                    let mut ok = false;
                    for attempt in 0..3 {
                        if attempt == 1 {
                            stats.retried += 1;
                        }
                        let r = http
                            .get(format!("{router}/load"))
                            .header("X-Skipper-Function", f.as_str())
                            .send()
                            .await;
                        match r {
                            Ok(resp) if resp.status().is_success() => {
                                let body = resp.text().await.unwrap_or_default();
                                let v: Value = serde_json::from_str(&body).unwrap_or_default();
                                let want: Value = serde_json::from_str(f).unwrap();
                                if v["tenant"] == want["tenant"] {
                                    ok = true;
                                    break;
                                }
                                errors.push(format!("wrong tenant: {body}"));
                            }
                            Ok(resp) => errors.push(format!(
                                "{}: {}",
                                resp.status(),
                                resp.text().await.unwrap_or_default()
                            )),
                            Err(e) => errors.push(e.to_string()),
                        }
                    }
                    if !ok {
                        stats.failed += 1;
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }
                (stats, errors)
            });
        }
        let mut total = LoadStats::default();
        let mut errors = Vec::new();
        while let Some(r) = set.join_next().await {
            let (s, e) = r.unwrap();
            total.sent += s.sent;
            total.retried += s.retried;
            total.failed += s.failed;
            errors.extend(e);
        }
        (total, errors)
    });
    Load { done, stop, handle }
}
