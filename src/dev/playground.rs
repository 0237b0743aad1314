//! `skipper dev`: the local playground.
//!
//! Starts the simulated cluster in-process, generates an assignment key
//! pair, creates the objects of `manifests/` against it (the controller
//! Deployment, its Services, Secret and RBAC in namespace `skipper`; one pool
//! Deployment per `--pool` in namespace `default`, from
//! `manifests/example-pool.yaml`), waits for every controller to report
//! `SERVING` and every pool to be Ready, then runs one `skipper router`
//! process on `--listen` that discovers the controllers through the
//! EndpointSlices of the headless controller Service. Controllers and pool
//! pods are pods of the simulated cluster (each on its own loopback IP); the
//! router is a child process (its log goes to `router.log` in the work
//! directory). SIGINT or SIGTERM stops the router, then every pod, and exits 0.
//!
//! The manifests are used as shipped, with these adjustments made in code:
//! namespace, name and replicas of each pool; `--command` replacing the
//! fixture; and controller environment (function namespaces, intervals,
//! text logs). Pods find the API server as on a real cluster: in-cluster
//! configuration with their ServiceAccount token.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::kubelet::{self, KubeletError, NodeKind};
use super::startup;
use crate::config::parse_positive_duration;
use crate::domain::{Function, Scale};
use crate::shutdown::Shutdown;
use crate::telemetry::{self, Format, Level};
use crate::token::SigningKey;
use skipper_devcluster::kubelet::PodNetwork;
use skipper_devcluster::kubelet::network::Bridge;
use skipper_devcluster::real_cluster::{self, RealCluster, RealClusterError};
use skipper_devcluster::{Cluster, ClusterError, Config};

/// `manifests/namespace.yaml`.
pub const NAMESPACE_YAML: &str = include_str!("../../manifests/namespace.yaml");
/// `manifests/rbac.yaml`.
pub const RBAC_YAML: &str = include_str!("../../manifests/rbac.yaml");
/// `manifests/controller.yaml`.
pub const CONTROLLER_YAML: &str = include_str!("../../manifests/controller.yaml");
/// `manifests/router.yaml`.
pub const ROUTER_YAML: &str = include_str!("../../manifests/router.yaml");
/// `manifests/network-policy.yaml`.
pub const NETWORK_POLICY_YAML: &str = include_str!("../../manifests/network-policy.yaml");
/// `manifests/example-pool.yaml`.
pub const EXAMPLE_POOL_YAML: &str = include_str!("../../manifests/example-pool.yaml");

/// Namespace of the controllers (as in `manifests/`).
pub const CONTROLLER_NAMESPACE: &str = "skipper";
/// Namespace of the playground's pools.
pub const POOL_NAMESPACE: &str = "default";
/// Label selector of the controller pods (ring membership).
pub const CONTROLLER_SELECTOR: &str = "app.kubernetes.io/name=skipper,app.kubernetes.io/component=controller";
/// The headless controller Service the router watches.
pub const CONTROLLER_HEADLESS_SERVICE: &str = "skipper-controller-headless";
/// The controllers' gRPC port (as in `manifests/controller.yaml`).
pub const CONTROLLER_PORT: u16 = 50051;
/// The controllers' metrics port (as in `manifests/controller.yaml`).
pub const CONTROLLER_METRICS_PORT: u16 = 9090;
/// The controllers' web UI port (the `--web-port` default, as in
/// `manifests/controller.yaml`).
pub const CONTROLLER_WEB_PORT: u16 = 8080;
/// The Secret holding the controllers' PASETO private key.
pub const PASETO_SECRET: &str = "skipper-controller-paseto";
/// The ConfigMap holding the pools' PASETO public key.
pub const PUBLIC_KEY_CONFIG_MAP: &str = "skipper-paseto-public";
/// The ServiceAccount of routers (as in `manifests/router.yaml`).
pub const ROUTER_SERVICE_ACCOUNT: &str = "skipper-router";
/// The router's token file in the work directory (the router is a process
/// of the playground, not a pod, so the playground does what the kubelet
/// does for a projected token: requests it and keeps it fresh).
pub const ROUTER_TOKEN_FILE: &str = "router-token";
/// Lifetime of the router's token.
const ROUTER_TOKEN_SECONDS: i64 = 3600;
/// The port a pool pod serves on (`manifests/example-pool.yaml`); a
/// `--command` program must listen on `$POD_IP:$PORT` with this port.
pub const POOL_PORT: u16 = 8888;

/// One `--pool NAME=REPLICAS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Deployment name (`skipper/deployment` label value).
    pub name: String,
    /// Pod count.
    pub replicas: u16,
}

/// RFC 1123 label: 1–63 of `[a-z0-9-]`, alphanumeric at both ends.
fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && b.first().is_some_and(alnum)
        && b.last().is_some_and(alnum)
        && b.iter().all(|c| alnum(c) || *c == b'-')
}

/// Parses `NAME=REPLICAS`.
///
/// # Errors
/// A message naming what is wrong.
pub fn parse_pool(s: &str) -> Result<PoolSpec, String> {
    let (name, replicas) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=REPLICAS"))?;
    if !is_dns_label(name) {
        return Err(format!(
            "{name:?} is not a valid Deployment name (RFC 1123 label)"
        ));
    }
    let replicas = replicas
        .parse::<u16>()
        .map_err(|e| format!("replicas {replicas:?} in {s:?}: {e}"))?;
    if replicas > 500 {
        return Err(format!("replicas {replicas} in {s:?}: at most 500"));
    }
    Ok(PoolSpec {
        name: name.to_owned(),
        replicas,
    })
}

/// Flags of the playground (`skipper dev` without a subcommand).
#[derive(Debug, Clone, clap::Args)]
#[group(skip)]
pub struct PlaygroundArgs {
    /// Pool Deployment to create in namespace `default`, NAME=REPLICAS (repeatable)
    #[arg(
        long = "pool",
        env = "SKIPPER_POOL",
        value_name = "NAME=REPLICAS",
        default_value = "fixture=3",
        value_delimiter = ',',
        value_parser = parse_pool
    )]
    pub pools: Vec<PoolSpec>,

    /// Shell command pool pods run instead of `skipper fixture`; it gets POD_IP and PORT and must
    /// serve HTTP on $POD_IP:$PORT
    #[arg(long = "command", env = "SKIPPER_COMMAND", value_name = "SHELL")]
    pub pod_command: Option<String>,

    /// Write the cluster administrator's kubeconfig here (for kubectl)
    #[arg(long, env = "SKIPPER_KUBECONFIG_OUT", value_name = "PATH")]
    pub kubeconfig_out: Option<PathBuf>,

    /// Controllers' --scale-interval
    #[arg(long, env = "SKIPPER_SCALE_INTERVAL", default_value = "5s", value_parser = parse_positive_duration)]
    pub scale_interval: Duration,

    /// Controllers' --heartbeat-timeout (idle functions scale to zero after it)
    #[arg(long, env = "SKIPPER_HEARTBEAT_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    pub heartbeat_timeout: Duration,

    /// Number of controller pods (ring members)
    #[arg(long, env = "SKIPPER_CONTROLLERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=16))]
    pub controllers: u16,

    /// Extra environment of the controller pods, KEY=VALUE (repeatable)
    #[arg(long = "controller-env", env = "SKIPPER_CONTROLLER_ENV", value_name = "KEY=VALUE",
          value_delimiter = ',', value_parser = parse_env)]
    pub controller_env: Vec<(String, String)>,

    /// Where the router listens
    #[arg(long, env = "SKIPPER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Where the router serves Prometheus /metrics
    #[arg(long, env = "SKIPPER_METRICS_LISTEN", default_value = "127.0.0.1:9090")]
    pub metrics_listen: SocketAddr,

    /// First wait of the pods' crash back-off (CrashLoopBackOff); it doubles per restart up to 30
    /// times this, as a kubelet's 10s up to 5m
    #[arg(long, env = "SKIPPER_RESTART_BACKOFF", default_value = "10s", value_parser = parse_positive_duration)]
    pub restart_backoff: Duration,

    /// Bound on bringing everything up
    #[arg(long, env = "SKIPPER_READY_TIMEOUT", default_value = "120s", value_parser = parse_positive_duration)]
    pub ready_timeout: Duration,

    /// How long a pool pod may take to turn Ready during start-up before skipper dev stops, naming
    /// it (a pod that exits stops it at once)
    #[arg(long, env = "SKIPPER_POD_READY_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    pub pod_ready_timeout: Duration,

    /// Export the traces of the router, the controllers and the pool pods over OTLP/HTTP to this
    /// collector (e.g. http://127.0.0.1:4318): sets their OTEL_EXPORTER_OTLP_ENDPOINT and --telemetry
    #[arg(long, env = "SKIPPER_OTLP_ENDPOINT", value_name = "URL", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,

    /// The Kubernetes control plane: `sim` (the embedded API simulator, nothing else needed) or
    /// `real` (etcd, kube-apiserver, kube-controller-manager and kube-scheduler as built by
    /// `make control-plane`, pods on a bridge of their own; needs root)
    #[arg(long, env = "SKIPPER_CONTROL_PLANE", value_enum, default_value_t = ControlPlaneKind::Sim,
          value_name = "sim|real", hide_possible_values = true)]
    pub control_plane: ControlPlaneKind,

    /// Where the binaries of `--control-plane real` are [default: target/control-plane, else
    /// control-plane beside the directory of this executable]
    #[arg(long, env = "SKIPPER_CONTROL_PLANE_DIR", value_name = "DIR")]
    pub control_plane_dir: Option<PathBuf>,

    /// Who runs the pods of `--control-plane real`: `agent` (Skipper's node agent, pods are
    /// processes of the host) or `kubelet` (kubelet and containerd as built by `make nodes`; the
    /// controllers, the router and the pool are pods from the image of `make image`)
    #[arg(long, env = "SKIPPER_NODES", value_enum, default_value_t = NodeKind::Agent,
          value_name = "agent|kubelet", hide_possible_values = true)]
    pub nodes: NodeKind,

    /// Where the binaries of `--nodes kubelet` are [default: target/nodes, else nodes beside the
    /// directory of this executable]
    #[arg(long, env = "SKIPPER_NODES_DIR", value_name = "DIR")]
    pub nodes_dir: Option<PathBuf>,

    /// The image archive `--nodes kubelet` runs [default: target/image/skipper.oci.tar, else
    /// image/skipper.oci.tar beside the directory of this executable]
    #[arg(long, env = "SKIPPER_IMAGE_ARCHIVE", value_name = "PATH")]
    pub image_archive: Option<PathBuf>,

    /// Log level of the playground itself (pods and the router log to files in its work directory)
    #[arg(long, env = "SKIPPER_LOG_LEVEL", default_value = "warn", ignore_case = true)]
    pub log_level: Level,
}

/// Which Kubernetes control plane `skipper dev` runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ControlPlaneKind {
    /// The embedded Kubernetes API simulator.
    Sim,
    /// A real control plane built by `make control-plane`.
    Real,
}

/// Where `make control-plane` puts the binaries, relative to the
/// repository (and the working directory of `cargo run`).
pub const DEFAULT_CONTROL_PLANE_DIR: &str = "target/control-plane";

/// The directory holding every binary of the real control plane:
/// `flag` when given (`--control-plane-dir`), else the first of
/// `default` ([`DEFAULT_CONTROL_PLANE_DIR`]) and `control-plane` in the parent of
/// `exe`'s directory (`target/debug/skipper` → `target/control-plane`)
/// that holds them all.
///
/// # Errors
/// [`PlaygroundError::ControlPlaneMissing`] naming the flag, the directories
/// looked at and the first binary missing.
pub fn control_plane_dir(
    flag: Option<&Path>,
    default: &Path,
    exe: &Path,
) -> Result<PathBuf, PlaygroundError> {
    let candidates: Vec<PathBuf> = match flag {
        Some(dir) => vec![dir.to_path_buf()],
        None => {
            let mut c = vec![default.to_path_buf()];
            if let Some(beside) = exe.parent().and_then(Path::parent) {
                let beside = beside.join("control-plane");
                if !c.contains(&beside) {
                    c.push(beside);
                }
            }
            c
        }
    };
    let missing = |dir: &Path| {
        skipper_devcluster::control_plane::BINARIES
            .into_iter()
            .find(|b| !is_executable(&dir.join(b)))
    };
    let mut first_missing = skipper_devcluster::control_plane::BINARIES[0];
    for (i, dir) in candidates.iter().enumerate() {
        match missing(dir) {
            None => return Ok(dir.clone()),
            Some(b) if i == 0 => first_missing = b,
            Some(_) => {}
        }
    }
    Err(PlaygroundError::ControlPlaneMissing {
        flag: if flag.is_some() {
            "--control-plane-dir"
        } else {
            "--control-plane real"
        },
        binary: first_missing,
        looked_in: candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" and "),
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Checks an OTLP/HTTP collector address: an `http://` or `https://` URL
/// with a host (the exporter appends `/v1/traces`).
///
/// # Errors
/// When it is not such a URL.
pub fn parse_otlp_endpoint(s: &str) -> Result<String, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(h)) if !h.is_empty() => Ok(s.trim_end_matches('/').to_owned()),
        _ => Err(format!("{s:?} is not an http:// or https:// URL with a host")),
    }
}

/// The collector address pods export to. Pods with a network of their
/// own (`host` is the host's address on it) have their own loopback, so a
/// loopback collector host (`127.0.0.0/8`, `::1`, `localhost`) becomes
/// `host`; any other URL, and every URL when pods share the host's
/// network, is kept.
#[must_use]
pub fn otlp_endpoint_for_pods(url: &str, host: Option<std::net::Ipv4Addr>) -> String {
    let Some(host) = host else {
        return url.to_owned();
    };
    let Ok(uri) = url.parse::<http::Uri>() else {
        return url.to_owned();
    };
    let loopback = uri.host().is_some_and(|h| {
        h.eq_ignore_ascii_case("localhost")
            || h.trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    if !loopback {
        return url.to_owned();
    }
    let scheme = uri.scheme_str().unwrap_or("http");
    let port = uri.port_u16().map(|p| format!(":{p}")).unwrap_or_default();
    let rest = uri
        .path_and_query()
        .map(http::uri::PathAndQuery::as_str)
        .filter(|p| *p != "/")
        .unwrap_or("");
    format!("{scheme}://{host}{port}{rest}")
}

/// Parses `KEY=VALUE`.
///
/// # Errors
/// When there is no `=` or the key is empty.
pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// Why the playground failed.
#[derive(Debug, thiserror::Error)]
pub enum PlaygroundError {
    #[error(
        "{flag} {addr}: cannot listen there ({source}); is another `skipper dev` running? choose another address with {flag}"
    )]
    ListenBusy {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "{flag}: no {binary} in {looked_in}; build the control plane with `make control-plane` (needs Go){}",
        if *flag == "--control-plane-dir" { "" } else { " or name its directory with --control-plane-dir" }
    )]
    ControlPlaneMissing {
        flag: &'static str,
        binary: &'static str,
        looked_in: String,
    },
    #[error("starting the simulated cluster: {0}")]
    Cluster(#[from] ClusterError),
    #[error("starting the real control plane: {0}")]
    RealCluster(#[from] RealClusterError),
    #[error("--kubeconfig-out {path}: {source}")]
    KubeconfigOut { path: PathBuf, source: std::io::Error },
    #[error("manifest {file}: {reason}")]
    Manifest { file: &'static str, reason: String },
    #[error("creating {kind} {name}: {source}")]
    Create {
        kind: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("not ready within --ready-timeout {timeout:?}: {waiting_for}")]
    NotReady { timeout: Duration, waiting_for: String },
    #[error("{problem}{}", log_lines(tail))]
    PodFailed {
        problem: Box<startup::PodProblem>,
        /// The last lines of the failed container's log.
        tail: Vec<String>,
    },
    #[error("the router does not serve {what} on {flag} {addr}; see router.log")]
    RouterListener {
        flag: &'static str,
        what: &'static str,
        addr: SocketAddr,
    },
    #[error(
        "{error}\nthe logs of this start are kept in {} (router.log; pods/<namespace>_<pod>/logs/<container>/<restart>.log)",
        kept.display()
    )]
    StartFailed {
        error: Box<PlaygroundError>,
        kept: PathBuf,
    },
    #[error("starting the router {exe}: {source}")]
    RouterStart { exe: PathBuf, source: std::io::Error },
    #[error("the router exited ({status}); see router.log")]
    RouterExited { status: ExitStatus },
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("the router's token: {0}")]
    RouterToken(String),
    #[error(transparent)]
    Kubelet(#[from] KubeletError),
}

/// The tail of a log, indented under the error line; a note when it is empty.
fn log_lines(tail: &[String]) -> String {
    if tail.is_empty() {
        return "; its log is empty".to_owned();
    }
    let mut out = String::from("; the last lines of its log:");
    for line in tail {
        out.push_str("\n    ");
        out.push_str(line);
    }
    out
}

impl PlaygroundError {
    /// Whether the logs of the start explain this failure (they are kept).
    fn logs_explain(&self) -> bool {
        matches!(
            self,
            Self::NotReady { .. }
                | Self::PodFailed { .. }
                | Self::RouterListener { .. }
                | Self::RouterExited { .. }
        )
    }
}

/// Splits a multi-document YAML manifest into JSON objects (empty documents skipped).
///
/// # Errors
/// When a document is not valid YAML.
pub fn manifest_documents(yaml: &str) -> Result<Vec<Value>, serde_yaml_ng::Error> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let v: Value = serde::Deserialize::deserialize(doc)?;
        if v.is_object() {
            out.push(v);
        }
    }
    Ok(out)
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// Creates one manifest object (any kind the API server serves) with the
/// namespace in its metadata; cluster-scoped when it has none.
///
/// # Errors
/// The API error, naming the kind and name.
pub async fn create_object(client: &kube::Client, obj: &Value) -> Result<(), PlaygroundError> {
    let api_version = str_at(obj, "/apiVersion");
    let kind = str_at(obj, "/kind").to_owned();
    let name = str_at(obj, "/metadata/name").to_owned();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &kind));
    let ns = str_at(obj, "/metadata/namespace");
    let api: Api<DynamicObject> = if ns.is_empty() {
        Api::all_with(client.clone(), &ar)
    } else {
        Api::namespaced_with(client.clone(), ns, &ar)
    };
    let err = |source: kube::Error| PlaygroundError::Create {
        kind: kind.clone(),
        name: name.clone(),
        source: Box::new(source),
    };
    let typed: DynamicObject =
        serde_json::from_value(obj.clone()).map_err(|e| err(kube::Error::SerdeError(e)))?;
    api.create(&PostParams::default(), &typed).await.map_err(err)?;
    Ok(())
}

fn documents(file: &'static str, yaml: &str) -> Result<Vec<Value>, PlaygroundError> {
    manifest_documents(yaml).map_err(|e| PlaygroundError::Manifest {
        file,
        reason: e.to_string(),
    })
}

fn set_env(container: &mut Value, name: &str, value: &str) {
    set_env_var(container, json!({"name": name, "value": value}));
}

fn set_env_var(container: &mut Value, var: Value) {
    if !container["env"].is_array() {
        container["env"] = json!([]);
    }
    let name = var["name"].clone();
    if let Some(env) = container["env"].as_array_mut() {
        env.retain(|e| e["name"] != name);
        env.push(var);
    }
}

/// The pool Deployment of `manifests/example-pool.yaml`, renamed to
/// `pool.name` in `namespace` with `pool.replicas` pods, and `command` (run
/// with `sh -c`, given `POD_IP` and `PORT`) instead of the fixture when given.
///
/// # Errors
/// When the manifest has no Deployment.
pub fn pool_manifest(
    namespace: &str,
    pool: &PoolSpec,
    command: Option<&str>,
    otlp_endpoint: Option<&str>,
) -> Result<Value, PlaygroundError> {
    let mut d = documents("example-pool.yaml", EXAMPLE_POOL_YAML)?
        .into_iter()
        .find(|d| str_at(d, "/kind") == "Deployment")
        .ok_or(PlaygroundError::Manifest {
            file: "example-pool.yaml",
            reason: "no Deployment".into(),
        })?;
    let name = pool.name.as_str();
    d["metadata"]["name"] = json!(name);
    d["metadata"]["namespace"] = json!(namespace);
    d["metadata"]["labels"]["skipper/deployment"] = json!(name);
    d["spec"]["replicas"] = json!(pool.replicas);
    d["spec"]["selector"]["matchLabels"]["skipper/deployment"] = json!(name);
    d["spec"]["template"]["metadata"]["labels"]["skipper/deployment"] = json!(name);
    let container = &mut d["spec"]["template"]["spec"]["containers"][0];
    if let Some(url) = otlp_endpoint {
        set_env(container, "SKIPPER_TELEMETRY", "true");
        set_env(container, "OTEL_EXPORTER_OTLP_ENDPOINT", url);
    }
    if let Some(cmd) = command {
        container["command"] = json!(["sh", "-c", cmd]);
        if let Some(obj) = container.as_object_mut() {
            obj.remove("args");
        }
        set_env_var(
            container,
            json!({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}),
        );
        set_env(container, "PORT", &POOL_PORT.to_string());
        container["readinessProbe"] = json!({"tcpSocket": {"port": "http"}, "periodSeconds": 1});
    }
    Ok(d)
}

/// The other objects of `manifests/example-pool.yaml` (RBAC) moved to `namespace`.
fn pool_rbac(namespace: &str) -> Result<Vec<Value>, PlaygroundError> {
    let mut out = Vec::new();
    for mut d in documents("example-pool.yaml", EXAMPLE_POOL_YAML)? {
        if matches!(str_at(&d, "/kind"), "Namespace" | "Deployment") {
            continue;
        }
        d["metadata"]["namespace"] = json!(namespace);
        out.push(d);
    }
    Ok(out)
}

/// The objects of `manifests/controller.yaml` with `replicas` controllers
/// serving the pool namespaces, and `env` added to their container.
fn controller_manifests(replicas: u16, env: &[(String, String)]) -> Result<Vec<Value>, PlaygroundError> {
    let mut docs = documents("controller.yaml", CONTROLLER_YAML)?;
    for d in &mut docs {
        if str_at(d, "/kind") != "Deployment" {
            continue;
        }
        d["spec"]["replicas"] = json!(replicas);
        let container = &mut d["spec"]["template"]["spec"]["containers"][0];
        for (k, v) in env {
            set_env(container, k, v);
        }
    }
    Ok(docs)
}

/// The header value of a function served by pool `deployment` for `tenant`.
#[must_use]
pub fn example_function(deployment: &str, tenant: &str) -> String {
    Function {
        namespace: POOL_NAMESPACE.into(),
        deployment: deployment.into(),
        tenant: tenant.into(),
        metadata: None,
        scale: Some(Scale {
            max_instances: Some(1),
            ..Scale::default()
        }),
        oneshot: None,
    }
    .to_json()
}

/// GET `path` over HTTP/1.0; the status code, if any answer came.
async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut buf = Vec::with_capacity(64);
        let mut chunk = [0u8; 64];
        while buf.len() < 12 {
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        String::from_utf8_lossy(&buf[9..12]).parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(2), attempt)
        .await
        .ok()
        .flatten()
}

/// Whether a controller's gRPC health service reports `SERVING`.
async fn controller_serving(ip: &str) -> bool {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let check = async {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{ip}:{CONTROLLER_PORT}")).ok()?;
        let channel = endpoint
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .ok()?;
        let resp = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()?;
        Some(
            resp.into_inner().status
                == tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
        )
    };
    tokio::time::timeout(Duration::from_secs(2), check)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Whether a pod's `Ready` condition is `True`.
pub(crate) fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The router child process; stopped with SIGTERM (then SIGKILL) on drop.
struct RouterProcess {
    child: tokio::process::Child,
}

impl RouterProcess {
    async fn stop(mut self, grace: Duration) {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        if tokio::time::timeout(grace, self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

/// Requests a token of the routers' ServiceAccount
/// (`skipper/skipper-router`) for the controllers' audience, valid for
/// `seconds` (TokenRequest): what a router pod gets in its projected volume.
///
/// # Errors
/// [`PlaygroundError::RouterToken`] with the API's answer.
pub async fn router_token(client: &kube::Client, seconds: i64) -> Result<String, PlaygroundError> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    let fail = |e: String| PlaygroundError::RouterToken(e);
    let api: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), CONTROLLER_NAMESPACE);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![crate::credentials::AUDIENCE.to_owned()],
            expiration_seconds: Some(seconds),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    let answer: TokenRequest = api
        .create_subresource("token", ROUTER_SERVICE_ACCOUNT, &PostParams::default(), &request)
        .await
        .map_err(|e| {
            fail(format!(
                "TokenRequest for {CONTROLLER_NAMESPACE}/{ROUTER_SERVICE_ACCOUNT}: {e}"
            ))
        })?;
    answer
        .status
        .map(|s| s.token)
        .ok_or_else(|| fail("the TokenRequest has no status".into()))
}

/// Writes a fresh router token to `path`, replacing the file in one step
/// (as the kubelet does).
async fn write_router_token(client: &kube::Client, path: &Path) -> Result<(), PlaygroundError> {
    let fail = |e: String| PlaygroundError::RouterToken(e);
    let token = router_token(client, ROUTER_TOKEN_SECONDS).await?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, token).map_err(|e| fail(format!("{}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    Ok(())
}

/// Writes the router's token now and renews it at 80% of its life until
/// shutdown.
async fn keep_router_token(
    client: kube::Client,
    path: PathBuf,
    shutdown: &Shutdown,
) -> Result<(), PlaygroundError> {
    write_router_token(&client, &path).await?;
    let token = shutdown.token().clone();
    let every = Duration::from_secs(u64::try_from(ROUTER_TOKEN_SECONDS * 4 / 5).unwrap_or(2880));
    shutdown.spawn("router-token", async move {
        loop {
            tokio::select! {
                () = token.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            if let Err(e) = write_router_token(&client, &path).await {
                tracing::warn!(error = %e, "failed to renew the router's token");
            }
        }
    });
    Ok(())
}

/// The router's heartbeat interval: well inside the heartbeat timeout.
fn router_heartbeat(args: &PlaygroundArgs) -> Duration {
    (args.heartbeat_timeout / 3).clamp(Duration::from_millis(200), Duration::from_secs(5))
}

/// The addresses the router serves on, held by the playground until the
/// router starts: a busy one fails the start at once, naming its flag.
struct RouterAddrs {
    /// `--listen`.
    listen: std::net::TcpListener,
    /// `--metrics-listen`.
    metrics: std::net::TcpListener,
    /// CPU profiles: a free port beside `--listen`.
    pprof: std::net::TcpListener,
}

/// The router's addresses as bound.
#[derive(Debug, Clone, Copy)]
struct RouterPorts {
    listen: SocketAddr,
    metrics: SocketAddr,
    /// `None` when the router runs as pods (on kubelet nodes).
    pprof: Option<SocketAddr>,
}

impl RouterAddrs {
    /// Binds `--listen` and `--metrics-listen` (a port 0 picks a free one)
    /// and a free port for profiles on `--listen`'s host.
    fn bind(args: &PlaygroundArgs) -> Result<Self, PlaygroundError> {
        let bind = |flag: &'static str, addr: SocketAddr| {
            std::net::TcpListener::bind(addr).map_err(|source| PlaygroundError::ListenBusy {
                flag,
                addr,
                source,
            })
        };
        Ok(Self {
            listen: bind("--listen", args.listen)?,
            metrics: bind("--metrics-listen", args.metrics_listen)?,
            pprof: bind("--listen", SocketAddr::new(args.listen.ip(), 0))?,
        })
    }

    fn ports(&self) -> RouterPorts {
        let addr = |l: &std::net::TcpListener, fallback: SocketAddr| l.local_addr().unwrap_or(fallback);
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        RouterPorts {
            listen: addr(&self.listen, any),
            metrics: addr(&self.metrics, any),
            pprof: Some(addr(&self.pprof, any)),
        }
    }
}

/// Starts the router on the addresses `held` kept free for it (released
/// just before).
fn spawn_router(
    args: &PlaygroundArgs,
    exe: &Path,
    kubeconfig: &Path,
    work_dir: &Path,
    held: RouterAddrs,
) -> Result<(RouterProcess, RouterPorts), PlaygroundError> {
    let ports = held.ports();
    let log = work_dir.join("router.log");
    let open = || std::fs::OpenOptions::new().create(true).append(true).open(&log);
    let start_err = |source| PlaygroundError::RouterStart {
        exe: exe.to_path_buf(),
        source,
    };
    let (out, err) = (open().map_err(start_err)?, open().map_err(start_err)?);
    let heartbeat = router_heartbeat(args);
    let mut cmd = tokio::process::Command::new(exe);
    let (listen, metrics) = (ports.listen, ports.metrics);
    let pprof = ports.pprof.unwrap_or(SocketAddr::new(listen.ip(), 0));
    cmd.arg("router")
        .args(["--host", &listen.ip().to_string()])
        .args(["--port", &listen.port().to_string()])
        .args(["--pod-ip", &listen.ip().to_string()])
        .args(["--controller-service-host", "skipper-controller.skipper.svc"])
        .args(["--controller-namespace", CONTROLLER_NAMESPACE])
        .args(["--controller-headless-service-name", CONTROLLER_HEADLESS_SERVICE])
        .args(["--controller-port", &CONTROLLER_PORT.to_string()])
        .args(["--zone", "zone-a"])
        .args([
            "--controller-token-file",
            &work_dir.join(ROUTER_TOKEN_FILE).display().to_string(),
        ])
        .args(["--heartbeat-interval", &crate::config::format_duration(heartbeat)])
        .args(["--log-format", "text"])
        .args(["--pprof-host", &pprof.ip().to_string()])
        .args(["--pprof-port", &pprof.port().to_string()])
        .args(["--telemetry", "true"])
        .args(["--telemetry-prometheus-host", &metrics.ip().to_string()])
        .args(["--telemetry-prometheus-port", &metrics.port().to_string()])
        .env_clear()
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        // Its own process group: Ctrl-C in the terminal reaches only the
        // playground, which then stops the router before the pods.
        .process_group(0)
        .kill_on_drop(true);
    for var in ["PATH", "HOME", "LANG", "RUST_BACKTRACE"] {
        if let Ok(v) = std::env::var(var) {
            cmd.env(var, v);
        }
    }
    match &args.otlp_endpoint {
        Some(url) => {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", url);
        }
        // No collector named: metrics only, no spans and no export attempts.
        None => {
            cmd.args(["--telemetry-trace", "false"]);
        }
    }
    drop(held);
    let child = cmd.spawn().map_err(start_err)?;
    Ok((RouterProcess { child }, ports))
}

/// What the playground brought up.
struct Up {
    controller_ips: Vec<String>,
    router: RouterPorts,
}

/// The pods of `ns` matching `selector`; `None` when the API does not
/// answer (the caller asks again until its deadline).
async fn list_pods(client: &kube::Client, ns: &str, selector: &str) -> Option<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    match api.list(&ListParams::default().labels(selector)).await {
        Ok(list) => Some(list.items),
        Err(e) => {
            tracing::debug!(error = %e, namespace = ns, selector, "listing pods");
            None
        }
    }
}

/// The IPs of `pods` that are Ready and not being deleted, sorted.
fn ready_ips(pods: &[Pod]) -> Vec<String> {
    let mut ips: Vec<String> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && pod_ready(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .filter(|ip| !ip.is_empty())
        .collect();
    ips.sort();
    ips
}

/// The first pod of the playground that failed its start, with the tail
/// of its log.
fn failed_pod(
    work_dir: &Path,
    pods: &[(startup::Role, &[Pod])],
    pod_ready_timeout: Duration,
) -> Option<PlaygroundError> {
    let now = jiff::Timestamp::now();
    let problem = pods.iter().find_map(|(role, pods)| {
        pods.iter()
            .find_map(|p| startup::pod_problem(p, *role, now, pod_ready_timeout))
    })?;
    let tail = startup::log_tail(&startup::log_file(work_dir, &problem), startup::LOG_TAIL_LINES);
    Some(PlaygroundError::PodFailed {
        problem: Box::new(problem),
        tail,
    })
}

/// Waits until every controller is Ready and `SERVING`, every pool has its
/// Ready pods and the router — the process, or with `router` `None` the
/// router pods behind the forwarder on `--listen` — is healthy and serves
/// metrics (and profiles); stops at once when a pod of the playground fails
/// its start or the router exits.
async fn bring_up(
    args: &PlaygroundArgs,
    cluster: &PlaygroundCluster,
    mut router: Option<&mut RouterProcess>,
    ports: RouterPorts,
) -> Result<Up, PlaygroundError> {
    let deadline = tokio::time::Instant::now() + args.ready_timeout;
    let client = &cluster.client;
    let pool_selector = format!(
        "skipper/deployment in ({})",
        args.pools
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut serving: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    loop {
        let controllers = list_pods(client, CONTROLLER_NAMESPACE, CONTROLLER_SELECTOR).await;
        let pools = list_pods(client, POOL_NAMESPACE, &pool_selector).await;
        let (controllers, pools) = (controllers.unwrap_or_default(), pools.unwrap_or_default());
        if let Some(failed) = failed_pod(
            &cluster.work_dir,
            &[
                (startup::Role::Controller, &controllers),
                (startup::Role::Pool, &pools),
            ],
            args.pod_ready_timeout,
        ) {
            return Err(failed);
        }
        if let Some(router) = router.as_mut()
            && let Some(status) = router
                .child
                .try_wait()
                .map_err(|source| PlaygroundError::RouterStart {
                    exe: PathBuf::from("skipper router"),
                    source,
                })?
        {
            return Err(PlaygroundError::RouterExited { status });
        }
        let controller_ips = ready_ips(&controllers);
        for ip in &controller_ips {
            if !serving.contains(ip) && controller_serving(ip).await {
                serving.insert(ip.clone());
            }
        }
        let waiting_for = if controller_ips.len() != usize::from(args.controllers) {
            Some(format!(
                "{} Ready controller pods ({} are)",
                args.controllers,
                controller_ips.len()
            ))
        } else if let Some(ip) = controller_ips.iter().find(|ip| !serving.contains(*ip)) {
            Some(format!("controller {ip} to report SERVING"))
        } else if let Some(pool) = args.pools.iter().find(|pool| {
            let of_pool: Vec<Pod> = pools
                .iter()
                .filter(|p| {
                    p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("skipper/deployment"))
                        == Some(&pool.name)
                })
                .cloned()
                .collect();
            ready_ips(&of_pool).len() < usize::from(pool.replicas)
        }) {
            Some(format!("{} Ready pods of pool {}", pool.replicas, pool.name))
        } else if http_status(ports.listen, "/healthz").await != Some(200) {
            let through = if router.is_none() {
                " (forwarded to the router pods)"
            } else {
                ""
            };
            Some(format!("the router's /healthz on {}{through}", ports.listen))
        } else {
            None
        };
        let Some(waiting_for) = waiting_for else {
            router_listeners(ports).await?;
            return Ok(Up {
                controller_ips,
                router: ports,
            });
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(PlaygroundError::NotReady {
                timeout: args.ready_timeout,
                waiting_for,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks that the router, once healthy, serves what the ready block
/// advertises: its metrics on `--metrics-listen` and profiles.
async fn router_listeners(ports: RouterPorts) -> Result<(), PlaygroundError> {
    if http_status(ports.metrics, "/metrics").await != Some(200) {
        return Err(PlaygroundError::RouterListener {
            flag: "--metrics-listen",
            what: "metrics",
            addr: ports.metrics,
        });
    }
    if let Some(pprof) = ports.pprof
        && http_status(pprof, "/debug/pprof/").await != Some(200)
    {
        return Err(PlaygroundError::RouterListener {
            flag: "--listen",
            what: "profiles (a free port on the host of)",
            addr: pprof,
        });
    }
    Ok(())
}

fn print_ready(args: &PlaygroundArgs, cluster: &PlaygroundCluster, up: &Up, took: Duration, describe: &str) {
    let work_dir = &cluster.work_dir;
    let pool = args.pools.first().map_or("fixture", |p| p.name.as_str());
    let function = example_function(pool, "t1");
    let listen = up.router.listen;
    let kubeconfig = args.kubeconfig_out.as_deref().unwrap_or(&cluster.kubeconfig);
    let members = up.controller_ips.join(",");
    let first = up.controller_ips.first().map_or("", String::as_str);
    println!("skipper dev ready: router http://{listen}");
    println!("curl -sS -H 'X-Skipper-Function: {function}' http://{listen}/hello");
    println!();
    println!(
        "  kubectl:       KUBECONFIG={} kubectl get pods -A",
        kubeconfig.display()
    );
    println!("  web UI:        http://{first}:{CONTROLLER_WEB_PORT}/ (every controller serves one)");
    if let Some(url) = &args.otlp_endpoint {
        println!("  traces:        OTLP/HTTP to {url} (router, controllers, pool pods)");
        let pods = otlp_endpoint_for_pods(url, cluster.host_on_pod_network);
        if &pods != url {
            println!("                 pods send to {pods}: the host on the pod network (listen there too)");
        }
    }
    println!("  controllers:   {members} (gRPC :{CONTROLLER_PORT}, metrics :{CONTROLLER_METRICS_PORT})");
    println!("  metrics:       curl -s http://{}/metrics", up.router.metrics);
    println!("                 curl -s http://{first}:{CONTROLLER_METRICS_PORT}/metrics");
    match up.router.pprof {
        Some(pprof) => println!(
            "  profiles:      http://{pprof}/debug/pprof/ (router), http://{first}:6060/debug/pprof/ (controller)"
        ),
        None => println!("  profiles:      http://{first}:6060/debug/pprof/ (controller)"),
    }
    println!(
        "  ring-inspect:  skipper ring-inspect --controller {first}:{CONTROLLER_PORT} --token-file {} --function '{function}'",
        work_dir.join(ROUTER_TOKEN_FILE).display()
    );
    println!("  pod network:   {}", cluster.pod_network);
    match &cluster.image {
        None => println!(
            "  logs:          kubectl logs, or {} (router.log; pods/<namespace>_<pod>/logs/<container>/<restart>.log)",
            work_dir.display()
        ),
        Some(image) => {
            println!(
                "  nodes:         {} kubelet nodes running {image} (kubectl get nodes -o wide)",
                kubelet::node_count()
            );
            println!(
                "  logs:          kubectl logs, or {} (nodes/<node>/pod-logs/<namespace>_<pod>_<uid>/<container>/<restart>.log)",
                work_dir.display()
            );
        }
    }
    println!("  started in:    {:.1}s ({describe})", took.as_secs_f64());
    println!("  stop:          Ctrl-C");
}

/// The cluster the playground drives, through what every backend offers:
/// the Kubernetes API as the administrator (a kube client and a
/// kubeconfig), a work directory, and shutdown.
struct PlaygroundCluster {
    backend: Backend,
    /// The administrator's client.
    client: kube::Client,
    /// The administrator's kubeconfig.
    kubeconfig: PathBuf,
    /// Holds the router's log and token, and the pods' directories.
    work_dir: PathBuf,
    /// The host's address as pods reach it, when pods have a network of
    /// their own (the bridge's gateway); `None` when they share the host's.
    host_on_pod_network: Option<std::net::Ipv4Addr>,
    /// How pods are networked.
    pod_network: PodNetworkKind,
    /// On kubelet nodes: the image every Skipper pod runs (its name in the
    /// nodes). `None` when the node agent runs pods as host processes.
    image: Option<String>,
}

/// How the playground's pods are networked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodNetworkKind {
    /// A network namespace per pod on this bridge.
    Bridge {
        name: String,
        subnet: (std::net::Ipv4Addr, u8),
    },
    /// A loopback address per pod in the host's network namespace, and why
    /// there is no bridge.
    Loopback { why: String },
}

impl PodNetworkKind {
    fn of(bridge: &Bridge) -> Self {
        Self::Bridge {
            name: bridge.name().to_owned(),
            subnet: bridge.subnet(),
        }
    }

    /// The one line `skipper dev` prints when pods share the host's network.
    #[must_use]
    pub fn announcement(&self) -> Option<String> {
        match self {
            Self::Bridge { .. } => None,
            Self::Loopback { why } => Some(format!(
                "skipper dev: pods share the host's network, each on a loopback address of its own, so a pod must bind $POD_IP, not 0.0.0.0 (no network namespace per pod: {why})"
            )),
        }
    }
}

impl std::fmt::Display for PodNetworkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bridge {
                name,
                subnet: (ip, prefix),
            } => write!(
                f,
                "a network namespace per pod on bridge {name} ({ip}/{prefix}, the host at .1)"
            ),
            Self::Loopback { .. } => write!(f, "the host's, a loopback address per pod (pods bind $POD_IP)"),
        }
    }
}

/// The simulator's pod network: a bridge when this process can make one
/// and `pods` fit on it, else loopback addresses (and why).
async fn simulator_pod_network(pods: usize) -> (PodNetwork, PodNetworkKind) {
    let loopback = |why: String| (PodNetwork::Loopback, PodNetworkKind::Loopback { why });
    let capacity = skipper_devcluster::kubelet::network::IpPool::capacity();
    if pods > capacity {
        return loopback(format!(
            "--pool and --controllers ask for {pods} pods, more than the {capacity} addresses of a pod bridge"
        ));
    }
    match tokio::task::spawn_blocking(Bridge::create).await {
        Ok(Ok(bridge)) => {
            let kind = PodNetworkKind::of(&bridge);
            (PodNetwork::Bridge(std::sync::Arc::new(bridge)), kind)
        }
        Ok(Err(e)) => loopback(e.to_string()),
        Err(e) => loopback(e.to_string()),
    }
}

/// What runs the Kubernetes API and the pods.
enum Backend {
    /// The embedded simulator with its node agent.
    Simulator(Cluster),
    /// A real control plane with the node agent, pods on a bridge.
    Real(Box<RealCluster>),
}

/// The control plane the flags ask for, checked before anything starts.
enum Target {
    Simulator,
    /// The real control plane; its nodes are kubelets when `kubelet` is set.
    Real {
        bin_dir: PathBuf,
        kubelet: Option<kubelet::Build>,
    },
}

impl Target {
    fn from_args(args: &PlaygroundArgs, exe: &Path) -> Result<Self, PlaygroundError> {
        if args.nodes == NodeKind::Kubelet && args.control_plane != ControlPlaneKind::Real {
            return Err(KubeletError::NeedsRealControlPlane.into());
        }
        match args.control_plane {
            ControlPlaneKind::Sim => Ok(Self::Simulator),
            ControlPlaneKind::Real => {
                let bin_dir = control_plane_dir(
                    args.control_plane_dir.as_deref(),
                    Path::new(DEFAULT_CONTROL_PLANE_DIR),
                    exe,
                )?;
                let kubelet = match args.nodes {
                    NodeKind::Agent => None,
                    NodeKind::Kubelet => Some(kubelet::find_build(args, exe)?),
                };
                Ok(Self::Real { bin_dir, kubelet })
            }
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Self::Simulator => "simulated control plane",
            Self::Real { kubelet: None, .. } => "real control plane",
            Self::Real { kubelet: Some(_), .. } => "real control plane, kubelet nodes",
        }
    }
}

impl PlaygroundCluster {
    async fn start(args: &PlaygroundArgs, exe: &Path, target: Target) -> Result<Self, PlaygroundError> {
        let restart_backoff = skipper_devcluster::kubelet::BackoffPolicy {
            initial: args.restart_backoff,
            max: args.restart_backoff.saturating_mul(30),
        };
        match target {
            Target::Simulator => {
                let pods = args.pools.iter().map(|p| usize::from(p.replicas)).sum::<usize>()
                    + usize::from(args.controllers);
                let (pod_network, kind) = simulator_pod_network(pods).await;
                let cluster = Cluster::start(Config {
                    skipper_exe: exe.to_path_buf(),
                    restart_backoff,
                    pod_network,
                    ..Config::default()
                })
                .await?;
                let host_on_pod_network = cluster.bridge().map(Bridge::gateway);
                let client = cluster.client()?;
                let kubeconfig = cluster.kubeconfig_path().to_path_buf();
                let work_dir = kubeconfig
                    .parent()
                    .unwrap_or_else(|| Path::new("."))
                    .to_path_buf();
                Ok(Self {
                    backend: Backend::Simulator(cluster),
                    client,
                    kubeconfig,
                    work_dir,
                    host_on_pod_network,
                    pod_network: kind,
                    image: None,
                })
            }
            Target::Real { bin_dir, kubelet } => {
                let sim = Config::default();
                let node_kind = match &kubelet {
                    None => real_cluster::Nodes::Agent,
                    Some(build) => real_cluster::Nodes::Kubelet(build.nodes_config()),
                };
                let cluster = RealCluster::start(real_cluster::Config {
                    control_plane: skipper_devcluster::control_plane::Config {
                        bin_dir,
                        ..skipper_devcluster::control_plane::Config::default()
                    },
                    skipper_exe: exe.to_path_buf(),
                    // The simulator's nodes, one per zone.
                    nodes: sim
                        .zones
                        .iter()
                        .enumerate()
                        .map(|(i, zone)| skipper_devcluster::kubelet::NodeSpec {
                            name: format!("node-{i}"),
                            zone: zone.clone(),
                        })
                        .collect(),
                    restart_backoff,
                    metrics_interval: sim.metrics_interval,
                    volume_resync: sim.volume_resync,
                    node_kind,
                    // The controllers read pod metrics, as from metrics-server.
                    metrics_api: true,
                    ..real_cluster::Config::default()
                })
                .await?;
                let image = match (&kubelet, cluster.kubelet_nodes()) {
                    (Some(build), Some(nodes)) => Some(kubelet::image_name(nodes, &build.image_archive)?),
                    _ => None,
                };
                let client = cluster.client().await?;
                let kubeconfig = cluster.admin_kubeconfig().to_path_buf();
                let work_dir = cluster.work_dir().to_path_buf();
                let host_on_pod_network = Some(cluster.bridge().gateway());
                let pod_network = PodNetworkKind::of(cluster.bridge());
                Ok(Self {
                    backend: Backend::Real(Box::new(cluster)),
                    client,
                    kubeconfig,
                    work_dir,
                    host_on_pod_network,
                    pod_network,
                    image,
                })
            }
        }
    }

    /// Copies the administrator's kubeconfig to `path` (mode 0600).
    fn write_kubeconfig(&self, path: &Path) -> Result<(), PlaygroundError> {
        let fail = |source| PlaygroundError::KubeconfigOut {
            path: path.to_path_buf(),
            source,
        };
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(fail)?;
        }
        let text = std::fs::read_to_string(&self.kubeconfig).map_err(fail)?;
        skipper_devcluster::pki::write_file(path, &text, true).map_err(|e| match e {
            skipper_devcluster::pki::PkiError::Write { source, .. } => fail(source),
            other => fail(std::io::Error::other(other.to_string())),
        })
    }

    async fn shutdown(self) {
        match self.backend {
            Backend::Simulator(cluster) => cluster.shutdown().await,
            Backend::Real(cluster) => cluster.shutdown().await,
        }
    }
}

/// Runs the playground until SIGINT/SIGTERM.
///
/// # Errors
/// [`PlaygroundError`]: a busy `--listen`, a manifest the cluster rejects,
/// or a part that does not come up within `--ready-timeout`.
pub async fn run(args: PlaygroundArgs) -> Result<ExitCode, PlaygroundError> {
    let started = std::time::Instant::now();
    telemetry::init(&telemetry::Args {
        log_level: args.log_level,
        log_format: Format::Text,
        ..telemetry::Args::default()
    });
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("skipper"));
    let target = Target::from_args(&args, &exe)?;
    let describe = target.describe();
    // Fail at once on a busy port, before anything starts; the ports stay
    // held until the router takes them.
    let held = RouterAddrs::bind(&args)?;
    if let Some(url) = &args.otlp_endpoint
        && let Some(warning) = otlp_unreachable(url).await
    {
        eprintln!("{warning}");
    }
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals().map_err(PlaygroundError::Signals)?;
    let cluster = PlaygroundCluster::start(&args, &exe, target).await?;
    if let Some(line) = cluster.pod_network.announcement() {
        eprintln!("{line}");
    }
    let result = match &args.kubeconfig_out {
        Some(path) => cluster.write_kubeconfig(path),
        None => Ok(()),
    };
    let result = match result {
        Ok(()) => tokio::select! {
            r = serve(&args, &cluster, &exe, &shutdown, held, (started, describe)) => r,
            () = shutdown.cancelled() => Ok(()),
        },
        Err(e) => Err(e),
    };
    // The work directory goes with the cluster: keep what explains a failure.
    let result = match result {
        Err(error) if error.logs_explain() => {
            match startup::keep_logs(&cluster.work_dir, &std::env::temp_dir()) {
                Ok(kept) => Err(PlaygroundError::StartFailed {
                    error: Box::new(error),
                    kept,
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "could not keep the logs");
                    Err(error)
                }
            }
        }
        other => other,
    };
    // The playground's own tasks (the router's token, the forwarder) stop
    // before the cluster does.
    shutdown.drain(Duration::from_secs(5)).await;
    cluster.shutdown().await;
    result.map(|()| ExitCode::SUCCESS)
}

/// A warning line when nothing accepts connections at the OTLP collector's
/// address (traces would be dropped without a word).
async fn otlp_unreachable(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri
        .host()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    });
    let connect = tokio::net::TcpStream::connect((host.as_str(), port));
    let why = match tokio::time::timeout(Duration::from_secs(2), connect).await {
        Ok(Ok(_)) => return None,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "no answer within 2s".to_owned(),
    };
    Some(format!(
        "skipper dev: warning: --otlp-endpoint {url}: nothing accepts connections there ({why}); traces are dropped until a collector listens"
    ))
}

async fn serve(
    args: &PlaygroundArgs,
    cluster: &PlaygroundCluster,
    exe: &Path,
    shutdown: &Shutdown,
    held: RouterAddrs,
    (started, describe): (std::time::Instant, &str),
) -> Result<(), PlaygroundError> {
    apply_manifests(args, cluster).await?;
    let work_dir = &cluster.work_dir;
    keep_router_token(cluster.client.clone(), work_dir.join(ROUTER_TOKEN_FILE), shutdown).await?;
    // On kubelet nodes the router is a pod; --listen forwards to it.
    let (mut router, ports) = match &cluster.image {
        None => {
            let (router, ports) = spawn_router(args, exe, &cluster.kubeconfig, work_dir, held)?;
            (Some(router), ports)
        }
        Some(_) => {
            let mut ports = held.ports();
            // The router pods serve profiles on their own addresses.
            ports.pprof = None;
            drop(held);
            kubelet::forward_to_router_pods(cluster.client.clone(), ports.listen, ports.metrics, shutdown)
                .await?;
            (None, ports)
        }
    };
    let up = match bring_up(args, cluster, router.as_mut(), ports).await {
        Ok(up) => up,
        Err(e) => {
            if let Some(router) = router {
                router.stop(Duration::from_secs(2)).await;
            }
            return Err(e);
        }
    };
    print_ready(args, cluster, &up, started.elapsed(), describe);
    let Some(mut router) = router else {
        shutdown.cancelled().await;
        return Ok(());
    };
    let exited = tokio::select! {
        () = shutdown.cancelled() => None,
        status = router.child.wait() => Some(status),
    };
    match exited {
        None => {
            router.stop(Duration::from_secs(10)).await;
            Ok(())
        }
        // Stopped by a signal of its own (it drains and exits 0).
        Some(Ok(status)) if status.success() => Ok(()),
        Some(status) => Err(PlaygroundError::RouterExited {
            status: status.map_err(|source| PlaygroundError::RouterStart {
                exe: exe.to_path_buf(),
                source,
            })?,
        }),
    }
}

/// The controllers' environment: the playground's settings, then
/// `--controller-env` (which wins).
///
/// The downscale stabilization window is the heartbeat timeout: a freshly
/// started controller scales nothing down for `max(stabilization, heartbeat
/// timeout)` (spec §5.5), so with the product's 90 s window an idle tenant's
/// pod would stay 90 s after the playground starts, whatever
/// `--heartbeat-timeout` says.
fn controller_env(args: &PlaygroundArgs, pods_otlp: Option<&str>) -> Vec<(String, String)> {
    let timeout = crate::config::format_duration(args.heartbeat_timeout);
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("SKIPPER_FUNCTION_NAMESPACES".into(), POOL_NAMESPACE.into());
    env.insert(
        "SKIPPER_SCALE_INTERVAL".into(),
        crate::config::format_duration(args.scale_interval),
    );
    env.insert("SKIPPER_HEARTBEAT_TIMEOUT".into(), timeout.clone());
    env.insert("SKIPPER_HPA_DOWNSCALE_STABILIZATION".into(), timeout);
    env.insert("SKIPPER_LOG_FORMAT".into(), "text".into());
    match pods_otlp {
        // The manifest exports no traces until a collector is named.
        Some(url) => {
            env.insert("SKIPPER_TELEMETRY".into(), "true".into());
            env.insert("SKIPPER_TELEMETRY_TRACE".into(), "true".into());
            env.insert("OTEL_EXPORTER_OTLP_ENDPOINT".into(), url.to_owned());
        }
        // Metrics stay on (the manifest's --telemetry); with no collector
        // named, no span is made and no export is tried.
        None => {
            env.insert("SKIPPER_TELEMETRY_TRACE".into(), "false".into());
        }
    }
    for (k, v) in &args.controller_env {
        env.insert(k.clone(), v.clone());
    }
    env.into_iter().collect()
}

async fn apply_manifests(args: &PlaygroundArgs, cluster: &PlaygroundCluster) -> Result<(), PlaygroundError> {
    let client = cluster.client.clone();
    let image = cluster.image.as_deref();
    // On kubelet nodes every object as it runs there (the image, restricted namespaces).
    let create = |mut d: Value| {
        let client = client.clone();
        async move {
            if let Some(image) = image {
                kubelet::for_image(&mut d, image);
            }
            create_object(&client, &d).await
        }
    };
    let pods_otlp = args
        .otlp_endpoint
        .as_deref()
        .map(|url| otlp_endpoint_for_pods(url, cluster.host_on_pod_network));
    let key = SigningKey::generate();
    let public_pem = key.verifying_key().to_pem();
    for d in documents("namespace.yaml", NAMESPACE_YAML)? {
        create(d).await?;
    }
    if image.is_some() {
        kubelet::enforce_restricted(&client, POOL_NAMESPACE).await?;
    }
    for d in documents("rbac.yaml", RBAC_YAML)? {
        create(d).await?;
    }
    for d in documents("network-policy.yaml", NETWORK_POLICY_YAML)? {
        create(d).await?;
    }
    // The router runs as a process of the playground (its ServiceAccount is
    // the manifest's, its token requested for it), or on kubelet nodes as
    // the manifest's pods.
    for mut d in documents("router.yaml", ROUTER_YAML)? {
        if image.is_none() && d["kind"] != "ServiceAccount" {
            continue;
        }
        let env = match &pods_otlp {
            Some(url) => vec![
                ("SKIPPER_TELEMETRY_TRACE".to_owned(), "true".to_owned()),
                ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), url.clone()),
            ],
            None => vec![("SKIPPER_TELEMETRY_TRACE".to_owned(), "false".to_owned())],
        };
        kubelet::router_deployment(&mut d, router_heartbeat(args), &env);
        create(d).await?;
    }
    create_object(
        &client,
        &json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": PASETO_SECRET, "namespace": CONTROLLER_NAMESPACE},
                "type": "Opaque",
                "stringData": {"SKIPPER_PASETO_PRIVATE_KEY": key.to_pem()}}),
    )
    .await?;
    create_object(
        &client,
        &json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": PUBLIC_KEY_CONFIG_MAP, "namespace": POOL_NAMESPACE},
                "data": {"SKIPPER_PUBLIC_KEY": public_pem}}),
    )
    .await?;
    for d in pool_rbac(POOL_NAMESPACE)? {
        create(d).await?;
    }
    for pool in &args.pools {
        create(pool_manifest(
            POOL_NAMESPACE,
            pool,
            args.pod_command.as_deref(),
            pods_otlp.as_deref(),
        )?)
        .await?;
    }
    let env = controller_env(args, pods_otlp.as_deref());
    for d in controller_manifests(args.controllers, &env)? {
        create(d).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otlp_endpoint_is_an_http_url_and_reaches_the_pool_pods() {
        assert_eq!(
            parse_otlp_endpoint("http://127.0.0.1:4318/").as_deref(),
            Ok("http://127.0.0.1:4318")
        );
        assert!(parse_otlp_endpoint("https://collector.example:4318").is_ok());
        for bad in ["127.0.0.1:4318", "ftp://host", "http://", "not a url"] {
            assert!(parse_otlp_endpoint(bad).is_err(), "{bad}");
        }
        let pool = PoolSpec {
            name: "fixture".into(),
            replicas: 1,
        };
        let d = pool_manifest("default", &pool, None, Some("http://127.0.0.1:4318")).unwrap();
        let env = &d["spec"]["template"]["spec"]["containers"][0]["env"];
        let value = |name: &str| {
            env.as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == name)
                .map(|e| e["value"].clone())
        };
        assert_eq!(
            value("OTEL_EXPORTER_OTLP_ENDPOINT"),
            Some(json!("http://127.0.0.1:4318"))
        );
        assert_eq!(value("SKIPPER_TELEMETRY"), Some(json!("true")));
        let plain = pool_manifest("default", &pool, None, None).unwrap();
        assert!(!plain.to_string().contains("OTEL_EXPORTER_OTLP_ENDPOINT"));
    }

    #[test]
    fn controllers_stabilize_over_the_heartbeat_timeout_unless_told_otherwise() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            dev: PlaygroundArgs,
        }
        let env = |argv: &[&str]| {
            let cli =
                <Cli as clap::Parser>::try_parse_from(std::iter::once("dev").chain(argv.iter().copied()))
                    .unwrap();
            controller_env(&cli.dev, None)
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let default = env(&[]);
        assert_eq!(default["SKIPPER_HEARTBEAT_TIMEOUT"], "30s");
        assert_eq!(default["SKIPPER_HPA_DOWNSCALE_STABILIZATION"], "30s");
        let short = env(&["--heartbeat-timeout", "8s"]);
        assert_eq!(short["SKIPPER_HPA_DOWNSCALE_STABILIZATION"], "8s");
        let told = env(&["--controller-env", "SKIPPER_HPA_DOWNSCALE_STABILIZATION=2m"]);
        assert_eq!(told["SKIPPER_HPA_DOWNSCALE_STABILIZATION"], "2m");
        assert_eq!(told["SKIPPER_HEARTBEAT_TIMEOUT"], "30s");
    }

    #[test]
    fn controllers_trace_only_when_a_collector_is_named() {
        let cli = <PlaygroundArgsCli as clap::Parser>::try_parse_from(["dev"]).unwrap();
        let env = |otlp| {
            controller_env(&cli.dev, otlp)
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let none = env(None);
        assert_eq!(none["SKIPPER_TELEMETRY_TRACE"], "false");
        assert!(!none.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT"));
        let named = env(Some("http://10.0.0.1:4318"));
        assert_eq!(named["SKIPPER_TELEMETRY"], "true");
        assert_eq!(named["OTEL_EXPORTER_OTLP_ENDPOINT"], "http://10.0.0.1:4318");
        assert_eq!(named["SKIPPER_TELEMETRY_TRACE"], "true");
        let told = <PlaygroundArgsCli as clap::Parser>::try_parse_from([
            "dev",
            "--controller-env",
            "SKIPPER_TELEMETRY_TRACE=true",
        ])
        .unwrap();
        let told = controller_env(&told.dev, None)
            .into_iter()
            .collect::<BTreeMap<_, _>>();
        assert_eq!(told["SKIPPER_TELEMETRY_TRACE"], "true");
    }

    #[derive(clap::Parser)]
    struct PlaygroundArgsCli {
        #[command(flatten)]
        dev: PlaygroundArgs,
    }

    #[test]
    fn control_plane_dir_is_the_flag_or_the_first_default_with_every_binary() {
        use std::os::unix::fs::PermissionsExt as _;
        let root = std::env::temp_dir().join(format!("skipper-cp-dir-{:016x}", rand::random::<u64>()));
        let fill = |dir: &Path, binaries: &[&str]| {
            std::fs::create_dir_all(dir).unwrap();
            for b in binaries {
                let path = dir.join(b);
                std::fs::write(&path, "").unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        };
        let all = skipper_devcluster::control_plane::BINARIES;
        let (default, beside, flagged, partial) = (
            root.join("target/control-plane"),
            root.join("install/control-plane"),
            root.join("mine"),
            root.join("partial"),
        );
        let exe = root.join("install/bin/skipper");
        // Nothing built: one error naming the flag, the directories and `make control-plane`.
        let err = control_plane_dir(None, &default, &exe).unwrap_err().to_string();
        assert!(err.starts_with("--control-plane real: no etcd in "), "{err}");
        assert!(
            err.contains(&default.display().to_string()) && err.contains(&beside.display().to_string()),
            "{err}"
        );
        assert!(err.contains("`make control-plane`"), "{err}");
        // Beside the executable, when the default has nothing.
        fill(&beside, &all);
        assert_eq!(control_plane_dir(None, &default, &exe).unwrap(), beside);
        // The default first.
        fill(&default, &all);
        assert_eq!(control_plane_dir(None, &default, &exe).unwrap(), default);
        // The flag wins, and must hold every binary (executable).
        fill(&flagged, &all);
        assert_eq!(
            control_plane_dir(Some(&flagged), &default, &exe).unwrap(),
            flagged
        );
        fill(&partial, &["etcd", "kube-apiserver"]);
        std::fs::write(partial.join("kube-controller-manager"), "").unwrap();
        let err = control_plane_dir(Some(&partial), &default, &exe)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--control-plane-dir: no kube-controller-manager in "),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn pods_on_a_network_of_their_own_reach_a_loopback_collector_through_the_host() {
        let gw = Some(std::net::Ipv4Addr::new(10, 213, 7, 1));
        for (url, host, want) in [
            ("http://127.0.0.1:4318", gw, "http://10.213.7.1:4318"),
            ("http://localhost:4318", gw, "http://10.213.7.1:4318"),
            ("https://[::1]:4318/base", gw, "https://10.213.7.1:4318/base"),
            ("http://127.3.2.1", gw, "http://10.213.7.1"),
            (
                "http://collector.example:4318",
                gw,
                "http://collector.example:4318",
            ),
            ("http://10.0.0.5:4318", gw, "http://10.0.0.5:4318"),
            ("http://127.0.0.1:4318", None, "http://127.0.0.1:4318"),
        ] {
            assert_eq!(otlp_endpoint_for_pods(url, host), want, "{url} with {host:?}");
        }
    }

    #[test]
    fn pool_flag_parses_and_rejects() {
        assert_eq!(
            parse_pool("fixture=3"),
            Ok(PoolSpec {
                name: "fixture".into(),
                replicas: 3
            })
        );
        assert!(parse_pool("fixture").unwrap_err().contains("NAME=REPLICAS"));
        assert!(parse_pool("Bad_Name=1").unwrap_err().contains("Deployment name"));
        assert!(parse_pool("a=x").unwrap_err().contains("replicas"));
        assert!(parse_pool("a=501").unwrap_err().contains("at most 500"));
    }

    #[test]
    fn env_flag_parses() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("x").is_err());
    }

    #[test]
    fn pool_manifest_is_renamed_and_resized() {
        let pool = PoolSpec {
            name: "echo".into(),
            replicas: 5,
        };
        let d = pool_manifest("default", &pool, None, None).unwrap();
        assert_eq!(d["metadata"]["name"], "echo");
        assert_eq!(d["metadata"]["namespace"], "default");
        assert_eq!(d["spec"]["replicas"], 5);
        assert_eq!(d["spec"]["selector"]["matchLabels"]["skipper/deployment"], "echo");
        assert_eq!(
            d["spec"]["selector"]["matchExpressions"][0],
            json!({"key": "skipper/tenant", "operator": "DoesNotExist"})
        );
        assert_eq!(
            d["spec"]["template"]["metadata"]["labels"]["skipper/deployment"],
            "echo"
        );
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["command"], json!(["skipper", "fixture"]));
        let mut template = manifest_documents(EXAMPLE_POOL_YAML)
            .unwrap()
            .into_iter()
            .find(|d| d["kind"] == "Deployment")
            .unwrap()["spec"]["template"]
            .clone();
        template["metadata"]["labels"]["skipper/deployment"] = json!("echo");
        assert_eq!(
            d["spec"]["template"], template,
            "the pod template is the manifest's, relabelled only"
        );
    }

    #[test]
    fn command_replaces_the_fixture() {
        let pool = PoolSpec {
            name: "mine".into(),
            replicas: 1,
        };
        let d = pool_manifest("default", &pool, Some("exec my-server"), None).unwrap();
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["command"], json!(["sh", "-c", "exec my-server"]));
        assert!(c.get("args").is_none());
        assert!(
            c["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == "POD_IP" && e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP")
        );
        assert_eq!(c["readinessProbe"]["tcpSocket"]["port"], "http");
    }

    #[test]
    fn controller_manifest_gets_replicas_and_env() {
        let docs =
            controller_manifests(3, &[("SKIPPER_FUNCTION_NAMESPACES".into(), "default".into())]).unwrap();
        let d = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
        assert_eq!(d["spec"]["replicas"], 3);
        let env = d["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap();
        let ns: Vec<_> = env
            .iter()
            .filter(|e| e["name"] == "SKIPPER_FUNCTION_NAMESPACES")
            .collect();
        assert_eq!(ns.len(), 1);
        assert_eq!(ns[0]["value"], "default");
    }

    #[test]
    fn example_function_is_valid() {
        let f = Function::from_json(&example_function("fixture", "t1")).unwrap();
        f.validate().unwrap();
        assert_eq!(f.tenant, "t1");
        assert_eq!(f.namespace, POOL_NAMESPACE);
    }
}
