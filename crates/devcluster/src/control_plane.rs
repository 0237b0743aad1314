//! A real Kubernetes control plane as local processes: etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler, built from
//! their Go modules by `make control-plane` (`tools/k8s/`) and run on
//! loopback the way envtest runs them — no containers, no kubelet (the
//! node agent of [`super::kubelet`] joins as the nodes).
//!
//! [`ControlPlane::start`] generates the cluster's key material
//! ([`super::pki`]: CA, serving certificate, ServiceAccount signing key,
//! one client certificate per component, and a separate front-proxy CA
//! for the aggregation layer), starts each process with its own
//! credentials and waits for it to be healthy:
//!
//! - **etcd**: one member on loopback, data in the work directory,
//!   `--unsafe-no-fsync` (the data dies with the control plane anyway).
//! - **kube-apiserver**: on loopback, or on [`Config::bind_address`] (the
//!   gateway of the node agent's pod bridge in
//!   [`super::real_cluster`], so pods reach it and the `kubernetes`
//!   Service gets a real endpoint); HTTPS only, client certificates and ServiceAccount
//!   tokens (issuer, JWKS) for authentication, `--authorization-mode=Node,RBAC`,
//!   the default admission plugins plus `NodeRestriction` (as kubeadm
//!   enables it), the aggregation layer's front-proxy certificates (an
//!   extension API server is registered by [`super::metrics_api`]), and
//!   Service cluster IPs on loopback ([`SERVICE_CLUSTER_IP_RANGE`]).
//! - **kube-controller-manager**: the deployment, replicaset,
//!   endpointslice, garbage-collector, namespace, serviceaccount,
//!   serviceaccount-token, root-ca-certificate-publisher and node-lifecycle
//!   controllers,
//!   each under its own ServiceAccount (`--use-service-account-credentials`).
//! - **kube-scheduler**.
//!
//! It writes an administrator kubeconfig (`kubernetes-admin` in
//! `system:masters`) and issues kubeconfigs for any other identity
//! ([`ControlPlane::kubeconfig_for`], e.g. a node's `system:node:<name>`)
//! or ServiceAccount token ([`ControlPlane::service_account_kubeconfig`]).
//!
//! [`ControlPlane::shutdown`] stops the processes in reverse order
//! (SIGTERM, then SIGKILL after [`Config::stop_timeout`]); dropping the
//! value SIGKILLs whatever still runs, and each process is started under
//! `setpriv --pdeathsig KILL` where `setpriv` exists, so a killed test
//! leaves nothing behind either.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt as _, Empty};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::pki::{self, Ca, CertKey, ClusterPki, PkiError, PkiFiles};

/// The binaries [`ControlPlane::start`] runs, in start order.
pub const BINARIES: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// The controllers kube-controller-manager runs.
pub const CONTROLLERS: [&str; 9] = [
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    // Removes the `node.kubernetes.io/not-ready` taint the TaintNodesByCondition
    // admission plugin puts on a new Node once it reports Ready, and taints
    // (and evicts from) nodes whose Lease stops being renewed.
    "node-lifecycle-controller",
];

/// The ServiceAccount token issuer (and default audience), as a cluster
/// built by kubeadm names it.
pub const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// The Service cluster IP range: loopback addresses (the node agent's pods
/// use `127.a.b.c` with `a` ≠ 0, so they never collide). There is no
/// kube-proxy, so a cluster IP reaches only a process that binds it; on
/// loopback a stray connection stays on this machine.
pub const SERVICE_CLUSTER_IP_RANGE: &str = "127.0.128.0/17";

/// The user the aggregation layer's front proxy authenticates as.
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

/// How the control plane runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where `etcd`, `kube-apiserver`, `kube-controller-manager` and
    /// `kube-scheduler` are (`make control-plane` builds them into
    /// `target/control-plane`).
    pub bin_dir: PathBuf,
    /// Holds key material, kubeconfigs, etcd's data and the process logs;
    /// a fresh temporary directory (removed on shutdown) when `None`.
    pub work_dir: Option<PathBuf>,
    /// How long each process may take to become healthy.
    pub start_timeout: Duration,
    /// How long each process may take to exit after SIGTERM.
    pub stop_timeout: Duration,
    /// Names and addresses the API server's certificate covers besides
    /// loopback and the `kubernetes` Service names.
    pub extra_serving_names: Vec<String>,
    /// Extra `--flag=value` arguments for kube-apiserver (appended last, so
    /// they win).
    pub apiserver_args: Vec<String>,
    /// The address kube-apiserver serves and advertises. On loopback (the
    /// default) the `kubernetes` Service gets no endpoints (they may not be
    /// loopback); any other address (e.g. the gateway of the node agent's
    /// pod bridge, so pods reach it) is covered by the serving certificate,
    /// advertised, and published by the endpoint reconciler as the
    /// `kubernetes` Service's endpoint, as on a real cluster.
    pub bind_address: Ipv4Addr,
    /// kube-apiserver's port; a free one when `None`.
    pub secure_port: Option<u16>,
    /// `--service-cluster-ip-range`; [`SERVICE_CLUSTER_IP_RANGE`] when `None`.
    pub service_cluster_ip_range: Option<String>,
    /// Whether kube-apiserver calls kubelets (logs, exec, the node proxy:
    /// of [`super::kubelet_nodes`], or the node agent's kubelet API,
    /// [`super::kubelet::api`]): with a client certificate of its own
    /// (`kube-apiserver-kubelet-client` in `system:masters`, as kubeadm
    /// issues it), verifying the kubelets' serving certificates with the
    /// cluster CA, at their `InternalIP`.
    pub kubelet_client: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bin_dir: PathBuf::from("target/control-plane"),
            work_dir: None,
            start_timeout: Duration::from_secs(60),
            stop_timeout: Duration::from_secs(15),
            extra_serving_names: Vec::new(),
            apiserver_args: Vec::new(),
            bind_address: Ipv4Addr::LOCALHOST,
            secure_port: None,
            service_cluster_ip_range: None,
            kubelet_client: false,
        }
    }
}

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error(
        "{binary} not found in {dir}: build the control plane with `make control-plane` (needs Go), \
         or point the control plane directory at the binaries"
    )]
    MissingBinary { binary: &'static str, dir: PathBuf },
    #[error("creating {path}: {source}")]
    WorkDir { path: PathBuf, source: std::io::Error },
    #[error("generating key material: {0}")]
    Pki(#[from] PkiError),
    #[error("finding a free port: {0}")]
    Port(std::io::Error),
    #[error("starting {name}: {source}")]
    Spawn {
        name: &'static str,
        source: std::io::Error,
    },
    #[error("{name} exited ({status}) while starting; the end of {log}:\n{tail}")]
    Exited {
        name: &'static str,
        status: std::process::ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} was not healthy after {waited:?}; the end of {log}:\n{tail}")]
    NotReady {
        name: &'static str,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("building a client for {what}: {source}")]
    Client { what: String, source: Box<kube::Error> },
    #[error("compacting etcd: {0}")]
    Compact(String),
    #[error("reading the kubeconfig for {what}: {source}")]
    Kubeconfig {
        what: String,
        source: Box<kube::config::KubeconfigError>,
    },
}

/// One running process of the control plane.
struct Component {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

/// A running control plane. Dropping it SIGKILLs every process.
pub struct ControlPlane {
    server: String,
    etcd: SocketAddr,
    addr: SocketAddr,
    pki: ClusterPki,
    files: PkiFiles,
    front_proxy_ca: PathBuf,
    front_proxy_ca_pem: String,
    work_dir: PathBuf,
    owns_work_dir: bool,
    admin_kubeconfig: PathBuf,
    components: Mutex<Vec<Component>>,
    stop_timeout: Duration,
    startup: Duration,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("work_dir", &self.work_dir)
            .finish_non_exhaustive()
    }
}

/// What a kubeconfig authenticates with.
#[derive(Debug, Clone)]
pub enum Credential<'a> {
    /// A client certificate and its key (PEM).
    Certificate(&'a CertKey),
    /// A bearer token.
    Token(&'a str),
}

/// The text of a kubeconfig for `server`, trusting `ca_pem`, with one
/// context named `name` (and the `default` namespace).
#[must_use]
pub fn kubeconfig_text(name: &str, server: &str, ca_pem: &str, credential: &Credential<'_>) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let user = match credential {
        Credential::Certificate(ck) => format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&ck.cert_pem),
            b64(&ck.key_pem)
        ),
        Credential::Token(t) => format!("    token: {t}\n"),
    };
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: {server}\n    \
         certificate-authority-data: {ca}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    \
         user: {name}\n    namespace: default\ncurrent-context: {name}\nusers:\n- name: {name}\n  user:\n{user}",
        ca = b64(ca_pem),
    )
}

/// A kube client from a kubeconfig's text.
///
/// # Errors
/// [`ControlPlaneError::Kubeconfig`] or [`ControlPlaneError::Client`].
pub async fn client_from_kubeconfig(what: &str, text: &str) -> Result<kube::Client, ControlPlaneError> {
    let kubeconfig = Kubeconfig::from_yaml(text).map_err(|e| ControlPlaneError::Kubeconfig {
        what: what.to_owned(),
        source: Box::new(e),
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| ControlPlaneError::Kubeconfig {
            what: what.to_owned(),
            source: Box::new(e),
        })?;
    kube::Client::try_from(config).map_err(|e| ControlPlaneError::Client {
        what: what.to_owned(),
        source: Box::new(e),
    })
}

/// A loopback port nobody listens on right now.
fn free_port() -> Result<u16, ControlPlaneError> {
    free_port_on(Ipv4Addr::LOCALHOST)
}

/// A port of `addr` nobody listens on right now.
fn free_port_on(addr: Ipv4Addr) -> Result<u16, ControlPlaneError> {
    std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(ControlPlaneError::Port)
}

/// The names the serving certificate covers besides the defaults: the
/// configured ones and the bind address.
fn serving_names(config: &Config) -> Vec<String> {
    let mut names = config.extra_serving_names.clone();
    let bind = config.bind_address.to_string();
    if !config.bind_address.is_loopback() && !names.contains(&bind) {
        names.push(bind);
    }
    names
}

/// The last `lines` lines of a log file (empty when unreadable).
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn write(path: &Path, contents: &str, secret: bool) -> Result<(), ControlPlaneError> {
    pki::write_file(path, contents, secret).map_err(ControlPlaneError::Pki)
}

/// Starts `bin_dir/name args`, its output going to `log`.
fn spawn(
    name: &'static str,
    bin_dir: &Path,
    args: &[String],
    log: &Path,
) -> Result<Component, ControlPlaneError> {
    let spawn_err = |source| ControlPlaneError::Spawn { name, source };
    let out = std::fs::File::create(log).map_err(spawn_err)?;
    let err = out.try_clone().map_err(spawn_err)?;
    let binary = bin_dir.join(name);
    // The process dies with us even when we are SIGKILLed.
    let setpriv = Path::new("/usr/bin/setpriv");
    let mut cmd = if setpriv.exists() {
        let mut c = Command::new(setpriv);
        c.args(["--pdeathsig", "KILL", "--"]).arg(&binary);
        c
    } else {
        Command::new(&binary)
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(spawn_err)?;
    Ok(Component {
        name,
        child,
        log: log.to_path_buf(),
    })
}

/// How many times a component is started on freshly chosen ports when it
/// exits because one was taken: a port is free when chosen, but another
/// process (parallel tests start many control planes) can bind it before the
/// component does.
const PORT_ATTEMPTS: u32 = 3;

/// Whether `name` starts again on new ports after `started`: when it lost a
/// port race and has attempts left (counted in `attempt`).
fn start_again(name: &str, attempt: &mut u32, started: &Result<(), ControlPlaneError>) -> bool {
    match started {
        Err(e) if *attempt < PORT_ATTEMPTS && lost_port_race(e) => {
            tracing::warn!(
                component = name,
                attempt = *attempt,
                "a port was taken by another process before the component bound it; starting it on new ports"
            );
            *attempt += 1;
            true
        }
        _ => false,
    }
}

/// Whether a start failed because a port the component was given was taken
/// by the time it bound it.
fn lost_port_race(err: &ControlPlaneError) -> bool {
    match err {
        ControlPlaneError::Exited { log, tail, .. } => {
            let in_use = |text: &str| text.contains("address already in use");
            in_use(tail) || std::fs::read_to_string(log).is_ok_and(|text| in_use(&text))
        }
        _ => false,
    }
}

/// Polls `healthy` every 50 ms until it answers true, failing when the
/// process exits or `timeout` passes.
async fn await_healthy<F, Fut>(
    component: &mut Component,
    timeout: Duration,
    mut healthy: F,
) -> Result<(), ControlPlaneError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        if let Ok(Some(status)) = component.child.try_wait() {
            return Err(ControlPlaneError::Exited {
                name: component.name,
                status,
                log: component.log.clone(),
                tail: log_tail(&component.log, 30),
            });
        }
        if healthy().await {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(ControlPlaneError::NotReady {
                name: component.name,
                waited: start.elapsed(),
                log: component.log.clone(),
                tail: log_tail(&component.log, 30),
            });
        }
    }
}

/// Whether `GET http://addr/path` answers 200 with a body containing `expect`.
async fn http_ok(addr: SocketAddr, path: &str, expect: &str) -> bool {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let Ok(uri) = format!("http://{addr}{path}").parse::<http::Uri>() else {
        return false;
    };
    let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), client.get(uri)).await else {
        return false;
    };
    if !resp.status().is_success() {
        return false;
    }
    resp.into_body()
        .collect()
        .await
        .is_ok_and(|b| String::from_utf8_lossy(&b.to_bytes()).contains(expect))
}

/// `POST http://addr/path` with a JSON body; the JSON answer.
async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| format!("{path}: no answer in 10 s"))?
        .map_err(|e| format!("{path}: {e}"))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("{path}: {status}: {}", String::from_utf8_lossy(&bytes)));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("{path}: {e}"))
}

/// Whether `GET <client's server>/path` answers `ok`.
async fn k8s_ok(client: &kube::Client, path: &str) -> bool {
    use tracing::instrument::WithSubscriber as _;
    let Ok(req) = http::Request::get(path).body(Vec::new()) else {
        return false;
    };
    // A component that is still starting refuses the connection or answers
    // 500; kube's client would log each such answer as an error (and each
    // handshake with a health port's self-signed certificate as a warning).
    // Here they are the expected answers until the deadline.
    let ask = tokio::time::timeout(Duration::from_secs(2), client.request_text(req))
        .with_subscriber(tracing::subscriber::NoSubscriber::default());
    matches!(ask.await, Ok(Ok(body)) if body.trim() == "ok")
}

/// A client for a component's own HTTPS port, which serves a self-signed
/// certificate; only `/healthz` is asked there.
fn insecure_client(port: u16) -> Result<kube::Client, ControlPlaneError> {
    let what = || format!("the health port {port}");
    let url = format!("https://127.0.0.1:{port}")
        .parse::<http::Uri>()
        .map_err(|e| ControlPlaneError::Kubeconfig {
            what: what(),
            source: Box::new(kube::config::KubeconfigError::ParseClusterUrl(e)),
        })?;
    let mut config = kube::Config::new(url);
    config.accept_invalid_certs = true;
    kube::Client::try_from(config).map_err(|e| ControlPlaneError::Client {
        what: what(),
        source: Box::new(e),
    })
}

fn flag(name: &str, value: impl std::fmt::Display) -> String {
    format!("--{name}={value}")
}

fn path_flag(name: &str, value: &Path) -> String {
    format!("--{name}={}", value.display())
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver, kube-controller-manager and
    /// kube-scheduler, each once the one before is healthy.
    ///
    /// # Errors
    /// [`ControlPlaneError`]: a missing binary (with how to build it), key
    /// material, or a process that exits or stays unhealthy (with the end of
    /// its log).
    pub async fn start(config: Config) -> Result<Self, ControlPlaneError> {
        let begin = Instant::now();
        for binary in BINARIES {
            if !config.bin_dir.join(binary).is_file() {
                return Err(ControlPlaneError::MissingBinary {
                    binary,
                    dir: config.bin_dir.clone(),
                });
            }
        }
        let (work_dir, owns_work_dir) = match &config.work_dir {
            Some(d) => (d.clone(), false),
            None => {
                let suffix: u64 = rand::random();
                (
                    std::env::temp_dir().join(format!("skipper-cp-{}-{suffix:016x}", std::process::id())),
                    true,
                )
            }
        };
        for dir in ["pki", "logs", "etcd"] {
            let path = work_dir.join(dir);
            std::fs::create_dir_all(&path).map_err(|source| ControlPlaneError::WorkDir { path, source })?;
        }
        let mut plane = Self {
            server: String::new(),
            etcd: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            pki: ClusterPki::generate(&serving_names(&config))?,
            files: PkiFiles {
                ca_cert: PathBuf::new(),
                ca_key: PathBuf::new(),
                serving_cert: PathBuf::new(),
                serving_key: PathBuf::new(),
                service_account_key: PathBuf::new(),
                service_account_pub: PathBuf::new(),
                admin_cert: PathBuf::new(),
                admin_key: PathBuf::new(),
            },
            front_proxy_ca: work_dir.join("pki/front-proxy-ca.crt"),
            front_proxy_ca_pem: String::new(),
            admin_kubeconfig: work_dir.join("admin.kubeconfig"),
            work_dir,
            owns_work_dir,
            components: Mutex::new(Vec::new()),
            stop_timeout: config.stop_timeout,
            startup: Duration::ZERO,
        };
        plane.files = plane.pki.write_dir(&plane.work_dir.join("pki"))?;
        plane.start_etcd_and_apiserver(&config).await?;
        plane.start_controllers(&config).await?;
        plane.startup = begin.elapsed();
        tracing::info!(server = %plane.server, startup = ?plane.startup, "control plane ready");
        Ok(plane)
    }

    fn push(&self, component: Component) {
        self.components
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(component);
    }

    /// Starts `name` and waits until `healthy` answers true; the process
    /// joins the control plane only then (a failed one is killed on drop).
    async fn start_component<F, Fut>(
        &self,
        name: &'static str,
        config: &Config,
        args: &[String],
        healthy: F,
    ) -> Result<(), ControlPlaneError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let log = self.work_dir.join("logs").join(format!("{name}.log"));
        let mut component = spawn(name, &config.bin_dir, args, &log)?;
        await_healthy(&mut component, config.start_timeout, healthy).await?;
        self.push(component);
        Ok(())
    }

    /// Starts etcd on fresh loopback ports; returns its client URL.
    async fn start_etcd(&mut self, config: &Config) -> Result<String, ControlPlaneError> {
        let mut attempt = 1;
        loop {
            let etcd_client = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
            let etcd_peer = format!("http://127.0.0.1:{}", free_port()?);
            let etcd_url = format!("http://{etcd_client}");
            self.etcd = etcd_client;
            let etcd_args = vec![
                flag("name", "default"),
                path_flag("data-dir", &self.work_dir.join("etcd")),
                flag("listen-client-urls", &etcd_url),
                flag("advertise-client-urls", &etcd_url),
                flag("listen-peer-urls", &etcd_peer),
                flag("initial-advertise-peer-urls", &etcd_peer),
                flag("initial-cluster", format!("default={etcd_peer}")),
                flag("unsafe-no-fsync", true),
                flag("log-level", "warn"),
            ];
            let started = self
                .start_component("etcd", config, &etcd_args, || {
                    http_ok(etcd_client, "/health", "\"true\"")
                })
                .await;
            if !start_again("etcd", &mut attempt, &started) {
                return started.map(|()| etcd_url);
            }
            // A fresh member: the data of the failed one names its old peer URL.
            let data = self.work_dir.join("etcd");
            let _ = std::fs::remove_dir_all(&data);
            std::fs::create_dir_all(&data)
                .map_err(|source| ControlPlaneError::WorkDir { path: data, source })?;
        }
    }

    async fn start_etcd_and_apiserver(&mut self, config: &Config) -> Result<(), ControlPlaneError> {
        let pki_dir = self.work_dir.join("pki");
        let etcd_url = self.start_etcd(config).await?;

        // The aggregation layer's front proxy: its own CA, as kubeadm does.
        let front_proxy_ca = Ca::generate("front-proxy-ca")?;
        let front_proxy_client = front_proxy_ca.issue_client(FRONT_PROXY_CLIENT, &[])?;
        write(&self.front_proxy_ca, front_proxy_ca.cert_pem(), false)?;
        self.front_proxy_ca_pem = front_proxy_ca.cert_pem().to_owned();
        let proxy_cert = pki_dir.join("front-proxy-client.crt");
        let proxy_key = pki_dir.join("front-proxy-client.key");
        write(&proxy_cert, &front_proxy_client.cert_pem, false)?;
        write(&proxy_key, &front_proxy_client.key_pem, true)?;

        let kubelet_client = if config.kubelet_client {
            let cert = self
                .pki
                .ca
                .issue_client("kube-apiserver-kubelet-client", &["system:masters"])?;
            let (crt, key) = (
                pki_dir.join("apiserver-kubelet-client.crt"),
                pki_dir.join("apiserver-kubelet-client.key"),
            );
            write(&crt, &cert.cert_pem, false)?;
            write(&key, &cert.key_pem, true)?;
            vec![
                path_flag("kubelet-client-certificate", &crt),
                path_flag("kubelet-client-key", &key),
                path_flag("kubelet-certificate-authority", &self.files.ca_cert),
                flag("kubelet-preferred-address-types", "InternalIP"),
            ]
        } else {
            Vec::new()
        };
        let service_range = config
            .service_cluster_ip_range
            .clone()
            .unwrap_or_else(|| SERVICE_CLUSTER_IP_RANGE.to_owned());
        let bind = config.bind_address;
        let mut attempt = 1;
        loop {
            let port = match config.secure_port {
                Some(p) => p,
                None => free_port_on(bind)?,
            };
            self.addr = SocketAddr::from((bind, port));
            self.server = format!("https://{}", self.addr);
            let mut args = vec![
                flag("etcd-servers", &etcd_url),
                flag("bind-address", bind),
                flag("advertise-address", bind),
                flag("secure-port", port),
                path_flag("cert-dir", &pki_dir),
                path_flag("tls-cert-file", &self.files.serving_cert),
                path_flag("tls-private-key-file", &self.files.serving_key),
                path_flag("client-ca-file", &self.files.ca_cert),
                flag("service-account-issuer", SERVICE_ACCOUNT_ISSUER),
                path_flag("service-account-key-file", &self.files.service_account_pub),
                path_flag(
                    "service-account-signing-key-file",
                    &self.files.service_account_key,
                ),
                flag("authorization-mode", "Node,RBAC"),
                flag("enable-admission-plugins", "NodeRestriction"),
                flag("service-cluster-ip-range", &service_range),
                flag("allow-privileged", true),
                flag("profiling", false),
                path_flag("requestheader-client-ca-file", &self.front_proxy_ca),
                flag("requestheader-allowed-names", FRONT_PROXY_CLIENT),
                flag("requestheader-username-headers", "X-Remote-User"),
                flag("requestheader-group-headers", "X-Remote-Group"),
                flag("requestheader-extra-headers-prefix", "X-Remote-Extra-"),
                path_flag("proxy-client-cert-file", &proxy_cert),
                path_flag("proxy-client-key-file", &proxy_key),
            ];
            if bind.is_loopback() {
                // Loopback cannot be an Endpoints address: the `kubernetes`
                // Service keeps no endpoints (pods get the API server's
                // address from the node agent).
                args.push(flag("endpoint-reconciler-type", "none"));
            }
            args.extend(kubelet_client.iter().cloned());
            args.extend(config.apiserver_args.iter().cloned());
            let admin = kubeconfig_text(
                "admin",
                &self.server,
                self.pki.ca.cert_pem(),
                &Credential::Certificate(&self.pki.admin),
            );
            write(&self.admin_kubeconfig, &admin, true)?;
            let client = client_from_kubeconfig("the administrator", &admin).await?;
            let started = self
                .start_component("kube-apiserver", config, &args, || k8s_ok(&client, "/readyz"))
                .await;
            if !start_again("kube-apiserver", &mut attempt, &started) {
                return started;
            }
        }
    }

    async fn start_controllers(&self, config: &Config) -> Result<(), ControlPlaneError> {
        let kcm_kubeconfig =
            self.kubeconfig_for("kube-controller-manager", "system:kube-controller-manager", &[])?;
        let mut attempt = 1;
        loop {
            let kcm_port = free_port()?;
            let kcm_args = vec![
                path_flag("kubeconfig", &kcm_kubeconfig),
                path_flag("authentication-kubeconfig", &kcm_kubeconfig),
                path_flag("authorization-kubeconfig", &kcm_kubeconfig),
                flag("bind-address", "127.0.0.1"),
                flag("secure-port", kcm_port),
                path_flag("cert-dir", &self.work_dir.join("pki/kube-controller-manager")),
                flag("leader-elect", false),
                flag("use-service-account-credentials", true),
                path_flag(
                    "service-account-private-key-file",
                    &self.files.service_account_key,
                ),
                path_flag("root-ca-file", &self.files.ca_cert),
                flag("controllers", CONTROLLERS.join(",")),
                flag("profiling", false),
            ];
            let kcm = insecure_client(kcm_port)?;
            let started = self
                .start_component("kube-controller-manager", config, &kcm_args, || {
                    k8s_ok(&kcm, "/healthz")
                })
                .await;
            if !start_again("kube-controller-manager", &mut attempt, &started) {
                break started;
            }
        }?;

        let scheduler_kubeconfig = self.kubeconfig_for("kube-scheduler", "system:kube-scheduler", &[])?;
        let mut attempt = 1;
        loop {
            let scheduler_port = free_port()?;
            let scheduler_args = vec![
                path_flag("kubeconfig", &scheduler_kubeconfig),
                path_flag("authentication-kubeconfig", &scheduler_kubeconfig),
                path_flag("authorization-kubeconfig", &scheduler_kubeconfig),
                flag("bind-address", "127.0.0.1"),
                flag("secure-port", scheduler_port),
                path_flag("cert-dir", &self.work_dir.join("pki/kube-scheduler")),
                flag("leader-elect", false),
                flag("profiling", false),
            ];
            let scheduler = insecure_client(scheduler_port)?;
            let started = self
                .start_component("kube-scheduler", config, &scheduler_args, || {
                    k8s_ok(&scheduler, "/healthz")
                })
                .await;
            if !start_again("kube-scheduler", &mut attempt, &started) {
                break started;
            }
        }
    }

    /// The API server's URL (`https://<bind address>:PORT`).
    #[must_use]
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The API server's address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The cluster's key material.
    #[must_use]
    pub fn pki(&self) -> &ClusterPki {
        &self.pki
    }

    /// The CA certificate file every component trusts.
    #[must_use]
    pub fn ca_cert(&self) -> &Path {
        &self.files.ca_cert
    }

    /// Who an extension API server accepts requests from: the aggregation
    /// layer's front proxy (its CA and client certificate name).
    #[must_use]
    pub fn front_proxy(&self) -> super::metrics_api::FrontProxy {
        super::metrics_api::FrontProxy {
            ca_pem: self.front_proxy_ca_pem.clone(),
            allowed_names: vec![FRONT_PROXY_CLIENT.to_owned()],
        }
    }

    /// The administrator's kubeconfig (`kubernetes-admin`, `system:masters`).
    #[must_use]
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The work directory (key material, kubeconfigs, `logs/`, etcd's data).
    #[must_use]
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// How long [`ControlPlane::start`] took, from the first process to a
    /// healthy scheduler.
    #[must_use]
    pub fn startup(&self) -> Duration {
        self.startup
    }

    /// The process ids of the running components, in start order.
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        self.components
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter_map(|c| c.child.id())
            .collect()
    }

    /// Compacts etcd's history up to its current revision the way
    /// kube-apiserver's compactor does (it records the revision under
    /// `compact_rev_key`, which every API server watches, then compacts),
    /// so reads at an older resourceVersion answer `410 Gone` — at once
    /// from etcd, and from the watch cache once it has seen the new
    /// compaction revision (it polls every 15 s). Returns the revision.
    ///
    /// # Errors
    /// [`ControlPlaneError::Compact`] when etcd does not answer as expected.
    pub async fn compact(&self) -> Result<u64, ControlPlaneError> {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        // The revision is in the header of any range answer.
        let range = http_post_json(
            self.etcd,
            "/v3/kv/range",
            &serde_json::json!({"key": b64("compact_rev_key")}),
        )
        .await
        .map_err(ControlPlaneError::Compact)?;
        let revision = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse::<u64>().ok())
            .ok_or_else(|| ControlPlaneError::Compact(format!("no revision in {range}")))?;
        http_post_json(
            self.etcd,
            "/v3/kv/put",
            &serde_json::json!({"key": b64("compact_rev_key"), "value": b64(&revision.to_string())}),
        )
        .await
        .map_err(ControlPlaneError::Compact)?;
        http_post_json(
            self.etcd,
            "/v3/kv/compaction",
            &serde_json::json!({"revision": revision.to_string(), "physical": true}),
        )
        .await
        .map_err(ControlPlaneError::Compact)?;
        Ok(revision)
    }

    /// A client as the administrator.
    ///
    /// # Errors
    /// [`ControlPlaneError::Client`].
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        let text = kubeconfig_text(
            "admin",
            &self.server,
            self.pki.ca.cert_pem(),
            &Credential::Certificate(&self.pki.admin),
        );
        client_from_kubeconfig("the administrator", &text).await
    }

    /// Writes `<work dir>/<name>.kubeconfig` for user `user` in `groups` (a
    /// client certificate from the cluster CA) and returns its path.
    ///
    /// # Errors
    /// [`ControlPlaneError::Pki`].
    pub fn kubeconfig_for(
        &self,
        name: &str,
        user: &str,
        groups: &[&str],
    ) -> Result<PathBuf, ControlPlaneError> {
        let cert = self.pki.ca.issue_client(user, groups)?;
        let path = self.work_dir.join(format!("{name}.kubeconfig"));
        let text = kubeconfig_text(
            name,
            &self.server,
            self.pki.ca.cert_pem(),
            &Credential::Certificate(&cert),
        );
        write(&path, &text, true)?;
        Ok(path)
    }

    /// A client for user `user` in `groups`, authenticated by a client
    /// certificate from the cluster CA (a node is `system:node:<name>` in
    /// `system:nodes`).
    ///
    /// # Errors
    /// [`ControlPlaneError`].
    pub async fn client_for(&self, user: &str, groups: &[&str]) -> Result<kube::Client, ControlPlaneError> {
        let cert = self.pki.ca.issue_client(user, groups)?;
        let text = kubeconfig_text(
            user,
            &self.server,
            self.pki.ca.cert_pem(),
            &Credential::Certificate(&cert),
        );
        client_from_kubeconfig(user, &text).await
    }

    /// The text of a kubeconfig that authenticates with `token` (e.g. a
    /// ServiceAccount token from the TokenRequest API).
    #[must_use]
    pub fn token_kubeconfig(&self, name: &str, token: &str) -> String {
        kubeconfig_text(
            name,
            &self.server,
            self.pki.ca.cert_pem(),
            &Credential::Token(token),
        )
    }

    /// Stops the scheduler, the controller manager, the API server and etcd,
    /// in that order: SIGTERM, then SIGKILL after the stop timeout.
    pub async fn shutdown(self) {
        let components: Vec<Component> = std::mem::take(
            &mut *self
                .components
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for mut component in components.into_iter().rev() {
            if let Some(pid) = component.child.id().and_then(|p| i32::try_from(p).ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            if tokio::time::timeout(self.stop_timeout, component.child.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    component = component.name,
                    "did not exit after SIGTERM; killing it"
                );
                let _ = component.child.kill().await;
            }
        }
        // Drop removes the work directory.
    }

    fn kill_all(&self) {
        let mut components = self
            .components
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for component in components.iter_mut().rev() {
            let _ = component.child.start_kill();
        }
        components.clear();
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill_all();
        if self.owns_work_dir {
            let _ = std::fs::remove_dir_all(&self.work_dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(log: PathBuf, tail: &str) -> ControlPlaneError {
        use std::os::unix::process::ExitStatusExt;
        ControlPlaneError::Exited {
            name: "kube-scheduler",
            status: std::process::ExitStatus::from_raw(1 << 8),
            log,
            tail: tail.to_owned(),
        }
    }

    #[test]
    fn only_a_taken_port_starts_a_component_again_and_only_while_attempts_last() {
        let dir = std::env::temp_dir().join(format!("skipper-cp-race-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("kube-scheduler.log");
        std::fs::write(
            &log,
            "E1201 failed to listen on 127.0.0.1:40123: listen tcp 127.0.0.1:40123: bind: address already in use\n\
             more lines after it\n",
        )
        .unwrap();
        // In the log but past the tail: still a lost race.
        assert!(lost_port_race(&exited(log.clone(), "more lines after it")));
        assert!(!lost_port_race(&exited(
            dir.join("missing.log"),
            "panic: bad flag"
        )));
        let timeout = ControlPlaneError::NotReady {
            name: "kube-scheduler",
            waited: Duration::from_secs(60),
            log: log.clone(),
            tail: String::new(),
        };
        assert!(!lost_port_race(&timeout));

        let mut attempt = 1;
        let lost = Err(exited(log.clone(), ""));
        assert!(start_again("kube-scheduler", &mut attempt, &lost));
        assert!(start_again("kube-scheduler", &mut attempt, &lost));
        assert!(
            !start_again("kube-scheduler", &mut attempt, &lost),
            "{PORT_ATTEMPTS} attempts at most"
        );
        assert!(!start_again("kube-scheduler", &mut 1, &Ok(())));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
