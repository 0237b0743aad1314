//! The resource kinds the simulator serves, and their discovery documents.

use serde_json::{Value, json};

/// One served resource kind.
#[derive(Debug, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group; empty for the core group.
    pub group: &'static str,
    /// API version within the group.
    pub version: &'static str,
    /// Lower-case plural used in URLs.
    pub plural: &'static str,
    /// Singular name (discovery).
    pub singular: &'static str,
    /// Object kind.
    pub kind: &'static str,
    /// Whether objects live in namespaces.
    pub namespaced: bool,
    /// kubectl short names.
    pub short_names: &'static [&'static str],
    /// Served subresources (`status`, `scale`).
    pub subresources: &'static [&'static str],
    /// Read-only kinds computed by the simulator (pod metrics).
    pub computed: bool,
    /// Create-only kinds that are answered, never stored (TokenReview,
    /// SubjectAccessReview, ...).
    pub review: bool,
}

impl ResourceDef {
    /// `v1` or `group/version`.
    #[must_use]
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `pods` or `replicasets.apps`.
    #[must_use]
    pub fn group_resource(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_owned()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

#[allow(clippy::too_many_arguments)] // a table row, one argument per column
const fn def(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
    subresources: &'static [&'static str],
) -> ResourceDef {
    ResourceDef {
        group,
        version,
        plural,
        singular,
        kind,
        namespaced,
        short_names,
        subresources,
        computed: false,
        review: false,
    }
}

/// A create-only review kind (answered, never stored).
const fn review(
    group: &'static str,
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
) -> ResourceDef {
    ResourceDef {
        group,
        version: "v1",
        plural,
        singular,
        kind,
        namespaced,
        short_names: &[],
        subresources: &[],
        computed: false,
        review: true,
    }
}

/// Every served resource.
pub static RESOURCES: &[ResourceDef] = &[
    def("", "v1", "pods", "pod", "Pod", true, &["po"], &["status", "log"]),
    def(
        "",
        "v1",
        "namespaces",
        "namespace",
        "Namespace",
        false,
        &["ns"],
        &["status"],
    ),
    def("", "v1", "nodes", "node", "Node", false, &["no"], &["status"]),
    def(
        "",
        "v1",
        "services",
        "service",
        "Service",
        true,
        &["svc"],
        &["status"],
    ),
    def("", "v1", "secrets", "secret", "Secret", true, &[], &[]),
    def(
        "",
        "v1",
        "configmaps",
        "configmap",
        "ConfigMap",
        true,
        &["cm"],
        &[],
    ),
    def(
        "",
        "v1",
        "serviceaccounts",
        "serviceaccount",
        "ServiceAccount",
        true,
        &["sa"],
        &["token"],
    ),
    def("", "v1", "events", "event", "Event", true, &["ev"], &[]),
    def(
        "apps",
        "v1",
        "deployments",
        "deployment",
        "Deployment",
        true,
        &["deploy"],
        &["status", "scale"],
    ),
    def(
        "apps",
        "v1",
        "replicasets",
        "replicaset",
        "ReplicaSet",
        true,
        &["rs"],
        &["status", "scale"],
    ),
    def(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        "endpointslice",
        "EndpointSlice",
        true,
        &[],
        &[],
    ),
    def(
        "coordination.k8s.io",
        "v1",
        "leases",
        "lease",
        "Lease",
        true,
        &[],
        &[],
    ),
    def(
        "rbac.authorization.k8s.io",
        "v1",
        "roles",
        "role",
        "Role",
        true,
        &[],
        &[],
    ),
    def(
        "rbac.authorization.k8s.io",
        "v1",
        "rolebindings",
        "rolebinding",
        "RoleBinding",
        true,
        &[],
        &[],
    ),
    def(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterroles",
        "clusterrole",
        "ClusterRole",
        false,
        &[],
        &[],
    ),
    def(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "clusterrolebinding",
        "ClusterRoleBinding",
        false,
        &[],
        &[],
    ),
    def(
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        "networkpolicy",
        "NetworkPolicy",
        true,
        &["netpol"],
        &[],
    ),
    def(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "poddisruptionbudget",
        "PodDisruptionBudget",
        true,
        &["pdb"],
        &["status"],
    ),
    ResourceDef {
        group: "metrics.k8s.io",
        version: "v1beta1",
        plural: "pods",
        singular: "",
        kind: "PodMetrics",
        namespaced: true,
        short_names: &[],
        subresources: &[],
        computed: true,
        review: false,
    },
    review(
        "authentication.k8s.io",
        "tokenreviews",
        "tokenreview",
        "TokenReview",
        false,
    ),
    review(
        "authentication.k8s.io",
        "selfsubjectreviews",
        "selfsubjectreview",
        "SelfSubjectReview",
        false,
    ),
    review(
        "authorization.k8s.io",
        "selfsubjectaccessreviews",
        "selfsubjectaccessreview",
        "SelfSubjectAccessReview",
        false,
    ),
    review(
        "authorization.k8s.io",
        "selfsubjectrulesreviews",
        "selfsubjectrulesreview",
        "SelfSubjectRulesReview",
        false,
    ),
    review(
        "authorization.k8s.io",
        "subjectaccessreviews",
        "subjectaccessreview",
        "SubjectAccessReview",
        false,
    ),
    review(
        "authorization.k8s.io",
        "localsubjectaccessreviews",
        "localsubjectaccessreview",
        "LocalSubjectAccessReview",
        true,
    ),
];

/// The resource served at `group/version/plural`.
#[must_use]
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The stored resource of a kind (`Pod`, `Deployment`, ...).
///
/// # Panics
/// Never for the kinds the simulator itself uses; they are in [`RESOURCES`].
#[must_use]
pub fn by_kind(kind: &str) -> &'static ResourceDef {
    #[allow(clippy::expect_used)] // callers pass kinds listed in RESOURCES
    RESOURCES
        .iter()
        .find(|r| r.kind == kind && !r.computed && !r.review)
        .expect("kind listed in RESOURCES")
}

fn groups() -> Vec<(&'static str, &'static str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !out.contains(&(r.group, r.version)) {
            out.push((r.group, r.version));
        }
    }
    out
}

/// `GET /api`.
#[must_use]
pub fn core_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]
    })
}

/// `GET /apis`.
#[must_use]
pub fn group_list() -> Value {
    let groups: Vec<Value> = groups()
        .into_iter()
        .map(|(g, v)| {
            let gv = json!({"groupVersion": format!("{g}/{v}"), "version": v});
            json!({"name": g, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `GET /apis/<group>` (`None` when the group is not served).
#[must_use]
pub fn group(name: &str) -> Option<Value> {
    groups().into_iter().find(|(g, _)| *g == name).map(|(g, v)| {
        let gv = json!({"groupVersion": format!("{g}/{v}"), "version": v});
        json!({"kind": "APIGroup", "apiVersion": "v1", "name": g, "versions": [gv.clone()], "preferredVersion": gv})
    })
}

/// `GET /api/v1` or `GET /apis/<group>/<version>` (`None` when not served).
#[must_use]
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let verbs: Vec<&str> = if r.computed {
            vec!["get", "list"]
        } else if r.review {
            vec!["create"]
        } else {
            vec![
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch",
            ]
        };
        resources.push(json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": verbs,
            "shortNames": r.short_names,
        }));
        for sub in r.subresources {
            let (kind, verbs, group_version): (&str, Vec<&str>, Option<(&str, &str)>) = match *sub {
                "scale" => (
                    "Scale",
                    vec!["get", "patch", "update"],
                    Some(("autoscaling", "v1")),
                ),
                "log" => ("Pod", vec!["get"], None),
                "token" => (
                    "TokenRequest",
                    vec!["create"],
                    Some(("authentication.k8s.io", "v1")),
                ),
                _ => (r.kind, vec!["get", "patch", "update"], None),
            };
            let mut entry = json!({
                "name": format!("{}/{sub}", r.plural),
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": kind,
                "verbs": verbs,
            });
            if let Some((g, v)) = group_version {
                entry["group"] = json!(g);
                entry["version"] = json!(v);
            }
            resources.push(entry);
        }
    }
    if resources.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}))
}

/// `GET /version`.
#[must_use]
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-skipper-sim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// `GET /openapi/v3`: the index of per-group-version documents.
#[must_use]
pub fn openapi_v3_root() -> Value {
    let mut paths = serde_json::Map::new();
    let mut gvs: Vec<(&str, &str)> = vec![("", "v1")];
    gvs.extend(groups());
    for (g, v) in gvs {
        let p = gv_path(g, v);
        paths.insert(
            p.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash=0")}),
        );
    }
    json!({"paths": paths})
}

/// `GET /openapi/v3/<api/v1 | apis/group/version>`: just enough OpenAPI for
/// kubectl to see that the server validates fields itself
/// (`fieldValidation` on every PATCH, tagged with its group-version-kind).
#[must_use]
pub fn openapi_v3_gv(path: &str) -> Option<Value> {
    let mut paths = serde_json::Map::new();
    for r in RESOURCES
        .iter()
        .filter(|r| gv_path(r.group, r.version) == path && !r.computed && !r.review)
    {
        let item = if r.namespaced {
            format!("/{path}/namespaces/{{namespace}}/{}/{{name}}", r.plural)
        } else {
            format!("/{path}/{}/{{name}}", r.plural)
        };
        let gvk = json!({"group": r.group, "version": r.version, "kind": r.kind});
        let params = json!([
            {"name": "dryRun", "in": "query", "schema": {"type": "string"}},
            {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
            {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
        ]);
        let op = |verb: &str| {
            json!({"operationId": format!("{verb}{}", r.kind), "parameters": params,
                   "responses": {"200": {"description": "OK"}},
                   "x-kubernetes-action": verb, "x-kubernetes-group-version-kind": gvk})
        };
        paths.insert(
            item,
            json!({"get": op("get"), "put": op("put"), "patch": op("patch"), "delete": op("delete")}),
        );
    }
    if !RESOURCES.iter().any(|r| gv_path(r.group, r.version) == path) {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}
