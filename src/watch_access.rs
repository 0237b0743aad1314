//! Whether the API server lets each of a process's watches run.
//!
//! A cache fed by a watch keeps its first list forever when the API server
//! refuses the watch itself (403: the `watch` verb is not granted, 401: the
//! credential is no longer accepted): the informer retries and logs, and
//! everything reading the cache sees a cluster that never changes. The
//! controller and the router report such a cache in their health instead
//! of serving from it.
//!
//! [`Refusals::client`] wraps the client of one watch so that its requests
//! report the API server's answer: a refused list or watch (401/403) marks
//! the watch refused; an accepted watch (2xx) clears the mark — a list
//! alone does not, as only a running watch keeps the cache current.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use kube::client::Body;
use tokio::sync::watch;

/// The refused watches of a process: what each watches (`pods in namespace
/// skipper-functions`) → the API server's last answer.
#[derive(Debug, Clone)]
pub struct Refusals {
    tx: Arc<watch::Sender<BTreeMap<String, Refusal>>>,
}

/// The API server's answer to a refused request of a watch, and what the
/// request asked (the verb the caller lacks when it is 403).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    /// `list` or `watch`.
    pub verb: &'static str,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.status)
    }
}

impl Default for Refusals {
    fn default() -> Self {
        Self::new()
    }
}

impl Refusals {
    /// No watch refused.
    #[must_use]
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::channel(BTreeMap::new()).0),
        }
    }

    /// A client for the watch of `what`, reporting its answers here. Call
    /// inside a Tokio runtime (the client buffers its requests in a task
    /// that ends with the client).
    #[must_use]
    pub fn client(&self, client: &kube::Client, what: impl Into<String>) -> kube::Client {
        let namespace = client.default_namespace().to_owned();
        kube::Client::new(
            Observed {
                client: client.clone(),
                what: Arc::from(what.into()),
                refusals: self.clone(),
            },
            namespace,
        )
    }

    /// Records the answer to a request of the watch of `what`.
    pub fn record(&self, what: &str, watch: bool, status: StatusCode) {
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            let why = Refusal {
                status,
                verb: if watch { "watch" } else { "list" },
            };
            self.tx.send_if_modified(|m| {
                if m.get(what) == Some(&why) {
                    return false;
                }
                m.insert(what.to_owned(), why);
                true
            });
        } else if watch && status.is_success() {
            self.tx.send_if_modified(|m| m.remove(what).is_some());
        }
    }

    /// The watches refused now.
    #[must_use]
    pub fn current(&self) -> BTreeMap<String, Refusal> {
        self.tx.borrow().clone()
    }

    /// Follows the refused watches (changes only).
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<BTreeMap<String, Refusal>> {
        self.tx.subscribe()
    }

    /// One line naming every refused watch and what it lacks, for health
    /// logs and answers.
    #[must_use]
    pub fn describe(refused: &BTreeMap<String, Refusal>) -> String {
        refused
            .iter()
            .map(|(what, why)| {
                let lacks = if why.status == StatusCode::FORBIDDEN {
                    format!(": the `{}` verb is not granted", why.verb)
                } else {
                    ": the credential is not accepted".to_owned()
                };
                format!("watch of {what} refused ({why}){lacks}")
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Whether a request is a watch (`?watch=true`, as kube-rs sends it).
fn is_watch<B>(req: &Request<B>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

/// A client of one watch that reports its answers to [`Refusals`].
#[derive(Clone)]
struct Observed {
    client: kube::Client,
    what: Arc<str>,
    refusals: Refusals,
}

impl tower::Service<Request<Body>> for Observed {
    type Response = Response<Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, kube::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), kube::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let watch = is_watch(&req);
        let this = self.clone();
        Box::pin(async move {
            let res = this.client.send(req).await?;
            this.refusals.record(&this.what, watch, res.status());
            Ok(res)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PODS: &str = "pods in namespace fn";

    #[test]
    fn a_refused_watch_is_marked_until_a_watch_is_accepted() {
        let r = Refusals::new();
        let mut rx = r.subscribe();
        r.record(PODS, false, StatusCode::OK);
        assert!(r.current().is_empty());
        r.record(PODS, true, StatusCode::FORBIDDEN);
        assert_eq!(
            r.current().get(PODS),
            Some(&Refusal {
                status: StatusCode::FORBIDDEN,
                verb: "watch"
            })
        );
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        // The same refusal again is no change; a list does not clear it.
        r.record(PODS, true, StatusCode::FORBIDDEN);
        r.record(PODS, false, StatusCode::OK);
        assert!(!rx.has_changed().unwrap());
        assert_eq!(r.current().len(), 1);
        // Other failures say nothing about access.
        r.record(PODS, true, StatusCode::GONE);
        r.record(PODS, true, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.current().len(), 1);
        r.record(PODS, true, StatusCode::OK);
        assert!(r.current().is_empty());
        assert!(rx.has_changed().unwrap());
    }

    #[test]
    fn a_refused_list_and_an_expired_credential_mark_it_too() {
        let r = Refusals::new();
        r.record(PODS, false, StatusCode::FORBIDDEN);
        r.record("replicasets in namespace fn", true, StatusCode::UNAUTHORIZED);
        assert_eq!(
            Refusals::describe(&r.current()),
            "watch of pods in namespace fn refused (403 Forbidden): the `list` verb is not granted; \
             watch of replicasets in namespace fn refused (401 Unauthorized): the credential is not accepted"
        );
    }

    #[test]
    fn watch_requests_are_told_from_lists() {
        let req = |uri: &str| Request::get(uri).body(()).unwrap();
        assert!(is_watch(&req(
            "/api/v1/namespaces/ns/pods?&watch=true&timeoutSeconds=290&resourceVersion=0"
        )));
        assert!(!is_watch(&req("/api/v1/namespaces/ns/pods?&limit=500")));
        assert!(!is_watch(&req(
            "/api/v1/namespaces/ns/pods?labelSelector=watch%3Dtrue"
        )));
        assert!(!is_watch(&req("/api/v1/namespaces/ns/pods")));
    }
}
