//! What Skipper's integration, end-to-end and reliability suites share: the
//! Kubernetes backends they run on ([`backend`]), the controller harness
//! ([`controller`]), the router harness with its scriptable fake controller
//! ([`router`]), the router binary as a process for the benchmarks
//! ([`router_process`]), a gRPC client that writes as Go's does ([`grpc`]), the
//! simulator's test settings and pod helpers ([`devcluster`]), process
//! checks ([`process`]), the one condition wait ([`eventually`]), and the
//! requests tests repeat ([`http`], [`get_text`], [`get_status`],
//! [`patch`], [`list_version`], [`api_error`]).
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
pub mod router_process;

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
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_every(what, timeout, Duration::from_millis(20), f).await
}

/// [`eventually`], polling every `every` (for checks that cost the system
/// under test something, such as listing pods).
pub async fn eventually_every<T, F, Fut>(what: &str, timeout: Duration, every: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll(what, timeout, every, f)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`eventually`] that returns the time-out as an error naming `what`
/// instead of panicking, for a test that must clean up before it fails.
pub async fn try_eventually<T, F, Fut>(what: &str, timeout: Duration, f: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll(what, timeout, Duration::from_millis(20), f).await
}

async fn poll<T, F, Fut>(what: &str, timeout: Duration, every: Duration, mut f: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    tokio::time::timeout(timeout, async {
        loop {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(every).await;
        }
    })
    .await
    .map_err(|_| format!("timed out after {timeout:?} waiting for {what}"))
}

/// An HTTP client that dials every address itself (no proxy from the
/// environment: the tests' addresses are local).
#[must_use]
pub fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// The body of a GET of `url` through [`http`]; panics on a transport
/// error (the status is not checked).
pub async fn get_text(url: impl reqwest::IntoUrl) -> String {
    http().get(url).send().await.unwrap().text().await.unwrap()
}

/// The status a GET of `url` through [`http`] answers with; panics on a
/// transport error.
pub async fn get_status(url: impl reqwest::IntoUrl) -> reqwest::StatusCode {
    http().get(url).send().await.unwrap().status()
}

/// `(code, reason, message)` of an error the API server answered; panics
/// on any other error.
#[must_use]
pub fn api_error(e: kube::Error) -> (u16, String, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason, s.message),
        other => panic!("not an API error: {other}"),
    }
}

/// The resourceVersion of a list of `api` now: a watch from it misses
/// nothing that changes after this call.
pub async fn list_version<K>(api: &kube::Api<K>) -> String
where
    K: Clone + std::fmt::Debug + k8s_openapi::serde::de::DeserializeOwned,
{
    api.list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .expect("a list carries its resourceVersion")
}

/// Applies `patch` to object `name` of `api`; panics when the API server
/// refuses it.
pub async fn patch<K>(api: &kube::Api<K>, name: &str, patch: kube::api::Patch<serde_json::Value>) -> K
where
    K: Clone + std::fmt::Debug + k8s_openapi::serde::de::DeserializeOwned,
{
    api.patch(name, &kube::api::PatchParams::default(), &patch)
        .await
        .unwrap_or_else(|e| panic!("patch {name}: {e}"))
}
