//! HTTP/1.1 exchanges the router writes and reads itself, inside the
//! request's own task: for a request without a body to an instance whose
//! pool speaks HTTP/1.1 (most requests).
//!
//! hyper's client runs each instance connection as a task of its own and
//! hands requests and responses to it over channels: every request then
//! crosses tasks twice, each crossing a wake-up. Here the request's task
//! writes the request head on a kept connection, reads and parses the
//! response head (httparse) and reads the body as the client takes it
//! ([`DirectBody`]). The connection goes back to the instance's slot once
//! the body has been read to its end; a body dropped before its end closes
//! it. Requests with a body, upgrades, HTTP/1.0 clients and h2c instances go
//! through hyper's client ([`super::upstream`]).
//!
//! Responses are framed as RFC 9112 §6.3 says: no body for `HEAD`, `204` and
//! `304`; `Transfer-Encoding` ending in `chunked` is decoded (a
//! `Content-Length` beside it is dropped); any other `Transfer-Encoding`, or
//! neither header, reads until the instance closes; a `Content-Length`
//! whose values disagree or do not parse fails the response. Interim `1xx`
//! responses are skipped (a `101` nobody asked for fails the response). A
//! response head larger than [`MAX_HEAD_BYTES`] or with more than
//! [`MAX_HEADERS`] fields fails, as in hyper's client.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Version, header};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::forwarding::Forwarding;
use crate::router::instances::Slot;

/// Largest response head read (hyper's client default buffer).
pub const MAX_HEAD_BYTES: usize = 400 * 1024;
/// Most header fields in a response head (hyper's client default).
pub const MAX_HEADERS: usize = 100;
/// Longest chunk-size line (with extensions) or trailer section.
const MAX_CHUNK_LINE: usize = 4096;
const MAX_TRAILERS: usize = 64 * 1024;
/// How much is read from an instance at a time.
const READ_CHUNK: usize = 16 * 1024;

/// An HTTP/1.1 exchange with an instance failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("connection closed before the response began")]
    ClosedBeforeResponse,
    #[error("connection failed before the response began: {0}")]
    ResetBeforeResponse(#[source] io::Error),
    #[error("reading the response failed: {0}")]
    Io(#[source] io::Error),
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("response head larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("response Content-Length {0:?} is not one valid length")]
    Length(String),
    #[error("malformed chunked response body: {0}")]
    Chunk(&'static str),
    #[error("connection closed with {left} bytes of the response body still to come")]
    Truncated { left: u64 },
    #[error("connection closed inside a chunked response body")]
    TruncatedChunked,
    #[error("instance switched protocols (101) without being asked to")]
    UnaskedSwitch,
}

impl ExchangeError {
    /// Whether nothing of a response arrived: the instance's end closed or
    /// reset the connection first.
    #[must_use]
    pub fn before_response(&self) -> bool {
        matches!(self, Self::ClosedBeforeResponse | Self::ResetBeforeResponse(_))
    }
}

/// A kept HTTP/1.1 connection to an instance: the socket and what was read
/// from it beyond the last message (nothing, on a well-behaved instance).
#[derive(Debug)]
pub struct DirectConn {
    stream: TcpStream,
    buf: BytesMut,
    since: Instant,
}

impl DirectConn {
    /// A new connection over `stream`.
    #[must_use]
    pub fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: BytesMut::new(),
            since: Instant::now(),
        }
    }

    /// Whether a kept connection can take a request: younger than
    /// `max_idle` and with nothing to read (an instance that closed it, or
    /// sent bytes nobody asked for, made it readable). The readiness the
    /// runtime already knows is checked, without a system call unless the
    /// socket became readable.
    pub(super) fn usable(&self, max_idle: std::time::Duration) -> bool {
        if self.since.elapsed() >= max_idle || !self.buf.is_empty() {
            return false;
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// Writes `head` (a request without a body) on `conn` and reads the
/// response head. `method` frames the body (`HEAD`).
///
/// # Errors
/// [`ExchangeError`]; [`ExchangeError::before_response`] tells apart a
/// connection that failed before any response byte.
pub async fn exchange(
    mut conn: DirectConn,
    head: &[u8],
    method: &Method,
    slot: Arc<Slot>,
) -> Result<Response<DirectBody>, ExchangeError> {
    if let Err(e) = conn.stream.write_all(head).await {
        return Err(ExchangeError::ResetBeforeResponse(e));
    }
    let mut received = false;
    loop {
        if let Some(len) = head_len(&conn.buf) {
            // The head's field values are slices of it (no copies).
            let head = conn.buf.split_to(len).freeze();
            let Some((parts, framing, keep_alive)) = parse_head(&head, method)? else {
                // An interim response: the final one follows.
                continue;
            };
            let body = DirectBody {
                conn: Some(conn),
                framing,
                keep_alive,
                slot,
                trailers: None,
                hint: parts.2,
            };
            let mut resp = Response::new(body);
            *resp.status_mut() = parts.0;
            *resp.headers_mut() = parts.1;
            *resp.version_mut() = Version::HTTP_11;
            return Ok(resp);
        }
        if conn.buf.len() >= MAX_HEAD_BYTES {
            return Err(ExchangeError::HeadTooLarge);
        }
        if !conn.buf.is_empty() {
            // No blank line yet: a head httparse refuses already fails now.
            refused_early(&conn.buf)?;
        }
        conn.buf.reserve(READ_CHUNK);
        match conn.stream.read_buf(&mut conn.buf).await {
            Ok(0) if !received => return Err(ExchangeError::ClosedBeforeResponse),
            Ok(0) => {
                return Err(ExchangeError::Head(
                    "connection closed inside the response head".into(),
                ));
            }
            Ok(_) => received = true,
            Err(e) if !received => return Err(ExchangeError::ResetBeforeResponse(e)),
            Err(e) => return Err(ExchangeError::Io(e)),
        }
    }
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    /// Bytes still to come.
    Length(u64),
    Chunked(Chunk),
    UntilClose,
}

/// Where a chunked body's decoder stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line comes next.
    Size,
    /// Bytes of the current chunk still to come.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer fields until an empty line.
    Trailers,
    Done,
}

/// Status, headers and the body's size hint of a final response.
type Head = (StatusCode, HeaderMap, SizeHint);
/// A final response head, its body's framing and whether the connection
/// stays open after it; `None` for an interim `1xx`.
type Parsed = Option<(Head, Framing, bool)>;

/// Parses a complete response head ([`head_len`]'s bytes): the response
/// (`None` for an interim `1xx`) with its framing and whether the
/// connection stays open. Field values are slices of `head`.
fn parse_head(head: &Bytes, method: &Method) -> Result<Parsed, ExchangeError> {
    // Uninitialized slots: the parser writes only the fields it finds
    // (initializing all 100 showed in profiles).
    let mut fields = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut parsed, head, &mut fields)
    {
        Ok(httparse::Status::Complete(_)) => {}
        // A blank line where the status line belongs.
        Ok(httparse::Status::Partial) => return Err(ExchangeError::Head("no status line".into())),
        Err(e) => return Err(head_refused(e)),
    }
    let code = parsed.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|_| ExchangeError::Head(format!("status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(ExchangeError::UnaskedSwitch);
    }
    if status.is_informational() {
        return Ok(None);
    }
    let http10 = parsed.version == Some(0);
    // Room for the header the proxy adds to every response
    // (`X-Skipper-Get-Instance-Duration-Ms`): a full map would grow, a
    // reallocation and a rehash on most responses.
    let mut headers = HeaderMap::with_capacity(parsed.headers.len() + 1);
    let mut length: Option<u64> = None;
    let mut chunked = None;
    let mut close = false;
    let mut keep_alive_asked = false;
    for f in parsed.headers.iter() {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| ExchangeError::Head(format!("header name {:?}", f.name)))?;
        let value = HeaderValue::from_maybe_shared(head.slice_ref(f.value))
            .map_err(|_| ExchangeError::Head(format!("value of header {:?}", f.name)))?;
        if name == header::CONTENT_LENGTH {
            for part in f.value.split(|b| *b == b',') {
                let text = std::str::from_utf8(part).unwrap_or_default().trim();
                let n: u64 = text
                    .parse()
                    .ok()
                    .filter(|_| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| ExchangeError::Length(String::from_utf8_lossy(f.value).into_owned()))?;
                if length.is_some_and(|l| l != n) {
                    return Err(ExchangeError::Length(
                        String::from_utf8_lossy(f.value).into_owned(),
                    ));
                }
                length = Some(n);
            }
        } else if name == header::TRANSFER_ENCODING {
            // The last coding decides (RFC 9112 §6.3).
            let last = f.value.rsplit(|b| *b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name == header::CONNECTION {
            for token in f.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                close |= token.eq_ignore_ascii_case(b"close");
                keep_alive_asked |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        }
        headers.append(name, value);
    }
    let mut keep_alive = !close && (!http10 || keep_alive_asked);
    let framing = if *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Empty
    } else if let Some(chunked) = chunked {
        // A length beside a transfer coding is not to be trusted.
        headers.remove(header::CONTENT_LENGTH);
        if chunked {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        }
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    if framing == Framing::UntilClose {
        keep_alive = false;
    }
    let hint = match framing {
        Framing::Empty => SizeHint::with_exact(0),
        Framing::Length(n) => SizeHint::with_exact(n),
        _ => SizeHint::default(),
    };
    Ok(Some(((status, headers, hint), framing, keep_alive)))
}

/// httparse's refusal of a response head, said as the exchange's error.
fn head_refused(e: httparse::Error) -> ExchangeError {
    match e {
        httparse::Error::TooManyHeaders => {
            ExchangeError::Head(format!("more than {MAX_HEADERS} header fields"))
        }
        e => ExchangeError::Head(e.to_string()),
    }
}

/// Fails a response head that is not complete yet when httparse refuses
/// what has arrived of it already.
fn refused_early(buf: &[u8]) -> Result<(), ExchangeError> {
    let mut fields = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut parsed, buf, &mut fields)
    {
        Ok(_) => Ok(()),
        Err(e) => Err(head_refused(e)),
    }
}

/// The length of the message head `buf` starts with, through its blank
/// line (a line feed followed by a line feed, or by a carriage return and a
/// line feed: the line ends httparse takes), if it holds one yet. Empty
/// lines before the start line belong to the head, as httparse skips them.
/// Found without parsing the head, which is then parsed once, whole.
#[must_use]
pub fn head_len(buf: &[u8]) -> Option<usize> {
    let mut from = 0;
    loop {
        match &buf[from..] {
            [b'\r', b'\n', ..] => from += 2,
            [b'\n', ..] => from += 1,
            _ => break,
        }
    }
    while let Some(at) = memchr::memchr(b'\n', &buf[from..]) {
        let lf = from + at;
        match &buf[lf + 1..] {
            [b'\n', ..] => return Some(lf + 2),
            [b'\r', b'\n', ..] => return Some(lf + 3),
            _ => from = lf + 1,
        }
    }
    None
}

/// An instance's response body read from its connection, which goes back
/// to the instance's slot once the body has been read to its end (when the
/// instance keeps it open).
#[derive(Debug)]
pub struct DirectBody {
    conn: Option<DirectConn>,
    framing: Framing,
    keep_alive: bool,
    slot: Arc<Slot>,
    /// Trailer fields of a chunked body, sent after its last data.
    trailers: Option<Box<HeaderMap>>,
    hint: SizeHint,
}

impl DirectBody {
    /// The body is done: keep the connection when it can take another
    /// request.
    fn finish(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if self.keep_alive && conn.buf.is_empty() {
            conn.since = Instant::now();
            self.slot.connections.put_direct(conn);
        }
    }

    /// Reads more of the body from the connection; `Ok(false)` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        let Some(conn) = self.conn.as_mut() else {
            return Poll::Ready(Ok(false));
        };
        conn.buf.reserve(READ_CHUNK);
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut conn.stream),
            cx,
            &mut conn.buf
        ))?;
        Poll::Ready(Ok(n > 0))
    }

    /// The next frame, or `None` at the end (the connection is then
    /// released).
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ExchangeError>>> {
        loop {
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(*t))));
            };
            match self.framing {
                Framing::Empty | Framing::Length(0) | Framing::Chunked(Chunk::Done) => {
                    self.finish();
                }
                Framing::Length(left) => {
                    if !conn.buf.is_empty() {
                        let n = usize::try_from(left).unwrap_or(usize::MAX).min(conn.buf.len());
                        self.framing = Framing::Length(left - n as u64);
                        self.hint = SizeHint::with_exact(left - n as u64);
                        let data = conn.buf.split_to(n).freeze();
                        if left == n as u64 {
                            self.finish();
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    match ready!(self.poll_fill(cx)) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.conn = None;
                            return Poll::Ready(Some(Err(ExchangeError::Truncated { left })));
                        }
                        Err(e) => {
                            self.conn = None;
                            return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                        }
                    }
                }
                Framing::UntilClose => {
                    if !conn.buf.is_empty() {
                        let data = conn.buf.split().freeze();
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    match ready!(self.poll_fill(cx)) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.conn = None;
                            return Poll::Ready(None);
                        }
                        Err(e) => {
                            self.conn = None;
                            return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                        }
                    }
                }
                Framing::Chunked(state) => match decode_chunked(state, &mut conn.buf, &mut self.trailers) {
                    Ok(Decoded::Data(next, data)) => {
                        self.framing = Framing::Chunked(next);
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    Ok(Decoded::Moved(next)) => self.framing = Framing::Chunked(next),
                    Ok(Decoded::NeedMore) => match ready!(self.poll_fill(cx)) {
                        Ok(true) => {}
                        Ok(false) => {
                            self.conn = None;
                            return Poll::Ready(Some(Err(ExchangeError::TruncatedChunked)));
                        }
                        Err(e) => {
                            self.conn = None;
                            return Poll::Ready(Some(Err(ExchangeError::Io(e))));
                        }
                    },
                    Err(e) => {
                        self.conn = None;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
            }
        }
    }
}

impl http_body::Body for DirectBody {
    type Data = Bytes;
    type Error = ExchangeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.get_mut().poll_next(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.trailers.is_none()
            && (self.conn.is_none()
                || matches!(
                    self.framing,
                    Framing::Empty | Framing::Length(0) | Framing::Chunked(Chunk::Done)
                ))
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

impl Drop for DirectBody {
    fn drop(&mut self) {
        // A body that needed no reading (HEAD, 204, 304, an empty one)
        // still frees its connection; an unfinished one closes it.
        if matches!(
            self.framing,
            Framing::Empty | Framing::Length(0) | Framing::Chunked(Chunk::Done)
        ) {
            self.finish();
        }
    }
}

/// One step of the chunked decoder.
#[derive(Debug, PartialEq, Eq)]
enum Decoded {
    /// Data of a chunk; the decoder is then at `.0`.
    Data(Chunk, Bytes),
    /// Framing consumed; the decoder is at `.0`.
    Moved(Chunk),
    /// More bytes are needed.
    NeedMore,
}

/// Decodes what `buf` holds of a chunked body from `state` (RFC 9112 §7.1);
/// trailer fields go to `trailers`.
fn decode_chunked(
    state: Chunk,
    buf: &mut BytesMut,
    trailers: &mut Option<Box<HeaderMap>>,
) -> Result<Decoded, ExchangeError> {
    match state {
        Chunk::Size => {
            let Some(end) = find_crlf(buf, MAX_CHUNK_LINE)? else {
                return Ok(Decoded::NeedMore);
            };
            let line = &buf[..end];
            let digits = line
                .iter()
                .position(|b| matches!(b, b';' | b' ' | b'\t'))
                .map_or(line, |i| &line[..i]);
            if digits.is_empty() || digits.len() > 15 {
                return Err(ExchangeError::Chunk("bad chunk size"));
            }
            let mut size: u64 = 0;
            for d in digits {
                let v = char::from(*d)
                    .to_digit(16)
                    .ok_or(ExchangeError::Chunk("bad chunk size"))?;
                size = size * 16 + u64::from(v);
            }
            buf.advance(end + 2);
            Ok(Decoded::Moved(if size == 0 {
                Chunk::Trailers
            } else {
                Chunk::Data(size)
            }))
        }
        Chunk::Data(left) => {
            if buf.is_empty() {
                return Ok(Decoded::NeedMore);
            }
            let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
            let data = buf.split_to(n).freeze();
            let next = if left == n as u64 {
                Chunk::DataEnd
            } else {
                Chunk::Data(left - n as u64)
            };
            Ok(Decoded::Data(next, data))
        }
        Chunk::DataEnd => {
            if buf.len() < 2 {
                return Ok(Decoded::NeedMore);
            }
            if &buf[..2] != b"\r\n" {
                return Err(ExchangeError::Chunk("chunk data not followed by CRLF"));
            }
            buf.advance(2);
            Ok(Decoded::Moved(Chunk::Size))
        }
        Chunk::Trailers => {
            // The whole trailer section, up to its empty line, at once.
            if buf.starts_with(b"\r\n") {
                buf.advance(2);
                return Ok(Decoded::Moved(Chunk::Done));
            }
            let Some(end) = find(buf, b"\r\n\r\n", MAX_TRAILERS)? else {
                return Ok(Decoded::NeedMore);
            };
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::parse_headers(&buf[..end + 4], &mut fields) {
                Ok(httparse::Status::Complete((_, parsed))) => {
                    let mut map = HeaderMap::with_capacity(parsed.len());
                    for f in parsed {
                        let (Ok(name), Ok(value)) = (
                            HeaderName::from_bytes(f.name.as_bytes()),
                            HeaderValue::from_bytes(f.value),
                        ) else {
                            return Err(ExchangeError::Chunk("bad trailer field"));
                        };
                        map.append(name, value);
                    }
                    *trailers = Some(Box::new(map));
                }
                _ => return Err(ExchangeError::Chunk("bad trailer section")),
            }
            buf.advance(end + 4);
            Ok(Decoded::Moved(Chunk::Done))
        }
        Chunk::Done => Ok(Decoded::Moved(Chunk::Done)),
    }
}

/// Where the first CRLF in `buf` starts, if within `limit` bytes.
fn find_crlf(buf: &[u8], limit: usize) -> Result<Option<usize>, ExchangeError> {
    find(buf, b"\r\n", limit)
}

fn find(buf: &[u8], needle: &[u8], limit: usize) -> Result<Option<usize>, ExchangeError> {
    match buf.windows(needle.len()).position(|w| w == needle) {
        Some(i) if i <= limit => Ok(Some(i)),
        Some(_) => Err(ExchangeError::Chunk("chunk line or trailers too long")),
        None if buf.len() > limit => Err(ExchangeError::Chunk("chunk line or trailers too long")),
        None => Ok(None),
    }
}

/// The request head for an exchange: request line, `headers` (without a
/// `Transfer-Encoding`: the request has no body), the `forwarding` fields
/// and `extra`, as hyper's client writes them (lower-case names).
pub fn write_head(
    out: &mut Vec<u8>,
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    forwarding: Option<&Forwarding>,
    extra: &[(&HeaderName, &HeaderValue)],
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let line = |out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue| {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in headers {
        if *name != header::TRANSFER_ENCODING {
            line(out, name, value);
        }
    }
    if let Some(f) = forwarding {
        f.write(out);
    }
    for (name, value) in extra {
        line(out, name, value);
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use http_body_util::BodyExt as _;

    /// Status, framing, keep-alive (`None`: an interim response).
    type Seen = Option<(u16, Framing, bool)>;

    /// What `parse_head` made of a head.
    fn parsed(head: &str, method: &Method) -> Result<Seen, String> {
        if head_len(head.as_bytes()) != Some(head.len()) {
            return Err("partial".into());
        }
        match parse_head(&Bytes::copy_from_slice(head.as_bytes()), method) {
            Ok(Some(((status, _, _), framing, keep))) => Ok(Some((status.as_u16(), framing, keep))),
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn response_heads_are_framed_as_rfc_9112_says() {
        use Framing::{Chunked, Empty, Length, UntilClose};
        let get = Method::GET;
        let head = Method::HEAD;
        let cases: [(&str, &Method, Result<Seen, &str>); 16] = [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
                &get,
                Ok(Some((200, Length(5), true))),
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n",
                &get,
                Ok(Some((200, Length(5), true))),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
                &head,
                Ok(Some((200, Empty, true))),
            ),
            (
                "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
                &get,
                Ok(Some((204, Empty, true))),
            ),
            (
                "HTTP/1.1 304 Not Modified\r\n\r\n",
                &get,
                Ok(Some((304, Empty, true))),
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
                &get,
                Ok(Some((200, Chunked(Chunk::Size), true))),
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
                &get,
                Ok(Some((200, UntilClose, false))),
            ),
            (
                "HTTP/1.1 200 OK\r\n\r\n",
                &get,
                Ok(Some((200, UntilClose, false))),
            ),
            (
                "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
                &get,
                Ok(Some((200, Length(0), false))),
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n",
                &get,
                Ok(Some((200, Length(0), false))),
            ),
            (
                "HTTP/1.0 200 OK\r\nconnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n",
                &get,
                Ok(Some((200, Length(0), true))),
            ),
            ("HTTP/1.1 100 Continue\r\n\r\n", &get, Ok(None)),
            (
                "HTTP/1.1 101 Switching Protocols\r\n\r\n",
                &get,
                Err("instance switched protocols (101) without being asked to"),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n",
                &get,
                Err("response Content-Length \"5, 6\" is not one valid length"),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n",
                &get,
                Err("response Content-Length \"+5\" is not one valid length"),
            ),
            ("HTTP/1.1 200 OK\r\ncontent-le", &get, Err("partial")),
        ];
        for (head, method, want) in cases {
            assert_eq!(parsed(head, method), want.map_err(str::to_owned), "{head:?}");
        }
    }

    #[test]
    fn a_length_beside_a_transfer_coding_is_dropped() {
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n";
        let Ok(Some(((_, headers, _), _, _))) = parse_head(&Bytes::from_static(head), &Method::GET) else {
            panic!("not parsed");
        };
        assert!(headers.get(header::CONTENT_LENGTH).is_none());
        assert_eq!(headers.get(header::TRANSFER_ENCODING).unwrap(), "chunked");
    }

    #[test]
    fn a_parsed_head_has_room_for_the_header_the_proxy_adds() {
        for n in 0..=40 {
            let mut head = String::from("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n");
            for i in 0..n {
                head.push_str(&format!("x-{i}: v\r\n"));
            }
            head.push_str("\r\n");
            let Ok(Some(((_, mut headers, _), _, _))) = parse_head(&Bytes::from(head.clone()), &Method::GET)
            else {
                panic!("not parsed: {head:?}");
            };
            let room = headers.capacity();
            headers.insert(
                super::super::headers::GET_INSTANCE_DURATION_MS,
                HeaderValue::from_static("0"),
            );
            assert_eq!(headers.capacity(), room, "the map grew for {} fields", n + 1);
        }
    }

    #[test]
    fn a_response_head_ends_where_httparse_ends_it_at_every_cut() {
        let heads: [&[u8]; 7] = [
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n",
            b"\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
            b"\n\r\n\nHTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.0 200 OK\nx: y\n\n",
            b"HTTP/1.1 204 No Content\r\ndate: Mon, 07 Dec 2026 19:00:00 GMT\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
        ];
        for head in heads {
            let mut followed = head.to_vec();
            followed.extend_from_slice(b"ok\r\n\r\nHTTP/1.1 200 OK\r\n\r\n");
            for bytes in [head, &followed[..]] {
                for cut in 0..=bytes.len() {
                    let part = &bytes[..cut];
                    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    let want = match httparse::Response::new(&mut fields).parse(part) {
                        Ok(httparse::Status::Complete(n)) => Some(n),
                        Ok(httparse::Status::Partial) => None,
                        Err(e) => panic!("{e}: {:?}", String::from_utf8_lossy(part)),
                    };
                    assert_eq!(head_len(part), want, "{:?}", String::from_utf8_lossy(part));
                    assert!(refused_early(part).is_ok());
                }
            }
        }
        // What httparse refuses before the head's end fails then.
        for early in [
            &b"HTTP/1.1 2x0 OK\r\n"[..],
            b"HTTP/1.1 200 OK\r\nbad header\r\n",
            b"HTTX",
        ] {
            assert!(refused_early(early).is_err(), "{early:?}");
        }
    }

    #[tokio::test]
    async fn a_head_refused_before_its_end_fails_at_once_and_interim_heads_are_passed_over() {
        // The instance keeps its connection open after these bytes.
        let addr = instance(b"HTTP/1.1 2x0 OK\r\n", false).await;
        let (_, resp) = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            exchange_with(addr, &Method::GET),
        )
        .await
        .expect("the refused head failed at once");
        assert!(matches!(resp, Err(ExchangeError::Head(_))), "{resp:?}");
        let addr = instance(
            b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-v: 1\r\n\r\nok",
            false,
        )
        .await;
        let (_, resp) = exchange_with(addr, &Method::GET).await;
        let resp = resp.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["x-v"], "1");
        assert!(!resp.headers().contains_key("link"));
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
    }

    #[test]
    fn too_many_header_fields_fail() {
        let mut head = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..=MAX_HEADERS {
            head.push_str(&format!("x-{i}: v\r\n"));
        }
        head.push_str("\r\n");
        assert_eq!(
            parsed(&head, &Method::GET),
            Err(format!(
                "malformed response head: more than {MAX_HEADERS} header fields"
            ))
        );
    }

    /// Data, trailers, and the bytes after the body.
    type Decoding = (Vec<u8>, Option<HeaderMap>, Vec<u8>);

    /// Decodes `wire` fed in pieces of `step` bytes: data, trailers, and
    /// the bytes left after the body.
    fn decode_in_steps(wire: &[u8], step: usize) -> Result<Decoding, ExchangeError> {
        let mut state = Chunk::Size;
        let mut buf = BytesMut::new();
        let mut fed = 0;
        let mut data = Vec::new();
        let mut trailers = None;
        while state != Chunk::Done {
            match decode_chunked(state, &mut buf, &mut trailers)? {
                Decoded::Data(next, d) => {
                    data.extend_from_slice(&d);
                    state = next;
                }
                Decoded::Moved(next) => state = next,
                Decoded::NeedMore => {
                    assert!(fed < wire.len(), "the decoder wants more than the body");
                    let end = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
            }
        }
        buf.extend_from_slice(&wire[fed..]);
        Ok((data, trailers.map(|t| *t), buf.to_vec()))
    }

    #[test]
    fn chunked_bodies_decode_the_same_however_they_arrive() {
        let wire = b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\ngrpc-status: 0\r\nx-t: a\r\n\r\nNEXT";
        for step in 1..=wire.len() {
            let (data, trailers, rest) = decode_in_steps(wire, step).unwrap();
            assert_eq!(data, b"helloabcdefghijklmnopqrstuvwxyz", "step {step}");
            let trailers = trailers.unwrap();
            assert_eq!(trailers.get("grpc-status").unwrap(), "0");
            assert_eq!(trailers.get("x-t").unwrap(), "a");
            assert_eq!(rest, b"NEXT", "step {step}");
        }
        let (data, trailers, rest) = decode_in_steps(b"0\r\n\r\n", 1).unwrap();
        assert!(data.is_empty() && trailers.is_none() && rest.is_empty());
    }

    #[test]
    fn malformed_chunked_bodies_fail_naming_the_fault() {
        let cases: [(&[u8], &str); 5] = [
            (b"zz\r\nhello\r\n0\r\n\r\n", "bad chunk size"),
            (b"\r\n", "bad chunk size"),
            (b"5\r\nhelloXX0\r\n\r\n", "chunk data not followed by CRLF"),
            (b"1000000000000000\r\n", "bad chunk size"),
            (b"0\r\nbad trailer\r\n\r\n", "bad trailer section"),
        ];
        for (wire, want) in cases {
            let e = decode_in_steps(wire, wire.len()).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("malformed chunked response body: {want}"),
                "{wire:?}"
            );
        }
        let long = vec![b'1'; MAX_CHUNK_LINE + 2];
        let e = decode_in_steps(&long, long.len()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "malformed chunked response body: chunk line or trailers too long"
        );
    }

    /// A slot for an instance at `addr`.
    fn slot(addr: std::net::SocketAddr) -> Arc<Slot> {
        Arc::new(
            Slot::new(&crate::api::Instance {
                name: Some("pod-1".into()),
                addr: Some(addr.to_string()),
                ..Default::default()
            })
            .unwrap(),
        )
    }

    /// An instance that reads one request head per connection and answers
    /// with `response` as given, then keeps the connection open (until
    /// `close_after`).
    async fn instance(response: &'static [u8], close_after: bool) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        let mut b = [0u8; 1];
                        if s.read(&mut b).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(b[0]);
                    }
                    s.write_all(response).await.unwrap();
                    if close_after {
                        return;
                    }
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest).await;
                });
            }
        });
        addr
    }

    async fn exchange_with(
        addr: std::net::SocketAddr,
        method: &Method,
    ) -> (Arc<Slot>, Result<Response<DirectBody>, ExchangeError>) {
        let slot = slot(addr);
        let stream = TcpStream::connect(addr).await.unwrap();
        let mut head = Vec::new();
        write_head(&mut head, method, "/x", &HeaderMap::new(), None, &[]);
        let resp = exchange(DirectConn::new(stream), &head, method, slot.clone()).await;
        (slot, resp)
    }

    #[tokio::test]
    async fn a_body_read_to_its_end_returns_its_connection_and_an_unfinished_one_closes_it() {
        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", false).await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let resp = resp.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.body().size_hint().exact(), Some(5));
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "hello");
        assert_eq!(slot.connections.len(), 1);

        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", false).await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let mut body = resp.unwrap().into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "hello");
        drop(body);
        assert_eq!(slot.connections.len(), 0);

        // HEAD needs no reading.
        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", false).await;
        let (slot, resp) = exchange_with(addr, &Method::HEAD).await;
        let resp = resp.unwrap();
        assert!(http_body::Body::is_end_stream(resp.body()));
        drop(resp);
        assert_eq!(slot.connections.len(), 1);
    }

    #[tokio::test]
    async fn chunked_trailers_pass_and_close_delimited_bodies_end_at_close() {
        let addr = instance(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\ngrpc-status: 0\r\n\r\n",
            false,
        )
        .await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let collected = resp.unwrap().into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap().get("grpc-status").unwrap(), "0");
        assert_eq!(collected.to_bytes(), "hello");
        assert_eq!(slot.connections.len(), 1);

        let addr = instance(b"HTTP/1.1 200 OK\r\n\r\nuntil close", true).await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let body = resp.unwrap().into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "until close");
        assert_eq!(slot.connections.len(), 0);
    }

    #[tokio::test]
    async fn a_cut_body_and_a_silent_close_are_errors_that_say_so() {
        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", true).await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let e = resp.unwrap().into_body().collect().await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "connection closed with 5 bytes of the response body still to come"
        );
        assert_eq!(slot.connections.len(), 0);

        let addr = instance(b"", true).await;
        let (_, resp) = exchange_with(addr, &Method::GET).await;
        let e = resp.unwrap_err();
        assert!(e.before_response(), "{e}");

        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-", true).await;
        let (_, resp) = exchange_with(addr, &Method::GET).await;
        let e = resp.unwrap_err();
        assert!(!e.before_response(), "{e}");
        assert_eq!(
            e.to_string(),
            "malformed response head: connection closed inside the response head"
        );
    }

    #[tokio::test]
    async fn a_kept_connection_the_instance_closed_is_not_used_again() {
        let addr = instance(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", true).await;
        let (slot, resp) = exchange_with(addr, &Method::GET).await;
        let body = resp.unwrap().into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
        // Kept: the instance's close had not been read yet.
        assert_eq!(slot.connections.len(), 1);
        // Its FIN arrives: the kept connection turns readable and is
        // dropped on the way instead of taken.
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while slot.connections.take_direct().is_some_and(|c| {
            slot.connections.put_direct(c);
            true
        }) {
            assert!(Instant::now() < deadline, "the closed connection stayed usable");
            tokio::task::yield_now().await;
        }
        assert_eq!(slot.connections.len(), 0);
    }

    #[test]
    fn request_heads_are_written_as_hyper_writes_them_without_transfer_encoding() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("x"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        let extra_name = HeaderName::from_static("x-skipper-instance");
        let extra_value = HeaderValue::from_static("pod-1");
        let mut out = Vec::new();
        write_head(
            &mut out,
            &Method::GET,
            "/p?q=1",
            &headers,
            None,
            &[(&extra_name, &extra_value)],
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET /p?q=1 HTTP/1.1\r\nhost: x\r\nx-a: 1\r\nx-a: 2\r\nx-skipper-instance: pod-1\r\n\r\n"
        );
        // The forwarding fields go after the map's, before `extra`.
        let peer = HeaderValue::from_static("203.0.113.5");
        let forwarding = Forwarding::take(&mut headers, Some(&peer), false);
        let mut out = Vec::new();
        write_head(
            &mut out,
            &Method::GET,
            "/",
            &headers,
            Some(&forwarding),
            &[(&extra_name, &extra_value)],
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "GET / HTTP/1.1\r\nhost: x\r\nx-a: 1\r\nx-a: 2\r\n\
             forwarded: for=203.0.113.5;host=x;proto=http\r\nx-forwarded-for: 203.0.113.5\r\n\
             x-forwarded-host: x\r\nx-forwarded-proto: http\r\nx-skipper-instance: pod-1\r\n\r\n"
        );
    }
}
