//! The controller's Prometheus metrics (spec §8.1): exact names, types,
//! labels and help strings. The label value is always the function's
//! deployment; the tenant is never a label.

use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Label set of per-function metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FunctionLabels {
    pub function_deployment: String,
}

/// Label set of failed assignments: the pod's HTTP status (`none` when it
/// did not answer) and a reason from a fixed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AssignFailureLabels {
    pub function_deployment: String,
    pub status: String,
    pub reason: &'static str,
}

/// Label set of per-function-namespace metrics (`namespace` is the
/// scraper's label for the controller's own).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FunctionNamespaceLabels {
    pub function_namespace: String,
}

/// Label set of refused heartbeat entries: which limit refused them.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeartbeatRefusedLabels {
    pub reason: &'static str,
}

/// Label set of refused calls: why the caller was not admitted.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthFailureLabels {
    pub reason: &'static str,
}

/// Label set of informer metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InformerLabels {
    pub resource: String,
    pub event: String,
}

fn lag_histogram() -> Histogram {
    Histogram::new([
        0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
    ])
}

/// Every controller metric.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub waiting_for_unassigned_pods: Family<FunctionLabels, Gauge>,
    pub assignments_total: Family<FunctionLabels, Counter>,
    pub scale_ups_total: Family<FunctionLabels, Counter>,
    pub scale_downs_total: Family<FunctionLabels, Counter>,
    pub informer_events_total: Family<InformerLabels, Counter>,
    pub informer_event_lag_seconds: Family<InformerLabels, Histogram>,
    pub informer_last_event_time_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub heartbeats_total: Family<FunctionLabels, Counter>,
    pub assignment_failures_total: Family<AssignFailureLabels, Counter>,
    pub heartbeats_refused_total: Family<HeartbeatRefusedLabels, Counter>,
    pub authentication_failures_total: Family<AuthFailureLabels, Counter>,
    pub ring_members: Gauge,
    pub function_namespace_ready: Family<FunctionNamespaceLabels, Gauge>,
    pub instances: Family<FunctionLabels, Gauge>,
    pub assignment_backoff_seconds: Family<FunctionLabels, Gauge>,
    pub supervisors: SupervisorCount,
}

/// `skipper_controller_supervisors`: read from the supervisor registry when
/// scraped (bound once the registry exists; 0 before).
#[derive(Clone, Default)]
pub struct SupervisorCount(Arc<OnceLock<Box<dyn Fn() -> usize + Send + Sync>>>);

impl std::fmt::Debug for SupervisorCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SupervisorCount").field(&self.get()).finish()
    }
}

impl SupervisorCount {
    /// Reads the count from `source` from now on (the first binding stays).
    pub fn bind(&self, source: impl Fn() -> usize + Send + Sync + 'static) {
        let _ = self.0.set(Box::new(source));
    }

    /// The current count.
    #[must_use]
    pub fn get(&self) -> usize {
        self.0.get().map_or(0, |source| source())
    }
}

impl Collector for SupervisorCount {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let (name, help) = DESCRIPTIONS[15];
        let g = ConstGauge::new(i64::try_from(self.get()).unwrap_or(i64::MAX));
        g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
    }
}

/// `(name without the skipper_controller_ prefix, help)` of every metric, in
/// registration order.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        "waiting_for_unassigned_pods",
        "Functions blocked waiting for pod assignment.",
    ),
    (
        "assignments",
        "Total pod assignments performed by the controller.",
    ),
    (
        "scale_ups",
        "Total scale-up operations performed by the controller.",
    ),
    (
        "scale_downs",
        "Total scale-down operations performed by the controller.",
    ),
    (
        "informer_events",
        "Kubernetes informer events processed by the controller.",
    ),
    (
        "informer_event_lag_seconds",
        "Lag between Kubernetes object change and informer processing (add and delete events only).",
    ),
    (
        "informer_last_event_time_seconds",
        "Unix timestamp of the last informer event processed.",
    ),
    ("heartbeats", "Heartbeats received from routers."),
    (
        "assignment_failures",
        "Assignments a pod refused or failed, by the pod's status and the reason.",
    ),
    (
        "heartbeats_refused",
        "Heartbeat entries refused: a router over its limit of active functions, or too many routers.",
    ),
    (
        "authentication_failures",
        "Calls refused before reaching the service: missing, malformed, refused or forbidden credentials.",
    ),
    (
        "ring_members",
        "Controllers in the hash ring as this controller sees it (0: no cold request can be served).",
    ),
    (
        "function_namespace_ready",
        "1 while this controller serves the function namespace, 0 while its watches are refused or unlisted.",
    ),
    (
        "instances",
        "Running assigned pods of the functions this controller owns on the ring, by deployment.",
    ),
    (
        "assignment_backoff_seconds",
        "Current back-off period of a deployment after consecutive failed assignments (0: not backing off).",
    ),
    ("supervisors", "Functions this controller runs a supervisor for."),
];

impl Metrics {
    /// Creates the metrics and registers them under `skipper_controller_`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            waiting_for_unassigned_pods: Family::default(),
            assignments_total: Family::default(),
            scale_ups_total: Family::default(),
            scale_downs_total: Family::default(),
            informer_events_total: Family::default(),
            informer_event_lag_seconds: Family::new_with_constructor(lag_histogram),
            informer_last_event_time_seconds: Gauge::default(),
            heartbeats_total: Family::default(),
            assignment_failures_total: Family::default(),
            heartbeats_refused_total: Family::default(),
            authentication_failures_total: Family::default(),
            ring_members: Gauge::default(),
            function_namespace_ready: Family::default(),
            instances: Family::default(),
            assignment_backoff_seconds: Family::default(),
            supervisors: SupervisorCount::default(),
        };
        let sub = registry
            .sub_registry_with_prefix("skipper")
            .sub_registry_with_prefix("controller");
        // prometheus-client appends the final period itself.
        let help = |i: usize| {
            let h = DESCRIPTIONS[i].1;
            h.strip_suffix('.').unwrap_or(h)
        };
        sub.register(DESCRIPTIONS[0].0, help(0), m.waiting_for_unassigned_pods.clone());
        sub.register(DESCRIPTIONS[1].0, help(1), m.assignments_total.clone());
        sub.register(DESCRIPTIONS[2].0, help(2), m.scale_ups_total.clone());
        sub.register(DESCRIPTIONS[3].0, help(3), m.scale_downs_total.clone());
        sub.register(DESCRIPTIONS[4].0, help(4), m.informer_events_total.clone());
        sub.register(DESCRIPTIONS[5].0, help(5), m.informer_event_lag_seconds.clone());
        sub.register(
            DESCRIPTIONS[6].0,
            help(6),
            m.informer_last_event_time_seconds.clone(),
        );
        sub.register(DESCRIPTIONS[7].0, help(7), m.heartbeats_total.clone());
        sub.register(DESCRIPTIONS[8].0, help(8), m.assignment_failures_total.clone());
        sub.register(DESCRIPTIONS[9].0, help(9), m.heartbeats_refused_total.clone());
        sub.register(
            DESCRIPTIONS[10].0,
            help(10),
            m.authentication_failures_total.clone(),
        );
        sub.register(DESCRIPTIONS[11].0, help(11), m.ring_members.clone());
        sub.register(DESCRIPTIONS[12].0, help(12), m.function_namespace_ready.clone());
        sub.register(DESCRIPTIONS[13].0, help(13), m.instances.clone());
        sub.register(DESCRIPTIONS[14].0, help(14), m.assignment_backoff_seconds.clone());
        sub.register_collector(Box::new(m.supervisors.clone()));
        m
    }

    /// A set registered nowhere (tests).
    #[must_use]
    pub fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    /// Labels for a function deployment.
    #[must_use]
    pub fn function(deployment: &str) -> FunctionLabels {
        FunctionLabels {
            function_deployment: deployment.to_owned(),
        }
    }

    /// Records one informer event; `lag` is observed for add and delete.
    pub fn informer_event(&self, resource: &str, event: &str, lag: Option<f64>) {
        let labels = InformerLabels {
            resource: resource.to_owned(),
            event: event.to_owned(),
        };
        self.informer_events_total.get_or_create(&labels).inc();
        if let Some(lag) = lag {
            self.informer_event_lag_seconds
                .get_or_create(&labels)
                .observe(lag.max(0.0));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        self.informer_last_event_time_seconds.set(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_exact_names_and_help() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.assignments_total.get_or_create(&Metrics::function("dep")).inc();
        m.waiting_for_unassigned_pods
            .get_or_create(&Metrics::function("dep"))
            .set(1);
        m.informer_event("pods", "add", Some(0.1));
        m.heartbeats_total.get_or_create(&Metrics::function("dep")).inc();
        m.supervisors.bind(|| 3);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        // The help texts exactly, one period at the end (families with a
        // series are encoded).
        for (name, help) in DESCRIPTIONS.iter().filter(|(n, _)| {
            [
                "assignments",
                "waiting_for_unassigned_pods",
                "informer_events",
                "heartbeats",
            ]
            .contains(n)
        }) {
            let line = format!("# HELP skipper_controller_{name} {help}\n");
            assert!(out.contains(&line), "missing {line:?} in\n{out}");
        }
        for line in [
            "# HELP skipper_controller_assignments Total pod assignments performed by the controller.",
            "# TYPE skipper_controller_assignments counter",
            "skipper_controller_assignments_total{function_deployment=\"dep\"} 1",
            "skipper_controller_waiting_for_unassigned_pods{function_deployment=\"dep\"} 1",
            "# TYPE skipper_controller_informer_event_lag_seconds histogram",
            "skipper_controller_informer_events_total{resource=\"pods\",event=\"add\"} 1",
            "skipper_controller_heartbeats_total{function_deployment=\"dep\"} 1",
            "# HELP skipper_controller_supervisors Functions this controller runs a supervisor for.",
            "# TYPE skipper_controller_supervisors gauge",
            "skipper_controller_supervisors 3",
            "# HELP skipper_controller_informer_last_event_time_seconds Unix timestamp of the last informer event processed.",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        for (_, help) in DESCRIPTIONS {
            assert!(help.len() <= 120 && help.ends_with('.'));
        }
        for line in out.lines().filter(|l| l.starts_with("# HELP")) {
            assert!(
                line.ends_with('.') && !line.ends_with(".."),
                "one final period: {line}"
            );
        }
    }
}
