//! The fixture pool in the simulator: Deployment → ReplicaSet → real fixture
//! processes on distinct loopback IPs; the claim patch of spec §4.4 (exactly
//! one concurrent claim wins); released pods are replaced; deletion, crashes
//! (restarted in place), rollouts, env wiring, EndpointSlices, pod metrics
//! and process cleanup.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams, WatchEvent};
use serde_json::{Value, json};
use skipper_devcluster::{Cluster, pool_deployment, pool_deployment_json};
use skipper_test_support::patch;

const NS: &str = "fixtures";
const WAIT: Duration = Duration::from_secs(20);

/// Waits until the pool has `n` Ready, unassigned pods and returns them.
async fn ready_pool(cluster: &Cluster, n: usize) -> Vec<Value> {
    let pods = cluster
        .wait_ready_pods(NS, "skipper/deployment=fixture,!skipper/tenant", n, WAIT)
        .await
        .unwrap();
    assert_eq!(pods.len(), n, "no more than {n} ready pool pods");
    pods
}

async fn start_pool(replicas: i32) -> (Cluster, kube::Client, skipper::token::SigningKey) {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    let (key, pem) = common::keys();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(
            &PostParams::default(),
            &pool_deployment(NS, "fixture", replicas, &pem),
        )
        .await
        .unwrap();
    (cluster, client, key)
}

fn ip_of(pod: &Value) -> String {
    pod["status"]["podIP"].as_str().unwrap().to_owned()
}

fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap().to_owned()
}

/// The claim patch of spec §4.4, in its exact order.
fn claim_patch(tenant: &str) -> Patch<()> {
    let function = common::function_json(tenant);
    let ops = json!([
        {"op": "test", "path": "/metadata/ownerReferences/0/kind", "value": "ReplicaSet"},
        {"op": "test", "path": "/metadata/labels/skipper~1tenant", "value": null},
        {"op": "test", "path": "/metadata/annotations/skipper~1function", "value": null},
        {"op": "test", "path": "/metadata/annotations/skipper~1assigned-at", "value": null},
        {"op": "copy", "path": "/metadata/annotations/skipper~1replica-set", "from": "/metadata/ownerReferences/0/name"},
        {"op": "add", "path": "/metadata/labels/skipper~1tenant", "value": tenant},
        {"op": "add", "path": "/metadata/annotations/skipper~1function", "value": function},
        {"op": "add", "path": "/metadata/annotations/skipper~1assigned-at", "value": "2026-01-01T00:00:00Z"},
    ]);
    Patch::Json(serde_json::from_value(ops).unwrap())
}

fn field_manager() -> PatchParams {
    PatchParams {
        field_manager: Some("skipper/controller".into()),
        ..PatchParams::default()
    }
}

#[tokio::test]
async fn a_pool_comes_up_ready_on_distinct_loopback_ips_and_answers_healthz() {
    let (cluster, client, _) = start_pool(3).await;
    let pods = ready_pool(&cluster, 3).await;
    let ips: HashSet<String> = pods.iter().map(ip_of).collect();
    assert_eq!(ips.len(), 3, "distinct IPs: {ips:?}");
    for ip in &ips {
        assert!(ip.starts_with("127.") && ip != "127.0.0.1");
        let resp = reqwest::get(format!("http://{ip}:8888/healthz")).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(
            reqwest::get(format!("http://{ip}:8888/")).await.unwrap().status(),
            503
        );
    }
    for pod in &pods {
        assert_eq!(pod["status"]["phase"], "Running");
        assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "ReplicaSet");
        assert!(pod["spec"]["nodeName"].as_str().unwrap().starts_with("sim-node-"));
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let d = common::eventually("deployment status", WAIT, || {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get("fixture").await.ok()?;
            (d.status.as_ref()?.ready_replicas == Some(3)).then_some(d)
        }
    })
    .await;
    assert_eq!(d.status.unwrap().replicas, Some(3));

    // metrics.k8s.io reports the real processes' memory.
    let metrics = common::eventually("pod metrics", WAIT, || {
        let url = format!(
            "{}/apis/metrics.k8s.io/v1beta1/namespaces/{NS}/pods",
            cluster.base_url()
        );
        let http = common::api_http(&cluster);
        async move {
            let v: Value = http.get(url).send().await.ok()?.json().await.ok()?;
            (v["items"].as_array()?.len() == 3).then_some(v)
        }
    })
    .await;
    for item in metrics["items"].as_array().unwrap() {
        let mem = item["containers"][0]["usage"]["memory"].as_str().unwrap();
        let kib: u64 = mem.trim_end_matches("Ki").parse().unwrap();
        assert!(kib > 1024, "a fixture process uses more than 1 MiB: {mem}");
        assert!(
            item["containers"][0]["usage"]["cpu"]
                .as_str()
                .unwrap()
                .ends_with('m')
        );
    }
}

#[tokio::test]
async fn exactly_one_of_two_concurrent_claims_wins_and_the_pool_refills() {
    let (cluster, client, key) = start_pool(3).await;
    let pods = ready_pool(&cluster, 3).await;
    let target = name_of(&pods[0]);
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let (pp, patch) = (field_manager(), claim_patch("acme"));
    let (a, b) = tokio::join!(api.patch(&target, &pp, &patch), api.patch(&target, &pp, &patch));
    let (won, lost) = match (a, b) {
        (Ok(p), Err(e)) | (Err(e), Ok(p)) => (p, e),
        (a, b) => panic!("exactly one claim must win: {a:?} / {b:?}"),
    };
    match lost {
        kube::Error::Api(s) => assert_eq!((s.code, s.reason.as_str()), (422, "Invalid")),
        other => panic!("the losing claim gets 422 Invalid, not {other}"),
    }
    let rs_name = pods[0]["metadata"]["ownerReferences"][0]["name"]
        .as_str()
        .unwrap();
    let annotations = won.metadata.annotations.clone().unwrap();
    assert_eq!(annotations["skipper/replica-set"], rs_name);
    assert_eq!(won.metadata.labels.clone().unwrap()["skipper/tenant"], "acme");

    // The ReplicaSet releases the claimed pod and creates a replacement.
    common::eventually("claimed pod released", WAIT, || {
        let api = api.clone();
        let target = target.clone();
        async move {
            let p = api.get(&target).await.ok()?;
            p.metadata
                .owner_references
                .is_none_or(|r| r.is_empty())
                .then_some(())
        }
    })
    .await;
    let refilled = ready_pool(&cluster, 3).await;
    assert!(refilled.iter().all(|p| name_of(p) != target));

    // The claimed pod accepts its assignment.
    let ip = ip_of(&pods[0]);
    assert_eq!(common::assign(&pods[0], &key, "acme").await, 200);
    let echo: Value = reqwest::get(format!("http://{ip}:8888/hi"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(echo["tenant"], "acme");

    // Busy CPU in the pod shows up in its metrics.
    let burn = tokio::spawn(reqwest::get(format!("http://{ip}:8888/burn?burn_ms=3000")));
    common::eventually("CPU usage reported", WAIT, || {
        let url = format!(
            "{}/apis/metrics.k8s.io/v1beta1/namespaces/{NS}/pods/{target}",
            cluster.base_url()
        );
        let http = common::api_http(&cluster);
        async move {
            let v: Value = http.get(url).send().await.ok()?.json().await.ok()?;
            let cpu: u64 = v["containers"][0]["usage"]["cpu"]
                .as_str()?
                .trim_end_matches('m')
                .parse()
                .ok()?;
            (cpu >= 100).then_some(())
        }
    })
    .await;
    burn.abort();

    // Claiming again fails the test ops.
    let again = api.patch(&target, &field_manager(), &claim_patch("other")).await;
    assert!(matches!(again, Err(kube::Error::Api(s)) if s.code == 422));
}

#[tokio::test]
async fn the_claim_patch_fails_on_a_pod_without_annotations() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    let (_, pem) = common::keys();
    let mut manifest = pool_deployment_json(NS, "fixture", 1, &pem);
    manifest["spec"]["template"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &serde_json::from_value(manifest).unwrap())
        .await
        .unwrap();
    let pods = ready_pool(&cluster, 1).await;
    let api: Api<Pod> = Api::namespaced(client, NS);
    let err = api
        .patch(&name_of(&pods[0]), &field_manager(), &claim_patch("t"))
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 422 && s.reason == "Invalid"));
    let pod = api.get(&name_of(&pods[0])).await.unwrap();
    assert!(
        !pod.metadata.labels.unwrap().contains_key("skipper/tenant"),
        "nothing applied"
    );
}

#[tokio::test]
async fn deleting_a_pod_stops_its_process_and_a_crashed_container_restarts() {
    let (cluster, client, _) = start_pool(2).await;
    let pods = ready_pool(&cluster, 2).await;
    let api: Api<Pod> = Api::namespaced(client.clone(), NS);

    let victim = name_of(&pods[0]);
    let pid = cluster.pod_pid(NS, &victim).unwrap();
    assert!(common::process_alive(pid));
    let rv = skipper_test_support::list_version(&api).await;
    let mut events = api
        .watch(
            &kube::api::WatchParams::default().fields(&format!("metadata.name={victim}")),
            &rv,
        )
        .await
        .unwrap()
        .boxed();
    let deleted = api.delete(&victim, &DeleteParams::default()).await.unwrap();
    let terminating = deleted.left().unwrap();
    assert!(
        terminating.metadata.deletion_timestamp.is_some(),
        "graceful deletion"
    );
    assert_eq!(terminating.metadata.deletion_grace_period_seconds, Some(5));
    // MODIFIED with deletionTimestamp first, DELETED once the process is gone.
    let mut seen = Vec::new();
    while let Some(ev) = tokio::time::timeout(WAIT, events.next()).await.unwrap() {
        match ev.unwrap() {
            WatchEvent::Modified(p) => seen.push(("MODIFIED", p.metadata.deletion_timestamp.is_some())),
            WatchEvent::Deleted(_) => {
                seen.push(("DELETED", true));
                break;
            }
            _ => {}
        }
    }
    assert_eq!(seen.first(), Some(&("MODIFIED", true)));
    assert_eq!(seen.last(), Some(&("DELETED", true)));
    assert!(!common::process_alive(pid), "the process is gone before DELETED");
    common::eventually("pod gone and process stopped", WAIT, || {
        let api = api.clone();
        let victim = victim.clone();
        async move { (api.get_opt(&victim).await.ok()?.is_none() && !common::process_alive(pid)).then_some(()) }
    })
    .await;

    // A crash restarts the container in place (restartPolicy Always): the
    // pod turns unready, then Ready again with restartCount 1 and the crash
    // in lastState; nothing replaces it.
    let fresh = ready_pool(&cluster, 2).await;
    let crashed = name_of(&fresh[0]);
    let pid = cluster.kill_pod_process(NS, &crashed).unwrap();
    let pod = common::eventually("crashed container restarted and Ready", WAIT, || {
        let api = api.clone();
        let crashed = crashed.clone();
        async move {
            let p = api.get(&crashed).await.ok()?;
            let cs = p.status.as_ref()?.container_statuses.as_ref()?.first()?.clone();
            (cs.ready && cs.restart_count == 1).then_some(p)
        }
    })
    .await;
    assert!(!common::process_alive(pid));
    let status = pod.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    let cs = &status.container_statuses.unwrap()[0];
    let last = cs.last_state.as_ref().unwrap().terminated.as_ref().unwrap();
    assert_eq!(last.exit_code, 137, "SIGKILL");
    assert_eq!(last.reason.as_deref(), Some("Error"));
    assert!(cs.state.as_ref().unwrap().running.is_some());
    assert_ne!(cluster.pod_pid(NS, &crashed), Some(pid), "a new process");
    let survivors = ready_pool(&cluster, 2).await;
    let all = api
        .list(&ListParams::default().labels("skipper/deployment=fixture"))
        .await
        .unwrap();
    assert_eq!(all.items.len(), 2, "no replacement for a restarted pod");
    // Over HTTP too.
    let target = name_of(&survivors[0]);
    let resp = common::api_http(&cluster)
        .post(format!("{}/_sim/pods/{NS}/{target}/kill", cluster.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let missing = common::api_http(&cluster)
        .post(format!("{}/_sim/pods/{NS}/nope/kill", cluster.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test]
async fn readiness_follows_the_readiness_probe_after_start() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    let (key, pem) = common::keys();
    // Probe "/": the fixture answers 503 until it is assigned.
    let mut manifest = pool_deployment_json(NS, "fixture", 1, &pem);
    manifest["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = json!("/");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &serde_json::from_value(manifest).unwrap())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let pod = common::eventually("pod running", WAIT, || {
        let pods = pods.clone();
        async move {
            let p = pods
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .next()?;
            p.status.as_ref()?.pod_ip.as_ref()?;
            (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
        }
    })
    .await;
    let name = pod.metadata.name.clone().unwrap();
    let ip = pod.status.clone().unwrap().pod_ip.unwrap();
    let ready = |want: bool| {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let p = pods.get(&name).await.ok()?;
            let r = p
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            (r == want).then_some(())
        }
    };
    common::eventually("fixture listening", WAIT, || {
        let url = format!("http://{ip}:8888/healthz");
        async move { reqwest::get(url).await.ok().map(|_| ()) }
    })
    .await;
    assert!(
        ready(false).await.is_some(),
        "503 from the probe path keeps the pod unready"
    );
    assert_eq!(
        common::assign(&serde_json::to_value(&pod).unwrap(), &key, "t").await,
        200
    );
    common::eventually("ready once the probe path answers 200", WAIT, || ready(true)).await;
    // A frozen process fails the probe (1s timeout) and the pod turns unready; thawed, it recovers.
    let pid = nix::unistd::Pid::from_raw(i32::try_from(cluster.pod_pid(NS, &name).unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    common::eventually("unready while frozen", WAIT, || ready(false)).await;
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    common::eventually("ready again", WAIT, || ready(true)).await;
}

#[tokio::test]
async fn a_recreated_pod_with_the_same_name_starts_with_fresh_volumes() {
    let cluster = common::cluster(&[NS]).await;
    let api: Api<Pod> = Api::namespaced(cluster.client().unwrap(), NS);
    let (key, pem) = common::keys();
    let template = pool_deployment_json(NS, "same", 1, &pem)["spec"]["template"].clone();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "same", "labels": {"app": "same"}},
        "spec": template["spec"],
    }))
    .unwrap();
    for round in 0..2 {
        api.create(&PostParams::default(), &pod).await.unwrap();
        let ready = common::eventually("pod ready", WAIT, || {
            let p = cluster.ready_pods(NS, "app=same");
            async move { p.into_iter().next() }
        })
        .await;
        let ip = ip_of(&ready);
        assert_eq!(
            reqwest::get(format!("http://{ip}:8888/")).await.unwrap().status(),
            503,
            "round {round}: a new pod is unassigned"
        );
        assert_eq!(common::assign(&ready, &key, "t").await, 200);
        // The token went to /tmp, the pool's emptyDir.
        let dir = cluster.pod_dir(NS, "same").unwrap();
        assert!(dir.join("volumes/tmp/token").exists());
        api.delete("same", &DeleteParams::default()).await.unwrap();
        common::eventually("pod gone", WAIT, || {
            let api = api.clone();
            async move { api.get_opt("same").await.ok()?.is_none().then_some(()) }
        })
        .await;
        if round == 0 {
            assert!(
                dir.join("volumes/tmp/token").exists(),
                "a deleted pod's directory stays readable"
            );
        }
    }
}

#[tokio::test]
async fn logs_follow_a_running_pod_until_it_is_deleted() {
    use futures::AsyncBufReadExt as _;
    let (cluster, client, key) = start_pool(1).await;
    let pod = ready_pool(&cluster, 1).await.remove(0);
    let name = name_of(&pod);
    let api: Api<Pod> = Api::namespaced(client, NS);
    let follow = LogParams {
        follow: true,
        ..LogParams::default()
    };
    let mut lines = api.log_stream(&name, &follow).await.unwrap().lines();
    let mut next = async || tokio::time::timeout(WAIT, lines.next()).await.unwrap();
    while !next().await.unwrap().unwrap().contains("fixture listening") {}
    assert_eq!(common::assign(&pod, &key, "followed").await, 200);
    while !next().await.unwrap().unwrap().contains("assigned") {}
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    while next().await.is_some() {}
}

#[tokio::test]
async fn a_pod_with_restart_policy_never_ends_failed_with_its_exit_code() {
    let cluster = common::cluster(&[NS]).await;
    let api: Api<Pod> = Api::namespaced(cluster.client().unwrap(), NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "once"},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": "sh",
            "command": ["/bin/sh", "-c", "exit 3"]}]},
    }))
    .unwrap();
    api.create(&PostParams::default(), &pod).await.unwrap();
    let status = common::eventually("pod failed", WAIT, || {
        let api = api.clone();
        async move {
            let s = api.get("once").await.ok()?.status?;
            (s.phase.as_deref() == Some("Failed")).then_some(s)
        }
    })
    .await;
    let cs = &status.container_statuses.unwrap()[0];
    assert_eq!(
        cs.state.as_ref().unwrap().terminated.as_ref().unwrap().exit_code,
        3
    );
}

#[tokio::test]
async fn a_template_change_rolls_out_a_new_replicaset_and_scales_the_old_to_zero() {
    let (cluster, client, _) = start_pool(2).await;
    let old = ready_pool(&cluster, 2).await;
    let old_rs = old[0]["metadata"]["ownerReferences"][0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let template = json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}});
    patch(&deployments, "fixture", Patch::Strategic(template)).await;
    let new = common::eventually("pods of the new template", WAIT, || {
        let pods = cluster.ready_pods(NS, "skipper/deployment=fixture");
        let old_rs = old_rs.clone();
        async move {
            (pods.len() == 2
                && pods
                    .iter()
                    .all(|p| p["metadata"]["ownerReferences"][0]["name"] != old_rs.as_str()))
            .then_some(pods)
        }
    })
    .await;
    assert!(new.iter().all(|p| p["metadata"]["annotations"]["rev"] == "2"));
    let rs: Api<ReplicaSet> = Api::namespaced(client, NS);
    let old = rs.get(&old_rs).await.unwrap();
    assert_eq!(old.spec.unwrap().replicas, Some(0));
    let all = rs.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), 2);
}

#[tokio::test]
async fn pods_get_their_environment_and_services_get_endpoint_slices() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    let pp = PostParams::default();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    secrets
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "s"}, "stringData": {"token": "hunter2"}}))
                .unwrap(),
        )
        .await
        .unwrap();
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client.clone(), NS);
    cms.create(
        &pp,
        &serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"MODE": "test"}})).unwrap(),
    )
    .await
    .unwrap();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "env", "labels": {"app": "env"}},
        "spec": {"containers": [{
            "name": "main", "image": "sh",
            "command": ["/bin/sh", "-c", "env; echo READY; exec sleep 60"],
            "env": [
                {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                {"name": "DERIVED", "value": "$(MY_NAME)-x"},
            ],
            "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "CM_"}],
        }]},
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(&pp, &pod).await.unwrap();
    let ready = common::eventually("env pod ready", WAIT, || {
        let p = cluster.ready_pods(NS, "app=env");
        async move { p.into_iter().next() }
    })
    .await;
    let ip = ip_of(&ready);
    let log = common::eventually("env printed", WAIT, || {
        let pods = pods.clone();
        async move {
            let log = pods.logs("env", &LogParams::default()).await.ok()?;
            log.contains("READY").then_some(log)
        }
    })
    .await;
    let api_port = cluster.addr().port();
    for want in [
        format!("MY_IP={ip}"),
        "MY_NAME=env".into(),
        "SECRET=hunter2".into(),
        "DERIVED=env-x".into(),
        "CM_MODE=test".into(),
        "HOSTNAME=env".into(),
        "HOME=/root".into(),
        "KUBERNETES_SERVICE_HOST=127.0.0.1".into(),
        format!("KUBERNETES_SERVICE_PORT={api_port}"),
    ] {
        assert!(log.lines().any(|l| l == want), "missing {want} in\n{log}");
    }
    for absent in ["KUBECONFIG=", "POD_DIR=", "SKIPPER_EXIT_WITH_PARENT=", "TMPDIR="] {
        assert!(
            !log.lines().any(|l| l.starts_with(absent)),
            "the runtime adds nothing of its own: {absent} in\n{log}"
        );
    }

    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), NS);
    services
        .create(&pp, &serde_json::from_value(json!({"metadata": {"name": "svc"},
            "spec": {"selector": {"app": "env"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})).unwrap())
        .await
        .unwrap();
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> = Api::namespaced(client, NS);
    let slice = common::eventually("endpoint slice", WAIT, || {
        let slices = slices.clone();
        async move {
            let l = slices
                .list(&ListParams::default().labels("kubernetes.io/service-name=svc"))
                .await
                .ok()?;
            l.items.into_iter().next()
        }
    })
    .await;
    let ep = &slice.endpoints[0];
    assert_eq!(ep.addresses, [ip]);
    assert_eq!(ep.conditions.as_ref().unwrap().ready, Some(true));
    assert!(ep.zone.as_deref().unwrap().starts_with("zone-"));
    assert_eq!(slice.ports.unwrap()[0].port, Some(8080));
}

#[tokio::test]
async fn deleting_a_deployment_or_a_namespace_removes_everything_it_owns() {
    let (cluster, client, _) = start_pool(2).await;
    ready_pool(&cluster, 2).await;
    let pids = cluster.pod_pids();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .delete("fixture", &DeleteParams::default())
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let rs: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    common::eventually("ReplicaSets and pods collected", WAIT, || {
        let (pods, rs) = (pods.clone(), rs.clone());
        let alive = pids.iter().any(|p| common::process_alive(*p));
        async move {
            let p = pods.list(&ListParams::default()).await.ok()?.items.len();
            let r = rs.list(&ListParams::default()).await.ok()?.items.len();
            (p == 0 && r == 0 && !alive).then_some(())
        }
    })
    .await;

    let (_, pem) = common::keys();
    deployments
        .create(&PostParams::default(), &pool_deployment(NS, "fixture", 2, &pem))
        .await
        .unwrap();
    ready_pool(&cluster, 2).await;
    let pids = cluster.pod_pids();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces.delete(NS, &DeleteParams::default()).await.unwrap();
    common::eventually("namespace emptied and processes stopped", WAIT, || {
        let alive = pids.iter().any(|p| common::process_alive(*p));
        let namespaces = namespaces.clone();
        async move { (namespaces.get_opt(NS).await.ok()?.is_none() && !alive).then_some(()) }
    })
    .await;
    let err = deployments.get("fixture").await.unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 404));
}

#[tokio::test]
async fn shutdown_and_drop_stop_every_pod_process() {
    let (cluster, _, _) = start_pool(2).await;
    ready_pool(&cluster, 2).await;
    let pids = cluster.pod_pids();
    assert_eq!(pids.len(), 2);
    cluster.shutdown().await;
    assert!(
        pids.iter().all(|p| !common::process_alive(*p)),
        "shutdown waits for the processes"
    );

    let (cluster, _, _) = start_pool(2).await;
    ready_pool(&cluster, 2).await;
    let pids = cluster.pod_pids();
    drop(cluster);
    common::eventually("processes gone after drop", WAIT, || {
        let alive = pids.iter().any(|p| common::process_alive(*p));
        async move { (!alive).then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn pods_turn_available_when_min_ready_seconds_are_over_not_at_the_next_resync() {
    // A resync far away: only the minReadySeconds wake-up can make the pod
    // available within the wait below.
    let cluster = common::cluster_with(&[NS], |c| c.resync_interval = Duration::from_secs(300)).await;
    let client = cluster.client().unwrap();
    let (_key, pem) = common::keys();
    let mut d = pool_deployment_json(NS, "fixture", 1, &pem);
    d["spec"]["minReadySeconds"] = json!(2);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &serde_json::from_value(d).unwrap())
        .await
        .unwrap();
    let pods = ready_pool(&cluster, 1).await;
    let ready_at = pods[0]["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["lastTransitionTime"].as_str())
        .unwrap()
        .parse::<jiff::Timestamp>()
        .unwrap();
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    // minReadySeconds (2 s) from readiness plus slack for a loaded machine,
    // well short of the resync and of the node heartbeats that also wake
    // the controllers.
    let rs = common::eventually(
        "the ReplicaSet counts its pod available",
        Duration::from_secs(6),
        || async {
            let list = replicasets.list(&ListParams::default()).await.ok()?;
            list.items
                .into_iter()
                .find(|rs| rs.status.as_ref().and_then(|s| s.available_replicas) == Some(1))
        },
    )
    .await;
    let status = rs.status.unwrap();
    assert_eq!(status.ready_replicas, Some(1));
    let now = jiff::Timestamp::now();
    assert!(
        now.duration_since(ready_at) > jiff::SignedDuration::from_secs(2),
        "available only after minReadySeconds: ready at {ready_at}, available by {now}"
    );
    common::eventually("the Deployment is available", WAIT, || async {
        let d = deployments.get("fixture").await.ok()?;
        (d.status?.available_replicas == Some(1)).then_some(())
    })
    .await;
    cluster.shutdown().await;
}
