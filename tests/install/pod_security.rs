//! Pod Security `restricted` for every pod Skipper's installers define,
//! checked by the real kube-apiserver's admission (the simulator has none):
//! in namespaces labelled `pod-security.kubernetes.io/enforce=restricted`
//! (and `warn=restricted`, so workloads are checked too), each Deployment of
//! the kustomize base, of `example-pool.yaml` and of every golden render of
//! the chart is created with `--dry-run=server` with no warning, and a pod
//! of each pod template is admitted.
//!
//! Skipped with a message when `make control-plane` (or `make helm`) has not
//! built what it needs; a failure under `CI=true`.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use serde_json::{Value, json};
use skipper::dev::playground::manifest_documents;
use skipper_test_support::backend::{self, Backend};
use skipper_test_support::workspace_root;

/// `(where it comes from, every Deployment it defines)`.
fn workloads() -> Vec<(String, Vec<Value>)> {
    let deployments = |yaml: &str| -> Vec<Value> {
        manifest_documents(yaml)
            .unwrap()
            .into_iter()
            .filter(|d| d["kind"] == "Deployment")
            .collect()
    };
    let root = workspace_root();
    let mut out = Vec::new();
    let kustomized = std::process::Command::new("kubectl")
        .args(["kustomize", "manifests/"])
        .current_dir(&root)
        .output()
        .unwrap();
    let kustomized = skipper_test_support::process::succeeded("kubectl kustomize manifests/", kustomized);
    out.push((
        "kubectl kustomize manifests/".to_owned(),
        deployments(&String::from_utf8_lossy(&kustomized)),
    ));
    out.push((
        "manifests/example-pool.yaml".to_owned(),
        deployments(&std::fs::read_to_string(root.join("manifests/example-pool.yaml")).unwrap()),
    ));
    // The golden renders are what `helm template` gives (the chart tests
    // check that), so this needs no helm.
    let mut goldens: Vec<_> = std::fs::read_dir(root.join("charts/skipper/ci"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".golden.yaml"))
        .collect();
    goldens.sort();
    for g in goldens {
        out.push((
            g.strip_prefix(&root).unwrap().display().to_string(),
            deployments(&std::fs::read_to_string(&g).unwrap()),
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pod_of_the_chart_and_the_kustomize_base_meets_restricted_with_no_warning() {
    if !backend::kubectl_available() {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true"),
            "kubectl is not installed"
        );
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    let Some(b) = Backend::real(&[]).await else {
        return;
    };
    let workloads = workloads();
    let namespaces: BTreeSet<String> = workloads
        .iter()
        .flat_map(|(_, ds)| {
            ds.iter().map(|d| {
                d["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned()
            })
        })
        .collect();
    for ns in &namespaces {
        let created = b
            .kubectl_with_stdin(
                &["apply", "-f", "-"],
                Some(
                    &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {
                        "pod-security.kubernetes.io/enforce": "restricted",
                        "pod-security.kubernetes.io/warn": "restricted",
                    }}})
                    .to_string(),
                ),
            )
            .await;
        assert!(created.ok, "namespace {ns}: {}", created.stderr);
    }
    // The admission is on: a pod without the securityContext is refused.
    let bare = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "bare", "namespace": namespaces.iter().next().unwrap()},
        "spec": {"containers": [{"name": "c", "image": "skipper"}]},
    });
    let refused = b
        .kubectl_with_stdin(
            &["create", "--dry-run=server", "-f", "-"],
            Some(&bare.to_string()),
        )
        .await;
    assert!(
        !refused.ok && refused.stderr.contains("violates PodSecurity \"restricted:"),
        "a pod without a securityContext: {}{}",
        refused.stdout,
        refused.stderr
    );
    let mut checked = 0;
    for (source, deployments) in &workloads {
        for d in deployments {
            let name = d["metadata"]["name"].as_str().unwrap();
            let ns = d["metadata"]["namespace"].as_str().unwrap_or("default");
            // The workload: warn=restricted checks its template.
            let dry = b
                .kubectl_with_stdin(&["create", "--dry-run=server", "-f", "-"], Some(&d.to_string()))
                .await;
            assert!(dry.ok, "{source}: Deployment {ns}/{name}: {}", dry.stderr);
            assert!(
                !dry.stderr.contains("Warning"),
                "{source}: Deployment {ns}/{name} warns: {}",
                dry.stderr
            );
            // A pod of it (its ServiceAccount first: admission looks it up):
            // enforce=restricted admits it or refuses it.
            if let Some(sa) = d["spec"]["template"]["spec"]["serviceAccountName"].as_str() {
                b.kubectl(&["-n", ns, "create", "serviceaccount", sa]).await;
            }
            let pod = json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("{name}-check"), "namespace": ns,
                             "labels": d["spec"]["template"]["metadata"]["labels"]},
                "spec": d["spec"]["template"]["spec"],
            });
            let dry = b
                .kubectl_with_stdin(&["create", "--dry-run=server", "-f", "-"], Some(&pod.to_string()))
                .await;
            assert!(
                dry.ok,
                "{source}: a pod of Deployment {ns}/{name} is refused: {}",
                dry.stderr
            );
            assert!(
                !dry.stderr.contains("Warning"),
                "{source}: a pod of Deployment {ns}/{name} warns: {}",
                dry.stderr
            );
            checked += 1;
        }
    }
    // kustomize: controller, router; the pool; the chart: 2 + 2 + 3 + 2 per render.
    assert!(checked >= 10, "only {checked} Deployments checked");
    println!("pod security restricted: {checked} Deployments and their pods admitted with no warning");
    b.shutdown().await;
}
