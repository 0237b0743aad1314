//! Prometheus metrics of the router (spec §8.1) and the `/metrics` endpoint
//! served on an already bound listener.
//!
//! The label is always the function's deployment: the tenant is never a label.
//! Only deployments a controller has served an instance for (so they exist)
//! get their own series, at most [`MAX_DEPLOYMENT_LABELS`] of them; any other
//! name a client sends counts under [`OTHER_DEPLOYMENT`].

use std::collections::HashSet;
use std::sync::{Arc, OnceLock, RwLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::shutdown::Shutdown;

/// Most distinct `function_deployment` label values.
pub const MAX_DEPLOYMENT_LABELS: usize = 512;
/// The label value of deployments without a series of their own.
pub const OTHER_DEPLOYMENT: &str = "other";

/// `function_deployment` label.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DeploymentLabel {
    pub function_deployment: String,
}

/// Labels of the request duration histogram.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DurationLabels {
    pub function_deployment: String,
    /// `2xx`, `3xx`, `4xx`, `5xx` (or `1xx` for upgrades).
    pub status_class: String,
}

/// `method` label of controller calls.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: &'static str,
}

/// Help strings (prometheus-client appends the final period).
const HELP_REQUESTS: &str = "Total requests processed by the router";
const HELP_IN_FLIGHT: &str = "Requests currently being handled by the router";
const HELP_HEARTBEATS: &str = "Heartbeats sent to the controller";
const HELP_CONTROLLER_CALLS: &str = "Controller RPCs made to serve requests (GetInstance, ReleaseInstance), by method; zero while tables are warm";
const HELP_DURATION: &str =
    "Time from a request's arrival to the response headers, by deployment and status class";
const HELP_GET_INSTANCE_DURATION: &str =
    "Time a GetInstance call took to give a request an instance (cold starts), by deployment";

/// Duration buckets in seconds: 1 ms to about 65 s.
fn duration_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

/// The router's metric handles. Cloning shares them.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub requests: Family<DeploymentLabel, Counter>,
    pub in_flight: Family<DeploymentLabel, Gauge>,
    pub heartbeats: Family<DeploymentLabel, Counter>,
    pub duration: Family<DurationLabels, Histogram>,
    pub get_instance_duration: Family<DeploymentLabel, Histogram>,
    pub controller_calls: Family<MethodLabel, Counter>,
    /// Requests waiting for an instance now (cold starts, retries through
    /// the controller, queues under a concurrency limit).
    pub waiting: Gauge,
    /// Requests answered 503 at once instead of waiting, by reason.
    pub refused: Family<ReasonLabel, Counter>,
    /// Deployments with series of their own. A std lock: a set lookup or
    /// insert, never across an await.
    known: Arc<RwLock<HashSet<String>>>,
    /// The series of deployments without their own.
    other: Series,
}

/// `reason` label of refused requests.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// The series of one `function_deployment` label, each resolved on its
/// first use and then kept by the function that counts in it (handles
/// share the values, so no label is hashed per request).
#[derive(Debug, Clone)]
pub struct Series {
    families: Families,
    deployment: Arc<str>,
    requests: OnceLock<Counter>,
    in_flight: OnceLock<Gauge>,
    heartbeats: OnceLock<Counter>,
    get_instance_duration: OnceLock<Histogram>,
    /// By status class: `1xx` to `5xx`.
    durations: [OnceLock<Histogram>; 5],
}

/// The families a [`Series`] draws from.
#[derive(Debug, Clone)]
struct Families {
    requests: Family<DeploymentLabel, Counter>,
    in_flight: Family<DeploymentLabel, Gauge>,
    heartbeats: Family<DeploymentLabel, Counter>,
    duration: Family<DurationLabels, Histogram>,
    get_instance_duration: Family<DeploymentLabel, Histogram>,
}

impl Series {
    fn label(&self) -> DeploymentLabel {
        DeploymentLabel {
            function_deployment: self.deployment.to_string(),
        }
    }

    /// `skipper_router_requests_total`.
    pub fn requests(&self) -> &Counter {
        self.requests
            .get_or_init(|| self.families.requests.get_or_create(&self.label()).clone())
    }

    /// `skipper_router_requests_in_flight`.
    pub fn in_flight(&self) -> &Gauge {
        self.in_flight
            .get_or_init(|| self.families.in_flight.get_or_create(&self.label()).clone())
    }

    /// `skipper_router_heartbeats_total`.
    pub fn heartbeats(&self) -> &Counter {
        self.heartbeats
            .get_or_init(|| self.families.heartbeats.get_or_create(&self.label()).clone())
    }

    /// `skipper_router_get_instance_duration_seconds`.
    pub fn get_instance_duration(&self) -> &Histogram {
        self.get_instance_duration.get_or_init(|| {
            self.families
                .get_instance_duration
                .get_or_create(&self.label())
                .clone()
        })
    }

    /// The duration histogram of `status`'s class.
    pub fn duration(&self, status: http::StatusCode) -> &Histogram {
        let class = usize::from((status.as_u16() / 100).clamp(1, 5));
        self.durations[class - 1].get_or_init(|| {
            self.families
                .duration
                .get_or_create(&DurationLabels {
                    function_deployment: self.deployment.to_string(),
                    status_class: status_class(status).to_owned(),
                })
                .clone()
        })
    }
}

const HELP_WAITING: &str = "Requests waiting for an instance (cold starts, retries through the controller, queues under a concurrency limit)";
const HELP_REFUSED: &str =
    "Requests answered 503 at once because too many requests wait for instances, by reason";

impl Metrics {
    /// Registers every router metric in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let families = Families {
            requests: Family::default(),
            in_flight: Family::default(),
            heartbeats: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
            get_instance_duration: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
        };
        let m = Self {
            requests: families.requests.clone(),
            in_flight: families.in_flight.clone(),
            heartbeats: families.heartbeats.clone(),
            duration: families.duration.clone(),
            get_instance_duration: families.get_instance_duration.clone(),
            controller_calls: Family::default(),
            waiting: Gauge::default(),
            refused: Family::default(),
            known: Arc::default(),
            other: Series::new(families, OTHER_DEPLOYMENT),
        };
        registry.register("skipper_router_requests", HELP_REQUESTS, m.requests.clone());
        registry.register(
            "skipper_router_requests_in_flight",
            HELP_IN_FLIGHT,
            m.in_flight.clone(),
        );
        registry.register("skipper_router_heartbeats", HELP_HEARTBEATS, m.heartbeats.clone());
        registry.register(
            "skipper_router_request_duration_seconds",
            HELP_DURATION,
            m.duration.clone(),
        );
        registry.register(
            "skipper_router_get_instance_duration_seconds",
            HELP_GET_INSTANCE_DURATION,
            m.get_instance_duration.clone(),
        );
        registry.register(
            "skipper_router_controller_calls",
            HELP_CONTROLLER_CALLS,
            m.controller_calls.clone(),
        );
        registry.register("skipper_router_requests_waiting", HELP_WAITING, m.waiting.clone());
        registry.register("skipper_router_requests_refused", HELP_REFUSED, m.refused.clone());
        m
    }

    /// Counts one controller RPC made for a request.
    pub fn controller_call(&self, method: &'static str) {
        self.controller_calls.get_or_create(&MethodLabel { method }).inc();
    }

    /// Counts one request refused for `reason`.
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// The series of deployments without their own ([`OTHER_DEPLOYMENT`]).
    #[must_use]
    pub fn other(&self) -> &Series {
        &self.other
    }

    /// The series of `deployment`'s own label (whether or not it is known).
    #[must_use]
    pub fn series(&self, deployment: &str) -> Series {
        Series::new(self.other.families.clone(), deployment)
    }

    /// Whether `deployment` has series of its own.
    #[must_use]
    pub fn is_known(&self, deployment: &str) -> bool {
        self.known
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(deployment)
    }

    /// Gives `deployment` series of its own (a controller served an
    /// instance of it), while fewer than [`MAX_DEPLOYMENT_LABELS`] have
    /// them; whether it has them now.
    pub fn learn(&self, deployment: &str) -> bool {
        if self.is_known(deployment) {
            return true;
        }
        let mut known = self
            .known
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if known.len() < MAX_DEPLOYMENT_LABELS {
            known.insert(deployment.to_owned());
            return true;
        }
        known.contains(deployment)
    }
}

impl Series {
    fn new(families: Families, deployment: &str) -> Self {
        Self {
            families,
            deployment: Arc::from(deployment),
            requests: OnceLock::new(),
            in_flight: OnceLock::new(),
            heartbeats: OnceLock::new(),
            get_instance_duration: OnceLock::new(),
            durations: Default::default(),
        }
    }
}

/// The status class label of a status code.
#[must_use]
pub fn status_class(status: http::StatusCode) -> &'static str {
    match status.as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// Renders `registry` in the Prometheus text format.
#[must_use]
pub fn render(registry: &Registry) -> String {
    let mut body = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, registry) {
        body = format!("# encoding metrics failed: {e}\n");
    }
    body
}

/// Serves `registry` on `listener` `/metrics` until shutdown (tracked task).
pub fn serve(listener: tokio::net::TcpListener, registry: Arc<Registry>, shutdown: &Shutdown) {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                (
                    [(
                        http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    render(&registry),
                )
            }
        }),
    );
    let token = shutdown.token().clone();
    shutdown.spawn("router-metrics", async move {
        if let Err(e) = axum::serve(crate::net::http_listener(listener), app)
            .with_graceful_shutdown(token.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_help_strings_match_the_contract() {
        let mut r = Registry::default();
        let m = Metrics::register(&mut r);
        let label = DeploymentLabel {
            function_deployment: "app".into(),
        };
        m.requests.get_or_create(&label).inc();
        m.in_flight.get_or_create(&label).inc();
        m.heartbeats.get_or_create(&label).inc();
        m.controller_call("GetInstance");
        m.get_instance_duration.get_or_create(&label).observe(0.2);
        let text = render(&r);
        for line in text.lines().filter(|l| l.starts_with("# HELP")) {
            assert!(
                line.ends_with('.') && !line.ends_with(".."),
                "one final period: {line}"
            );
        }
        for line in [
            "# HELP skipper_router_requests Total requests processed by the router.",
            "skipper_router_requests_total{function_deployment=\"app\"} 1",
            "# HELP skipper_router_requests_in_flight Requests currently being handled by the router.",
            "skipper_router_requests_in_flight{function_deployment=\"app\"} 1",
            "# HELP skipper_router_heartbeats Heartbeats sent to the controller.",
            "skipper_router_heartbeats_total{function_deployment=\"app\"} 1",
            "skipper_router_controller_calls_total{method=\"GetInstance\"} 1",
            "# HELP skipper_router_get_instance_duration_seconds Time a GetInstance call took to give a request an instance (cold starts), by deployment.",
            "skipper_router_get_instance_duration_seconds_count{function_deployment=\"app\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn status_classes() {
        assert_eq!(status_class(http::StatusCode::SWITCHING_PROTOCOLS), "1xx");
        assert_eq!(status_class(http::StatusCode::OK), "2xx");
        assert_eq!(status_class(http::StatusCode::NOT_FOUND), "4xx");
        assert_eq!(status_class(http::StatusCode::BAD_GATEWAY), "5xx");
    }
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn only_learned_deployments_get_series_and_their_number_is_bounded() {
        let mut r = Registry::default();
        let m = Metrics::register(&mut r);
        assert!(!m.is_known("made-up"));
        assert!(m.learn("app"));
        assert!(m.is_known("app"));
        for i in 0..2 * MAX_DEPLOYMENT_LABELS {
            m.learn(&format!("d{i}"));
        }
        assert!(m.is_known("app"));
        assert!(!m.learn(&format!("d{}", 2 * MAX_DEPLOYMENT_LABELS - 1)));
        // Series appear on first use, each class of the histogram on its own.
        assert!(!render(&r).contains("function_deployment=\"other\""));
        let s = m.series("app");
        s.requests().inc();
        s.duration(http::StatusCode::NOT_FOUND).observe(0.01);
        let text = render(&r);
        assert!(
            text.contains("skipper_router_requests_total{function_deployment=\"app\"} 1"),
            "{text}"
        );
        assert!(text.contains("status_class=\"4xx\""), "{text}");
        assert!(!text.contains("status_class=\"2xx\""), "{text}");
        // Handles share the values.
        m.series("app").requests().inc();
        assert!(render(&r).contains("skipper_router_requests_total{function_deployment=\"app\"} 2"));
    }
}
