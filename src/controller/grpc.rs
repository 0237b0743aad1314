//! `skipper.ControllerService`: decode, delegate to [`Core`], encode. Errors
//! become `tonic::Status` through the one mapping in [`super::error`].
//! [`AuthLayer`] authenticates every call before it reaches the service.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::auth::Authenticator;
use super::core::Core;
use super::error::Error;
use super::peers::forwarded_hops;
use super::supervisor::converge::Decision;
use crate::api::{self, ScaleReason};
use crate::domain::ASSIGN_TIMING_METADATA;
use crate::telemetry::otel;

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct Service {
    core: Arc<Core>,
}

impl Service {
    /// A service over `core`.
    #[must_use]
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }

    /// The caller's deadline (`grpc-timeout`) less a small margin, so the
    /// caller receives this controller's answer rather than its own
    /// timeout; capped at twice the assign timeout so no request waits
    /// without bound.
    fn deadline<T>(&self, req: &Request<T>) -> Instant {
        let cap = self.core.config.scale.assign_timeout * 2;
        let asked = req
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .map_or(cap, |d| d.saturating_sub((d / 10).min(Duration::from_millis(50))));
        Instant::now() + asked.min(cap)
    }
}

/// Parses a `grpc-timeout` header value (`100m`, `5S`, ...).
#[must_use]
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 {
        return None;
    }
    let (num, unit) = v.split_at(v.len() - 1);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[tonic::async_trait]
impl api::controller_service_server::ControllerService for Service {
    async fn get_instance(
        &self,
        request: Request<api::GetInstanceRequest>,
    ) -> Result<Response<api::GetInstanceResponse>, Status> {
        let span = server_span("GetInstance", request.metadata());
        let answer = async {
            let deadline = self.deadline(&request);
            let req = request.into_inner();
            let f = self.core.admit(req.function.as_ref())?;
            let instance = self
                .core
                .get_instance(f, &req.exclude_instance_names, deadline)
                .await?;
            span.record("has_instances", instance.assign_timing.is_none());
            let mut resp = Response::new(api::GetInstanceResponse {
                instance: Some(instance.to_api()),
            });
            with_timing(&mut resp, std::iter::once(&instance));
            Ok(resp)
        }
        .instrument(span.clone())
        .await;
        finish(&span, answer)
    }

    async fn heartbeat(
        &self,
        request: Request<api::HeartbeatRequest>,
    ) -> Result<Response<api::HeartbeatResponse>, Status> {
        self.core.heartbeat(request.into_inner()).await?;
        Ok(Response::new(api::HeartbeatResponse {}))
    }

    async fn scale(
        &self,
        request: Request<api::ScaleRequest>,
    ) -> Result<Response<api::ScaleResponse>, Status> {
        let span = server_span("Scale", request.metadata());
        let answer = self.scale_traced(request).instrument(span.clone()).await;
        finish(&span, answer)
    }

    async fn release_instance(
        &self,
        request: Request<api::ReleaseInstanceRequest>,
    ) -> Result<Response<api::ReleaseInstanceResponse>, Status> {
        self.core.release(request.into_inner().instance.as_ref()).await?;
        Ok(Response::new(api::ReleaseInstanceResponse {}))
    }

    type WatchInstancesStream = super::watch::ResponseStream;

    async fn watch_instances(
        &self,
        request: Request<tonic::Streaming<api::WatchInstancesRequest>>,
    ) -> Result<Response<Self::WatchInstancesStream>, Status> {
        super::watch::serve(self.core.clone(), request).await
    }

    async fn get_cluster_state(
        &self,
        request: Request<api::GetClusterStateRequest>,
    ) -> Result<Response<api::GetClusterStateResponse>, Status> {
        let local_only = request.into_inner().local_only.unwrap_or(false);
        let state = self.core.cluster_state(local_only).await;
        Ok(Response::new(api::GetClusterStateResponse {
            cluster_state: Some(state),
        }))
    }
}

impl Service {
    async fn scale_traced(
        &self,
        request: Request<api::ScaleRequest>,
    ) -> Result<Response<api::ScaleResponse>, Status> {
        let deadline = self.deadline(&request);
        let hops = forwarded_hops(&request);
        let req = request.into_inner();
        let f = self.core.admit(req.function.as_ref())?;
        let reason = req
            .reason
            .and_then(|r| ScaleReason::try_from(r).ok())
            .unwrap_or(ScaleReason::Unspecified);
        let decision = Decision::new(req.desired_instances.unwrap_or(0), reason);
        let instances = self.core.scale(f, decision, deadline, hops).await?;
        let mut resp = Response::new(api::ScaleResponse {
            instances: instances.iter().map(super::kube::Instance::to_api).collect(),
        });
        with_timing(&mut resp, instances.iter());
        Ok(resp)
    }
}

/// The server span of one call (`skipper.ControllerService/<method>`),
/// child of the caller's context from the request metadata; disabled when
/// traces are off.
fn server_span(method: &'static str, metadata: &tonic::metadata::MetadataMap) -> tracing::Span {
    if !otel::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %format_args!("skipper.ControllerService/{method}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "skipper.ControllerService",
        rpc.method = method,
        rpc.grpc.status_code = tracing::field::Empty,
        has_instances = tracing::field::Empty,
    );
    otel::set_remote_parent(&span, otel::extract_grpc(metadata));
    span
}

/// Records the call's status on its span.
fn finish<T>(span: &tracing::Span, answer: Result<T, Status>) -> Result<T, Status> {
    let code = match &answer {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    };
    span.record("rpc.grpc.status_code", code as i32);
    if matches!(
        code,
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Unavailable | tonic::Code::DataLoss
    ) {
        span.record("otel.status_code", "ERROR");
    }
    answer
}

/// Puts the timing of the assignment among `instances` (if one was made by
/// this call) into the answer's metadata.
fn with_timing<'a, T>(
    resp: &mut Response<T>,
    mut instances: impl Iterator<Item = &'a super::kube::Instance>,
) {
    let Some(t) = instances.find_map(|i| i.assign_timing.as_deref()) else {
        return;
    };
    if let Ok(v) = tonic::metadata::MetadataValue::try_from(t.encode()) {
        resp.metadata_mut().insert(ASSIGN_TIMING_METADATA, v);
    }
}

/// Puts an [`Authenticator`] in front of a gRPC service; a refused call is
/// answered with its [`AuthError`](super::auth::AuthError)'s status.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Arc<Authenticator>,
}

impl AuthLayer {
    /// A layer checking calls with `auth`.
    #[must_use]
    pub fn new(auth: Arc<Authenticator>) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticated {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// A gRPC service whose calls are authenticated first; the [`Caller`] is a
/// request extension.
#[derive(Debug, Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Arc<Authenticator>,
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<B>> for Authenticated<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // The clone is ready only after poll_ready; keep the ready one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let auth = self.auth.clone();
        Box::pin(async move {
            match auth.authenticate(req.headers()).await {
                Ok(caller) => {
                    req.extensions_mut().insert(caller);
                    inner.call(req).await
                }
                Err(e) => {
                    let status = Status::from(Error::from(e));
                    Ok(status.into_http())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("7x"), None);
        assert_eq!(parse_grpc_timeout("m"), None);
    }
}
