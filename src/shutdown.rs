//! Process-wide cancellation: one root [`CancellationToken`] set by
//! SIGTERM/SIGINT, and a [`TaskTracker`] that owns every spawned task so
//! shutdown can wait for them with a deadline.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// The root of the cancellation tree and the owner of background tasks.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    token: CancellationToken,
    tracker: TaskTracker,
}

impl Shutdown {
    /// A fresh, not yet cancelled root.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The root token; cancelled when shutdown begins.
    #[must_use]
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// The tracker owning every task spawned through [`Shutdown::spawn`].
    #[must_use]
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// Whether shutdown has begun.
    #[must_use]
    pub fn is_shutting_down(&self) -> bool {
        self.token.is_cancelled()
    }

    /// A root of its own for tasks that outlive the start of this one's
    /// shutdown: cancelled by `token`, owned by the same tracker (so
    /// [`Shutdown::drain`] still waits for them).
    #[must_use]
    pub fn with_token(&self, token: CancellationToken) -> Self {
        Self {
            token,
            tracker: self.tracker.clone(),
        }
    }

    /// Begins shutdown.
    pub fn trigger(&self) {
        self.token.cancel();
    }

    /// Resolves when shutdown begins.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// Spawns a tracked task inside a span named `name`.
    pub fn spawn<F>(&self, name: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker
            .spawn(fut.instrument(tracing::info_span!("task", name)))
    }

    /// Cancels the root token on the first SIGTERM or SIGINT (tracked task).
    ///
    /// # Errors
    /// When the signal handlers cannot be installed.
    pub fn trigger_on_signals(&self) -> std::io::Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let token = self.token.clone();
        self.spawn("signals", async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("received SIGTERM, shutting down"),
                _ = int.recv() => tracing::info!("received SIGINT, shutting down"),
                () = token.cancelled() => return,
            }
            token.cancel();
        });
        Ok(())
    }

    /// Cancels, closes the tracker and waits up to `grace` for every tracked
    /// task. Returns `false` when the deadline passed first.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.token.cancel();
        self.tracker.close();
        tokio::time::timeout(grace, self.tracker.wait()).await.is_ok()
    }
}

/// A flag set once that many tasks wait for, made for waits polled at every
/// wake-up of a busy task (a client connection's stop signals): checking it
/// and polling a registered [`Wait`] again read one atomic, where a
/// [`CancellationToken`] takes a mutex for each (two for a poll). A wait
/// takes the waiter list's lock when it first registers, when its task's
/// waker changes and when it is dropped.
#[derive(Debug, Clone, Default)]
pub struct Latch(Arc<LatchInner>);

#[derive(Debug, Default)]
struct LatchInner {
    set: AtomicBool,
    waiters: Mutex<Waiters>,
}

#[derive(Debug, Default)]
struct Waiters {
    next: u64,
    wakers: HashMap<u64, Waker>,
}

impl LatchInner {
    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Latch {
    /// A flag not set yet.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the flag and wakes every wait (once; later calls do nothing).
    pub fn set(&self) {
        if self.0.set.swap(true, Ordering::AcqRel) {
            return;
        }
        let wakers = std::mem::take(&mut self.0.waiters().wakers);
        for waker in wakers.into_values() {
            waker.wake();
        }
    }

    /// Whether the flag is set.
    #[must_use]
    pub fn is_set(&self) -> bool {
        self.0.set.load(Ordering::Acquire)
    }

    /// Resolves once the flag is set.
    pub fn wait(&self) -> Wait<'_> {
        Wait {
            latch: &self.0,
            registered: None,
        }
    }
}

/// The future of [`Latch::wait`].
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Wait<'a> {
    latch: &'a LatchInner,
    /// Its key in the waiter list and the waker registered there.
    registered: Option<(u64, Waker)>,
}

impl Future for Wait<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if this.latch.set.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        if let Some((_, waker)) = &this.registered
            && waker.will_wake(cx.waker())
        {
            return Poll::Pending;
        }
        let mut waiters = this.latch.waiters();
        // Checked again under the lock: `set` raises the flag before it
        // takes the list, so a wait registered here is woken by it.
        if this.latch.set.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        let key = match &this.registered {
            Some((key, _)) => *key,
            None => {
                waiters.next += 1;
                waiters.next
            }
        };
        waiters.wakers.insert(key, cx.waker().clone());
        this.registered = Some((key, cx.waker().clone()));
        Poll::Pending
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if let Some((key, _)) = self.registered.take() {
            self.latch.waiters().wakers.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_tasks_until_the_deadline() {
        let s = Shutdown::new();
        let token = s.token().clone();
        s.spawn("quick", async move { token.cancelled().await });
        assert!(s.drain(Duration::from_secs(1)).await);

        let s = Shutdown::new();
        s.spawn("stuck", std::future::pending::<()>());
        assert!(!s.drain(Duration::from_secs(1)).await);
    }

    #[tokio::test]
    async fn a_latch_wakes_every_wait_once_set() {
        let latch = Latch::new();
        assert!(!latch.is_set());
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let latch = latch.clone();
                tokio::spawn(async move { latch.wait().await })
            })
            .collect();
        // Every task has registered (polled once, pending) before the set.
        wait_registered(&latch, 3).await;
        latch.set();
        latch.set();
        assert!(latch.is_set());
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .expect("woken")
                .unwrap();
        }
        assert_eq!(latch.0.waiters().wakers.len(), 0);
        // A wait made after the set is ready at once.
        assert!(futures::FutureExt::now_or_never(latch.wait()).is_some());
    }

    #[tokio::test]
    async fn a_latch_wait_polled_again_keeps_one_registration_and_leaves_none_when_dropped() {
        let latch = Latch::new();
        let mut wait = latch.wait();
        for _ in 0..3 {
            assert!(futures::poll!(&mut wait).is_pending());
        }
        assert_eq!(latch.0.waiters().wakers.len(), 1);
        // Polled by another task: its waker replaces the first.
        let other = futures::task::noop_waker();
        let mut cx = Context::from_waker(&other);
        assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
        assert_eq!(latch.0.waiters().wakers.len(), 1);
        assert!(
            latch
                .0
                .waiters()
                .wakers
                .values()
                .next()
                .unwrap()
                .will_wake(&other)
        );
        drop(wait);
        assert_eq!(latch.0.waiters().wakers.len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_latch_set_while_waits_register_wakes_them_all() {
        for _ in 0..200 {
            let latch = Latch::new();
            let waits: Vec<_> = (0..4)
                .map(|_| {
                    let latch = latch.clone();
                    tokio::spawn(async move { latch.wait().await })
                })
                .collect();
            let setter = {
                let latch = latch.clone();
                tokio::spawn(async move { latch.set() })
            };
            setter.await.unwrap();
            for w in waits {
                tokio::time::timeout(Duration::from_secs(5), w)
                    .await
                    .expect("no wait is missed")
                    .unwrap();
            }
        }
    }

    async fn wait_registered(latch: &Latch, n: usize) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while latch.0.waiters().wakers.len() < n {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the waits registered");
    }
}
