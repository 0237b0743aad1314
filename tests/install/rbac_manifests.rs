//! Skipper's controller runs as its ServiceAccount under exactly the Roles
//! of `manifests/` (`rbac.yaml` and `example-pool.yaml`), and removing a
//! verb those Roles grant makes a named test fail with 403: the start-up
//! test for the verbs start-up needs, the claim-path test (claim, usage,
//! release, ring changes; it needs pods) for every verb.
//!
//! Each runs against the simulator and the real control plane.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;
use skipper_test_support::differential;
use skipper_test_support::try_eventually;

use std::time::Duration;

use backend::Backend;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::Role;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use skipper::dev::playground::{
    CONTROLLER_YAML, EXAMPLE_POOL_YAML, NAMESPACE_YAML, RBAC_YAML, create_object, manifest_documents,
};
use skipper::shutdown::Shutdown;
use skipper::token::SigningKey;
use tokio::net::TcpListener;

/// The controller's warnings, captured so a failed run can show the API
/// errors (403s) it logged rather than only "not serving".
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Self;
    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

static LOGS: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();

/// Starts capturing warnings (once per test process); the log so far.
fn logs() -> &'static Captured {
    LOGS.get_or_init(|| {
        let captured = Captured::default();
        let _ = tracing_subscriber::fmt()
            .with_writer(captured.clone())
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .try_init();
        captured
    })
}

/// The captured lines since byte `from` that report a refusal.
fn forbidden_lines(from: usize) -> Vec<String> {
    let all = logs().0.lock().unwrap();
    String::from_utf8_lossy(&all[from.min(all.len())..])
        .lines()
        .filter(|l| l.contains("403") || l.to_lowercase().contains("forbidden"))
        .map(str::to_owned)
        .collect()
}

const CTL_NS: &str = "skipper";
const FN_NS: &str = "skipper-functions";
const SA: &str = "skipper-controller";

/// Every object of the manifests except workloads (no node runs pods in
/// this test): namespaces, ServiceAccounts, Roles and RoleBindings.
async fn apply_rbac(b: &Backend) {
    let admin = b.client().await;
    for yaml in [NAMESPACE_YAML, RBAC_YAML, CONTROLLER_YAML, EXAMPLE_POOL_YAML] {
        for doc in manifest_documents(yaml).unwrap() {
            let kind = doc["kind"].as_str().unwrap_or("");
            if matches!(kind, "Namespace" | "ServiceAccount" | "Role" | "RoleBinding") {
                create_object(&admin, &doc).await.unwrap();
            }
        }
    }
}

/// The manifests' RBAC objects ([`apply_rbac`]) and the controller pod that
/// makes a ring of one ([`ready_controller_pod`] on 127.0.0.1).
async fn controller_rbac_and_pod(b: &Backend) {
    apply_rbac(b).await;
    ready_controller_pod(b, "127.0.0.1").await;
}

/// A controller pod in `skipper`, Ready on `ip`, written as a kubelet
/// would report it (the ring's one member).
async fn ready_controller_pod(b: &Backend, ip: &str) {
    ready_controller_pod_named(b, "controller-0", ip).await;
}

/// [`ready_controller_pod`] named `name`.
async fn ready_controller_pod_named(b: &Backend, name: &str, ip: &str) {
    let pods: Api<Pod> = Api::namespaced(b.client().await, CTL_NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {
            "app.kubernetes.io/name": "skipper", "app.kubernetes.io/component": "controller"}},
        // Namespace `skipper` enforces Pod Security `restricted` (manifests/namespace.yaml).
        "spec": {"nodeName": "node-a", "serviceAccountName": SA,
                 "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{"name": "controller", "image": "skipper", "command": ["sleep", "3600"],
                                 "securityContext": {"allowPrivilegeEscalation": false,
                                                     "capabilities": {"drop": ["ALL"]}}}]},
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let now = jiff::Timestamp::now().to_string();
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": now}],
        }})),
    )
    .await
    .unwrap();
}

/// A second Ready controller pod, `controller-joiner` on `ip`.
async fn joining_controller_pod(b: &Backend, ip: &str) {
    ready_controller_pod_named(b, "controller-joiner", ip).await;
}

/// Removes `controller-joiner` at once (no node runs it), if it exists.
async fn leaving_controller_pod(b: &Backend) {
    let pods: Api<Pod> = Api::namespaced(b.client().await, CTL_NS);
    let _ = pods
        .delete(
            "controller-joiner",
            &kube::api::DeleteParams::default().grace_period(0),
        )
        .await;
    backend::eventually(
        "controller-joiner to be gone",
        Duration::from_secs(30),
        || async {
            pods.get_opt("controller-joiner")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
}

/// A controller run as ServiceAccount `skipper/skipper-controller` on a
/// fresh 127.0.0.1 port.
struct AsServiceAccount {
    addr: std::net::SocketAddr,
    /// Answered once the controller serves.
    ready: tokio::sync::oneshot::Receiver<skipper::controller::Running>,
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<Result<(), skipper::controller::RunError>>,
}

/// Starts the controller as its ServiceAccount, signing with `key` and
/// waiting at most `ring_wait` for the hash ring; `tweak` adjusts the rest
/// of its config.
async fn run_as_service_account(
    b: &Backend,
    key: SigningKey,
    ring_wait: Duration,
    tweak: impl FnOnce(&mut skipper::controller::Config),
) -> AsServiceAccount {
    let client = b.service_account_client(CTL_NS, SA).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = skipper::controller::Config::new(CTL_NS, "127.0.0.1", &[FN_NS], key);
    config.port = addr.port();
    config.hash_ring_wait_time = ring_wait;
    tweak(&mut config);
    let shutdown = Shutdown::new();
    let (tx, ready) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(skipper::controller::run(
        config,
        client,
        listener,
        shutdown.clone(),
        move |r| {
            let _ = tx.send(r);
        },
    ));
    AsServiceAccount {
        addr,
        ready,
        shutdown,
        task,
    }
}

/// Stops a controller (`shutdown`, `task`) and turns the `outcome` of a
/// named test into its answer: on failure, why (the controller's own error
/// when it ended with one), with the first refusals it logged since byte
/// `log_start`.
async fn stopped_with(
    outcome: Result<(), String>,
    shutdown: &Shutdown,
    task: tokio::task::JoinHandle<Result<(), skipper::controller::RunError>>,
    log_start: usize,
) -> Result<(), String> {
    shutdown.trigger();
    let ended = tokio::time::timeout(Duration::from_secs(15), task).await;
    let refusals = forbidden_lines(log_start)
        .into_iter()
        .take(3)
        .collect::<Vec<_>>()
        .join("\n");
    match (outcome, ended) {
        (Ok(()), _) => Ok(()),
        (Err(_), Ok(Ok(Err(e)))) => Err(format!("{e}\n{refusals}")),
        (Err(why), _) => Err(format!("{why}\n{refusals}")),
    }
}

/// The named test: the controller, as ServiceAccount `skipper/skipper-controller`,
/// starts, syncs its caches and serves within `limit`. The error says why not.
async fn controller_serves_as_its_service_account(b: &Backend, limit: Duration) -> Result<(), String> {
    let log_start = logs().0.lock().unwrap().len();
    let c = run_as_service_account(b, SigningKey::generate(), limit, |_| {}).await;
    let outcome = tokio::select! {
        r = c.ready => r.map(|_| ()).map_err(|_| "the controller stopped before it served".to_owned()),
        () = tokio::time::sleep(limit) => Err(format!("not serving after {limit:?}")),
    };
    stopped_with(outcome, &c.shutdown, c.task, log_start).await
}

differential!(
    the_controller_serves_under_the_manifest_roles,
    serves_under_manifest_roles,
    namespaces = []
);

async fn serves_under_manifest_roles(b: &Backend) {
    controller_rbac_and_pod(b).await;
    controller_serves_as_its_service_account(b, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Every (namespace, Role, rule, verb) the manifests grant the controller.
async fn controller_grants(b: &Backend) -> Vec<(String, usize, String)> {
    let roles: Api<Role> = Api::namespaced(b.client().await, CTL_NS);
    let mut grants = Vec::new();
    for ns in [CTL_NS, FN_NS] {
        let roles = Api::<Role>::namespaced(roles.clone().into_client(), ns);
        let role = roles.get(SA).await.unwrap();
        for (i, rule) in role.rules.unwrap_or_default().iter().enumerate() {
            for verb in &rule.verbs {
                grants.push((ns.to_owned(), i, verb.clone()));
            }
        }
    }
    grants
}

/// The rules of Role `role` in `ns`, as JSON.
async fn rules_of(b: &Backend, ns: &str, role: &str) -> Value {
    let role = Api::<Role>::namespaced(b.client().await, ns)
        .get(role)
        .await
        .unwrap();
    serde_json::to_value(role.rules.unwrap()).unwrap()
}

/// Replaces the rules of Role `role` in `ns` with `rules`.
async fn set_rules(b: &Backend, ns: &str, role: &str, rules: &Value) {
    Api::<Role>::namespaced(b.client().await, ns)
        .patch(
            role,
            &PatchParams::default(),
            &Patch::Merge(json!({"rules": rules})),
        )
        .await
        .unwrap();
}

/// `rules` without `verb` in rule number `rule` (and without that rule when
/// `verb` was its only one: a rule needs a verb).
fn without_verb(rules: &Value, rule: usize, verb: &str) -> Value {
    let mut reduced = rules.clone();
    let verbs = reduced[rule]["verbs"].as_array_mut().unwrap();
    verbs.retain(|v| v != verb);
    if verbs.is_empty() {
        reduced.as_array_mut().unwrap().remove(rule);
    }
    reduced
}

/// `group/resource` of rule number `rule` of `rules` (its first of each).
fn resource_of(rules: &Value, rule: usize) -> String {
    format!(
        "{}/{}",
        rules[rule]["apiGroups"][0].as_str().unwrap_or(""),
        rules[rule]["resources"][0].as_str().unwrap_or("")
    )
}

/// Runs the named test `named` (`what` it checks) once without each verb
/// the manifests grant the controller, numbering the rounds, and grants the
/// verb again after it: the verbs it passed without (`verb group/resource
/// in namespace`). Where it fails, its error shows a 403.
async fn without_each_verb(
    b: &Backend,
    what: &str,
    mut named: impl AsyncFnMut(usize) -> Result<(), String>,
) -> Vec<String> {
    let mut passed_without = Vec::new();
    for (round, (ns, rule, verb)) in controller_grants(b).await.into_iter().enumerate() {
        let original = rules_of(b, &ns, SA).await;
        set_rules(b, &ns, SA, &without_verb(&original, rule, &verb)).await;
        let result = named(round).await;
        set_rules(b, &ns, SA, &original).await;
        let resource = resource_of(&original, rule);
        match result {
            Ok(()) => passed_without.push(format!("{verb} {resource} in {ns}")),
            Err(e) => {
                assert!(
                    e.contains("403") || e.to_lowercase().contains("forbidden"),
                    "without {verb} on {resource} in {ns} {what} fails, but not with 403: {e}"
                );
                println!(
                    "without {verb} on {resource} in {ns}: {}",
                    e.replace('\n', "\n    ")
                );
            }
        }
    }
    passed_without
}

differential!(
    removing_a_start_up_verb_from_the_controller_roles_fails_with_403,
    verb_removal,
    namespaces = []
);

/// For each verb of the controller's Roles: without it, the named test
/// `the_controller_serves_under_the_manifest_roles` fails and says 403
/// (forbidden); verbs only the claim path uses (`patch`, `delete`, `get`
/// of a pod, `metrics.k8s.io`, the watches) are reported, not asserted, as
/// start-up does not exercise them (see
/// `removing_a_claim_path_verb_from_the_controller_roles_fails_with_403`).
async fn verb_removal(b: &Backend) {
    controller_rbac_and_pod(b).await;
    let not_needed_at_start = without_each_verb(b, "the controller", async |_| {
        controller_serves_as_its_service_account(b, Duration::from_secs(8)).await
    })
    .await;
    println!("verbs start-up does not need (exercised by the claim path): {not_needed_at_start:?}");
    // With every verb back the named test passes again.
    controller_serves_as_its_service_account(b, Duration::from_secs(30))
        .await
        .unwrap();
}

differential!(
    a_refused_watch_turns_the_controller_not_serving,
    refused_watch,
    namespaces = []
);

/// Health of the controller listening on `port` as it changes: the first
/// status, then every change.
async fn health_statuses(port: u16) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Waits for health `want` on `statuses`, within `limit`.
async fn await_health(
    statuses: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
    want: tonic_health::pb::health_check_response::ServingStatus,
    limit: Duration,
) -> Result<(), String> {
    let wait = async {
        while let Some(m) = statuses.message().await.map_err(|e| e.to_string())? {
            if m.status == want as i32 {
                return Ok(());
            }
        }
        Err("the health stream ended".to_owned())
    };
    tokio::time::timeout(limit, wait)
        .await
        .map_err(|_| format!("no {want:?} within {limit:?}"))?
}

/// Without `watch` on pods in the function namespace the controller starts
/// (its lists succeed) but its pod cache would never change: it reports
/// NOT_SERVING and logs the refused watch; once the verb is granted again
/// it reports SERVING (at the watch's next retry). Liveness stays SERVING.
async fn refused_watch(b: &Backend) {
    use tonic_health::pb::health_check_response::ServingStatus;
    controller_rbac_and_pod(b).await;
    let original = rules_of(b, FN_NS, SA).await;
    let mut reduced = original.clone();
    for rule in reduced.as_array_mut().unwrap() {
        if rule["apiGroups"] == json!([""]) && rule["resources"] == json!(["pods"]) {
            rule["verbs"].as_array_mut().unwrap().retain(|v| v != "watch");
        }
    }
    assert_ne!(reduced, original, "the manifests grant watch on pods in {FN_NS}");
    set_rules(b, FN_NS, SA, &reduced).await;

    let log_start = logs().0.lock().unwrap().len();
    let c = run_as_service_account(b, SigningKey::generate(), Duration::from_secs(30), |_| {}).await;
    let port = c.addr.port();
    let started = tokio::time::timeout(Duration::from_secs(30), c.ready).await;
    assert!(
        matches!(started, Ok(Ok(_))),
        "the controller did not start without watch: {}",
        forbidden_lines(log_start).join("\n")
    );
    let mut statuses = health_statuses(port).await;
    let refused = await_health(&mut statuses, ServingStatus::NotServing, Duration::from_secs(30)).await;
    let live = live_status(port).await;
    let logged = {
        let all = logs().0.lock().unwrap();
        String::from_utf8_lossy(&all[log_start.min(all.len())..]).into_owned()
    };
    let why = logged
        .lines()
        .find(|l| l.contains("controller not serving"))
        .map(str::to_owned);

    set_rules(b, FN_NS, SA, &original).await;
    // The watch retries with kube-rs' back-off (at most 30 s apart).
    let granted = await_health(&mut statuses, ServingStatus::Serving, Duration::from_secs(45)).await;
    c.shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(15), c.task).await;

    refused.unwrap_or_else(|e| panic!("without watch on pods: {e}\n{logged}"));
    let why = why.unwrap_or_else(|| panic!("no log line says why the controller is not serving:\n{logged}"));
    assert!(
        why.contains(&format!(
            "watch of pods in namespace {FN_NS} refused (403 Forbidden)"
        )),
        "{why}"
    );
    assert_eq!(live, ServingStatus::Serving as i32, "liveness while not serving");
    granted.unwrap_or_else(|e| panic!("with watch granted again: {e}"));
}

/// The status of the controller's liveness service.
async fn live_status(port: u16) -> i32 {
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: skipper::controller::LIVENESS_SERVICE.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

// === The router ===

const ROUTER_SA: &str = "skipper-router";

/// An EndpointSlice of the controller Service with one ready endpoint
/// (written by the administrator: the address is only read, never dialled).
async fn controller_endpoint_slice(b: &Backend) {
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(b.client().await, CTL_NS);
    slices
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "skipper-controller-test", "labels": {
                    "kubernetes.io/service-name": "skipper-controller-headless",
                    "endpointslice.kubernetes.io/managed-by": "skipper-tests"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}, "zone": "zone-a"}],
                "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
}

/// The named test: the router's discovery, as ServiceAccount
/// `skipper/skipper-router`, finds the controller endpoint within `limit`
/// (and with `refusals`, records what the API server refuses).
async fn router_discovers_as_its_service_account(
    b: &Backend,
    limit: Duration,
    refusals: Option<&skipper::watch_access::Refusals>,
) -> Result<(), String> {
    let log_start = logs().0.lock().unwrap().len();
    let client = b.service_account_client(CTL_NS, ROUTER_SA).await;
    let client = match refusals {
        Some(r) => r.client(&client, "EndpointSlices"),
        None => client,
    };
    let endpoints = skipper::client::Endpoints::new(skipper::client::ChannelSettings::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(skipper::router::discovery::run_endpoint_slices(
        client,
        CTL_NS.into(),
        "skipper-controller-headless".into(),
        50051,
        "zone-a".into(),
        endpoints.clone(),
        stop.clone(),
    ));
    let want: Vec<std::net::SocketAddr> = vec!["10.0.0.1:50051".parse().unwrap()];
    let found = tokio::time::timeout(limit, endpoints.wait_until(|a| a == want.as_slice())).await;
    if let Some(r) = refusals {
        // The watch starts after the list: await its answer.
        let _ = tokio::time::timeout(limit, r.subscribe().wait_for(|m| !m.is_empty())).await;
    }
    stop.cancel();
    let _ = task.await;
    let refusals = forbidden_lines(log_start)
        .into_iter()
        .take(2)
        .collect::<Vec<_>>()
        .join("\n");
    found.map_err(|_| format!("no controller endpoint after {limit:?}\n{refusals}"))
}

differential!(
    removing_a_verb_from_the_router_role_fails_discovery_with_403,
    router_verbs,
    namespaces = []
);

/// With the manifests' router Role the named test passes; without `list`
/// it fails with 403. Without `watch` discovery finds the first endpoints
/// from the list alone, and the refused watch is recorded (what turns the
/// router's `/healthz` to 503).
async fn router_verbs(b: &Backend) {
    apply_rbac(b).await;
    let admin = b.client().await;
    for doc in manifest_documents(skipper::dev::playground::ROUTER_YAML).unwrap() {
        if doc["kind"] == "ServiceAccount" {
            create_object(&admin, &doc).await.unwrap();
        }
    }
    controller_endpoint_slice(b).await;
    router_discovers_as_its_service_account(b, Duration::from_secs(30), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let original = rules_of(b, CTL_NS, ROUTER_SA).await;
    for verb in ["list", "watch"] {
        set_rules(b, CTL_NS, ROUTER_SA, &without_verb(&original, 0, verb)).await;
        let refusals = skipper::watch_access::Refusals::new();
        let probe = (verb == "watch").then_some(&refusals);
        let result = router_discovers_as_its_service_account(b, Duration::from_secs(8), probe).await;
        set_rules(b, CTL_NS, ROUTER_SA, &original).await;
        match (verb, result) {
            ("list", Err(e)) => assert!(e.contains("403"), "without list: {e}"),
            ("list", Ok(())) => panic!("discovery works without list"),
            (_, r) => {
                // The first list finds the endpoints, but the router's
                // health reports the refused watch (its /healthz is 503).
                println!("without {verb}: {r:?}");
                assert_eq!(
                    skipper::watch_access::Refusals::describe(&refusals.current()),
                    "watch of EndpointSlices refused (403 Forbidden): the `watch` verb is not granted"
                );
            }
        }
    }
}

// === The claim path ===

/// A pool Deployment `name` of one fixture pod in the function namespace,
/// created by the administrator; returns once its pod is Ready.
async fn ready_pool(b: &Backend, name: &str, public_pem: &str) {
    let admin = b.client().await;
    let d: k8s_openapi::api::apps::v1::Deployment = serde_json::from_value(
        skipper_devcluster::pool_deployment_json(FN_NS, name, 1, public_pem),
    )
    .unwrap();
    Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(admin.clone(), FN_NS)
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin, FN_NS);
    let selector = format!("skipper/deployment={name},!skipper/tenant");
    backend::eventually("the pool's pod to be Ready", Duration::from_secs(60), || async {
        let list = pods
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .unwrap();
        list.items
            .iter()
            .any(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .then_some(())
    })
    .await;
}

/// Starts the controller as ServiceAccount `skipper/skipper-controller`:
/// its gRPC address and state, or why it did not serve within `limit`.
async fn start_as_service_account(
    b: &Backend,
    key: &SigningKey,
    limit: Duration,
) -> (
    Result<
        (
            std::net::SocketAddr,
            std::sync::Arc<skipper::controller::core::Core>,
        ),
        String,
    >,
    Shutdown,
    tokio::task::JoinHandle<Result<(), skipper::controller::RunError>>,
) {
    let c = run_as_service_account(b, key.clone(), limit, |config| {
        config.scale_interval = Duration::from_millis(200);
        // The calls below carry no token: this test is about the API server's
        // authorisation of the controller, not the controller's of its callers.
        config.auth.allow_unauthenticated = true;
    })
    .await;
    let addr = c.addr;
    let started = tokio::select! {
        r = c.ready => r.map(|r| (addr, r.core)).map_err(|_| "the controller stopped before it served".to_owned()),
        () = tokio::time::sleep(limit) => Err(format!("not started after {limit:?}")),
    };
    (started, c.shutdown, c.task)
}

/// The named test of the claim path: the controller, as ServiceAccount
/// `skipper/skipper-controller`, starts and reports SERVING (every watch
/// accepted); claims a pod of a pool created after it started (its
/// ReplicaSet and pod watches see it) and assigns it; reads the pod's usage
/// from `metrics.k8s.io`; releases an instance it does not know (reading
/// the pod from the API server); and releases the claimed instance (deleting
/// the pod); and sees a controller that joins the ring and leaves it. The
/// error names the step and the refusals the controller logged.
async fn claim_path_as_its_service_account(
    b: &Backend,
    key: &SigningKey,
    pool: &str,
    limit: Duration,
) -> Result<(), String> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let log_start = logs().0.lock().unwrap().len();
    let (started, shutdown, task) = start_as_service_account(b, key, limit).await;
    let outcome = async {
        let (addr, core) = started?;
        let mut statuses = health_statuses(addr.port()).await;
        await_health(&mut statuses, ServingStatus::Serving, limit)
            .await
            .map_err(|e| format!("health: {e}"))?;
        ready_pool(b, pool, &key.verifying_key().to_pem()).await;
        skipper_test_support::controller::caught_up_within(&b.client().await, &core, limit)
            .await
            .map_err(|e| format!("pool {pool}: {e}"))?;
        let mut grpc = skipper::api::controller_service_client::ControllerServiceClient::connect(format!(
            "http://{addr}"
        ))
        .await
        .unwrap();
        let f = skipper::domain::Function {
            namespace: FN_NS.into(),
            deployment: pool.into(),
            tenant: "claimant".into(),
            metadata: None,
            scale: Some(skipper::domain::Scale {
                min_instances: Some(0),
                max_instances: Some(1),
                ..skipper::domain::Scale::default()
            }),
            oneshot: None,
        };
        let mut req = tonic::Request::new(skipper::api::GetInstanceRequest {
            function: Some((&f).into()),
            exclude_instance_names: vec![],
        });
        req.set_timeout(limit);
        let instance = grpc
            .get_instance(req)
            .await
            .map_err(|e| format!("GetInstance: {e:?}"))?
            .into_inner()
            .instance
            .ok_or("GetInstance answered no instance")?;
        let name = instance.name.clone().unwrap_or_default();
        try_eventually(&format!("usage of {name} from metrics.k8s.io"), limit, || {
            std::future::ready((core.cluster.state.usage.get(FN_NS, &name) != (0, 0)).then_some(()))
        })
        .await?;
        let unknown = skipper::api::Instance {
            name: Some(format!("{pool}-not-a-pod")),
            ..instance.clone()
        };
        grpc.release_instance(skipper::api::ReleaseInstanceRequest {
            instance: Some(unknown),
        })
        .await
        .map_err(|e| format!("ReleaseInstance of an unknown pod: {e:?}"))?;
        grpc.release_instance(skipper::api::ReleaseInstanceRequest {
            instance: Some(instance),
        })
        .await
        .map_err(|e| format!("ReleaseInstance: {e:?}"))?;
        let pods: Api<Pod> = Api::namespaced(b.client().await, FN_NS);
        try_eventually(&format!("the released pod {name} deleted"), limit, || async {
            let pod = pods.get_opt(&name).await.unwrap();
            pod.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
                .then_some(())
        })
        .await?;
        // A controller that joins later enters the ring (the watch of the
        // controller pods), and leaves it when its pod goes.
        let members = || core.cluster.ring.current().sorted_members().len();
        joining_controller_pod(b, "127.0.0.2").await;
        try_eventually("a joining controller in the ring", limit, || {
            std::future::ready((members() == 2).then_some(()))
        })
        .await?;
        leaving_controller_pod(b).await;
        try_eventually("a leaving controller out of the ring", limit, || {
            std::future::ready((members() == 1).then_some(()))
        })
        .await?;
        Ok::<(), String>(())
    }
    .await;
    leaving_controller_pod(b).await;
    stopped_with(outcome, &shutdown, task, log_start).await
}

differential!(
    removing_a_claim_path_verb_from_the_controller_roles_fails_with_403,
    claim_path_verb_removal,
    namespaces = [],
    pods
);

/// With the manifests' Roles the named claim-path test passes; without any
/// one verb of the controller's Roles it fails, and the controller's log
/// shows the 403.
async fn claim_path_verb_removal(b: &Backend) {
    if !b.runs_pods() {
        eprintln!("skipped: no node agent runs pods on the {} backend", b.name());
        return;
    }
    controller_rbac_and_pod(b).await;
    let key = SigningKey::generate();
    let limit = Duration::from_secs(8);
    claim_path_as_its_service_account(b, &key, "pool-all", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("with every verb of the manifests: {e}"));
    let passed_without = without_each_verb(b, "the claim path", async |round| {
        claim_path_as_its_service_account(b, &key, &format!("pool-{round}"), limit).await
    })
    .await;
    assert!(
        passed_without.is_empty(),
        "the claim path needs no {passed_without:?}: the manifests grant more than Skipper uses"
    );
}
