//! Prometheus metrics of the router (spec §8.1) and the `/metrics` endpoint
//! served on an already bound listener.
//!
//! The label is always the function's deployment: the tenant is never a label.
//! Only deployments a controller has served an instance for (so they exist)
//! get their own series, at most [`MAX_DEPLOYMENT_LABELS`] of them; any other
//! name a client sends counts under [`OTHER_DEPLOYMENT`].

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

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
    /// Deployments with series of their own. A std lock: a set lookup or
    /// insert, never across an await.
    known: Arc<RwLock<HashSet<String>>>,
}

impl Metrics {
    /// Registers every router metric in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            in_flight: Family::default(),
            heartbeats: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
            get_instance_duration: Family::new_with_constructor(|| Histogram::new(duration_buckets())),
            controller_calls: Family::default(),
            known: Arc::default(),
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
        m
    }

    /// Counts one controller RPC made for a request.
    pub fn controller_call(&self, method: &'static str) {
        self.controller_calls.get_or_create(&MethodLabel { method }).inc();
    }
}

impl Metrics {
    /// The label of `deployment`: its own name once [`Metrics::learn`] has
    /// seen it, else [`OTHER_DEPLOYMENT`].
    #[must_use]
    pub fn deployment(&self, deployment: &str) -> DeploymentLabel {
        let known = self
            .known
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(deployment);
        DeploymentLabel {
            function_deployment: if known { deployment } else { OTHER_DEPLOYMENT }.to_owned(),
        }
    }

    /// Gives `deployment` series of its own (a controller served an
    /// instance of it), while fewer than [`MAX_DEPLOYMENT_LABELS`] have them.
    pub fn learn(&self, deployment: &str) {
        if self
            .known
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(deployment)
        {
            return;
        }
        let mut known = self
            .known
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if known.len() < MAX_DEPLOYMENT_LABELS {
            known.insert(deployment.to_owned());
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
        let m = Metrics::register(&mut Registry::default());
        assert_eq!(m.deployment("made-up").function_deployment, OTHER_DEPLOYMENT);
        m.learn("app");
        assert_eq!(m.deployment("app").function_deployment, "app");
        for i in 0..2 * MAX_DEPLOYMENT_LABELS {
            m.learn(&format!("d{i}"));
        }
        assert_eq!(m.deployment("app").function_deployment, "app");
        assert_eq!(
            m.deployment(&format!("d{}", 2 * MAX_DEPLOYMENT_LABELS - 1))
                .function_deployment,
            OTHER_DEPLOYMENT
        );
    }
}
