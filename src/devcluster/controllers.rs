//! The control loops: Deployment → ReplicaSet → Pods, garbage collection of
//! dependents, and EndpointSlices for Services. One pass reconciles every
//! object; the cluster runs a pass after each store change.

use std::collections::{BTreeMap, HashSet};

use serde_json::{Value, json};

use super::error::ApiError;
use super::resources::by_kind;
use super::selector::{LabelSelector, labels_of};
use super::store::{Store, is_terminating, name_of, namespace_of, uid_of};

/// Label carrying the template hash on ReplicaSets and their pods.
pub const POD_TEMPLATE_HASH: &str = "pod-template-hash";

/// What the control loops need besides the store.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The cluster CA (PEM), published in every namespace as `kube-root-ca.crt`.
    pub ca_pem: String,
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
    expire_events(store);
    note(deployments(store));
    note(replicasets(store));
    note(garbage_collect(store));
    note(endpoint_slices(store));
    first_err.map_or(Ok(()), Err)
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

fn template_hash(template: &Value) -> String {
    let h = xxhash_rust::xxh64::xxh64(template.to_string().as_bytes(), 0);
    let s = format!("{h:016x}");
    s[..10].to_owned()
}

fn replicas_of(obj: &Value) -> i64 {
    obj.pointer("/spec/replicas").and_then(Value::as_i64).unwrap_or(1)
}

fn status_i64(obj: &Value, field: &str) -> i64 {
    obj.pointer(&format!("/status/{field}"))
        .and_then(Value::as_i64)
        .unwrap_or(0)
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
    let (namespaces, _) = store.list(by_kind("Namespace"), None);
    let sares = by_kind("ServiceAccount");
    let cmres = by_kind("ConfigMap");
    for ns in namespaces.iter().filter(|n| !is_terminating(n)) {
        let ns = name_of(ns);
        if store.get(sares, ns, "default").is_none() {
            match store.create(sares, ns, json!({"metadata": {"name": "default"}})) {
                Ok(_) | Err(ApiError::AlreadyExists { .. } | ApiError::Terminating(_)) => {}
                Err(e) => return Err(e),
            }
        }
        if ctx.ca_pem.is_empty() {
            continue;
        }
        let data = json!({"ca.crt": ctx.ca_pem});
        match store.get(cmres, ns, ROOT_CA_CONFIG_MAP) {
            None => {
                let cm = json!({
                    "metadata": {"name": ROOT_CA_CONFIG_MAP,
                                 "annotations": {"kubernetes.io/description": ROOT_CA_DESCRIPTION}},
                    "data": data,
                });
                match store.create(cmres, ns, cm) {
                    Ok(_) | Err(ApiError::AlreadyExists { .. } | ApiError::Terminating(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            Some(cm) if cm.get("data") != Some(&data) || cm.get("binaryData").is_some() => {
                ignore_not_found(store.update(cmres, ns, ROOT_CA_CONFIG_MAP, |o| {
                    o["data"] = data;
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
    let (existing, _) = store.list(evres, Some(ns));
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

/// Removes Events not seen for [`EVENT_TTL_SECONDS`], as etcd's lease on them does.
fn expire_events(store: &Store) {
    let evres = by_kind("Event");
    let cutoff = jiff::Timestamp::now().as_second() - EVENT_TTL_SECONDS;
    let (events, _) = store.list(evres, None);
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

/// `ScalingReplicaSet` on the Deployment, as the deployment controller words it.
fn record_scaling(store: &Store, deployment: &Value, rs: &Value, from: i64, to: i64) {
    let direction = if to > from { "up" } else { "down" };
    record_event(
        store,
        deployment,
        "Normal",
        "ScalingReplicaSet",
        &format!(
            "Scaled {direction} replica set {} from {from} to {to}",
            name_of(rs)
        ),
        DEPLOYMENT_CONTROLLER,
    );
}

fn deployments(store: &Store) -> Result<(), ApiError> {
    let dres = by_kind("Deployment");
    let rsres = by_kind("ReplicaSet");
    let (deploys, _) = store.list(dres, None);
    let (all_rs, _) = store.list(rsres, None);
    for d in deploys.iter().filter(|d| !is_terminating(d)) {
        let ns = namespace_of(d);
        let uid = uid_of(d);
        let Some(template) = d.pointer("/spec/template") else {
            continue;
        };
        let hash = template_hash(template);
        let replicas = replicas_of(d);
        let owned: Vec<&Value> = all_rs
            .iter()
            .filter(|rs| namespace_of(rs) == ns && controlled_by(rs, uid))
            .collect();
        let current = owned.iter().find(|rs| {
            rs.pointer(&format!("/metadata/labels/{POD_TEMPLATE_HASH}"))
                .and_then(Value::as_str)
                == Some(&hash)
        });
        let revision = owned.len() + usize::from(current.is_none());
        match current {
            None => {
                let mut template = template.clone();
                template["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(hash);
                let mut selector = d.pointer("/spec/selector").cloned().unwrap_or_else(|| json!({}));
                selector["matchLabels"][POD_TEMPLATE_HASH] = json!(hash);
                let mut labels = template["metadata"]["labels"].clone();
                labels[POD_TEMPLATE_HASH] = json!(hash);
                let rs = json!({
                    "metadata": {
                        "name": format!("{}-{hash}", name_of(d)),
                        "labels": labels,
                        "annotations": {"deployment.kubernetes.io/revision": revision.to_string(),
                                        "deployment.kubernetes.io/desired-replicas": replicas.to_string()},
                        "ownerReferences": [owner_ref(d)],
                    },
                    "spec": {"replicas": replicas, "selector": selector, "template": template},
                });
                match store.create(rsres, ns, rs) {
                    Ok(created) if replicas > 0 => record_scaling(store, d, &created, 0, replicas),
                    Ok(_) | Err(ApiError::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Some(rs) if replicas_of(rs) != replicas => {
                let from = replicas_of(rs);
                ignore_not_found(store.update(rsres, ns, name_of(rs), |o| {
                    o["spec"]["replicas"] = json!(replicas);
                    Ok(())
                }))?;
                record_scaling(store, d, rs, from, replicas);
            }
            Some(_) => {}
        }
        for old in owned.iter().filter(|rs| {
            rs.pointer(&format!("/metadata/labels/{POD_TEMPLATE_HASH}"))
                .and_then(Value::as_str)
                != Some(&hash)
                && replicas_of(rs) != 0
        }) {
            let from = replicas_of(old);
            ignore_not_found(store.update(rsres, ns, name_of(old), |o| {
                o["spec"]["replicas"] = json!(0);
                Ok(())
            }))?;
            record_scaling(store, d, old, from, 0);
        }
        let sum = |f: &str| owned.iter().map(|rs| status_i64(rs, f)).sum::<i64>();
        let updated = current.map_or(0, |rs| status_i64(rs, "replicas"));
        let ready = sum("readyReplicas");
        let total = sum("replicas");
        let available = if ready >= replicas { "True" } else { "False" };
        let status = json!({
            "observedGeneration": d.pointer("/metadata/generation").cloned().unwrap_or(json!(1)),
            "replicas": total,
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": (replicas - ready).max(0),
            "conditions": [
                {"type": "Available", "status": available, "reason": if available == "True" { "MinimumReplicasAvailable" } else { "MinimumReplicasUnavailable" }},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ],
        });
        if d.get("status") != Some(&status) {
            ignore_not_found(store.update(dres, ns, name_of(d), |o| {
                o["status"] = status;
                Ok(())
            }))?;
        }
    }
    Ok(())
}

fn replicasets(store: &Store) -> Result<(), ApiError> {
    let rsres = by_kind("ReplicaSet");
    let podres = by_kind("Pod");
    let (all_rs, _) = store.list(rsres, None);
    let (pods, _) = store.list(podres, None);
    for rs in all_rs.iter().filter(|rs| !is_terminating(rs)) {
        let ns = namespace_of(rs);
        let uid = uid_of(rs);
        let Ok(selector) = LabelSelector::from_object(rs.pointer("/spec/selector").unwrap_or(&Value::Null))
        else {
            continue;
        };
        if selector.0.is_empty() {
            continue;
        }
        let mut active: Vec<&Value> = Vec::new();
        for pod in pods.iter().filter(|p| namespace_of(p) == ns) {
            let matches = selector.matches(&labels_of(pod));
            if controlled_by(pod, uid) {
                if !matches {
                    // Release: the pod's labels no longer match.
                    ignore_not_found(store.update(podres, ns, name_of(pod), |o| {
                        if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                            refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(uid));
                            if refs.is_empty()
                                && let Some(m) = o["metadata"].as_object_mut()
                            {
                                m.remove("ownerReferences");
                            }
                        }
                        Ok(())
                    }))?;
                    continue;
                }
            } else if controller_ref(pod).is_none() && matches && !is_terminating(pod) && !pod_finished(pod) {
                // Adopt an orphan that matches.
                let rref = owner_ref(rs);
                ignore_not_found(store.update(podres, ns, name_of(pod), |o| {
                    match o["metadata"]["ownerReferences"].as_array_mut() {
                        Some(refs) => refs.push(rref),
                        None => o["metadata"]["ownerReferences"] = json!([rref]),
                    }
                    Ok(())
                }))?;
            } else {
                continue;
            }
            if !is_terminating(pod) && !pod_finished(pod) {
                active.push(pod);
            }
        }
        let want = replicas_of(rs);
        let have = i64::try_from(active.len()).unwrap_or(i64::MAX);
        if have < want {
            for _ in have..want {
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
                let created = store.create(podres, ns, pod)?;
                record_event(
                    store,
                    rs,
                    "Normal",
                    "SuccessfulCreate",
                    &format!("Created pod: {}", name_of(&created)),
                    REPLICASET_CONTROLLER,
                );
            }
        } else if have > want {
            let mut victims = active.clone();
            victims.sort_by_key(|p| {
                let scheduled = p.pointer("/spec/nodeName").is_some();
                let created = p
                    .pointer("/metadata/creationTimestamp")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                (scheduled, pod_ready(p), std::cmp::Reverse(created))
            });
            let excess = usize::try_from(have - want).unwrap_or(0);
            for p in victims.into_iter().take(excess) {
                ignore_not_found(delete_pod(store, ns, name_of(p), None))?;
                record_event(
                    store,
                    rs,
                    "Normal",
                    "SuccessfulDelete",
                    &format!("Deleted pod: {}", name_of(p)),
                    REPLICASET_CONTROLLER,
                );
            }
        }
        let ready = i64::try_from(active.iter().filter(|p| pod_ready(p)).count()).unwrap_or(0);
        let replicas = have;
        let status = json!({
            "replicas": replicas,
            "fullyLabeledReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": rs.pointer("/metadata/generation").cloned().unwrap_or(json!(1)),
        });
        if rs.get("status") != Some(&status) {
            ignore_not_found(store.update(rsres, ns, name_of(rs), |o| {
                o["status"] = status;
                Ok(())
            }))?;
        }
    }
    Ok(())
}

fn garbage_collect(store: &Store) -> Result<(), ApiError> {
    let owner_kinds = ["Deployment", "ReplicaSet", "Service"];
    let mut uids: HashSet<String> = HashSet::new();
    for kind in owner_kinds {
        let (objs, _) = store.list(by_kind(kind), None);
        uids.extend(objs.iter().map(|o| uid_of(o).to_owned()));
    }
    for kind in ["ReplicaSet", "Pod", "EndpointSlice"] {
        let res = by_kind(kind);
        let (objs, _) = store.list(res, None);
        for obj in objs.iter().filter(|o| !is_terminating(o)) {
            let Some(refs) = obj.pointer("/metadata/ownerReferences").and_then(Value::as_array) else {
                continue;
            };
            let tracked: Vec<&Value> = refs
                .iter()
                .filter(|r| {
                    r.get("kind")
                        .and_then(Value::as_str)
                        .is_some_and(|k| owner_kinds.contains(&k))
                })
                .collect();
            if tracked.is_empty() || tracked.len() != refs.len() {
                continue;
            }
            let orphaned = tracked
                .iter()
                .all(|r| !uids.contains(r.get("uid").and_then(Value::as_str).unwrap_or("")));
            if orphaned {
                let ns = namespace_of(obj);
                if kind == "Pod" {
                    ignore_not_found(delete_pod(store, ns, name_of(obj), None))?;
                } else {
                    ignore_not_found(store.remove(res, ns, name_of(obj), None))?;
                }
            }
        }
    }
    Ok(())
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
    let (services, _) = store.list(svcres, None);
    let (pods, _) = store.list(by_kind("Pod"), None);
    let (nodes, _) = store.list(noderes, None);
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
        match store.get(epsres, ns, &name) {
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
