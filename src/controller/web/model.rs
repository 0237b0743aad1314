//! The operator's view of one cluster-state snapshot: pure functions from
//! [`api::ClusterState`] (as `GetClusterState` aggregates it across the
//! ring), the instance-count history and the snapshot time to the rows,
//! health issues, statistics and pictures the pages show. No I/O, no clock:
//! every relative time is computed against the snapshot's `now`.
//!
//! Everything a page lists is bounded: tables show at most [`MAX_ROWS`]
//! rows (with the total), the event log is the controller's (at most 200).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::history::{Point, Series};
use crate::api::{self, EventSeverity, EventType, ScaleReason};
use crate::domain::{Function, FunctionId};
use crate::ring::HashRing;

/// Most rows a table shows (the rest is counted, not listed).
pub const MAX_ROWS: usize = 500;
/// An unready instance assigned longer ago than this is stuck.
pub const STUCK_AFTER: Duration = Duration::from_secs(60);
/// A router heartbeat older than this is quiet; a quiet one that still
/// reported requests in flight is stale (a router that went silent mid-work:
/// stopped, partitioned, or wedged). Routers report only active functions,
/// so a quiet report with nothing in flight is an idle function, not a
/// problem.
pub const STALE_HEARTBEAT_AFTER: Duration = Duration::from_secs(60);
/// How many items a health issue names.
const ISSUE_ITEMS: usize = 5;

// ---------------------------------------------------------------------------
// Formatting

/// `Ns ago`, `Nm ago`, `Nh ago`, `Nd ago`; `just now` for a time after `now`.
#[must_use]
pub fn ago(now: SystemTime, t: SystemTime) -> String {
    let Ok(d) = now.duration_since(t) else {
        return "just now".into();
    };
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86_400 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}

/// [`ago`] of an optional time; `—` when absent.
#[must_use]
pub fn ago_opt(now: SystemTime, t: Option<SystemTime>) -> String {
    t.map_or_else(|| "—".to_owned(), |t| ago(now, t))
}

/// `Ns`, `Nm`, `Nm Ns`, `Nh Nm`.
#[must_use]
pub fn duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 if s.is_multiple_of(60) => format!("{}m", s / 60),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        _ => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

/// A UTC timestamp `YYYY-MM-DD HH:MM:SS`.
#[must_use]
pub fn timestamp(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|ts| ts.strftime("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

fn timestamp_opt(t: Option<SystemTime>) -> String {
    t.map_or_else(|| "—".to_owned(), timestamp)
}

fn time_of(t: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(*t).ok())
}

/// Escapes a path segment as Go's `url.PathEscape` does for the keys the
/// pages use (everything but unreserved characters is percent-encoded).
#[must_use]
pub fn path_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The key of a function in URLs: `namespace:deployment:tenant`, as in the
/// Go implementation, with `:oneshot` appended for a oneshot function so the
/// two functions of one triple do not collide.
#[must_use]
pub fn function_key(f: &Function) -> String {
    let mut k = format!("{}:{}:{}", f.namespace, f.deployment, f.tenant);
    if f.is_oneshot() {
        k.push_str(":oneshot");
    }
    k
}

fn reason_label(r: ScaleReason) -> &'static str {
    match r {
        ScaleReason::Unspecified => "—",
        ScaleReason::Cpu => "cpu",
        ScaleReason::HeartbeatTimeout => "heartbeat timeout",
        ScaleReason::InFlightRequests => "in-flight requests",
        ScaleReason::Memory => "memory",
        ScaleReason::NoReadyInstances => "no ready instances",
    }
}

fn event_label(t: EventType) -> &'static str {
    match t {
        EventType::Unspecified => "event",
        EventType::ScaleUp => "scale up",
        EventType::ScaleDown => "scale down",
        EventType::PodAssigned => "pod assigned",
        EventType::PodDeleted => "pod deleted",
        EventType::StaleReplacement => "stale replacement",
        EventType::HeartbeatTimeout => "heartbeat timeout",
        EventType::StuckInstanceCleanup => "stuck instance cleanup",
        EventType::AssignmentFailed => "assignment failed",
        EventType::AssignmentBackoffEnded => "assignment back-off ended",
    }
}

// ---------------------------------------------------------------------------
// Rows

/// One instance as the tables show it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct InstanceRow {
    pub name: String,
    pub url: String,
    pub namespace: String,
    pub address: String,
    /// `ready`, `pending` or `stale` (ready, of a replica set other than the
    /// deployment's active one).
    pub status: &'static str,
    pub stuck: bool,
    pub cpu: String,
    pub memory: String,
    pub replica_set: String,
    pub assigned: String,
    pub assigned_at: String,
    pub ready: String,
    pub ready_at: String,
    pub function_key: String,
    pub function_url: String,
    pub tenant: String,
    pub deployment: String,
    pub responsible: String,
    /// `assigned → ready` for the timeline.
    pub startup: String,
}

/// One router's latest heartbeat for a function.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HeartbeatRow {
    pub router: String,
    pub router_url: String,
    pub in_flight: u32,
    pub last_seen: String,
    /// No report for [`STALE_HEARTBEAT_AFTER`].
    pub quiet: bool,
    /// Quiet with requests in flight.
    pub stale: bool,
    pub function_key: String,
    pub function_url: String,
}

/// One autoscaler recommendation.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RecommendationRow {
    pub when: String,
    /// Consecutive ticks that agreed, the first `since`.
    pub ticks: u32,
    pub since: String,
    pub desired: u32,
    pub unclamped: u32,
    pub clamped: bool,
    pub reason: &'static str,
    pub metrics: String,
    pub acted: bool,
}

/// A function with everything the pages derive from it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionRow {
    pub key: String,
    pub url: String,
    pub namespace: String,
    pub deployment: String,
    pub deployment_url: String,
    pub tenant: String,
    pub tenant_url: String,
    pub oneshot: bool,
    pub ready: usize,
    pub pending: usize,
    pub total: usize,
    pub stale: usize,
    pub min: u32,
    pub max: u32,
    pub target_cpu: String,
    pub target_memory: String,
    pub target_in_flight: String,
    pub routers: usize,
    pub in_flight: u32,
    pub last_activity: String,
    pub responsible: String,
    pub responsible_url: String,
    pub active_replica_set: String,
    pub instances: Vec<InstanceRow>,
    pub heartbeats: Vec<HeartbeatRow>,
    pub recommendations: Vec<RecommendationRow>,
    /// A small SVG of the instance count over the history window.
    pub sparkline: String,
    #[serde(skip)]
    pub id: FunctionId,
    #[serde(skip)]
    pub stuck: usize,
}

/// An event as the tables show it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EventRow {
    pub time: String,
    pub ago: String,
    pub function_key: String,
    pub function_url: String,
    pub kind: &'static str,
    pub message: String,
    /// `info` or `warn`.
    pub severity: &'static str,
}

/// One controller of the ring.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ControllerRow {
    pub ip: String,
    pub url: String,
    pub is_self: bool,
    pub functions: usize,
    pub ready: usize,
    pub total: usize,
    /// Share of the ring's key space, percent.
    pub share: String,
    /// Width of the functions-owned bar, percent of the largest.
    pub bar: u32,
    pub color: usize,
}

/// A segment of the ring ownership bar.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RingSegment {
    pub ip: String,
    pub url: String,
    pub percent: String,
    pub color: usize,
    pub is_self: bool,
}

/// A router seen in heartbeats.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RouterRow {
    pub ip: String,
    pub url: String,
    pub functions: usize,
    pub in_flight: u32,
    pub last_seen: String,
    /// No report for [`STALE_HEARTBEAT_AFTER`] (idle, or gone).
    pub quiet: bool,
}

/// A tenant across its functions.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantRow {
    pub tenant: String,
    pub url: String,
    pub functions: usize,
    pub deployments: Vec<String>,
    pub ready: usize,
    pub pending: usize,
    pub total: usize,
}

/// A deployment (by name) across its functions.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeploymentRow {
    pub name: String,
    pub url: String,
    pub namespaces: Vec<String>,
    pub tenants: usize,
    pub functions: usize,
    pub ready: usize,
    pub pending: usize,
    pub total: usize,
    pub min_sum: u64,
    pub max_sum: u64,
    /// Instances over the summed maximum, percent.
    pub utilisation: String,
    /// The pool: the Deployment's replicas, its unassigned Ready pods, and
    /// the pods assigned to tenants.
    pub pool_size: u32,
    pub unassigned_ready: usize,
    pub assigned: usize,
}

/// A pool as this controller's caches see it (summed over namespaces for
/// a deployment name).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pool {
    pub size: u32,
    pub unassigned_ready: usize,
    pub assigned: usize,
}

/// A configuration value (secrets are masked by the controller).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConfigRow {
    pub name: String,
    pub value: String,
    pub description: String,
}

/// A health problem on the dashboard.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Issue {
    /// `red` or `yellow`.
    pub level: &'static str,
    pub title: &'static str,
    pub count: usize,
    pub items: Vec<(String, String)>,
}

/// The dashboard's stat cards.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Stats {
    pub tenants: usize,
    pub functions: usize,
    pub deployments: usize,
    pub ready: usize,
    pub pending: usize,
    pub total: usize,
    pub uptime: String,
    pub controllers: usize,
    pub routers: usize,
}

// ---------------------------------------------------------------------------
// The model

/// Everything the pages show, built once per snapshot.
#[derive(Debug, Clone, Default)]
pub struct Model {
    /// Increases with every snapshot.
    pub generation: u64,
    pub self_ip: String,
    pub taken: String,
    pub functions: Vec<FunctionRow>,
    pub events: Vec<EventRow>,
    pub controllers: Vec<ControllerRow>,
    pub ring: Vec<RingSegment>,
    pub ring_imbalanced: bool,
    pub routers: Vec<RouterRow>,
    pub tenants: Vec<TenantRow>,
    pub deployments: Vec<DeploymentRow>,
    pub config: Vec<ConfigRow>,
    pub issues: Vec<Issue>,
    pub stats: Stats,
    /// SVG of the cluster's ready and total instances over the window.
    pub cluster_chart: String,
    /// The function charts, by key.
    pub charts: HashMap<String, String>,
}

/// What [`Model::build`] reads.
#[derive(Debug)]
pub struct Input<'a> {
    pub state: &'a api::ClusterState,
    pub now: SystemTime,
    pub generation: u64,
    pub history: &'a HashMap<FunctionId, Series>,
    pub totals: &'a Series,
    /// Pools by deployment name.
    pub pools: &'a HashMap<String, Pool>,
    /// The window the charts cover.
    pub window: Duration,
}

/// A scaling target with its unit; `—` when not set.
fn target(v: Option<u32>, unit: &str) -> String {
    v.filter(|v| *v > 0)
        .map_or_else(|| "—".to_owned(), |v| format!("{v}{unit}"))
}

impl Model {
    /// Builds the model of one snapshot.
    #[must_use]
    #[allow(clippy::too_many_lines)]
    pub fn build(input: &Input<'_>) -> Self {
        let state = input.state;
        let now = input.now;
        let self_ip = state.pod_ip.clone().unwrap_or_default();
        let ring_ips: Vec<String> = state.controller_ips.clone();
        let color_of: HashMap<&str, usize> = ring_ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (ip.as_str(), i % 8))
            .collect();

        let mut functions: Vec<FunctionRow> = state
            .supervisors
            .iter()
            .filter_map(|s| function_row(s, now, input))
            .collect();
        functions.sort_by(|a, b| a.key.cmp(&b.key));

        let events = state
            .events
            .iter()
            .map(|e| {
                let f = e.function.as_ref().map(Function::from).unwrap_or_default();
                let key = function_key(&f);
                let t = time_of(e.timestamp.as_ref()).unwrap_or(SystemTime::UNIX_EPOCH);
                EventRow {
                    time: timestamp(t),
                    ago: ago(now, t),
                    function_url: format!("/functions/{}", path_escape(&key)),
                    function_key: key,
                    kind: event_label(
                        e.r#type
                            .and_then(|t| EventType::try_from(t).ok())
                            .unwrap_or_default(),
                    ),
                    message: e.message.clone().unwrap_or_default(),
                    severity: match e.severity.and_then(|s| EventSeverity::try_from(s).ok()) {
                        Some(EventSeverity::Warn) => "warn",
                        _ => "info",
                    },
                }
            })
            .collect();

        // Controllers: the ring's members, what they own, their key space.
        let ring = HashRing::new(ring_ips.iter().map(String::as_str));
        let shares: HashMap<String, f64> = ring
            .distribution()
            .into_iter()
            .map(|(ip, _, share)| (ip.to_string(), share))
            .collect();
        let mut controllers: Vec<ControllerRow> = ring_ips
            .iter()
            .map(|ip| {
                let owned: Vec<&FunctionRow> = functions.iter().filter(|f| f.responsible == *ip).collect();
                ControllerRow {
                    ip: ip.clone(),
                    url: format!("/controllers/{}", path_escape(ip)),
                    is_self: *ip == self_ip,
                    functions: owned.len(),
                    ready: owned.iter().map(|f| f.ready).sum(),
                    total: owned.iter().map(|f| f.total).sum(),
                    share: format!("{:.1}", shares.get(ip).copied().unwrap_or(0.0) * 100.0),
                    bar: 0,
                    color: color_of.get(ip.as_str()).copied().unwrap_or(0),
                }
            })
            .collect();
        let most = controllers.iter().map(|c| c.functions).max().unwrap_or(0);
        for c in &mut controllers {
            c.bar = (c.functions * 100)
                .checked_div(most)
                .map_or(0, |b| u32::try_from(b).unwrap_or(100));
        }
        let ring_imbalanced = imbalanced(&controllers.iter().map(|c| c.functions).collect::<Vec<_>>());
        let ring_segments = ring_ips
            .iter()
            .map(|ip| RingSegment {
                ip: ip.clone(),
                url: format!("/controllers/{}", path_escape(ip)),
                percent: format!("{:.2}", shares.get(ip).copied().unwrap_or(0.0) * 100.0),
                color: color_of.get(ip.as_str()).copied().unwrap_or(0),
                is_self: *ip == self_ip,
            })
            .collect();

        let routers = router_rows(&functions, now, state);
        let tenants = tenant_rows(&functions);
        let deployments = deployment_rows(&functions, input.pools);
        let issues = issues(&functions);
        let ready: usize = functions.iter().map(|f| f.ready).sum();
        let total: usize = functions.iter().map(|f| f.total).sum();
        let stats = Stats {
            tenants: tenants.len(),
            functions: functions.len(),
            deployments: deployments.len(),
            ready,
            pending: total - ready,
            total,
            uptime: time_of(state.started_at.as_ref())
                .and_then(|t| now.duration_since(t).ok())
                .map_or_else(|| "—".to_owned(), duration),
            controllers: ring_ips.len(),
            routers: routers.len(),
        };
        let start = now.checked_sub(input.window).unwrap_or(SystemTime::UNIX_EPOCH);
        let cluster_chart = chart(input.totals, start, now, 640, 140);
        let charts = functions
            .iter()
            .map(|f| {
                let empty = Series::default();
                let series = input.history.get(&f.id).unwrap_or(&empty);
                (f.key.clone(), chart(series, start, now, 640, 140))
            })
            .collect();
        let config = state
            .config
            .iter()
            .map(|c| ConfigRow {
                name: c.name.clone().unwrap_or_default(),
                value: c.value.clone().unwrap_or_default(),
                description: c.description.clone().unwrap_or_default(),
            })
            .collect();
        Self {
            generation: input.generation,
            self_ip,
            taken: timestamp(now),
            functions,
            events,
            controllers,
            ring: ring_segments,
            ring_imbalanced,
            routers,
            tenants,
            deployments,
            config,
            issues,
            stats,
            cluster_chart,
            charts,
        }
    }

    /// The function with `key`.
    #[must_use]
    pub fn function(&self, key: &str) -> Option<&FunctionRow> {
        self.functions.iter().find(|f| f.key == key)
    }

    /// The instance named `name` (first match across namespaces).
    #[must_use]
    pub fn instance(&self, name: &str) -> Option<(&FunctionRow, &InstanceRow)> {
        self.functions
            .iter()
            .find_map(|f| f.instances.iter().find(|i| i.name == name).map(|i| (f, i)))
    }
}

/// Whether any count differs from the mean by more than half the mean.
fn imbalanced(counts: &[usize]) -> bool {
    if counts.len() < 2 {
        return false;
    }
    #[allow(clippy::cast_precision_loss)]
    let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
    #[allow(clippy::cast_precision_loss)]
    let off = counts.iter().any(|c| (*c as f64 - mean).abs() > mean * 0.5);
    mean > 0.0 && off
}

fn function_row(s: &api::SupervisorState, now: SystemTime, input: &Input<'_>) -> Option<FunctionRow> {
    let f = Function::from(s.function.as_ref()?);
    let key = function_key(&f);
    let url = format!("/functions/{}", path_escape(&key));
    let scale = f.scale_or_default();
    let active = s.active_replica_set.clone().unwrap_or_default();
    let responsible = s.responsible_controller_ip.clone().unwrap_or_default();
    let mut instances: Vec<InstanceRow> = s
        .instances
        .iter()
        .map(|i| {
            let assigned = time_of(i.assigned_at.as_ref());
            let ready = time_of(i.ready_at.as_ref());
            let rs = i.replica_set.clone().unwrap_or_default();
            let stale = ready.is_some() && !active.is_empty() && !rs.is_empty() && rs != active;
            let stuck = ready.is_none()
                && assigned.is_some_and(|a| now.duration_since(a).unwrap_or_default() > STUCK_AFTER);
            let name = i.name.clone().unwrap_or_default();
            InstanceRow {
                url: format!("/instances/{}", path_escape(&name)),
                name,
                namespace: f.namespace.clone(),
                address: i.addr.clone().unwrap_or_default(),
                status: match (ready.is_some(), stale) {
                    (true, true) => "stale",
                    (true, false) => "ready",
                    (false, _) => "pending",
                },
                stuck,
                cpu: i
                    .cpu_usage_milli
                    .map_or_else(|| "—".to_owned(), |v| format!("{v}m")),
                memory: i
                    .memory_usage_mib
                    .map_or_else(|| "—".to_owned(), |v| format!("{v}Mi")),
                replica_set: rs,
                assigned: ago_opt(now, assigned),
                assigned_at: timestamp_opt(assigned),
                ready: ago_opt(now, ready),
                ready_at: timestamp_opt(ready),
                function_key: key.clone(),
                function_url: url.clone(),
                tenant: f.tenant.clone(),
                deployment: f.deployment.clone(),
                responsible: responsible.clone(),
                startup: match (assigned, ready) {
                    (Some(a), Some(r)) => r
                        .duration_since(a)
                        .map_or_else(|_| "—".to_owned(), |d| format!("{} ms", d.as_millis())),
                    _ => "—".into(),
                },
            }
        })
        .collect();
    instances.sort_by(|a, b| a.name.cmp(&b.name));
    let mut heartbeats: Vec<HeartbeatRow> = s
        .router_heartbeats
        .iter()
        .map(|h| {
            let router = h.router_ip.clone().unwrap_or_default();
            let t = h.heartbeat.as_ref().and_then(|hb| time_of(hb.timestamp.as_ref()));
            HeartbeatRow {
                router_url: format!("/routers/{}", path_escape(&router)),
                router,
                in_flight: h
                    .heartbeat
                    .as_ref()
                    .and_then(|hb| hb.in_flight_requests)
                    .unwrap_or(0),
                last_seen: ago_opt(now, t),
                quiet: t.is_none_or(|t| now.duration_since(t).unwrap_or_default() > STALE_HEARTBEAT_AFTER),
                stale: false,
                function_key: key.clone(),
                function_url: url.clone(),
            }
        })
        .map(|mut h| {
            h.stale = h.quiet && h.in_flight > 0;
            h
        })
        .collect();
    heartbeats.sort_by(|a, b| a.router.cmp(&b.router));
    let last_activity = s
        .router_heartbeats
        .iter()
        .filter_map(|h| h.heartbeat.as_ref().and_then(|hb| time_of(hb.timestamp.as_ref())))
        .max();
    let recommendations = s
        .recent_recommendations
        .iter()
        .rev()
        .map(|r| {
            let d = r.decision.clone().unwrap_or_default();
            let desired = d.desired_instances.unwrap_or(0);
            let unclamped = d.unclamped_desired_instances.unwrap_or(desired);
            let ticks = r.ticks.unwrap_or(1);
            RecommendationRow {
                when: ago_opt(now, time_of(r.timestamp.as_ref())),
                ticks,
                since: ago_opt(
                    now,
                    time_of(r.since.as_ref()).or_else(|| time_of(r.timestamp.as_ref())),
                ),
                desired,
                unclamped,
                clamped: unclamped != desired,
                reason: reason_label(
                    d.reason
                        .and_then(|r| ScaleReason::try_from(r).ok())
                        .unwrap_or_default(),
                ),
                metrics: d
                    .metrics
                    .iter()
                    .map(|m| {
                        format!(
                            "{}: {:.1}",
                            m.name.clone().unwrap_or_default(),
                            m.value.unwrap_or(0.0)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                acted: r.acted.unwrap_or(false),
            }
        })
        .collect();
    let ready = instances.iter().filter(|i| i.status != "pending").count();
    let id = f.id();
    let start = now.checked_sub(input.window).unwrap_or(SystemTime::UNIX_EPOCH);
    let empty = Series::default();
    let sparkline = sparkline(input.history.get(&id).unwrap_or(&empty), start, now);
    Some(FunctionRow {
        url,
        namespace: f.namespace.clone(),
        deployment_url: format!("/deployments/{}", path_escape(&f.deployment)),
        deployment: f.deployment.clone(),
        tenant_url: format!("/tenants/{}", path_escape(&f.tenant)),
        tenant: f.tenant.clone(),
        oneshot: f.is_oneshot(),
        ready,
        pending: instances.len() - ready,
        total: instances.len(),
        stale: instances.iter().filter(|i| i.status == "stale").count(),
        stuck: instances.iter().filter(|i| i.stuck).count(),
        min: scale.min_instances(),
        max: scale.max_instances(),
        target_cpu: target(scale.target_cpu_usage_milli, "m"),
        target_memory: target(scale.target_memory_usage_mib, "Mi"),
        target_in_flight: target(scale.target_in_flight_requests, ""),
        routers: heartbeats.len(),
        in_flight: heartbeats.iter().map(|h| h.in_flight).sum(),
        last_activity: ago_opt(now, last_activity),
        responsible_url: format!("/controllers/{}", path_escape(&responsible)),
        responsible,
        active_replica_set: active,
        instances,
        heartbeats,
        recommendations,
        sparkline,
        id,
        key,
    })
}

fn router_rows(functions: &[FunctionRow], now: SystemTime, state: &api::ClusterState) -> Vec<RouterRow> {
    // Newest heartbeat per router, across every function.
    let mut newest: BTreeMap<String, Option<SystemTime>> = BTreeMap::new();
    for s in &state.supervisors {
        for h in &s.router_heartbeats {
            let t = h.heartbeat.as_ref().and_then(|hb| time_of(hb.timestamp.as_ref()));
            let e = newest.entry(h.router_ip.clone().unwrap_or_default()).or_default();
            *e = (*e).max(t);
        }
    }
    newest
        .into_iter()
        .map(|(ip, t)| {
            let beats: Vec<&HeartbeatRow> = functions
                .iter()
                .flat_map(|f| f.heartbeats.iter())
                .filter(|h| h.router == ip)
                .collect();
            RouterRow {
                url: format!("/routers/{}", path_escape(&ip)),
                functions: beats.len(),
                in_flight: beats.iter().map(|h| h.in_flight).sum(),
                last_seen: ago_opt(now, t),
                quiet: t.is_none_or(|t| now.duration_since(t).unwrap_or_default() > STALE_HEARTBEAT_AFTER),
                ip,
            }
        })
        .collect()
}

fn tenant_rows(functions: &[FunctionRow]) -> Vec<TenantRow> {
    let mut by: BTreeMap<&str, TenantRow> = BTreeMap::new();
    let mut deps: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for f in functions {
        let row = by.entry(&f.tenant).or_insert_with(|| TenantRow {
            tenant: f.tenant.clone(),
            url: f.tenant_url.clone(),
            functions: 0,
            deployments: Vec::new(),
            ready: 0,
            pending: 0,
            total: 0,
        });
        row.functions += 1;
        row.ready += f.ready;
        row.pending += f.pending;
        row.total += f.total;
        deps.entry(&f.tenant).or_default().insert(&f.deployment);
    }
    by.into_iter()
        .map(|(t, mut row)| {
            row.deployments = deps
                .get(t)
                .map(|d| d.iter().map(|s| (*s).to_owned()).collect())
                .unwrap_or_default();
            row
        })
        .collect()
}

fn deployment_rows(functions: &[FunctionRow], pools: &HashMap<String, Pool>) -> Vec<DeploymentRow> {
    let mut by: BTreeMap<&str, (DeploymentRow, BTreeSet<&str>, BTreeSet<&str>)> = BTreeMap::new();
    for f in functions {
        let (row, tenants, namespaces) = by.entry(&f.deployment).or_insert_with(|| {
            (
                DeploymentRow {
                    name: f.deployment.clone(),
                    url: f.deployment_url.clone(),
                    namespaces: Vec::new(),
                    tenants: 0,
                    functions: 0,
                    ready: 0,
                    pending: 0,
                    total: 0,
                    min_sum: 0,
                    max_sum: 0,
                    utilisation: String::new(),
                    pool_size: 0,
                    unassigned_ready: 0,
                    assigned: 0,
                },
                BTreeSet::new(),
                BTreeSet::new(),
            )
        });
        row.functions += 1;
        row.ready += f.ready;
        row.pending += f.pending;
        row.total += f.total;
        row.min_sum += u64::from(f.min);
        row.max_sum += u64::from(f.max);
        tenants.insert(&f.tenant);
        namespaces.insert(&f.namespace);
    }
    by.into_values()
        .map(|(mut row, tenants, namespaces)| {
            row.tenants = tenants.len();
            row.namespaces = namespaces.into_iter().map(str::to_owned).collect();
            #[allow(clippy::cast_precision_loss)]
            let pct = if row.max_sum == 0 {
                0.0
            } else {
                row.total as f64 * 100.0 / row.max_sum as f64
            };
            row.utilisation = format!("{pct:.0}%");
            let pool = pools.get(&row.name).copied().unwrap_or_default();
            row.pool_size = pool.size;
            row.unassigned_ready = pool.unassigned_ready;
            row.assigned = pool.assigned;
            row
        })
        .collect()
}

fn issues(functions: &[FunctionRow]) -> Vec<Issue> {
    let item = |f: &FunctionRow| (f.key.clone(), f.url.clone());
    let mut out = Vec::new();
    let stuck: Vec<&FunctionRow> = functions.iter().filter(|f| f.stuck > 0).collect();
    if !stuck.is_empty() {
        out.push(Issue {
            level: "red",
            title: "Stuck instances",
            count: stuck.iter().map(|f| f.stuck).sum(),
            items: stuck.iter().take(ISSUE_ITEMS).map(|f| item(f)).collect(),
        });
    }
    let waiting: Vec<&FunctionRow> = functions.iter().filter(|f| f.total > 0 && f.ready == 0).collect();
    if !waiting.is_empty() {
        out.push(Issue {
            level: "yellow",
            title: "Functions waiting for pods",
            count: waiting.len(),
            items: waiting.iter().take(ISSUE_ITEMS).map(|f| item(f)).collect(),
        });
    }
    let stale_beats: Vec<&HeartbeatRow> = functions
        .iter()
        .flat_map(|f| f.heartbeats.iter())
        .filter(|h| h.stale)
        .collect();
    if !stale_beats.is_empty() {
        out.push(Issue {
            level: "yellow",
            title: "Stale heartbeats",
            count: stale_beats.len(),
            items: stale_beats
                .iter()
                .take(ISSUE_ITEMS)
                .map(|h| {
                    (
                        format!("{} → {}", h.router, h.function_key),
                        h.function_url.clone(),
                    )
                })
                .collect(),
        });
    }
    let stale: Vec<&FunctionRow> = functions.iter().filter(|f| f.stale > 0).collect();
    if !stale.is_empty() {
        out.push(Issue {
            level: "yellow",
            title: "Stale instances",
            count: stale.iter().map(|f| f.stale).sum(),
            items: stale.iter().take(ISSUE_ITEMS).map(|f| item(f)).collect(),
        });
    }
    out
}

// ---------------------------------------------------------------------------
// Filters and sorting

/// Sort direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dir {
    #[default]
    Asc,
    Desc,
}

impl Dir {
    /// `desc` is descending; anything else ascending.
    #[must_use]
    pub fn parse(s: Option<&str>) -> Self {
        if s == Some("desc") { Self::Desc } else { Self::Asc }
    }

    /// The query value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Asc => "asc",
            Self::Desc => "desc",
        }
    }
}

/// `/functions?search=&sort=&dir=`: a case-insensitive substring of
/// deployment, namespace or tenant; sort by `deployment` (default),
/// `namespace`, `tenant` or `instances`.
#[must_use]
pub fn filter_functions<'a>(
    rows: &'a [FunctionRow],
    search: &str,
    sort: &str,
    dir: Dir,
) -> Vec<&'a FunctionRow> {
    let needle = search.trim().to_lowercase();
    let mut out: Vec<&FunctionRow> = rows
        .iter()
        .filter(|f| {
            needle.is_empty()
                || f.deployment.to_lowercase().contains(&needle)
                || f.namespace.to_lowercase().contains(&needle)
                || f.tenant.to_lowercase().contains(&needle)
        })
        .collect();
    out.sort_by(|a, b| {
        let by_name = || {
            (&a.deployment, &a.namespace, &a.tenant, a.oneshot).cmp(&(
                &b.deployment,
                &b.namespace,
                &b.tenant,
                b.oneshot,
            ))
        };
        let o = match sort {
            "namespace" => a.namespace.cmp(&b.namespace).then_with(by_name),
            "tenant" => a.tenant.cmp(&b.tenant).then_with(by_name),
            "instances" => a.total.cmp(&b.total).then_with(by_name),
            _ => by_name(),
        };
        if dir == Dir::Desc { o.reverse() } else { o }
    });
    out
}

/// `/tenants?search=&sort=&dir=`: a substring of the tenant or of any of
/// its deployments; sort by `tenant` (default), `functions`, `instances`
/// (ready) or `deployments`.
#[must_use]
pub fn filter_tenants<'a>(rows: &'a [TenantRow], search: &str, sort: &str, dir: Dir) -> Vec<&'a TenantRow> {
    let needle = search.trim().to_lowercase();
    let mut out: Vec<&TenantRow> = rows
        .iter()
        .filter(|t| {
            needle.is_empty()
                || t.tenant.to_lowercase().contains(&needle)
                || t.deployments.iter().any(|d| d.to_lowercase().contains(&needle))
        })
        .collect();
    out.sort_by(|a, b| {
        let o = match sort {
            "functions" => a.functions.cmp(&b.functions),
            "instances" => a.ready.cmp(&b.ready),
            "deployments" => a.deployments.len().cmp(&b.deployments.len()),
            _ => std::cmp::Ordering::Equal,
        }
        .then_with(|| a.tenant.cmp(&b.tenant));
        if dir == Dir::Desc { o.reverse() } else { o }
    });
    out
}

/// `/events?function=&severity=`: a case-insensitive substring of the
/// function key; severity `1` info only, `2` warn only, else all.
#[must_use]
pub fn filter_events<'a>(rows: &'a [EventRow], function: &str, severity: &str) -> Vec<&'a EventRow> {
    let needle = function.trim().to_lowercase();
    rows.iter()
        .filter(|e| needle.is_empty() || e.function_key.to_lowercase().contains(&needle))
        .filter(|e| match severity {
            "1" => e.severity == "info",
            "2" => e.severity == "warn",
            _ => true,
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Pictures

/// Seconds since the epoch.
#[must_use]
pub fn unix(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// The step function of `series` over `[start, now]`: the value in force at
/// `start`, each change, and the value at `now`.
fn steps(series: &Series, start: SystemTime, now: SystemTime) -> Vec<Point> {
    let (s, n) = (unix(start), unix(now));
    let mut out = Vec::new();
    let before = series.points().iter().rev().find(|p| p.at <= s).copied();
    if let Some(p) = before {
        out.push(Point { at: s, ..p });
    }
    out.extend(series.points().iter().filter(|p| p.at > s && p.at <= n).copied());
    if let Some(last) = out.last().copied() {
        out.push(Point { at: n, ..last });
    }
    out
}

#[allow(clippy::cast_precision_loss)]
fn polyline(
    points: &[Point],
    start: u64,
    span: u64,
    w: f64,
    h: f64,
    top: f64,
    value: impl Fn(&Point) -> u32,
) -> String {
    let mut path = String::new();
    let mut last_y: Option<f64> = None;
    for p in points {
        let x = (p.at.saturating_sub(start) as f64 / span as f64) * w;
        let y = h - f64::from(value(p)) / top * h;
        if let Some(ly) = last_y {
            let _ = write!(path, "{x:.1},{ly:.1} ");
        }
        let _ = write!(path, "{x:.1},{y:.1} ");
        last_y = Some(y);
    }
    path.trim_end().to_owned()
}

/// A small SVG of the total instance count (no axes), for table rows.
#[must_use]
pub fn sparkline(series: &Series, start: SystemTime, now: SystemTime) -> String {
    let (w, h) = (80.0, 18.0);
    let pts = steps(series, start, now);
    let span = unix(now).saturating_sub(unix(start)).max(1);
    let top = f64::from(pts.iter().map(|p| p.total).max().unwrap_or(0).max(1));
    let line = polyline(&pts, unix(start), span, w, h - 2.0, top, |p| u32::from(p.total));
    format!(
        "<svg class=\"spark\" viewBox=\"0 -1 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"instances over the last minutes\"><polyline points=\"{line}\"/></svg>"
    )
}

/// An SVG chart of ready (solid) and total (dashed) instances over
/// `[start, now]`, with the maximum on the y axis and the window on the x
/// axis.
#[must_use]
pub fn chart(series: &Series, start: SystemTime, now: SystemTime, width: u32, height: u32) -> String {
    let (w, h) = (f64::from(width) - 40.0, f64::from(height) - 24.0);
    let pts = steps(series, start, now);
    let span = unix(now).saturating_sub(unix(start)).max(1);
    let max = pts.iter().map(|p| p.total).max().unwrap_or(0).max(1);
    let top = f64::from(max);
    let total = polyline(&pts, unix(start), span, w, h, top, |p| u32::from(p.total));
    let ready = polyline(&pts, unix(start), span, w, h, top, |p| u32::from(p.ready));
    let minutes = span / 60;
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg class=\"chart\" viewBox=\"-30 -8 {width} {height}\" width=\"{width}\" height=\"{height}\" role=\"img\" aria-label=\"ready and total instances over the last {minutes} minutes\">\
         <line class=\"axis\" x1=\"0\" y1=\"{h}\" x2=\"{w}\" y2=\"{h}\"/>\
         <line class=\"axis\" x1=\"0\" y1=\"0\" x2=\"0\" y2=\"{h}\"/>\
         <line class=\"grid\" x1=\"0\" y1=\"0\" x2=\"{w}\" y2=\"0\"/>\
         <text class=\"label\" x=\"-6\" y=\"4\" text-anchor=\"end\">{max}</text>\
         <text class=\"label\" x=\"-6\" y=\"{h}\" text-anchor=\"end\">0</text>\
         <text class=\"label\" x=\"0\" y=\"{ly}\">-{minutes}m</text>\
         <text class=\"label\" x=\"{w}\" y=\"{ly}\" text-anchor=\"end\">now</text>\
         <polyline class=\"total\" points=\"{total}\"/>\
         <polyline class=\"ready\" points=\"{ready}\"/></svg>",
        ly = h + 16.0,
    );
    svg
}

#[cfg(test)]
mod tests;
