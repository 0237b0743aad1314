//! A request body that can be sent again: what was read from the client is
//! kept, up to [`MAX_REPLAY_BYTES`], so a request an instance refused
//! without processing it (`421 Misdirected Request`) goes to another
//! instance with the same bytes. Past the bound the copy is dropped and the
//! body can no longer be replayed (it still streams through untouched).
//!
//! A request without a body (most `GET`s) needs none of this:
//! [`ReplayBody::empty`] is a body that ends at once and replays as itself.
//!
//! All clones share one state. [`ReplayBody::replay`] starts a new
//! generation: the new body first repeats what was read, then reads on from
//! the client; a body of an earlier generation (still held by the
//! connection that got the 421) fails when polled again, so the two never
//! both read the client.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use super::body::{ClientBodyError, RequestBody};

/// Largest request body kept for a replay.
pub const MAX_REPLAY_BYTES: usize = 64 * 1024;

#[derive(Debug)]
struct Shared {
    inner: RequestBody,
    /// Data read from the client so far (dropped once past the bound).
    kept: Vec<Bytes>,
    trailers: Option<HeaderMap>,
    read: u64,
    /// More than the bound was read (or announced): nothing is kept.
    spoiled: bool,
    /// Reading the client failed.
    failed: bool,
    ended: bool,
    generation: u64,
    limit: usize,
    /// The client's size hint, for every generation.
    hint: SizeHint,
}

/// The request body sent to instances; see the module docs.
#[derive(Debug)]
pub struct ReplayBody {
    /// `None`: a request without a body.
    shared: Option<Arc<Mutex<Shared>>>,
    generation: u64,
    /// Next kept piece this body repeats.
    pos: usize,
    /// Bytes this body has given out.
    sent: u64,
    trailers_sent: bool,
}

impl ReplayBody {
    /// Wraps the client's body, keeping up to `limit` bytes for a replay.
    #[must_use]
    pub fn new(inner: RequestBody, limit: usize) -> Self {
        let hint = inner.size_hint();
        let spoiled = hint.lower() > limit as u64;
        Self {
            shared: Some(Arc::new(Mutex::new(Shared {
                inner,
                kept: Vec::new(),
                trailers: None,
                read: 0,
                spoiled,
                failed: false,
                ended: false,
                generation: 0,
                limit,
                hint,
            }))),
            generation: 0,
            pos: 0,
            sent: 0,
            trailers_sent: false,
        }
    }

    /// The body of a request without one.
    #[must_use]
    pub fn empty() -> Self {
        Self {
            shared: None,
            generation: 0,
            pos: 0,
            sent: 0,
            trailers_sent: false,
        }
    }

    fn lock(shared: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
        // Poisoning needs a panic inside a body poll, which hyper does not
        // propagate across this lock.
        shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A body that sends the same bytes again (the whole body when
    /// nothing was read yet), or `None` when bytes beyond the bound were
    /// read or reading the client failed. Earlier bodies of this request
    /// stop working.
    #[must_use]
    pub fn replay(&self) -> Option<Self> {
        let Some(shared) = &self.shared else {
            return Some(Self::empty());
        };
        let mut s = Self::lock(shared);
        if s.failed || (s.spoiled && s.read > 0) {
            return None;
        }
        s.generation += 1;
        Some(Self {
            shared: Some(shared.clone()),
            generation: s.generation,
            pos: 0,
            sent: 0,
            trailers_sent: false,
        })
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let Self {
            shared,
            generation,
            pos,
            sent,
            trailers_sent,
        } = &mut *self;
        let Some(shared) = shared.as_ref() else {
            return Poll::Ready(None);
        };
        let mut s = Self::lock(shared);
        if s.generation != *generation {
            return Poll::Ready(Some(Err(ClientBodyError::Replaced)));
        }
        if let Some(piece) = s.kept.get(*pos).cloned() {
            *pos += 1;
            *sent += piece.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        if s.ended {
            if !*trailers_sent && let Some(t) = s.trailers.clone() {
                *trailers_sent = true;
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            return Poll::Ready(None);
        }
        match Pin::new(&mut s.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                s.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                s.failed = true;
                s.kept = Vec::new();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    s.read += data.len() as u64;
                    *sent += data.len() as u64;
                    if !s.spoiled {
                        if s.read > s.limit as u64 {
                            s.spoiled = true;
                            s.kept = Vec::new();
                        } else {
                            s.kept.push(data.clone());
                            *pos = s.kept.len();
                        }
                    }
                } else if let Some(t) = frame.trailers_ref() {
                    s.trailers = Some(t.clone());
                    *trailers_sent = true;
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let Some(shared) = &self.shared else {
            return true;
        };
        let s = Self::lock(shared);
        if s.generation != self.generation {
            return false;
        }
        if self.pos < s.kept.len() || (s.trailers.is_some() && !self.trailers_sent) {
            return false;
        }
        s.ended || s.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let Some(shared) = &self.shared else {
            return SizeHint::with_exact(0);
        };
        let s = Self::lock(shared);
        match s.hint.exact() {
            Some(n) => SizeHint::with_exact(n.saturating_sub(self.sent)),
            None => {
                let mut h = SizeHint::new();
                h.set_lower(s.hint.lower().saturating_sub(self.sent));
                h
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};

    use super::super::body::Progress;
    use super::*;

    fn client_body(pieces: &[&'static [u8]]) -> RequestBody {
        let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = pieces
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        RequestBody::new(
            StreamBody::new(futures::stream::iter(frames)),
            None,
            Progress::default(),
        )
    }

    async fn collect(body: ReplayBody) -> Result<Vec<u8>, ClientBodyError> {
        Ok(body.collect().await?.to_bytes().to_vec())
    }

    #[tokio::test]
    async fn a_replay_repeats_what_was_read_and_reads_on() {
        let mut first = ReplayBody::new(client_body(&[b"hello ", b"big ", b"world"]), 1024);
        // The first attempt reads one piece, then gets its answer.
        let piece = first.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&piece[..], b"hello ");
        let second = first.replay().unwrap();
        assert!(
            matches!(first.frame().await, Some(Err(ClientBodyError::Replaced))),
            "the earlier body stops"
        );
        assert_eq!(collect(second).await.unwrap(), b"hello big world");
    }

    #[tokio::test]
    async fn a_body_read_to_the_end_replays_whole() {
        let first = ReplayBody::new(client_body(&[b"abc", b"def"]), 1024);
        let again = first.replay().unwrap();
        drop(first);
        let keep = again.replay().unwrap();
        let copy = keep.replay().unwrap();
        drop(again);
        drop(keep);
        assert_eq!(
            collect(copy).await.unwrap(),
            b"abcdef",
            "read through, then replayed"
        );
        let last = ReplayBody::new(client_body(&[b"abc", b"def"]), 1024);
        let _ = collect(last.replay().unwrap()).await.unwrap();
        assert_eq!(collect(last.replay().unwrap()).await.unwrap(), b"abcdef");
    }

    #[tokio::test]
    async fn past_the_bound_there_is_no_replay() {
        let first = ReplayBody::new(client_body(&[b"0123456789", b"0123456789"]), 15);
        let a = first.replay().unwrap();
        assert_eq!(
            collect(a).await.unwrap().len(),
            20,
            "the body itself streams through"
        );
        assert!(first.replay().is_none());
    }

    #[test]
    fn size_hints_follow_what_was_sent() {
        let full = http_body_util::Full::new(Bytes::from_static(b"12345"))
            .map_err(|never: std::convert::Infallible| match never {});
        let inner = RequestBody::new(full, None, Progress::default());
        let body = ReplayBody::new(inner, 1024);
        assert_eq!(body.size_hint().exact(), Some(5));
        let none =
            http_body_util::Empty::<Bytes>::new().map_err(|never: std::convert::Infallible| match never {});
        let empty = ReplayBody::new(RequestBody::new(none, None, Progress::default()), 1024);
        assert!(empty.is_end_stream());
        assert!(empty.replay().unwrap().is_end_stream());
        let none = ReplayBody::empty();
        assert!(none.is_end_stream());
        assert_eq!(none.size_hint().exact(), Some(0));
        assert!(none.replay().unwrap().is_end_stream());
    }
}
