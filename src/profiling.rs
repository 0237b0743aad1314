//! The profiling endpoint (`--pprof`, `--pprof-host`, `--pprof-port`), with
//! the routes of Go's `net/http/pprof` that make sense for a Rust process:
//!
//! - `GET /debug/pprof/`: an index of what is served;
//! - `GET /debug/pprof/profile?seconds=N`: a CPU profile of the whole
//!   process over N seconds (default 30, at most [`MAX_PROFILE_SECONDS`]),
//!   sampled at 100 Hz, in pprof's protobuf format (`go tool pprof` reads
//!   it);
//! - `GET /debug/pprof/cmdline`: the command line, NUL-separated;
//! - `/debug/pprof/symbol`, `/debug/pprof/trace` and the heap profiles are
//!   Go runtime features: 501 with a line saying so.
//!
//! One CPU profile runs at a time (the sampler is process-wide): a second
//! request is answered 409. A profile ends early, with what was collected,
//! when the client goes away or the process shuts down. Failing to bind the
//! port is logged and the process carries on, as in the Go implementation.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::sync::Semaphore;

use crate::shutdown::Shutdown;

/// Longest CPU profile a request may ask for.
pub const MAX_PROFILE_SECONDS: u64 = 120;
/// Profile length when `seconds` is not given (as in Go).
pub const DEFAULT_PROFILE_SECONDS: u64 = 30;
/// Samples per second.
pub const SAMPLE_HZ: i32 = 100;

/// Why a profile request failed. `Display` is the one-line answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("seconds: {0:?} is not a whole number of seconds between 1 and {MAX_PROFILE_SECONDS}")]
    BadSeconds(String),
    #[error("a CPU profile is already being taken; try again when it is done")]
    Busy,
    #[error("cannot start the CPU profiler: {0}")]
    Start(#[source] ::pprof::Error),
    #[error("cannot build the CPU profile: {0}")]
    Report(#[source] ::pprof::Error),
    #[error("the profiler task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = match &self {
            Self::BadSeconds(_) => StatusCode::BAD_REQUEST,
            Self::Busy => StatusCode::CONFLICT,
            Self::Start(_) | Self::Report(_) | Self::Task(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{self}\n"),
        )
            .into_response()
    }
}

#[derive(Clone)]
struct AppState {
    /// One profile at a time.
    running: Arc<Semaphore>,
    shutdown: Shutdown,
}

/// The profiling routes.
pub fn router(shutdown: Shutdown) -> axum::Router {
    let state = AppState {
        running: Arc::new(Semaphore::new(1)),
        shutdown,
    };
    axum::Router::new()
        .route("/debug/pprof", get(index))
        .route("/debug/pprof/", get(index))
        .route("/debug/pprof/profile", get(profile))
        .route("/debug/pprof/cmdline", get(cmdline))
        .route("/debug/pprof/{name}", get(not_available))
        .with_state(state)
}

/// Serves [`router`] on `addr` until `shutdown`, then waits at most `grace`
/// for open requests; returns the bound address, or `None` (logged) when
/// the address cannot be bound.
pub async fn serve(addr: SocketAddr, grace: Duration, shutdown: &Shutdown) -> Option<SocketAddr> {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%addr, error = %e, "failed to bind the pprof endpoint; continuing without it");
            return None;
        }
    };
    let local = listener.local_addr().ok()?;
    let app = router(shutdown.clone());
    let token = shutdown.token().clone();
    shutdown.spawn("pprof-server", async move {
        let serving = axum::serve(crate::net::http_listener(listener), app)
            .with_graceful_shutdown(token.clone().cancelled_owned());
        let mut serving = std::pin::pin!(serving.into_future());
        let result = tokio::select! {
            r = &mut serving => r,
            () = token.cancelled() => match tokio::time::timeout(grace, &mut serving).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(?grace, "pprof endpoint did not stop within --pprof-shutdown-timeout");
                    Ok(())
                }
            },
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "pprof endpoint stopped");
        }
    });
    tracing::info!(address = %local, "serving pprof");
    Some(local)
}

/// Serves the endpoint when `--pprof` is on (see [`serve`]).
///
/// # Errors
/// When `--pprof-host` is not an address (a bind failure is only logged).
pub async fn start(
    args: &crate::telemetry::Args,
    shutdown: &Shutdown,
) -> Result<Option<SocketAddr>, crate::telemetry::AddrError> {
    let Some(addr) = args.pprof_addr()? else {
        return Ok(None);
    };
    Ok(serve(addr, args.pprof_shutdown_timeout, shutdown).await)
}

async fn index() -> Response {
    let body = "<!doctype html><html><head><title>/debug/pprof/</title></head><body>\
        <h1>/debug/pprof/</h1>\
        <p><a href=\"profile?seconds=30\">profile</a>: CPU profile (<code>?seconds=N</code>, 1 to 120; \
        read it with <code>go tool pprof</code>)</p>\
        <p><a href=\"cmdline\">cmdline</a>: the command line of this process</p>\
        </body></html>";
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

async fn cmdline() -> Response {
    let line = std::env::args().collect::<Vec<_>>().join("\0");
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], line).into_response()
}

async fn not_available(axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    (
        StatusCode::NOT_IMPLEMENTED,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!(
            "/debug/pprof/{name} is a Go runtime profile; this process serves /debug/pprof/profile (CPU)\n"
        ),
    )
        .into_response()
}

/// Query of `/debug/pprof/profile`.
#[derive(Debug, serde::Deserialize)]
struct ProfileQuery {
    seconds: Option<String>,
}

/// Parses the `seconds` parameter.
///
/// # Errors
/// [`Error::BadSeconds`] outside `1..=MAX_PROFILE_SECONDS`.
pub fn parse_seconds(raw: Option<&str>) -> Result<Duration, Error> {
    let Some(raw) = raw.filter(|s| !s.is_empty()) else {
        return Ok(Duration::from_secs(DEFAULT_PROFILE_SECONDS));
    };
    match raw.parse::<u64>() {
        Ok(n) if (1..=MAX_PROFILE_SECONDS).contains(&n) => Ok(Duration::from_secs(n)),
        _ => Err(Error::BadSeconds(raw.to_owned())),
    }
}

async fn profile(State(state): State<AppState>, Query(q): Query<ProfileQuery>) -> Result<Response, Error> {
    let length = parse_seconds(q.seconds.as_deref())?;
    let permit = state
        .running
        .clone()
        .try_acquire_owned()
        .map_err(|_| Error::Busy)?;
    // The sampler runs on a blocking thread (its guard is not Send); the
    // channel ends it early: a message on shutdown, disconnection when this
    // request is dropped.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let token = state.shutdown.token().clone();
    let stopper = stop_tx.clone();
    let watch = tokio::spawn(async move {
        token.cancelled().await;
        let _ = stopper.send(());
    });
    let task = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        take_profile(length, &stop_rx)
    });
    let result = task.await;
    watch.abort();
    drop(stop_tx);
    let bytes = result.map_err(Error::Task)??;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::CONTENT_DISPOSITION, "attachment; filename=\"profile\""),
        ],
        bytes,
    )
        .into_response())
}

/// Samples the process for `length` (or until `stop` fires or disconnects)
/// and encodes the profile.
fn take_profile(length: Duration, stop: &std::sync::mpsc::Receiver<()>) -> Result<Vec<u8>, Error> {
    let guard = ::pprof::ProfilerGuardBuilder::default()
        .frequency(SAMPLE_HZ)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
        .map_err(Error::Start)?;
    // Either outcome ends the wait: the time is up, or the request/process
    // is going away.
    let _ = stop.recv_timeout(length);
    let report = guard.report().build().map_err(Error::Report)?;
    drop(guard);
    Ok(encode(&report))
}

/// pprof's `profile.proto` (github.com/google/pprof), the messages this
/// endpoint writes.
pub mod proto {
    /// A profile.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    /// A sample type and its unit (indices into the string table).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    /// One stack with its values.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Leaf first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    /// A sample label.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    /// A mapped binary.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    /// A stack frame: an address with its (inlined) lines.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        /// Innermost inlined function first, the caller last.
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    /// A source line of a function.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
        #[prost(int64, tag = "3")]
        pub column: i64,
    }

    /// A function.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// The string table under construction (index 0 is the empty string).
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: std::collections::HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Self::default();
        s.id("");
        s
    }

    fn id(&mut self, s: &str) -> i64 {
        if let Some(i) = self.index.get(s) {
            return *i;
        }
        let i = i64::try_from(self.table.len()).unwrap_or(i64::MAX);
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

/// A resolved stack frame as the encoder sees it: its inlined functions,
/// innermost first, as `(name, system name, file, line)`.
pub type Frame = Vec<(String, String, String, i64)>;

/// One stack (leaf first) with its thread and sample count.
#[derive(Debug, Clone)]
pub struct Stack {
    pub frames: Vec<Frame>,
    pub thread: String,
    pub count: i64,
}

/// Encodes `stacks` sampled at `hz` over `duration` from `start` as pprof
/// protobuf: sample types `samples/count` and `cpu/nanoseconds`, one
/// location per distinct frame, one function per distinct name and file.
#[must_use]
pub fn encode_stacks(stacks: &[Stack], hz: i32, start: std::time::SystemTime, duration: Duration) -> Vec<u8> {
    use prost::Message as _;
    let mut strings = Strings::new();
    let mut functions: Vec<proto::Function> = Vec::new();
    let mut function_ids: std::collections::HashMap<(String, String), u64> = std::collections::HashMap::new();
    let mut locations: Vec<proto::Location> = Vec::new();
    let mut location_ids: std::collections::HashMap<Frame, u64> = std::collections::HashMap::new();
    let period = 1_000_000_000 / i64::from(hz.max(1));
    let thread_key = strings.id("thread");
    let mut samples = Vec::with_capacity(stacks.len());
    for stack in stacks {
        let mut ids = Vec::with_capacity(stack.frames.len());
        for frame in &stack.frames {
            if let Some(id) = location_ids.get(frame) {
                ids.push(*id);
                continue;
            }
            let mut lines = Vec::with_capacity(frame.len());
            for (name, system_name, file, line) in frame {
                let key = (name.clone(), file.clone());
                let function_id = if let Some(id) = function_ids.get(&key) {
                    *id
                } else {
                    let id = functions.len() as u64 + 1;
                    functions.push(proto::Function {
                        id,
                        name: strings.id(name),
                        system_name: strings.id(system_name),
                        filename: strings.id(file),
                        start_line: 0,
                    });
                    function_ids.insert(key, id);
                    id
                };
                lines.push(proto::Line {
                    function_id,
                    line: *line,
                    column: 0,
                });
            }
            let id = locations.len() as u64 + 1;
            locations.push(proto::Location {
                id,
                line: lines,
                ..proto::Location::default()
            });
            location_ids.insert(frame.clone(), id);
            ids.push(id);
        }
        samples.push(proto::Sample {
            location_id: ids,
            value: vec![stack.count, stack.count.saturating_mul(period)],
            label: vec![proto::Label {
                key: thread_key,
                str: strings.id(&stack.thread),
                ..proto::Label::default()
            }],
        });
    }
    let cpu = proto::ValueType {
        r#type: strings.id("cpu"),
        unit: strings.id("nanoseconds"),
    };
    let profile = proto::Profile {
        sample_type: vec![
            proto::ValueType {
                r#type: strings.id("samples"),
                unit: strings.id("count"),
            },
            cpu.clone(),
        ],
        sample: samples,
        location: locations,
        function: functions,
        time_nanos: start
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        duration_nanos: i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX),
        period_type: Some(cpu),
        period,
        string_table: std::mem::take(&mut strings.table),
        ..proto::Profile::default()
    };
    profile.encode_to_vec()
}

/// Encodes a pprof-rs report (see [`encode_stacks`]).
fn encode(report: &::pprof::Report) -> Vec<u8> {
    let stacks: Vec<Stack> = report
        .data
        .iter()
        .map(|(frames, count)| Stack {
            frames: frames
                .frames
                .iter()
                .map(|symbols| {
                    symbols
                        .iter()
                        .map(|s| {
                            (
                                s.name(),
                                s.sys_name().into_owned(),
                                s.filename().into_owned(),
                                i64::from(s.lineno()),
                            )
                        })
                        .collect()
                })
                .collect(),
            thread: frames.thread_name_or_id(),
            count: i64::try_from(*count).unwrap_or(0),
        })
        .collect();
    let timing = &report.timing;
    encode_stacks(&stacks, timing.frequency, timing.start_time, timing.duration)
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    #[test]
    fn seconds_are_bounded() {
        assert_eq!(parse_seconds(None).unwrap(), Duration::from_secs(30));
        assert_eq!(parse_seconds(Some("")).unwrap(), Duration::from_secs(30));
        assert_eq!(parse_seconds(Some("1")).unwrap(), Duration::from_secs(1));
        assert_eq!(parse_seconds(Some("120")).unwrap(), Duration::from_secs(120));
        for bad in ["0", "121", "-1", "1.5", "x"] {
            assert!(
                matches!(parse_seconds(Some(bad)), Err(Error::BadSeconds(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn stacks_encode_with_shared_locations_and_functions() {
        let f = |n: &str, line| vec![(n.to_owned(), format!("_Z{n}"), "src/a.rs".to_owned(), line)];
        let stacks = vec![
            Stack {
                frames: vec![f("leaf", 3), f("main", 10)],
                thread: "worker".into(),
                count: 5,
            },
            Stack {
                frames: vec![f("other", 7), f("main", 10)],
                thread: "worker".into(),
                count: 2,
            },
        ];
        let bytes = encode_stacks(&stacks, 100, std::time::UNIX_EPOCH, Duration::from_secs(1));
        let p = proto::Profile::decode(bytes.as_slice()).unwrap();
        assert_eq!(p.string_table[0], "");
        let s = |i: i64| p.string_table[usize::try_from(i).unwrap()].as_str();
        assert_eq!(s(p.sample_type[0].r#type), "samples");
        assert_eq!(s(p.sample_type[1].unit), "nanoseconds");
        assert_eq!(p.period, 10_000_000);
        assert_eq!(p.location.len(), 3, "main is shared");
        assert_eq!(p.function.len(), 3);
        assert_eq!(p.sample[0].value, vec![5, 50_000_000]);
        assert_eq!(p.sample[0].location_id[1], p.sample[1].location_id[1]);
        let main = &p.location[usize::try_from(p.sample[0].location_id[1] - 1).unwrap()];
        let func = &p.function[usize::try_from(main.line[0].function_id - 1).unwrap()];
        assert_eq!(s(func.name), "main");
        assert_eq!(main.line[0].line, 10);
    }
}
