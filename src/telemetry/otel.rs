//! OpenTelemetry traces (`--telemetry` with `--telemetry-trace`): the
//! process's `tracing` spans exported over OTLP/HTTP (protobuf) to the
//! collector the standard `OTEL_EXPORTER_OTLP_*` variables name (default
//! `http://localhost:4318/v1/traces`), with `service.name`
//! `skipper.<command>` and the resource attributes of
//! `OTEL_RESOURCE_ATTRIBUTES`; sampling parent-based always-on; W3C trace
//! context and baggage propagate across processes.
//!
//! - Which spans: this crate's spans at INFO and above (router request,
//!   `GetInstance` client and server, claim, assign POST, converge ticks,
//!   Kubernetes writes, the fixture's requests); WARN and ERROR events
//!   inside them become span events (ERROR sets the span's status).
//! - Propagation: [`inject_http`] / [`extract_http`] for HTTP headers,
//!   [`inject_grpc`] / [`extract_grpc`] for gRPC metadata.
//! - Cost when off: [`enabled`] is one relaxed atomic load; code on the hot
//!   paths creates no span and touches no header unless it is true.
//!
//! The "current" context is the OTel context of the innermost exported
//! span being executed (`tracing-opentelemetry` activates it on enter).
//!
//! Export runs on the SDK's batch thread; the HTTP request itself runs on
//! the process's tokio runtime (hyper, plain HTTP or HTTPS verified against
//! the system's roots), bounded by the exporter's timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::{Extractor, Injector, TextMapCompositePropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Whether spans are being exported.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns [`enabled`] on without an exporter (tests that install their own
/// provider and subscriber).
#[cfg(test)]
pub(crate) fn enable_for_tests() {
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    ENABLED.store(true, Ordering::Relaxed);
}

/// Whether trace export is on in this process (set once at start-up).
#[must_use]
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Why trace export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("OTLP trace exporter: {0}")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    #[error("OTLP trace exporter: TLS configuration: {0}")]
    Tls(#[source] rustls::Error),
}

/// Largest collector answer read (the protocol's answers are tiny).
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Bound on one export request when `OTEL_EXPORTER_OTLP_*TIMEOUT` is not
/// smaller.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

type Connector = hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;

/// The exporter's HTTP client: requests run on the tokio runtime the
/// process started, whatever thread asks.
#[derive(Debug, Clone)]
struct Client {
    http: HyperClient<Connector, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
}

impl Client {
    fn new(runtime: tokio::runtime::Handle) -> Result<Self, Error> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(Error::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(REQUEST_TIMEOUT));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            http: HyperClient::builder(TokioExecutor::new()).build(connector),
            runtime,
        })
    }
}

/// Why one export request failed.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("sending: {0}")]
    Send(#[source] hyper_util::client::legacy::Error),
    #[error("reading the answer: {0}")]
    Read(#[source] hyper::Error),
    #[error("the answer is larger than {MAX_RESPONSE_BYTES} bytes")]
    TooLarge,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("the runtime is shutting down")]
    Stopped,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let http = self.http.clone();
        let uri = request.uri().clone();
        self.runtime.spawn(async move {
            let exchange = async {
                let resp = http
                    .request(request.map(Full::new))
                    .await
                    .map_err(SendError::Send)?;
                let (parts, body) = resp.into_parts();
                let body = http_body_util::Limited::new(body, MAX_RESPONSE_BYTES)
                    .collect()
                    .await
                    .map_err(|e| match e.downcast::<hyper::Error>() {
                        Ok(e) => SendError::Read(*e),
                        Err(_) => SendError::TooLarge,
                    })?
                    .to_bytes();
                Ok::<_, SendError>(http::Response::from_parts(parts, body))
            };
            let result = match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
                Ok(r) => r,
                Err(_) => Err(SendError::Timeout(REQUEST_TIMEOUT)),
            };
            note_delivery(&uri, &result);
            let _ = tx.send(result);
        });
        match rx.await {
            Ok(r) => r.map_err(Into::into),
            Err(_) => Err(SendError::Stopped.into()),
        }
    }
}

/// Whether the last export failed (so a failure is said once, not per batch).
static FAILING: AtomicBool = AtomicBool::new(false);

/// Says once when the collector stops taking traces (they are dropped), and
/// once when it takes them again.
fn note_delivery(uri: &http::Uri, result: &Result<http::Response<Bytes>, SendError>) {
    match result {
        Err(e) => {
            if !FAILING.swap(true, Ordering::Relaxed) {
                tracing::warn!(collector = %uri, error = %e, "the OTLP collector does not take traces; they are dropped until it does");
            }
        }
        Ok(resp) if !resp.status().is_success() => {
            if !FAILING.swap(true, Ordering::Relaxed) {
                tracing::warn!(collector = %uri, status = %resp.status(), "the OTLP collector refuses traces; they are dropped until it takes them");
            }
        }
        Ok(_) => {
            if FAILING.swap(false, Ordering::Relaxed) {
                tracing::info!(collector = %uri, "the OTLP collector takes traces again");
            }
        }
    }
}

/// Sets up export for `service` (`skipper.controller`, ...): the tracer
/// provider, the global propagator, and [`enabled`].
///
/// # Errors
/// [`Error::Exporter`] for an unusable `OTEL_EXPORTER_OTLP_*` setting.
pub fn provider(service: &'static str, runtime: tokio::runtime::Handle) -> Result<SdkTracerProvider, Error> {
    use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
    if let Ok(p) = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        && p != "http/protobuf"
    {
        tracing::warn!(protocol = %p, "OTEL_EXPORTER_OTLP_PROTOCOL: this binary exports traces as http/protobuf");
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_http_client(Client::new(runtime)?)
        .build()
        .map_err(Error::Exporter)?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .build();
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    ENABLED.store(true, Ordering::Relaxed);
    Ok(provider)
}

/// The `tracing` layer that turns this crate's spans into OpenTelemetry
/// spans of `provider`.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl tracing_subscriber::Layer<S> + 'static
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    let tracer = provider.tracer("skipper");
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
            // `task` spans last as long as the task (a whole process, a
            // supervisor's life): the work inside them makes its own traces.
            meta.target().starts_with("skipper")
                && if meta.is_span() {
                    *meta.level() <= tracing::Level::INFO && meta.name() != "task"
                } else {
                    *meta.level() <= tracing::Level::WARN
                }
        }))
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Writes the current span's context (`traceparent`, `tracestate`,
/// `baggage`) into outgoing HTTP headers. Nothing when export is off or
/// no span is current.
pub fn inject_http(headers: &mut http::HeaderMap) {
    if !enabled() {
        return;
    }
    let cx = opentelemetry::Context::current();
    if !cx.span().span_context().is_valid() {
        return;
    }
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderInjector(headers)));
}

/// Writes the current span's context into outgoing gRPC metadata.
pub fn inject_grpc(metadata: &mut tonic::metadata::MetadataMap) {
    if !enabled() {
        return;
    }
    let cx = opentelemetry::Context::current();
    if !cx.span().span_context().is_valid() {
        return;
    }
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut MetadataInjector(metadata))
    });
}

/// The remote context carried by incoming HTTP headers.
#[must_use]
pub fn extract_http(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// The remote context carried by incoming gRPC metadata.
#[must_use]
pub fn extract_grpc(metadata: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)))
}

/// Makes `parent` (from [`extract_http`] or [`extract_grpc`]) the parent
/// of `span` when it carries a valid remote span.
pub fn set_remote_parent(span: &tracing::Span, parent: opentelemetry::Context) {
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

/// `(trace_id, span_id)` of the exported span being executed (the OTel
/// context activated when its `tracing` span was entered), hex, when
/// export is on.
#[must_use]
pub fn current_ids() -> Option<(String, String)> {
    if !enabled() {
        return None;
    }
    let cx = opentelemetry::Context::current();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid()
        .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt as _;

    #[test]
    fn context_travels_in_headers_and_metadata_and_parents_the_remote_side() {
        enable_for_tests();
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry().with(layer(&provider));
        tracing::subscriber::with_default(subscriber, || {
            let client = tracing::info_span!("client");
            let (mut headers, mut metadata) = (http::HeaderMap::new(), tonic::metadata::MetadataMap::new());
            client.in_scope(|| {
                inject_http(&mut headers);
                inject_grpc(&mut metadata);
            });
            let (trace_id, span_id) = client.in_scope(|| current_ids().unwrap());
            let traceparent = headers["traceparent"].to_str().unwrap().to_owned();
            assert_eq!(traceparent, format!("00-{trace_id}-{span_id}-01"));
            assert_eq!(
                metadata.get("traceparent").unwrap().to_str().unwrap(),
                traceparent
            );

            // The receiving side: a span parented by the extracted context
            // continues the trace.
            for remote in [extract_http(&headers), extract_grpc(&metadata)] {
                let server = tracing::info_span!(parent: None, "server");
                set_remote_parent(&server, remote);
                let (t, s) = server.in_scope(|| current_ids().unwrap());
                assert_eq!(t, trace_id);
                assert_ne!(s, span_id);
            }
            // Nothing to carry outside a span; a malformed header starts no trace.
            let mut none = http::HeaderMap::new();
            inject_http(&mut none);
            assert!(none.is_empty());
            let mut bad = http::HeaderMap::new();
            bad.insert("traceparent", http::HeaderValue::from_static("00-zz-yy-01"));
            let server = tracing::info_span!(parent: None, "server");
            set_remote_parent(&server, extract_http(&bad));
            let (t, _) = server.in_scope(|| current_ids().unwrap());
            assert_ne!(t, trace_id);
        });
    }

    /// Log lines written while it is alive (on this thread).
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_collector_that_refuses_is_said_once_and_so_is_its_return() {
        use opentelemetry_http::HttpClient as _;
        let logs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Captured(writer.clone()))
            .with_ansi(false)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let count = |needle: &str| {
            String::from_utf8_lossy(&logs.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
                .matches(needle)
                .count()
        };
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let nobody = closed.local_addr().unwrap();
        drop(closed);
        let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = collector.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            while let Ok((mut s, _)) = collector.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        let client = Client::new(tokio::runtime::Handle::current()).unwrap();
        let post = |addr: std::net::SocketAddr| {
            http::Request::post(format!("http://{addr}/v1/traces"))
                .body(Bytes::from_static(b"spans"))
                .unwrap()
        };
        for _ in 0..3 {
            assert!(client.send_bytes(post(nobody)).await.is_err());
        }
        assert_eq!(count("the OTLP collector does not take traces"), 1);
        assert!(count(&nobody.to_string()) >= 1, "names the collector");
        for _ in 0..2 {
            assert!(client.send_bytes(post(up)).await.is_ok());
        }
        assert_eq!(count("the OTLP collector takes traces again"), 1);
        assert!(client.send_bytes(post(nobody)).await.is_err());
        assert_eq!(
            count("the OTLP collector does not take traces"),
            2,
            "said again after it answered"
        );
    }
}
