//! What Skipper's integration, end-to-end and reliability suites share: the
//! Kubernetes backends they run on ([`backend`]), the controller harness
//! ([`controller`]), the router harness with its scriptable fake controller
//! ([`router`]), a gRPC client that writes as Go's does ([`grpc`]), the simulator's test settings and pod helpers
//! ([`devcluster`]), process checks ([`process`]), and the one condition
//! wait ([`eventually`]).
//!
//! The root package takes this crate as a dev-dependency only; the product
//! never links it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod backend;
pub mod controller;
pub mod devcluster;
pub mod grpc;
pub mod process;
pub mod router;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// The workspace's root directory (where `target/` and `manifests/` are).
#[must_use]
pub fn workspace_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")))
}

/// The `skipper` executable the tests run: `CARGO_BIN_EXE_skipper` when the
/// runner sets it (cargo-nextest does), else the binary beside the test
/// binary's `deps/` directory, where cargo builds it for integration tests.
///
/// # Panics
/// When neither names an existing file (the binary is not built).
#[must_use]
pub fn skipper_exe() -> PathBuf {
    if let Some(p) = std::env::var_os("CARGO_BIN_EXE_skipper") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().expect("the test binary's directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent")
    } else {
        dir
    };
    let candidate = dir.join("skipper");
    assert!(
        candidate.is_file(),
        "the skipper binary is not at {}: build it (cargo test builds it for integration tests)",
        candidate.display()
    );
    candidate
}

/// Polls `f` every 20 ms until it yields a value; panics after `timeout`,
/// naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    tokio::time::timeout(timeout, async {
        loop {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out after {timeout:?} waiting for {what}"))
}
