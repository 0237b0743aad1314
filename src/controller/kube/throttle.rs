//! Client-side rate limit of the Kubernetes client (`--kubeconfig-qps`,
//! `--kubeconfig-burst`): a token bucket that gates `poll_ready`, so each
//! request waits for its token before it is sent.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// A token bucket: `qps` tokens a second, at most `burst` saved up.
#[derive(Debug)]
pub struct Bucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// A full bucket.
    #[must_use]
    pub fn new(qps: f32, burst: u32, now: Instant) -> Self {
        Self {
            qps: f64::from(qps).max(f64::MIN_POSITIVE),
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: now,
        }
    }

    /// Takes a token; returns how long to wait before using it.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst) - 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

/// The layer adding [`Throttled`].
#[derive(Debug, Clone)]
pub struct ThrottleLayer {
    bucket: Arc<Mutex<Bucket>>,
}

impl ThrottleLayer {
    /// A layer allowing `qps` requests a second with bursts of `burst`.
    #[must_use]
    pub fn new(qps: f32, burst: u32) -> Self {
        Self {
            bucket: Arc::new(Mutex::new(Bucket::new(qps, burst, Instant::now()))),
        }
    }
}

impl<S> tower::Layer<S> for ThrottleLayer {
    type Service = Throttled<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Throttled {
            inner,
            bucket: self.bucket.clone(),
            sleep: None,
            reserved: false,
        }
    }
}

/// A service that takes a token before each request.
#[derive(Debug)]
pub struct Throttled<S> {
    inner: S,
    // A std mutex: the critical section is a few float operations.
    bucket: Arc<Mutex<Bucket>>,
    sleep: Option<Pin<Box<Sleep>>>,
    reserved: bool,
}

impl<S, R> tower::Service<R> for Throttled<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            if self.reserved {
                return self.inner.poll_ready(cx);
            }
            if let Some(sleep) = self.sleep.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
                self.reserved = true;
                continue;
            }
            let wait = self
                .bucket
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .reserve(Instant::now());
            if wait.is_zero() {
                self.reserved = true;
            } else {
                self.sleep = Some(Box::pin(tokio::time::sleep(wait)));
            }
        }
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.reserved = false;
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service};

    #[test]
    fn bucket_allows_the_burst_then_paces_at_qps() {
        let t0 = Instant::now();
        let mut b = Bucket::new(10.0, 3, t0);
        for _ in 0..3 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        let w = b.reserve(t0);
        assert!((w.as_secs_f64() - 0.1).abs() < 1e-6, "{w:?}");
        let w = b.reserve(t0);
        assert!((w.as_secs_f64() - 0.2).abs() < 1e-6, "{w:?}");
        // A second later the debt is paid and tokens accrue up to the burst.
        assert_eq!(b.reserve(t0 + Duration::from_secs(2)), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_wait_for_their_token() {
        #[derive(Clone)]
        struct Echo;
        impl tower::Service<u32> for Echo {
            type Response = u32;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<u32, Self::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, r: u32) -> Self::Future {
                std::future::ready(Ok(r))
            }
        }
        let mut svc = ThrottleLayer::new(2.0, 1).layer(Echo);
        let start = Instant::now();
        for i in 0..3 {
            std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
            assert_eq!(svc.call(i).await.unwrap(), i);
        }
        // One immediately, then one every 500 ms.
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }
}
