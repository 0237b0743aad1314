//! Process-wide cancellation: one root [`CancellationToken`] set by
//! SIGTERM/SIGINT, and a [`TaskTracker`] that owns every spawned task so
//! shutdown can wait for them with a deadline.

use std::future::Future;
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
}
