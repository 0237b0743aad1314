//! `metrics.k8s.io/v1beta1` as an aggregated API, the way metrics-server
//! serves it to a real control plane: an HTTPS server that kube-apiserver's
//! aggregation layer proxies to, and its registration (a Service without
//! selector and an `APIService` whose `caBundle` trusts the server).
//!
//! kube-apiserver authenticates and authorizes the caller (RBAC on
//! `pods.metrics.k8s.io`) before it proxies; this server accepts only
//! connections that present the front proxy's client certificate (signed
//! by the front-proxy CA, one of the allowed names) and that name the
//! caller in `X-Remote-User`, as an extension API server's requestheader
//! authentication does.
//!
//! The control plane has no kube-proxy and EndpointSlices refuse loopback
//! addresses, so the Service is an `ExternalName` for `localhost` on the
//! server's port: the aggregation layer checks no endpoints for it and
//! dials `localhost:<port>` with the Service's DNS name as TLS server name.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::pki::{Ca, CertKey, PkiError};
use super::selector::LabelSelector;

/// The group and version served.
pub const GROUP_VERSION: &str = "metrics.k8s.io/v1beta1";
/// The `APIService` name.
pub const API_SERVICE: &str = "v1beta1.metrics.k8s.io";

/// The usage of one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerUsage {
    pub name: String,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

/// The latest usage of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUsage {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// When it was sampled (RFC 3339).
    pub timestamp: String,
    /// The interval the CPU figure covers.
    pub window: Duration,
    pub containers: Vec<ContainerUsage>,
}

/// Where the served figures come from (the node agent's samples).
pub trait UsageSource: Send + Sync + 'static {
    /// The pods of `namespace` (every namespace when `None`) that have a sample.
    fn pods(&self, namespace: Option<&str>) -> Vec<PodUsage>;
}

/// Why the metrics API could not be served or registered.
#[derive(Debug, thiserror::Error)]
pub enum MetricsApiError {
    #[error("key material: {0}")]
    Pki(#[from] PkiError),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("creating {what}: {source}")]
    Create { what: String, source: Box<kube::Error> },
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the APIService {API_SERVICE} did not become Available in {0:?}: {1}")]
    NotAvailable(Duration, String),
}

/// Who may call: the front proxy's CA and the names its client certificate may carry.
#[derive(Debug, Clone)]
pub struct FrontProxy {
    /// The front-proxy CA (kube-apiserver's `--requestheader-client-ca-file`).
    pub ca_pem: String,
    /// Allowed common names (`--requestheader-allowed-names`); empty allows any.
    pub allowed_names: Vec<String>,
}

fn pem_der(pem: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE-----"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    base64::engine::general_purpose::STANDARD.decode(body).ok()
}

/// TLS for the server: `serving` as its certificate, clients must present a
/// certificate from the front-proxy CA.
///
/// # Errors
/// [`MetricsApiError::Tls`] when the material is unusable.
pub fn tls_config(
    serving: &CertKey,
    front_proxy: &FrontProxy,
) -> Result<Arc<rustls::ServerConfig>, MetricsApiError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let ca = pem_der(&front_proxy.ca_pem)
        .ok_or_else(|| MetricsApiError::Tls("the front-proxy CA is not PEM".into()))?;
    roots
        .add(CertificateDer::from(ca))
        .map_err(|e| MetricsApiError::Tls(e.to_string()))?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .map_err(|e| MetricsApiError::Tls(e.to_string()))?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(serving.key_der.clone()));
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| MetricsApiError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![CertificateDer::from(serving.cert_der.clone())], key)
        .map_err(|e| MetricsApiError::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

struct AppState {
    source: Arc<dyn UsageSource>,
    allowed_names: Vec<String>,
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    (
        code,
        axum::Json(
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": message, "reason": reason, "code": code.as_u16()}),
        ),
    )
        .into_response()
}

/// The caller, as the front proxy names it (`None`: answer 401).
fn caller(
    state: &AppState,
    peer: Option<&super::auth::PeerCertificate>,
    headers: &HeaderMap,
) -> Option<String> {
    let proxy = peer?.0.as_ref()?.name.clone();
    if !state.allowed_names.is_empty() && !state.allowed_names.contains(&proxy) {
        return None;
    }
    headers
        .get("x-remote-user")
        .and_then(|v| v.to_str().ok())
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
}

fn unauthorized() -> Response {
    status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized")
}

fn pod_metrics(p: &PodUsage) -> Value {
    json!({
        "kind": "PodMetrics",
        "apiVersion": GROUP_VERSION,
        "metadata": {"name": p.name, "namespace": p.namespace, "labels": p.labels,
                     "creationTimestamp": p.timestamp},
        "timestamp": p.timestamp,
        "window": format!("{}s", p.window.as_secs().max(1)),
        "containers": p.containers.iter().map(|c| json!({"name": c.name, "usage": {
            "cpu": format!("{}m", c.cpu_millis),
            "memory": format!("{}Ki", c.memory_bytes / 1024),
        }})).collect::<Vec<_>>(),
    })
}

async fn list_pods(state: &AppState, ns: Option<&str>, query: &BTreeMap<String, String>) -> Response {
    let selector = match query.get("labelSelector").map(|s| LabelSelector::parse(s)) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e),
    };
    let items: Vec<Value> = state
        .source
        .pods(ns)
        .iter()
        .filter(|p| selector.as_ref().is_none_or(|s| s.matches(&p.labels)))
        .map(pod_metrics)
        .collect();
    axum::Json(json!({"kind": "PodMetricsList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": items}))
        .into_response()
}

type Shared = State<Arc<AppState>>;
type Peer = Option<axum::Extension<super::auth::PeerCertificate>>;

async fn resources(State(state): Shared, peer: Peer, headers: HeaderMap) -> Response {
    if caller(&state, peer.as_deref(), &headers).is_none() {
        return unauthorized();
    }
    axum::Json(json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION,
        "resources": [
            {"name": "nodes", "singularName": "", "namespaced": false, "kind": "NodeMetrics", "verbs": ["get", "list"]},
            {"name": "pods", "singularName": "", "namespaced": true, "kind": "PodMetrics", "verbs": ["get", "list"]},
        ],
    }))
    .into_response()
}

async fn all_pods(
    State(state): Shared,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if caller(&state, peer.as_deref(), &headers).is_none() {
        return unauthorized();
    }
    list_pods(&state, None, &q).await
}

async fn namespace_pods(
    State(state): Shared,
    peer: Peer,
    headers: HeaderMap,
    Path(ns): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if caller(&state, peer.as_deref(), &headers).is_none() {
        return unauthorized();
    }
    list_pods(&state, Some(&ns), &q).await
}

async fn one_pod(
    State(state): Shared,
    peer: Peer,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    if caller(&state, peer.as_deref(), &headers).is_none() {
        return unauthorized();
    }
    match state.source.pods(Some(&ns)).iter().find(|p| p.name == name) {
        Some(p) => axum::Json(pod_metrics(p)).into_response(),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("podmetrics.metrics.k8s.io \"{name}\" not found"),
        ),
    }
}

async fn nodes(State(state): Shared, peer: Peer, headers: HeaderMap) -> Response {
    if caller(&state, peer.as_deref(), &headers).is_none() {
        return unauthorized();
    }
    axum::Json(json!({"kind": "NodeMetricsList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": []}))
        .into_response()
}

/// The HTTP routes of the aggregated API.
pub fn router(source: Arc<dyn UsageSource>, front_proxy: &FrontProxy) -> axum::Router {
    let state = Arc::new(AppState {
        source,
        allowed_names: front_proxy.allowed_names.clone(),
    });
    axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/apis/metrics.k8s.io/v1beta1", axum::routing::get(resources))
        .route("/apis/metrics.k8s.io/v1beta1/pods", axum::routing::get(all_pods))
        .route("/apis/metrics.k8s.io/v1beta1/nodes", axum::routing::get(nodes))
        .route(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods",
            axum::routing::get(namespace_pods),
        )
        .route(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{name}",
            axum::routing::get(one_pod),
        )
        .with_state(state)
}

/// Where and how [`register_and_serve`] registers the API.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The Service's namespace (metrics-server uses `kube-system`).
    pub namespace: String,
    /// The Service's name.
    pub service: String,
    /// The port on `127.0.0.1` (`0` picks one).
    pub port: u16,
    /// Who may call.
    pub front_proxy: FrontProxy,
    /// How long the APIService may take to become Available.
    pub available_within: Duration,
}

/// A registered, serving metrics API.
#[derive(Debug)]
pub struct Registered {
    /// Where it listens.
    pub addr: SocketAddr,
}

/// Registers `metrics.k8s.io` with the cluster `client` talks to and serves
/// it from `source` until `stop`: it listens on `127.0.0.1:<port>` (`0`
/// picks one), creates a Service `namespace/service` of type `ExternalName`
/// (`localhost`, that port — the aggregation layer dials it without needing
/// endpoints, which may not be loopback addresses), a serving certificate
/// from a CA of its own for `<service>.<namespace>.svc`, and the
/// `APIService` trusting that CA; waits until the APIService is Available.
///
/// # Errors
/// [`MetricsApiError`].
pub async fn register_and_serve(
    client: &kube::Client,
    registration: &Registration,
    source: Arc<dyn UsageSource>,
    tracker: &tokio_util::task::TaskTracker,
    stop: &CancellationToken,
) -> Result<Registered, MetricsApiError> {
    let Registration {
        namespace,
        service,
        port,
        front_proxy,
        available_within,
    } = registration;
    let (port, available_within) = (*port, *available_within);
    // Listen first: the Service names the port.
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .map_err(|source| MetricsApiError::Listen {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| MetricsApiError::Listen {
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        source,
    })?;
    let ca = Ca::generate("skipper-metrics-ca")?;
    let serving = ca.issue_serving(
        "skipper-metrics",
        &[format!("{service}.{namespace}.svc"), "localhost".into()],
    )?;
    let tls = tls_config(&serving, front_proxy)?;
    let app = router(source, front_proxy);
    let stop_serving = stop.clone();
    tracker.spawn(super::https::serve(listener, tls, app, stop_serving));
    register(
        client,
        namespace,
        service,
        addr.port(),
        ca.cert_pem(),
        available_within,
    )
    .await?;
    Ok(Registered { addr })
}

/// Registers `metrics.k8s.io` as served on `localhost:<port>` by a server
/// whose certificate `ca_pem` issued (for `<service>.<namespace>.svc`): a
/// Service `namespace/service` of type `ExternalName` (`localhost`, that
/// port — the aggregation layer dials it without needing endpoints, which
/// may not be loopback addresses) and the `APIService` trusting that CA;
/// waits until the APIService is Available.
///
/// # Errors
/// [`MetricsApiError`].
pub async fn register(
    client: &kube::Client,
    namespace: &str,
    service: &str,
    port: u16,
    ca_pem: &str,
    available_within: Duration,
) -> Result<(), MetricsApiError> {
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": service, "labels": {"app.kubernetes.io/name": "skipper-metrics"}},
        "spec": {"type": "ExternalName", "externalName": "localhost",
                 "ports": [{"name": "https", "port": port, "protocol": "TCP"}]},
    }))
    .map_err(|e| MetricsApiError::Tls(e.to_string()))?;
    services
        .create(&PostParams::default(), &svc)
        .await
        .map_err(|e| MetricsApiError::Create {
            what: format!("Service {namespace}/{service}"),
            source: Box::new(e),
        })?;

    let api_services: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource {
            group: "apiregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "apiregistration.k8s.io/v1".into(),
            kind: "APIService".into(),
            plural: "apiservices".into(),
        },
    );
    use base64::Engine as _;
    let api_service: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
        "metadata": {"name": API_SERVICE},
        "spec": {"service": {"name": service, "namespace": namespace, "port": port},
                 "group": "metrics.k8s.io", "version": "v1beta1",
                 "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem),
                 "groupPriorityMinimum": 100, "versionPriority": 100},
    }))
    .map_err(|e| MetricsApiError::Tls(e.to_string()))?;
    api_services
        .create(&PostParams::default(), &api_service)
        .await
        .map_err(|e| MetricsApiError::Create {
            what: format!("APIService {API_SERVICE}"),
            source: Box::new(e),
        })?;
    let deadline = tokio::time::Instant::now() + available_within;
    let mut last = String::from("no status yet");
    loop {
        if let Ok(a) = api_services.get(API_SERVICE).await {
            let conditions = a.data["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if let Some(c) = conditions.iter().find(|c| c["type"] == "Available") {
                if c["status"] == "True" {
                    return Ok(());
                }
                last = format!("{}: {}", c["reason"], c["message"]);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(MetricsApiError::NotAvailable(available_within, last));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
