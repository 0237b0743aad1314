//! The ReplicaSet controller's decisions, as kube-controller-manager makes
//! them (`pkg/controller/replicaset`): which pods go first when there are
//! too many, when a pod counts as available, and the status.
//!
//! Pure functions of the pods and the time; the control loop acts on them.

use std::cmp::Reverse;
use std::collections::HashMap;

use jiff::Timestamp;
use serde_json::{Map, Value, json};

use super::selector::{LabelSelector, labels_of};

/// Annotation that makes a pod cheaper (lower) or dearer to delete.
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// How many pods one pass creates or deletes at most (`--burst-replicas` of the real controller).
pub const BURST_REPLICAS: usize = 500;

fn phase(pod: &Value) -> &str {
    pod.pointer("/status/phase").and_then(Value::as_str).unwrap_or("")
}

fn node(pod: &Value) -> &str {
    pod.pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn uid(pod: &Value) -> &str {
    pod.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("")
}

fn ready_condition(pod: &Value) -> Option<&Value> {
    pod.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
}

/// Whether a pod is Ready (`IsPodReady`).
#[must_use]
pub fn is_ready(pod: &Value) -> bool {
    ready_condition(pod).is_some_and(|c| c["status"] == "True")
}

fn ready_since(pod: &Value) -> Option<Timestamp> {
    ready_condition(pod)
        .filter(|c| c["status"] == "True")?
        .get("lastTransitionTime")?
        .as_str()?
        .parse()
        .ok()
}

/// Whether a pod is neither finished nor being deleted (`IsPodActive`).
#[must_use]
pub fn is_active(pod: &Value) -> bool {
    !matches!(phase(pod), "Succeeded" | "Failed")
        && pod
            .pointer("/metadata/deletionTimestamp")
            .is_none_or(Value::is_null)
}

/// Whether a pod is being deleted and not finished (`IsPodTerminating`).
#[must_use]
pub fn is_terminating(pod: &Value) -> bool {
    !matches!(phase(pod), "Succeeded" | "Failed")
        && pod
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null())
}

/// Whether a pod has been Ready for longer than `min_ready_seconds` (`IsPodAvailable`).
#[must_use]
pub fn is_available(pod: &Value, min_ready_seconds: i64, now: Timestamp) -> bool {
    if !is_ready(pod) {
        return false;
    }
    if min_ready_seconds <= 0 {
        return true;
    }
    ready_since(pod)
        .and_then(|t| {
            t.checked_add(jiff::SignedDuration::from_secs(min_ready_seconds))
                .ok()
        })
        .is_some_and(|t| t < now)
}

/// When the next of `pods` turns available (for a timely resync), if any is still waiting.
#[must_use]
pub fn next_availability(pods: &[&Value], min_ready_seconds: i64, now: Timestamp) -> Option<Timestamp> {
    if min_ready_seconds <= 0 {
        return None;
    }
    pods.iter()
        .filter(|p| is_ready(p) && !is_available(p, min_ready_seconds, now))
        .filter_map(|p| {
            ready_since(p)?
                .checked_add(jiff::SignedDuration::from_secs(min_ready_seconds))
                .ok()
        })
        .min()
}

/// `floor(log2(now - t))` in nanoseconds, `-1` for times not in the past:
/// times are compared on a logarithmic scale.
fn log_age(t: Timestamp, now: Timestamp) -> i64 {
    let d = now.as_nanosecond() - t.as_nanosecond();
    if d <= 0 {
        return -1;
    }
    i64::from(127 - d.leading_zeros())
}

fn restarts(pod: &Value, statuses: &str) -> i64 {
    pod.pointer(&format!("/status/{statuses}"))
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

fn sidecar_restarts(pod: &Value) -> i64 {
    let sidecars: Vec<&str> = pod
        .pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter(|c| c["restartPolicy"] == "Always")
                .filter_map(|c| c["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    pod.pointer("/status/initContainerStatuses")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter(|c| c["name"].as_str().is_some_and(|n| sidecars.contains(&n)))
                .filter_map(|c| c.get("restartCount").and_then(Value::as_i64))
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// The order in which surplus pods are deleted (`ActivePodsWithRanks`),
/// as indices into `pods`, first to go first: unassigned before assigned,
/// Pending before Unknown before Running, unready before ready, lower
/// deletion cost first, pods doubled up on a node (counting `related`, the
/// pods of every ReplicaSet of the same owner) first, the most recently
/// Ready first, more container restarts first, the newest first; times on a
/// logarithmic scale, then the uid.
#[must_use]
pub fn deletion_order(pods: &[&Value], related: &[&Value], now: Timestamp) -> Vec<usize> {
    let mut on_node: HashMap<&str, i64> = HashMap::new();
    for p in related.iter().filter(|p| is_active(p)) {
        *on_node.entry(node(p)).or_default() += 1;
    }
    let key = |p: &Value| {
        let phase_rank = match phase(p) {
            "Unknown" => 1,
            "Running" => 2,
            _ => 0,
        };
        let cost = p
            .pointer(&format!(
                "/metadata/annotations/{}",
                DELETION_COST.replace('/', "~1")
            ))
            .and_then(Value::as_str)
            .and_then(|c| c.parse::<i32>().ok())
            .unwrap_or(0);
        let ready = is_ready(p);
        // Only compared between two Ready pods (both have a key here).
        let ready_age = if ready {
            ready_since(p).map_or(-2, |t| log_age(t, now))
        } else {
            0
        };
        let created = p
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str)
            .and_then(|t| t.parse::<Timestamp>().ok())
            .map_or(-2, |t| log_age(t, now));
        (
            !node(p).is_empty(),
            phase_rank,
            ready,
            cost,
            Reverse(on_node.get(node(p)).copied().unwrap_or(0)),
            ready_age,
            Reverse(restarts(p, "containerStatuses")),
            Reverse(sidecar_restarts(p)),
            created,
            uid(p).to_owned(),
        )
    };
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by_cached_key(|&i| key(pods[i]));
    order
}

/// A ReplicaSet's status (`calculateStatus`): `active` are the pods it
/// controls that are neither finished nor being deleted, `terminating` how
/// many it controls that are being deleted; `failure` is the message of a
/// failed create or delete.
#[must_use]
pub fn status(
    rs: &Value,
    active: &[&Value],
    terminating: usize,
    failure: Option<(&str, String)>,
    now: Timestamp,
) -> Value {
    let min_ready = rs
        .pointer("/spec/minReadySeconds")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let template_labels = LabelSelector(
        labels_of(
            &json!({"metadata": rs.pointer("/spec/template/metadata").cloned().unwrap_or(Value::Null)}),
        )
        .into_iter()
        .map(|(k, v)| super::selector::Requirement::Eq(k, v))
        .collect(),
    );
    let count =
        |f: &dyn Fn(&Value) -> bool| i64::try_from(active.iter().filter(|p| f(p)).count()).unwrap_or(0);
    let fully_labeled = count(&|p| template_labels.matches(&labels_of(p)));
    let ready = count(&is_ready);
    let available = count(&|p| is_available(p, min_ready, now));
    let mut m = Map::new();
    m.insert("replicas".into(), json!(active.len()));
    for (k, v) in [
        ("fullyLabeledReplicas", fully_labeled),
        ("readyReplicas", ready),
        ("availableReplicas", available),
    ] {
        if v != 0 {
            m.insert(k.into(), json!(v));
        }
    }
    m.insert("terminatingReplicas".into(), json!(terminating));
    // The generation this status describes.
    if let Some(g) = rs.pointer("/metadata/generation").and_then(Value::as_i64)
        && g != 0
    {
        m.insert("observedGeneration".into(), json!(g));
    }
    // The ReplicaFailure condition stays while writes fail and goes once they succeed.
    let existing = rs
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["type"] == "ReplicaFailure"))
        .cloned();
    let failure_condition = match (failure, existing) {
        (Some(_), Some(cur)) => Some(cur),
        (Some((reason, message)), None) => Some(json!({
            "type": "ReplicaFailure",
            "status": "True",
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            "reason": reason,
            "message": message,
        })),
        (None, _) => None,
    };
    if let Some(c) = failure_condition {
        m.insert("conditions".into(), json!([c]));
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Timestamp {
        "2026-01-01T12:00:00Z".parse().unwrap()
    }

    fn ago(secs: i64) -> String {
        (now() - jiff::SignedDuration::from_secs(secs))
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    }

    /// A pod: `node` ("" unassigned), `phase`, Ready since `ready` seconds
    /// ago (None: not ready), created `created` seconds ago.
    fn pod(name: &str, node: &str, phase: &str, ready: Option<i64>, created: i64) -> Value {
        let mut p = json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"), "creationTimestamp": ago(created)},
            "spec": {"nodeName": node},
            "status": {"phase": phase, "conditions": [
                {"type": "Ready", "status": if ready.is_some() { "True" } else { "False" },
                 "lastTransitionTime": ago(ready.unwrap_or(created))}]},
        });
        if node.is_empty() {
            p["spec"].as_object_mut().unwrap().remove("nodeName");
        }
        p
    }

    fn order(pods: &[Value]) -> Vec<String> {
        let refs: Vec<&Value> = pods.iter().collect();
        deletion_order(&refs, &refs, now())
            .into_iter()
            .map(|i| pods[i]["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn surplus_pods_go_in_the_real_controllers_order() {
        let cases: Vec<(&str, Vec<Value>, Vec<&str>)> = vec![
            (
                "unassigned before assigned",
                vec![
                    pod("assigned", "n1", "Pending", None, 10),
                    pod("unassigned", "", "Pending", None, 100),
                ],
                vec!["unassigned", "assigned"],
            ),
            (
                "pending before unknown before running",
                vec![
                    pod("running", "n1", "Running", None, 10),
                    pod("unknown", "n2", "Unknown", None, 10),
                    pod("pending", "n3", "Pending", None, 10),
                ],
                vec!["pending", "unknown", "running"],
            ),
            (
                "unready before ready",
                vec![
                    pod("ready", "n1", "Running", Some(5), 10),
                    pod("unready", "n2", "Running", None, 1000),
                ],
                vec!["unready", "ready"],
            ),
            (
                "doubled up on a node first",
                vec![
                    pod("alone", "n1", "Running", Some(50), 100),
                    pod("pair-a", "n2", "Running", Some(50), 100),
                    pod("pair-b", "n2", "Running", Some(50), 100),
                ],
                vec!["pair-a", "pair-b", "alone"],
            ),
            (
                "ready for a shorter time first",
                vec![
                    pod("long", "n1", "Running", Some(3600), 7200),
                    pod("short", "n2", "Running", Some(2), 7200),
                ],
                vec!["short", "long"],
            ),
            (
                "newer first",
                vec![
                    pod("old", "n1", "Pending", None, 7200),
                    pod("new", "n2", "Pending", None, 3),
                ],
                vec!["new", "old"],
            ),
        ];
        for (what, pods, want) in cases {
            assert_eq!(order(&pods), want, "{what}");
        }
    }

    #[test]
    fn deletion_cost_and_restarts_break_ties() {
        let mut cheap = pod("cheap", "n1", "Running", Some(60), 100);
        cheap["metadata"]["annotations"] = json!({DELETION_COST: "-5"});
        let dear = pod("dear", "n2", "Running", Some(60), 100);
        assert_eq!(order(&[dear.clone(), cheap]), ["cheap", "dear"]);
        let mut crashy = pod("crashy", "n3", "Running", Some(60), 100);
        crashy["status"]["containerStatuses"] = json!([{"name": "c", "restartCount": 4}]);
        assert_eq!(order(&[dear, crashy]), ["crashy", "dear"]);
    }

    #[test]
    fn availability_waits_for_min_ready_seconds() {
        let p = pod("p", "n1", "Running", Some(5), 100);
        assert!(is_available(&p, 0, now()));
        assert!(is_available(&p, 4, now()));
        assert!(
            !is_available(&p, 5, now()),
            "ready exactly minReadySeconds ago is not yet available"
        );
        assert!(!is_available(&p, 10, now()));
        assert_eq!(
            next_availability(&[&p], 10, now()),
            Some(now() + jiff::SignedDuration::from_secs(5))
        );
        assert!(!is_available(&pod("u", "n1", "Running", None, 100), 0, now()));
    }

    #[test]
    fn status_counts_ready_available_and_terminating_pods() {
        let rs = json!({"metadata": {"generation": 3},
                        "spec": {"minReadySeconds": 10, "template": {"metadata": {"labels": {"app": "a"}}}},
                        "status": {"observedGeneration": 2}});
        let mut a = pod("a", "n1", "Running", Some(60), 100);
        a["metadata"]["labels"] = json!({"app": "a"});
        let b = pod("b", "n1", "Running", Some(2), 100);
        let c = pod("c", "n1", "Pending", None, 100);
        let s = status(&rs, &[&a, &b, &c], 2, None, now());
        assert_eq!(
            s,
            json!({"replicas": 3, "fullyLabeledReplicas": 1, "readyReplicas": 2, "availableReplicas": 1,
                   "terminatingReplicas": 2, "observedGeneration": 3})
        );
        let failed = status(&rs, &[], 0, Some(("FailedCreate", "quota".into())), now());
        assert_eq!(failed["conditions"][0]["reason"], "FailedCreate");
        assert_eq!(failed["replicas"], 0);
    }
}
