//! Flags of `skipper controller` ([`Args`]) and the validated [`Config`] built
//! from them. Every check names the flag it concerns.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::auth::{Policy, ServiceAccount};
use super::supervisor::converge::ScaleConfig;
use crate::config::{format_duration, parse_duration, parse_positive_duration, split_list};
use crate::token::{SigningKey, Version};

/// Flags of `skipper controller`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Bind host of the gRPC server (and of the web UI unless --web-host says otherwise)
    #[arg(long, env = "SKIPPER_HOST", default_value = "0.0.0.0")]
    pub host: String,

    /// gRPC port; also the port peer controllers are dialled on
    #[arg(long, env = "SKIPPER_PORT", default_value_t = 50051)]
    pub port: u16,

    /// Bound on the graceful stop of the gRPC server
    #[arg(long, env = "SKIPPER_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_positive_duration)]
    pub shutdown_timeout: Duration,

    /// Namespace whose Ready controller pods form the hash ring
    #[arg(long, env = "SKIPPER_NAMESPACE", required = true)]
    pub namespace: String,

    /// This controller's pod IP (its ring identity)
    #[arg(long, env = "SKIPPER_POD_IP", required = true)]
    pub pod_ip: String,

    /// Client-side QPS limit for the Kubernetes client
    #[arg(long, env = "SKIPPER_KUBECONFIG_QPS", default_value_t = 100.0)]
    pub kubeconfig_qps: f32,

    /// Client-side burst for the Kubernetes client
    #[arg(long, env = "SKIPPER_KUBECONFIG_BURST", default_value_t = 200)]
    pub kubeconfig_burst: u32,

    /// Ed25519 private key (PKCS#8 PEM) that signs assignment tokens
    #[arg(
        long,
        env = "SKIPPER_PASETO_PRIVATE_KEY",
        required = true,
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub paseto_private_key: String,

    /// PASETO version of assignment tokens: v2 (v2.public, what existing pods accept) or v4
    #[arg(long, env = "SKIPPER_PASETO_VERSION", value_enum, default_value = "v2")]
    pub paseto_version: Version,

    /// No activity for this long scales a function to zero
    #[arg(long, env = "SKIPPER_HEARTBEAT_TIMEOUT", default_value = "1m30s", value_parser = parse_positive_duration)]
    pub heartbeat_timeout: Duration,

    /// Period of converge, pod-metrics refresh and supervisor discovery
    #[arg(long, env = "SKIPPER_SCALE_INTERVAL", default_value = "15s", value_parser = parse_positive_duration)]
    pub scale_interval: Duration,

    /// Usage-ratio tolerance band of the autoscaler
    #[arg(long, env = "SKIPPER_HPA_TOLERANCE", default_value_t = 0.1)]
    pub hpa_tolerance: f64,

    /// CPU samples of instances ready for at most this long are ignored
    #[arg(long, env = "SKIPPER_HPA_INITIAL_READINESS_DELAY", default_value = "30s", value_parser = parse_positive_duration)]
    pub hpa_initial_readiness_delay: Duration,

    /// Window over which the highest recommendation is kept before scaling down
    #[arg(long, env = "SKIPPER_HPA_DOWNSCALE_STABILIZATION", default_value = "1m30s", value_parser = parse_positive_duration)]
    pub hpa_downscale_stabilization: Duration,

    /// How long to wait for a non-empty hash ring before exiting with an error
    #[arg(long, env = "SKIPPER_HASH_RING_WAIT_TIME", default_value = "10s", value_parser = parse_positive_duration)]
    pub hash_ring_wait_time: Duration,

    /// Namespaces whose pods can be assigned, comma-separated
    #[arg(long, env = "SKIPPER_FUNCTION_NAMESPACES", required = true)]
    pub function_namespaces: String,

    /// HTTP path POSTed on a pod to assign it
    #[arg(long, env = "SKIPPER_FUNCTION_ASSIGN_PATH", default_value = crate::domain::DEFAULT_ASSIGN_PATH)]
    pub function_assign_path: String,

    /// Timeout of the assign request; twice this marks an instance as stuck
    #[arg(long, env = "SKIPPER_FUNCTION_ASSIGN_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    pub function_assign_timeout: Duration,

    /// Longest a scale-down waits for routers to stop using an instance before deleting its pod (0s = no wait)
    #[arg(long, env = "SKIPPER_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Controller-wide limit on concurrent stale-instance replacements
    #[arg(long, env = "SKIPPER_MAX_CONCURRENT_STALE_REPLACEMENTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_stale_replacements: u32,

    /// Most entries one Heartbeat call may carry (a larger batch is refused whole)
    #[arg(long, env = "SKIPPER_MAX_HEARTBEAT_ENTRIES", default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_heartbeat_entries: u32,

    /// Most functions one router may keep active on a controller; heartbeats for more are refused
    #[arg(long, env = "SKIPPER_MAX_FUNCTIONS_PER_ROUTER", default_value_t = 50_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_functions_per_router: u32,

    /// Most routers that may keep functions active on a controller at once
    #[arg(long, env = "SKIPPER_MAX_HEARTBEAT_ROUTERS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_heartbeat_routers: u32,

    /// Accept calls without a token (Go routers during a migration); a token that is sent is still verified
    #[arg(long, env = "SKIPPER_ALLOW_UNAUTHENTICATED", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub allow_unauthenticated: bool,

    /// Audience of the ServiceAccount tokens callers present (and this controller presents to its peers)
    #[arg(long, env = "SKIPPER_TOKEN_AUDIENCE", default_value = crate::credentials::AUDIENCE)]
    pub token_audience: String,

    /// ServiceAccounts that may call as routers: NAME (in --namespace) or NAMESPACE/NAME, comma-separated
    #[arg(
        long,
        env = "SKIPPER_ROUTER_SERVICE_ACCOUNTS",
        default_value = "skipper-router"
    )]
    pub router_service_accounts: String,

    /// ServiceAccount of the peer controllers: NAME (in --namespace) or NAMESPACE/NAME
    #[arg(
        long,
        env = "SKIPPER_CONTROLLER_SERVICE_ACCOUNT",
        default_value = "skipper-controller"
    )]
    pub controller_service_account: String,

    /// Token this controller presents to its peers (a projected ServiceAccount token, re-read as it is refreshed); empty: none
    #[arg(long, env = "SKIPPER_TOKEN_FILE", default_value = crate::credentials::DEFAULT_TOKEN_FILE)]
    pub token_file: String,

    /// Leave out a function namespace that answers Forbidden at start-up (without it, the namespace is retried until its Role allows the watches)
    #[arg(long, env = "SKIPPER_SKIP_FORBIDDEN_NAMESPACES", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub skip_forbidden_namespaces: bool,

    /// Port of the web UI
    #[arg(long, env = "SKIPPER_WEB_PORT", default_value_t = 8080)]
    pub web_port: u16,

    /// Bind host of the web UI (empty: --host); 0.0.0.0 in a pod lets `kubectl port-forward`, which dials localhost in the pod, reach it
    #[arg(long, env = "SKIPPER_WEB_HOST", default_value = "")]
    pub web_host: String,

    /// Read the web UI's templates from DIR/templates/ and static files from DIR/static/ on every request (working on them)
    #[arg(long, env = "SKIPPER_WEB_TEMPLATE_DIR", value_name = "DIR")]
    pub web_template_dir: Option<PathBuf>,

    /// Put only --pod-ip in the ring and skip controller-pod discovery (local development)
    #[arg(long, env = "SKIPPER_SINGLE_CONTROLLER_MODE", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub single_controller_mode: bool,

    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// A flag value that is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--paseto-private-key: {0}")]
    PrivateKey(#[source] crate::token::KeyError),
    #[error("--function-namespaces: at least one namespace is required")]
    NoFunctionNamespaces,
    #[error("--function-namespaces: {0:?} is not a valid namespace name")]
    BadFunctionNamespace(String),
    #[error("--namespace: must not be empty")]
    EmptyNamespace,
    #[error("--pod-ip: {0:?} is not an IP address")]
    BadPodIp(String),
    #[error("--hpa-tolerance: {0} must be a finite number >= 0")]
    BadTolerance(f64),
    #[error("--kubeconfig-qps: {0} must be greater than zero")]
    BadQps(f32),
    #[error("--kubeconfig-burst: must be at least 1")]
    BadBurst,
    #[error("--function-assign-path: {0:?} must start with '/'")]
    BadAssignPath(String),
    #[error("--host/--port: {0}")]
    BadListenAddr(String),
    #[error("--token-audience: must not be empty")]
    EmptyAudience,
    #[error("--{flag}: {value:?} is not NAME or NAMESPACE/NAME of a ServiceAccount")]
    BadServiceAccount { flag: &'static str, value: String },
    #[error("--router-service-accounts: at least one ServiceAccount is required")]
    NoRouterServiceAccounts,
    #[error("--web-host/--web-port: {0}")]
    BadWebAddr(String),
    #[error("--web-template-dir {0}: not a directory with templates/ in it")]
    BadTemplateDir(PathBuf),
}

/// `NAME` (in `namespace`) or `NAMESPACE/NAME`.
fn service_account(flag: &'static str, value: &str, namespace: &str) -> Result<ServiceAccount, ConfigError> {
    let bad = || ConfigError::BadServiceAccount {
        flag,
        value: value.to_owned(),
    };
    let (ns, name) = match value.split_once('/') {
        Some((ns, name)) => (ns, name),
        None => (namespace, value),
    };
    if !is_dns1123_label(ns) || !is_dns1123_subdomain(name) {
        return Err(bad());
    }
    Ok(ServiceAccount {
        namespace: ns.to_owned(),
        name: name.to_owned(),
    })
}

/// Bounds on what callers can make a controller hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Entries of one Heartbeat call.
    pub heartbeat_entries: usize,
    /// Functions one router keeps active.
    pub functions_per_router: usize,
    /// Routers keeping functions active at once.
    pub heartbeat_routers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            heartbeat_entries: 20_000,
            functions_per_router: 50_000,
            heartbeat_routers: 1024,
        }
    }
}

/// The validated controller configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub shutdown_timeout: Duration,
    pub namespace: String,
    pub pod_ip: String,
    pub kube_qps: f32,
    pub kube_burst: u32,
    pub signing_key: SigningKey,
    pub paseto_version: Version,
    pub scale: ScaleConfig,
    pub scale_interval: Duration,
    pub hash_ring_wait_time: Duration,
    pub function_namespaces: Vec<String>,
    pub assign_path: String,
    pub max_concurrent_stale_replacements: usize,
    pub limits: Limits,
    /// Who may call, and how their tokens are checked.
    pub auth: Policy,
    /// The token presented to peers; `None`: calls carry no token.
    pub token_file: Option<PathBuf>,
    pub skip_forbidden_namespaces: bool,
    pub single_controller_mode: bool,
    /// Where the web UI listens (`None`: not served; tests and embedders).
    pub web_addr: Option<SocketAddr>,
    /// `--web-template-dir`.
    pub web_template_dir: Option<PathBuf>,
    /// Bound on waiting for routers to report a draining instance idle.
    pub drain_timeout: Duration,
    pub telemetry: crate::telemetry::Args,
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(a: Args) -> Result<Self, Self::Error> {
        let signing_key = SigningKey::from_pem(&a.paseto_private_key).map_err(ConfigError::PrivateKey)?;
        let function_namespaces = split_list(&a.function_namespaces);
        if function_namespaces.is_empty() {
            return Err(ConfigError::NoFunctionNamespaces);
        }
        if let Some(bad) = function_namespaces.iter().find(|n| !is_dns1123_label(n)) {
            return Err(ConfigError::BadFunctionNamespace(bad.clone()));
        }
        if a.namespace.trim().is_empty() {
            return Err(ConfigError::EmptyNamespace);
        }
        if a.pod_ip.parse::<std::net::IpAddr>().is_err() {
            return Err(ConfigError::BadPodIp(a.pod_ip));
        }
        if !a.hpa_tolerance.is_finite() || a.hpa_tolerance < 0.0 {
            return Err(ConfigError::BadTolerance(a.hpa_tolerance));
        }
        if !(a.kubeconfig_qps.is_finite() && a.kubeconfig_qps > 0.0) {
            return Err(ConfigError::BadQps(a.kubeconfig_qps));
        }
        if a.kubeconfig_burst == 0 {
            return Err(ConfigError::BadBurst);
        }
        if !a.function_assign_path.starts_with('/') {
            return Err(ConfigError::BadAssignPath(a.function_assign_path));
        }
        if a.token_audience.trim().is_empty() {
            return Err(ConfigError::EmptyAudience);
        }
        let routers = split_list(&a.router_service_accounts)
            .iter()
            .map(|v| service_account("router-service-accounts", v, &a.namespace))
            .collect::<Result<Vec<_>, _>>()?;
        if routers.is_empty() {
            return Err(ConfigError::NoRouterServiceAccounts);
        }
        let controller = service_account(
            "controller-service-account",
            a.controller_service_account.trim(),
            &a.namespace,
        )?;
        let web_host = match a.web_host.trim() {
            "" => a.host.as_str(),
            h => h,
        };
        let web_addr = host_port(web_host, a.web_port).map_err(ConfigError::BadWebAddr)?;
        let web_template_dir = a.web_template_dir.filter(|d| !d.as_os_str().is_empty());
        if let Some(dir) = &web_template_dir
            && !dir.join("templates").is_dir()
        {
            return Err(ConfigError::BadTemplateDir(dir.clone()));
        }
        let cfg = Self {
            host: a.host,
            port: a.port,
            shutdown_timeout: a.shutdown_timeout,
            namespace: a.namespace,
            pod_ip: a.pod_ip,
            kube_qps: a.kubeconfig_qps,
            kube_burst: a.kubeconfig_burst,
            signing_key,
            paseto_version: a.paseto_version,
            scale: ScaleConfig {
                heartbeat_timeout: a.heartbeat_timeout,
                tolerance: a.hpa_tolerance,
                initial_readiness_delay: a.hpa_initial_readiness_delay,
                downscale_stabilization: a.hpa_downscale_stabilization,
                assign_timeout: a.function_assign_timeout,
            },
            scale_interval: a.scale_interval,
            hash_ring_wait_time: a.hash_ring_wait_time,
            function_namespaces,
            assign_path: a.function_assign_path,
            max_concurrent_stale_replacements: a.max_concurrent_stale_replacements as usize,
            auth: Policy {
                allow_unauthenticated: a.allow_unauthenticated,
                audience: a.token_audience.trim().to_owned(),
                routers,
                controllers: vec![controller],
            },
            token_file: Some(a.token_file.trim())
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            limits: Limits {
                heartbeat_entries: a.max_heartbeat_entries as usize,
                functions_per_router: a.max_functions_per_router as usize,
                heartbeat_routers: a.max_heartbeat_routers as usize,
            },
            skip_forbidden_namespaces: a.skip_forbidden_namespaces,
            single_controller_mode: a.single_controller_mode,
            web_addr: Some(web_addr),
            web_template_dir,
            drain_timeout: a.drain_timeout,
            telemetry: a.telemetry,
        };
        cfg.listen_addr()?;
        Ok(cfg)
    }
}

/// DNS-1123 labels joined by dots, at most 253 characters.
fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// `host:port` as a socket address; the message quotes what failed.
fn host_port(host: &str, port: u16) -> Result<SocketAddr, String> {
    let addr = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    addr.parse().map_err(|e| format!("{addr:?}: {e}"))
}

/// Lowercase alphanumerics and `-`, at most 63, alphanumeric at both ends.
fn is_dns1123_label(s: &str) -> bool {
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.iter().all(|&b| ok(b) || b == b'-')
        && ok(bytes[0])
        && ok(bytes[bytes.len() - 1])
}

impl Config {
    /// A configuration with defaults for everything but the required values
    /// (used by tests and the dev playground).
    #[must_use]
    pub fn new(namespace: &str, pod_ip: &str, function_namespaces: &[&str], signing_key: SigningKey) -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 50051,
            shutdown_timeout: Duration::from_secs(5),
            namespace: namespace.into(),
            pod_ip: pod_ip.into(),
            kube_qps: 100.0,
            kube_burst: 200,
            signing_key,
            paseto_version: Version::V2,
            scale: ScaleConfig::default(),
            scale_interval: Duration::from_secs(15),
            hash_ring_wait_time: Duration::from_secs(10),
            function_namespaces: function_namespaces.iter().map(|s| (*s).to_owned()).collect(),
            assign_path: crate::domain::DEFAULT_ASSIGN_PATH.into(),
            max_concurrent_stale_replacements: 10,
            limits: Limits::default(),
            auth: Policy {
                allow_unauthenticated: false,
                audience: crate::credentials::AUDIENCE.into(),
                routers: vec![ServiceAccount {
                    namespace: namespace.into(),
                    name: "skipper-router".into(),
                }],
                controllers: vec![ServiceAccount {
                    namespace: namespace.into(),
                    name: "skipper-controller".into(),
                }],
            },
            token_file: None,
            skip_forbidden_namespaces: false,
            single_controller_mode: false,
            web_addr: None,
            web_template_dir: None,
            drain_timeout: Duration::from_secs(10),
            telemetry: crate::telemetry::Args::default(),
        }
    }

    /// The gRPC listen address from `--host` and `--port`.
    ///
    /// # Errors
    /// When they do not form a socket address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        host_port(&self.host, self.port).map_err(ConfigError::BadListenAddr)
    }

    /// `(name, value, description)` for every flag, as `GetClusterState`
    /// reports them. The private key is masked.
    #[must_use]
    pub fn describe(&self) -> Vec<(&'static str, String, &'static str)> {
        let d = format_duration;
        vec![
            ("host", self.host.clone(), "Bind host of the gRPC server"),
            (
                "web-host",
                self.web_addr.map_or_else(String::new, |a| a.ip().to_string()),
                "Bind host of the web UI",
            ),
            (
                "port",
                self.port.to_string(),
                "gRPC port; also the port peer controllers are dialled on",
            ),
            (
                "shutdown-timeout",
                d(self.shutdown_timeout),
                "Bound on the graceful stop of the gRPC server",
            ),
            (
                "namespace",
                self.namespace.clone(),
                "Namespace whose Ready controller pods form the hash ring",
            ),
            (
                "pod-ip",
                self.pod_ip.clone(),
                "This controller's pod IP (its ring identity)",
            ),
            (
                "kubeconfig-qps",
                self.kube_qps.to_string(),
                "Client-side QPS limit for the Kubernetes client",
            ),
            (
                "kubeconfig-burst",
                self.kube_burst.to_string(),
                "Client-side burst for the Kubernetes client",
            ),
            (
                "paseto-private-key",
                "****".into(),
                "Ed25519 private key (PKCS#8 PEM) that signs assignment tokens",
            ),
            (
                "paseto-version",
                format!("{:?}", self.paseto_version).to_lowercase(),
                "PASETO version of assignment tokens",
            ),
            (
                "heartbeat-timeout",
                d(self.scale.heartbeat_timeout),
                "No activity for this long scales a function to zero",
            ),
            (
                "scale-interval",
                d(self.scale_interval),
                "Period of converge, pod-metrics refresh and supervisor discovery",
            ),
            (
                "hpa-tolerance",
                self.scale.tolerance.to_string(),
                "Usage-ratio tolerance band of the autoscaler",
            ),
            (
                "hpa-initial-readiness-delay",
                d(self.scale.initial_readiness_delay),
                "CPU samples of instances ready for at most this long are ignored",
            ),
            (
                "hpa-downscale-stabilization",
                d(self.scale.downscale_stabilization),
                "Window over which the highest recommendation is kept before scaling down",
            ),
            (
                "hash-ring-wait-time",
                d(self.hash_ring_wait_time),
                "How long to wait for a non-empty hash ring",
            ),
            (
                "function-namespaces",
                self.function_namespaces.join(", "),
                "Namespaces whose pods can be assigned",
            ),
            (
                "function-assign-path",
                self.assign_path.clone(),
                "HTTP path POSTed on a pod to assign it",
            ),
            (
                "function-assign-timeout",
                d(self.scale.assign_timeout),
                "Timeout of the assign request",
            ),
            (
                "drain-timeout",
                d(self.drain_timeout),
                "Longest a scale-down waits for routers to stop using an instance",
            ),
            (
                "max-concurrent-stale-replacements",
                self.max_concurrent_stale_replacements.to_string(),
                "Controller-wide limit on concurrent stale-instance replacements",
            ),
            (
                "max-heartbeat-entries",
                self.limits.heartbeat_entries.to_string(),
                "Most entries one Heartbeat call may carry",
            ),
            (
                "max-functions-per-router",
                self.limits.functions_per_router.to_string(),
                "Most functions one router may keep active on this controller",
            ),
            (
                "max-heartbeat-routers",
                self.limits.heartbeat_routers.to_string(),
                "Most routers that may keep functions active at once",
            ),
            (
                "allow-unauthenticated",
                self.auth.allow_unauthenticated.to_string(),
                "Accept calls without a token (a migration with Go routers)",
            ),
            (
                "token-audience",
                self.auth.audience.clone(),
                "Audience of the ServiceAccount tokens callers present",
            ),
            (
                "router-service-accounts",
                self.auth
                    .routers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                "ServiceAccounts that may call as routers",
            ),
            (
                "controller-service-account",
                self.auth
                    .controllers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                "ServiceAccount of the peer controllers",
            ),
            (
                "token-file",
                self.token_file
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                "Token this controller presents to its peers",
            ),
            (
                "skip-forbidden-namespaces",
                self.skip_forbidden_namespaces.to_string(),
                "Leave out a function namespace that answers Forbidden at start-up",
            ),
            (
                "web-port",
                self.web_addr.map_or_else(String::new, |a| a.port().to_string()),
                "Port of the web UI",
            ),
            (
                "web-template-dir",
                self.web_template_dir
                    .as_ref()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                "Read the web UI's templates from this directory on every request",
            ),
            (
                "single-controller-mode",
                self.single_controller_mode.to_string(),
                "Put only --pod-ip in the ring",
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn pem() -> String {
        SigningKey::generate().to_pem()
    }

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let key = pem();
        let mut argv = vec![
            "x",
            "--namespace",
            "skipper",
            "--pod-ip",
            "10.0.0.1",
            "--function-namespaces",
            "fns, more",
            "--paseto-private-key",
            &key,
        ];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).map(|c| c.args)
    }

    #[test]
    fn the_web_ui_binds_web_host_else_host() {
        let web = |extra: &[&str]| Config::try_from(parse(extra).unwrap()).map(|c| c.web_addr);
        let addr = |s: &str| Some(s.parse().unwrap());
        assert_eq!(web(&["--host", "10.0.0.7"]).unwrap(), addr("10.0.0.7:8080"));
        assert_eq!(
            web(&["--host", "10.0.0.7", "--web-host", "0.0.0.0"]).unwrap(),
            addr("0.0.0.0:8080")
        );
        assert_eq!(
            web(&["--web-host", "127.0.0.1", "--web-port", "9"]).unwrap(),
            addr("127.0.0.1:9")
        );
        let bad = web(&["--web-host", "not an address"]).unwrap_err().to_string();
        assert!(bad.starts_with("--web-host/--web-port: "), "{bad}");
    }

    #[test]
    fn defaults_match_the_spec() {
        let cfg = Config::try_from(parse(&[]).unwrap()).unwrap();
        assert_eq!(cfg.port, 50051);
        assert_eq!(cfg.scale.heartbeat_timeout, Duration::from_secs(90));
        assert_eq!(cfg.scale_interval, Duration::from_secs(15));
        assert_eq!(cfg.scale.initial_readiness_delay, Duration::from_secs(30));
        assert_eq!(cfg.scale.downscale_stabilization, Duration::from_secs(90));
        assert_eq!(cfg.hash_ring_wait_time, Duration::from_secs(10));
        assert_eq!(cfg.function_namespaces, vec!["fns", "more"]);
        assert_eq!(cfg.assign_path, "/__skipper/assign");
        assert_eq!(cfg.max_concurrent_stale_replacements, 10);
        assert_eq!(cfg.drain_timeout, Duration::from_secs(10));
        assert_eq!(cfg.paseto_version, Version::V2);
        assert_eq!(cfg.web_addr, Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(cfg.web_template_dir, None);
        assert!((cfg.scale.tolerance - 0.1).abs() < f64::EPSILON);
        assert_eq!(cfg.scale.protection_period(), Duration::from_secs(90));
        assert_eq!(cfg.limits, Limits::default());
        assert!(
            !cfg.auth.allow_unauthenticated,
            "callers authenticate unless told otherwise"
        );
        assert_eq!(cfg.auth.audience, "skipper-controller");
        assert_eq!(cfg.auth.routers[0].to_string(), "skipper/skipper-router");
        assert_eq!(cfg.auth.controllers[0].to_string(), "skipper/skipper-controller");
        assert_eq!(
            cfg.token_file.as_deref(),
            Some(std::path::Path::new("/var/run/secrets/skipper/token"))
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (argv, flag) in [
            (vec!["--scale-interval", "0s"], "--scale-interval"),
            (vec!["--heartbeat-timeout", "soon"], "--heartbeat-timeout"),
            (
                vec!["--max-concurrent-stale-replacements", "0"],
                "--max-concurrent-stale-replacements",
            ),
            (vec!["--paseto-version", "v3"], "--paseto-version"),
            (vec!["--drain-timeout", "later"], "--drain-timeout"),
            (vec!["--max-heartbeat-entries", "0"], "--max-heartbeat-entries"),
            (
                vec!["--max-functions-per-router", "0"],
                "--max-functions-per-router",
            ),
            (vec!["--max-heartbeat-routers", "none"], "--max-heartbeat-routers"),
        ] {
            let err = parse(&argv).unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
        type Edit = fn(&mut Args);
        let cases: [(Edit, &str); 10] = [
            (|a| a.token_audience = " ".into(), "--token-audience"),
            (
                |a| a.router_service_accounts = "Bad_Name".into(),
                "--router-service-accounts: \"Bad_Name\"",
            ),
            (
                |a| a.router_service_accounts = ",".into(),
                "--router-service-accounts",
            ),
            (
                |a| a.controller_service_account = "a/b/c".into(),
                "--controller-service-account",
            ),
            (|a| a.hpa_tolerance = -1.0, "--hpa-tolerance"),
            (|a| a.pod_ip = "not-an-ip".into(), "--pod-ip"),
            (|a| a.function_namespaces = " , ".into(), "--function-namespaces"),
            (
                |a| a.function_namespaces = "Bad_NS".into(),
                "--function-namespaces",
            ),
            (
                |a| a.paseto_private_key = "nonsense".into(),
                "--paseto-private-key: invalid PEM block",
            ),
            (
                |a| a.function_assign_path = "assign".into(),
                "--function-assign-path",
            ),
        ];
        for (edit, flag) in cases {
            let mut args = parse(&[]).unwrap();
            edit(&mut args);
            let err = Config::try_from(args).unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
    }

    #[test]
    fn required_flags_are_required() {
        let err = Cli::try_parse_from(["x", "--pod-ip", "1.2.3.4"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--namespace"), "{err}");
    }

    #[test]
    fn describe_masks_the_key() {
        let cfg = Config::try_from(parse(&[]).unwrap()).unwrap();
        let d = cfg.describe();
        let key = d.iter().find(|(n, _, _)| *n == "paseto-private-key").unwrap();
        assert_eq!(key.1, "****");
        let hb = d.iter().find(|(n, _, _)| *n == "heartbeat-timeout").unwrap();
        assert_eq!(hb.1, "1m30s");
    }
}
