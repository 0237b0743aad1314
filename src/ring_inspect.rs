//! `skipper ring-inspect`: the operator's view of the consistent hash ring.
//!
//! Answers: which controller owns a function (or a raw hash), how evenly the
//! ring spreads the key space, and what moves when a member joins or leaves.
//!
//! The members come from `--members`, from a live controller
//! (`--controller HOST:PORT`, its `GetClusterState` ring), or from the
//! cluster (`--namespace`, optionally `--kubeconfig`: the Ready controller
//! pods, exactly as controllers build their ring).

use std::fmt::Write as _;
use std::net::IpAddr;
use std::process::ExitCode;

use serde_json::{Value, json};

use crate::domain::{Function, FunctionId};
use crate::ring::HashRing;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// Flags of `skipper ring-inspect`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Ring members (controller pod IPs), comma-separated, in the order they joined
    #[arg(long, env = "SKIPPER_MEMBERS", value_delimiter = ',', conflicts_with_all = ["controller", "namespace"])]
    pub members: Vec<String>,

    /// Take the members from this controller's ring (gRPC GetClusterState)
    #[arg(
        long,
        env = "SKIPPER_CONTROLLER",
        value_name = "HOST:PORT",
        conflicts_with = "namespace"
    )]
    pub controller: Option<String>,

    /// With --controller: a ServiceAccount token (audience skipper-controller) to present, e.g. from `kubectl create token`
    #[arg(
        long,
        env = "SKIPPER_TOKEN_FILE",
        value_name = "PATH",
        requires = "controller"
    )]
    pub token_file: Option<std::path::PathBuf>,

    /// Take the members from the Ready controller pods of this namespace
    #[arg(long, env = "SKIPPER_NAMESPACE", value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    /// Kubeconfig used with --namespace (default: in-cluster or ~/.kube/config)
    #[arg(long, env = "SKIPPER_KUBECONFIG", value_name = "PATH", requires = "namespace")]
    pub kubeconfig: Option<std::path::PathBuf>,

    /// Function header JSON to look up (repeatable)
    #[arg(long = "function", value_name = "JSON")]
    pub functions: Vec<String>,

    /// Raw 64-bit function hash to look up (repeatable)
    #[arg(long = "hash", value_name = "U64")]
    pub hashes: Vec<u64>,

    /// Show each member's virtual nodes and share of the key space
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub distribution: bool,

    /// Show what moves when this member joins
    #[arg(long, value_name = "IP", conflicts_with = "remove")]
    pub add: Option<String>,

    /// Show what moves when this member leaves
    #[arg(long, value_name = "IP")]
    pub remove: Option<String>,

    /// Output format
    #[arg(long, env = "SKIPPER_OUTPUT", value_enum, default_value = "table")]
    pub output: Output,
}

/// Bad input, reported as one line and exit status 2.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no ring members: pass --members IP[,IP...], --controller HOST:PORT or --namespace NAMESPACE")]
    NoMembers,
    #[error("--controller {addr}: {reason}")]
    Controller { addr: String, reason: String },
    #[error("--namespace {namespace}: {reason}")]
    Cluster { namespace: String, reason: String },
    #[error("invalid member {0:?}: not an IP address")]
    BadIp(String),
    #[error("invalid --function {json:?}: failed to unmarshal function: {reason}")]
    BadJson { json: String, reason: String },
    #[error("invalid --function {json:?}: {reason}")]
    InvalidFunction { json: String, reason: String },
    #[error("--remove {0}: not a ring member")]
    NotAMember(String),
}

/// What is being looked up.
#[derive(Debug, Clone)]
enum Subject {
    Function(Function),
    Hash(FunctionId),
}

impl Subject {
    fn id(&self) -> FunctionId {
        match self {
            Self::Function(f) => f.id(),
            Self::Hash(id) => *id,
        }
    }

    fn to_json(&self, owner: Option<&str>) -> Value {
        let id = self.id();
        let mut v = match self {
            Self::Function(f) => json!({
                "namespace": f.namespace,
                "deployment": f.deployment,
                "tenant": f.tenant,
                "oneshot": f.is_oneshot(),
            }),
            Self::Hash(_) => json!({}),
        };
        v["hash"] = json!(id.0.to_string());
        v["key"] = json!(format!("{:#010x}", id.fold32()));
        v["owner"] = json!(owner);
        v
    }

    fn label(&self) -> String {
        match self {
            Self::Function(f) => format!(
                "{}/{}/{}{}",
                f.namespace,
                f.deployment,
                f.tenant,
                if f.is_oneshot() { " (oneshot)" } else { "" }
            ),
            Self::Hash(id) => format!("hash {id}"),
        }
    }
}

/// The computed report, rendered as a table or JSON.
#[derive(Debug)]
pub struct Report {
    ring: HashRing,
    subjects: Vec<Subject>,
    distribution: bool,
    change: Option<(String, HashRing)>,
}

fn check_ip(ip: &str) -> Result<String, Error> {
    let ip = ip.trim();
    ip.parse::<IpAddr>().map_err(|_| Error::BadIp(ip.to_owned()))?;
    Ok(ip.to_owned())
}

impl Report {
    /// Validates the flags and computes the report.
    ///
    /// # Errors
    /// [`Error`] naming the first bad input.
    pub fn build(args: &Args) -> Result<Self, Error> {
        let members = args
            .members
            .iter()
            .filter(|m| !m.trim().is_empty())
            .map(|m| check_ip(m))
            .collect::<Result<Vec<_>, _>>()?;
        if members.is_empty() {
            return Err(Error::NoMembers);
        }
        let ring = HashRing::new(&members);
        let mut subjects = Vec::new();
        for raw in &args.functions {
            let f = Function::from_json(raw).map_err(|e| Error::BadJson {
                json: raw.clone(),
                reason: e.to_string(),
            })?;
            // A lookup needs the function's identity, not its scale.
            f.validate_identity().map_err(|e| Error::InvalidFunction {
                json: raw.clone(),
                reason: e.to_string(),
            })?;
            subjects.push(Subject::Function(f));
        }
        subjects.extend(args.hashes.iter().map(|&h| Subject::Hash(FunctionId(h))));
        let change = match (&args.add, &args.remove) {
            (Some(ip), _) => {
                let ip = check_ip(ip)?;
                let next = ring.with_member(&ip);
                Some((format!("add {ip}"), next))
            }
            (None, Some(ip)) => {
                let ip = check_ip(ip)?;
                if !ring.contains(&ip) {
                    return Err(Error::NotAMember(ip));
                }
                let next = ring.without_member(&ip);
                Some((format!("remove {ip}"), next))
            }
            (None, None) => None,
        };
        let distribution = args.distribution || (subjects.is_empty() && change.is_none());
        Ok(Self {
            ring,
            subjects,
            distribution,
            change,
        })
    }

    #[allow(clippy::type_complexity)]
    fn moved(&self) -> Option<(f64, Vec<(&Subject, Option<&str>, Option<&str>)>)> {
        let (_, next) = self.change.as_ref()?;
        let share = self.ring.moved_share(next);
        let functions = self
            .subjects
            .iter()
            .map(|s| (s, self.ring.owner(s.id()), next.owner(s.id())))
            .filter(|(_, before, after)| before != after)
            .collect();
        Some((share, functions))
    }

    /// The report as one JSON object (`hash` is a decimal string: u64 is not
    /// safe as a JSON number).
    #[must_use]
    pub fn to_json(&self) -> Value {
        let members: Vec<Value> = self
            .ring
            .distribution()
            .into_iter()
            .map(|(ip, vnodes, share)| json!({"ip": &*ip, "vnodes": vnodes, "share": round4(share)}))
            .collect();
        let functions: Vec<Value> = self
            .subjects
            .iter()
            .map(|s| s.to_json(self.ring.owner(s.id())))
            .collect();
        let mut out = json!({"members": members, "functions": functions});
        if let Some((share, moved)) = self.moved() {
            let moved: Vec<Value> = moved
                .into_iter()
                .map(|(s, before, after)| {
                    let mut v = s.to_json(before);
                    v["new_owner"] = json!(after);
                    v
                })
                .collect();
            out["moved"] = json!({"share": round4(share), "functions": moved});
        }
        out
    }

    /// The report as a human-friendly table.
    #[must_use]
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let dist = self.ring.distribution();
        if self.distribution {
            let _ = writeln!(out, "MEMBER{:pad$}  VNODES  SHARE", "", pad = width(&dist) - 6);
            for (ip, vnodes, share) in &dist {
                let _ = writeln!(
                    out,
                    "{ip:w$}  {vnodes:>6}  {:>6.2}%",
                    share * 100.0,
                    w = width(&dist)
                );
            }
            let shares: Vec<f64> = dist.iter().map(|d| d.2).collect();
            let max = shares.iter().copied().fold(0.0, f64::max);
            let min = shares.iter().copied().fold(1.0, f64::min);
            let _ = writeln!(
                out,
                "spread (max/min share): {:.3}",
                if min > 0.0 { max / min } else { f64::INFINITY }
            );
        }
        if !self.subjects.is_empty() {
            if !out.is_empty() {
                out.push('\n');
            }
            let w = self
                .subjects
                .iter()
                .map(|s| s.label().len())
                .max()
                .unwrap_or(0)
                .max(8);
            let _ = writeln!(out, "{:w$}  {:20}  {:10}  OWNER", "FUNCTION", "HASH", "KEY");
            for s in &self.subjects {
                let id = s.id();
                let _ = writeln!(
                    out,
                    "{:w$}  {:<20}  {:#010x}  {}",
                    s.label(),
                    id.0,
                    id.fold32(),
                    self.ring.owner(id).unwrap_or("-")
                );
            }
        }
        if let Some((share, moved)) = self.moved() {
            let what = self.change.as_ref().map_or("", |c| c.0.as_str());
            if !out.is_empty() {
                out.push('\n');
            }
            let _ = writeln!(
                out,
                "{what}: {:.2}% of the key space changes owner",
                share * 100.0
            );
            if !self.subjects.is_empty() {
                let _ = writeln!(
                    out,
                    "{} of {} functions change owner",
                    moved.len(),
                    self.subjects.len()
                );
                for (s, before, after) in moved {
                    let _ = writeln!(
                        out,
                        "  {}: {} -> {}",
                        s.label(),
                        before.unwrap_or("-"),
                        after.unwrap_or("-")
                    );
                }
            }
        }
        out
    }
}

fn width(dist: &[(std::sync::Arc<str>, usize, f64)]) -> usize {
    dist.iter().map(|d| d.0.len()).max().unwrap_or(0).max(6)
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// Runs `skipper ring-inspect`: prints the report, or one line naming the
/// bad input and exits 2.
///
/// # Errors
/// Only when writing to stdout fails.
pub async fn main(mut args: Args) -> anyhow::Result<ExitCode> {
    match live_members(&args).await {
        Ok(Some(members)) => args.members = members,
        Ok(None) => {}
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    }
    match Report::build(&args) {
        Ok(report) => {
            match args.output {
                Output::Json => println!("{}", report.to_json()),
                Output::Table => print!("{}", report.to_table()),
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(2))
        }
    }
}

/// Deadline of the `GetClusterState` call and of the pod list.
const LIVE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The live ring members named by `--controller` or `--namespace`, sorted
/// (`None` when neither is given).
///
/// # Errors
/// [`Error::Controller`] or [`Error::Cluster`] naming what failed.
pub async fn live_members(args: &Args) -> Result<Option<Vec<String>>, Error> {
    if let Some(addr) = &args.controller {
        return members_from_controller(addr, args.token_file.as_deref())
            .await
            .map(Some);
    }
    if let Some(ns) = &args.namespace {
        return members_from_cluster(ns, args.kubeconfig.as_deref())
            .await
            .map(Some);
    }
    Ok(None)
}

async fn members_from_controller(
    addr: &str,
    token_file: Option<&std::path::Path>,
) -> Result<Vec<String>, Error> {
    let fail = |reason: String| Error::Controller {
        addr: addr.to_owned(),
        reason,
    };
    let credentials = match token_file {
        Some(path) => crate::credentials::Credentials::from_file(path).map_err(|e| fail(e.to_string()))?,
        None => crate::credentials::Credentials::none(),
    };
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| fail(format!("cannot resolve: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(fail("resolves to no address".into()));
    }
    let client = crate::client::Client::new(
        crate::client::Endpoints::fixed(&addrs, crate::client::ChannelSettings::default())
            .with_credentials(credentials),
    );
    let resp = client
        .get_cluster_state(
            crate::api::GetClusterStateRequest {
                local_only: Some(true),
            },
            LIVE_DEADLINE,
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut ips = resp.cluster_state.map(|s| s.controller_ips).unwrap_or_default();
    ips.sort();
    Ok(ips)
}

async fn members_from_cluster(
    namespace: &str,
    kubeconfig: Option<&std::path::Path>,
) -> Result<Vec<String>, Error> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ListParams};
    let fail = |reason: String| Error::Cluster {
        namespace: namespace.to_owned(),
        reason,
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| fail(format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| fail(e.to_string()))?
        }
        None => kube::Config::infer().await.map_err(|e| fail(e.to_string()))?,
    };
    let client = kube::Client::try_from(config).map_err(|e| fail(e.to_string()))?;
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    let lp = ListParams::default().labels(crate::controller::kube::stores::CONTROLLER_SELECTOR);
    let list = tokio::time::timeout(LIVE_DEADLINE, pods.list(&lp))
        .await
        .map_err(|_| {
            fail(format!(
                "listing controller pods timed out after {LIVE_DEADLINE:?}"
            ))
        })?
        .map_err(|e| fail(e.to_string()))?;
    let mut ips: Vec<String> = list
        .items
        .iter()
        .filter(|p| crate::controller::kube::is_ready(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    ips.sort();
    ips.dedup();
    Ok(ips)
}
