//! Authorization as kube-apiserver's `--authorization-mode=Node,RBAC` does
//! it: `system:masters` is always allowed, node credentials go through the
//! Node authorizer (its rules, restricted to the node's own objects and to
//! what pods bound to it reference, with NodeRestriction's limits), and
//! everyone else through RBAC — Roles, ClusterRoles, RoleBindings and
//! ClusterRoleBindings read from the store, matched by verb, API group,
//! resource, `*/subresource`, resourceNames and non-resource URLs.
//!
//! The 403 text is the real one ([`forbidden_message`](crate::rbac::forbidden_message)); the bootstrap
//! policy the API server creates at start is [`bootstrap_policy`](crate::rbac::bootstrap_policy).

use std::sync::Arc;

use serde_json::{Value, json};

use super::auth::{SERVICE_ACCOUNT_USER_PREFIX, UserInfo};
use super::pki::MASTERS_GROUP;
use super::resources::by_kind;
use super::store::{Store, name_of, namespace_of};

/// What a request asks to do (kube-apiserver's `authorizer.Attributes`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`, `impersonate`, ... (HTTP verbs in lower case for non-resource paths).
    pub verb: String,
    /// Whether this is a resource request (else a non-resource path).
    pub resource_request: bool,
    /// Namespace ("" for cluster scope).
    pub namespace: String,
    /// API group ("" for core).
    pub api_group: String,
    /// Plural resource name.
    pub resource: String,
    /// Subresource ("" for none).
    pub subresource: String,
    /// Object name ("" for collections and creates).
    pub name: String,
    /// The URL path of a non-resource request.
    pub path: String,
    /// The request's field selector (the Node authorizer limits node pod lists with it).
    pub field_selector: String,
}

impl Attributes {
    /// A resource request.
    #[must_use]
    pub fn resource(
        verb: &str,
        namespace: &str,
        api_group: &str,
        resource: &str,
        subresource: &str,
        name: &str,
    ) -> Self {
        Self {
            verb: verb.to_owned(),
            resource_request: true,
            namespace: namespace.to_owned(),
            api_group: api_group.to_owned(),
            resource: resource.to_owned(),
            subresource: subresource.to_owned(),
            name: name.to_owned(),
            ..Self::default()
        }
    }

    /// A non-resource request.
    #[must_use]
    pub fn non_resource(verb: &str, path: &str) -> Self {
        Self {
            verb: verb.to_owned(),
            path: path.to_owned(),
            ..Self::default()
        }
    }

    /// `resource/subresource`.
    fn combined_resource(&self) -> String {
        if self.subresource.is_empty() {
            self.resource.clone()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        }
    }
}

/// An authorization decision and its reason (as SubjectAccessReview reports it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may proceed.
    pub allowed: bool,
    /// Why (`RBAC: allowed by ...`), possibly empty.
    pub reason: String,
}

impl Decision {
    fn allow(reason: impl Into<String>) -> Self {
        Self {
            allowed: true,
            reason: reason.into(),
        }
    }

    fn no_opinion() -> Self {
        Self {
            allowed: false,
            reason: String::new(),
        }
    }
}

/// The part after `... is forbidden: ` of a 403, word for word as kube-apiserver writes it.
#[must_use]
pub fn forbidden_message(user: &str, attrs: &Attributes) -> String {
    if !attrs.resource_request {
        return format!("User {user:?} cannot {} path {:?}", attrs.verb, attrs.path);
    }
    let resource = attrs.combined_resource();
    if attrs.namespace.is_empty() {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} at the cluster scope",
            attrs.verb, attrs.api_group
        )
    } else {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} in the namespace {:?}",
            attrs.verb, attrs.api_group, attrs.namespace
        )
    }
}

fn strings(v: &Value, field: &str) -> Vec<String> {
    v.get(field)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default()
}

fn contains_or_star(list: &[String], want: &str) -> bool {
    list.iter().any(|x| x == "*" || x == want)
}

/// Whether one PolicyRule allows `attrs` (rbac.RuleAllows).
#[must_use]
pub fn rule_allows(rule: &Value, attrs: &Attributes) -> bool {
    if !contains_or_star(&strings(rule, "verbs"), &attrs.verb) {
        return false;
    }
    if !attrs.resource_request {
        return strings(rule, "nonResourceURLs").iter().any(|u| {
            u == "*"
                || *u == attrs.path
                || u.strip_suffix('*')
                    .is_some_and(|prefix| attrs.path.starts_with(prefix))
        });
    }
    if !contains_or_star(&strings(rule, "apiGroups"), &attrs.api_group) {
        return false;
    }
    let combined = attrs.combined_resource();
    let resource_ok = strings(rule, "resources").iter().any(|r| {
        r == "*"
            || *r == combined
            || (!attrs.subresource.is_empty() && r.strip_prefix("*/") == Some(attrs.subresource.as_str()))
    });
    if !resource_ok {
        return false;
    }
    let names = strings(rule, "resourceNames");
    names.is_empty() || names.contains(&attrs.name)
}

/// Index of the first binding subject that applies to `user`.
fn applies_to(user: &UserInfo, subjects: &[Value], binding_namespace: &str) -> Option<usize> {
    subjects.iter().position(|s| {
        let name = s.get("name").and_then(Value::as_str).unwrap_or("");
        match s.get("kind").and_then(Value::as_str) {
            Some("User") => user.name == name,
            Some("Group") => user.in_group(name),
            Some("ServiceAccount") => {
                let ns = s
                    .get("namespace")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .unwrap_or(binding_namespace);
                !ns.is_empty()
                    && user
                        .name
                        .strip_prefix(SERVICE_ACCOUNT_USER_PREFIX)
                        .and_then(|rest| rest.split_once(':'))
                        == Some((ns, name))
            }
            _ => false,
        }
    })
}

fn describe_subject(s: &Value, binding_namespace: &str) -> String {
    let kind = s.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = s.get("name").and_then(Value::as_str).unwrap_or("");
    if kind == "ServiceAccount" {
        let ns = s
            .get("namespace")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .unwrap_or(binding_namespace);
        format!("{kind} {:?}", format!("{name}/{ns}"))
    } else {
        format!("{kind} {name:?}")
    }
}

fn role_rules(store: &Store, role_ref: &Value, binding_namespace: &str) -> Option<Arc<Value>> {
    let name = role_ref.get("name").and_then(Value::as_str).unwrap_or("");
    match role_ref.get("kind").and_then(Value::as_str) {
        Some("Role") if !binding_namespace.is_empty() => {
            store.get_shared(by_kind("Role"), binding_namespace, name)
        }
        Some("ClusterRole") => store.get_shared(by_kind("ClusterRole"), "", name),
        _ => None,
    }
}

/// The `rules` of a role [`role_rules`] found.
fn rules_of(role: Option<&Arc<Value>>) -> &[Value] {
    role.and_then(|r| r.get("rules"))
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The `subjects` of a binding.
fn subjects_of(binding: &Value) -> &[Value] {
    binding
        .get("subjects")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Calls `visit(source, rule)` for every rule that applies to `user` in
/// `namespace` (cluster bindings first); stops when `visit` returns false.
fn visit_rules(store: &Store, user: &UserInfo, namespace: &str, mut visit: impl FnMut(&str, &Value) -> bool) {
    // Every request is authorized: the bindings and roles are read in
    // place, not copied.
    let crbs = store.snapshot(by_kind("ClusterRoleBinding"), None);
    for b in &crbs {
        let subjects = subjects_of(b);
        let Some(i) = applies_to(user, subjects, "") else {
            continue;
        };
        let role_ref = &b["roleRef"];
        let source = format!(
            "ClusterRoleBinding {:?} of {} {:?} to {}",
            name_of(b),
            role_ref["kind"].as_str().unwrap_or(""),
            role_ref["name"].as_str().unwrap_or(""),
            describe_subject(&subjects[i], "")
        );
        let role = role_rules(store, role_ref, "");
        for rule in rules_of(role.as_ref()) {
            if !visit(&source, rule) {
                return;
            }
        }
    }
    if namespace.is_empty() {
        return;
    }
    let rbs = store.snapshot(by_kind("RoleBinding"), Some(namespace));
    for b in &rbs {
        let subjects = subjects_of(b);
        let Some(i) = applies_to(user, subjects, namespace) else {
            continue;
        };
        let role_ref = &b["roleRef"];
        let source = format!(
            "RoleBinding {:?} of {} {:?} to {}",
            format!("{}/{}", name_of(b), namespace_of(b)),
            role_ref["kind"].as_str().unwrap_or(""),
            role_ref["name"].as_str().unwrap_or(""),
            describe_subject(&subjects[i], namespace)
        );
        let role = role_rules(store, role_ref, namespace);
        for rule in rules_of(role.as_ref()) {
            if !visit(&source, rule) {
                return;
            }
        }
    }
}

fn rbac(store: &Store, user: &UserInfo, attrs: &Attributes) -> Decision {
    let mut decision = Decision::no_opinion();
    visit_rules(store, user, &attrs.namespace, |source, rule| {
        if rule_allows(rule, attrs) {
            decision = Decision::allow(format!("RBAC: allowed by {source}"));
            return false;
        }
        true
    });
    decision
}

/// Every rule that applies to `user` in `namespace` (SelfSubjectRulesReview).
#[must_use]
pub fn rules_for(store: &Store, user: &UserInfo, namespace: &str) -> Vec<Value> {
    let mut out = Vec::new();
    if user.in_group(MASTERS_GROUP) {
        out.push(json!({"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}));
        out.push(json!({"verbs": ["*"], "nonResourceURLs": ["*"]}));
    }
    visit_rules(store, user, namespace, |_, rule| {
        out.push(rule.clone());
        true
    });
    out
}

/// Decides a request: privileged group, then Node, then RBAC.
#[must_use]
pub fn authorize(store: &Store, user: &UserInfo, attrs: &Attributes) -> Decision {
    if user.in_group(MASTERS_GROUP) {
        return Decision::allow("");
    }
    let mut reasons = Vec::new();
    if let Some(node) = user.node_name()
        && let Some(d) = node_authorizer(store, node, attrs)
    {
        if d.allowed {
            return d;
        }
        reasons.push(format!("node: {}", d.reason));
    }
    let d = rbac(store, user, attrs);
    if d.allowed {
        return d;
    }
    Decision {
        allowed: false,
        reason: reasons.join(", "),
    }
}

/// Whether a pod bound to `node` satisfies `pred` (pods are looked at in
/// place: the kubelet's every request is authorized, and copying every pod
/// for each was most of an idle cluster's work).
fn any_pod_on(store: &Store, node: &str, pred: impl Fn(&Value) -> bool) -> bool {
    store.any(by_kind("Pod"), None, |p| {
        p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node) && pred(p)
    })
}

/// `(kind, namespace, name)` of everything a pod references (volumes,
/// projected sources, env, envFrom, image pull secrets, ServiceAccount).
fn references(pod: &Value) -> Vec<(&'static str, String, String)> {
    let ns = namespace_of(pod).to_owned();
    let mut out = Vec::new();
    let mut add = |kind: &'static str, name: Option<&str>| {
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            out.push((kind, ns.clone(), n.to_owned()));
        }
    };
    let spec = &pod["spec"];
    add(
        "ServiceAccount",
        Some(
            spec.get("serviceAccountName")
                .and_then(Value::as_str)
                .unwrap_or("default"),
        ),
    );
    for s in spec
        .get("imagePullSecrets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        add("Secret", s.get("name").and_then(Value::as_str));
    }
    for v in spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        add("Secret", v.pointer("/secret/secretName").and_then(Value::as_str));
        add("ConfigMap", v.pointer("/configMap/name").and_then(Value::as_str));
        add(
            "PersistentVolumeClaim",
            v.pointer("/persistentVolumeClaim/claimName")
                .and_then(Value::as_str),
        );
        for src in v
            .pointer("/projected/sources")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            add("Secret", src.pointer("/secret/name").and_then(Value::as_str));
            add(
                "ConfigMap",
                src.pointer("/configMap/name").and_then(Value::as_str),
            );
        }
    }
    for list in ["containers", "initContainers", "ephemeralContainers"] {
        for c in spec.get(list).and_then(Value::as_array).into_iter().flatten() {
            for e in c.get("env").and_then(Value::as_array).into_iter().flatten() {
                add(
                    "Secret",
                    e.pointer("/valueFrom/secretKeyRef/name").and_then(Value::as_str),
                );
                add(
                    "ConfigMap",
                    e.pointer("/valueFrom/configMapKeyRef/name")
                        .and_then(Value::as_str),
                );
            }
            for e in c.get("envFrom").and_then(Value::as_array).into_iter().flatten() {
                add("Secret", e.pointer("/secretRef/name").and_then(Value::as_str));
                add(
                    "ConfigMap",
                    e.pointer("/configMapRef/name").and_then(Value::as_str),
                );
            }
        }
    }
    out
}

/// The Node authorizer's static rules (bootstrap policy `NodeRules`) for
/// what it does not subdivide.
fn node_rules() -> Vec<Value> {
    vec![
        rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
        rule(
            &["authorization.k8s.io"],
            &["subjectaccessreviews", "localsubjectaccessreviews"],
            &["create"],
        ),
        rule(&[""], &["services"], &["get", "list", "watch"]),
        rule(
            &["", "events.k8s.io"],
            &["events"],
            &["create", "patch", "update"],
        ),
        rule(&[""], &["endpoints"], &["get"]),
        rule(
            &["certificates.k8s.io"],
            &["certificatesigningrequests"],
            &["create", "get", "list", "watch"],
        ),
        rule(&["node.k8s.io"], &["runtimeclasses"], &["get", "list", "watch"]),
        rule(&["storage.k8s.io"], &["csidrivers"], &["get", "list", "watch"]),
    ]
}

/// Whether a field selector requires `field` to equal `value`.
fn selects(field_selector: &str, field: &str, value: &str) -> bool {
    field_selector.split(',').any(|r| {
        r.trim()
            .split_once('=')
            .is_some_and(|(f, v)| f.trim() == field && v.trim_start_matches('=').trim() == value)
    })
}

/// The Node authorizer: `Some` allows, or refuses with a reason (the
/// request then goes to RBAC); `None` has no opinion and no reason.
fn node_authorizer(store: &Store, node: &str, attrs: &Attributes) -> Option<Decision> {
    if !attrs.resource_request {
        return None;
    }
    let allow = || Some(Decision::allow(""));
    let refuse = |why: String| {
        Some(Decision {
            allowed: false,
            reason: why,
        })
    };
    let no_relation = || {
        refuse(format!(
            "no relationship found between node '{node}' and this object"
        ))
    };
    let verb = attrs.verb.as_str();
    let sub = attrs.subresource.as_str();
    let node_exists = store.get(by_kind("Node"), "", node).is_some();
    // A path from the object to this node in the authorizer's graph.
    let related = |kind: &str| -> Option<Decision> {
        if attrs.name.is_empty() {
            return refuse("No Object name found".into());
        }
        let on_node = node_exists
            && any_pod_on(store, node, |p| {
                (kind == "Pod" && namespace_of(p) == attrs.namespace && name_of(p) == attrs.name)
                    || references(p)
                        .iter()
                        .any(|(k, n, m)| *k == kind && *n == attrs.namespace && *m == attrs.name)
            });
        if on_node { allow() } else { no_relation() }
    };
    match (attrs.api_group.as_str(), attrs.resource.as_str()) {
        ("", kind @ ("secrets" | "configmaps")) => {
            if !matches!(verb, "get" | "list" | "watch") {
                return refuse("can only read resources of this type".into());
            }
            if !sub.is_empty() {
                return refuse("cannot read subresource".into());
            }
            if attrs.namespace.is_empty() {
                return refuse("can only read namespaced object of this type".into());
            }
            related(if kind == "secrets" { "Secret" } else { "ConfigMap" })
        }
        ("", "persistentvolumeclaims") => {
            if sub == "status" {
                return if matches!(verb, "update" | "patch") {
                    related("PersistentVolumeClaim")
                } else {
                    refuse("can only get/update/patch this type".into())
                };
            }
            if verb != "get" {
                return refuse("can only get individual resources of this type".into());
            }
            related("PersistentVolumeClaim")
        }
        ("", "serviceaccounts") => {
            if verb != "create" || attrs.name.is_empty() {
                return refuse("can only create tokens for individual service accounts".into());
            }
            if sub != "token" {
                return refuse("can only create token subresource of serviceaccount".into());
            }
            related("ServiceAccount")
        }
        ("coordination.k8s.io", "leases") => {
            if !matches!(verb, "get" | "create" | "update" | "patch" | "delete") {
                return refuse("can only get, create, update, patch, or delete a node lease".into());
            }
            if attrs.namespace != "kube-node-lease" {
                return refuse("can only access leases in the \"kube-node-lease\" system namespace".into());
            }
            if verb != "create" && attrs.name != node {
                return refuse("can only access node lease with the same name as the requesting node".into());
            }
            allow()
        }
        ("", "nodes") => match (sub, verb) {
            ("", "create" | "update" | "patch") | ("status", "update" | "patch") => allow(),
            ("", "get" | "list" | "watch") => match attrs.name.as_str() {
                n if n == node => allow(),
                "" => refuse(format!(
                    "node '{node}' cannot read all nodes, only its own Node object"
                )),
                other => refuse(format!(
                    "node '{node}' cannot read '{other}', only its own Node object"
                )),
            },
            _ => None,
        },
        ("", "pods") => match (sub, verb) {
            ("", "get") => related("Pod"),
            ("", "list" | "watch") => {
                if selects(&attrs.field_selector, "spec.nodeName", node) {
                    allow()
                } else if !attrs.name.is_empty() {
                    related("Pod")
                } else {
                    refuse("can only list/watch pods with spec.nodeName field selector".into())
                }
            }
            ("", "create" | "delete") | ("status", "update" | "patch") | ("eviction", "create") => allow(),
            _ => None,
        },
        _ => node_rules()
            .iter()
            .any(|r| rule_allows(r, attrs))
            .then(|| Decision::allow("")),
    }
}

/// NodeRestriction admission: what a node may write, judged on the stored
/// object or the request body. `Err` carries the message after `is forbidden: `.
///
/// # Errors
/// The admission plugin's text when the write touches another node's objects.
pub fn node_restriction(
    store: &Store,
    node: &str,
    attrs: &Attributes,
    body: Option<&Value>,
) -> Result<(), String> {
    let body_name = body
        .and_then(|b| b.pointer("/metadata/name"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let name = if attrs.name.is_empty() {
        body_name
    } else {
        attrs.name.as_str()
    };
    let pod_node = || {
        store
            .get(by_kind("Pod"), &attrs.namespace, &attrs.name)
            .and_then(|p| {
                p.pointer("/spec/nodeName")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
    };
    match (
        attrs.api_group.as_str(),
        attrs.resource.as_str(),
        attrs.subresource.as_str(),
        attrs.verb.as_str(),
    ) {
        ("", "nodes", _, "create" | "update" | "patch" | "delete") if name != node => Err(format!(
            "node \"{node}\" is not allowed to modify node \"{name}\""
        )),
        ("coordination.k8s.io", "leases", "", "create") if name != node => {
            Err("can only access node lease with the same name as the requesting node".to_owned())
        }
        ("", "pods", "status", "update" | "patch") if pod_node().as_deref() != Some(node) => Err(format!(
            "node \"{node}\" can only update pod status for pods with spec.nodeName set to itself"
        )),
        ("", "pods", "", "delete") if pod_node().as_deref() != Some(node) => Err(format!(
            "node \"{node}\" can only delete pods with spec.nodeName set to itself"
        )),
        ("", "pods", "", "create") => Err(format!(
            "pod does not have \"kubernetes.io/config.mirror\" annotation, node \"{node}\" can only create mirror pods"
        )),
        _ => Ok(()),
    }
}

fn rule(api_groups: &[&str], resources: &[&str], verbs: &[&str]) -> Value {
    json!({"apiGroups": api_groups, "resources": resources, "verbs": verbs})
}

fn cluster_role(name: &str, rules: Vec<Value>) -> Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                     "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}},
        "rules": rules,
    })
}

fn cluster_role_binding(name: &str, role: &str, groups: &[&str]) -> Value {
    let subjects: Vec<Value> = groups
        .iter()
        .map(|g| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": g}))
        .collect();
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                     "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": subjects,
    })
}

/// The ClusterRoles and ClusterRoleBindings kube-apiserver creates at start
/// that matter here: `cluster-admin` (bound to `system:masters`),
/// `system:discovery`, `system:basic-user`, `system:public-info-viewer`,
/// and the aggregated user-facing roles `view`, `edit` and `admin` (their
/// core rules, flattened).
#[must_use]
pub fn bootstrap_policy() -> Vec<Value> {
    let read = ["get", "list", "watch"];
    let write = ["create", "delete", "deletecollection", "patch", "update"];
    let view_rules = vec![
        rule(
            &[""],
            &[
                "configmaps",
                "endpoints",
                "persistentvolumeclaims",
                "persistentvolumeclaims/status",
                "pods",
                "replicationcontrollers",
                "replicationcontrollers/scale",
                "serviceaccounts",
                "services",
                "services/status",
                "bindings",
                "events",
                "limitranges",
                "namespaces/status",
                "pods/log",
                "pods/status",
                "replicationcontrollers/status",
                "resourcequotas",
                "resourcequotas/status",
                "namespaces",
            ],
            &read,
        ),
        rule(
            &["apps"],
            &[
                "controllerrevisions",
                "daemonsets",
                "daemonsets/status",
                "deployments",
                "deployments/scale",
                "deployments/status",
                "replicasets",
                "replicasets/scale",
                "replicasets/status",
                "statefulsets",
                "statefulsets/scale",
                "statefulsets/status",
            ],
            &read,
        ),
        rule(
            &["batch"],
            &["cronjobs", "cronjobs/status", "jobs", "jobs/status"],
            &read,
        ),
        rule(&["discovery.k8s.io"], &["endpointslices"], &read),
        rule(
            &["policy"],
            &["poddisruptionbudgets", "poddisruptionbudgets/status"],
            &read,
        ),
        rule(&["events.k8s.io"], &["events"], &read),
        rule(&["metrics.k8s.io"], &["pods", "nodes"], &read),
    ];
    let mut edit_rules = view_rules.clone();
    edit_rules.extend([
        rule(
            &[""],
            &[
                "pods",
                "pods/attach",
                "pods/exec",
                "pods/portforward",
                "pods/proxy",
                "pods/eviction",
                "configmaps",
                "endpoints",
                "persistentvolumeclaims",
                "replicationcontrollers",
                "replicationcontrollers/scale",
                "secrets",
                "serviceaccounts",
                "services",
                "services/proxy",
            ],
            &write,
        ),
        rule(&[""], &["secrets"], &read),
        rule(&[""], &["serviceaccounts/token"], &["create"]),
        rule(&[""], &["serviceaccounts"], &["impersonate"]),
        rule(
            &["apps"],
            &[
                "daemonsets",
                "deployments",
                "deployments/rollback",
                "deployments/scale",
                "replicasets",
                "replicasets/scale",
                "statefulsets",
                "statefulsets/scale",
            ],
            &write,
        ),
        rule(&["batch"], &["cronjobs", "jobs"], &write),
        rule(&["discovery.k8s.io"], &["endpointslices"], &write),
        rule(&["policy"], &["poddisruptionbudgets"], &write),
        rule(
            &["coordination.k8s.io"],
            &["leases"],
            &[
                "get",
                "list",
                "watch",
                "create",
                "delete",
                "deletecollection",
                "patch",
                "update",
            ],
        ),
    ]);
    let mut admin_rules = edit_rules.clone();
    admin_rules.extend([
        rule(
            &["rbac.authorization.k8s.io"],
            &["rolebindings", "roles"],
            &[
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch",
            ],
        ),
        rule(
            &["authorization.k8s.io"],
            &["localsubjectaccessreviews"],
            &["create"],
        ),
    ]);
    vec![
        cluster_role(
            "cluster-admin",
            vec![
                rule(&["*"], &["*"], &["*"]),
                json!({"nonResourceURLs": ["*"], "verbs": ["*"]}),
            ],
        ),
        cluster_role_binding("cluster-admin", "cluster-admin", &[MASTERS_GROUP]),
        cluster_role(
            "system:discovery",
            vec![
                json!({"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez",
                                            "/openapi", "/openapi/*", "/readyz", "/version", "/version/"],
                        "verbs": ["get"]}),
            ],
        ),
        cluster_role_binding("system:discovery", "system:discovery", &["system:authenticated"]),
        cluster_role(
            "system:basic-user",
            vec![
                rule(
                    &["authorization.k8s.io"],
                    &["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                    &["create"],
                ),
                rule(&["authentication.k8s.io"], &["selfsubjectreviews"], &["create"]),
            ],
        ),
        cluster_role_binding(
            "system:basic-user",
            "system:basic-user",
            &["system:authenticated"],
        ),
        cluster_role(
            "system:public-info-viewer",
            vec![
                json!({"nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"],
                        "verbs": ["get"]}),
            ],
        ),
        cluster_role_binding(
            "system:public-info-viewer",
            "system:public-info-viewer",
            &["system:authenticated", "system:unauthenticated"],
        ),
        cluster_role("view", view_rules),
        cluster_role("edit", edit_rules),
        cluster_role("admin", admin_rules),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(verb: &str, group: &str, resource: &str, sub: &str, name: &str) -> Attributes {
        Attributes::resource(verb, "ns", group, resource, sub, name)
    }

    #[test]
    fn rules_match_verbs_groups_resources_subresources_and_names() {
        let r = json!({"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]});
        assert!(rule_allows(&r, &attrs("get", "", "pods", "", "p")));
        assert!(rule_allows(&r, &attrs("get", "", "pods", "log", "p")));
        assert!(!rule_allows(&r, &attrs("get", "", "pods", "status", "p")));
        assert!(!rule_allows(&r, &attrs("watch", "", "pods", "", "")));
        assert!(!rule_allows(&r, &attrs("get", "apps", "pods", "", "p")));
        let star = json!({"apiGroups": ["*"], "resources": ["*/scale"], "verbs": ["*"]});
        assert!(rule_allows(
            &star,
            &attrs("update", "apps", "deployments", "scale", "d")
        ));
        assert!(!rule_allows(
            &star,
            &attrs("update", "apps", "deployments", "", "d")
        ));
        let named = json!({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["one"], "verbs": ["get", "list"]});
        assert!(rule_allows(&named, &attrs("get", "", "configmaps", "", "one")));
        assert!(!rule_allows(&named, &attrs("get", "", "configmaps", "", "two")));
        assert!(
            !rule_allows(&named, &attrs("list", "", "configmaps", "", "")),
            "a list has no name"
        );
        let urls = json!({"nonResourceURLs": ["/healthz", "/apis/*"], "verbs": ["get"]});
        assert!(rule_allows(&urls, &Attributes::non_resource("get", "/healthz")));
        assert!(rule_allows(
            &urls,
            &Attributes::non_resource("get", "/apis/apps/v1")
        ));
        assert!(!rule_allows(
            &urls,
            &Attributes::non_resource("get", "/healthz/x")
        ));
        assert!(!rule_allows(&urls, &attrs("get", "", "healthz", "", "")));
    }

    #[test]
    fn forbidden_messages_are_the_real_text() {
        let a = Attributes::resource("list", "default", "", "pods", "", "");
        assert_eq!(
            forbidden_message("system:serviceaccount:skipper:skipper-controller", &a),
            "User \"system:serviceaccount:skipper:skipper-controller\" cannot list resource \"pods\" in API group \"\" in the namespace \"default\""
        );
        let a = Attributes::resource("get", "", "", "nodes", "status", "n");
        assert_eq!(
            forbidden_message("alice", &a),
            "User \"alice\" cannot get resource \"nodes/status\" in API group \"\" at the cluster scope"
        );
        assert_eq!(
            forbidden_message("alice", &Attributes::non_resource("post", "/_sim/compact")),
            "User \"alice\" cannot post path \"/_sim/compact\""
        );
    }

    #[test]
    fn references_cover_volumes_env_and_the_service_account() {
        let pod = json!({"metadata": {"namespace": "ns", "name": "p"}, "spec": {
            "volumes": [{"name": "a", "secret": {"secretName": "s1"}},
                        {"name": "b", "projected": {"sources": [{"configMap": {"name": "c1"}}]}}],
            "containers": [{"name": "x", "env": [{"name": "E", "valueFrom": {"secretKeyRef": {"name": "s2", "key": "k"}}}],
                            "envFrom": [{"configMapRef": {"name": "c2"}}]}]}});
        let refs = references(&pod);
        for (k, n) in [
            ("ServiceAccount", "default"),
            ("Secret", "s1"),
            ("ConfigMap", "c1"),
            ("Secret", "s2"),
            ("ConfigMap", "c2"),
        ] {
            assert!(
                refs.contains(&(k, "ns".to_owned(), n.to_owned())),
                "{k} {n}: {refs:?}"
            );
        }
    }
}
