//! The control loops: Deployment → ReplicaSet → Pods, the scheduler,
//! namespace termination, garbage collection of dependents, and
//! EndpointSlices for Services. One pass reconciles every object; the
//! cluster runs a pass after each store change.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use serde_json::{Value, json};

use super::deployment;
use super::error::ApiError;
use super::replicaset;
use super::resources::by_kind;
use super::selector::{LabelSelector, labels_of};
use super::store::{Store, is_terminating, name_of, namespace_of, uid_of};

/// Label carrying the template hash on ReplicaSets and their pods.
pub use super::deployment::POD_TEMPLATE_HASH;

/// What the control loops need besides the store.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The cluster CA (PEM), published in every namespace as `kube-root-ca.crt`.
    pub ca_pem: String,
    /// When (Unix seconds) the pass last looked for expired Events.
    pub events_expired_at: Arc<AtomicI64>,
}

/// Name of the ConfigMap holding the cluster CA in every namespace.
pub const ROOT_CA_CONFIG_MAP: &str = "kube-root-ca.crt";
/// The description kube-controller-manager's root-CA publisher puts on it.
const ROOT_CA_DESCRIPTION: &str = "Contains a CA bundle that can be used to verify the kube-apiserver when using internal endpoints such as the internal service IP or kubernetes.default.svc. No other usage is guaranteed across distributions of Kubernetes clusters.";

/// One full reconciliation pass. Returns the first error it met (the pass carries on past errors).
pub fn reconcile(store: &Store, ctx: &Context) -> Result<(), ApiError> {
    let mut first_err = None;
    let mut note = |r: Result<(), ApiError>| {
        if let Err(e) = r
            && first_err.is_none()
        {
            first_err = Some(e);
        }
    };
    note(namespace_defaults(store, ctx));
    // An Event lives an hour: looking for expired ones every few seconds
    // is soon enough, and spares the other passes a read of every Event.
    let now = jiff::Timestamp::now().as_second();
    if now - ctx.events_expired_at.load(Ordering::Relaxed) >= EVENT_EXPIRY_INTERVAL_SECONDS {
        ctx.events_expired_at.store(now, Ordering::Relaxed);
        expire_events(store);
    }
    note(deployments(store));
    note(replicasets(store));
    note(terminate_namespaces(store));
    note(super::scheduler::schedule(store));
    note(garbage_collect(store));
    note(endpoint_slices(store));
    first_err.map_or(Ok(()), Err)
}

/// When the next Ready pod of a ReplicaSet with `minReadySeconds` turns
/// available: the controllers' loop wakes then, as kube-controller-manager
/// requeues such a ReplicaSet after `minReadySeconds` (its Deployment follows
/// the ReplicaSet's status). `None` when no pod is waiting.
#[must_use]
pub fn next_wake(store: &Store) -> Option<jiff::Timestamp> {
    let min_ready = |rs: &Value| {
        rs.pointer("/spec/minReadySeconds")
            .and_then(Value::as_i64)
            .unwrap_or(0)
    };
    let all_rs = store.snapshot(by_kind("ReplicaSet"), None);
    let waiting: Vec<&Value> = all_rs
        .iter()
        .map(|v| &**v)
        .filter(|rs| min_ready(rs) > 0)
        .collect();
    if waiting.is_empty() {
        return None;
    }
    let pods = store.snapshot(by_kind("Pod"), None);
    let now = jiff::Timestamp::now();
    waiting
        .into_iter()
        .filter_map(|rs| {
            let uid = uid_of(rs);
            let owned: Vec<&Value> = pods
                .iter()
                .map(|v| &**v)
                .filter(|p| controlled_by(p, uid))
                .collect();
            replicaset::next_availability(&owned, min_ready(rs), now)
        })
        .min()
}

/// Whether the object carries a controller ownerReference with this uid.
fn controlled_by(obj: &Value, owner_uid: &str) -> bool {
    controller_ref(obj).is_some_and(|r| r.get("uid").and_then(Value::as_str) == Some(owner_uid))
}

fn controller_ref(obj: &Value) -> Option<&Value> {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .and_then(|refs| {
            refs.iter()
                .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
        })
}

fn owner_ref(owner: &Value) -> Value {
    json!({
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": name_of(owner),
        "uid": uid_of(owner),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

fn replicas_of(obj: &Value) -> i64 {
    obj.pointer("/spec/replicas").and_then(Value::as_i64).unwrap_or(1)
}

/// Whether a pod is Ready (condition `Ready` is `True`).
#[must_use]
pub fn pod_ready(pod: &Value) -> bool {
    pod.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

fn pod_finished(pod: &Value) -> bool {
    matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Failed" | "Succeeded")
    )
}

fn ignore_not_found(r: Result<Value, ApiError>) -> Result<(), ApiError> {
    match r {
        Ok(_) | Err(ApiError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Deletes a pod the way the API does by default: gracefully when it runs
/// on a node, at once when it never got scheduled.
///
/// # Errors
/// `NotFound` when the pod is gone.
pub fn delete_pod(store: &Store, ns: &str, name: &str, grace: Option<i64>) -> Result<Value, ApiError> {
    let res = by_kind("Pod");
    let Some(pod) = store.get(res, ns, name) else {
        return Err(ApiError::NotFound {
            res,
            name: name.to_owned(),
        });
    };
    let grace = grace.unwrap_or_else(|| {
        pod.pointer("/spec/terminationGracePeriodSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(30)
    });
    let scheduled = pod
        .pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    if grace <= 0 || !scheduled {
        store.remove(res, ns, name, None)
    } else {
        store.mark_terminating(res, ns, name, grace)
    }
}

/// The ServiceAccount controller (a `default` ServiceAccount in every
/// namespace) and the root-CA publisher (`kube-root-ca.crt` in every
/// namespace, put back when changed or deleted).
fn namespace_defaults(store: &Store, ctx: &Context) -> Result<(), ApiError> {
    let namespaces = store.snapshot(by_kind("Namespace"), None);
    let sares = by_kind("ServiceAccount");
    let cmres = by_kind("ConfigMap");
    for ns in namespaces.iter().filter(|n| !is_terminating(n)) {
        let ns = name_of(ns);
        if store.get_shared(sares, ns, "default").is_none() {
            match store.create(sares, ns, json!({"metadata": {"name": "default"}})) {
                Ok(_) | Err(ApiError::AlreadyExists { .. } | ApiError::Terminating { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if ctx.ca_pem.is_empty() {
            continue;
        }
        let data = || json!({"ca.crt": ctx.ca_pem});
        // The published data is exactly the CA, and nothing binary.
        let published = |cm: &Value| {
            cm.get("data")
                .and_then(Value::as_object)
                .is_some_and(|d| d.len() == 1 && d.get("ca.crt").and_then(Value::as_str) == Some(&ctx.ca_pem))
                && cm.get("binaryData").is_none()
        };
        match store.get_shared(cmres, ns, ROOT_CA_CONFIG_MAP) {
            None => {
                let cm = json!({
                    "metadata": {"name": ROOT_CA_CONFIG_MAP,
                                 "annotations": {"kubernetes.io/description": ROOT_CA_DESCRIPTION}},
                    "data": data(),
                });
                match store.create(cmres, ns, cm) {
                    Ok(_) | Err(ApiError::AlreadyExists { .. } | ApiError::Terminating { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Some(cm) if !published(&cm) => {
                ignore_not_found(store.update(cmres, ns, ROOT_CA_CONFIG_MAP, |o| {
                    o["data"] = data();
                    if let Some(m) = o.as_object_mut() {
                        m.remove("binaryData");
                    }
                    Ok(())
                }))?;
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// `source.component` of the Deployment controller's Events.
pub const DEPLOYMENT_CONTROLLER: &str = "deployment-controller";
/// `source.component` of the ReplicaSet controller's Events.
pub const REPLICASET_CONTROLLER: &str = "replicaset-controller";

/// Records a core/v1 Event about `involved`, as client-go's recorder does:
/// a repeat of the same (object, reason, message, source) within the
/// history raises `count` and `lastTimestamp` of the existing Event.
/// Recording is best effort (a failure is logged, never returned).
pub fn record_event(
    store: &Store,
    involved: &Value,
    type_: &str,
    reason: &str,
    message: &str,
    component: &str,
) {
    let evres = by_kind("Event");
    let ns = namespace_of(involved);
    let uid = uid_of(involved);
    let existing = store.snapshot(evres, Some(ns));
    let same = existing.iter().find(|e| {
        e.pointer("/involvedObject/uid").and_then(Value::as_str) == Some(uid)
            && e.get("reason").and_then(Value::as_str) == Some(reason)
            && e.get("message").and_then(Value::as_str) == Some(message)
            && e.pointer("/source/component").and_then(Value::as_str) == Some(component)
    });
    let now = super::store::now_rfc3339();
    let result = match same {
        Some(e) => store
            .update(evres, ns, name_of(e), |o| {
                let count = o.get("count").and_then(Value::as_i64).unwrap_or(1);
                o["count"] = json!(count + 1);
                o["lastTimestamp"] = json!(now);
                Ok(())
            })
            .map(|_| ()),
        None => {
            let nanos = jiff::Timestamp::now().as_nanosecond();
            let event = json!({
                "metadata": {"name": format!("{}.{:x}", name_of(involved), nanos)},
                "involvedObject": {
                    "kind": involved["kind"], "namespace": ns, "name": name_of(involved), "uid": uid,
                    "apiVersion": involved["apiVersion"],
                    "resourceVersion": involved.pointer("/metadata/resourceVersion").cloned().unwrap_or(Value::Null),
                },
                "reason": reason,
                "message": message,
                "source": {"component": component},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "type": type_,
                "eventTime": null,
                "reportingComponent": component,
                "reportingInstance": "",
            });
            store.create(evres, ns, event).map(|_| ())
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, reason, "recording an event");
    }
}

/// How long an Event is kept after it last happened (kube-apiserver's `--event-ttl`).
const EVENT_TTL_SECONDS: i64 = 3600;
/// How often a pass looks for expired Events.
const EVENT_EXPIRY_INTERVAL_SECONDS: i64 = 10;

/// Removes Events not seen for [`EVENT_TTL_SECONDS`], as etcd's lease on them does.
fn expire_events(store: &Store) {
    let evres = by_kind("Event");
    let cutoff = jiff::Timestamp::now().as_second() - EVENT_TTL_SECONDS;
    let events = store.snapshot(evres, None);
    for e in events {
        let last = e
            .get("lastTimestamp")
            .and_then(Value::as_str)
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .map_or(i64::MAX, jiff::Timestamp::as_second);
        if last < cutoff {
            let _ = store.remove(evres, namespace_of(&e), name_of(&e), Some(uid_of(&e)));
        }
    }
}

/// Removes the ownerReference with `owner_uid` (the owner releases the object).
fn release(
    store: &Store,
    res: &'static super::resources::ResourceDef,
    obj: &Value,
    owner_uid: &str,
) -> Result<(), ApiError> {
    let rv = obj.pointer("/metadata/resourceVersion").cloned();
    ignore_gone(store.update(res, namespace_of(obj), name_of(obj), |o| {
        if let Some(rv) = rv {
            o["metadata"]["resourceVersion"] = rv;
        }
        if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
            refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(owner_uid));
            if refs.is_empty()
                && let Some(m) = o["metadata"].as_object_mut()
            {
                m.remove("ownerReferences");
            }
        }
        Ok(())
    }))
}

/// Adds a controller ownerReference to `owner` (the owner adopts the object);
/// the adopted object as stored.
fn adopt(
    store: &Store,
    res: &'static super::resources::ResourceDef,
    obj: &Value,
    owner: &Value,
) -> Result<Option<Value>, ApiError> {
    let rv = obj.pointer("/metadata/resourceVersion").cloned();
    let rref = owner_ref(owner);
    match store.update(res, namespace_of(obj), name_of(obj), |o| {
        if let Some(rv) = rv {
            o["metadata"]["resourceVersion"] = rv;
        }
        match o["metadata"]["ownerReferences"].as_array_mut() {
            Some(refs) => refs.push(rref),
            None => o["metadata"]["ownerReferences"] = json!([rref]),
        }
        Ok(())
    }) {
        Ok(v) => Ok(Some(v)),
        Err(ApiError::NotFound { .. } | ApiError::Conflict { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Like [`ignore_not_found`], also for a write that lost a race (the next pass retries).
fn ignore_gone(r: Result<Value, ApiError>) -> Result<(), ApiError> {
    match r {
        Ok(_) | Err(ApiError::NotFound { .. } | ApiError::Conflict { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The objects of `candidates` (one namespace) that `owner` controls,
/// adopting orphans its selector matches and releasing what it controls but
/// no longer matches (`ClaimObject`); nothing changes hands while either is
/// being deleted.
fn claim<'a>(
    store: &Store,
    res: &'static super::resources::ResourceDef,
    owner: &Value,
    selector: &LabelSelector,
    candidates: &[&'a Value],
) -> Result<Vec<Cow<'a, Value>>, ApiError> {
    let uid = uid_of(owner);
    let owner_deleting = is_terminating(owner);
    let matches = |obj: &Value| !selector.0.is_empty() && selector.matches(&labels_of(obj));
    let mut claimed = Vec::new();
    for obj in candidates.iter().copied() {
        match controller_ref(obj)
            .and_then(|r| r.get("uid"))
            .and_then(Value::as_str)
        {
            Some(u) if u == uid => {
                if owner_deleting || matches(obj) {
                    claimed.push(Cow::Borrowed(obj));
                } else {
                    release(store, res, obj, uid)?;
                }
            }
            Some(_) => {}
            None => {
                if !owner_deleting && !is_terminating(obj) && matches(obj) {
                    claimed.extend(adopt(store, res, obj, owner)?.map(Cow::Owned));
                }
            }
        }
    }
    Ok(claimed)
}

fn deployments(store: &Store) -> Result<(), ApiError> {
    let dres = by_kind("Deployment");
    let rsres = by_kind("ReplicaSet");
    let deploys = store.snapshot(dres, None);
    let all_rs = store.snapshot(rsres, None);
    let pods = store.snapshot(by_kind("Pod"), None);
    let mut first_err = None;
    for d in &deploys {
        let ns = namespace_of(d);
        let Ok(selector) = LabelSelector::from_object(d.pointer("/spec/selector").unwrap_or(&Value::Null))
        else {
            continue;
        };
        let candidates: Vec<&Value> = all_rs
            .iter()
            .map(|v| &**v)
            .filter(|rs| namespace_of(rs) == ns)
            .collect();
        let owned = claim(store, rsres, d, &selector, &candidates)?;
        let mut live_pods: HashMap<String, usize> = HashMap::new();
        for rs in &owned {
            let uid = uid_of(rs);
            let n = pods
                .iter()
                .filter(|p| namespace_of(p) == ns && controlled_by(p, uid) && !pod_finished(p))
                .count();
            live_pods.insert(uid.to_owned(), n);
        }
        let input = deployment::Input {
            deployment: deployment::Deployment::from_json(d),
            replica_sets: owned
                .iter()
                .map(|rs| deployment::ReplicaSet::from_json(rs))
                .collect(),
            live_pods,
            now: jiff::Timestamp::now(),
        };
        for action in deployment::sync(input) {
            if let Err(e) = carry_out(store, d, action) {
                tracing::debug!(error = %e, deployment = name_of(d), "deployment sync");
                if first_err.is_none() {
                    first_err = Some(e);
                }
                break;
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Performs one write the Deployment controller decided on.
fn carry_out(store: &Store, d: &Value, action: deployment::Action) -> Result<(), ApiError> {
    use deployment::Action;
    let dres = by_kind("Deployment");
    let rsres = by_kind("ReplicaSet");
    let ns = namespace_of(d);
    let precondition = |o: &mut Value, rv: String| {
        if !rv.is_empty() {
            o["metadata"]["resourceVersion"] = json!(rv);
        }
    };
    match action {
        Action::CreateReplicaSet(rs) => match store.create(rsres, ns, rs.clone()) {
            Ok(_) => Ok(()),
            Err(ApiError::AlreadyExists { .. }) => {
                let existing = store.get(rsres, ns, name_of(&rs));
                let ours = existing.as_ref().is_some_and(|e| {
                    controlled_by(e, uid_of(d))
                        && deployment::equal_ignore_hash(
                            e.pointer("/spec/template").unwrap_or(&Value::Null),
                            d.pointer("/spec/template").unwrap_or(&Value::Null),
                        )
                });
                if ours {
                    return Ok(());
                }
                // A hash collision: the next template hash includes the count.
                let rv = d.pointer("/metadata/resourceVersion").cloned();
                store.update(dres, ns, name_of(d), |o| {
                    if let Some(rv) = rv {
                        o["metadata"]["resourceVersion"] = rv;
                    }
                    let count = o
                        .pointer("/status/collisionCount")
                        .and_then(Value::as_i64)
                        .unwrap_or(0);
                    o["status"]["collisionCount"] = json!(count + 1);
                    Ok(())
                })?;
                Err(ApiError::AlreadyExists {
                    res: rsres,
                    name: name_of(&rs).to_owned(),
                })
            }
            Err(e @ ApiError::Terminating { .. }) => Err(e),
            Err(e) => {
                let message = format!(
                    "Failed to create new replica set {:?}: {}",
                    name_of(&rs),
                    e.status()["message"].as_str().unwrap_or("")
                );
                if d.pointer("/spec/progressDeadlineSeconds").is_some() {
                    let now = super::store::now_rfc3339();
                    let _ = store.update(dres, ns, name_of(d), |o| {
                        let mut conditions: Vec<Value> = o
                            .pointer("/status/conditions")
                            .and_then(Value::as_array)
                            .cloned()
                            .unwrap_or_default();
                        conditions.retain(|c| c["type"] != "Progressing");
                        conditions.push(json!({"type": "Progressing", "status": "False",
                            "lastUpdateTime": now, "lastTransitionTime": now,
                            "reason": deployment::reason::FAILED_RS_CREATE, "message": message}));
                        o["status"]["conditions"] = json!(conditions);
                        Ok(())
                    });
                }
                record_event(
                    store,
                    d,
                    "Warning",
                    deployment::reason::FAILED_RS_CREATE,
                    &message,
                    DEPLOYMENT_CONTROLLER,
                );
                Err(e)
            }
        },
        Action::UpdateReplicaSet {
            name,
            resource_version,
            replicas,
            min_ready_seconds,
            annotations,
        } => store
            .update(rsres, ns, &name, |o| {
                precondition(o, resource_version);
                o["spec"]["replicas"] = json!(replicas);
                if min_ready_seconds == 0 {
                    if let Some(spec) = o["spec"].as_object_mut() {
                        spec.remove("minReadySeconds");
                    }
                } else {
                    o["spec"]["minReadySeconds"] = json!(min_ready_seconds);
                }
                o["metadata"]["annotations"] = json!(annotations);
                Ok(())
            })
            .map(|_| ()),
        Action::DeleteReplicaSet { name, uid } => {
            ignore_not_found(store.remove(rsres, ns, &name, Some(&uid)))
        }
        Action::UpdateDeployment {
            resource_version,
            template,
            annotations,
        } => store
            .update(dres, ns, name_of(d), |o| {
                precondition(o, resource_version);
                o["spec"]["template"] = template;
                o["metadata"]["annotations"] = json!(annotations);
                Ok(())
            })
            .map(|_| ()),
        Action::UpdateStatus {
            resource_version,
            annotations,
            status,
        } => store
            .update(dres, ns, name_of(d), |o| {
                precondition(o, resource_version);
                o["status"] = status;
                if annotations.is_empty() {
                    if let Some(m) = o["metadata"].as_object_mut() {
                        m.remove("annotations");
                    }
                } else {
                    o["metadata"]["annotations"] = json!(annotations);
                }
                Ok(())
            })
            .map(|_| ()),
        Action::Event {
            warning,
            reason,
            message,
        } => {
            let type_ = if warning { "Warning" } else { "Normal" };
            record_event(store, d, type_, reason, &message, DEPLOYMENT_CONTROLLER);
            Ok(())
        }
    }
}

fn replicasets(store: &Store) -> Result<(), ApiError> {
    let rsres = by_kind("ReplicaSet");
    let podres = by_kind("Pod");
    let all_rs = store.snapshot(rsres, None);
    let pods = store.snapshot(podres, None);
    let now = jiff::Timestamp::now();
    let mut first_err = None;
    for rs in &all_rs {
        let ns = namespace_of(rs);
        let uid = uid_of(rs);
        let Ok(selector) = LabelSelector::from_object(rs.pointer("/spec/selector").unwrap_or(&Value::Null))
        else {
            continue;
        };
        if selector.0.is_empty() {
            continue;
        }
        let in_ns: Vec<&Value> = pods
            .iter()
            .map(|v| &**v)
            .filter(|p| namespace_of(p) == ns)
            .collect();
        let active_candidates: Vec<&Value> = in_ns
            .iter()
            .copied()
            .filter(|p| replicaset::is_active(p))
            .collect();
        let active = claim(store, podres, rs, &selector, &active_candidates)?;
        let terminating = in_ns
            .iter()
            .filter(|p| {
                controlled_by(p, uid) && replicaset::is_terminating(p) && selector.matches(&labels_of(p))
            })
            .count();
        let mut failure = None;
        if !is_terminating(rs) {
            let want = replicas_of(rs);
            let have = i64::try_from(active.len()).unwrap_or(i64::MAX);
            if have < want {
                let n = usize::try_from(want - have)
                    .unwrap_or(0)
                    .min(replicaset::BURST_REPLICAS);
                if let Err(e) = create_pods(store, rs, n)
                    && !matches!(e, ApiError::Terminating { .. })
                {
                    failure = Some((
                        "FailedCreate",
                        e.status()["message"].as_str().unwrap_or("").to_owned(),
                    ));
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            } else if have > want {
                let n = usize::try_from(have - want)
                    .unwrap_or(0)
                    .min(replicaset::BURST_REPLICAS);
                let related = related_pods(rs, &all_rs, &in_ns);
                let active_refs: Vec<&Value> = active.iter().map(|p| &**p).collect();
                let order = replicaset::deletion_order(&active_refs, &related, now);
                for i in order.into_iter().take(n) {
                    let p = &active[i];
                    match delete_pod(store, ns, name_of(p), None) {
                        Ok(_) => record_event(
                            store,
                            rs,
                            "Normal",
                            "SuccessfulDelete",
                            &format!("Deleted pod: {}", name_of(p)),
                            REPLICASET_CONTROLLER,
                        ),
                        Err(ApiError::NotFound { .. }) => {}
                        Err(e) => {
                            let message = e.status()["message"].as_str().unwrap_or("").to_owned();
                            record_event(
                                store,
                                rs,
                                "Warning",
                                "FailedDelete",
                                &format!("Error deleting: {message}"),
                                REPLICASET_CONTROLLER,
                            );
                            failure = Some(("FailedDelete", message));
                            if first_err.is_none() {
                                first_err = Some(e);
                            }
                            break;
                        }
                    }
                }
            }
        }
        let active_refs: Vec<&Value> = active.iter().map(|p| &**p).collect();
        let status = replicaset::status(rs, &active_refs, terminating, failure, now);
        if rs.get("status") != Some(&status) {
            let rv = rs.pointer("/metadata/resourceVersion").cloned();
            ignore_gone(store.update(rsres, ns, name_of(rs), |o| {
                if let Some(rv) = rv {
                    o["metadata"]["resourceVersion"] = rv;
                }
                o["status"] = status;
                Ok(())
            }))?;
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Creates `n` pods from a ReplicaSet's template, recording each.
fn create_pods(store: &Store, rs: &Value, n: usize) -> Result<(), ApiError> {
    let podres = by_kind("Pod");
    let ns = namespace_of(rs);
    for _ in 0..n {
        let mut template = rs.pointer("/spec/template").cloned().unwrap_or_else(|| json!({}));
        if !template.get("metadata").is_some_and(Value::is_object) {
            template["metadata"] = json!({});
        }
        template["metadata"]["generateName"] = json!(format!("{}-", name_of(rs)));
        template["metadata"]["ownerReferences"] = json!([owner_ref(rs)]);
        if let Some(m) = template["metadata"].as_object_mut() {
            m.remove("name");
        }
        let pod = json!({"metadata": template["metadata"], "spec": template["spec"]});
        // Through admission, as a create through the API would be.
        match store.create(podres, ns, super::admission::admit_pod(store, ns, pod)) {
            Ok(created) => record_event(
                store,
                rs,
                "Normal",
                "SuccessfulCreate",
                &format!("Created pod: {}", name_of(&created)),
                REPLICASET_CONTROLLER,
            ),
            Err(e) => {
                if !matches!(e, ApiError::Terminating { .. }) {
                    let message = e.status()["message"].as_str().unwrap_or("").to_owned();
                    record_event(
                        store,
                        rs,
                        "Warning",
                        "FailedCreate",
                        &format!("Error creating: {message}"),
                        REPLICASET_CONTROLLER,
                    );
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The pods of every ReplicaSet with the same controller as `rs` (by each
/// one's selector): how crowded a node is counts them all.
fn related_pods<'a>(rs: &Value, all_rs: &[Arc<Value>], in_ns: &[&'a Value]) -> Vec<&'a Value> {
    let Some(owner) = controller_ref(rs)
        .and_then(|r| r.get("uid"))
        .and_then(Value::as_str)
    else {
        return in_ns
            .iter()
            .copied()
            .filter(|p| controlled_by(p, uid_of(rs)))
            .collect();
    };
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for other in all_rs
        .iter()
        .filter(|o| namespace_of(o) == namespace_of(rs) && controlled_by(o, owner))
    {
        let Ok(sel) = LabelSelector::from_object(other.pointer("/spec/selector").unwrap_or(&Value::Null))
        else {
            continue;
        };
        for p in in_ns.iter().copied().filter(|p| sel.matches(&labels_of(p))) {
            if seen.insert(uid_of(p)) {
                out.push(p);
            }
        }
    }
    out
}

/// The namespace controller: a namespace being deleted has its content
/// deleted (pods gracefully, finalizers honoured), reports what remains in
/// its conditions, and goes (its `kubernetes` finalizer removed) once it
/// is empty.
fn terminate_namespaces(store: &Store) -> Result<(), ApiError> {
    let nsres = by_kind("Namespace");
    let namespaces = store.snapshot(nsres, None);
    let mut first_err = None;
    for ns in namespaces.iter().filter(|n| is_terminating(n)) {
        let name = name_of(ns);
        let mut delete_failed = None;
        for (group, plural, obj_name) in store.keys_in_namespace(name) {
            let Some(res) = super::resources::RESOURCES
                .iter()
                .find(|r| r.group == group && r.plural == plural && !r.computed)
            else {
                continue;
            };
            let Some(obj) = store.get(res, name, &obj_name) else {
                continue;
            };
            if is_terminating(&obj) {
                continue;
            }
            let r = if res.kind == "Pod" {
                delete_pod(store, name, &obj_name, None)
            } else {
                store.remove(res, name, &obj_name, Some(uid_of(&obj)))
            };
            if let Err(e) = ignore_gone(r) {
                delete_failed = Some(e.to_string());
                if first_err.is_none() {
                    first_err = Some(e);
                }
            }
        }
        // What is left: per resource how many, per finalizer how many.
        let mut remaining: BTreeMap<String, usize> = BTreeMap::new();
        let mut held: BTreeMap<String, usize> = BTreeMap::new();
        for (group, plural, obj_name) in store.keys_in_namespace(name) {
            let Some(res) = super::resources::RESOURCES
                .iter()
                .find(|r| r.group == group && r.plural == plural && !r.computed)
            else {
                continue;
            };
            let Some(obj) = store.get(res, name, &obj_name) else {
                continue;
            };
            *remaining
                .entry(format!("{}.{}", res.plural, res.group))
                .or_default() += 1;
            for f in super::store::finalizers_of(&obj) {
                *held.entry(f.to_owned()).or_default() += 1;
            }
        }
        let conditions = namespace_conditions(ns, delete_failed.as_deref(), &remaining, &held);
        let rv = ns.pointer("/metadata/resourceVersion").cloned();
        let empty = remaining.is_empty();
        let r = store.update(nsres, "", name, |o| {
            if let Some(rv) = rv {
                o["metadata"]["resourceVersion"] = rv;
            }
            o["status"]["phase"] = json!("Terminating");
            o["status"]["conditions"] = json!(conditions);
            if empty && let Some(list) = o.pointer_mut("/spec/finalizers").and_then(Value::as_array_mut) {
                list.retain(|f| f != "kubernetes");
            }
            Ok(())
        });
        if let Err(e) = ignore_gone(r)
            && first_err.is_none()
        {
            first_err = Some(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// The namespace controller's conditions (kept in their order; a
/// condition's transition time stays while its status does).
fn namespace_conditions(
    ns: &Value,
    delete_failed: Option<&str>,
    remaining: &BTreeMap<String, usize>,
    held: &BTreeMap<String, usize>,
) -> Vec<Value> {
    let now = super::store::now_rfc3339();
    let existing: Vec<Value> = ns
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let content = match delete_failed {
        Some(e) => (
            "True",
            "ContentDeletionFailed",
            format!("Failed to delete all resource types, 1 remaining: {e}"),
        ),
        None => (
            "False",
            "ContentDeleted",
            "All content successfully deleted, may be waiting on finalization".to_owned(),
        ),
    };
    let rest = if remaining.is_empty() {
        (
            "False",
            "ContentRemoved",
            "All content successfully removed".to_owned(),
        )
    } else {
        let parts: Vec<String> = remaining
            .iter()
            .map(|(r, n)| format!("{r} has {n} resource instances"))
            .collect();
        (
            "True",
            "SomeResourcesRemain",
            format!("Some resources are remaining: {}", parts.join(", ")),
        )
    };
    let fin = if held.is_empty() {
        (
            "False",
            "ContentHasNoFinalizers",
            "All content-preserving finalizers finished".to_owned(),
        )
    } else {
        let parts: Vec<String> = held
            .iter()
            .map(|(f, n)| format!("{f} in {n} resource instances"))
            .collect();
        (
            "True",
            "SomeFinalizersRemain",
            format!(
                "Some content in the namespace has finalizers remaining: {}",
                parts.join(", ")
            ),
        )
    };
    [
        (
            "NamespaceDeletionDiscoveryFailure",
            ("False", "ResourcesDiscovered", "All resources successfully discovered".to_owned()),
        ),
        (
            "NamespaceDeletionGroupVersionParsingFailure",
            ("False", "ParsedGroupVersions", "All legacy kube types successfully parsed".to_owned()),
        ),
        ("NamespaceDeletionContentFailure", content),
        ("NamespaceContentRemaining", rest),
        ("NamespaceFinalizersRemaining", fin),
    ]
    .into_iter()
    .map(|(type_, (status, reason, message))| {
        let since = existing
            .iter()
            .find(|c| c["type"] == type_ && c["status"] == status)
            .and_then(|c| c.get("lastTransitionTime").cloned())
            .unwrap_or_else(|| json!(now));
        json!({"type": type_, "status": status, "lastTransitionTime": since, "reason": reason, "message": message})
    })
    .collect()
}

/// Finalizer that keeps an object until its blocking dependents are gone
/// (`propagationPolicy: Foreground`).
pub const FOREGROUND_DELETION: &str = "foregroundDeletion";
/// Finalizer that releases an object's dependents before it goes
/// (`propagationPolicy: Orphan`).
pub const ORPHAN: &str = "orphan";

/// One dependent of an owner.
struct Dependent<'a> {
    res: &'static super::resources::ResourceDef,
    obj: &'a Value,
    /// `blockOwnerDeletion`: a foreground deletion of the owner waits for it.
    blocking: bool,
}

/// The garbage collector, for every kind: an owner deleted with `orphan`
/// releases its dependents, one deleted with `foregroundDeletion` deletes
/// them and waits for the blocking ones, and an object whose owners are
/// all gone is deleted (references to some gone owners are removed).
fn garbage_collect(store: &Store) -> Result<(), ApiError> {
    let (uids, objs) = store.gc_view();
    let resource = |g: &str, p: &str| {
        super::resources::RESOURCES
            .iter()
            .find(|r| r.group == g && r.plural == p && !r.computed)
    };
    let owner_refs = |o: &Value| -> Vec<Value> {
        o.pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let mut dependents: HashMap<String, Vec<Dependent<'_>>> = HashMap::new();
    for (g, p, o) in &objs {
        let Some(res) = resource(g, p) else { continue };
        for r in owner_refs(o) {
            let Some(owner) = r.get("uid").and_then(Value::as_str) else {
                continue;
            };
            dependents.entry(owner.to_owned()).or_default().push(Dependent {
                res,
                obj: o,
                blocking: r.get("blockOwnerDeletion").and_then(Value::as_bool) == Some(true),
            });
        }
    }
    let mut first_err = None;
    let mut note = |r: Result<(), ApiError>| {
        if let Err(e) = r
            && first_err.is_none()
        {
            first_err = Some(e);
        }
    };
    for (g, p, owner) in objs.iter().filter(|(_, _, o)| is_terminating(o)) {
        let Some(res) = resource(g, p) else { continue };
        let finalizers = super::store::finalizers_of(owner);
        let uid = uid_of(owner);
        let deps = dependents.get(uid).map_or(&[][..], Vec::as_slice);
        if finalizers.contains(&ORPHAN) {
            // The finalizer goes once no dependent refers to the owner.
            for d in deps {
                note(release(store, d.res, d.obj, uid));
            }
            if deps.is_empty() {
                note(remove_finalizer(store, res, owner, ORPHAN));
            }
        } else if finalizers.contains(&FOREGROUND_DELETION) {
            for d in deps.iter().filter(|d| !is_terminating(d.obj)) {
                // A dependent with dependents of its own goes in the foreground too.
                let policy = dependents
                    .contains_key(uid_of(d.obj))
                    .then_some(FOREGROUND_DELETION);
                note(delete_dependent(store, d.res, d.obj, policy));
            }
            if !deps.iter().any(|d| d.blocking) {
                note(remove_finalizer(store, res, owner, FOREGROUND_DELETION));
            }
        }
    }
    for (g, p, obj) in objs.iter().filter(|(_, _, o)| !is_terminating(o)) {
        let Some(res) = resource(g, p) else { continue };
        let refs = owner_refs(obj);
        let dangling: Vec<&str> = refs
            .iter()
            .filter_map(|r| r.get("uid").and_then(Value::as_str))
            .filter(|u| !uids.contains(*u))
            .collect();
        if dangling.is_empty() {
            continue;
        }
        if dangling.len() == refs.len() {
            note(delete_dependent(store, res, obj, None));
        } else {
            for u in dangling {
                note(release(store, res, obj, u));
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Deletes a dependent for the garbage collector (a pod gracefully).
fn delete_dependent(
    store: &Store,
    res: &'static super::resources::ResourceDef,
    obj: &Value,
    finalizer: Option<&str>,
) -> Result<(), ApiError> {
    let (ns, name) = (namespace_of(obj), name_of(obj));
    let r = if res.kind == "Pod" && finalizer.is_none() {
        delete_pod(store, ns, name, None)
    } else {
        store.delete_with_finalizer(res, ns, name, Some(uid_of(obj)), finalizer)
    };
    ignore_gone(r)
}

/// Removes `finalizer` from an object (which may then go).
fn remove_finalizer(
    store: &Store,
    res: &'static super::resources::ResourceDef,
    obj: &Value,
    finalizer: &str,
) -> Result<(), ApiError> {
    let rv = obj.pointer("/metadata/resourceVersion").cloned();
    ignore_gone(store.update(res, namespace_of(obj), name_of(obj), |o| {
        if let Some(rv) = rv {
            o["metadata"]["resourceVersion"] = rv;
        }
        if let Some(list) = o["metadata"]["finalizers"].as_array_mut() {
            list.retain(|f| f != finalizer);
            if list.is_empty()
                && let Some(m) = o["metadata"].as_object_mut()
            {
                m.remove("finalizers");
            }
        }
        Ok(())
    }))
}

fn resolve_target_port(target: &Value, pods: &[&Value]) -> Option<i64> {
    if let Some(n) = target.as_i64() {
        return Some(n);
    }
    let name = target.as_str()?;
    if let Ok(n) = name.parse() {
        return Some(n);
    }
    pods.iter().find_map(|p| {
        p.pointer("/spec/containers")?
            .as_array()?
            .iter()
            .flat_map(|c| c.get("ports").and_then(Value::as_array).into_iter().flatten())
            .find(|port| port.get("name").and_then(Value::as_str) == Some(name))
            .and_then(|port| port.get("containerPort").and_then(Value::as_i64))
    })
}

fn endpoint_slices(store: &Store) -> Result<(), ApiError> {
    let svcres = by_kind("Service");
    let epsres = by_kind("EndpointSlice");
    let noderes = by_kind("Node");
    let services = store.snapshot(svcres, None);
    let pods = store.snapshot(by_kind("Pod"), None);
    let nodes = store.snapshot(noderes, None);
    let zone_of: BTreeMap<&str, &str> = nodes
        .iter()
        .filter_map(|n| {
            let zone = n
                .pointer("/metadata/labels/topology.kubernetes.io~1zone")?
                .as_str()?;
            Some((name_of(n), zone))
        })
        .collect();
    for svc in services.iter().filter(|s| !is_terminating(s)) {
        let Some(sel) = svc.pointer("/spec/selector").and_then(Value::as_object) else {
            continue;
        };
        if sel.is_empty() {
            continue;
        }
        let ns = namespace_of(svc);
        let selector = LabelSelector::from_object(&json!({"matchLabels": sel})).unwrap_or_default();
        let members: Vec<&Value> = pods
            .iter()
            .map(|v| &**v)
            .filter(|p| namespace_of(p) == ns && selector.matches(&labels_of(p)))
            .filter(|p| {
                p.pointer("/status/podIP")
                    .and_then(Value::as_str)
                    .is_some_and(|ip| !ip.is_empty())
            })
            .collect();
        let endpoints: Vec<Value> = members
            .iter()
            .map(|p| {
                let terminating = is_terminating(p);
                let ready = pod_ready(p) && !terminating;
                let node = p.pointer("/spec/nodeName").and_then(Value::as_str).unwrap_or("");
                let mut ep = json!({
                    "addresses": [p["status"]["podIP"]],
                    "conditions": {"ready": ready, "serving": pod_ready(p), "terminating": terminating},
                    "nodeName": node,
                    "targetRef": {"kind": "Pod", "name": name_of(p), "namespace": ns, "uid": uid_of(p)},
                });
                if let Some(zone) = zone_of.get(node) {
                    ep["zone"] = json!(zone);
                }
                ep
            })
            .collect();
        let ports: Vec<Value> = svc
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        let target = p.get("targetPort").unwrap_or(&p["port"]);
                        json!({
                            "name": p.get("name").cloned().unwrap_or(json!("")),
                            "port": resolve_target_port(target, &members),
                            "protocol": p.get("protocol").cloned().unwrap_or(json!("TCP")),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        let name = format!("{}-sim", name_of(svc));
        match store.get_shared(epsres, ns, &name) {
            None => {
                let eps = json!({
                    "metadata": {
                        "name": name,
                        "labels": {"kubernetes.io/service-name": name_of(svc),
                                   "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
                        "ownerReferences": [owner_ref(svc)],
                    },
                    "addressType": "IPv4",
                    "endpoints": endpoints,
                    "ports": ports,
                });
                match store.create(epsres, ns, eps) {
                    Ok(_) | Err(ApiError::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Some(cur)
                if cur.get("endpoints") != Some(&json!(endpoints))
                    || cur.get("ports") != Some(&json!(ports)) =>
            {
                ignore_not_found(store.update(epsres, ns, &name, |o| {
                    o["endpoints"] = json!(endpoints);
                    o["ports"] = json!(ports);
                    Ok(())
                }))?;
            }
            Some(_) => {}
        }
    }
    Ok(())
}
