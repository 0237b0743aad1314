//! The client's request body on its way to an instance: a bound on pauses
//! between its pieces (`--body-timeout`), and failures marked as the
//! client's so the one error map can answer 400/408 instead of 502.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use tokio::time::{Instant, Sleep};

/// Reading the request body from the client failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    /// The client sent nothing for longer than the body timeout.
    #[error("the client sent no request body data for {0:?}")]
    Stalled(Duration),
    /// The body was malformed (e.g. broken chunked framing) or the client
    /// went away mid-body.
    #[error("failed to read the request body from the client: {0}")]
    Read(#[source] hyper::Error),
    /// The request went to another instance; this copy of the body is no
    /// longer sent.
    #[error("the request body is being sent to another instance")]
    Replaced,
}

impl ClientBodyError {
    /// The client-body failure behind an upstream send error, if that is
    /// what made the send fail.
    #[must_use]
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Self> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(found) = err.downcast_ref::<Self>() {
                return Some(found);
            }
            cur = err.source();
        }
        None
    }
}

/// The request body sent to an instance.
pub struct RequestBody {
    inner: UnsyncBoxBody<Bytes, hyper::Error>,
    timeout: Option<Duration>,
    /// Armed when the body had nothing to give; reset on every piece.
    sleep: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl RequestBody {
    /// Wraps `inner` (the body hyper read from the client); `timeout`
    /// bounds each pause (`None`: no bound).
    #[must_use]
    pub fn new<B>(inner: B, timeout: Option<Duration>) -> Self
    where
        B: Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    {
        Self {
            inner: inner.boxed_unsync(),
            timeout,
            sleep: None,
            armed: false,
        }
    }
}

impl std::fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(ClientBodyError::Read(e)))),
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r.map(|f| f.map_err(ClientBodyError::Read)))
            }
            Poll::Pending => {
                let Some(t) = this.timeout else {
                    return Poll::Pending;
                };
                let deadline = Instant::now() + t;
                let armed = this.armed;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !armed {
                    sleep.as_mut().reset(deadline);
                    this.armed = true;
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(ClientBodyError::Stalled(t)))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
