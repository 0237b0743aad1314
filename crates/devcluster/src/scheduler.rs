//! The scheduler: binds each pending pod to a node, as kube-scheduler's
//! default profile does for the filters that matter here, and explains a
//! pod it cannot place the way kube-scheduler words it.
//!
//! Filters, in kube-scheduler's plugin order (a node is rejected by the
//! first that fails): `NodeUnschedulable` (cordoned nodes), `TaintToleration`
//! (`NoSchedule`/`NoExecute` taints), `NodeAffinity` (`nodeSelector` and
//! required node affinity), `NodeResourcesFit` (pod count, CPU and memory
//! requests against allocatable minus what is bound). Among the nodes that
//! fit, pods of one owner spread over nodes, then the least allocated node
//! wins. A pod that fits nowhere stays `Pending` with `PodScheduled=False`,
//! reason `Unschedulable` and a message such as
//! `0/3 nodes are available: 1 node(s) were unschedulable, 2 Insufficient cpu.
//! preemption: 0/3 nodes are available: 1 Preemption is not helpful for
//! scheduling, 2 No preemption victims found for incoming pod.` (there are
//! no priorities here, so preemption never finds a victim).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value, json};

use super::error::ApiError;
use super::quantity::{parse_milli, parse_units};
use super::resources::by_kind;
use super::store::{Store, is_terminating, name_of, namespace_of, now_rfc3339, uid_of};

/// The scheduler name pods get by default.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// Why a node was filtered out (kube-scheduler's reason strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    Unschedulable,
    UntoleratedTaint,
    NodeAffinity,
    TooManyPods,
    InsufficientCpu,
    InsufficientMemory,
}

impl Reason {
    /// The text kube-scheduler reports.
    #[must_use]
    pub fn text(self) -> &'static str {
        match self {
            Self::Unschedulable => "node(s) were unschedulable",
            Self::UntoleratedTaint => "node(s) had untolerated taint(s)",
            Self::NodeAffinity => "node(s) didn't match Pod's node affinity/selector",
            Self::TooManyPods => "Too many pods",
            Self::InsufficientCpu => "Insufficient cpu",
            Self::InsufficientMemory => "Insufficient memory",
        }
    }

    /// Whether evicting lower-priority pods could help (resource shortages only).
    fn preemption_may_help(self) -> bool {
        matches!(
            self,
            Self::TooManyPods | Self::InsufficientCpu | Self::InsufficientMemory
        )
    }
}

/// What a pod asks of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// Millicores.
    pub cpu_milli: i128,
    /// Bytes.
    pub memory: i128,
}

/// A node as the filters see it.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub unschedulable: bool,
    /// `(key, value, effect)`.
    pub taints: Vec<(String, String, String)>,
    pub allocatable: Request,
    pub allocatable_pods: i128,
    pub requested: Request,
    pub pods: i128,
    /// Bound pods per controller owner uid (for spreading).
    pub owners: BTreeMap<String, usize>,
}

fn str_map(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

fn quantity(list: Option<&Value>, key: &str, milli: bool) -> Option<i128> {
    let q = list?.get(key)?;
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    if milli {
        parse_milli(&text)
    } else {
        parse_units(&text)
    }
}

fn container_request(c: &Value) -> Request {
    // The API server defaults a missing request to the limit.
    let get = |key: &str, milli: bool| {
        quantity(c.pointer("/resources/requests"), key, milli)
            .or_else(|| quantity(c.pointer("/resources/limits"), key, milli))
            .unwrap_or(0)
    };
    Request {
        cpu_milli: get("cpu", true),
        memory: get("memory", false),
    }
}

/// The effective request of a pod: its containers and restartable (sidecar)
/// init containers together, or the largest init container if that is more.
#[must_use]
pub fn pod_request(pod: &Value) -> Request {
    let mut sum = Request::default();
    let add = |sum: &mut Request, r: &Request| {
        sum.cpu_milli += r.cpu_milli;
        sum.memory += r.memory;
    };
    for c in pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        add(&mut sum, &container_request(c));
    }
    let mut init_max = Request::default();
    let mut sidecars = Request::default();
    for c in pod
        .pointer("/spec/initContainers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let r = container_request(c);
        if c.get("restartPolicy").and_then(Value::as_str) == Some("Always") {
            add(&mut sidecars, &r);
            add(&mut sum, &r);
        } else {
            init_max.cpu_milli = init_max.cpu_milli.max(r.cpu_milli + sidecars.cpu_milli);
            init_max.memory = init_max.memory.max(r.memory + sidecars.memory);
        }
    }
    if let Some(overhead) = pod.pointer("/spec/overhead") {
        sum.cpu_milli += quantity(Some(overhead), "cpu", true).unwrap_or(0);
        sum.memory += quantity(Some(overhead), "memory", false).unwrap_or(0);
    }
    Request {
        cpu_milli: sum.cpu_milli.max(init_max.cpu_milli),
        memory: sum.memory.max(init_max.memory),
    }
}

fn tolerates(pod: &Value, key: &str, value: &str, effect: &str) -> bool {
    pod.pointer("/spec/tolerations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|t| {
            let t_effect = t.get("effect").and_then(Value::as_str).unwrap_or("");
            let t_key = t.get("key").and_then(Value::as_str).unwrap_or("");
            let op = t.get("operator").and_then(Value::as_str).unwrap_or("Equal");
            let effect_ok = t_effect.is_empty() || t_effect == effect;
            let key_ok = t_key.is_empty() && op == "Exists" || t_key == key;
            let value_ok = op == "Exists" || t.get("value").and_then(Value::as_str).unwrap_or("") == value;
            effect_ok && key_ok && value_ok
        })
}

fn expression_matches(expr: &Value, value: Option<&str>) -> bool {
    let values: Vec<&str> = expr
        .get("values")
        .and_then(Value::as_array)
        .map(|v| v.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match expr.get("operator").and_then(Value::as_str).unwrap_or("") {
        "In" => value.is_some_and(|v| values.contains(&v)),
        "NotIn" => value.is_none_or(|v| !values.contains(&v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => value
            .and_then(number)
            .zip(values.first().copied().and_then(number))
            .is_some_and(|(v, bound)| v > bound),
        "Lt" => value
            .and_then(number)
            .zip(values.first().copied().and_then(number))
            .is_some_and(|(v, bound)| v < bound),
        _ => false,
    }
}

/// `nodeSelector` and `requiredDuringSchedulingIgnoredDuringExecution` node affinity.
fn affinity_matches(pod: &Value, node: &NodeView) -> bool {
    let selector = str_map(pod.pointer("/spec/nodeSelector"));
    if selector.iter().any(|(k, v)| node.labels.get(k) != Some(v)) {
        return false;
    }
    let Some(terms) = pod
        .pointer(
            "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms",
        )
        .and_then(Value::as_array)
    else {
        return true;
    };
    // Terms are ORed; the expressions of one term are ANDed.
    terms.iter().any(|term| {
        let labels_ok = term
            .get("matchExpressions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .all(|e| {
                let key = e.get("key").and_then(Value::as_str).unwrap_or("");
                expression_matches(e, node.labels.get(key).map(String::as_str))
            });
        let fields_ok = term
            .get("matchFields")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .all(|e| {
                let field = e.get("key").and_then(Value::as_str).unwrap_or("");
                let value = (field == "metadata.name").then_some(node.name.as_str());
                expression_matches(e, value)
            });
        labels_ok && fields_ok
    })
}

/// Why `node` cannot take `pod` (empty when it can).
#[must_use]
pub fn filter(pod: &Value, request: &Request, node: &NodeView) -> Vec<Reason> {
    if node.unschedulable && !tolerates(pod, "node.kubernetes.io/unschedulable", "", "NoSchedule") {
        return vec![Reason::Unschedulable];
    }
    let untolerated = node.taints.iter().any(|(key, value, effect)| {
        (effect == "NoSchedule" || effect == "NoExecute") && !tolerates(pod, key, value, effect)
    });
    if untolerated {
        return vec![Reason::UntoleratedTaint];
    }
    if !affinity_matches(pod, node) {
        return vec![Reason::NodeAffinity];
    }
    let mut reasons = Vec::new();
    if node.pods + 1 > node.allocatable_pods {
        reasons.push(Reason::TooManyPods);
    }
    if request.cpu_milli > 0 && node.requested.cpu_milli + request.cpu_milli > node.allocatable.cpu_milli {
        reasons.push(Reason::InsufficientCpu);
    }
    if request.memory > 0 && node.requested.memory + request.memory > node.allocatable.memory {
        reasons.push(Reason::InsufficientMemory);
    }
    reasons
}

/// kube-scheduler's message for a pod no node can take.
#[must_use]
pub fn unschedulable_message(nodes: usize, rejections: &[Vec<Reason>]) -> String {
    if nodes == 0 {
        return "no nodes available to schedule pods".to_owned();
    }
    let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    let (mut not_helpful, mut no_victims) = (0, 0);
    for reasons in rejections {
        for r in reasons {
            *counts.entry(r.text()).or_default() += 1;
        }
        if reasons.iter().all(|r| r.preemption_may_help()) {
            no_victims += 1;
        } else {
            not_helpful += 1;
        }
    }
    let mut histogram: Vec<String> = counts.iter().map(|(text, n)| format!("{n} {text}")).collect();
    histogram.sort();
    let mut preemption = Vec::new();
    if no_victims > 0 {
        preemption.push(format!(
            "{no_victims} No preemption victims found for incoming pod"
        ));
    }
    if not_helpful > 0 {
        preemption.push(format!("{not_helpful} Preemption is not helpful for scheduling"));
    }
    preemption.sort();
    format!(
        "0/{nodes} nodes are available: {}. preemption: 0/{nodes} nodes are available: {}.",
        histogram.join(", "),
        preemption.join(", ")
    )
}

/// Picks the best of the nodes that fit: fewest pods of the same owner,
/// then the most free CPU and memory (as a share of allocatable), then name.
fn best<'a>(fits: &[&'a NodeView], owner: Option<&str>, request: &Request) -> Option<&'a NodeView> {
    let free_share = |n: &NodeView| -> i128 {
        let share = |alloc: i128, used: i128| {
            if alloc <= 0 {
                0
            } else {
                (alloc - used).max(0) * 1000 / alloc
            }
        };
        share(n.allocatable.cpu_milli, n.requested.cpu_milli + request.cpu_milli)
            + share(n.allocatable.memory, n.requested.memory + request.memory)
    };
    fits.iter().copied().min_by(|a, b| {
        let same = |n: &NodeView| owner.and_then(|o| n.owners.get(o)).copied().unwrap_or(0);
        same(a)
            .cmp(&same(b))
            .then_with(|| free_share(b).cmp(&free_share(a)))
            .then_with(|| a.pods.cmp(&b.pods))
            .then_with(|| a.name.cmp(&b.name))
    })
}

fn controller_uid(pod: &Value) -> Option<String> {
    pod.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)?
        .iter()
        .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
        .and_then(|r| r.get("uid").and_then(Value::as_str))
        .map(str::to_owned)
}

fn pod_finished(pod: &Value) -> bool {
    matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    )
}

fn node_views(nodes: &[Arc<Value>], pods: &[Arc<Value>]) -> Vec<NodeView> {
    let mut views: Vec<NodeView> = nodes
        .iter()
        .filter(|n| !is_terminating(n))
        .map(|n| {
            let alloc = n.pointer("/status/allocatable");
            NodeView {
                name: name_of(n).to_owned(),
                labels: str_map(n.pointer("/metadata/labels")),
                unschedulable: n.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true),
                taints: n
                    .pointer("/spec/taints")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        let s = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
                        (s("key"), s("value"), s("effect"))
                    })
                    .collect(),
                allocatable: Request {
                    cpu_milli: quantity(alloc, "cpu", true).unwrap_or(0),
                    memory: quantity(alloc, "memory", false).unwrap_or(0),
                },
                allocatable_pods: quantity(alloc, "pods", false).unwrap_or(0),
                requested: Request::default(),
                pods: 0,
                owners: BTreeMap::new(),
            }
        })
        .collect();
    for pod in pods.iter().filter(|p| !pod_finished(p)) {
        let Some(node) = pod.pointer("/spec/nodeName").and_then(Value::as_str) else {
            continue;
        };
        if let Some(view) = views.iter_mut().find(|v| v.name == node) {
            bind_into(view, pod, &pod_request(pod));
        }
    }
    views
}

fn bind_into(view: &mut NodeView, pod: &Value, request: &Request) {
    view.requested.cpu_milli += request.cpu_milli;
    view.requested.memory += request.memory;
    view.pods += 1;
    if let Some(owner) = controller_uid(pod) {
        *view.owners.entry(owner).or_default() += 1;
    }
}

fn scheduled_condition(status: &str, reason: Option<&str>, message: Option<&str>) -> Value {
    let mut c = json!({"type": "PodScheduled", "status": status, "lastProbeTime": null,
                       "lastTransitionTime": now_rfc3339()});
    if let Some(r) = reason {
        c["reason"] = json!(r);
    }
    if let Some(m) = message {
        c["message"] = json!(m);
    }
    c
}

fn set_scheduled_condition(pod: &mut Value, condition: Value) {
    if !pod.get("status").is_some_and(Value::is_object) {
        pod["status"] = json!({});
    }
    let conditions = &mut pod["status"]["conditions"];
    if !conditions.is_array() {
        *conditions = json!([]);
    }
    if let Some(list) = conditions.as_array_mut() {
        list.retain(|c| c["type"] != "PodScheduled");
        list.insert(0, condition);
    }
}

/// One scheduling pass over every pending pod (oldest first).
///
/// # Errors
/// The first store error met (the pass carries on past errors).
pub fn schedule(store: &Store) -> Result<(), ApiError> {
    let podres = by_kind("Pod");
    let pods = store.snapshot(podres, None);
    let mut pending: Vec<&Value> = pods
        .iter()
        .map(|v| &**v)
        .filter(|p| {
            p.pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
                && !is_terminating(p)
                && !pod_finished(p)
                && p.pointer("/spec/schedulerName")
                    .and_then(Value::as_str)
                    .is_none_or(|s| s == DEFAULT_SCHEDULER)
        })
        .collect();
    if pending.is_empty() {
        return Ok(());
    }
    pending.sort_by_key(|p| {
        (
            p.pointer("/metadata/creationTimestamp")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            name_of(p).to_owned(),
        )
    });
    let nodes = store.snapshot(by_kind("Node"), None);
    let mut views = node_views(&nodes, &pods);
    let mut first_err = None;
    for pod in pending {
        let request = pod_request(pod);
        let verdicts: Vec<Vec<Reason>> = views.iter().map(|n| filter(pod, &request, n)).collect();
        let fits: Vec<&NodeView> = views
            .iter()
            .zip(&verdicts)
            .filter(|(_, v)| v.is_empty())
            .map(|(n, _)| n)
            .collect();
        let owner = controller_uid(pod);
        let (ns, name, uid) = (namespace_of(pod), name_of(pod), uid_of(pod).to_owned());
        let result = match best(&fits, owner.as_deref(), &request).map(|n| n.name.clone()) {
            Some(node) => {
                let bound = store.update(podres, ns, name, |o| {
                    let unbound = o
                        .pointer("/spec/nodeName")
                        .and_then(Value::as_str)
                        .is_none_or(str::is_empty);
                    if uid_of(o) != uid || !unbound || is_terminating(o) {
                        return Err(ApiError::Conflict {
                            res: podres,
                            name: name.to_owned(),
                        });
                    }
                    o["spec"]["nodeName"] = json!(node);
                    set_scheduled_condition(o, scheduled_condition("True", None, None));
                    Ok(())
                });
                if bound.is_ok()
                    && let Some(view) = views.iter_mut().find(|v| v.name == node)
                {
                    bind_into(view, pod, &request);
                }
                bound.map(drop)
            }
            None => {
                let message = unschedulable_message(views.len(), &verdicts);
                let current = pod
                    .pointer("/status/conditions")
                    .and_then(Value::as_array)
                    .and_then(|cs| cs.iter().find(|c| c["type"] == "PodScheduled"));
                let unchanged = current.is_some_and(|c| {
                    c["status"] == "False"
                        && c["reason"] == "Unschedulable"
                        && c["message"] == message.as_str()
                });
                if unchanged {
                    Ok(())
                } else {
                    store
                        .update(podres, ns, name, |o| {
                            if uid_of(o) != uid {
                                return Err(ApiError::Conflict {
                                    res: podres,
                                    name: name.to_owned(),
                                });
                            }
                            set_scheduled_condition(
                                o,
                                scheduled_condition("False", Some("Unschedulable"), Some(&message)),
                            );
                            Ok(())
                        })
                        .map(drop)
                }
            }
        };
        if let Err(e) = result
            && !matches!(e, ApiError::NotFound { .. } | ApiError::Conflict { .. })
            && first_err.is_none()
        {
            first_err = Some(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cpu: &str) -> NodeView {
        NodeView {
            name: name.into(),
            labels: [("topology.kubernetes.io/zone".to_owned(), format!("zone-{name}"))].into(),
            unschedulable: false,
            taints: Vec::new(),
            allocatable: Request {
                cpu_milli: parse_milli(cpu).unwrap(),
                memory: parse_units("1Gi").unwrap(),
            },
            allocatable_pods: 110,
            requested: Request::default(),
            pods: 0,
            owners: BTreeMap::new(),
        }
    }

    fn pod(spec: Value) -> Value {
        json!({"metadata": {"name": "p"}, "spec": spec})
    }

    #[test]
    fn requests_sum_containers_and_take_the_largest_init_container() {
        let p = pod(json!({
            "containers": [
                {"name": "a", "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}}},
                {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "32Mi"}}},
            ],
            "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}],
        }));
        assert_eq!(
            pod_request(&p),
            Request {
                cpu_milli: 2000,
                memory: 96 * 1024 * 1024
            }
        );
    }

    #[test]
    fn each_filter_rejects_for_its_reason() {
        let request = |cpu: &str| Request {
            cpu_milli: parse_milli(cpu).unwrap(),
            memory: 0,
        };
        let plain = pod(json!({"containers": [{"name": "c"}]}));
        let mut cordoned = node("a", "1");
        cordoned.unschedulable = true;
        assert_eq!(filter(&plain, &request("0"), &cordoned), [Reason::Unschedulable]);
        let mut tainted = node("a", "1");
        tainted
            .taints
            .push(("dedicated".into(), "gpu".into(), "NoSchedule".into()));
        assert_eq!(
            filter(&plain, &request("0"), &tainted),
            [Reason::UntoleratedTaint]
        );
        let tolerant = pod(json!({"containers": [], "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]}));
        assert!(filter(&tolerant, &request("0"), &tainted).is_empty());
        let selective =
            pod(json!({"containers": [], "nodeSelector": {"topology.kubernetes.io/zone": "zone-b"}}));
        assert_eq!(
            filter(&selective, &request("0"), &node("a", "1")),
            [Reason::NodeAffinity]
        );
        assert!(filter(&selective, &request("0"), &node("b", "1")).is_empty());
        let affine = pod(json!({"containers": [], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-x"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]},
        ]}}}}));
        assert_eq!(
            filter(&affine, &request("0"), &node("a", "1")),
            [Reason::NodeAffinity]
        );
        assert!(filter(&affine, &request("0"), &node("b", "1")).is_empty());
        let mut busy = node("a", "1");
        busy.requested.cpu_milli = 900;
        assert_eq!(filter(&plain, &request("200m"), &busy), [Reason::InsufficientCpu]);
        assert!(filter(&plain, &request("100m"), &busy).is_empty());
        busy.allocatable_pods = 0;
        assert_eq!(
            filter(&plain, &request("200m"), &busy),
            [Reason::TooManyPods, Reason::InsufficientCpu]
        );
    }

    #[test]
    fn the_message_counts_reasons_like_kube_scheduler() {
        let message = unschedulable_message(
            3,
            &[
                vec![Reason::Unschedulable],
                vec![Reason::InsufficientCpu],
                vec![Reason::InsufficientCpu, Reason::InsufficientMemory],
            ],
        );
        assert_eq!(
            message,
            "0/3 nodes are available: 1 Insufficient memory, 1 node(s) were unschedulable, 2 Insufficient cpu. \
             preemption: 0/3 nodes are available: 1 Preemption is not helpful for scheduling, \
             2 No preemption victims found for incoming pod."
        );
        assert_eq!(
            unschedulable_message(0, &[]),
            "no nodes available to schedule pods"
        );
    }

    #[test]
    fn pods_of_one_owner_spread_then_the_least_allocated_node_wins() {
        let mut a = node("a", "4");
        let b = node("b", "4");
        let mut c = node("c", "4");
        a.owners.insert("rs".into(), 1);
        c.requested.cpu_milli = 3000;
        let fits = [&a, &b, &c];
        let r = Request::default();
        assert_eq!(best(&fits, Some("rs"), &r).unwrap().name, "b");
        assert_eq!(best(&fits, None, &r).unwrap().name, "a");
    }
}
