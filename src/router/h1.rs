//! HTTP/1.1 client connections: the router reads request heads and writes
//! responses itself while the requests are plain, and hands the connection
//! to hyper's server at the first one that is not.
//!
//! A request is plain when it is HTTP/1.1, has no body (no
//! `Transfer-Encoding`, no `Content-Length` but `0`), is not an upgrade,
//! expects no `100 Continue`, is not `CONNECT`, and its target is in origin
//! form (`/path?query`). That is what most traffic is, and for it the
//! router needs none of hyper's machinery: it parses the head with
//! httparse (at most [`MAX_HEADERS`] fields, the head at most
//! [`super::MAX_REQUEST_HEAD_BYTES`]), runs the same request handling as
//! every other request, and writes the response as hyper's server would
//! (status line, `content-length` or `chunked`, trailers only as the
//! response's `Trailer` names them, `date`, no body for `HEAD`, `204` and
//! `304`).
//!
//! Anything else — a body, an upgrade, HTTP/1.0, a head httparse refuses or
//! that is too large — goes to hyper with every byte read so far, and hyper
//! serves the connection from that request on (so its answers for bad heads,
//! `431` and `400`, are hyper's).
//!
//! Bounds, as with hyper:
//! - the wait for a request head, from the moment the connection waits for
//!   one, is bounded by `--idle-timeout` (one timer per connection, moved on
//!   only when it fires);
//! - writes are bounded by `--write-timeout` ([`super::proxy::client_io`]);
//! - while a request is in progress the connection is still read: a reset
//!   ends the request at once, an end of input is held until the answer has
//!   been written (a half-closed client gets it), and bytes of a next
//!   request are kept up to the head limit;
//! - once the drain has begun, an idle connection closes, and one in use
//!   closes after its answer.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::time::{Instant, Sleep};

use crate::shutdown::Latch;

use super::proxy::direct::head_len;
use super::proxy::headers::{ADDED_FIELDS, known_name};
use super::{MAX_REQUEST_HEAD_BYTES, Memo, State};

/// Header fields a request head may have (hyper's limit as well).
pub const MAX_HEADERS: usize = 100;
/// Response bytes gathered before a write.
const WRITE_BATCH: usize = 16 * 1024;
/// Bytes read at a time.
const READ_CHUNK: usize = 8 * 1024;
/// Spare room below which the read buffer grows before a read.
const MIN_READ_ROOM: usize = 1024;

/// The empty body of a plain request.
type NoBody = http_body_util::combinators::MapErr<
    http_body_util::Empty<Bytes>,
    fn(std::convert::Infallible) -> hyper::Error,
>;

fn no_body() -> NoBody {
    fn never(e: std::convert::Infallible) -> hyper::Error {
        match e {}
    }
    http_body_util::Empty::new().map_err(never as fn(_) -> _)
}

/// Room to read into. The buffer grows only when less than
/// [`MIN_READ_ROOM`] is left: growing it before every read, while the
/// request in progress still holds the head split off its front, took a
/// new buffer (and a shared one at the next split) on every request.
fn make_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < MIN_READ_ROOM {
        buf.reserve(READ_CHUNK);
    }
}

/// How the router's part of a connection ended.
pub enum Served<S> {
    /// The connection is done (closed, timed out, drained or failed).
    Closed,
    /// A request the router does not serve itself: hyper serves the
    /// connection from here, starting with these bytes.
    HandOver(S, Vec<u8>),
}

/// One client connection, served until it closes or is handed over.
pub struct Connection<'a> {
    pub state: &'a State,
    pub memo: &'a Memo,
    pub idle_timeout: Duration,
    pub drain: Latch,
}

impl Connection<'_> {
    /// Serves `io`, whose first bytes `prefix` were read already.
    ///
    /// # Errors
    /// A failed read or write (the client reset, or stopped reading for
    /// the write timeout).
    pub async fn serve<S>(self, mut io: S, prefix: Vec<u8>) -> io::Result<Served<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut buf = BytesMut::with_capacity(READ_CHUNK.max(prefix.len()));
        buf.extend_from_slice(&prefix);
        let mut out = Vec::with_capacity(WRITE_BATCH);
        let mut idle = IdleTimer::new(self.idle_timeout);
        // The request timeout's timer, kept for the connection's requests.
        let mut timer = Deadline::new(Instant::now());
        let mut drained = self.drain.wait();
        // The client ended its input (its requests already read are still
        // answered).
        let mut eof = false;
        loop {
            idle.restart();
            // The next request head, complete in `buf`.
            let head = loop {
                match parse(&buf) {
                    Parsed::Complete(len) if len <= MAX_REQUEST_HEAD_BYTES => break len,
                    // Too large (hyper answers it 431), or refused by httparse
                    // (hyper answers it 400).
                    Parsed::Complete(_) | Parsed::Other => return Ok(Served::HandOver(io, buf.to_vec())),
                    Parsed::Partial if buf.len() > MAX_REQUEST_HEAD_BYTES => {
                        return Ok(Served::HandOver(io, buf.to_vec()));
                    }
                    Parsed::Partial => {}
                }
                if eof {
                    return Ok(Served::Closed);
                }
                make_room(&mut buf);
                tokio::select! {
                    biased;
                    r = io.read_buf(&mut buf) => {
                        if r? == 0 {
                            eof = true;
                        }
                    }
                    () = &mut drained, if buf.is_empty() => return Ok(Served::Closed),
                    timed_out = idle.expired() => if timed_out {
                        return Ok(Served::Closed);
                    },
                }
            };
            let bytes = buf.split_to(head).freeze();
            let (request, close) = match plain(&bytes) {
                Some(plain) => plain,
                None => {
                    let mut rest = bytes.to_vec();
                    rest.extend_from_slice(&buf);
                    return Ok(Served::HandOver(io, rest));
                }
            };
            let head_request = request.method() == Method::HEAD;
            let handling = super::handle(self.state, self.memo, request, Some(&mut timer));
            let mut handling = std::pin::pin!(handling);
            // Read on while the request is handled: a reset drops it.
            let resp = loop {
                let reading = !eof && buf.len() <= MAX_REQUEST_HEAD_BYTES;
                if reading {
                    make_room(&mut buf);
                }
                tokio::select! {
                    biased;
                    resp = &mut handling => break resp,
                    r = io.read_buf(&mut buf), if reading => {
                        if r? == 0 {
                            eof = true;
                        }
                    }
                }
            };
            let close = close || self.drain.is_set();
            let keep = write_response(&mut io, &mut out, resp, head_request, close).await?;
            if !keep {
                io.shutdown().await?;
                return Ok(Served::Closed);
            }
        }
    }
}

/// The wait for a request head, on one [`Deadline`] per connection.
struct IdleTimer {
    timeout: Duration,
    deadline: Deadline,
}

impl IdleTimer {
    fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            deadline: Deadline::new(Instant::now() + timeout),
        }
    }

    /// The connection starts waiting for a request head.
    fn restart(&mut self) {
        self.deadline.set(Instant::now() + self.timeout);
    }

    /// Resolves `true` once the deadline has passed.
    fn expired(&mut self) -> impl Future<Output = bool> + '_ {
        std::future::poll_fn(|cx| self.deadline.poll_passed(cx).map(|()| true))
    }
}

/// A deadline a connection moves on request after request, on one timer:
/// armed at the first wait and moved only when it fires before the current
/// deadline, so a busy connection whose deadlines only move later does not
/// touch the timer wheel per request.
pub struct Deadline {
    at: Instant,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Deadline {
    fn new(at: Instant) -> Self {
        Self { at, sleep: None }
    }

    fn set(&mut self, at: Instant) {
        self.at = at;
    }

    /// Ready once the current deadline has passed.
    fn poll_passed(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let at = self.at;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        loop {
            if sleep.deadline() > at {
                // Moved earlier (rare): arm it again.
                sleep.as_mut().reset(at);
            }
            std::task::ready!(sleep.as_mut().poll(cx));
            if sleep.deadline() >= at {
                return std::task::Poll::Ready(());
            }
            // It fired at an earlier deadline: on to the current one.
            sleep.as_mut().reset(at);
        }
    }

    /// `fut`'s output, or `None` when `at` passes first.
    pub async fn within<F: Future>(&mut self, at: Instant, mut fut: Pin<&mut F>) -> Option<F::Output> {
        self.set(at);
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(out) = fut.as_mut().poll(cx) {
                return std::task::Poll::Ready(Some(out));
            }
            self.poll_passed(cx).map(|()| None)
        })
        .await
    }
}

/// What the bytes of a connection hold.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    /// A complete request head of this many bytes.
    Complete(usize),
    /// Not complete yet.
    Partial,
    /// Something httparse refuses (hyper answers it).
    Other,
}

/// Whether `buf` starts with a complete request head. A head is complete
/// at its blank line, found without parsing it: [`plain`] parses it once,
/// and hands a head httparse refuses to hyper then. Only bytes without a
/// blank line yet are parsed here, to tell a head still arriving from one
/// httparse refuses already (hyper answers that at once).
fn parse(buf: &[u8]) -> Parsed {
    if let Some(len) = head_len(buf) {
        return Parsed::Complete(len);
    }
    if buf.is_empty() {
        return Parsed::Partial;
    }
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    match httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, buf, &mut headers) {
        Ok(httparse::Status::Complete(n)) => Parsed::Complete(n),
        Ok(httparse::Status::Partial) => Parsed::Partial,
        Err(_) => Parsed::Other,
    }
}

/// The request in `head` (a complete head), if it is plain, and whether it
/// asks to close the connection after its answer; `None`: hyper's to serve.
fn plain(head: &Bytes) -> Option<(Request<NoBody>, bool)> {
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    if !matches!(
        httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, head, &mut headers),
        Ok(httparse::Status::Complete(_))
    ) {
        return None;
    }
    if req.version != Some(1) {
        return None;
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return None;
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return None;
    };
    if method == Method::CONNECT || !path.starts_with('/') {
        return None;
    }
    let Ok(uri) = Uri::from_maybe_shared(head.slice_ref(path.as_bytes())) else {
        return None;
    };
    // Room for the fields the proxy adds: the map does not grow on the way.
    let mut map = HeaderMap::with_capacity(req.headers.len() + ADDED_FIELDS);
    let mut close = false;
    for h in &*req.headers {
        let name = match known_name(h.name.as_bytes()) {
            Some(name) => name,
            None => match HeaderName::from_bytes(h.name.as_bytes()) {
                Ok(name) => name,
                Err(_) => return None,
            },
        };
        let Ok(value) = HeaderValue::from_maybe_shared(head.slice_ref(h.value)) else {
            return None;
        };
        match name {
            header::TRANSFER_ENCODING | header::UPGRADE | header::EXPECT => return None,
            header::CONTENT_LENGTH if value.as_bytes() != b"0" => return None,
            header::CONNECTION => close |= has_token(value.as_bytes(), b"close"),
            _ => {}
        }
        map.append(name, value);
    }
    let mut request = Request::new(no_body());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = map;
    Some((request, close))
}

/// Whether the comma-separated `list` names `token` (any case).
fn has_token(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// How a response body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (`HEAD`, `1xx`, `204`, `304`).
    None,
    /// This many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
}

/// What [`encode_head`] decided about the response.
#[derive(Debug)]
struct Encoded {
    framing: Framing,
    /// The connection closes after this response.
    close: bool,
    /// Trailer fields the response's `Trailer` names (only those are sent).
    trailers: Vec<HeaderName>,
}

/// Writes the status line and headers of a response to a `HEAD` request
/// (`head_request`) or another one into `out`, with the framing the body
/// needs (`exact`: its length, if known). `close`: the connection closes
/// after it, which the response says.
fn encode_head(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    exact: Option<u64>,
    head_request: bool,
    close: bool,
) -> Encoded {
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let no_length =
        status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let bodiless = no_length || head_request;
    let mut close = close || status.is_informational();
    let mut length = None;
    let mut date = false;
    let mut connection = false;
    let mut trailers = Vec::new();
    for (name, value) in headers {
        match *name {
            header::CONTENT_LENGTH => {
                if no_length || length.is_some() {
                    continue;
                }
                let Some(n) = std::str::from_utf8(value.as_bytes())
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                else {
                    continue;
                };
                length = Some(n);
            }
            // The framing is the router's to choose.
            header::TRANSFER_ENCODING => continue,
            header::CONNECTION => {
                connection = true;
                close |= has_token(value.as_bytes(), b"close");
            }
            header::DATE => date = true,
            header::TRAILER => {
                if bodiless {
                    continue;
                }
                if let Ok(v) = value.to_str() {
                    trailers.extend(
                        v.split(',')
                            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok()),
                    );
                }
            }
            _ => {}
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let framing = if bodiless {
        Framing::None
    } else if let Some(n) = length {
        Framing::Length(n)
    } else if let Some(n) = exact {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.extend_from_slice(b"\r\n");
        Framing::Length(n)
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Framing::Chunked
    };
    if close && !connection {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !date {
        out.extend_from_slice(b"date: ");
        date::extend(out);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if framing != Framing::Chunked {
        trailers.clear();
    }
    Encoded {
        framing,
        close,
        trailers,
    }
}

/// Writes `resp` to `io` (`out` is the write buffer). Returns whether the
/// connection stays open for the next request.
async fn write_response<S>(
    io: &mut S,
    out: &mut Vec<u8>,
    resp: Response<Body>,
    head_request: bool,
    close: bool,
) -> io::Result<bool>
where
    S: AsyncWrite + Unpin,
{
    let (parts, mut body) = resp.into_parts();
    out.clear();
    let exact = http_body::Body::size_hint(&body).exact();
    let encoded = encode_head(out, parts.status, &parts.headers, exact, head_request, close);
    let mut left = match encoded.framing {
        Framing::None => {
            io.write_all(out).await?;
            io.flush().await?;
            return Ok(!encoded.close);
        }
        Framing::Length(n) => Some(n),
        Framing::Chunked => None,
    };
    loop {
        if http_body::Body::is_end_stream(&body) {
            break;
        }
        // What the body has ready goes out with what is gathered; a wait
        // for more first sends what is gathered.
        let frame = match futures::FutureExt::now_or_never(body.frame()) {
            Some(f) => f,
            None => {
                if !out.is_empty() {
                    io.write_all(out).await?;
                    io.flush().await?;
                    out.clear();
                }
                body.frame().await
            }
        };
        let frame = match frame {
            None => break,
            Some(Ok(f)) => f,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "response body failed; closing the client connection");
                return Err(io::Error::other(e));
            }
        };
        match frame.into_data() {
            Ok(data) => {
                if data.is_empty() {
                    continue;
                }
                match &mut left {
                    Some(n) => {
                        let len = data.len() as u64;
                        if len > *n {
                            return Err(io::Error::other("response body longer than its content-length"));
                        }
                        *n -= len;
                        gather(io, out, &[], &data, b"").await?;
                    }
                    None => {
                        let mut size = [0u8; 18];
                        let size = chunk_size(&mut size, data.len());
                        gather(io, out, size, &data, b"\r\n").await?;
                    }
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers()
                    && left.is_none()
                {
                    out.extend_from_slice(b"0\r\n");
                    for (name, value) in &trailers {
                        if encoded.trailers.contains(name) {
                            out.extend_from_slice(name.as_str().as_bytes());
                            out.extend_from_slice(b": ");
                            out.extend_from_slice(value.as_bytes());
                            out.extend_from_slice(b"\r\n");
                        }
                    }
                    out.extend_from_slice(b"\r\n");
                    io.write_all(out).await?;
                    io.flush().await?;
                    out.clear();
                    return Ok(!encoded.close);
                }
            }
        }
    }
    match left {
        Some(0) => {}
        Some(n) => {
            return Err(io::Error::other(format!(
                "response body ended {n} bytes short of its content-length"
            )));
        }
        None => out.extend_from_slice(b"0\r\n\r\n"),
    }
    io.write_all(out).await?;
    io.flush().await?;
    out.clear();
    Ok(!encoded.close)
}

/// Adds `prefix`, `data` and `suffix` to the gathered bytes; large data is
/// written at once, without a copy.
async fn gather<S>(io: &mut S, out: &mut Vec<u8>, prefix: &[u8], data: &[u8], suffix: &[u8]) -> io::Result<()>
where
    S: AsyncWrite + Unpin,
{
    if out.len() + data.len() <= WRITE_BATCH {
        out.extend_from_slice(prefix);
        out.extend_from_slice(data);
        out.extend_from_slice(suffix);
        return Ok(());
    }
    out.extend_from_slice(prefix);
    io.write_all(out).await?;
    out.clear();
    io.write_all(data).await?;
    out.extend_from_slice(suffix);
    Ok(())
}

/// `"<size in hex>\r\n"` in `buf`.
fn chunk_size(buf: &mut [u8; 18], len: usize) -> &[u8] {
    use std::io::Write as _;
    let mut w = &mut buf[..];
    let _ = write!(w, "{len:x}\r\n");
    let left = w.len();
    &buf[..18 - left]
}

/// The `Date` header's value, formatted once per second per thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    /// `Sun, 06 Nov 1994 08:49:37 GMT`.
    const LEN: usize = 29;

    thread_local! {
        static CACHED: RefCell<(u64, [u8; LEN])> = const { RefCell::new((u64::MAX, [0; LEN])) };
    }

    pub fn extend(out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        CACHED.with(|c| {
            let mut c = c.borrow_mut();
            if c.0 != secs {
                let s = httpdate::fmt_http_date(now);
                if s.len() == LEN {
                    c.1.copy_from_slice(s.as_bytes());
                    c.0 = secs;
                } else {
                    out.extend_from_slice(s.as_bytes());
                    return;
                }
            }
            out.extend_from_slice(&c.1);
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn head_of(req: &str) -> Option<(Request<NoBody>, bool)> {
        let bytes = Bytes::copy_from_slice(req.as_bytes());
        assert!(
            matches!(parse(&bytes), Parsed::Complete(n) if n == bytes.len()),
            "{req:?}"
        );
        plain(&bytes)
    }

    #[test]
    fn only_plain_bodiless_http11_requests_are_served_by_the_router() {
        let cases: [(&str, Option<bool>); 14] = [
            ("GET / HTTP/1.1\r\nhost: a\r\n\r\n", Some(false)),
            (
                "GET /a?b=c HTTP/1.1\r\nhost: a\r\nconnection: keep-alive, Close\r\n\r\n",
                Some(true),
            ),
            (
                "DELETE /x HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\n\r\n",
                Some(false),
            ),
            ("HEAD /x HTTP/1.1\r\nhost: a\r\n\r\n", Some(false)),
            ("GET / HTTP/1.0\r\nhost: a\r\n\r\n", None),
            ("POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\n\r\n", None),
            (
                "POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n",
                None,
            ),
            (
                "GET / HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
                None,
            ),
            (
                "PUT / HTTP/1.1\r\nhost: a\r\nexpect: 100-continue\r\ncontent-length: 0\r\n\r\n",
                None,
            ),
            ("CONNECT a:443 HTTP/1.1\r\nhost: a:443\r\n\r\n", None),
            ("GET http://a/x HTTP/1.1\r\nhost: a\r\n\r\n", None),
            ("OPTIONS * HTTP/1.1\r\nhost: a\r\n\r\n", None),
            ("GET / HTTP/1.1\r\nhost: a\r\ncontent-length: 00\r\n\r\n", None),
            ("GET /x HTTP/1.1\r\nx-a: 1\r\nx-a: 2\r\n\r\n", Some(false)),
        ];
        for (req, want) in cases {
            match (head_of(req), want) {
                (Some((request, close)), Some(c)) => {
                    assert_eq!(close, c, "{req:?}");
                    assert_eq!(request.version(), Version::HTTP_11);
                    assert!(request.uri().path().starts_with('/'), "{req:?}");
                    assert!(http_body::Body::is_end_stream(request.body()));
                }
                (None, None) => {}
                (Some(_), None) => panic!("{req:?} must go to hyper"),
                (None, Some(_)) => panic!("{req:?} is plain"),
            }
        }
        let (request, _) = head_of("GET /x HTTP/1.1\r\nx-a: 1\r\nX-A: 2\r\n\r\n").unwrap();
        let v: Vec<_> = request.headers().get_all("x-a").iter().collect();
        assert_eq!(v, ["1", "2"]);
    }

    #[test]
    fn heads_httparse_refuses_or_too_many_fields_go_to_hyper() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\nhost: a\r\n"), Parsed::Partial);
        // Refused before its end: at once.
        assert_eq!(parse(b"GET / HTTP/1.1\r\nbad header\r\n"), Parsed::Other);
        // Complete: the one parse (`plain`) refuses it.
        let bad = b"GET / HTTP/1.1\r\nbad header\r\n\r\n";
        assert_eq!(parse(bad), Parsed::Complete(bad.len()));
        assert!(plain(&Bytes::from_static(bad)).is_none());
        let mut many = String::from("GET / HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            many.push_str(&format!("x-{i}: v\r\n"));
        }
        many.push_str("\r\n");
        assert_eq!(parse(many.as_bytes()), Parsed::Complete(many.len()));
        assert!(plain(&Bytes::from(many)).is_none());
    }

    /// What httparse makes of `buf`, as [`Parsed`].
    fn httparse_says(buf: &[u8]) -> Parsed {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        match httparse::Request::new(&mut headers).parse(buf) {
            Ok(httparse::Status::Complete(n)) => Parsed::Complete(n),
            Ok(httparse::Status::Partial) => Parsed::Partial,
            Err(_) => Parsed::Other,
        }
    }

    #[test]
    fn a_head_ends_where_httparse_ends_it_at_every_cut() {
        // A head, and whether the router serves it itself (HTTP/1.1).
        let heads: [(&[u8], bool); 9] = [
            (b"GET / HTTP/1.1\r\nhost: a\r\n\r\n", true),
            (b"\r\nGET / HTTP/1.1\r\nhost: a\r\n\r\n", true),
            (b"\r\n\n\r\nGET / HTTP/1.1\r\nhost: a\r\n\r\n", true),
            (
                b"GET /x?y=1 HTTP/1.1\r\nhost: a\r\nx-skipper-function: {\"a\":1}\r\naccept: */*\r\n\r\n",
                true,
            ),
            (b"GET / HTTP/1.1\nhost: a\n\n", true),
            (b"GET / HTTP/1.1\r\nhost: a\n\r\n", true),
            (b"GET / HTTP/1.1\nhost: a\r\n\n", true),
            (b"GET / HTTP/1.1\r\n\r\n", true),
            (b"HEAD /h HTTP/1.0\r\nx-empty:\r\nx-tab: a\tb\r\n\r\n", false),
        ];
        for (head, served) in heads {
            // Alone, followed by a pipelined request, and cut anywhere.
            let mut pipelined = head.to_vec();
            pipelined.extend_from_slice(b"GET /next HTTP/1.1\r\nhost: b\r\n\r\n");
            for bytes in [head, &pipelined[..]] {
                for cut in 0..=bytes.len() {
                    let part = &bytes[..cut];
                    let want = httparse_says(part);
                    assert_eq!(parse(part), want, "{:?}", String::from_utf8_lossy(part));
                    if let Parsed::Complete(n) = want {
                        assert_eq!(n, head.len());
                        let request = plain(&Bytes::copy_from_slice(&part[..n]));
                        assert_eq!(request.is_some(), served, "{:?}", String::from_utf8_lossy(head));
                    }
                }
            }
        }
        // Complete heads httparse refuses are complete here too; the one
        // parse refuses them.
        for bad in [
            &b"GET / HTTP/1.1\r\nbad header\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nx: \x01\r\n\r\n",
            b"GET / HTTP/1.1\r\n folded: a\r\n\r\n",
            b"G@T / HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(httparse_says(bad), Parsed::Other);
            assert!(
                matches!(parse(bad), Parsed::Complete(_) | Parsed::Other),
                "{bad:?}"
            );
            assert!(plain(&Bytes::copy_from_slice(bad)).is_none(), "{bad:?}");
        }
    }

    fn encoded(
        status: u16,
        headers: &[(&str, &str)],
        exact: Option<u64>,
        head: bool,
        close: bool,
    ) -> (String, Encoded) {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        let mut out = Vec::new();
        let e = encode_head(
            &mut out,
            StatusCode::from_u16(status).unwrap(),
            &map,
            exact,
            head,
            close,
        );
        (String::from_utf8(out).unwrap(), e)
    }

    #[test]
    fn the_response_head_frames_the_body_as_hyper_does() {
        let date = ("date", "Sun, 06 Nov 1994 08:49:37 GMT");
        // (status, headers, exact, HEAD?, close) → framing, lines present, lines absent
        type Case<'a> = (
            u16,
            Vec<(&'a str, &'a str)>,
            Option<u64>,
            bool,
            bool,
            Framing,
            Vec<&'a str>,
            Vec<&'a str>,
        );
        let cases: Vec<Case<'_>> = vec![
            (
                200,
                vec![date, ("content-length", "5")],
                Some(5),
                false,
                false,
                Framing::Length(5),
                vec!["HTTP/1.1 200 OK", "content-length: 5"],
                vec!["connection"],
            ),
            (
                200,
                vec![date],
                Some(3),
                false,
                false,
                Framing::Length(3),
                vec!["content-length: 3"],
                vec!["transfer-encoding"],
            ),
            (
                200,
                vec![date],
                None,
                false,
                false,
                Framing::Chunked,
                vec!["transfer-encoding: chunked"],
                vec!["content-length"],
            ),
            (
                200,
                vec![date, ("transfer-encoding", "gzip, chunked")],
                None,
                false,
                false,
                Framing::Chunked,
                vec!["transfer-encoding: chunked"],
                vec!["gzip"],
            ),
            (
                200,
                vec![date, ("content-length", "7")],
                Some(0),
                true,
                false,
                Framing::None,
                vec!["content-length: 7"],
                vec!["transfer-encoding"],
            ),
            (
                200,
                vec![date],
                Some(0),
                true,
                false,
                Framing::None,
                vec![],
                vec!["content-length", "transfer-encoding"],
            ),
            (
                204,
                vec![date, ("content-length", "0")],
                Some(0),
                false,
                false,
                Framing::None,
                vec!["HTTP/1.1 204 No Content"],
                vec!["content-length", "transfer-encoding"],
            ),
            (
                304,
                vec![date],
                None,
                false,
                false,
                Framing::None,
                vec!["HTTP/1.1 304 Not Modified"],
                vec!["content-length", "transfer-encoding"],
            ),
            (
                503,
                vec![date],
                Some(4),
                false,
                true,
                Framing::Length(4),
                vec!["HTTP/1.1 503 Service Unavailable", "connection: close"],
                vec![],
            ),
            (
                200,
                vec![date, ("connection", "close")],
                Some(1),
                false,
                false,
                Framing::Length(1),
                vec!["connection: close"],
                vec![],
            ),
            (
                200,
                vec![],
                Some(1),
                false,
                false,
                Framing::Length(1),
                vec!["date: "],
                vec![],
            ),
        ];
        for (status, headers, exact, head, close, framing, present, absent) in cases {
            let (text, e) = encoded(status, &headers, exact, head, close);
            assert!(text.ends_with("\r\n\r\n"), "{text:?}");
            assert_eq!(e.framing, framing, "{text:?}");
            assert_eq!(e.close, close || text.contains("connection: close"), "{text:?}");
            for p in present {
                assert!(text.contains(p), "{p:?} in {text:?}");
            }
            for a in absent {
                assert!(!text.contains(a), "{a:?} not in {text:?}");
            }
            assert_eq!(text.matches("date: ").count(), 1, "{text:?}");
        }
        let (_, e) = encoded(
            200,
            &[("trailer", "grpc-status, grpc-message")],
            None,
            false,
            false,
        );
        assert_eq!(e.trailers, ["grpc-status", "grpc-message"]);
        let (_, e) = encoded(200, &[("trailer", "grpc-status")], Some(2), false, false);
        assert!(e.trailers.is_empty(), "a body with a length has no trailers");
    }

    async fn written(resp: Response<Body>, head: bool, close: bool) -> (String, bool) {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let mut out = Vec::new();
        let keep = write_response(&mut a, &mut out, resp, head, close).await.unwrap();
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        (String::from_utf8(got).unwrap(), keep)
    }

    #[tokio::test]
    async fn bodies_are_written_with_their_length_or_chunked_with_the_named_trailers() {
        let (text, keep) = written(Response::new(Body::from("hello")), false, false).await;
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text:?}");
        assert!(
            text.ends_with("content-length: 5\r\n") || text.contains("content-length: 5\r\n"),
            "{text:?}"
        );
        assert!(text.ends_with("\r\n\r\nhello"), "{text:?}");
        assert!(keep);

        // A streamed body with trailers, one named in `Trailer`.
        let frames: Vec<Result<http_body::Frame<Bytes>, std::convert::Infallible>> = vec![
            Ok(http_body::Frame::data(Bytes::from_static(b"ab"))),
            Ok(http_body::Frame::data(Bytes::from(vec![b'x'; 20]))),
            Ok(http_body::Frame::trailers({
                let mut t = HeaderMap::new();
                t.insert("grpc-status", HeaderValue::from_static("0"));
                t.insert("x-secret", HeaderValue::from_static("no"));
                t
            })),
        ];
        let body = Body::new(http_body_util::StreamBody::new(futures::stream::iter(frames)));
        let mut resp = Response::new(body);
        resp.headers_mut()
            .insert("trailer", HeaderValue::from_static("grpc-status"));
        let (text, keep) = written(resp, false, true).await;
        assert!(text.contains("transfer-encoding: chunked\r\n"), "{text:?}");
        assert!(text.contains("connection: close\r\n"), "{text:?}");
        let body = text.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(
            body,
            format!(
                "2\r\nab\r\n14\r\n{}\r\n0\r\ngrpc-status: 0\r\n\r\n",
                "x".repeat(20)
            )
        );
        assert!(!keep);

        // A large body goes out whole, without a length it is chunked.
        let big = Bytes::from(vec![b'y'; 100_000]);
        let frames: Vec<Result<http_body::Frame<Bytes>, std::convert::Infallible>> =
            vec![Ok(http_body::Frame::data(big.clone()))];
        let body = Body::new(http_body_util::StreamBody::new(futures::stream::iter(frames)));
        let (text, _) = written(Response::new(body), false, false).await;
        let body = text.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(body.len(), 100_000 + "186a0\r\n".len() + "\r\n0\r\n\r\n".len());
        assert!(body.starts_with("186a0\r\nyyy"), "{}", &body[..10]);

        // HEAD: the head only.
        let mut resp = Response::new(Body::empty());
        resp.headers_mut()
            .insert("content-length", HeaderValue::from_static("11"));
        let (text, keep) = written(resp, true, false).await;
        assert!(
            text.ends_with("content-length: 11\r\n") || text.ends_with("\r\n\r\n"),
            "{text:?}"
        );
        assert!(text.contains("content-length: 11\r\n"), "{text:?}");
        assert!(keep);
    }

    #[tokio::test]
    async fn a_body_shorter_or_longer_than_its_length_fails_the_connection() {
        for (declared, actual) in [(10, 5), (3, 5)] {
            let mut resp = Response::new(Body::from(vec![b'z'; actual]));
            resp.headers_mut()
                .insert("content-length", HeaderValue::from(declared));
            let (mut a, _b) = tokio::io::duplex(1 << 16);
            let mut out = Vec::new();
            let err = write_response(&mut a, &mut out, resp, false, false)
                .await
                .unwrap_err();
            assert!(err.to_string().contains("content-length"), "{err}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_runs_each_request_to_its_own_end_on_one_timer() {
        let mut d = Deadline::new(Instant::now());
        let start = Instant::now();
        // Done before its deadline: the output.
        let mut quick = std::pin::pin!(tokio::time::sleep(Duration::from_secs(1)));
        let out = d.within(start + Duration::from_secs(10), quick.as_mut()).await;
        assert_eq!(out, Some(()));
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        // The next request's deadline is later: the timer, armed at 10 s,
        // fires there and moves on to 21 s.
        let mut slow = std::pin::pin!(std::future::pending::<()>());
        let out = d.within(start + Duration::from_secs(21), slow.as_mut()).await;
        assert_eq!(out, None);
        assert_eq!(start.elapsed(), Duration::from_secs(21));
        // An earlier deadline than the armed one is kept too.
        let at = Instant::now() + Duration::from_secs(5);
        let mut other = std::pin::pin!(std::future::pending::<()>());
        {
            let arming = std::pin::pin!(d.within(Instant::now() + Duration::from_secs(100), other.as_mut()));
            assert!(futures::poll!(arming).is_pending());
        }
        let out = d.within(at, other.as_mut()).await;
        assert_eq!(out, None);
        assert_eq!(Instant::now(), at);
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_timer_fires_at_the_latest_deadline_only() {
        let mut t = IdleTimer::new(Duration::from_secs(60));
        let start = Instant::now();
        // Restarted after 50 s: the first arming (at 60 s) moves on to 110 s.
        let expired = t.expired();
        let waited = tokio::time::timeout(Duration::from_secs(50), expired).await;
        assert!(waited.is_err());
        t.restart();
        assert!(t.expired().await);
        assert_eq!(start.elapsed(), Duration::from_secs(110));
    }

    #[test]
    fn a_plain_request_map_has_room_for_the_fields_the_proxy_adds() {
        use crate::router::proxy::headers;
        for n in 0..=40 {
            for forwarded in [false, true] {
                let mut req = String::from("GET / HTTP/1.1\r\nhost: a\r\nX-Skipper-Function: {}\r\n");
                if forwarded {
                    req.push_str("x-forwarded-for: 192.0.2.1\r\nforwarded: for=192.0.2.1\r\n");
                }
                for i in 0..n {
                    req.push_str(&format!("x-{i}: v\r\n"));
                }
                req.push_str("\r\n");
                let (request, _) = head_of(&req).expect("plain");
                let mut fields = request.into_parts().0.headers;
                assert!(
                    fields.contains_key(&headers::FUNCTION),
                    "the function header by its known name"
                );
                let room = fields.capacity();
                let node = HeaderValue::from_static("203.0.113.5");
                headers::rewrite_from(&mut fields, Some(&node), forwarded, None);
                fields.insert("traceparent", HeaderValue::from_static("00-0-0-01"));
                fields.insert("tracestate", HeaderValue::from_static("a=b"));
                assert_eq!(
                    fields.capacity(),
                    room,
                    "the map grew: {n} fields, forwarded {forwarded}"
                );
            }
        }
    }

    #[test]
    fn the_read_buffer_is_kept_while_a_request_holds_its_head() {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        buf.extend_from_slice(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        let head = buf.split_to(buf.len()).freeze();
        let spare = buf.as_ptr();
        make_room(&mut buf);
        assert_eq!(buf.as_ptr(), spare, "a new buffer while the head is held");
        drop(head);
        // Nearly full: it grows.
        buf.extend_from_slice(&vec![b'x'; buf.capacity() - buf.len() - 10]);
        make_room(&mut buf);
        assert!(buf.capacity() - buf.len() >= READ_CHUNK);
    }

    #[test]
    fn chunk_sizes_are_hex() {
        let mut b = [0u8; 18];
        assert_eq!(chunk_size(&mut b, 0), b"0\r\n");
        assert_eq!(chunk_size(&mut b, 255), b"ff\r\n");
        assert_eq!(
            chunk_size(&mut b, usize::MAX),
            format!("{:x}\r\n", usize::MAX).as_bytes()
        );
    }

    #[test]
    fn the_date_is_an_imf_fixdate() {
        let mut out = Vec::new();
        date::extend(&mut out);
        let s = String::from_utf8(out).unwrap();
        assert_eq!(s.len(), 29, "{s}");
        assert!(httpdate::parse_http_date(&s).is_ok(), "{s}");
    }
}
