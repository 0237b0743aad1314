//! One switch for the tests that can run against either Kubernetes
//! backend: the embedded simulator (the default) or the real control plane
//! built by `make control-plane` (`SKIPPER_TEST_CONTROL_PLANE=real`).
//!
//! Include it with `#[path = "common/backend.rs"] mod backend;`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use skipper::devcluster::control_plane;

/// Where `make control-plane` puts the binaries (`SKIPPER_CONTROL_PLANE_DIR` overrides).
pub fn control_plane_dir() -> PathBuf {
    std::env::var_os("SKIPPER_CONTROL_PLANE_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/control-plane"), PathBuf::from)
}

/// Whether the tests were asked to run against the real control plane.
pub fn real_requested() -> bool {
    std::env::var("SKIPPER_TEST_CONTROL_PLANE").is_ok_and(|v| v == "real")
}

/// The control plane configuration for tests, or `None` (with a message)
/// when the binaries are not built and nothing demands them: CI
/// (`CI=true`) and `SKIPPER_TEST_CONTROL_PLANE=real` make a missing build a
/// failure.
pub fn control_plane_config() -> Option<control_plane::Config> {
    let dir = control_plane_dir();
    let built = control_plane::BINARIES.iter().all(|b| dir.join(b).is_file());
    if !built {
        let demanded = real_requested() || std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(
            !demanded,
            "the real control plane is not built in {}: run `make control-plane`",
            dir.display()
        );
        eprintln!(
            "skipped: the real control plane is not built in {} (run `make control-plane`)",
            dir.display()
        );
        return None;
    }
    Some(control_plane::Config {
        bin_dir: dir,
        ..control_plane::Config::default()
    })
}

/// Polls `f` every 20ms until it yields a value; panics after `timeout`.
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

/// Whether a process with this pid exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}
