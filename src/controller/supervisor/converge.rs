//! The pure core of a supervisor: the HPA-style desired-instance calculation
//! (spec §5.4), the downscale stabilization window, the per-tick plan of a
//! regular or oneshot function (§5.5, §5.7, §5.9) and the execution rules of a
//! decision (§5.6). Everything here is a synchronous function of its inputs and
//! `now`; the supervisor task carries the plans out.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use crate::api::{EventSeverity, EventType, ScaleReason};
pub use crate::controller::heartbeat::Combined;
use crate::domain::Function;

/// Added to the tolerance when comparing usage ratios (absorbs float error).
const TOLERANCE_EPSILON: f64 = 1e-10;

/// One instance as converge sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub name: String,
    pub assigned_at: SystemTime,
    /// Set when the pod is Ready and accepted its assignment.
    pub ready_at: Option<SystemTime>,
    pub cpu_milli: u32,
    pub memory_mib: u32,
}

/// The autoscaler's settings (the controller's `--hpa-*`,
/// `--heartbeat-timeout` and `--function-assign-timeout` flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleConfig {
    pub heartbeat_timeout: Duration,
    pub tolerance: f64,
    pub initial_readiness_delay: Duration,
    pub downscale_stabilization: Duration,
    pub assign_timeout: Duration,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout: Duration::from_secs(90),
            tolerance: 0.1,
            initial_readiness_delay: Duration::from_secs(30),
            downscale_stabilization: Duration::from_secs(90),
            assign_timeout: Duration::from_secs(30),
        }
    }
}

impl ScaleConfig {
    /// How long a freshly started controller never scales down:
    /// `max(downscale stabilization, heartbeat timeout)`.
    #[must_use]
    pub fn protection_period(&self) -> Duration {
        self.downscale_stabilization.max(self.heartbeat_timeout)
    }
}

/// A scaling decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub desired: u32,
    pub unclamped: u32,
    pub reason: ScaleReason,
    pub metrics: Vec<(&'static str, f64)>,
}

impl Decision {
    /// A decision with no metrics.
    #[must_use]
    pub fn new(desired: u32, reason: ScaleReason) -> Self {
        Self {
            desired,
            unclamped: 0,
            reason,
            metrics: Vec::new(),
        }
    }

    /// Whether `other` is the same decision, a metric that is NaN equal to
    /// NaN: the in-flight metric of a function without instances is 0/0,
    /// and two ticks that recommend the same are one recommendation.
    #[must_use]
    pub fn same_as(&self, other: &Decision) -> bool {
        self.desired == other.desired
            && self.unclamped == other.unclamped
            && self.reason == other.reason
            && self.metrics.len() == other.metrics.len()
            && self
                .metrics
                .iter()
                .zip(&other.metrics)
                .all(|((a, x), (b, y))| a == b && (x == y || (x.is_nan() && y.is_nan())))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Cpu,
    Memory,
}

fn clamp(v: u32, f: &Function) -> u32 {
    let s = f.scale_or_default();
    v.max(s.min_instances()).min(s.max_instances())
}

fn ceil_u32(x: f64) -> u32 {
    // Saturating float-to-int conversion is the intent: absurd ratios clamp.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let v = x.ceil().max(0.0) as u32;
    v
}

/// `(desired, average usage)` for one resource metric (spec §5.4
/// `metricDesired`). The target is the function's current one: a scale
/// change keeps the instances (see [`staleness`]) and moves their target.
fn metric_desired(
    metric: Metric,
    target: u32,
    instances: &[Observed],
    now: SystemTime,
    cfg: &ScaleConfig,
) -> (u32, f64) {
    let current = u32::try_from(instances.len()).unwrap_or(u32::MAX);
    let mut with = 0u32;
    let mut without = 0u32;
    let mut total = 0u32;
    for i in instances {
        let usage = match metric {
            Metric::Cpu => i.cpu_milli,
            Metric::Memory => i.memory_mib,
        };
        let warming = metric == Metric::Cpu
            && i.ready_at.is_none_or(|r| {
                now.duration_since(r).unwrap_or(Duration::ZERO) <= cfg.initial_readiness_delay
            });
        if warming || usage == 0 {
            without += 1;
            continue;
        }
        with += 1;
        total = total.saturating_add(usage);
    }
    if with == 0 || target == 0 {
        return (current, 0.0);
    }
    let target = f64::from(target);
    let avg = f64::from(total) / f64::from(with);
    let ratio = avg / target;
    let mut desired = ceil_u32(f64::from(current) * ratio);
    if (1.0 - ratio).abs() <= cfg.tolerance + TOLERANCE_EPSILON {
        return (current, 0.0);
    }
    if without > 0 {
        let adjusted_total = if desired < current {
            f64::from(total) + f64::from(without) * target
        } else {
            f64::from(total)
        };
        let adj_ratio = (adjusted_total / f64::from(current)) / target;
        let flips = (adj_ratio > 1.0 && ratio < 1.0) || (adj_ratio < 1.0 && ratio > 1.0);
        if flips || (1.0 - adj_ratio).abs() <= cfg.tolerance + TOLERANCE_EPSILON {
            return (current, avg);
        }
        desired = ceil_u32(f64::from(current) * adj_ratio);
    }
    (desired, avg)
}

/// The desired instance count of a function (spec §5.4).
#[must_use]
pub fn desire(
    f: &Function,
    hb: Combined,
    instances: &[Observed],
    now: SystemTime,
    cfg: &ScaleConfig,
) -> Decision {
    let timed_out = hb
        .timestamp
        .is_none_or(|t| now.duration_since(t).unwrap_or(Duration::ZERO) >= cfg.heartbeat_timeout);
    if timed_out {
        return Decision::new(0, ScaleReason::HeartbeatTimeout);
    }
    if f.is_oneshot() {
        return Decision {
            desired: clamp(hb.in_flight, f),
            unclamped: hb.in_flight,
            reason: ScaleReason::InFlightRequests,
            metrics: vec![("in_flight_requests", f64::from(hb.in_flight))],
        };
    }
    let scale = f.scale_or_default();
    let mut best = 1u32;
    let mut reason = ScaleReason::Unspecified;
    // One entry per target: a supervisor keeps decisions across ticks.
    let targets = [
        scale.target_in_flight_requests(),
        scale.target_cpu_usage_milli(),
        scale.target_memory_usage_mib(),
    ];
    let mut metrics = Vec::with_capacity(targets.iter().filter(|t| **t > 0).count());
    let mut consider = |d: u32, r: ScaleReason| {
        if d > best {
            best = d;
            reason = r;
        }
    };
    if scale.target_in_flight_requests() > 0 {
        let d = hb.in_flight.div_ceil(scale.target_in_flight_requests());
        // Informational: NaN or infinite when there are no instances.
        #[allow(clippy::cast_precision_loss)]
        let per_instance = f64::from(hb.in_flight) / instances.len() as f64;
        metrics.push(("in_flight_requests", per_instance));
        consider(d, ScaleReason::InFlightRequests);
    }
    if scale.target_cpu_usage_milli() > 0 {
        let (d, avg) = metric_desired(Metric::Cpu, scale.target_cpu_usage_milli(), instances, now, cfg);
        metrics.push(("cpu", avg));
        consider(d, ScaleReason::Cpu);
    }
    if scale.target_memory_usage_mib() > 0 {
        let (d, avg) = metric_desired(
            Metric::Memory,
            scale.target_memory_usage_mib(),
            instances,
            now,
            cfg,
        );
        metrics.push(("memory", avg));
        consider(d, ScaleReason::Memory);
    }
    Decision {
        desired: clamp(best, f),
        unclamped: best,
        reason,
        metrics,
    }
}

/// Recent recommendations, for the downscale stabilization maximum. Only
/// the recommendations that can still be the maximum are kept: each is
/// larger than every newer one (a monotonic queue), so a function whose
/// recommendation does not change holds one entry.
#[derive(Debug, Clone, Default)]
pub struct Window {
    entries: VecDeque<(u32, SystemTime)>,
}

impl Window {
    /// Records `desired` at `now`, drops entries older than `now - window`
    /// and returns the maximum of what remains (the new entry included).
    pub fn record(&mut self, desired: u32, now: SystemTime, window: Duration) -> u32 {
        // Older entries no larger than `desired` can never be the maximum
        // again: `desired` outlives them.
        while self.entries.back().is_some_and(|(d, _)| *d <= desired) {
            self.entries.pop_back();
        }
        // Grow one at a time while small: a steady function holds one entry.
        if self.entries.len() == self.entries.capacity() && self.entries.len() < 4 {
            self.entries.reserve_exact(1);
        }
        self.entries.push_back((desired, now));
        let cutoff = now.checked_sub(window).unwrap_or(SystemTime::UNIX_EPOCH);
        while self.entries.front().is_some_and(|(_, t)| *t < cutoff) {
            self.entries.pop_front();
        }
        self.entries.front().map_or(desired, |(d, _)| *d)
    }

    /// Number of recommendations held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no recommendation is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// An event the plan asks to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEvent {
    pub kind: EventType,
    pub severity: EventSeverity,
    pub message: String,
}

impl PlannedEvent {
    fn new(kind: EventType, severity: EventSeverity, message: impl Into<String>) -> Self {
        Self {
            kind,
            severity,
            message: message.into(),
        }
    }
}

/// What one converge tick does.
#[derive(Debug, Clone, PartialEq)]
pub enum TickPlan {
    /// Nothing to do this tick (oneshot within its life, protection period,
    /// or not the ring owner). `stop` ends the supervisor after the tick.
    Idle { decision: Decision, stop: bool },
    /// Oneshot safety net: stop, and (as ring owner) delete every instance.
    OneshotCleanup { delete: Vec<String> },
    /// The ring owner acts: record `event`, delete `stuck` instances, then
    /// execute `decision` over the remaining instances; stale replacement
    /// runs only when `replace_stale`.
    Act {
        decision: Decision,
        event: Option<PlannedEvent>,
        stuck: Vec<String>,
        replace_stale: bool,
        stop: bool,
    },
}

/// Inputs of one tick.
#[derive(Debug)]
pub struct TickInput<'a> {
    pub function: &'a Function,
    pub instances: &'a [Observed],
    pub heartbeat: Combined,
    pub now: SystemTime,
    /// When this controller started (the protection period runs from here).
    pub started_at: SystemTime,
    /// Whether this controller owns the function on the ring.
    pub owner: bool,
}

fn elapsed(now: SystemTime, since: SystemTime) -> Duration {
    now.duration_since(since).unwrap_or(Duration::ZERO)
}

/// Plans one converge tick (spec §5.5, §5.7, §5.9). `window` is the
/// supervisor's stabilization window; it is updated on every controller so a
/// new owner takes over with a warm window.
#[must_use]
pub fn plan_tick(input: &TickInput<'_>, window: &mut Window, cfg: &ScaleConfig) -> TickPlan {
    let f = input.function;
    let mut decision = desire(f, input.heartbeat, input.instances, input.now, cfg);
    let running_for = elapsed(input.now, input.started_at);

    if f.is_oneshot() {
        if decision.reason == ScaleReason::HeartbeatTimeout && running_for >= cfg.heartbeat_timeout {
            let delete = if input.owner {
                input.instances.iter().map(|i| i.name.clone()).collect()
            } else {
                Vec::new()
            };
            return TickPlan::OneshotCleanup { delete };
        }
        return TickPlan::Idle {
            decision,
            stop: false,
        };
    }

    let max_rec = window.record(decision.desired, input.now, cfg.downscale_stabilization);
    let current = u32::try_from(input.instances.len()).unwrap_or(u32::MAX);
    let scaling_down = decision.desired < current || decision.desired == 0;
    let mut stop = false;
    if scaling_down {
        if running_for < cfg.protection_period() {
            return TickPlan::Idle {
                decision,
                stop: false,
            };
        }
        if decision.desired == 0 {
            stop = true;
        } else {
            decision.desired = current.min(max_rec);
        }
    }
    if !input.owner {
        return TickPlan::Idle { decision, stop };
    }
    let event = (scaling_down && decision.desired == 0 && current > 0).then(|| {
        if decision.reason == ScaleReason::HeartbeatTimeout {
            PlannedEvent::new(
                EventType::HeartbeatTimeout,
                EventSeverity::Warn,
                "heartbeat timeout, scaling to 0",
            )
        } else {
            PlannedEvent::new(EventType::ScaleDown, EventSeverity::Warn, "scaling to 0")
        }
    });
    let stuck_after = cfg.assign_timeout * 2;
    let stuck = input
        .instances
        .iter()
        .filter(|i| i.ready_at.is_none() && elapsed(input.now, i.assigned_at) > stuck_after)
        .map(|i| i.name.clone())
        .collect();
    TickPlan::Act {
        decision,
        event,
        stuck,
        replace_stale: !scaling_down,
        stop,
    }
}

/// Why a ready instance is replaced one for one (spec §5.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// Its ReplicaSet was scaled to zero or is gone (a rollout of the pool).
    RetiredReplicaSet,
    /// It was assigned with other metadata (or for another identity): what
    /// a pod receives at assignment is no longer what the function says.
    Assignment,
}

/// Whether an instance assigned for `assigned` must be replaced now that the
/// function is `current`. Only ready instances are replaced (an unready one
/// is the stuck-instance rule's). A change of the scale settings alone never
/// replaces: they ride on every request's header, and they only move the
/// supervisor's targets, which need no new pod.
#[must_use]
pub fn staleness(assigned: &Function, current: &Function, ready: bool, retired: bool) -> Option<Stale> {
    if !ready {
        None
    } else if retired {
        Some(Stale::RetiredReplicaSet)
    } else if !assigned.same_assignment(current) {
        Some(Stale::Assignment)
    } else {
        None
    }
}

/// What executing a decision over the current instances does (spec §5.6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// Already at the desired count with nothing unready.
    Noop,
    /// Scale-up refused: `max_instances + 1` instances exist already.
    TooMany,
    /// Assign `count` new pods (the unready ones are kept).
    ScaleUp { count: u32 },
    /// A `NO_READY_INSTANCES` request found ready instances: never scale down.
    Guarded,
    /// Delete these, in order: every unready instance, then the oldest ready
    /// ones until `desired` remain.
    ScaleDown { delete: Vec<String> },
}

/// Decides how to execute `decision` over `instances` (spec §5.6).
#[must_use]
pub fn execute(f: &Function, decision: &Decision, instances: &[Observed]) -> Execution {
    let mut ready: Vec<&Observed> = instances.iter().filter(|i| i.ready_at.is_some()).collect();
    let unready: Vec<&Observed> = instances.iter().filter(|i| i.ready_at.is_none()).collect();
    let n_ready = u32::try_from(ready.len()).unwrap_or(u32::MAX);
    let total = u32::try_from(instances.len()).unwrap_or(u32::MAX);
    let desired = decision.desired;
    if desired == n_ready && unready.is_empty() {
        return Execution::Noop;
    }
    if desired > n_ready {
        if total >= f.scale_or_default().max_instances().saturating_add(1) {
            return Execution::TooMany;
        }
        return Execution::ScaleUp {
            count: desired - n_ready,
        };
    }
    if decision.reason == ScaleReason::NoReadyInstances {
        return Execution::Guarded;
    }
    let mut delete: Vec<String> = unready.iter().map(|i| i.name.clone()).collect();
    // Newest first; delete from the oldest end until `desired` remain.
    ready.sort_by_key(|i| std::cmp::Reverse(i.assigned_at));
    let keep = desired as usize;
    delete.extend(ready.iter().skip(keep).rev().map(|i| i.name.clone()));
    Execution::ScaleDown { delete }
}

#[cfg(test)]
mod tests;
