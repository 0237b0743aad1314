//! The client's request body on its way to an instance: a bound on how
//! slowly it may arrive ([`Pace`]: `--body-timeout`, `--body-min-rate`),
//! what it is doing right now ([`Progress`], so the request deadline can
//! tell a client still sending from an instance still answering), and
//! failures marked as the client's so the one error map can answer 400/408
//! instead of 502.
//!
//! The bound is a budget of waiting time: it starts at `--body-timeout`,
//! drains while the router waits for body data the client has not sent,
//! and every piece that arrives buys back its length at `--body-min-rate`
//! (at most up to the start). A body that pauses for `--body-timeout`, or
//! falls `--body-timeout` behind the minimum rate, ends with 408. Time the
//! router spends not asking for the body (the instance is slow to read it,
//! or no instance is chosen yet) costs nothing. Once the instance has
//! answered (its response headers arrived) the bound ends: the exchange is
//! a conversation the pod chose to hold (a gRPC or other bidirectional
//! stream whose client speaks when it has something to say).

use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
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
    /// The client sent its body so slowly that it fell the body timeout
    /// behind the minimum rate.
    #[error(
        "the client sent the request body slower than {rate} bytes/s for too long (more than {slack:?} behind)"
    )]
    TooSlow { rate: u32, slack: Duration },
    /// The body was malformed (e.g. broken chunked framing) or the client
    /// went away mid-body.
    #[error("failed to read the request body from the client: {0}")]
    Read(#[source] hyper::Error),
    /// The request went to another instance; this copy of the body is no
    /// longer sent.
    #[error("the request body is being sent to another instance")]
    Replaced,
}

/// How slowly a request body may arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// The waiting budget: the longest pause, and how far the body may
    /// fall behind `min_rate`.
    pub slack: Duration,
    /// The average rate the body must keep (`None`: pauses alone are
    /// bounded).
    pub min_rate: Option<NonZeroU32>,
}

impl Pace {
    /// The waiting time `bytes` buy back.
    fn credit(&self, bytes: usize) -> Duration {
        match self.min_rate {
            // Credits stay far below a second per byte: f64 is exact enough.
            #[allow(clippy::cast_precision_loss)]
            Some(rate) => Duration::from_secs_f64(bytes as f64 / f64::from(rate.get())),
            None => self.slack,
        }
    }
}

/// What a request body is doing, shared with whoever bounds the request.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<ProgressState>);

#[derive(Debug, Default)]
struct ProgressState {
    state: AtomicU8,
    /// The instance's response headers arrived.
    answered: AtomicBool,
}

const SENDING: u8 = 0;
const WAITING: u8 = 1;
const DONE: u8 = 2;

impl Progress {
    /// Whether the router is waiting for body data the client has not sent.
    #[must_use]
    pub fn waiting_for_client(&self) -> bool {
        self.0.state.load(Ordering::Relaxed) == WAITING
    }

    /// The instance has answered: the body's pace is no longer bounded.
    pub fn answered(&self) {
        self.0.answered.store(true, Ordering::Relaxed);
    }

    fn is_answered(&self) -> bool {
        self.0.answered.load(Ordering::Relaxed)
    }

    fn set(&self, state: u8) {
        self.0.state.store(state, Ordering::Relaxed);
    }
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
    pace: Option<Pace>,
    /// Waiting time left (see the module docs).
    left: Duration,
    /// Since when the router has been waiting for the client, if it is.
    waiting_since: Option<Instant>,
    /// Fires when `left` runs out during a wait.
    sleep: Option<Pin<Box<Sleep>>>,
    progress: Progress,
}

impl RequestBody {
    /// Wraps `inner` (the body hyper read from the client), bounded by
    /// `pace` (`None`: no bound), reporting into `progress`.
    #[must_use]
    pub fn new<B>(inner: B, pace: Option<Pace>, progress: Progress) -> Self
    where
        B: Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    {
        Self {
            inner: inner.boxed_unsync(),
            left: pace.map_or(Duration::ZERO, |p| p.slack),
            pace,
            waiting_since: None,
            sleep: None,
            progress,
        }
    }
}

impl std::fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody")
            .field("pace", &self.pace)
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
            Poll::Ready(Some(Err(e))) => {
                this.progress.set(DONE);
                Poll::Ready(Some(Err(ClientBodyError::Read(e))))
            }
            Poll::Ready(None) => {
                this.progress.set(DONE);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.progress.set(SENDING);
                if let Some(pace) = this.pace {
                    if let Some(since) = this.waiting_since.take() {
                        this.left = this.left.saturating_sub(since.elapsed());
                    }
                    let bytes = frame.data_ref().map_or(0, Bytes::len);
                    this.left = (this.left + pace.credit(bytes)).min(pace.slack);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                this.progress.set(WAITING);
                let Some(pace) = this.pace.filter(|_| !this.progress.is_answered()) else {
                    this.sleep = None;
                    return Poll::Pending;
                };
                let now = Instant::now();
                let since = *this.waiting_since.get_or_insert(now);
                let deadline = since + this.left;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.deadline() != deadline {
                    sleep.as_mut().reset(deadline);
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        let e = match pace.min_rate {
                            Some(rate) if this.left < pace.slack => ClientBodyError::TooSlow {
                                rate: rate.get(),
                                slack: pace.slack,
                            },
                            _ => ClientBodyError::Stalled(pace.slack),
                        };
                        Poll::Ready(Some(Err(e)))
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A client body fed by the test: `Some(n)` is n bytes, `None` the end.
    fn client() -> (
        tokio::sync::mpsc::UnboundedSender<Option<usize>>,
        impl Body<Data = Bytes, Error = hyper::Error> + Send + 'static,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Option<usize>>();
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Some(Some(n)) => Some((Ok(Frame::data(Bytes::from(vec![b'x'; n]))), rx)),
                _ => None,
            }
        });
        (tx, http_body_util::StreamBody::new(stream))
    }

    fn pace(slack_secs: u64, rate: u32) -> Option<Pace> {
        Some(Pace {
            slack: Duration::from_secs(slack_secs),
            min_rate: NonZeroU32::new(rate),
        })
    }

    /// Reads `body` to its end or first error; the bytes it gave.
    async fn drain(mut body: RequestBody) -> Result<usize, ClientBodyError> {
        let mut total = 0;
        while let Some(f) = body.frame().await {
            total += f?.into_data().map_or(0, |d| d.len());
        }
        Ok(total)
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_longer_than_the_slack_is_stalled_and_a_shorter_one_is_fine() {
        let (tx, inner) = client();
        let progress = Progress::default();
        let body = RequestBody::new(inner, pace(10, 100), progress.clone());
        let feeder = tokio::spawn(async move {
            for _ in 0..3 {
                tx.send(Some(1000)).unwrap();
                tokio::time::sleep(Duration::from_secs(9)).await;
            }
            tx.send(Some(1000)).unwrap();
            tokio::time::sleep(Duration::from_secs(11)).await;
            tx.send(None).ok();
        });
        let started = Instant::now();
        let err = drain(body).await.unwrap_err();
        assert!(
            matches!(err, ClientBodyError::Stalled(d) if d == Duration::from_secs(10)),
            "{err}"
        );
        assert_eq!(started.elapsed(), Duration::from_secs(37));
        assert!(progress.waiting_for_client());
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn once_the_instance_has_answered_pauses_are_the_pods_business() {
        let (tx, inner) = client();
        let progress = Progress::default();
        let body = RequestBody::new(inner, pace(10, 100), progress.clone());
        let answered = progress.clone();
        let feeder = tokio::spawn(async move {
            tx.send(Some(10)).unwrap();
            // Well inside the budget, the response headers arrive; then the
            // client of a bidirectional stream is quiet for a minute twice.
            tokio::time::sleep(Duration::from_secs(5)).await;
            answered.answered();
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_secs(60)).await;
                tx.send(Some(1)).unwrap();
            }
            tx.send(None).ok();
        });
        let started = Instant::now();
        assert_eq!(drain(body).await.unwrap(), 12);
        assert_eq!(started.elapsed(), Duration::from_secs(125));
        feeder.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_drip_below_the_rate_ends_once_it_is_the_slack_behind() {
        let (tx, inner) = client();
        let body = RequestBody::new(inner, pace(10, 100), Progress::default());
        // One byte every 2 s: each buys 10 ms back, so about 5 bytes in.
        let feeder = tokio::spawn(async move {
            loop {
                if tx.send(Some(1)).is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
        let started = Instant::now();
        let err = drain(body).await.unwrap_err();
        assert!(matches!(err, ClientBodyError::TooSlow { rate: 100, .. }), "{err}");
        let took = started.elapsed();
        assert!(
            took > Duration::from_secs(10) && took <= Duration::from_secs(11),
            "{took:?}"
        );
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_at_the_rate_never_runs_out_and_credit_is_capped() {
        let (tx, inner) = client();
        let progress = Progress::default();
        let body = RequestBody::new(inner, pace(10, 100), progress.clone());
        let feeder = tokio::spawn(async move {
            // A burst far ahead of the rate banks no more than the slack...
            tx.send(Some(1_000_000)).unwrap();
            // ...then exactly the rate for a minute.
            for _ in 0..60 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                tx.send(Some(100)).unwrap();
            }
            tx.send(None).unwrap();
        });
        assert_eq!(drain(body).await.unwrap(), 1_000_000 + 6_000);
        assert!(!progress.waiting_for_client());
        feeder.await.unwrap();

        let (tx, inner) = client();
        let body = RequestBody::new(inner, pace(10, 100), Progress::default());
        let feeder = tokio::spawn(async move {
            tx.send(Some(1_000_000)).unwrap();
            tokio::time::sleep(Duration::from_secs(11)).await;
            tx.send(None).ok();
        });
        let err = drain(body).await.unwrap_err();
        assert!(
            matches!(err, ClientBodyError::Stalled(_)),
            "a burst buys no more than the slack: {err}"
        );
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_rate_every_piece_restores_the_whole_slack_and_without_a_pace_nothing_ends() {
        let (tx, inner) = client();
        let body = RequestBody::new(inner, pace(10, 0), Progress::default());
        let feeder = tokio::spawn(async move {
            for _ in 0..5 {
                tx.send(Some(1)).unwrap();
                tokio::time::sleep(Duration::from_secs(9)).await;
            }
            tx.send(None).unwrap();
        });
        assert_eq!(drain(body).await.unwrap(), 5);
        feeder.await.unwrap();

        let (tx, inner) = client();
        let body = RequestBody::new(inner, None, Progress::default());
        let feeder = tokio::spawn(async move {
            tx.send(Some(1)).unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            tx.send(None).unwrap();
        });
        assert_eq!(drain(body).await.unwrap(), 1);
        feeder.await.unwrap();
    }
}
