//! The node agent behaves like a kubelet, checked against real processes:
//! probes (gRPC, exec, HTTP, TCP; startup gating; liveness restarts with
//! the crash back-off), restart policies, termination (`preStop` before
//! SIGTERM, SIGTERM to the main process only, SIGKILL at the deadline,
//! graceful namespace deletion), private filesystems and volumes, init and
//! multiple containers, scheduling, and node registration.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, ContainerStatus, Namespace, Node, Pod, PodCondition, Secret};
use kube::api::{
    Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::{Value, json};
use skipper_devcluster::Cluster;
use skipper_test_support::patch;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "conf";
const WAIT: Duration = Duration::from_secs(30);

async fn cluster() -> Cluster {
    common::cluster_with(&[NS], |c| {
        c.volume_resync = Duration::from_millis(200);
        c.node_lease_duration = Duration::from_secs(2);
    })
    .await
}

fn pods(cluster: &Cluster) -> Api<Pod> {
    Api::namespaced(cluster.client().unwrap(), NS)
}

/// A container running `script` with `sh`.
fn sh(name: &str, script: &str) -> Value {
    json!({"name": name, "image": "busybox", "command": ["/bin/sh", "-c", script]})
}

async fn create(api: &Api<Pod>, name: &str, spec: Value) {
    let pod: Pod =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"test": name}}, "spec": spec}))
            .unwrap();
    api.create(&PostParams::default(), &pod).await.unwrap();
}

/// Polls the pod until `check` holds.
async fn wait_pod(api: &Api<Pod>, name: &str, what: &str, check: impl Fn(&Pod) -> bool) -> Pod {
    common::eventually(&format!("{name}: {what}"), WAIT, || {
        let api = api.clone();
        let name = name.to_owned();
        let ok = &check;
        async move {
            let p = api.get_opt(&name).await.ok()??;
            ok(&p).then_some(p)
        }
    })
    .await
}

async fn wait_gone(api: &Api<Pod>, name: &str) {
    common::eventually(&format!("{name} deleted"), WAIT, || {
        let api = api.clone();
        let name = name.to_owned();
        async move { api.get_opt(&name).await.ok()?.is_none().then_some(()) }
    })
    .await;
}

fn status(p: &Pod, container: &str) -> Option<ContainerStatus> {
    let s = p.status.as_ref()?;
    s.container_statuses
        .iter()
        .chain(s.init_container_statuses.iter())
        .flatten()
        .find(|c| c.name == container)
        .cloned()
}

fn condition(p: &Pod, kind: &str) -> Option<PodCondition> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
        .cloned()
}

fn is_ready(p: &Pod) -> bool {
    condition(p, "Ready").is_some_and(|c| c.status == "True")
}

fn running(p: &Pod, container: &str) -> bool {
    status(p, container).is_some_and(|c| c.state.is_some_and(|s| s.running.is_some()))
}

fn waiting_reason(p: &Pod, container: &str) -> Option<String> {
    status(p, container)?.state?.waiting?.reason
}

async fn log(api: &Api<Pod>, pod: &str, container: &str) -> String {
    api.logs(
        pod,
        &LogParams {
            container: Some(container.into()),
            ..LogParams::default()
        },
    )
    .await
    .unwrap_or_default()
}

fn fixture(extra_args: &[&str]) -> Value {
    let (_, pem) = common::keys();
    let mut args: Vec<String> = vec!["fixture".into(), "--log-format".into(), "text".into()];
    args.extend(extra_args.iter().map(|s| (*s).to_owned()));
    json!({"name": "fixture", "image": "skipper", "command": ["skipper"], "args": args,
           "env": [{"name": "SKIPPER_PUBLIC_KEY", "value": pem},
                   {"name": "SKIPPER_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
           "ports": [{"name": "http", "containerPort": 8888}, {"name": "grpc", "containerPort": 9000}]})
}

#[tokio::test]
async fn a_grpc_probe_answering_not_serving_keeps_the_pod_unready() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let grpc_probe = |service: &str| json!({"grpc": {"port": 9000, "service": service}, "periodSeconds": 1, "failureThreshold": 1});
    let with_probe = |status: &str, service: &str| {
        let mut c = fixture(&[
            "--fixture-grpc-health-port",
            "9000",
            "--fixture-grpc-health-status",
            status,
        ]);
        c["readinessProbe"] = grpc_probe(service);
        json!({"containers": [c]})
    };
    create(&api, "not-serving", with_probe("NOT_SERVING", "")).await;
    create(&api, "unknown-service", with_probe("SERVING", "nope")).await;
    create(&api, "serving", with_probe("SERVING", "")).await;
    wait_pod(&api, "serving", "Ready", is_ready).await;
    // A pod started after them is Ready too: by then the others were probed many times.
    create(&api, "control", with_probe("SERVING", "")).await;
    wait_pod(&api, "control", "Ready", is_ready).await;
    for name in ["not-serving", "unknown-service"] {
        let p = api.get(name).await.unwrap();
        assert!(running(&p, "fixture"), "{name} runs");
        assert!(!is_ready(&p), "{name} stays unready");
        assert!(!status(&p, "fixture").unwrap().ready);
        let c = condition(&p, "ContainersReady").unwrap();
        assert_eq!(c.reason.as_deref(), Some("ContainersNotReady"));
        assert_eq!(
            c.message.as_deref(),
            Some("containers with unready status: [fixture]")
        );
    }
}

#[tokio::test]
async fn an_exec_probe_runs_in_the_container_and_exit_1_keeps_it_unready() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let marker = format!("skipper-probe-{:x}", rand::random::<u64>());
    let probe = |cmd: &str| json!({"exec": {"command": ["/bin/sh", "-c", cmd]}, "periodSeconds": 1, "failureThreshold": 1});
    let mut failing = sh("main", "exec sleep 1000");
    failing["readinessProbe"] = probe("exit 1");
    create(&api, "failing", json!({"containers": [failing]})).await;
    // The probe sees the container's own /tmp and environment.
    let mut own = sh("main", &format!("sleep 1; touch /tmp/{marker}; exec sleep 1000"));
    own["env"] = json!([{"name": "MARK", "value": "yes"}]);
    own["readinessProbe"] = probe(&format!("test -f /tmp/{marker} && test \"$MARK\" = yes"));
    create(&api, "own-tmp", json!({"containers": [own]})).await;
    wait_pod(&api, "own-tmp", "Ready", is_ready).await;
    assert!(
        !std::path::Path::new("/tmp").join(&marker).exists(),
        "the container's /tmp is not the host's"
    );
    create(
        &api,
        "control",
        json!({"containers": [{"name": "main", "image": "busybox",
        "command": ["/bin/sh", "-c", "exec sleep 1000"], "readinessProbe": probe("exit 0")}]}),
    )
    .await;
    wait_pod(&api, "control", "Ready", is_ready).await;
    let p = api.get("failing").await.unwrap();
    assert!(running(&p, "main") && !is_ready(&p));
    assert_eq!(
        status(&p, "main").unwrap().restart_count,
        0,
        "readiness never restarts"
    );
}

#[tokio::test]
async fn probe_timing_fields_delay_time_out_and_count_successes() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    // A check slower than timeoutSeconds fails, however it would end (run
    // to its end, this one would pass 2 s in, before "delayed" is Ready).
    let mut slow = sh("main", "exec sleep 1000");
    slow["readinessProbe"] = json!({"exec": {"command": ["/bin/sh", "-c", "sleep 2"]},
        "timeoutSeconds": 1, "periodSeconds": 1, "failureThreshold": 1});
    create(&api, "slow", json!({"containers": [slow]})).await;
    // Nothing is probed before initialDelaySeconds; then successThreshold
    // successes in a row, periodSeconds apart, make it Ready.
    let mut delayed = sh("main", "exec sleep 1000");
    delayed["readinessProbe"] = json!({"exec": {"command": ["/bin/sh", "-c", "exit 0"]},
        "initialDelaySeconds": 2, "periodSeconds": 1, "successThreshold": 2});
    create(&api, "delayed", json!({"containers": [delayed]})).await;
    let p = wait_pod(&api, "delayed", "Ready", is_ready).await;
    let started = status(&p, "main")
        .and_then(|s| s.state?.running?.started_at)
        .expect("running with startedAt");
    let ready = condition(&p, "Ready")
        .and_then(|c| c.last_transition_time)
        .expect("Ready has a transition time");
    // 2 s of delay and 1 s between the two successes (whole seconds).
    assert!(
        ready.0.as_second() - started.0.as_second() >= 2,
        "Ready at {ready:?}, started at {started:?}"
    );
    let p = wait_pod(&api, "slow", "running", |p| running(p, "main")).await;
    assert!(!is_ready(&p), "a timed-out probe is a failure");
    assert_eq!(status(&p, "main").unwrap().restart_count, 0);
}

#[tokio::test]
async fn http_and_tcp_probes_use_named_ports_and_headers() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let mut c = fixture(&[]);
    c["readinessProbe"] = json!({"httpGet": {"path": "/healthz", "port": "http",
        "httpHeaders": [{"name": "X-Probe", "value": "1"}]}, "periodSeconds": 1});
    c["livenessProbe"] = json!({"tcpSocket": {"port": "http"}, "periodSeconds": 1, "failureThreshold": 3});
    create(&api, "web", json!({"containers": [c]})).await;
    let p = wait_pod(&api, "web", "Ready", is_ready).await;
    // An HTTP probe of a path answering 503 (the unassigned echo path) fails.
    let mut c = fixture(&[]);
    c["readinessProbe"] = json!({"httpGet": {"path": "/", "port": 8888}, "periodSeconds": 1});
    create(&api, "unassigned", json!({"containers": [c]})).await;
    wait_pod(&api, "unassigned", "running", |p| running(p, "fixture")).await;
    // Waited for in that order: whatever order the agent starts pods in,
    // the failing probe's pod is running before the check.
    create(&api, "control", json!({"containers": [fixture(&[])]})).await;
    wait_pod(&api, "control", "Ready", is_ready).await;
    let u = api.get("unassigned").await.unwrap();
    assert!(running(&u, "fixture") && !is_ready(&u));
    assert_eq!(status(&p, "fixture").unwrap().restart_count, 0);
}

#[tokio::test]
async fn the_startup_probe_holds_the_other_probes_and_its_failure_restarts() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    // Starts only once the test drops a file into its emptyDir.
    let mut c = sh("main", "exec sleep 1000");
    c["volumeMounts"] = json!([{"name": "gate", "mountPath": "/gate"}]);
    c["startupProbe"] =
        json!({"exec": {"command": ["test", "-f", "/gate/go"]}, "periodSeconds": 1, "failureThreshold": 60});
    c["readinessProbe"] = json!({"exec": {"command": ["true"]}, "periodSeconds": 1});
    c["livenessProbe"] = json!({"exec": {"command": ["true"]}, "periodSeconds": 1});
    create(
        &api,
        "gated",
        json!({"containers": [c], "volumes": [{"name": "gate", "emptyDir": {}}]}),
    )
    .await;
    let p = wait_pod(&api, "gated", "running", |p| running(p, "main")).await;
    let s = status(&p, "main").unwrap();
    assert_eq!(
        (s.started, s.ready),
        (Some(false), false),
        "not started, so not ready"
    );
    let gate = cluster.pod_dir(NS, "gated").unwrap().join("volumes/gate/go");
    std::fs::write(&gate, "").unwrap();
    let p = wait_pod(&api, "gated", "started and Ready", is_ready).await;
    assert_eq!(status(&p, "main").unwrap().started, Some(true));

    let mut c = sh("main", "trap 'exit 143' TERM; sleep 1000 & wait");
    c["startupProbe"] = json!({"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2});
    create(&api, "never-starts", json!({"containers": [c]})).await;
    let p = wait_pod(&api, "never-starts", "restarted", |p| {
        status(p, "main").is_some_and(|s| s.restart_count >= 1)
    })
    .await;
    assert!(!is_ready(&p));
}

#[tokio::test]
async fn a_failing_liveness_probe_restarts_the_container_with_a_growing_back_off() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let mut c = sh("main", "trap 'exit 143' TERM; sleep 1000 & wait");
    // The first probe waits a second: a SIGTERM that reaches the shell (the
    // container's first process) before it has run its `trap` is ignored, and
    // the container would then live out the pod's 30 s grace.
    c["livenessProbe"] = json!({
        "exec": {"command": ["false"]},
        "initialDelaySeconds": 1,
        "periodSeconds": 1,
        "failureThreshold": 1,
    });
    // Every version the node agent publishes, from the pod's creation: the
    // states between restarts last a few hundred milliseconds at test
    // scale, too short for polling to see them on a loaded machine.
    let rv = skipper_test_support::list_version(&api).await;
    let mut events = api
        .watch(&WatchParams::default().fields("metadata.name=unhealthy"), &rv)
        .await
        .unwrap()
        .boxed();
    create(&api, "unhealthy", json!({"containers": [c]})).await;
    let message = |p: &Pod| status(p, "main")?.state?.waiting?.message;
    let mut seen: Vec<Pod> = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(ev) = events.next().await {
            if let WatchEvent::Added(p) | WatchEvent::Modified(p) = ev.unwrap() {
                let done = message(&p).is_some_and(|m| m.starts_with("back-off 1s "));
                seen.push(p);
                if done {
                    return;
                }
            }
        }
        panic!("the watch ended before a back-off of 1s");
    })
    .await
    .unwrap_or_else(|_| panic!("timed out after {WAIT:?} waiting for a back-off of 1s; saw {seen:#?}"));

    // The first restart: the probe's SIGTERM ended the container (its trap exits 143).
    let first = seen
        .iter()
        .find_map(|p| status(p, "main").filter(|s| s.restart_count == 1))
        .expect("a version with restartCount 1");
    let last = first.last_state.unwrap().terminated.unwrap();
    assert_eq!(last.exit_code, 143, "SIGTERM ended it (its trap exits 143)");
    assert_eq!(last.reason.as_deref(), Some("Error"));
    // Then CrashLoopBackOff, each wait longer than the one before (test scale: 500ms, 1s, 2s).
    let mut back_offs: Vec<String> = seen
        .iter()
        .filter(|p| waiting_reason(p, "main").as_deref() == Some("CrashLoopBackOff"))
        .filter_map(message)
        .collect();
    back_offs.dedup();
    assert!(
        back_offs[0].starts_with("back-off 500ms restarting failed container=main pod=unhealthy_conf("),
        "{back_offs:?}"
    );
    assert!(
        back_offs.last().unwrap().starts_with("back-off 1s "),
        "{back_offs:?}"
    );
    let second = seen.last().unwrap();
    assert!(status(second, "main").unwrap().restart_count >= 2);
    assert_eq!(second.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
}

#[tokio::test]
async fn restart_policies_decide_what_runs_again() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    create(
        &api,
        "once-ok",
        json!({"restartPolicy": "OnFailure", "containers": [sh("main", "exit 0")]}),
    )
    .await;
    create(
        &api,
        "retry",
        json!({"restartPolicy": "OnFailure", "containers": [sh("main", "exit 3")]}),
    )
    .await;
    create(&api, "always", json!({"containers": [sh("main", "exit 0")]})).await;
    let p = wait_pod(&api, "once-ok", "Succeeded", |p| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
    })
    .await;
    let s = status(&p, "main").unwrap();
    assert_eq!(s.restart_count, 0);
    assert_eq!(
        s.state.unwrap().terminated.unwrap().reason.as_deref(),
        Some("Completed")
    );
    assert_eq!(
        condition(&p, "Ready").unwrap().reason.as_deref(),
        Some("PodCompleted")
    );
    for name in ["retry", "always"] {
        let p = wait_pod(&api, name, "restarted twice", |p| {
            status(p, "main").is_some_and(|s| s.restart_count >= 2)
        })
        .await;
        assert_eq!(p.status.unwrap().phase.as_deref(), Some("Running"), "{name}");
    }
}

#[tokio::test]
async fn pre_stop_runs_before_sigterm_and_only_the_main_process_gets_sigterm() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    // The main process and a child both trap TERM; only the main one may see it.
    let script = r#"trap 'echo main-term >> /out/log; exit 0' TERM
sh -c 'trap "echo child-term >> /out/log" TERM; sleep 1000 & wait' &
echo started >> /out/log
wait"#;
    let mut c = sh("main", script);
    c["volumeMounts"] = json!([{"name": "out", "mountPath": "/out"}]);
    c["lifecycle"] = json!({"preStop": {"exec": {"command": ["/bin/sh", "-c", "echo prestop >> /out/log"]}}});
    create(
        &api,
        "hooked",
        json!({"terminationGracePeriodSeconds": 10, "containers": [c], "volumes": [{"name": "out", "emptyDir": {}}]}),
    )
    .await;
    wait_pod(&api, "hooked", "running", |p| running(p, "main")).await;
    let log_file = cluster.pod_dir(NS, "hooked").unwrap().join("volumes/out/log");
    common::eventually("started", WAIT, || {
        let text = std::fs::read_to_string(&log_file).unwrap_or_default();
        async move { text.contains("started").then_some(()) }
    })
    .await;
    let pid = cluster.pod_pid(NS, "hooked").unwrap();
    api.delete("hooked", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "hooked").await;
    assert!(!common::process_alive(pid));
    let lines: Vec<String> = std::fs::read_to_string(&log_file)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(lines, ["started", "prestop", "main-term"], "no child-term");

    // An httpGet preStop hook (host, port, path and headers as sent) is
    // answered before the main process gets SIGTERM.
    let hook = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_port = hook.local_addr().unwrap().port();
    let mut c = sh(
        "main",
        "trap 'echo main-term >> /out/log; exit 0' TERM; echo started >> /out/log; sleep 1000 & wait",
    );
    c["volumeMounts"] = json!([{"name": "out", "mountPath": "/out"}]);
    c["lifecycle"] = json!({"preStop": {"httpGet": {"host": "127.0.0.1", "port": hook_port,
        "path": "/drain", "httpHeaders": [{"name": "X-Hook", "value": "pre-stop"}]}}});
    create(
        &api,
        "http-hooked",
        json!({"terminationGracePeriodSeconds": 10, "containers": [c], "volumes": [{"name": "out", "emptyDir": {}}]}),
    )
    .await;
    wait_pod(&api, "http-hooked", "running", |p| running(p, "main")).await;
    let log_file = cluster
        .pod_dir(NS, "http-hooked")
        .unwrap()
        .join("volumes/out/log");
    common::eventually("started", WAIT, || {
        let text = std::fs::read_to_string(&log_file).unwrap_or_default();
        async move { text.contains("started").then_some(()) }
    })
    .await;
    api.delete("http-hooked", &DeleteParams::default()).await.unwrap();
    let (mut conn, _) = tokio::time::timeout(WAIT, hook.accept()).await.unwrap().unwrap();
    let mut request = Vec::new();
    let mut buf = [0_u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(WAIT, conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the hook request ended early");
        request.extend_from_slice(&buf[..n]);
    }
    let request = String::from_utf8_lossy(&request).to_lowercase();
    assert!(request.starts_with("get /drain http/1.1\r\n"), "{request}");
    assert!(request.contains("x-hook: pre-stop\r\n"), "{request}");
    // The container is still running while the hook is being answered.
    let before_answer = std::fs::read_to_string(&log_file).unwrap();
    assert_eq!(before_answer, "started\n", "SIGTERM waits for the hook");
    conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    drop(conn);
    wait_gone(&api, "http-hooked").await;
    assert_eq!(
        std::fs::read_to_string(&log_file).unwrap(),
        "started\nmain-term\n"
    );

    // A preStop sleep counts against the grace period, and a main process
    // that ignores SIGTERM (PID 1 without a handler) is killed at the deadline.
    let mut c = sh("main", "sleep 1000 & wait");
    c["lifecycle"] = json!({"preStop": {"sleep": {"seconds": 1}}});
    create(
        &api,
        "stubborn",
        json!({"terminationGracePeriodSeconds": 2, "containers": [c]}),
    )
    .await;
    wait_pod(&api, "stubborn", "running", |p| running(p, "main")).await;
    let pid = cluster.pod_pid(NS, "stubborn").unwrap();
    let begin = tokio::time::Instant::now();
    api.delete("stubborn", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "stubborn").await;
    let took = begin.elapsed();
    assert!(!common::process_alive(pid));
    assert!(
        took >= Duration::from_secs(2),
        "the preStop sleep, then at least 2 s of grace: {took:?}"
    );
}

#[tokio::test]
async fn two_pods_writing_the_same_tmp_file_do_not_see_each_other() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let name = format!("skipper-x-{:x}", rand::random::<u64>());
    let script = format!(
        "if [ -e /tmp/{name} ]; then echo SAW; fi; echo $HOSTNAME > /tmp/{name}; echo WROTE; exec sleep 1000"
    );
    create(&api, "first", json!({"containers": [sh("main", &script)]})).await;
    common::eventually("first wrote", WAIT, || {
        let api = api.clone();
        async move { log(&api, "first", "main").await.contains("WROTE").then_some(()) }
    })
    .await;
    create(&api, "second", json!({"containers": [sh("main", &script)]})).await;
    let second = common::eventually("second wrote", WAIT, || {
        let api = api.clone();
        async move {
            let l = log(&api, "second", "main").await;
            l.contains("WROTE").then_some(l)
        }
    })
    .await;
    assert!(!second.contains("SAW"), "second saw first's file: {second}");
    assert!(
        !std::path::Path::new("/tmp").join(&name).exists(),
        "nothing on the host's /tmp"
    );
    let first_tmp = cluster
        .pod_dir(NS, "first")
        .unwrap()
        .join("containers/main/tmp")
        .join(&name);
    assert_eq!(std::fs::read_to_string(first_tmp).unwrap().trim(), "first");
}

#[tokio::test]
async fn secret_and_config_map_volumes_hold_their_bytes_and_follow_updates() {
    let cluster = cluster().await;
    let client = cluster.client().unwrap();
    let api = pods(&cluster);
    let blob: Vec<u8> = (0..=255).collect();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let mut secret = Secret::default();
    secret.metadata.name = Some("s".into());
    secret.data = Some(
        [
            ("blob".to_owned(), k8s_openapi::ByteString(blob.clone())),
            ("other".to_owned(), k8s_openapi::ByteString(b"x".to_vec())),
        ]
        .into(),
    );
    secrets.create(&PostParams::default(), &secret).await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"k": "one"}})).unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    let script = "cp /etc/s/bin/blob /out/blob; stat -c '%a' /etc/s/bin/blob; ls /etc/s; readlink /etc/c/k; \
                  echo READY; while :; do cat /etc/c/k > /out/k; sleep 0.1; done";
    let mut c = sh("main", script);
    c["volumeMounts"] = json!([
        {"name": "secret", "mountPath": "/etc/s"},
        {"name": "config", "mountPath": "/etc/c"},
        {"name": "out", "mountPath": "/out"},
    ]);
    create(
        &api,
        "vols",
        json!({"containers": [c], "volumes": [
            {"name": "secret", "secret": {"secretName": "s", "items": [{"key": "blob", "path": "bin/blob", "mode": 256}]}},
            {"name": "config", "configMap": {"name": "c"}},
            {"name": "out", "emptyDir": {}},
        ]}),
    )
    .await;
    let text = common::eventually("volumes read", WAIT, || {
        let api = api.clone();
        async move {
            let l = log(&api, "vols", "main").await;
            l.contains("READY").then_some(l)
        }
    })
    .await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[..3], ["400", "bin", "..data/k"], "{text}");
    let dir = cluster.pod_dir(NS, "vols").unwrap().join("volumes");
    assert_eq!(std::fs::read(dir.join("out/blob")).unwrap(), blob, "exact bytes");
    let k = dir.join("out/k");
    common::eventually("the config map's value", WAIT, || {
        let v = std::fs::read_to_string(&k).unwrap_or_default();
        async move { (v == "one").then_some(()) }
    })
    .await;
    patch(&cms, "c", Patch::Merge(json!({"data": {"k": "two"}}))).await;
    common::eventually("the update reaches the container", WAIT, || {
        let v = std::fs::read_to_string(&k).unwrap_or_default();
        async move { (v == "two").then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn downward_api_and_projected_volumes_and_sub_paths() {
    let cluster = cluster().await;
    let client = cluster.client().unwrap();
    let api = pods(&cluster);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"a": "A", "b": "B"}})).unwrap();
    cms.create(&PostParams::default(), &cm).await.unwrap();
    let mut c = sh(
        "main",
        "for f in /info/name /info/labels /all/a /all/ns /only-b /deep/new/dir/b; do cat $f; echo; done; echo READY; exec sleep 1000",
    );
    c["volumeMounts"] = json!([
        {"name": "info", "mountPath": "/info"},
        {"name": "all", "mountPath": "/all"},
        {"name": "config", "mountPath": "/only-b", "subPath": "b"},
        {"name": "config", "mountPath": "/deep/new/dir"},
    ]);
    create(
        &api,
        "downward",
        json!({"containers": [c], "volumes": [
            {"name": "info", "downwardAPI": {"items": [
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            ]}},
            {"name": "all", "projected": {"sources": [
                {"configMap": {"name": "c", "items": [{"key": "a", "path": "a"}]}},
                {"downwardAPI": {"items": [{"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]}},
            {"name": "config", "configMap": {"name": "c"}},
        ]}),
    )
    .await;
    let text = common::eventually("volumes read", WAIT, || {
        let api = api.clone();
        async move {
            let l = log(&api, "downward", "main").await;
            l.contains("READY").then_some(l)
        }
    })
    .await;
    // Field files hold the bare value (no newline); label files one `k="v"` line each.
    assert_eq!(
        text, "downward\ntest=\"downward\"\n\nA\nconf\nB\nB\nREADY\n",
        "{text}"
    );
    assert!(
        !std::path::Path::new("/deep").exists(),
        "mount points are made inside the pod only"
    );
}

#[tokio::test]
async fn init_containers_run_in_order_before_the_others_and_their_work_is_seen() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let mount = json!([{"name": "work", "mountPath": "/work"}]);
    let mut init1 = sh("init1", "echo hello > /work/msg");
    init1["volumeMounts"] = mount.clone();
    // The second waits until the test lets it finish.
    let mut init2 = sh(
        "init2",
        "until [ -e /work/go ]; do sleep 0.1; done; echo world >> /work/msg",
    );
    init2["volumeMounts"] = mount.clone();
    let mut main = sh("main", "cat /work/msg; exec sleep 1000");
    main["volumeMounts"] = mount;
    create(
        &api,
        "inits",
        json!({"initContainers": [init1, init2], "containers": [main],
               "volumes": [{"name": "work", "emptyDir": {}}]}),
    )
    .await;
    let p = wait_pod(&api, "inits", "init2 running", |p| running(p, "init2")).await;
    assert_eq!(p.status.as_ref().unwrap().phase.as_deref(), Some("Pending"));
    let init = condition(&p, "Initialized").unwrap();
    assert_eq!(init.status, "False");
    assert_eq!(init.reason.as_deref(), Some("ContainersNotInitialized"));
    assert_eq!(
        init.message.as_deref(),
        Some("containers with incomplete status: [init2]")
    );
    assert_eq!(waiting_reason(&p, "main").as_deref(), Some("PodInitializing"));
    let first = status(&p, "init1").unwrap().state.unwrap().terminated.unwrap();
    assert_eq!((first.exit_code, first.reason.as_deref()), (0, Some("Completed")));
    std::fs::write(cluster.pod_dir(NS, "inits").unwrap().join("volumes/work/go"), "").unwrap();
    let p = wait_pod(&api, "inits", "Ready", is_ready).await;
    assert_eq!(condition(&p, "Initialized").unwrap().status, "True");
    let text = common::eventually("main printed", WAIT, || {
        let api = api.clone();
        async move {
            let l = log(&api, "inits", "main").await;
            (!l.is_empty()).then_some(l)
        }
    })
    .await;
    assert_eq!(text, "hello\nworld\n");
}

#[tokio::test]
async fn every_container_runs_and_ready_counts_them_truthfully() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let mut a = sh("a", "exec sleep 1000");
    a["readinessProbe"] = json!({"exec": {"command": ["true"]}, "periodSeconds": 1});
    let mut b = sh("b", "exec sleep 1000");
    b["readinessProbe"] = json!({"exec": {"command": ["false"]}, "periodSeconds": 1});
    let sidecar = json!({"name": "side", "image": "busybox", "restartPolicy": "Always",
                         "command": ["/bin/sh", "-c", "exec sleep 1000"]});
    create(
        &api,
        "multi",
        json!({"initContainers": [sidecar], "containers": [a, b]}),
    )
    .await;
    let p = wait_pod(&api, "multi", "a ready", |p| {
        status(p, "a").is_some_and(|s| s.ready)
    })
    .await;
    assert!(running(&p, "b") && running(&p, "side"));
    assert!(!is_ready(&p));
    assert_eq!(
        condition(&p, "ContainersReady").unwrap().message.as_deref(),
        Some("containers with unready status: [b]")
    );
    assert!(cluster.pod_pids().len() >= 3, "each container is a process");
    // kubectl's READY column: 2 of 3 (the sidecar counts).
    let table = common::api_get_as(
        &cluster,
        &format!("/api/v1/namespaces/{NS}/pods/multi"),
        "application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    .await;
    let http = common::api_http(&cluster);
    assert_eq!(table["rows"][0]["cells"][1], "2/3", "{table}");
    let logs = http
        .get(format!(
            "{}/api/v1/namespaces/{NS}/pods/multi/log",
            cluster.base_url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(logs.status(), 400, "several containers: one must be named");
    assert!(
        logs.text()
            .await
            .unwrap()
            .contains("a container name must be specified for pod multi, choose one of: [a b]")
    );
}

#[tokio::test]
async fn pods_that_fit_nowhere_stay_pending_with_the_schedulers_reason() {
    let cluster = cluster().await;
    let client = cluster.client().unwrap();
    let api = pods(&cluster);
    let pending = |p: &Pod| {
        let c = condition(p, "PodScheduled")?;
        (c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
            .then(|| c.message.unwrap_or_default())
    };
    create(
        &api,
        "nowhere",
        json!({"nodeSelector": {"topology.kubernetes.io/zone": "zone-x"},
        "containers": [sh("main", "exec sleep 1000")]}),
    )
    .await;
    let p = wait_pod(&api, "nowhere", "unschedulable", |p| pending(p).is_some()).await;
    assert_eq!(
        pending(&p).unwrap(),
        "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. \
         preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
    );
    assert_eq!(p.status.unwrap().phase.as_deref(), Some("Pending"));
    let mut big = sh("main", "exec sleep 1000");
    big["resources"] = json!({"requests": {"cpu": "1000"}});
    create(&api, "huge", json!({"containers": [big]})).await;
    let p = wait_pod(&api, "huge", "unschedulable", |p| pending(p).is_some()).await;
    assert_eq!(
        pending(&p).unwrap(),
        "0/3 nodes are available: 3 Insufficient cpu. \
         preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod."
    );
    // A matching selector lands on that zone's node.
    create(
        &api,
        "zone-b",
        json!({"nodeSelector": {"topology.kubernetes.io/zone": "zone-b"},
        "containers": [sh("main", "exec sleep 1000")]}),
    )
    .await;
    let p = wait_pod(&api, "zone-b", "running", |p| running(p, "main")).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .get(p.spec.unwrap().node_name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        node.metadata.labels.unwrap()["topology.kubernetes.io/zone"],
        "zone-b"
    );
    // Cordoned nodes take nothing new; uncordoned, the pod runs.
    for n in nodes.list(&ListParams::default()).await.unwrap().items {
        nodes
            .patch(
                n.metadata.name.as_deref().unwrap(),
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"unschedulable": true}})),
            )
            .await
            .unwrap();
    }
    create(
        &api,
        "cordoned",
        json!({"containers": [sh("main", "exec sleep 1000")]}),
    )
    .await;
    let p = wait_pod(&api, "cordoned", "unschedulable", |p| pending(p).is_some()).await;
    assert!(
        pending(&p)
            .unwrap()
            .starts_with("0/3 nodes are available: 3 node(s) were unschedulable.")
    );
    nodes
        .patch(
            "sim-node-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": false}})),
        )
        .await
        .unwrap();
    let p = wait_pod(&api, "cordoned", "running", |p| running(p, "main")).await;
    assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some("sim-node-0"));
    assert_eq!(condition(&p, "PodScheduled").unwrap().status, "True");
}

#[tokio::test]
async fn deleting_a_namespace_terminates_its_pods_gracefully() {
    let cluster = cluster().await;
    let client = cluster.client().unwrap();
    cluster.create_namespace("doomed").unwrap();
    let api: Api<Pod> = Api::namespaced(client.clone(), "doomed");
    let mut c = sh(
        "main",
        "trap 'sleep 1; echo term >> /out/log; exit 0' TERM; echo up >> /out/log; sleep 1000 & wait",
    );
    c["volumeMounts"] = json!([{"name": "out", "mountPath": "/out"}]);
    create(
        &api,
        "p",
        json!({"containers": [c], "volumes": [{"name": "out", "emptyDir": {}}]}),
    )
    .await;
    wait_pod(&api, "p", "running", |p| running(p, "main")).await;
    let log_file = cluster.pod_dir("doomed", "p").unwrap().join("volumes/out/log");
    common::eventually("up", WAIT, || {
        let t = std::fs::read_to_string(&log_file).unwrap_or_default();
        async move { t.contains("up").then_some(()) }
    })
    .await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    let ns = namespaces.get("doomed").await.unwrap();
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Terminating"));
    // The namespace controller deletes the content (pods gracefully).
    common::eventually("the pod terminating", WAIT, || {
        let api = api.clone();
        async move { api.get("p").await.ok()?.metadata.deletion_timestamp.map(|_| ()) }
    })
    .await;
    let err = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "late"},
            "spec": {"containers": [sh("main", "true")]}}))
            .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(s) if s.code == 403),
        "a terminating namespace takes nothing new"
    );
    common::eventually("namespace gone", WAIT, || {
        let namespaces = namespaces.clone();
        async move { namespaces.get_opt("doomed").await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(&log_file).unwrap(),
        "up\nterm\n",
        "SIGTERM, then time to finish"
    );
}

#[tokio::test]
async fn the_agent_registers_its_nodes_and_renews_their_leases() {
    let cluster = cluster().await;
    let client = cluster.client().unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(list.len(), 3);
    for (i, n) in list.iter().enumerate() {
        let labels = n.metadata.labels.clone().unwrap();
        assert_eq!(labels["kubernetes.io/hostname"], format!("sim-node-{i}"));
        assert_eq!(
            labels["topology.kubernetes.io/zone"],
            ["zone-a", "zone-b", "zone-c"][i]
        );
        let status = n.status.clone().unwrap();
        let ready = status
            .conditions
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_deref()),
            ("True", Some("KubeletReady"))
        );
        assert_eq!(status.addresses.unwrap()[0].type_, "InternalIP");
        assert!(status.allocatable.unwrap().contains_key("cpu"));
    }
    let leases: Api<Lease> = Api::namespaced(client, "kube-node-lease");
    let renewed = |name: &'static str| {
        let leases = leases.clone();
        async move {
            let l = leases.get_opt(name).await.ok()??;
            let spec = l.spec?;
            Some((spec.holder_identity?, spec.renew_time?))
        }
    };
    let (holder, first) = common::eventually("a lease", WAIT, || renewed("sim-node-1")).await;
    assert_eq!(holder, "sim-node-1");
    common::eventually("the lease renewed", WAIT, || {
        let first = first.clone();
        let next = renewed("sim-node-1");
        async move { next.await.filter(|(_, t)| *t != first).map(drop) }
    })
    .await;
}

#[tokio::test]
async fn pods_get_their_service_account_identity_and_the_in_cluster_environment() {
    let cluster = cluster().await;
    let api = pods(&cluster);
    let dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    let script = format!(
        "ls {dir}; cat {dir}/namespace; echo; echo \"$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT\"; echo READY; exec sleep 1000"
    );
    create(&api, "identity", json!({"containers": [sh("main", &script)]})).await;
    create(
        &api,
        "anonymous",
        json!({"automountServiceAccountToken": false, "containers": [sh("main", &format!("ls {dir}; echo READY; exec sleep 1000"))]}),
    )
    .await;
    let read = |name: &'static str| {
        let api = api.clone();
        common::eventually(name, WAIT, move || {
            let api = api.clone();
            async move {
                let l = log(&api, name, "main").await;
                l.contains("READY").then_some(l)
            }
        })
    };
    let text = read("identity").await;
    assert_eq!(
        text,
        format!(
            "ca.crt\nnamespace\ntoken\n{NS}\n127.0.0.1:{}\nREADY\n",
            cluster.addr().port()
        )
    );
    assert!(
        !read("anonymous").await.contains("token"),
        "automountServiceAccountToken: false"
    );
    // The token is the pod's ServiceAccount's, issued through TokenRequest.
    let p = api.get("identity").await.unwrap();
    let volume = p.spec.unwrap().volumes.unwrap()[0].name.clone();
    assert!(volume.starts_with("kube-api-access-"));
    let token_file = cluster
        .pod_dir(NS, "identity")
        .unwrap()
        .join("volumes")
        .join(&volume)
        .join("token");
    let token = std::fs::read_to_string(token_file).unwrap();
    let ca = std::fs::read_to_string(
        cluster
            .pod_dir(NS, "identity")
            .unwrap()
            .join("volumes")
            .join(&volume)
            .join("ca.crt"),
    )
    .unwrap();
    assert_eq!(ca, cluster.ca_pem());
    let http = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .build()
        .unwrap();
    let review: Value = http
        .post(format!(
            "{}/apis/authentication.k8s.io/v1/selfsubjectreviews",
            cluster.base_url()
        ))
        .bearer_auth(token.trim())
        .json(&json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        review["status"]["userInfo"]["username"],
        format!("system:serviceaccount:{NS}:default"),
        "{review}"
    );
}
