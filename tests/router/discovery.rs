//! Zone-aware controller discovery against a minimal Kubernetes API on
//! 127.0.0.1:0 that serves an EndpointSlice list and a watch stream, through
//! the real kube-rs client.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, State};
use skipper::client::{ChannelSettings, Endpoints};
use skipper::router::discovery;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone)]
struct Api {
    slice: Arc<Mutex<serde_json::Value>>,
    events: broadcast::Sender<String>,
    selectors: Arc<Mutex<Vec<String>>>,
    /// Watch requests received.
    watches: Arc<tokio::sync::watch::Sender<usize>>,
}

fn slice(rv: &str, b_ready: bool) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "controller-abc",
            "namespace": "skipper",
            "resourceVersion": rv,
            "labels": {"kubernetes.io/service-name": "controller"}
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": true}, "zone": "z1"},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": b_ready}, "zone": "z2"},
            {"addresses": ["10.0.0.3"], "conditions": {"ready": false}, "zone": "z2"}
        ]
    })
}

async fn endpointslices(
    State(api): State<Api>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    api.selectors
        .lock()
        .unwrap()
        .push(q.get("labelSelector").cloned().unwrap_or_default());
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let rx = api.events.subscribe();
        api.watches.send_modify(|n| *n += 1);
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            let line = rx.recv().await.ok()?;
            Some((Ok::<_, std::io::Error>(format!("{line}\n")), rx))
        });
        return axum::response::Response::new(Body::from_stream(stream));
    }
    let item = api.slice.lock().unwrap().clone();
    axum::Json(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSliceList",
        "metadata": {"resourceVersion": "1"},
        "items": [item]
    }))
    .into_response()
}

use axum::response::IntoResponse;

async fn start_api() -> (SocketAddr, Api) {
    let api = Api {
        slice: Arc::new(Mutex::new(slice("1", true))),
        events: broadcast::channel(16).0,
        selectors: Arc::default(),
        watches: Arc::new(tokio::sync::watch::channel(0).0),
    };
    let app = axum::Router::new()
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/skipper/endpointslices",
            axum::routing::get(endpointslices),
        )
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, api)
}

/// Runs the router's EndpointSlice discovery of Service `controller` in
/// namespace `skipper` through `client`, preferring `zone`: the endpoints it
/// keeps, its stop token and its task.
fn discover(client: kube::Client, zone: &str) -> (Endpoints, CancellationToken, tokio::task::JoinHandle<()>) {
    let endpoints = Endpoints::new(ChannelSettings::default());
    let stop = CancellationToken::new();
    let task = tokio::spawn(discovery::run_endpoint_slices(
        client,
        "skipper".into(),
        "controller".into(),
        50051,
        zone.into(),
        endpoints.clone(),
        stop.clone(),
    ));
    (endpoints, stop, task)
}

/// Waits (at most [`LIMIT`]) until `endpoints` are `want` in any order;
/// panics naming `what` otherwise.
async fn endpoints_become(endpoints: &Endpoints, want: &[&str], what: &str) {
    let mut want: Vec<SocketAddr> = want.iter().map(|s| s.parse().unwrap()).collect();
    want.sort();
    let matches = |a: &[SocketAddr]| {
        let mut a = a.to_vec();
        a.sort();
        a == want
    };
    tokio::time::timeout(LIMIT, endpoints.wait_until(matches))
        .await
        .unwrap_or_else(|_| panic!("{what}: not {want:?} in time"));
}

#[tokio::test]
async fn endpoint_slices_drive_the_controller_endpoints_with_zone_preference() {
    let (addr, api) = start_api().await;
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let (endpoints, stop, task) = discover(client, "z2");

    // Same-zone ready endpoint preferred.
    endpoints_become(&endpoints, &["10.0.0.2:50051"], "initial endpoints").await;
    assert!(
        api.selectors
            .lock()
            .unwrap()
            .iter()
            .all(|s| s == "kubernetes.io/service-name=controller")
    );

    // The same-zone endpoint turns not ready: fall back to every zone.
    let updated = slice("2", false);
    *api.slice.lock().unwrap() = updated.clone();
    let event = serde_json::json!({"type": "MODIFIED", "object": updated}).to_string();
    let mut watches = api.watches.subscribe();
    tokio::time::timeout(LIMIT, watches.wait_for(|n| *n >= 1))
        .await
        .expect("the watch is established")
        .unwrap();
    api.events.send(event).unwrap();
    endpoints_become(&endpoints, &["10.0.0.1:50051"], "endpoints after the update").await;

    stop.cancel();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
}

/// The same resolver against the project's Kubernetes API simulator.
#[tokio::test]
async fn endpoint_slices_from_the_simulator() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::api::{DeleteParams, PostParams};
    use skipper_devcluster::{Cluster, Config};

    let cluster = Cluster::start(Config {
        namespaces: vec!["skipper".into()],
        ..Config::default()
    })
    .await
    .unwrap();
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(cluster.client().unwrap(), "skipper");
    let mut first: EndpointSlice = serde_json::from_value(slice("0", true)).unwrap();
    first.metadata.resource_version = None;
    api.create(&PostParams::default(), &first).await.unwrap();
    // A slice of another Service is ignored.
    let mut other: EndpointSlice = serde_json::from_value(slice("0", true)).unwrap();
    other.metadata.resource_version = None;
    other.metadata.name = Some("other-xyz".into());
    other.metadata.labels = Some([("kubernetes.io/service-name".to_owned(), "other".to_owned())].into());
    other.endpoints[0].addresses = vec!["10.9.9.9".into()];
    api.create(&PostParams::default(), &other).await.unwrap();

    let (endpoints, stop, task) = discover(cluster.client().unwrap(), "z1");
    endpoints_become(
        &endpoints,
        &["10.0.0.1:50051"],
        "same-zone endpoint from the simulator",
    )
    .await;

    // A second slice of the same Service adds a ready same-zone endpoint.
    let mut second: EndpointSlice = serde_json::from_value(slice("0", true)).unwrap();
    second.metadata.resource_version = None;
    second.metadata.name = Some("controller-def".into());
    second.endpoints = vec![
        serde_json::from_value(serde_json::json!(
            {"addresses": ["10.0.0.4"], "conditions": {"ready": true}, "zone": "z1"}
        ))
        .unwrap(),
    ];
    api.create(&PostParams::default(), &second).await.unwrap();
    endpoints_become(
        &endpoints,
        &["10.0.0.1:50051", "10.0.0.4:50051"],
        "endpoints of both slices",
    )
    .await;

    // Deleting the first slice leaves only the second's endpoint.
    api.delete("controller-abc", &DeleteParams::default())
        .await
        .unwrap();
    endpoints_become(
        &endpoints,
        &["10.0.0.4:50051"],
        "endpoints after a slice is deleted",
    )
    .await;

    stop.cancel();
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    cluster.shutdown().await;
}
