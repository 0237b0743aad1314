//! Every write the controller makes to Kubernetes: the claim JSON Patch
//! (spec §4.4), the ready-at patch (§4.5) and pod deletion (§4.6). Each write
//! uses the field manager `skipper/controller` and is reflected in the local
//! [`PodCache`] at once.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::{Value, json};

use super::cache::PodCache;
use super::format_time;
use crate::domain::{FIELD_MANAGER, Function};

/// A write that failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The claim's `test` operations failed (the pod is no longer in the
    /// pool, another controller won the race, or the pod is gone): try
    /// another pod.
    #[error("pod {0} is no longer claimable")]
    Conflict(String),
    /// The API server rejected or failed the request.
    #[error("kubernetes API: {0}")]
    Api(#[source] Box<kube::Error>),
}

impl WriteError {
    fn from_kube(pod: &str, e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(s) if s.code == 422 || s.code == 409 || s.code == 404 => {
                Self::Conflict(pod.to_owned())
            }
            _ => Self::Api(Box::new(e)),
        }
    }
}

/// The claim operations, in the order the wire contract fixes: four
/// `test`s, the `copy` of the owning ReplicaSet's name, three `add`s; then,
/// with `owner` (the pool's Deployment), an ownerReference to it. Values are
/// JSON-encoded by `serde_json`, so any tenant or function text is safe.
///
/// The ReplicaSet releases a claimed pod (its labels no longer match) by
/// removing its own reference only, so the pod stays owned by the pool's
/// Deployment, not as its controller: deleting the Deployment deletes its
/// tenants' pods too (the garbage collector does), and uninstalling a pool
/// leaves none behind.
#[must_use]
pub fn claim_ops(function: &Function, assigned_at: SystemTime, owner: Option<&OwnerReference>) -> Value {
    let mut ops = json!([
        {"op": "test", "path": "/metadata/ownerReferences/0/kind", "value": "ReplicaSet"},
        {"op": "test", "path": "/metadata/labels/skipper~1tenant", "value": null},
        {"op": "test", "path": "/metadata/annotations/skipper~1function", "value": null},
        {"op": "test", "path": "/metadata/annotations/skipper~1assigned-at", "value": null},
        {"op": "copy", "path": "/metadata/annotations/skipper~1replica-set", "from": "/metadata/ownerReferences/0/name"},
        {"op": "add", "path": "/metadata/labels/skipper~1tenant", "value": function.tenant},
        {"op": "add", "path": "/metadata/annotations/skipper~1function", "value": function.to_json()},
        {"op": "add", "path": "/metadata/annotations/skipper~1assigned-at", "value": format_time(assigned_at)},
    ]);
    if let (Some(owner), Some(list)) = (owner, ops.as_array_mut()) {
        // The first `test` makes sure the list exists (the ReplicaSet's reference is first).
        list.push(json!({"op": "add", "path": "/metadata/ownerReferences/-", "value": owner}));
    }
    ops
}

/// The ownerReference a claimed pod gets to its pool's Deployment: not its
/// controller (the ReplicaSet does not adopt it back, the Deployment
/// controller ignores it) and not blocking the owner's deletion (which would
/// need `update` on `deployments/finalizers`).
#[must_use]
pub fn pool_owner(deployment: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "apps/v1".to_owned(),
        kind: "Deployment".to_owned(),
        name: deployment.to_owned(),
        uid: uid.to_owned(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    }
}

fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

fn json_patch(ops: Value) -> Result<Patch<()>, WriteError> {
    serde_json::from_value(ops)
        .map(Patch::Json)
        .map_err(|e| WriteError::Api(Box::new(kube::Error::SerdeError(e))))
}

/// Writes pods of one namespace and keeps its cache in step.
#[derive(Clone)]
pub struct PodWriter {
    api: Api<Pod>,
    cache: Arc<PodCache>,
}

impl std::fmt::Debug for PodWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodWriter")
            .field("namespace", &self.cache.namespace())
            .finish()
    }
}

impl PodWriter {
    /// A writer for the namespace of `cache`.
    #[must_use]
    pub fn new(client: kube::Client, cache: Arc<PodCache>) -> Self {
        Self {
            api: Api::namespaced(client, cache.namespace()),
            cache,
        }
    }

    /// The cache this writer updates.
    #[must_use]
    pub fn cache(&self) -> &Arc<PodCache> {
        &self.cache
    }

    /// Claims pool pod `name` for `function`, owned by `owner` (see
    /// [`claim_ops`]) when given.
    ///
    /// # Errors
    /// [`WriteError::Conflict`] when the pod is no longer claimable,
    /// [`WriteError::Api`] otherwise.
    #[tracing::instrument(name = "controller.claim", skip_all, fields(pod = name))]
    pub async fn claim(
        &self,
        name: &str,
        function: &Function,
        now: SystemTime,
        owner: Option<&OwnerReference>,
    ) -> Result<Pod, WriteError> {
        let patch = json_patch(claim_ops(function, now, owner))?;
        let pod = self
            .api
            .patch(name, &params(), &patch)
            .await
            .map_err(|e| WriteError::from_kube(name, e))?;
        self.cache.apply(pod.clone(), false);
        Ok(pod)
    }

    /// Adds `skipper/ready-at` with up to five attempts (backoff 50, 100,
    /// 200, 400 ms). A pod that is gone is not an error.
    ///
    /// # Errors
    /// [`WriteError::Api`] after the last failed attempt.
    pub async fn patch_ready_at(&self, name: &str, ready_at: &str) -> Result<(), WriteError> {
        let ops =
            json!([{"op": "add", "path": "/metadata/annotations/skipper~1ready-at", "value": ready_at}]);
        let mut delay = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let patch = json_patch(ops.clone())?;
            match self.api.patch(name, &params(), &patch).await {
                Ok(pod) => {
                    self.cache.apply(pod, false);
                    return Ok(());
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                Err(e) if attempt >= 5 => return Err(WriteError::Api(Box::new(e))),
                Err(e) => {
                    tracing::debug!(pod = name, error = %e, "ready-at patch failed, retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
    }

    /// Reads a pod from the API server (not the cache): `None` when it does
    /// not exist.
    ///
    /// # Errors
    /// [`WriteError::Api`] when the API server fails the request.
    pub async fn fetch(&self, name: &str) -> Result<Option<Pod>, WriteError> {
        self.api
            .get_opt(name)
            .await
            .map_err(|e| WriteError::Api(Box::new(e)))
    }

    /// Deletes the pod `name` only if it is still the object with `uid`
    /// (graceful). Returns `false` when it was already gone or replaced.
    ///
    /// # Errors
    /// [`WriteError::Api`] when the API server fails the request.
    pub async fn delete_exact(&self, name: &str, uid: &str) -> Result<bool, WriteError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.api.delete(name, &params).await {
            Ok(_) => {
                self.cache.remove(name);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(false),
            Err(e) => Err(WriteError::Api(Box::new(e))),
        }
    }

    /// Deletes a pod (graceful, default options). Returns `false` when it
    /// was already gone.
    ///
    /// # Errors
    /// [`WriteError::Api`] when the API server fails the request.
    pub async fn delete(&self, name: &str) -> Result<bool, WriteError> {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {
                self.cache.remove(name);
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {
                self.cache.remove(name);
                Ok(false)
            }
            Err(e) => Err(WriteError::Api(Box::new(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Scale;

    #[test]
    fn claim_patch_is_the_eight_ops_in_order_and_escaped() {
        let f = Function {
            namespace: "ns".into(),
            deployment: "dep".into(),
            tenant: "t-1".into(),
            metadata: Some("quote \" backslash \\ del \u{7f}".into()),
            scale: Some(Scale {
                max_instances: Some(2),
                ..Scale::default()
            }),
            oneshot: None,
        };
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_705_314_600);
        let ops = claim_ops(&f, t, None);
        let ops = ops.as_array().unwrap();
        let kinds: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["test", "test", "test", "test", "copy", "add", "add", "add"]
        );
        assert_eq!(ops[0]["value"], "ReplicaSet");
        assert!(ops[1]["value"].is_null());
        assert_eq!(ops[4]["from"], "/metadata/ownerReferences/0/name");
        assert_eq!(ops[5]["value"], "t-1");
        let stored = ops[6]["value"].as_str().unwrap();
        assert_eq!(Function::from_json(stored).unwrap(), f, "annotation round-trips");
        assert_eq!(ops[7]["value"], "2024-01-15T10:30:00Z");
        // The patch parses as an RFC 6902 document.
        let text = serde_json::to_string(&Value::Array(ops.clone())).unwrap();
        assert!(serde_json::from_str::<json_patch::Patch>(&text).is_ok());
    }

    #[test]
    fn a_claim_with_an_owner_adds_a_non_controller_reference_after_the_contract_ops() {
        let f = Function {
            namespace: "ns".into(),
            deployment: "dep".into(),
            tenant: "t".into(),
            metadata: None,
            scale: None,
            oneshot: None,
        };
        let owner = pool_owner("dep", "uid-1");
        let ops = claim_ops(&f, SystemTime::UNIX_EPOCH, Some(&owner));
        let ops = ops.as_array().unwrap();
        assert_eq!(ops.len(), 9);
        assert_eq!(
            ops[..8],
            claim_ops(&f, SystemTime::UNIX_EPOCH, None).as_array().unwrap()[..]
        );
        assert_eq!(
            ops[8],
            json!({"op": "add", "path": "/metadata/ownerReferences/-", "value": {
                "apiVersion": "apps/v1", "kind": "Deployment", "name": "dep", "uid": "uid-1",
                "controller": false, "blockOwnerDeletion": false}})
        );
        // Applied to a pool pod (the `test`s aside: absent members compare
        // with null on the API server, not in RFC 6902): the ReplicaSet stays
        // first, the Deployment follows.
        let mut pod = json!({"metadata": {
            "labels": {}, "annotations": {},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "dep-abc",
                                 "uid": "rs-1", "controller": true}]}});
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops[4..].to_vec())).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();
        let refs = pod["metadata"]["ownerReferences"].as_array().unwrap();
        assert_eq!(
            (refs[0]["kind"].as_str(), refs[1]["kind"].as_str()),
            (Some("ReplicaSet"), Some("Deployment"))
        );
        assert_eq!(pod["metadata"]["annotations"]["skipper/replica-set"], "dep-abc");
    }
}
