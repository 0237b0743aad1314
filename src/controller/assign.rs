//! Assigning a pool pod to a function (spec §3.1–3.3, §4.4–4.5): pick a
//! Running and Ready unassigned pod, claim it with the JSON Patch, wait for
//! the pod store to show a new pool pod when the pool is empty (woken by the
//! watch, bounded by the caller's deadline), POST the assign path with the
//! signed token, delete the pod when that fails, and mark the instance ready
//! in memory at once while `skipper/ready-at` is patched in the background.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::seq::IndexedRandom;
use tokio::time::Instant;

use super::error::Error;
use super::kube::pods::WriteError;
use super::kube::stores::Namespace;
use super::kube::{Instance, format_time, is_ready, join_addr, pod_port};
use super::metrics::Metrics;
use crate::domain::{Function, HEADER_FUNCTION, HEADER_TOKEN};
use crate::shutdown::Shutdown;
use crate::token::{SigningKey, Version};

/// Everything an assignment needs.
#[derive(Clone)]
pub struct Assigner {
    http: HttpClient<HttpConnector, Empty<Bytes>>,
    key: SigningKey,
    version: Version,
    path: String,
    timeout: Duration,
    metrics: Metrics,
    shutdown: Shutdown,
}

impl std::fmt::Debug for Assigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assigner")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Guard that keeps the waiting gauge raised while a claim waits.
struct Waiting<'a> {
    metrics: &'a Metrics,
    deployment: &'a str,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.metrics
            .waiting_for_unassigned_pods
            .get_or_create(&Metrics::function(self.deployment))
            .dec();
    }
}

impl Assigner {
    /// An assigner signing with `key` and POSTing `path` with `timeout`.
    #[must_use]
    pub fn new(
        key: SigningKey,
        version: Version,
        path: String,
        timeout: Duration,
        metrics: Metrics,
        shutdown: Shutdown,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
            key,
            version,
            path,
            timeout,
            metrics,
            shutdown,
        }
    }

    /// Assigns a pool pod of `ns` to `function`, waiting for one until
    /// `deadline`.
    ///
    /// # Errors
    /// [`Error::NoPoolPod`] when no pool pod appears before the deadline,
    /// [`Error::AssignFailed`] when the pod refused or did not answer (the
    /// pod is deleted), [`Error::Kube`] when the API server fails.
    #[tracing::instrument(name = "controller.assign", skip_all, fields(function = %function.id(), deployment = %function.deployment))]
    pub async fn assign(
        &self,
        ns: &Namespace,
        function: &Function,
        deadline: Instant,
    ) -> Result<Instance, Error> {
        self.metrics
            .assignments_total
            .get_or_create(&Metrics::function(&function.deployment))
            .inc();
        let pod = self.claim(ns, function, deadline).await?;
        let name = pod.metadata.name.clone().unwrap_or_default();
        let result = self.post(&pod, function).await;
        let ready_at = match result {
            Ok(t) => t,
            Err(reason) => {
                if let Err(e) = ns.writer.delete(&name).await {
                    tracing::warn!(pod = %name, error = %e, "failed to delete pod after a failed assignment");
                }
                return Err(Error::AssignFailed { pod: name, reason });
            }
        };
        let stamp = format_time(ready_at);
        ns.pods.mark_ready(&name, &stamp);
        {
            let writer = ns.writer.clone();
            let name = name.clone();
            let timeout = self.timeout;
            self.shutdown.spawn("patch-ready-at", async move {
                match tokio::time::timeout(timeout, writer.patch_ready_at(&name, &stamp)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(pod = %name, error = %e, "failed to persist ready-at annotation")
                    }
                    Err(_) => tracing::warn!(pod = %name, "failed to persist ready-at annotation: timed out"),
                }
            });
        }
        let mut instance =
            Instance::from_pod(&pod, Arc::new(function.clone())).map_err(|e| Error::AssignFailed {
                pod: name.clone(),
                reason: e.to_string(),
            })?;
        let secs = ready_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        instance.ready_at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        Ok(instance)
    }

    /// Claims a pool pod, trying each candidate once and waiting for the
    /// store to change when none is left.
    async fn claim(
        &self,
        ns: &Namespace,
        function: &Function,
        deadline: Instant,
    ) -> Result<k8s_openapi::api::core::v1::Pod, Error> {
        let mut tried: HashSet<String> = HashSet::new();
        let mut waiting: Option<Waiting<'_>> = None;
        let mut changes = ns.pods.subscribe();
        loop {
            changes.mark_unchanged();
            let candidates: Vec<String> = ns
                .pods
                .pool(&function.deployment)
                .iter()
                .filter(|p| is_ready(p) && is_pool_owned(p))
                .filter_map(|p| p.metadata.name.clone())
                .filter(|n| !tried.contains(n))
                .collect();
            let pick = candidates.choose(&mut rand::rng()).cloned();
            if let Some(name) = pick {
                match ns.writer.claim(&name, function, SystemTime::now()).await {
                    Ok(pod) => return Ok(pod),
                    Err(WriteError::Conflict(_)) => {
                        tracing::debug!(pod = %name, "pod no longer claimable, trying another");
                        tried.insert(name);
                        continue;
                    }
                    Err(WriteError::Api(e)) => return Err(Error::Kube(e)),
                }
            }
            if waiting.is_none() {
                self.metrics
                    .waiting_for_unassigned_pods
                    .get_or_create(&Metrics::function(&function.deployment))
                    .inc();
                waiting = Some(Waiting {
                    metrics: &self.metrics,
                    deployment: &function.deployment,
                });
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(Error::NoPoolPod {
                    deployment: function.deployment.clone(),
                    namespace: function.namespace.clone(),
                });
            }
        }
    }

    /// POSTs the assignment; returns the time captured before signing.
    async fn post(
        &self,
        pod: &k8s_openapi::api::core::v1::Pod,
        function: &Function,
    ) -> Result<SystemTime, String> {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        let port = pod_port(pod).map_err(|e| e.to_string())?;
        let now = SystemTime::now();
        let token = self
            .key
            .sign(self.version, &function.tenant, now)
            .map_err(|e| e.to_string())?;
        let uri = format!("http://{}{}", join_addr(&ip, &port), self.path);
        let req = http::Request::post(uri)
            .header(HEADER_TOKEN, token)
            .header(HEADER_FUNCTION, function.to_json())
            .header(http::header::CONTENT_LENGTH, "0")
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("failed to build assign request: {e}"))?;
        let exchange = async {
            let resp = self
                .http
                .request(req)
                .await
                .map_err(|e| format!("failed to send assign request: {e}"))?;
            let status = resp.status();
            if status == http::StatusCode::OK {
                return Ok(());
            }
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Err(format!(
                "assign request failed: status={} body={}",
                status.as_u16(),
                String::from_utf8_lossy(&body).trim()
            ))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(())) => Ok(now),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!(
                "failed to send assign request: timed out after {:?}",
                self.timeout
            )),
        }
    }
}

/// Whether the pod's first owner is a ReplicaSet (claimable pool pod).
fn is_pool_owned(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    pod.metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.first())
        .is_some_and(|o| o.kind == "ReplicaSet")
}
