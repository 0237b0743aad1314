//! The `WatchInstances` subscription behind a function's [`Table`]: opens
//! the stream on a controller, applies the snapshot and the changes,
//! reports draining instances idle, and subscribes again when the stream
//! ends — at once when the controller says the function moved on the ring
//! (`ABORTED`), after a back-off otherwise, and rarely when the controller
//! does not serve the stream at all (`UNIMPLEMENTED`: a controller without
//! the warm path). While the stream is down the table is not used: requests
//! ask `GetInstance`, as they would without a table.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use super::instances::{Table, View};
use crate::api;
use crate::client::Client;

/// Bound on opening a stream (connect plus response headers).
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// First back-off after a failed or ended stream.
pub const RETRY_MIN: Duration = Duration::from_millis(100);
/// Largest back-off after failed or ended streams.
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// Wait before asking again a controller that does not serve the stream.
pub const UNSUPPORTED_RETRY: Duration = Duration::from_secs(60);

/// What to do after a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Subscribe again at once (the function moved on the ring, or the
    /// stream lost track of its version).
    Now,
    /// Subscribe again after the back-off.
    BackOff,
    /// The controller does not serve `WatchInstances`.
    Unsupported,
}

impl Next {
    /// The reaction to a stream that ended with `code`.
    #[must_use]
    pub fn after(code: Code) -> Self {
        match code {
            Code::Aborted => Self::Now,
            Code::Unimplemented => Self::Unsupported,
            _ => Self::BackOff,
        }
    }
}

/// The wait before subscription attempt `failures` + 1 after `failures`
/// consecutive failures: `RETRY_MIN` doubling up to `RETRY_MAX`, times
/// `1 + jitter` (`jitter` in `[0, 1)`), capped at `RETRY_MAX`.
#[must_use]
pub fn backoff(failures: u32, jitter: f64) -> Duration {
    let exp = RETRY_MIN.saturating_mul(1 << failures.saturating_sub(1).min(16));
    exp.mul_f64(1.0 + jitter.clamp(0.0, 1.0)).min(RETRY_MAX)
}

/// Everything a subscription needs besides its table.
#[derive(Debug, Clone)]
pub struct Subscriber {
    pub client: Client,
    pub router_ip: String,
}

impl Subscriber {
    /// Keeps `table` fed for `function` until the table is stopped.
    pub async fn run(self, table: Arc<Table>, function: api::Function) {
        let stop = table.stopped().clone();
        let mut failures = 0u32;
        loop {
            let started = tokio::time::Instant::now();
            let next = tokio::select! {
                () = stop.cancelled() => break,
                n = self.stream_once(&table, &function) => n,
            };
            table.set_down();
            if started.elapsed() >= RETRY_MAX {
                failures = 0;
            }
            let wait = match next {
                Err(Next::Unsupported) => UNSUPPORTED_RETRY,
                Ok(()) | Err(Next::Now) if failures == 0 => Duration::ZERO,
                _ => backoff(failures + 1, rand::random()),
            };
            failures = failures.saturating_add(1);
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        table.set_down();
    }

    /// One stream, until it ends. `Ok` when it delivered a snapshot before
    /// ending (the next one starts without delay), else what to do next.
    async fn stream_once(&self, table: &Arc<Table>, function: &api::Function) -> Result<(), Next> {
        let (tx, rx) = mpsc::channel(8);
        let first = api::WatchInstancesRequest {
            function: Some(function.clone()),
            idle_instance_names: vec![],
            router_ip: Some(self.router_ip.clone()),
        };
        // A fresh channel with room for eight: cannot be full.
        let _ = tx.try_send(first);
        let mut stream = match self
            .client
            .watch_instances(ReceiverStream::new(rx), OPEN_TIMEOUT)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "failed to open the instance stream");
                return Err(Next::after(e.code()));
            }
        };
        let idle = table.idle_signal();
        let mut view = View::default();
        let mut synced = false;
        loop {
            tokio::select! {
                msg = stream.next() => match msg {
                    Some(Ok(m)) => match view.apply(&m, &table.known()) {
                        Ok((next, bad)) => {
                            for b in bad {
                                tracing::warn!(error = %b, "ignoring an instance from the stream");
                            }
                            view = next;
                            table.publish(&view);
                            synced = true;
                            report_idle(table, &tx).await;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "instance stream out of step; subscribing again");
                            return if synced { Ok(()) } else { Err(Next::Now) };
                        }
                    },
                    Some(Err(status)) => {
                        tracing::debug!(code = ?status.code(), message = status.message(), "instance stream ended");
                        return match Next::after(status.code()) {
                            Next::Now | Next::BackOff if synced => Ok(()),
                            n => Err(n),
                        };
                    }
                    None => return if synced { Ok(()) } else { Err(Next::BackOff) },
                },
                () = idle.notified() => report_idle(table, &tx).await,
            }
        }
    }
}

/// Sends the draining instances that just became idle.
async fn report_idle(table: &Table, tx: &mpsc::Sender<api::WatchInstancesRequest>) {
    let names = table.newly_idle();
    if names.is_empty() {
        return;
    }
    tracing::debug!(instances = ?names, "reporting draining instances idle");
    let _ = tx
        .send(api::WatchInstancesRequest {
            function: None,
            idle_instance_names: names,
            router_ip: None,
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reactions_to_stream_endings() {
        assert_eq!(Next::after(Code::Aborted), Next::Now);
        assert_eq!(Next::after(Code::Unimplemented), Next::Unsupported);
        for c in [
            Code::Unavailable,
            Code::Internal,
            Code::DeadlineExceeded,
            Code::InvalidArgument,
        ] {
            assert_eq!(Next::after(c), Next::BackOff, "{c:?}");
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap() {
        let ms = |f, j| backoff(f, j).as_millis();
        assert_eq!(ms(1, 0.0), 100);
        assert_eq!(ms(2, 0.0), 200);
        assert_eq!(ms(3, 0.5), 600);
        assert_eq!(ms(1, 0.999), 199);
        assert_eq!(ms(7, 0.0), 5000);
        assert_eq!(ms(u32::MAX, 0.9), 5000);
    }
}
