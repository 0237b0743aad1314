//! Test harness for the controller client and the router: a scriptable fake
//! `ControllerService` served on 127.0.0.1:0, plus helpers to await
//! conditions with a deadline.
//!
//! Include it with `#[path = "common/router.rs"] mod harness;`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

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
}

/// A fake controller. Clones share state.
#[derive(Debug, Clone)]
pub struct FakeController {
    state: Arc<Mutex<State>>,
    changed: Arc<watch::Sender<u64>>,
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
        }
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
        self.with(|s| {
            s.instances.push(api::Instance {
                name: Some(name.to_owned()),
                addr: Some(addr.to_string()),
                ..Default::default()
            });
        });
    }

    pub fn calls(&self, method: &'static str) -> usize {
        self.with(|s| s.calls.get(method).copied().unwrap_or(0))
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

    fn enter(&self, method: &'static str) -> Result<(), Status> {
        self.with(|s| {
            *s.calls.entry(method).or_default() += 1;
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
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                )
                .await
                .unwrap();
        });
        addr
    }
}

#[tonic::async_trait]
impl ControllerService for FakeController {
    async fn get_instance(
        &self,
        request: Request<api::GetInstanceRequest>,
    ) -> Result<Response<api::GetInstanceResponse>, Status> {
        let req = request.into_inner();
        self.with(|s| s.get_instance_requests.push(req.clone()));
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
        self.with(|s| s.heartbeats.push(request.into_inner()));
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
