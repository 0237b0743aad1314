//! The README's deploy steps run verbatim — `skipper keygen`, `kubectl
//! apply`, the imperative `kubectl create namespace|secret|configmap` —
//! against the simulator and against the real control plane, and leave
//! the objects `manifests/` describes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;
use skipper_test_support::differential;

use std::path::{Path, PathBuf};

use backend::Backend;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::Role;
use kube::Api;

/// The commands of the README's `## Deploying` shell block, with
/// backslash continuations joined and comments dropped.
fn readme_deploy_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let section = readme.split("## Deploying").nth(1).expect("a Deploying section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a sh block in the Deploying section");
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in block.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if let Some(part) = line.strip_suffix('\\') {
            current.push_str(part.trim_end());
            current.push(' ');
        } else {
            current.push_str(line);
            commands.push(std::mem::take(&mut current));
        }
    }
    commands
}

/// A directory laid out like the repository root for the commands:
/// `manifests/` and a `bin/skipper`.
fn workspace() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "skipper-readme-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::os::unix::fs::symlink(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests"),
        dir.join("manifests"),
    )
    .unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_skipper"), dir.join("bin/skipper")).unwrap();
    dir
}

#[test]
fn the_readme_has_the_deploy_steps_this_test_runs() {
    let commands = readme_deploy_commands();
    assert_eq!(
        commands.first().map(String::as_str),
        Some("skipper keygen --out-dir ./keys")
    );
    assert!(
        commands.iter().any(|c| c == "kubectl apply -k manifests/"),
        "{commands:?}"
    );
    assert!(
        commands
            .iter()
            .any(|c| c.starts_with("kubectl -n skipper create secret generic skipper-controller-paseto")),
        "{commands:?}"
    );
    assert_eq!(commands.len(), 7, "{commands:?}");
}

differential!(
    the_readme_deploy_steps_run_verbatim,
    deploy_steps,
    namespaces = []
);

async fn deploy_steps(b: &Backend) {
    if !backend::kubectl_available() {
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    let dir = workspace();
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for command in readme_deploy_commands() {
        let out = tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &command])
            .current_dir(&dir)
            .env("PATH", &path)
            .env("KUBECONFIG", b.kubeconfig())
            .env("KUBECACHEDIR", dir.join("kube-cache"))
            .output()
            .await
            .unwrap();
        let _ = skipper_test_support::process::succeeded(&command, out);
    }

    let client = b.client().await;
    let secret = Api::<Secret>::namespaced(client.clone(), "skipper")
        .get("skipper-controller-paseto")
        .await
        .unwrap();
    let private_pem = std::fs::read(dir.join("keys/private.pem")).unwrap();
    assert_eq!(secret.data.unwrap()["SKIPPER_PASETO_PRIVATE_KEY"].0, private_pem);
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "skipper-functions")
        .get("skipper-paseto-public")
        .await
        .unwrap();
    let public_pem = std::fs::read_to_string(dir.join("keys/public.pem")).unwrap();
    assert_eq!(cm.data.unwrap()["SKIPPER_PUBLIC_KEY"], public_pem);
    for (ns, name) in [
        ("skipper", "skipper-controller"),
        ("skipper", "skipper-router"),
        ("skipper-functions", "fixture"),
    ] {
        let d = Api::<Deployment>::namespaced(client.clone(), ns)
            .get(name)
            .await
            .unwrap();
        let image = d.spec.unwrap().template.spec.unwrap().containers[0].image.clone();
        if ns == "skipper" {
            assert_eq!(
                image.as_deref(),
                Some("registry.example.com/skipper:latest"),
                "kustomize sets the image"
            );
        }
    }
    for (ns, name) in [
        ("skipper", "skipper-controller"),
        ("skipper", "skipper-router"),
        ("skipper-functions", "skipper-controller"),
    ] {
        Api::<Role>::namespaced(client.clone(), ns)
            .get(name)
            .await
            .unwrap();
    }
    for name in ["skipper-controller", "skipper-router"] {
        Api::<ServiceAccount>::namespaced(client.clone(), "skipper")
            .get(name)
            .await
            .unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
