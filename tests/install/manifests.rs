//! Every object of `manifests/` is created successfully against the
//! simulator (the kube-rs equivalent of `kubectl create -f`), and the
//! kustomization lists every manifest and sets the one image they all use.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use serde_json::Value;
use skipper::dev::playground::{
    CONTROLLER_YAML, EXAMPLE_POOL_YAML, NAMESPACE_YAML, NETWORK_POLICY_YAML, RBAC_YAML, ROUTER_YAML,
    create_object, manifest_documents,
};
use skipper_devcluster::{Cluster, Config};

const FILES: [(&str, &str); 6] = [
    ("namespace.yaml", NAMESPACE_YAML),
    ("rbac.yaml", RBAC_YAML),
    ("controller.yaml", CONTROLLER_YAML),
    ("router.yaml", ROUTER_YAML),
    ("network-policy.yaml", NETWORK_POLICY_YAML),
    ("example-pool.yaml", EXAMPLE_POOL_YAML),
];

fn kind_name(d: &Value) -> (String, String, String) {
    let s = |p: &str| d.pointer(p).and_then(Value::as_str).unwrap_or("").to_owned();
    (s("/kind"), s("/metadata/namespace"), s("/metadata/name"))
}

#[tokio::test]
async fn every_manifest_is_created_against_the_simulator() {
    let cluster = Cluster::start(Config {
        skipper_exe: env!("CARGO_BIN_EXE_skipper").into(),
        ..Config::default()
    })
    .await
    .unwrap();
    let client = cluster.client().unwrap();
    let mut created = Vec::new();
    for (file, yaml) in FILES {
        let docs = manifest_documents(yaml).unwrap();
        assert!(!docs.is_empty(), "{file} has no objects");
        for d in docs {
            create_object(&client, &d)
                .await
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            created.push(kind_name(&d));
        }
    }
    // Each object is stored as created.
    for (kind, ns, name) in &created {
        assert!(
            cluster.get(kind, ns, name).is_some(),
            "{kind} {ns}/{name} is not stored"
        );
    }
    let kinds: BTreeSet<&str> = created.iter().map(|(k, _, _)| k.as_str()).collect();
    let expected = [
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "ClusterRole",
        "ClusterRoleBinding",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ];
    for k in expected {
        assert!(kinds.contains(k), "no {k} in manifests/ (have {kinds:?})");
    }
    cluster.shutdown().await;
}

#[test]
fn kustomization_lists_the_manifests_and_sets_the_image_once() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/manifests/kustomization.yaml"
    ))
    .unwrap();
    let k = manifest_documents(&text).unwrap().remove(0);
    let resources: BTreeSet<&str> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        resources,
        BTreeSet::from([
            "namespace.yaml",
            "rbac.yaml",
            "controller.yaml",
            "router.yaml",
            "network-policy.yaml"
        ])
    );
    let images = k["images"].as_array().unwrap();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0]["name"], "skipper");
    for (file, yaml) in FILES {
        for d in manifest_documents(yaml).unwrap() {
            if let Some(containers) = d
                .pointer("/spec/template/spec/containers")
                .and_then(Value::as_array)
            {
                for c in containers {
                    assert_eq!(c["image"], "skipper", "{file}: container image is not `skipper`");
                }
            }
        }
    }
}

#[test]
fn router_probes_readiness_on_healthz_and_liveness_on_livez() {
    let docs = manifest_documents(ROUTER_YAML).unwrap();
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let c = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
}

#[test]
fn controller_manifest_matches_the_spec() {
    let docs = manifest_documents(CONTROLLER_YAML).unwrap();
    let d = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(d["spec"]["replicas"], 2);
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    let field = |name: &str| {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e.pointer("/valueFrom/fieldRef/fieldPath"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    assert_eq!(field("SKIPPER_POD_IP").as_deref(), Some("status.podIP"));
    assert_eq!(field("SKIPPER_NAMESPACE").as_deref(), Some("metadata.namespace"));
    assert_eq!(c["readinessProbe"]["grpc"]["port"], 50051);
    // Readiness asks the overall status; liveness and start-up the
    // process-only service, so a refused watch does not restart the pod.
    assert_eq!(c["readinessProbe"]["grpc"].get("service"), None);
    for probe in ["livenessProbe", "startupProbe"] {
        assert_eq!(
            c[probe]["grpc"]["service"],
            skipper::controller::LIVENESS_SERVICE,
            "{probe}"
        );
    }
    assert_eq!(c["envFrom"][0]["secretRef"]["name"], "skipper-controller-paseto");
    let headless = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["spec"]["clusterIP"] == "None")
        .unwrap();
    assert_eq!(headless["metadata"]["name"], "skipper-controller-headless");
    assert!(docs.iter().any(|d| d["kind"] == "PodDisruptionBudget"));
    let pool = manifest_documents(EXAMPLE_POOL_YAML).unwrap();
    let pool = pool.iter().find(|d| d["kind"] == "Deployment").unwrap();
    assert_eq!(
        pool["spec"]["selector"]["matchExpressions"][0],
        serde_json::json!({"key": "skipper/tenant", "operator": "DoesNotExist"})
    );
}

#[test]
fn routers_and_controllers_present_a_projected_token_and_only_they_reach_the_grpc_port() {
    for (file, yaml) in [("controller.yaml", CONTROLLER_YAML), ("router.yaml", ROUTER_YAML)] {
        let docs = manifest_documents(yaml).unwrap();
        let d = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
        let spec = &d["spec"]["template"]["spec"];
        let volume = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "skipper-token")
            .unwrap_or_else(|| panic!("{file}: no skipper-token volume"));
        let source = &volume["projected"]["sources"][0]["serviceAccountToken"];
        assert_eq!(source["audience"], skipper::credentials::AUDIENCE, "{file}");
        assert_eq!(source["path"], "token", "{file}");
        let mount = spec["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "skipper-token")
            .unwrap();
        assert_eq!(
            format!("{}/token", mount["mountPath"].as_str().unwrap()),
            skipper::credentials::DEFAULT_TOKEN_FILE,
            "{file}: the token is where skipper reads it by default"
        );
    }
    // Controllers may review tokens.
    let rbac = manifest_documents(RBAC_YAML).unwrap();
    let role = rbac
        .iter()
        .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "skipper-controller-token-review")
        .unwrap();
    assert_eq!(role["rules"][0]["resources"][0], "tokenreviews");
    assert_eq!(role["rules"][0]["verbs"], serde_json::json!(["create"]));
    let binding = rbac.iter().find(|d| d["kind"] == "ClusterRoleBinding").unwrap();
    assert_eq!(binding["subjects"][0]["name"], "skipper-controller");
    // Port 50051 admits routers and controllers only.
    let np = manifest_documents(NETWORK_POLICY_YAML).unwrap().remove(0);
    let grpc = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ports"][0]["port"] == 50051)
        .unwrap();
    let components: BTreeSet<&str> = grpc["from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            f.pointer("/podSelector/matchLabels/app.kubernetes.io~1component")
                .and_then(Value::as_str)
                .unwrap()
        })
        .collect();
    assert_eq!(components, BTreeSet::from(["router", "controller"]));
}
