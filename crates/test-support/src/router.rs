//! Test harness for the controller client and the router: a scriptable fake
//! `ControllerService` served on 127.0.0.1:0, plus helpers to await
//! conditions with a deadline.
//!
//! Use it as `use skipper_test_support::router as harness;`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use skipper::api;
use skipper::api::controller_service_server::{ControllerService, ControllerServiceServer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Everything the fake controller has seen, and what it is told to answer.
#[derive(Debug, Default)]
pub struct State {
    /// Failures to answer, per method name, before behaving normally.
    pub failures: HashMap<&'static str, VecDeque<Status>>,
    /// Instances GetInstance picks from: the first whose name is not excluded
    /// (all excluded → the first).
    pub instances: Vec<api::Instance>,
    /// Calls received per method name (failed ones included).
    pub calls: HashMap<&'static str, usize>,
    pub get_instance_requests: Vec<api::GetInstanceRequest>,
    pub heartbeats: Vec<api::HeartbeatRequest>,
    pub releases: Vec<api::ReleaseInstanceRequest>,
    pub scales: Vec<api::ScaleRequest>,
    /// Set (to true) whenever GetInstance is called.
    pub get_instance_flags: Vec<Arc<std::sync::atomic::AtomicBool>>,
    /// Whether WatchInstances is served (otherwise it is UNIMPLEMENTED, as
    /// on a controller without the warm path).
    pub streams: bool,
    /// Instances streamed as DRAINING.
    pub draining: std::collections::HashSet<String>,
    /// Subscriptions received (the first message of each stream).
    pub subscriptions: Vec<api::WatchInstancesRequest>,
    /// Instance names routers reported idle.
    pub idle_reports: Vec<String>,
    /// Open streams.
    pub open_streams: usize,
    /// Set to end every open stream with this status.
    pub end_streams: Option<(u64, Status)>,
    /// While set, every call is refused with this code (as a controller
    /// refusing the caller's credentials does), whatever else is queued.
    pub refuse: Option<tonic::Code>,
}

impl State {
    /// Calls received of `method` (failed ones included).
    pub fn called(&self, method: &str) -> usize {
        self.calls.get(method).copied().unwrap_or(0)
    }
}

/// A fake controller. Clones share state.
#[derive(Debug, Clone)]
pub struct FakeController {
    state: Arc<Mutex<State>>,
    changed: Arc<watch::Sender<u64>>,
    /// While false, GetInstance calls wait (a cold start in progress).
    get_instance_open: Arc<watch::Sender<bool>>,
}

impl Default for FakeController {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeController {
    pub fn new() -> Self {
        Self {
            state: Arc::default(),
            changed: Arc::new(watch::channel(0).0),
            get_instance_open: Arc::new(watch::channel(true).0),
        }
    }

    /// From now on GetInstance calls wait (after being recorded) until
    /// [`FakeController::open_get_instance`].
    pub fn close_get_instance(&self) {
        self.get_instance_open.send_replace(false);
    }

    /// Lets waiting and later GetInstance calls answer.
    pub fn open_get_instance(&self) {
        self.get_instance_open.send_replace(true);
    }

    /// Runs `f` on the state (and wakes waiters).
    pub fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state.lock().unwrap());
        self.changed.send_modify(|g| *g += 1);
        r
    }

    /// Queues `n` failures with `code` for `method`.
    pub fn fail(&self, method: &'static str, code: tonic::Code, n: usize) {
        self.with(|s| {
            let q = s.failures.entry(method).or_default();
            for _ in 0..n {
                q.push_back(Status::new(code, format!("scripted {code:?}")));
            }
        });
    }

    /// Adds an instance GetInstance may return.
    pub fn add_instance(&self, name: &str, addr: SocketAddr) {
        self.add_instance_speaking(name, addr, api::Protocol::Unspecified);
    }

    /// Adds an instance of a pool that speaks `protocol`.
    pub fn add_instance_speaking(&self, name: &str, addr: SocketAddr, protocol: api::Protocol) {
        self.with(|s| {
            s.instances.push(api::Instance {
                name: Some(name.to_owned()),
                addr: Some(addr.to_string()),
                protocol: (protocol != api::Protocol::Unspecified).then_some(protocol as i32),
                ..Default::default()
            });
        });
    }

    /// Adds an instance GetInstance returns before every other one (while
    /// it is not excluded).
    pub fn add_instance_first(&self, name: &str, addr: &str) {
        self.with(|s| {
            s.instances.insert(
                0,
                api::Instance {
                    name: Some(name.to_owned()),
                    addr: Some(addr.to_owned()),
                    ..Default::default()
                },
            );
        });
    }

    /// The instance names each GetInstance call asked to exclude, in the
    /// order of the calls.
    pub fn exclusions(&self) -> Vec<Vec<String>> {
        self.with(|s| {
            s.get_instance_requests
                .iter()
                .map(|r| r.exclude_instance_names.clone())
                .collect()
        })
    }

    /// The names of the instances ReleaseInstance was called for, in order.
    pub fn released(&self) -> Vec<String> {
        self.with(|s| {
            s.releases
                .iter()
                .map(|r| r.instance.as_ref().unwrap().name.clone().unwrap())
                .collect()
        })
    }

    /// Makes every instance GetInstance returns speak `protocol`.
    pub fn speak(&self, protocol: api::Protocol) {
        self.with(|s| {
            for i in &mut s.instances {
                i.protocol = Some(protocol as i32);
            }
        });
    }

    pub fn calls(&self, method: &'static str) -> usize {
        self.with(|s| s.called(method))
    }

    /// Waits (at most `limit`) until `cond` holds on the state.
    pub async fn wait_until(&self, limit: Duration, mut cond: impl FnMut(&State) -> bool) {
        let mut rx = self.changed.subscribe();
        tokio::time::timeout(limit, async {
            loop {
                if cond(&self.state.lock().unwrap()) {
                    return;
                }
                rx.changed().await.unwrap();
            }
        })
        .await
        .expect("condition on the fake controller not reached in time");
    }

    /// Serves WatchInstances from now on.
    pub fn enable_streams(&self) {
        self.with(|s| s.streams = true);
    }

    /// Ends every open stream with `code`.
    pub fn end_streams(&self, code: tonic::Code) {
        self.with(|s| {
            let generation = s.end_streams.as_ref().map_or(1, |(g, _)| g + 1);
            s.end_streams = Some((generation, Status::new(code, "scripted end")));
        });
    }

    /// The streamed view (read without waking anyone).
    fn view(&self) -> Vec<(String, api::InstanceChange)> {
        let s = self.state.lock().unwrap();
        {
            s.instances
                .iter()
                .map(|i| {
                    let name = i.name.clone().unwrap_or_default();
                    let state = if s.draining.contains(&name) {
                        api::InstanceState::Draining
                    } else {
                        api::InstanceState::Ready
                    };
                    (
                        name,
                        api::InstanceChange {
                            instance: Some(i.clone()),
                            state: Some(state as i32),
                        },
                    )
                })
                .collect()
        }
    }

    /// Refuses every call with `code` from now on (`None`: stops refusing).
    pub fn refuse(&self, code: Option<tonic::Code>) {
        self.with(|s| s.refuse = code);
    }

    fn enter(&self, method: &'static str) -> Result<(), Status> {
        self.with(|s| {
            *s.calls.entry(method).or_default() += 1;
            if let Some(code) = s.refuse {
                return Err(Status::new(code, "scripted refusal of the caller's token"));
            }
            match s.failures.get_mut(method).and_then(VecDeque::pop_front) {
                Some(st) => Err(st),
                None => Ok(()),
            }
        })
    }

    /// Serves the fake on a fresh 127.0.0.1 port until `stop` is cancelled.
    pub async fn serve(&self, stop: CancellationToken) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.serve_on(listener, stop)
    }

    /// Serves the fake on `listener` until `stop` is cancelled.
    pub fn serve_on(&self, listener: tokio::net::TcpListener, stop: CancellationToken) -> SocketAddr {
        let addr = listener.local_addr().unwrap();
        let svc = ControllerServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(skipper::net::grpc_incoming(listener), stop.cancelled_owned())
                .await
                .unwrap();
        });
        addr
    }
}

type WatchStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<api::WatchInstancesResponse, Status>> + Send>>;

/// The changes from `old` to `new` (both by name).
fn diff(
    old: &[(String, api::InstanceChange)],
    new: &[(String, api::InstanceChange)],
) -> Vec<api::InstanceChange> {
    let mut out: Vec<api::InstanceChange> = new
        .iter()
        .filter(|(n, c)| !old.iter().any(|(o, oc)| o == n && oc == c))
        .map(|(_, c)| c.clone())
        .collect();
    for (n, _) in old {
        if !new.iter().any(|(x, _)| x == n) {
            out.push(api::InstanceChange {
                instance: Some(api::Instance {
                    name: Some(n.clone()),
                    ..Default::default()
                }),
                state: Some(api::InstanceState::Removed as i32),
            });
        }
    }
    out
}

#[tonic::async_trait]
impl ControllerService for FakeController {
    type WatchInstancesStream = WatchStream;

    async fn watch_instances(
        &self,
        request: Request<tonic::Streaming<api::WatchInstancesRequest>>,
    ) -> Result<Response<Self::WatchInstancesStream>, Status> {
        self.enter("WatchInstances")?;
        if !self.with(|s| s.streams) {
            return Err(Status::unimplemented("WatchInstances is not served"));
        }
        let mut incoming = request.into_inner();
        let first = incoming
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("no subscription"))?;
        let ended_before = self.with(|s| {
            s.subscriptions.push(first);
            s.open_streams += 1;
            s.end_streams.as_ref().map_or(0, |(g, _)| *g)
        });
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let fake = self.clone();
        tokio::spawn(async move {
            let mut changed = fake.changed.subscribe();
            let mut sent = fake.view();
            let mut version = 1u64;
            let snapshot = api::WatchInstancesResponse {
                version: Some(version),
                previous_version: None,
                snapshot: Some(true),
                changes: sent.iter().map(|(_, c)| c.clone()).collect(),
            };
            let mut reading = true;
            if tx.send(Ok(snapshot)).await.is_ok() {
                loop {
                    tokio::select! {
                        () = tx.closed() => break,
                        r = changed.changed() => {
                            if r.is_err() {
                                break;
                            }
                            let end = fake.state.lock().unwrap().end_streams.clone();
                            if let Some((g, status)) = end
                                && g > ended_before
                            {
                                let _ = tx.send(Err(status)).await;
                                break;
                            }
                            let next = fake.view();
                            let changes = diff(&sent, &next);
                            if !changes.is_empty() {
                                let msg = api::WatchInstancesResponse {
                                    version: Some(version + 1),
                                    previous_version: Some(version),
                                    snapshot: Some(false),
                                    changes,
                                };
                                if tx.send(Ok(msg)).await.is_err() {
                                    break;
                                }
                                version += 1;
                                sent = next;
                            }
                        }
                        m = incoming.message(), if reading => match m {
                            Ok(Some(req)) => fake.with(|s| s.idle_reports.extend(req.idle_instance_names)),
                            Ok(None) | Err(_) => reading = false,
                        },
                    }
                }
            }
            fake.with(|s| s.open_streams -= 1);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_instance(
        &self,
        request: Request<api::GetInstanceRequest>,
    ) -> Result<Response<api::GetInstanceResponse>, Status> {
        let req = request.into_inner();
        self.with(|s| {
            s.get_instance_requests.push(req.clone());
            for f in &s.get_instance_flags {
                f.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        });
        let mut open = self.get_instance_open.subscribe();
        let _ = open.wait_for(|o| *o).await;
        self.enter("GetInstance")?;
        self.with(|s| {
            let pick = s
                .instances
                .iter()
                .find(|i| {
                    !req.exclude_instance_names
                        .contains(&i.name.clone().unwrap_or_default())
                })
                .or(s.instances.first())
                .cloned();
            match pick {
                Some(mut i) => {
                    i.function = req.function.clone();
                    Ok(Response::new(api::GetInstanceResponse { instance: Some(i) }))
                }
                None => Err(Status::resource_exhausted("no instances")),
            }
        })
    }

    async fn heartbeat(
        &self,
        request: Request<api::HeartbeatRequest>,
    ) -> Result<Response<api::HeartbeatResponse>, Status> {
        self.enter("Heartbeat")?;
        let req = request.into_inner();
        if req.router_ip.as_deref().is_none_or(str::is_empty) {
            return Err(Status::invalid_argument("missing router_ip"));
        }
        self.with(|s| s.heartbeats.push(req));
        Ok(Response::new(api::HeartbeatResponse {}))
    }

    async fn scale(
        &self,
        request: Request<api::ScaleRequest>,
    ) -> Result<Response<api::ScaleResponse>, Status> {
        self.enter("Scale")?;
        self.with(|s| s.scales.push(request.into_inner()));
        Ok(Response::new(api::ScaleResponse { instances: vec![] }))
    }

    async fn release_instance(
        &self,
        request: Request<api::ReleaseInstanceRequest>,
    ) -> Result<Response<api::ReleaseInstanceResponse>, Status> {
        self.enter("ReleaseInstance")?;
        self.with(|s| s.releases.push(request.into_inner()));
        Ok(Response::new(api::ReleaseInstanceResponse {}))
    }

    async fn get_cluster_state(
        &self,
        _request: Request<api::GetClusterStateRequest>,
    ) -> Result<Response<api::GetClusterStateResponse>, Status> {
        self.enter("GetClusterState")?;
        Ok(Response::new(api::GetClusterStateResponse::default()))
    }
}

// ---------------------------------------------------------------------------
// Router and upstream helpers.

use axum::body::Body;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::response::IntoResponse;
use skipper::router::{self, Config};
use skipper::shutdown::Shutdown;

/// A valid function header for `deployment` / `tenant`.
pub fn function_header(deployment: &str, tenant: &str, oneshot: bool) -> String {
    format!(
        r#"{{"namespace":"ns","deployment":"{deployment}","tenant":"{tenant}","scale":{{"max_instances":3}},"oneshot":{oneshot}}}"#
    )
}

/// The function header of deployment `app` for tenant `t1`: the function
/// most tests send.
pub fn app_header() -> String {
    function_header("app", "t1", false)
}

/// `len` bytes of a pattern that does not repeat at any power of two, for
/// bodies whose every byte is checked at the far end.
pub fn pattern_body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// The JSON the test upstream's echo answered `resp` with; asserts a 200.
pub async fn echo_of(resp: reqwest::Response) -> serde_json::Value {
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

/// The values of header `name` the test upstream received, as its `echo`
/// reports them, in the order they arrived.
pub fn echoed_header(echo: &serde_json::Value, name: &str) -> Vec<String> {
    let headers: Vec<(String, String)> = serde_json::from_value(echo["headers"].clone()).unwrap();
    headers
        .into_iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v)
        .collect()
}

/// Asserts that the test upstream's `echo` received exactly `body` (its
/// length and digest).
pub fn assert_echoed_body(echo: &serde_json::Value, body: &[u8]) {
    assert_eq!(echo["body_len"], body.len());
    assert_eq!(echo["body_xxh64"], xxhash_rust::xxh64::xxh64(body, 0));
}

/// A router running on 127.0.0.1:0.
pub struct RouterHandle {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub shutdown: Shutdown,
    pub done: tokio::task::JoinHandle<Result<(), router::Error>>,
}

impl RouterHandle {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A request `method path` through the router with `header` as the
    /// function header.
    pub fn request_as(&self, method: reqwest::Method, path: &str, header: &str) -> reqwest::RequestBuilder {
        crate::http()
            .request(method, self.url(path))
            .header(skipper::domain::HEADER_FUNCTION, header)
    }

    /// A request `method path` through the router for [`app_header`]'s
    /// function.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.request_as(method, path, &app_header())
    }

    /// `GET path` through the router with `header` as the function header;
    /// panics on a transport error.
    pub async fn get_as(&self, path: &str, header: &str) -> reqwest::Response {
        self.request_as(reqwest::Method::GET, path, header)
            .send()
            .await
            .unwrap()
    }

    /// `GET path` through the router for [`app_header`]'s function; panics
    /// on a transport error.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.get_as(path, &app_header()).await
    }

    /// `POST path` with `body` through the router for [`app_header`]'s
    /// function; panics on a transport error.
    pub async fn post(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.request(reqwest::Method::POST, path)
            .body(body)
            .send()
            .await
            .unwrap()
    }

    /// Sends `body` with `method` to the test upstream's echo (`/upload`)
    /// for [`app_header`]'s function; asserts that it arrived byte for byte.
    pub async fn upload(&self, method: reqwest::Method, body: &[u8]) {
        let resp = self
            .request(method, "/upload")
            .body(body.to_vec())
            .send()
            .await
            .unwrap();
        assert_echoed_body(&echo_of(resp).await, body);
    }

    /// `GET path` for [`app_header`]'s function on a task of its own: the
    /// status it is answered with.
    pub fn get_in_background(&self, path: &str) -> tokio::task::JoinHandle<reqwest::StatusCode> {
        let req = self.request(reqwest::Method::GET, path);
        tokio::spawn(async move { req.send().await.unwrap().status() })
    }

    /// The router's metrics, as its `/metrics` endpoint exposes them.
    pub async fn metrics(&self) -> String {
        crate::get_text(format!("http://{}/metrics", self.metrics_addr)).await
    }

    /// The sum of the samples whose metrics line starts with `line_prefix`
    /// (every series of a metric, or one series).
    pub async fn metric(&self, line_prefix: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with(line_prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Triggers shutdown and waits (bounded) for the router to return.
    pub async fn stop(self) {
        self.shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(10), self.done)
            .await
            .expect("router did not stop in time")
            .unwrap()
            .unwrap();
        assert!(self.shutdown.drain(Duration::from_secs(10)).await);
    }
}

/// Test defaults: short intervals and backoffs.
pub fn test_config(controllers: Vec<SocketAddr>) -> Config {
    let mut c = Config::with_controllers("10.1.2.3", controllers);
    c.heartbeat_interval = Duration::from_millis(50);
    c.retry_min = Duration::from_millis(5);
    c.retry_max = Duration::from_millis(20);
    c.dial_timeout = Duration::from_millis(500);
    c.get_instance_timeout = Duration::from_secs(2);
    c
}

/// Starts a router with `config`.
pub async fn start_router(config: Config) -> RouterHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let shutdown = Shutdown::new();
    let done = tokio::spawn(router::serve(config, listener, Some(metrics), shutdown.clone()));
    RouterHandle {
        addr,
        metrics_addr,
        shutdown,
        done,
    }
}

/// Controls of the test upstream.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    /// Requests that reached `/block` or `/sse`.
    pub arrived: Arc<watch::Sender<usize>>,
    /// Opens the gate `/block` and `/sse` wait on.
    pub gate: Arc<watch::Sender<bool>>,
    /// Requests inside `/block` now, and the most there were at once.
    blocked: Arc<std::sync::atomic::AtomicUsize>,
    peak: Arc<std::sync::atomic::AtomicUsize>,
}

impl Upstream {
    pub async fn wait_arrived(&self, n: usize) {
        let mut rx = self.arrived.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|v| *v >= n))
            .await
            .expect("requests did not reach the upstream in time")
            .unwrap();
    }

    pub fn open(&self) {
        self.gate.send_replace(true);
    }

    /// The most requests that were inside `/block` at once.
    pub fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn wait_gate(gate: &watch::Sender<bool>) {
    let mut rx = gate.subscribe();
    let _ = rx.wait_for(|open| *open).await;
}

/// Echoes method, URI, HTTP version, headers and a digest of the body as JSON.
async fn echo(req: http::Request<Body>) -> impl IntoResponse {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("?").to_owned()))
        .collect();
    axum::Json(serde_json::json!({
        "method": parts.method.as_str(),
        "uri": parts.uri.to_string(),
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_len": bytes.len(),
        "body_xxh64": xxhash_rust::xxh64::xxh64(&bytes, 0),
    }))
}

/// Starts the test upstream on 127.0.0.1:0 (HTTP/1.1 and h2c).
pub async fn start_upstream() -> Upstream {
    use axum::routing::{any, get};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let up = Upstream {
        addr,
        arrived: Arc::new(watch::channel(0).0),
        gate: Arc::new(watch::channel(false).0),
        blocked: Arc::default(),
        peak: Arc::default(),
    };
    let (u1, u2) = (up.clone(), up.clone());
    let app = axum::Router::new()
        .route("/hello", any(|| async { "hello world" }))
        .route(
            "/peer",
            any(
                |axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>| async move {
                    peer.to_string()
                },
            ),
        )
        .route(
            "/sink",
            any(|body: Body| async move {
                let mut stream = body.into_data_stream();
                let mut total = 0usize;
                while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
                    // A body cut short by the router ends the count.
                    let Ok(chunk) = chunk else { break };
                    total += chunk.len();
                }
                total.to_string()
            }),
        )
        .route(
            "/status/{code}",
            any(|axum::extract::Path(code): axum::extract::Path<u16>| async move {
                (
                    http::StatusCode::from_u16(code).unwrap(),
                    [("x-upstream", "yes")],
                    format!("status {code} from upstream"),
                )
            }),
        )
        .route(
            "/block",
            any(move || {
                let up = u1.clone();
                async move {
                    use std::sync::atomic::Ordering;
                    let now = up.blocked.fetch_add(1, Ordering::SeqCst) + 1;
                    up.peak.fetch_max(now, Ordering::SeqCst);
                    up.arrived.send_modify(|n| *n += 1);
                    wait_gate(&up.gate).await;
                    up.blocked.fetch_sub(1, Ordering::SeqCst);
                    "unblocked"
                }
            }),
        )
        .route(
            "/sse",
            get(move || {
                let up = u2.clone();
                async move {
                    up.arrived.send_modify(|n| *n += 1);
                    let stream = futures::stream::unfold(0u8, move |i| {
                        let up = up.clone();
                        async move {
                            match i {
                                0 => Some((Ok::<_, std::io::Error>("data: first\n\n".to_owned()), 1)),
                                1 => {
                                    wait_gate(&up.gate).await;
                                    Some((Ok("data: second\n\n".to_owned()), 2))
                                }
                                _ => None,
                            }
                        }
                    });
                    (
                        [(http::header::CONTENT_TYPE, "text/event-stream")],
                        Body::from_stream(stream),
                    )
                }
            }),
        )
        .route(
            "/download/{n}",
            get(|axum::extract::Path(n): axum::extract::Path<usize>| async move {
                let chunk = bytes::Bytes::from(vec![b'x'; 64 * 1024]);
                let count = n.div_ceil(chunk.len());
                let stream =
                    futures::stream::iter((0..count).map(move |_| Ok::<_, std::io::Error>(chunk.clone())));
                Body::from_stream(stream)
            }),
        )
        .route(
            "/ws",
            get(|ws: WebSocketUpgrade| async move {
                ws.on_upgrade(|mut socket| async move {
                    while let Some(Ok(msg)) = socket.recv().await {
                        let reply = match msg {
                            Message::Text(t) => Message::Text(t),
                            Message::Close(_) => return,
                            _ => continue,
                        };
                        if socket.send(reply).await.is_err() {
                            return;
                        }
                    }
                })
            }),
        )
        .fallback(echo);
    tokio::spawn(async move {
        axum::serve(
            skipper::net::http_listener(listener),
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    up
}

/// A condition on the fake's state: the router's latest heartbeat reports
/// `n` requests in flight for some function.
pub fn in_flight(n: u32) -> impl FnMut(&State) -> bool {
    move |s: &State| {
        s.heartbeats
            .last()
            .is_some_and(|h| h.heartbeats.iter().any(|b| b.in_flight_requests == Some(n)))
    }
}

/// The router end to end: a fake controller offering one instance
/// (`pod-1`, the test upstream) and a router in front of it.
pub struct World {
    pub fake: FakeController,
    pub router: RouterHandle,
    pub upstream: Upstream,
    _stop: CancellationToken,
}

/// Starts a [`World`] whose router config `tweak` adjusts.
pub async fn world(tweak: impl FnOnce(&mut Config)) -> World {
    let fake = FakeController::new();
    let stop = CancellationToken::new();
    let ctrl = fake.serve(stop.clone()).await;
    let upstream = start_upstream().await;
    fake.add_instance("pod-1", upstream.addr);
    let mut config = test_config(vec![ctrl]);
    tweak(&mut config);
    let router = start_router(config).await;
    World {
        fake,
        router,
        upstream,
        _stop: stop,
    }
}

/// A port nothing listens on (connections are refused).
pub fn refused_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}
