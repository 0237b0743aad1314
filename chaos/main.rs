//! The reliability suite (`make chaos`): hostile input and bad days in
//! production against the real binary. Each scenario starts its own
//! `skipper dev` (simulated cluster, controller pods, router process, pool
//! pods), drives load from the test itself, injects faults through the
//! simulator's fault endpoints, the API and signals, and asserts one figure,
//! which it also prints as a `chaos: <figure>: <value>` line:
//!
//! - router RSS under a flood of large valid headers with unknown fields;
//! - controller RSS per 10k supervisors after a heartbeat flood, what is
//!   left once the supervisors stop, and that a second flood reuses it;
//! - oneshot releases that failed when the release reached another
//!   controller than the claim;
//! - tenants above `max_instances: 1` after a burst of first requests;
//! - 502s while tenant pods are killed under load;
//! - failed requests while controllers are killed (`kill -9`, force delete);
//! - claimed pods left once the tenants are idle (at the end of each
//!   scenario that claims pods).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with the end-to-end suite (`e2e/`); each uses part of it.
#[allow(dead_code)]
#[path = "../e2e/harness.rs"]
mod harness;
mod probe;
mod scenarios;

pub use harness::Timer;
