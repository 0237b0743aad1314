//! kubectl as a real client of `skipper dev apiserver`: a pool of 3 fixture
//! pods created with `kubectl create -f` comes up Ready on distinct IPs, is
//! assigned, labelled (the pool refills), annotated, patched (a failing JSON
//! Patch `test` gives kubectl's usual error), watched, scaled and deleted;
//! Ctrl-C stops every pod process. Skipped with a message without kubectl.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use skipper_devcluster::pool_deployment_json;
use tokio::io::{AsyncBufReadExt as _, BufReader};

const WAIT: Duration = Duration::from_secs(30);

struct Apiserver {
    child: tokio::process::Child,
    dir: PathBuf,
}

impl Apiserver {
    async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "skipper-kubectl-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .args([
                "dev",
                "apiserver",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--kubeconfig",
            ])
            .arg(dir.join("kubeconfig"))
            .args(["--log-format", "text", "--log-level", "warn"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let me = Self { child, dir };
        common::eventually("apiserver answers", WAIT, || {
            let path = me.dir.join("kubeconfig");
            async move {
                let client = Self::client_from(&path).await?;
                client.apiserver_version().await.ok().map(|_| ())
            }
        })
        .await;
        me
    }

    /// A client from the kubeconfig at `path` (`None` until it is written).
    async fn client_from(path: &Path) -> Option<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::read_from(path).ok()?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                .await
                .ok()?;
        kube::Client::try_from(config).ok()
    }

    async fn kubectl(&self, args: &[&str]) -> (bool, String, String) {
        let out = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.join("cache"))
            .args(args)
            .output()
            .await
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    async fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.kubectl(args).await;
        assert!(ok, "kubectl {args:?} failed: {err}");
        out
    }

    async fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&a).await).unwrap()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Apiserver {
    /// Ctrl-C the server (it stops its pod processes and exits) and remove the kubeconfig directory.
    fn drop(&mut self) {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGINT);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ready(pod: &Value) -> bool {
    pod["status"]["phase"] == "Running"
        && pod["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
        && pod["metadata"]["deletionTimestamp"].is_null()
}

/// The fixture process of a pod: the one listening on its IP.
fn pid_of(pod: &Value) -> u32 {
    let ip = pod["status"]["podIP"].as_str().unwrap().parse().unwrap();
    common::listener_pid(ip, 8888).unwrap()
}

async fn ready_pool(api: &Apiserver, n: usize) -> Vec<Value> {
    common::eventually(&format!("{n} ready pool pods"), WAIT, || async {
        let list = api
            .json(&["get", "pods", "-l", "skipper/deployment=fixture,!skipper/tenant"])
            .await;
        let pods: Vec<Value> = list["items"]
            .as_array()?
            .iter()
            .filter(|p| ready(p))
            .cloned()
            .collect();
        (pods.len() == n).then_some(pods)
    })
    .await
}

fn write(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

#[tokio::test]
async fn kubectl_drives_a_fixture_pool_against_skipper_dev_apiserver() {
    if !common::kubectl_available() {
        eprintln!("SKIPPED: kubectl is not installed");
        return;
    }
    let mut api = Apiserver::start().await;
    let (key, pem) = common::keys();
    let manifest = api.path("pool.json");
    let mut deploy = pool_deployment_json("default", "fixture", 3, &pem);
    deploy["metadata"].as_object_mut().unwrap().remove("namespace");
    write(&manifest, &deploy);

    let out = api.ok(&["create", "-f", manifest.to_str().unwrap()]).await;
    assert_eq!(out.trim(), "deployment.apps/fixture created");
    let pods = ready_pool(&api, 3).await;
    let ips: HashSet<&str> = pods
        .iter()
        .map(|p| p["status"]["podIP"].as_str().unwrap())
        .collect();
    assert_eq!(ips.len(), 3);
    for ip in &ips {
        assert!(ip.starts_with("127."));
        assert_eq!(
            skipper_test_support::get_status(format!("http://{ip}:8888/healthz")).await,
            200
        );
    }
    let all_pids: Vec<u32> = pods.iter().map(pid_of).collect();

    // `kubectl get` renders the server's Table.
    let table = api.ok(&["get", "pods"]).await;
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.contains("1/1") && l.contains("Running"))
            .count(),
        3,
        "{table}"
    );
    let d = api.ok(&["get", "deployment", "fixture"]).await;
    assert!(d.lines().nth(1).unwrap().contains("3/3"), "{d}");

    // Assign one pod, then label it as the controller would: the pool refills.
    let pod = pods[0]["metadata"]["name"].as_str().unwrap().to_owned();
    assert_eq!(common::assign(&pods[0], &key, "acme").await, 200);
    let out = api.ok(&["label", "pod", &pod, "skipper/tenant=acme"]).await;
    assert_eq!(out.trim(), format!("pod/{pod} labeled"));
    let refilled = ready_pool(&api, 3).await;
    assert!(refilled.iter().all(|p| p["metadata"]["name"] != pod.as_str()));
    let claimed = api.json(&["get", "pod", &pod]).await;
    assert!(
        claimed["metadata"]["ownerReferences"].is_null(),
        "released by its ReplicaSet"
    );

    let out = api.ok(&["annotate", "pod", &pod, "note=hi"]).await;
    assert_eq!(out.trim(), format!("pod/{pod} annotated"));
    let note = api
        .ok(&["get", "pod", &pod, "-o", "jsonpath={.metadata.annotations.note}"])
        .await;
    assert_eq!(note, "hi");

    // A failing JSON Patch `test` is kubectl's usual "request is invalid" error.
    let test_absent = r#"[{"op":"test","path":"/metadata/labels/skipper~1tenant","value":null}]"#;
    let (ok, _, err) = api
        .kubectl(&["patch", "pod", &pod, "--type=json", "-p", test_absent])
        .await;
    assert!(!ok);
    assert!(
        err.contains("The request is invalid") && err.contains("test failed"),
        "{err}"
    );
    let add = r#"[{"op":"test","path":"/metadata/labels/skipper~1tenant","value":"acme"},{"op":"add","path":"/metadata/annotations/skipper~1ready-at","value":"2026-01-01T00:00:00Z"}]"#;
    let out = api.ok(&["patch", "pod", &pod, "--type=json", "-p", add]).await;
    assert_eq!(out.trim(), format!("pod/{pod} patched"));

    // `kubectl get -w` sees the pods that `kubectl scale` adds.
    let mut watch = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(api.path("kubeconfig"))
        .arg("--cache-dir")
        .arg(api.path("cache"))
        .args(["get", "pods", "-w", "-l", "!skipper/tenant", "--no-headers"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let known: HashSet<String> = refilled
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    let mut seen = 0;
    while seen < known.len() {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(known.iter().any(|n| line.starts_with(n.as_str())), "{line}");
        seen += 1;
    }
    let out = api.ok(&["scale", "deployment/fixture", "--replicas=4"]).await;
    assert_eq!(out.trim(), "deployment.apps/fixture scaled");
    tokio::time::timeout(WAIT, async {
        loop {
            let line = lines.next_line().await.unwrap().unwrap();
            let name = line.split_whitespace().next().unwrap_or("").to_owned();
            if !known.contains(&name) && line.contains("Running") && line.contains("1/1") {
                break;
            }
        }
    })
    .await
    .expect("get -w shows the new pod Running");
    watch.kill().await.unwrap();
    let pool = ready_pool(&api, 4).await;
    let all_pids: Vec<u32> = all_pids.into_iter().chain(pool.iter().map(pid_of)).collect();

    // Deleting a pod stops its process.
    let pid = pid_of(&claimed);
    assert!(common::process_alive(pid));
    let out = api.ok(&["delete", "pod", &pod, "--dry-run=server"]).await;
    assert_eq!(out.trim(), format!("pod \"{pod}\" deleted (server dry run)"));
    assert!(common::process_alive(pid), "a dry run deletes nothing");
    let out = api.ok(&["delete", "pod", &pod]).await;
    assert_eq!(out.trim(), format!("pod \"{pod}\" deleted"));
    let (ok, _, err) = api.kubectl(&["get", "pod", &pod]).await;
    assert!(!ok && err.contains("NotFound"), "{err}");
    assert!(!common::process_alive(pid));

    // Ctrl-C stops the API server and every pod process.
    let server_pid = i32::try_from(api.child.id().unwrap()).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server_pid),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = tokio::time::timeout(WAIT, api.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    assert!(
        all_pids.iter().all(|p| !common::process_alive(*p)),
        "no pod process outlives the server"
    );
}

#[tokio::test]
async fn the_written_kubeconfig_works_for_kube_rs() {
    let api = Apiserver::start().await;
    let kubeconfig = kube::config::Kubeconfig::read_from(api.path("kubeconfig")).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    assert_eq!(config.default_namespace, "default");
    let client = kube::Client::try_from(config).unwrap();
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client);
    let names: Vec<String> = namespaces
        .list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert_eq!(
        names,
        ["default", "kube-node-lease", "kube-public", "kube-system"]
    );
}

#[test]
fn a_busy_address_is_named() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    // The playground checks --listen before starting anything.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
        .args(["dev", "--listen", &addr])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("--listen {addr}")));

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
        .args([
            "dev",
            "apiserver",
            "--listen",
            &addr,
            "--kubeconfig",
            "/nonexistent/kc",
        ])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("listening on {addr}")));
}

#[tokio::test]
async fn every_pod_process_exits_when_the_simulator_is_killed() {
    let mut api = Apiserver::start().await;
    let kubeconfig = kube::config::Kubeconfig::read_from(api.path("kubeconfig")).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let (_, pem) = common::keys();
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(client.clone(), "default");
    deployments
        .create(
            &kube::api::PostParams::default(),
            &skipper_devcluster::pool_deployment("default", "fixture", 2, &pem),
        )
        .await
        .unwrap();
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, "default");
    let pids: Vec<u32> = common::eventually("2 ready pods", WAIT, || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&kube::api::ListParams::default()).await.ok()?;
            let json: Vec<Value> = list
                .items
                .iter()
                .filter_map(|p| serde_json::to_value(p).ok())
                .collect();
            let ready: Vec<u32> = json.iter().filter(|p| ready(p)).map(pid_of).collect();
            (ready.len() == 2).then_some(ready)
        }
    })
    .await;
    assert!(pids.iter().all(|p| common::process_alive(*p)));
    let server_pid = api.child.id().unwrap();
    // Every process of every pod: shims, main processes and their children.
    let tree = common::descendants(server_pid);
    assert!(pids.iter().all(|p| tree.contains(p)), "{pids:?} under {tree:?}");
    api.child.start_kill().unwrap();
    api.child.wait().await.unwrap();
    common::eventually("orphaned pod processes exit", WAIT, || {
        let alive: Vec<u32> = tree
            .iter()
            .copied()
            .filter(|p| common::process_alive(*p))
            .collect();
        async move { alive.is_empty().then_some(()) }
    })
    .await;
    // A killed simulator cannot remove its work directory.
    let prefix = format!("skipper-sim-{server_pid}-");
    for entry in std::fs::read_dir(std::env::temp_dir()).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            std::fs::remove_dir_all(entry.path()).unwrap();
        }
    }
}
