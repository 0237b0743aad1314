//! Kubernetes writes as client spans: a tower layer on the controller's
//! API client that, while traces are exported, wraps every request other
//! than a read (`POST`, `PUT`, `PATCH`, `DELETE`) in a span named
//! `kubernetes <METHOD> <resource>` and sends its context in `traceparent`.
//! Reads and watches pass through untouched.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::Instrument as _;

use crate::telemetry::otel;

/// The layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer;

impl<S> tower::Layer<S> for TraceLayer {
    type Service = Traced<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Traced { inner }
    }
}

/// A service that traces writes.
#[derive(Debug, Clone)]
pub struct Traced<S> {
    inner: S,
}

/// The resource a request path names: `/api/v1/namespaces/ns/pods/p` →
/// `pods`, `/apis/apps/v1/namespaces/ns/deployments/d/scale` →
/// `deployments/scale`, `/api/v1/namespaces/ns` → `namespaces`.
#[must_use]
pub fn resource(path: &str) -> String {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // Skip the group/version prefix: `api/v1` or `apis/<group>/<version>`.
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..).unwrap_or_default(),
        Some(&"apis") => segments.get(3..).unwrap_or_default(),
        _ => return String::new(),
    };
    let rest = match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    match rest {
        [kind] | [kind, _] => (*kind).to_owned(),
        [kind, _, sub, ..] => format!("{kind}/{sub}"),
        [] => String::new(),
    }
}

impl<S, B, RB> tower::Service<http::Request<B>> for Traced<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let write = !matches!(*req.method(), http::Method::GET | http::Method::HEAD);
        if !(write && otel::enabled()) {
            return Box::pin(self.inner.call(req));
        }
        let span = tracing::info_span!(
            "kubernetes.write",
            otel.name = %format_args!("kubernetes {} {}", req.method(), resource(req.uri().path())),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            http.request.method = %req.method(),
            url.path = req.uri().path(),
            http.response.status_code = tracing::field::Empty,
        );
        span.in_scope(|| otel::inject_http(req.headers_mut()));
        let call = self.inner.call(req);
        let recorded = span.clone();
        Box::pin(
            async move {
                let resp = call.await;
                match &resp {
                    Ok(r) => {
                        recorded.record("http.response.status_code", r.status().as_u16());
                        if r.status().is_server_error() {
                            recorded.record("otel.status_code", "ERROR");
                        }
                    }
                    Err(_) => {
                        recorded.record("otel.status_code", "ERROR");
                    }
                }
                resp
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::resource;

    #[test]
    fn resources_are_read_from_api_paths() {
        for (path, want) in [
            ("/api/v1/namespaces/ns/pods/p", "pods"),
            ("/api/v1/namespaces/ns/pods", "pods"),
            ("/api/v1/namespaces/ns/pods/p/eviction", "pods/eviction"),
            (
                "/apis/apps/v1/namespaces/ns/deployments/d/scale",
                "deployments/scale",
            ),
            ("/api/v1/namespaces/ns/events", "events"),
            ("/api/v1/namespaces/ns", "namespaces"),
            ("/api/v1/nodes/n", "nodes"),
            ("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", "leases"),
            ("/version", ""),
        ] {
            assert_eq!(resource(path), want, "{path}");
        }
    }
}
