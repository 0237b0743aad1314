//! The chart's life on the real control plane, with the node agent and on
//! kubelet nodes: `helm install`, `helm upgrade` to a new image tag while
//! warm and cold tenants send HTTP requests and WebSocket sessions run
//! through the routers (0 failed, 0 answered for another tenant), and `helm
//! uninstall` with the pool deleted after it (no Skipper object, no tenant
//! pod left).
//!
//! Clients reach routers as a Service's clients do: a new connection goes to
//! one of the Ready router pods (followed by a watch, as endpoints are);
//! kept-alive connections stay with their router until it answers
//! `Connection: close`.
//!
//! [`lifecycle`] takes the backend and the image, so the same scenario runs
//! on kubelet nodes (`make nodes image`) with two tags of the image imported
//! there, the pool running it and Pod Security `restricted` enforced.
//!
//! Skipped with a message when helm (`make helm`), the control plane
//! (`make control-plane`) or, for the kubelet variant, the nodes and the
//! image (`make nodes image`) are not built; a failure under `CI=true`.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::{SinkExt as _, StreamExt as _};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::Value;
use skipper::token::SigningKey;
use skipper_test_support::backend::Backend;
use skipper_test_support::{eventually, workspace_root};
use tokio_util::sync::CancellationToken;

use super::steps::{self, CONTROLLERS, POOL_NS, ROUTERS, WAIT};

fn helm() -> Option<PathBuf> {
    let helm = workspace_root().join("target/helm/helm");
    if helm.is_file() {
        return Some(helm);
    }
    assert!(
        !std::env::var("CI").is_ok_and(|v| v == "true"),
        "helm is not built at {}: run `make helm`",
        helm.display()
    );
    eprintln!(
        "skipped: helm is not built at {} (run `make helm`)",
        helm.display()
    );
    None
}

async fn run_helm(helm: &PathBuf, b: &Backend, args: &[&str]) {
    let out = tokio::process::Command::new(helm)
        .args(args)
        .arg("--kubeconfig")
        .arg(b.kubeconfig())
        .current_dir(workspace_root())
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("skipper-helm-cache"))
        .env(
            "HELM_CONFIG_HOME",
            std::env::temp_dir().join("skipper-helm-config"),
        )
        .env("HELM_DATA_HOME", std::env::temp_dir().join("skipper-helm-data"))
        .output()
        .await
        .unwrap();
    let _ = skipper_test_support::process::succeeded(&format!("helm {args:?}"), out);
}

/// The chart's values for this test besides the image: short shutdown
/// timings so the rollout is quick.
const VALUES: [&str; 6] = [
    "--set",
    "controller.preStopSleepSeconds=2",
    "--set",
    "router.shutdownDelaySeconds=3",
    "--set",
    "controller.flags.heartbeat-timeout=30s",
];

/// How long a WebSocket session (handshake, three pings, close) may take
/// before it counts as failed: the router's own bound on finding an
/// instance (`--get-instance-timeout`, 30 s by default) and 10 s more. An
/// HTTP request waits as long as the router does too. Slower is slow, not
/// failed: on a machine running two suites at once a pool pod (10m of CPU
/// requested) is starved for seconds, its readiness probe fails, and a cold
/// start waits for the pool to refill. Sessions over [`SLOW`] go in the
/// timeline, and the slowest session and request are printed.
const SESSION_BOUND: Duration = Duration::from_secs(40);

/// A session or request slower than this is recorded in the timeline.
const SLOW: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
struct Figures {
    warm: AtomicUsize,
    cold: AtomicUsize,
    sessions: AtomicUsize,
    failed: AtomicUsize,
    cross: AtomicUsize,
    /// The slowest answered request and completed session, in ms.
    slowest_request: AtomicU64,
    slowest_session: AtomicU64,
    timeline: Timeline,
}

impl Figures {
    /// Keeps `took` if it is the slowest of its kind, and records it in the
    /// timeline when it is over [`SLOW`].
    fn took(&self, slowest: &AtomicU64, started: Instant, what: impl FnOnce() -> String) {
        let took = started.elapsed();
        slowest.fetch_max(
            u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
        if took > SLOW {
            self.timeline.record(started, format!("{} took {took:?}", what()));
        }
    }
}

/// What happened during the load, for a failure's message: each Skipper
/// and tenant pod's changes (IP, readiness, deletion) as watches saw them, and each failed request or session, by seconds since
/// the load began.
#[derive(Debug)]
struct Timeline {
    start: Instant,
    lines: Mutex<Vec<String>>,
    pods: Mutex<BTreeMap<String, String>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            lines: Mutex::default(),
            pods: Mutex::default(),
        }
    }
}

impl Timeline {
    fn record(&self, at: Instant, line: String) {
        let t = at.saturating_duration_since(self.start).as_secs_f64();
        self.lines.lock().unwrap().push(format!("{t:7.2}s {line}"));
    }

    /// Records each pod of `pods` whose state changed since the last look,
    /// and each pod of `namespace` that is gone.
    fn observe(&self, namespace: &str, pods: &[Pod]) {
        let now = Instant::now();
        let mut seen = self.pods.lock().unwrap();
        let mut present = BTreeSet::new();
        for p in pods {
            let name = format!("{namespace}/{}", p.metadata.name.clone().unwrap_or_default());
            let ip = p
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .unwrap_or_default();
            let tenant = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("skipper/tenant"))
                .map_or(String::new(), |t| format!(" tenant {t}"));
            let state = format!(
                "{ip}{tenant} {}{}",
                if steps::ready(p) { "ready" } else { "not ready" },
                if p.metadata.deletion_timestamp.is_some() {
                    ", deleting"
                } else {
                    ""
                }
            );
            present.insert(name.clone());
            if seen.get(&name) != Some(&state) {
                self.record(now, format!("{name}: {state}"));
                seen.insert(name, state);
            }
        }
        let prefix = format!("{namespace}/");
        let gone: Vec<String> = seen
            .keys()
            .filter(|k| k.starts_with(&prefix) && !present.contains(*k))
            .cloned()
            .collect();
        for name in gone {
            seen.remove(&name);
            self.record(now, format!("{name}: gone"));
        }
    }

    fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

/// Ready, not terminating router pods: what a Service's endpoints hold.
/// One line per pod for a failure message: name, image, phase, readiness,
/// whether it is being deleted, and why a container waits or last ended.
fn describe_pods(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .map(|p| {
            let status = p.status.as_ref();
            let phase = status.and_then(|s| s.phase.clone()).unwrap_or_default();
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            let mut line = format!(
                "{} {image} ({phase}, ready {}",
                p.metadata.name.clone().unwrap_or_default(),
                steps::ready(p)
            );
            if p.metadata.deletion_timestamp.is_some() {
                line.push_str(", deleting");
            }
            for c in status
                .and_then(|s| s.container_statuses.as_ref())
                .into_iter()
                .flatten()
            {
                let state = c.state.as_ref();
                if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
                    line.push_str(&format!(
                        ", {} waiting: {} {}",
                        c.name,
                        w.reason.clone().unwrap_or_default(),
                        w.message.clone().unwrap_or_default()
                    ));
                }
                if let Some(t) = c.last_state.as_ref().and_then(|s| s.terminated.as_ref()) {
                    line.push_str(&format!(
                        ", {} restarted {} times, last exit {} {}",
                        c.name,
                        c.restart_count,
                        t.exit_code,
                        t.reason.clone().unwrap_or_default()
                    ));
                }
            }
            line.push(')');
            line
        })
        .collect()
}

/// One line per Deployment of `ns` for a failure message: its replica
/// counts and the messages of its conditions.
async fn describe_deployments(client: &kube::Client, ns: &str) -> Vec<String> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let Ok(list) = api.list(&ListParams::default()).await else {
        return Vec::new();
    };
    list.items
        .iter()
        .map(|d| {
            let s = d.status.clone().unwrap_or_default();
            let conditions: Vec<String> = s
                .conditions
                .unwrap_or_default()
                .into_iter()
                .map(|c| format!("{}={}: {}", c.type_, c.status, c.message.unwrap_or_default()))
                .collect();
            format!(
                "{}: {} replicas, {} updated, {} ready, {} available; {conditions:?}",
                d.metadata.name.clone().unwrap_or_default(),
                s.replicas.unwrap_or(0),
                s.updated_replicas.unwrap_or(0),
                s.ready_replicas.unwrap_or(0),
                s.available_replicas.unwrap_or(0),
            )
        })
        .collect()
}

async fn router_endpoints(client: &kube::Client) -> Vec<String> {
    ready_routers(&steps::pods(client, "skipper", ROUTERS).await)
}

/// The IPs of the Ready, not terminating routers among `pods`.
fn ready_routers(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("app.kubernetes.io/component"))
                == Some(&"router".to_owned())
        })
        .filter(|p| p.metadata.deletion_timestamp.is_none() && steps::ready(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect()
}

/// Watches the pods of `api` matching `selector` until `stop`, handing the
/// whole set to `seen` after each change.
async fn follow(api: Api<Pod>, selector: &str, stop: &CancellationToken, mut seen: impl FnMut(&[Pod])) {
    use kube::runtime::{WatchStreamExt as _, reflector, watcher};
    let (reader, writer) = reflector::store();
    let events =
        reflector(writer, watcher(api, watcher::Config::default().labels(selector))).default_backoff();
    let mut events = std::pin::pin!(events);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            event = events.next() => match event {
                // The store fills at `InitDone`: until then it holds nothing.
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
                Some(Ok(_)) => {
                    let pods: Vec<Pod> = reader.state().iter().map(|p| Pod::clone(p)).collect();
                    seen(&pods);
                }
                Some(Err(e)) => eprintln!("watching pods ({selector}): {e}"),
                None => return,
            },
        }
    }
}

fn pick(endpoints: &RwLock<Vec<String>>) -> Option<String> {
    let e = endpoints.read().unwrap();
    (!e.is_empty()).then(|| e[rand::random_range(0..e.len())].clone())
}

fn function(tenant: &str) -> String {
    format!(
        r#"{{"namespace":"{POOL_NS}","deployment":"fixture","tenant":"{tenant}","scale":{{"max_instances":1}}}}"#
    )
}

/// One HTTP request for `tenant`; counts a failure or an answer for another tenant.
async fn http_once(
    http: &reqwest::Client,
    endpoints: &RwLock<Vec<String>>,
    tenant: &str,
    f: &Figures,
) -> bool {
    let started = Instant::now();
    let fail = |what: String| {
        eprintln!("{what}");
        f.timeline.record(started, what);
    };
    let Some(router) = pick(endpoints) else {
        fail(format!("{tenant}: no Ready router"));
        f.failed.fetch_add(1, Ordering::SeqCst);
        return false;
    };
    let resp = http
        .get(format!("http://{router}:8080/hello"))
        .header("X-Skipper-Function", function(tenant))
        .send()
        .await;
    match resp {
        Ok(r) if r.status() == 200 => match r.json::<Value>().await {
            Ok(body) if body["tenant"] == tenant => {
                f.took(&f.slowest_request, started, || format!("{tenant} via {router}"));
                true
            }
            Ok(body) => {
                fail(format!("cross-tenant answer for {tenant}: {body}"));
                f.cross.fetch_add(1, Ordering::SeqCst);
                false
            }
            Err(e) => {
                fail(format!("{tenant} via {router}: {}", chain(&e)));
                f.failed.fetch_add(1, Ordering::SeqCst);
                false
            }
        },
        Ok(r) => {
            fail(format!("{tenant} via {router}: {}", r.status()));
            f.failed.fetch_add(1, Ordering::SeqCst);
            false
        }
        Err(e) => {
            fail(format!("{tenant} via {router}: {}", chain(&e)));
            f.failed.fetch_add(1, Ordering::SeqCst);
            false
        }
    }
}

/// An error with its sources ("error sending request" says little alone).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// One WebSocket session through a router: three pings, three pongs.
async fn ws_session(endpoints: &RwLock<Vec<String>>, tenant: &str, f: &Figures) {
    use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest as _};
    let Some(router) = pick(endpoints) else {
        eprintln!("websocket {tenant}: no Ready router");
        f.timeline
            .record(Instant::now(), format!("websocket {tenant}: no Ready router"));
        f.failed.fetch_add(1, Ordering::SeqCst);
        return;
    };
    let mut req = format!("ws://{router}:8080/socket")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("x-skipper-function", function(tenant).parse().unwrap());
    // The step a session is in, for a time-out's message.
    let step = std::sync::Mutex::new("the handshake");
    let at = |s: &'static str| *step.lock().unwrap() = s;
    let session = async {
        let (mut ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .map_err(|e| e.to_string())?;
        for ping in ["the first pong", "the second pong", "the third pong"] {
            at(ping);
            ws.send(Message::text("ping")).await.map_err(|e| e.to_string())?;
            match ws.next().await {
                Some(Ok(m)) if m.to_text().ok() == Some("pong") => {}
                other => return Err(format!("{other:?}")),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        at("the close");
        ws.close(None).await.map_err(|e| e.to_string())
    };
    let started = Instant::now();
    match tokio::time::timeout(SESSION_BOUND, session).await {
        Ok(Ok(())) => {
            f.took(&f.slowest_session, started, || {
                format!("websocket {tenant} via {router}")
            });
            f.sessions.fetch_add(1, Ordering::SeqCst);
        }
        other => {
            let what = format!(
                "websocket {tenant} via {router}: {other:?} after {:?}, waiting for {}",
                started.elapsed(),
                step.lock().unwrap()
            );
            eprintln!("{what}");
            f.timeline.record(started, what);
            f.failed.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Pods of `selector` in `skipper` still running the image `image`.
async fn with_image(client: &kube::Client, selector: &str, image: &str) -> usize {
    steps::pods(client, "skipper", selector)
        .await
        .iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .is_some_and(|s| s.containers.iter().any(|c| c.image.as_deref() == Some(image)))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_upgrade_under_load_and_uninstall_on_the_real_control_plane() {
    let Some(helm) = helm() else { return };
    let Some(b) = Backend::real_with_pods(&[]).await else {
        return;
    };
    // The node agent runs the test's own binary whatever the image says.
    lifecycle(&helm, &b, "skipper", ("v1", "v2"), None).await;
    b.shutdown().await;
}

/// The same on kubelet nodes: the image imported there under two tags, the
/// pool running it, Pod Security `restricted` enforced on both namespaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_upgrade_under_load_and_uninstall_on_kubelet_nodes() {
    let Some(helm) = helm() else { return };
    let Some((cluster, image)) = steps::kubelet_cluster().await else {
        return;
    };
    let repository = image
        .rsplit_once(':')
        .map_or(image.as_str(), |(r, _)| r)
        .to_owned();
    for tag in ["v1", "v2"] {
        cluster
            .kubelet_nodes()
            .unwrap()
            .tag_image(&image, &format!("{repository}:{tag}"))
            .await
            .unwrap();
    }
    let b = Backend::Cluster(Box::new(cluster));
    lifecycle(&helm, &b, &repository, ("v1", "v2"), Some(&image)).await;
    b.shutdown().await;
}

/// Install, upgrade from tag `tags.0` to `tags.1` of `repository` under
/// load, uninstall (see the module's documentation). On kubelet nodes
/// (`pool_image` set) the pool runs `pool_image` and both namespaces
/// enforce Pod Security `restricted`.
async fn lifecycle(
    helm: &PathBuf,
    b: &Backend,
    repository: &str,
    tags: (&str, &str),
    pool_image: Option<&str>,
) {
    let client = b.client().await;
    let repository_value = format!("image.repository={repository}");
    let (old_tag, new_tag) = (format!("image.tag={}", tags.0), format!("image.tag={}", tags.1));
    let (old_image, new_image) = (
        format!("{repository}:{}", tags.0),
        format!("{repository}:{}", tags.1),
    );
    let key = SigningKey::generate();
    // The namespace and its Secret, then the pool (any order works).
    b.create_namespace("skipper").await;
    if pool_image.is_some() {
        skipper::dev::kubelet::enforce_restricted(&client, "skipper")
            .await
            .unwrap();
    }
    steps::apply(
        &client,
        &[serde_json::json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "skipper-controller-paseto", "namespace": "skipper"},
            "stringData": {"SKIPPER_PASETO_PRIVATE_KEY": key.to_pem()}})],
    )
    .await;
    // The pool's namespace, public key and Deployment; the chart renders the
    // controller's Role there and the namespace's NetworkPolicy.
    let mut pool: Vec<Value> = steps::pool(&key)
        .into_iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Namespace" | "ConfigMap" | "Deployment")))
        .collect();
    for d in &mut pool {
        if d["kind"] == "Deployment" {
            d["spec"]["replicas"] = 6.into();
        }
        if let Some(image) = pool_image {
            skipper::dev::kubelet::for_image(d, image);
        }
    }
    steps::apply(&client, &pool).await;

    let begin = Instant::now();
    let mut install = vec![
        "install",
        "skipper",
        "charts/skipper",
        "--namespace",
        "skipper",
        "--set",
        &old_tag,
        "--set",
        &repository_value,
    ];
    install.extend_from_slice(&VALUES);
    run_helm(helm, b, &install).await;
    steps::serve(&client, 2, "first").await;
    let installed = begin.elapsed();

    // Load: warm tenants, a new tenant every 2 s, WebSocket sessions.
    let endpoints = Arc::new(RwLock::new(router_endpoints(&client).await));
    let figures = Arc::new(Figures::default());
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    {
        // Routers' endpoints follow a watch of the Skipper pods, as the
        // EndpointSlice controller does: a router leaves them when it is
        // deleted or unready, with no polling lag that a loaded machine
        // could stretch past the router's shutdown delay. The same events
        // feed the timeline.
        let (endpoints, client, stop, figures) =
            (endpoints.clone(), client.clone(), stop.clone(), figures.clone());
        tasks.spawn(async move {
            let api: Api<Pod> = Api::namespaced(client, "skipper");
            follow(api, "app.kubernetes.io/name=skipper", &stop, |pods| {
                figures.timeline.observe("skipper", pods);
                *endpoints.write().unwrap() = ready_routers(pods);
            })
            .await;
        });
    }
    {
        let (client, stop, figures) = (client.clone(), stop.clone(), figures.clone());
        tasks.spawn(async move {
            let api: Api<Pod> = Api::namespaced(client, POOL_NS);
            follow(api, "skipper/tenant", &stop, |pods| {
                figures.timeline.observe(POOL_NS, pods);
            })
            .await;
        });
    }
    for w in 0..5 {
        let (endpoints, figures, stop) = (endpoints.clone(), figures.clone(), stop.clone());
        tasks.spawn(async move {
            let http = reqwest::Client::new();
            let tenant = format!("warm-{w}");
            // After a slow answer the next request waits its 100 ms, not a
            // burst of the ticks missed meanwhile.
            let mut every = tokio::time::interval(Duration::from_millis(100));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.is_cancelled() {
                every.tick().await;
                if http_once(&http, &endpoints, &tenant, &figures).await {
                    figures.warm.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    }
    {
        let (endpoints, figures, stop) = (endpoints.clone(), figures.clone(), stop.clone());
        tasks.spawn(async move {
            let http = reqwest::Client::new();
            let mut every = tokio::time::interval(Duration::from_secs(2));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0;
            while !stop.is_cancelled() {
                every.tick().await;
                n += 1;
                if http_once(&http, &endpoints, &format!("cold-{n}"), &figures).await {
                    figures.cold.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    }
    for s in 0..2 {
        let (endpoints, figures, stop) = (endpoints.clone(), figures.clone(), stop.clone());
        tasks.spawn(async move {
            // Paced like the others: a session that fails at once (no
            // Ready router) must not spin without yielding to the runtime.
            let mut every = tokio::time::interval(Duration::from_millis(100));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.is_cancelled() {
                every.tick().await;
                ws_session(&endpoints, &format!("socket-{s}"), &figures).await;
            }
        });
    }
    eventually("warm tenants answered", WAIT, || {
        let figures = figures.clone();
        async move { (figures.warm.load(Ordering::SeqCst) >= 50).then_some(()) }
    })
    .await;

    let upgrade = Instant::now();
    figures.timeline.record(upgrade, "helm upgrade begins".into());
    let mut up = vec![
        "upgrade",
        "skipper",
        "charts/skipper",
        "--namespace",
        "skipper",
        "--set",
        &new_tag,
        "--set",
        &repository_value,
    ];
    up.extend_from_slice(&VALUES);
    run_helm(helm, b, &up).await;
    // Four pods replaced one after another at most (each starts, turns
    // Ready, and the one it replaces drains): twice the wait of one step,
    // for a loaded machine. A time-out describes every pod and Deployment.
    let rollout = skipper_test_support::try_eventually(
        "every controller and router on the new tag, the old ones gone",
        WAIT * 2,
        || async {
            let old = with_image(&client, CONTROLLERS, &old_image).await
                + with_image(&client, ROUTERS, &old_image).await;
            let new = steps::ready_ips(&client, "skipper", CONTROLLERS).await.len() == 2
                && with_image(&client, CONTROLLERS, &new_image).await == 2
                && with_image(&client, ROUTERS, &new_image).await == 2
                && router_endpoints(&client).await.len() == 2;
            (old == 0 && new).then_some(())
        },
    )
    .await;
    if let Err(e) = rollout {
        let skipper = describe_pods(&steps::pods(&client, "skipper", "app.kubernetes.io/name=skipper").await);
        panic!(
            "{e}: Skipper pods {skipper:#?}; Deployments {:#?}; router endpoints {:?}",
            describe_deployments(&client, "skipper").await,
            router_endpoints(&client).await
        );
    }
    let rolled = upgrade.elapsed();
    figures.timeline.record(
        Instant::now(),
        "every controller and router on the new tag".into(),
    );
    // Load on the new pods for a while.
    let at = figures.warm.load(Ordering::SeqCst);
    eventually("warm tenants answered after the upgrade", WAIT, || {
        let figures = figures.clone();
        async move { (figures.warm.load(Ordering::SeqCst) >= at + 50).then_some(()) }
    })
    .await;
    stop.cancel();
    // A session under way ends within its bound.
    while let Some(r) = tokio::time::timeout(SESSION_BOUND + Duration::from_secs(10), tasks.join_next())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let (warm, cold, sessions, failed, cross) = (
        figures.warm.load(Ordering::SeqCst),
        figures.cold.load(Ordering::SeqCst),
        figures.sessions.load(Ordering::SeqCst),
        figures.failed.load(Ordering::SeqCst),
        figures.cross.load(Ordering::SeqCst),
    );
    let restarts = steps::restarts(&client, "skipper", CONTROLLERS).await
        + steps::restarts(&client, "skipper", ROUTERS).await;

    // Uninstall: the release, then the pool (its namespace kept).
    let uninstall = Instant::now();
    run_helm(
        helm,
        b,
        &["uninstall", "skipper", "--namespace", "skipper", "--wait"],
    )
    .await;
    let pool_objects: Vec<Value> = pool
        .iter()
        .filter(|d| d["kind"] != "Namespace" && d["kind"] != "ConfigMap")
        .cloned()
        .collect();
    steps::delete(&client, &pool_objects).await;
    // Polled until nothing is left; a timeout names what is.
    let deadline = Instant::now() + WAIT;
    loop {
        let tenants = describe_pods(&steps::pods(&client, POOL_NS, "skipper/tenant").await);
        let skipper = describe_pods(&steps::pods(&client, "skipper", "app.kubernetes.io/name=skipper").await);
        let left = helm_objects(b).await;
        let pool_left = steps::remaining(&client, &pool_objects).await;
        if tenants.is_empty() && skipper.is_empty() && left.is_empty() && pool_left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{WAIT:?} after the uninstall: tenant pods {tenants:?}, Skipper pods {skipper:?}, \
             the release's objects {left:?}, the pool's objects {pool_left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "helm on the real control plane ({}): install to serving {installed:?}; upgrade {old_image} → {new_image} rolled in {rolled:?} \
         under load: {warm} warm and {cold} cold requests, {sessions} WebSocket sessions, {failed} failed, \
         {cross} cross-tenant, {restarts} restarts, slowest request {} ms and session {} ms; \
         uninstall to 0 objects and 0 tenant pods in {:?}",
        if pool_image.is_some() {
            "kubelet nodes"
        } else {
            "node agent"
        },
        figures.slowest_request.load(Ordering::SeqCst),
        figures.slowest_session.load(Ordering::SeqCst),
        uninstall.elapsed()
    );
    assert_eq!(
        (failed, cross),
        (0, 0),
        "failed and cross-tenant answers during the upgrade; the load's timeline:\n{}",
        figures.timeline.text()
    );
    assert!(cold >= 3 && sessions >= 4, "cold {cold}, sessions {sessions}");
}

/// Objects that carry the release's label, of every kind the chart renders.
async fn helm_objects(b: &Backend) -> Vec<String> {
    let kinds = "deployments,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets,networkpolicies,\
                 secrets,configmaps,horizontalpodautoscalers,clusterroles,clusterrolebindings";
    let out = b
        .kubectl(&[
            "get",
            kinds,
            "--all-namespaces",
            "-l",
            "app.kubernetes.io/instance=skipper",
            "-o",
            "name",
        ])
        .await;
    assert!(out.ok, "{}", out.stderr);
    out.stdout.lines().map(str::to_owned).collect()
}
