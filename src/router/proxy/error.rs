//! Every answer the router makes itself, and the one place that maps them to
//! HTTP (status, a one-line text body saying why) and to gRPC (a
//! trailers-only response with `grpc-status` and `grpc-message`, for
//! requests whose `Content-Type` is `application/grpc…`), with a single log
//! line.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

use super::body::ClientBodyError;
use super::forwarding::HostError;
use super::upstream::ConnectError;
use crate::client;
use crate::router::entry::HeaderError;

/// Seconds a client is asked to wait after a 503.
pub const RETRY_AFTER_SECS: u32 = 1;
/// Longest body line of an answer (bytes): client-supplied values quoted in
/// a message are cut here.
pub const MAX_BODY_LINE: usize = 512;

/// A request the router answers itself.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The function header is missing, malformed or invalid.
    #[error(transparent)]
    BadHeader(#[from] HeaderError),
    /// `Host` is missing (HTTP/1.1), given twice or not a host.
    #[error(transparent)]
    BadHost(#[from] HostError),
    /// No controller answered GetInstance.
    #[error("no controller available: {0}")]
    ControllerUnavailable(#[source] client::Error),
    /// The controllers found no capacity for the function in time.
    #[error("no capacity for the function: {0}")]
    NoCapacity(#[source] client::Error),
    /// The controllers refuse the function itself (e.g. its namespace is
    /// not managed): the client's request is wrong, not the router.
    #[error("controller rejected the function: {0}")]
    Rejected(#[source] client::Error),
    /// The controllers refuse this router's credentials
    /// (`UNAUTHENTICATED`, `PERMISSION_DENIED`): the router cannot serve,
    /// another router may.
    #[error("the controllers refuse this router's credentials: {0}")]
    CredentialsRefused(#[source] client::Error),
    /// The function's Deployment does not exist.
    #[error("function not found: {0}")]
    NotFound(#[source] client::Error),
    /// A controller refused GetInstance for another reason.
    #[error("controller failed to provide an instance: {0}")]
    GetInstance(#[source] client::Error),
    /// A controller answered GetInstance without a usable instance.
    #[error("controller answered without an instance")]
    NoInstance,
    /// The instance's address is not an IP socket address.
    #[error("instance {name:?} has an unusable address {addr:?}")]
    InstanceAddress { name: String, addr: String },
    /// Connecting to the instance failed (nothing was sent).
    #[error("failed to connect to instance {name:?}: {source}")]
    Connect {
        name: String,
        #[source]
        source: ConnectError,
    },
    /// The instance answered `421 Misdirected Request`: it is not the
    /// instance the router named (its address now belongs to another pod).
    #[error("instance {name:?} is not at its address any more (421 Misdirected Request)")]
    Misdirected { name: String },
    /// An instance refused the request (421) after more of its body was
    /// read than the router keeps for a replay.
    #[error("the request body is larger than the {limit} bytes kept to send it again: {last}")]
    NotReplayable { limit: usize, last: Box<Error> },
    /// The client paused its request body for longer than `--body-timeout`,
    /// or sent it too slowly, while it was being sent to the instance.
    #[error("{cause}")]
    RequestBodyTimeout { name: String, cause: String },
    /// The client's request body was malformed (e.g. broken chunked
    /// framing) or cut short while it was being sent to the instance.
    #[error("{}", client_body_cause(.source))]
    BadRequestBody {
        name: String,
        #[source]
        source: hyper::Error,
    },
    /// The instance failed after the request was handed to it.
    #[error("instance {name:?} failed: {source}")]
    Upstream {
        name: String,
        #[source]
        source: hyper::Error,
    },
    /// The instance failed in a direct exchange ([`super::direct`]) after
    /// the request was written to it.
    #[error("instance {name:?} failed: {source}")]
    Exchange {
        name: String,
        #[source]
        source: super::direct::ExchangeError,
    },
    /// The instance switched to another protocol than asked.
    #[error("instance {name:?} switched to {got:?} instead of {want:?}")]
    UpgradeMismatch { name: String, want: String, got: String },
    /// `--response-header-timeout` passed after the request was sent.
    #[error("instance {name:?} sent no response headers within {timeout:?}")]
    ResponseHeaderTimeout {
        name: String,
        timeout: std::time::Duration,
    },
    /// `--request-timeout` passed before the response headers arrived.
    #[error("no response within the request timeout of {0:?}")]
    RequestTimeout(std::time::Duration),
    /// `--request-timeout` passed while the client was still sending its
    /// request body.
    #[error("the client did not send its request within the request timeout of {0:?}")]
    RequestIncomplete(std::time::Duration),
    /// The request may not wait for an instance: too many wait already
    /// (router-wide or for its function), or other functions' requests
    /// took its place.
    #[error("{0}")]
    Overloaded(#[source] super::admission::Refused),
    /// Every instance stayed at the function's `max_in_flight_requests`
    /// for as long as a request waits.
    #[error("every instance of the function had {limit} requests in flight for {timeout:?}")]
    NoRoom {
        limit: u32,
        timeout: std::time::Duration,
    },
    /// Every attempt failed; `last` says how the final one failed.
    #[error("gave up after {attempts} attempts: {last}")]
    Exhausted { attempts: u32, last: Box<Error> },
}

impl Error {
    /// Whether a GetInstance failure means no controller or no capacity
    /// (503) rather than a controller error (502).
    #[must_use]
    pub fn from_get_instance(e: client::Error) -> Self {
        match e.code() {
            tonic::Code::InvalidArgument => Self::Rejected(e),
            code if client::is_credentials_refusal(code) => Self::CredentialsRefused(e),
            tonic::Code::NotFound => Self::NotFound(e),
            tonic::Code::Unavailable => Self::ControllerUnavailable(e),
            tonic::Code::ResourceExhausted | tonic::Code::DeadlineExceeded => Self::NoCapacity(e),
            _ => Self::GetInstance(e),
        }
    }

    /// Whether a GetInstance failure is the controllers' considered answer
    /// (the function is refused, or no capacity arrived within the
    /// controller's own wait), so asking again cannot help.
    #[must_use]
    pub fn is_final_get_instance(e: &client::Error) -> bool {
        matches!(
            e.code(),
            tonic::Code::InvalidArgument
                | tonic::Code::NotFound
                | tonic::Code::ResourceExhausted
                | tonic::Code::DeadlineExceeded
        ) && !matches!(e, client::Error::DeadlineExceeded { .. })
    }

    /// A failed send: the client's body when that is what broke it, else
    /// the instance.
    #[must_use]
    pub fn from_send(name: String, source: hyper::Error) -> Self {
        match ClientBodyError::find(&source) {
            Some(e @ (ClientBodyError::Stalled(_) | ClientBodyError::TooSlow { .. })) => {
                Self::RequestBodyTimeout {
                    name,
                    cause: e.to_string(),
                }
            }
            Some(ClientBodyError::Read(_)) => Self::BadRequestBody { name, source },
            Some(ClientBodyError::Replaced) | None => Self::Upstream { name, source },
        }
    }

    /// The HTTP status of this answer.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadHeader(HeaderError::TooLarge { .. }) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::BadHeader(_) | Self::BadHost(_) | Self::Rejected(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::RequestBodyTimeout { .. } | Self::RequestIncomplete(_) => StatusCode::REQUEST_TIMEOUT,
            Self::BadRequestBody { .. } => StatusCode::BAD_REQUEST,
            Self::ControllerUnavailable(_)
            | Self::NoCapacity(_)
            | Self::NotReplayable { .. }
            | Self::CredentialsRefused(_)
            | Self::Overloaded(_)
            | Self::NoRoom { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::GetInstance(_)
            | Self::NoInstance
            | Self::Misdirected { .. }
            | Self::InstanceAddress { .. }
            | Self::Connect { .. }
            | Self::Upstream { .. }
            | Self::Exchange { .. }
            | Self::UpgradeMismatch { .. } => StatusCode::BAD_GATEWAY,
            Self::ResponseHeaderTimeout { .. } | Self::RequestTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Exhausted { last, .. } => last.status(),
        }
    }
}

impl Error {
    /// The gRPC status of this answer, for gRPC clients: what the failure
    /// means to a caller (a retry elsewhere may help: `UNAVAILABLE`).
    #[must_use]
    pub fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::BadHeader(_) | Self::BadHost(_) | Self::Rejected(_) | Self::BadRequestBody { .. } => {
                Code::InvalidArgument
            }
            Self::NotFound(_) => Code::NotFound,
            Self::RequestBodyTimeout { .. }
            | Self::RequestIncomplete(_)
            | Self::ResponseHeaderTimeout { .. }
            | Self::RequestTimeout(_) => Code::DeadlineExceeded,
            Self::ControllerUnavailable(_)
            | Self::NoCapacity(_)
            | Self::NotReplayable { .. }
            | Self::CredentialsRefused(_)
            | Self::Overloaded(_)
            | Self::NoRoom { .. }
            | Self::GetInstance(_)
            | Self::NoInstance
            | Self::Misdirected { .. }
            | Self::InstanceAddress { .. }
            | Self::Connect { .. }
            | Self::Upstream { .. }
            | Self::Exchange { .. }
            | Self::UpgradeMismatch { .. } => Code::Unavailable,
            Self::Exhausted { last, .. } => last.grpc_code(),
        }
    }

    /// The answer: gRPC for a gRPC request, else HTTP.
    #[must_use]
    pub fn respond(self, grpc: bool) -> Response {
        if grpc {
            self.into_grpc_response()
        } else {
            self.into_response()
        }
    }

    /// A trailers-only gRPC response (HTTP 200) carrying this answer's
    /// status and its one-line reason.
    #[must_use]
    pub fn into_grpc_response(self) -> Response {
        let line = one_line(&self.to_string());
        log(self.status(), &line);
        grpc_status(self.grpc_code(), &line)
    }
}

/// The gRPC status for an instance's response body that ended in `err`
/// mid-call: a stream the instance reset with `CANCEL` is the call
/// cancelled (`CANCELLED`, as the instance's own gRPC library reports a
/// handler that gave up); every other failure (reset otherwise, connection
/// lost, process gone) is `UNAVAILABLE`.
#[must_use]
pub fn grpc_code_mid_response(err: &(dyn std::error::Error + 'static)) -> tonic::Code {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return match h2.reason() {
                Some(h2::Reason::CANCEL) => tonic::Code::Cancelled,
                _ => tonic::Code::Unavailable,
            };
        }
        cause = e.source();
    }
    tonic::Code::Unavailable
}

/// Whether a request is a gRPC call (`Content-Type: application/grpc`,
/// `application/grpc+proto`, `application/grpc-web…`).
#[must_use]
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A trailers-only gRPC response: status `code`, `message` percent-encoded
/// as the gRPC HTTP/2 protocol asks.
#[must_use]
pub fn grpc_status(code: tonic::Code, message: &str) -> Response {
    let mut resp = Response::new(Body::empty());
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.extend(grpc_trailers(code, message));
    resp
}

/// `grpc-status` and `grpc-message` for `code` and `message`.
#[must_use]
pub fn grpc_trailers(code: tonic::Code, message: &str) -> http::HeaderMap {
    let mut h = http::HeaderMap::with_capacity(2);
    h.insert("grpc-status", HeaderValue::from(code as i32));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        h.insert("grpc-message", v);
    }
    h
}

/// `grpc-message` encoding: printable ASCII but `%` as is, every other
/// byte of the UTF-8 as `%XX`.
fn percent_encode(text: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn log(status: StatusCode, line: &str) {
    if status.is_server_error() {
        tracing::warn!(status = status.as_u16(), error = %line, "request failed");
    } else {
        tracing::info!(status = status.as_u16(), error = %line, "request rejected");
    }
}

/// The client-side cause inside a send error, as text.
fn client_body_cause(e: &hyper::Error) -> String {
    ClientBodyError::find(e).map_or_else(|| e.to_string(), ToString::to_string)
}

/// `text` on one line (CR/LF become spaces), cut at [`MAX_BODY_LINE`]
/// bytes on a character boundary with `…` marking the cut.
#[must_use]
pub fn one_line(text: &str) -> String {
    let mut line = text.replace(['\r', '\n'], " ");
    if line.len() > MAX_BODY_LINE {
        let mut cut = MAX_BODY_LINE - '…'.len_utf8();
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
        line.push('…');
    }
    line
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status();
        let line = one_line(&self.to_string());
        log(status, &line);
        let mut resp = Response::new(Body::from(format!("{line}\n")));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_percent_encoded_outside_printable_ascii() {
        assert_eq!(
            percent_encode("no capacity: 100% busy"),
            "no capacity: 100%25 busy"
        );
        assert_eq!(percent_encode("pod \"ä\"\n"), "pod \"%C3%A4\"%0A");
    }

    #[test]
    fn a_grpc_answer_is_trailers_only_with_the_errors_status() {
        let resp = Error::from(HeaderError::Missing).respond(true);
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(h["grpc-status"], "3");
        assert_eq!(h["grpc-message"], "missing X-Skipper-Function");
        let http = Error::from(HeaderError::Missing).respond(false);
        assert_eq!(http.status(), StatusCode::BAD_REQUEST);
        assert!(http.headers().get("grpc-status").is_none());
    }

    #[test]
    fn a_stream_the_instance_cancels_is_a_cancelled_call_and_other_losses_unavailable() {
        /// An error caused by `0`, as hyper wraps the h2 error it got.
        #[derive(Debug, thiserror::Error)]
        #[error("stream error")]
        struct Wrapped(#[source] h2::Error);
        let cases: [(&(dyn std::error::Error + 'static), tonic::Code); 4] = [
            (&Wrapped(h2::Reason::CANCEL.into()), tonic::Code::Cancelled),
            (
                &Wrapped(h2::Reason::INTERNAL_ERROR.into()),
                tonic::Code::Unavailable,
            ),
            (
                &Wrapped(h2::Reason::REFUSED_STREAM.into()),
                tonic::Code::Unavailable,
            ),
            (
                &std::io::Error::from(std::io::ErrorKind::ConnectionReset),
                tonic::Code::Unavailable,
            ),
        ];
        for (err, want) in cases {
            assert_eq!(grpc_code_mid_response(err), want, "{err}");
        }
    }

    #[test]
    fn grpc_codes_follow_what_the_failure_means() {
        use std::time::Duration;
        let timeout = Error::RequestTimeout(Duration::from_secs(1));
        assert_eq!(timeout.grpc_code(), tonic::Code::DeadlineExceeded);
        let lost = Error::Misdirected { name: "p".into() };
        assert_eq!(lost.grpc_code(), tonic::Code::Unavailable);
        let exhausted = Error::Exhausted {
            attempts: 3,
            last: Box::new(Error::RequestTimeout(Duration::from_secs(1))),
        };
        assert_eq!(exhausted.grpc_code(), tonic::Code::DeadlineExceeded);
        assert!(is_grpc(
            &[(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc+proto")
            )]
            .into_iter()
            .collect()
        ));
        assert!(!is_grpc(
            &[(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))]
                .into_iter()
                .collect()
        ));
    }
}
