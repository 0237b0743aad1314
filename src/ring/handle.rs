//! [`RingHandle`]: the current ring, published through a `watch` channel.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::HashRing;

/// Errors of ring lookups that need members.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The ring stayed empty for the whole wait: membership discovery failed.
    #[error("hash ring is still empty after waiting {0:?}: no controller is a ring member")]
    Empty(Duration),
}

/// A cheap, cloneable view of the current ring, plus the means to publish a
/// new one. Readers take a snapshot (`Arc` clone) and never block writers.
#[derive(Debug, Clone)]
pub struct RingHandle {
    tx: Arc<watch::Sender<Arc<HashRing>>>,
}

impl Default for RingHandle {
    fn default() -> Self {
        Self::new(HashRing::default())
    }
}

impl RingHandle {
    /// A handle publishing `ring`.
    #[must_use]
    pub fn new(ring: HashRing) -> Self {
        let (tx, _) = watch::channel(Arc::new(ring));
        Self { tx: Arc::new(tx) }
    }

    /// The current ring.
    #[must_use]
    pub fn current(&self) -> Arc<HashRing> {
        self.tx.borrow().clone()
    }

    /// Replaces the ring with the result of `f(current)`, notifying waiters
    /// when it changed.
    pub fn update(&self, f: impl FnOnce(&HashRing) -> HashRing) {
        self.tx.send_if_modified(|ring| {
            let next = f(ring);
            if next == **ring {
                false
            } else {
                *ring = Arc::new(next);
                true
            }
        });
    }

    /// Publishes `ring` as the current ring.
    pub fn publish(&self, ring: HashRing) {
        self.update(|_| ring);
    }

    /// A receiver that observes every published ring.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<Arc<HashRing>> {
        self.tx.subscribe()
    }

    /// The current ring once it has a member, waiting at most `wait`.
    ///
    /// # Errors
    /// [`RingError::Empty`] when the ring is still empty after `wait`.
    pub async fn wait_non_empty(&self, wait: Duration) -> Result<Arc<HashRing>, RingError> {
        let mut rx = self.tx.subscribe();
        let found = tokio::time::timeout(wait, rx.wait_for(|r| !r.is_empty())).await;
        match found {
            Ok(Ok(ring)) => Ok(ring.clone()),
            _ => Err(RingError::Empty(wait)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn empty_ring_errors_after_the_deadline() {
        let h = RingHandle::default();
        let err = h.wait_non_empty(Duration::from_secs(10)).await.unwrap_err();
        assert_eq!(err, RingError::Empty(Duration::from_secs(10)));
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_wake_when_a_member_joins() {
        let h = RingHandle::default();
        let waiter = tokio::spawn({
            let h = h.clone();
            async move { h.wait_non_empty(Duration::from_secs(10)).await }
        });
        tokio::task::yield_now().await;
        h.update(|r| r.with_member("10.0.0.1"));
        let ring = waiter.await.unwrap().unwrap();
        assert_eq!(ring.sorted_members().len(), 1);
    }
}
