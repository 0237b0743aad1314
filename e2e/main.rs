//! End-to-end scenarios: each starts the real `skipper dev` (simulated
//! cluster, controller pods from `manifests/`, the router process, fixture
//! pool pods) and asserts exact outcomes through the router, the simulated
//! API server and the controllers' gRPC state. Run with `make e2e`; every
//! scenario prints its run time (and scenario 5 its request counts) as
//! `e2e: ...` lines.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod browser;
// Shared with the reliability suite (`chaos/`); each uses part of it.
#[allow(dead_code)]
mod harness;
mod kubelet;
mod playground;
mod scenarios;
mod traces;

pub use harness::Timer;
