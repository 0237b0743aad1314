//! Logging, metrics and profiling flags shared by every long-running
//! subcommand.
//!
//! Logs go to stderr as JSON (default) or text, optionally also to a file with
//! its own level and format; inside a traced span every record carries
//! `trace_id` and `span_id`. Traces are exported over OTLP by [`otel`] when
//! `--telemetry` and `--telemetry-trace` are on. Prometheus metrics (the component's own and the
//! standard `process_*` series of [`process`]) are served on
//! `--telemetry-prometheus-host:port` `/metrics` when `--telemetry` and
//! `--telemetry-metric` are on. CPU profiles are served by
//! [`crate::profiling`] when `--pprof` is on.

pub mod otel;
pub mod process;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Args as ClapArgs, ValueEnum};
use prometheus_client::registry::Registry;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::parse_duration;

/// Log verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "lower")]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl From<Level> for LevelFilter {
    fn from(l: Level) -> Self {
        match l {
            Level::Trace => LevelFilter::TRACE,
            Level::Debug => LevelFilter::DEBUG,
            Level::Info => LevelFilter::INFO,
            Level::Warn => LevelFilter::WARN,
            Level::Error => LevelFilter::ERROR,
        }
    }
}

/// Log record format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Json,
    Text,
}

/// Logging and telemetry flags shared by `controller`, `router` and `fixture`.
#[derive(Debug, Clone, ClapArgs)]
#[group(skip)]
pub struct Args {
    /// Log level: trace, debug, info, warn or error
    #[arg(long, env = "SKIPPER_LOG_LEVEL", default_value = "info", ignore_case = true)]
    pub log_level: Level,

    /// Log format on stderr: json or text
    #[arg(long, env = "SKIPPER_LOG_FORMAT", default_value = "json")]
    pub log_format: Format,

    /// Also write logs to this file (parent directories are created)
    #[arg(long, env = "SKIPPER_LOG_FILE")]
    pub log_file: Option<PathBuf>,

    /// Level for the log file (defaults to --log-level)
    #[arg(long, env = "SKIPPER_LOG_FILE_LEVEL", ignore_case = true)]
    pub log_file_level: Option<Level>,

    /// Format for the log file (defaults to --log-format)
    #[arg(long, env = "SKIPPER_LOG_FILE_FORMAT")]
    pub log_file_format: Option<Format>,

    /// Serve CPU profiles on --pprof-host:--pprof-port (/debug/pprof/)
    #[arg(long, env = "SKIPPER_PPROF", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub pprof: bool,

    /// Bind host of the pprof endpoint
    #[arg(long, env = "SKIPPER_PPROF_HOST", default_value = "0.0.0.0")]
    pub pprof_host: String,

    /// Port of the pprof endpoint
    #[arg(long, env = "SKIPPER_PPROF_PORT", default_value_t = 6060)]
    pub pprof_port: u16,

    /// Bound on stopping the pprof endpoint
    #[arg(long, env = "SKIPPER_PPROF_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub pprof_shutdown_timeout: Duration,

    /// Master switch for the metrics endpoint
    #[arg(long, env = "SKIPPER_TELEMETRY", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub telemetry: bool,

    /// Export traces over OTLP/HTTP when telemetry is on (collector from the OTEL_EXPORTER_OTLP_* environment)
    #[arg(long, env = "SKIPPER_TELEMETRY_TRACE", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub telemetry_trace: bool,

    /// Serve Prometheus /metrics when telemetry is on
    #[arg(long, env = "SKIPPER_TELEMETRY_METRIC", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub telemetry_metric: bool,

    /// Accepted as in the Go implementation, where it does nothing: metrics are scraped from /metrics (--telemetry-metric)
    #[arg(long, env = "SKIPPER_TELEMETRY_METRIC_OTLP", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub telemetry_metric_otlp: bool,

    /// Bind host of the /metrics endpoint
    #[arg(long, env = "SKIPPER_TELEMETRY_PROMETHEUS_HOST", default_value = "0.0.0.0")]
    pub telemetry_prometheus_host: String,

    /// Port of the /metrics endpoint
    #[arg(long, env = "SKIPPER_TELEMETRY_PROMETHEUS_PORT", default_value_t = 9090)]
    pub telemetry_prometheus_port: u16,

    /// Bound on stopping the metrics endpoint
    #[arg(long, env = "SKIPPER_TELEMETRY_SHUTDOWN_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub telemetry_shutdown_timeout: Duration,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            log_level: Level::Info,
            log_format: Format::Json,
            log_file: None,
            log_file_level: None,
            log_file_format: None,
            pprof: true,
            pprof_host: "0.0.0.0".into(),
            pprof_port: 6060,
            pprof_shutdown_timeout: Duration::from_secs(5),
            telemetry: false,
            telemetry_trace: true,
            telemetry_metric: true,
            telemetry_metric_otlp: false,
            telemetry_prometheus_host: "0.0.0.0".into(),
            telemetry_prometheus_port: 9090,
            telemetry_shutdown_timeout: Duration::from_secs(5),
        }
    }
}

/// A bind host flag that does not form a socket address with its port.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {host:?}: {source}")]
pub struct AddrError {
    pub flag: &'static str,
    pub host: String,
    #[source]
    pub source: std::net::AddrParseError,
}

/// `host:port` as a socket address (IPv6 hosts with or without brackets).
fn socket_addr(host: &str, port: u16) -> Result<SocketAddr, std::net::AddrParseError> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.contains(':') {
        format!("[{bare}]:{port}").parse()
    } else {
        format!("{bare}:{port}").parse()
    }
}

impl Args {
    /// The address of the pprof endpoint when `--pprof` is on.
    ///
    /// # Errors
    /// When `--pprof-host` and `--pprof-port` do not form a socket address.
    pub fn pprof_addr(&self) -> Result<Option<SocketAddr>, AddrError> {
        if !self.pprof {
            return Ok(None);
        }
        socket_addr(&self.pprof_host, self.pprof_port)
            .map(Some)
            .map_err(|source| AddrError {
                flag: "--pprof-host",
                host: self.pprof_host.clone(),
                source,
            })
    }

    /// The address of the metrics endpoint when it is enabled.
    ///
    /// # Errors
    /// When the host and port do not form a socket address.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, String> {
        if !(self.telemetry && self.telemetry_metric) {
            return Ok(None);
        }
        let host = &self.telemetry_prometheus_host;
        let addr = if host.contains(':') {
            format!("[{host}]:{}", self.telemetry_prometheus_port)
        } else {
            format!("{host}:{}", self.telemetry_prometheus_port)
        };
        addr.parse()
            .map(Some)
            .map_err(|e| format!("--telemetry-prometheus-host {host:?}: {e}"))
    }
}

/// Adds `trace_id` and `span_id` of the current exported span to every
/// record written inside one (JSON: two more fields; text: appended).
struct WithTraceIds<F>(F);

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for WithTraceIds<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let Some((trace_id, span_id)) = otel::current_ids() else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        let body = line.trim_end_matches('\n');
        match body.strip_suffix('}') {
            Some(open) if body.starts_with('{') => {
                writeln!(
                    writer,
                    "{open},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}"
                )
            }
            _ => writeln!(writer, "{body} trace_id={trace_id} span_id={span_id}"),
        }
    }
}

fn fmt_layer<S, W>(format: Format, writer: W, ansi: bool) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    match format {
        Format::Json => tracing_subscriber::fmt::layer()
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(WithTraceIds(
                tracing_subscriber::fmt::format()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_span_list(false),
            ))
            .with_writer(writer)
            .boxed(),
        Format::Text => tracing_subscriber::fmt::layer()
            .event_format(WithTraceIds(tracing_subscriber::fmt::format().with_ansi(ansi)))
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
    }
}

/// Installs the global logger. A log file that cannot be opened is reported
/// and logging continues on stderr only.
pub fn init(args: &Args) {
    install(args, None);
}

/// Installs the global logger and, when `--telemetry` and
/// `--telemetry-trace` are on, trace export as `service`
/// (`skipper.router`, ...). Call from inside the process's tokio runtime;
/// [`Traces::shutdown`] flushes what is left at exit.
#[must_use]
pub fn init_traced(args: &Args, service: &'static str) -> Traces {
    let provider = if args.telemetry && args.telemetry_trace {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => match otel::provider(service, rt) {
                Ok(p) => Some(p),
                Err(e) => {
                    install(args, None);
                    tracing::warn!(error = %e, "traces are not exported");
                    return Traces { provider: None };
                }
            },
            Err(_) => None,
        }
    } else {
        None
    };
    install(args, provider.as_ref());
    Traces { provider }
}

/// The trace exporter of the process, if any.
#[derive(Debug)]
pub struct Traces {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Traces {
    /// Exports the spans still queued and stops the exporter, bounded by
    /// `timeout`.
    pub async fn shutdown(self, timeout: Duration) {
        let Some(provider) = self.provider else { return };
        let flush = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(timeout));
        match tokio::time::timeout(timeout + Duration::from_secs(1), flush).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "failed to flush traces"),
            Ok(Err(e)) => tracing::warn!(error = %e, "failed to flush traces"),
            Err(_) => tracing::warn!(?timeout, "flushing traces timed out"),
        }
    }
}

fn install(args: &Args, provider: Option<&opentelemetry_sdk::trace::SdkTracerProvider>) {
    let stderr =
        fmt_layer(args.log_format, std::io::stderr, false).with_filter(LevelFilter::from(args.log_level));
    let mut file_problem = None;
    let file = args.log_file.as_ref().and_then(|path| {
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        match std::fs::OpenOptions::new().create(true).append(true).open(path) {
            Ok(f) => {
                let level = args.log_file_level.unwrap_or(args.log_level);
                let format = args.log_file_format.unwrap_or(args.log_format);
                Some(fmt_layer(format, Mutex::new(f), false).with_filter(LevelFilter::from(level)))
            }
            Err(e) => {
                file_problem = Some(format!("cannot open log file {}: {e}", path.display()));
                None
            }
        }
    });
    let traces = provider.map(otel::layer);
    let _ = tracing_subscriber::registry()
        .with(traces)
        .with(stderr)
        .with(file)
        .try_init();
    if let Some(p) = file_problem {
        tracing::warn!("{p}; logging to stderr only");
    }
}

/// Serves `registry` as Prometheus text on `addr` `/metrics` until `shutdown`
/// is cancelled. Returns the bound address.
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: Arc<Registry>,
    shutdown: &crate::shutdown::Shutdown,
) -> std::io::Result<SocketAddr> {
    use axum::response::IntoResponse;
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (
                        [(
                            http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    )
                        .into_response(),
                    Err(e) => (
                        [(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                        format!("encoding metrics failed: {e}\n"),
                    )
                        .into_response(),
                }
            }
        }),
    );
    let token = shutdown.token().clone();
    shutdown.spawn("metrics-server", async move {
        if let Err(e) = axum::serve(crate::net::http_listener(listener), app)
            .with_graceful_shutdown(token.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    tracing::info!(address = %local, "serving metrics");
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log sink the test reads back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn lines(sink: &Sink) -> Vec<String> {
        String::from_utf8(sink.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn records_inside_a_traced_span_carry_its_ids() {
        otel::enable_for_tests();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let (json, text) = (Sink::default(), Sink::default());
        let (j, t) = (json.clone(), text.clone());
        let subscriber = tracing_subscriber::registry()
            .with(otel::layer(&provider))
            .with(fmt_layer(Format::Json, move || j.clone(), false))
            .with(fmt_layer(Format::Text, move || t.clone(), false));
        let ids = tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside");
            let span = tracing::info_span!("work", tenant = "a");
            span.in_scope(|| {
                tracing::info!(n = 1, "inside");
                otel::current_ids().unwrap()
            })
        });
        let json = lines(&json);
        assert_eq!(json.len(), 2, "{json:?}");
        let outside: serde_json::Value = serde_json::from_str(&json[0]).unwrap();
        assert!(outside.get("trace_id").is_none(), "{outside}");
        let inside: serde_json::Value = serde_json::from_str(&json[1]).unwrap();
        assert_eq!(inside["message"], "inside");
        assert_eq!(inside["n"], 1);
        assert_eq!(inside["trace_id"], ids.0.as_str());
        assert_eq!(inside["span_id"], ids.1.as_str());
        assert_eq!(inside["span"]["tenant"], "a");
        let text = lines(&text);
        assert!(!text[0].contains("trace_id"), "{text:?}");
        assert!(
            text[1].ends_with(&format!("trace_id={} span_id={}", ids.0, ids.1)),
            "{text:?}"
        );
    }
}
