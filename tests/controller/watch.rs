//! `WatchInstances` against the simulator: a snapshot then versioned
//! changes as instances come and go, draining before a scale-down (waiting
//! for routers' idle reports, or the deadline), forwarding from a non-owner,
//! and `ABORTED` when the ring moves the function.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::collections::BTreeMap;
use std::time::Duration;

use harness::{CTL_NS, Ctl, Sim, eventually, function, tenant_owned_by};
use skipper::api::{self, InstanceState};
use skipper::domain::Function;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

const LIMIT: Duration = Duration::from_secs(20);

type Grpc = api::controller_service_client::ControllerServiceClient<Channel>;

/// A router's view of one stream: the table it keeps and the version check.
struct Watcher {
    tx: mpsc::Sender<api::WatchInstancesRequest>,
    stream: tonic::Streaming<api::WatchInstancesResponse>,
    version: Option<u64>,
    table: BTreeMap<String, InstanceState>,
}

impl Watcher {
    async fn open(grpc: &Grpc, f: &Function) -> Self {
        let (tx, rx) = mpsc::channel(8);
        tx.send(api::WatchInstancesRequest {
            function: Some(f.into()),
            idle_instance_names: vec![],
            router_ip: Some("10.0.0.9".into()),
        })
        .await
        .unwrap();
        let stream = grpc
            .clone()
            .watch_instances(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self {
            tx,
            stream,
            version: None,
            table: BTreeMap::new(),
        }
    }

    /// The next message, applied to the table (checking that changes name
    /// the version the table is at).
    async fn next(&mut self) -> api::WatchInstancesResponse {
        let msg = tokio::time::timeout(LIMIT, self.stream.message())
            .await
            .expect("a stream message in time")
            .unwrap()
            .expect("the stream is open");
        if msg.snapshot == Some(true) {
            assert!(self.version.is_none(), "one snapshot per stream");
            self.table.clear();
        } else {
            assert_eq!(msg.previous_version, self.version, "changes continue the version");
        }
        assert!(msg.version > self.version, "versions grow");
        self.version = msg.version;
        for c in &msg.changes {
            let name = c.instance.as_ref().unwrap().name.clone().unwrap();
            match InstanceState::try_from(c.state.unwrap()).unwrap() {
                InstanceState::Removed => {
                    self.table.remove(&name);
                }
                s => {
                    assert!(c.instance.as_ref().unwrap().addr.is_some());
                    self.table.insert(name, s);
                }
            }
        }
        msg
    }

    /// Reads messages until the table satisfies `cond`.
    async fn until(&mut self, what: &str, cond: impl Fn(&BTreeMap<String, InstanceState>) -> bool) {
        tokio::time::timeout(LIMIT, async {
            while !cond(&self.table) {
                self.next().await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("stream never showed {what}: {:?}", self.table));
    }

    async fn report_idle(&self, names: &[String]) {
        self.tx
            .send(api::WatchInstancesRequest {
                function: None,
                idle_instance_names: names.to_vec(),
                router_ip: None,
            })
            .await
            .unwrap();
    }

    /// The status the stream ended with.
    async fn ended(&mut self) -> tonic::Status {
        tokio::time::timeout(LIMIT, async {
            loop {
                match self.stream.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the stream ended without a status"),
                    Err(s) => return s,
                }
            }
        })
        .await
        .expect("the stream ends in time")
    }
}

fn ready(t: &BTreeMap<String, InstanceState>) -> Vec<String> {
    t.iter()
        .filter(|(_, s)| **s == InstanceState::Ready)
        .map(|(n, _)| n.clone())
        .collect()
}

fn scale(f: &Function, desired: u32) -> tonic::Request<api::ScaleRequest> {
    harness::scale(f, desired, LIMIT)
}

type ScaleDown = tokio::task::JoinHandle<Result<tonic::Response<api::ScaleResponse>, tonic::Status>>;

/// Scales `f` to two instances, then (in a task) down to one while `w`
/// watches, and returns that task with the instance marked draining. A
/// scale-down first deletes instances that are not ready, without draining
/// them (routers do not have them): the simulator's readiness probes can
/// flap on a loaded machine, so the cycle is repeated until an instance
/// drains.
async fn drain_one(grpc: &Grpc, w: &mut Watcher, f: &Function) -> (ScaleDown, String) {
    for _ in 0..5 {
        grpc.clone().scale(scale(f, 2)).await.unwrap();
        w.until("two ready instances", |t| ready(t).len() == 2).await;
        let mut g = grpc.clone();
        let fc = f.clone();
        let mut down: ScaleDown = tokio::spawn(async move { g.scale(scale(&fc, 1)).await });
        let draining = tokio::time::timeout(LIMIT, async {
            loop {
                if let Some((n, _)) = w.table.iter().find(|(_, s)| **s == InstanceState::Draining) {
                    return Some(n.clone());
                }
                tokio::select! {
                    _ = w.next() => {}
                    r = &mut down => {
                        r.unwrap().unwrap();
                        return None;
                    }
                }
            }
        })
        .await
        .expect("the scale-down drains or ends");
        if let Some(name) = draining {
            return (down, name);
        }
    }
    panic!("five scale-downs removed an unready instance instead of draining one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_follows_the_instances_and_a_scale_down_waits_for_idle_reports() {
    let sim = Sim::with_pool("pool", 3).await;
    let mut config = sim.config("127.0.0.1");
    // Long enough that only the reports can end the drain in this test.
    config.drain_timeout = Duration::from_secs(60);
    let mut ctl = Ctl::start(&sim, config, TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let f = function("pool", "w1", 3);

    let mut w = Watcher::open(&ctl.grpc, &f).await;
    let snap = w.next().await;
    assert_eq!(snap.snapshot, Some(true));
    assert!(snap.changes.is_empty(), "a cold function has no instances");

    let first = ctl.instance(&f, LIMIT).await.name.unwrap();
    w.until("the first instance ready", |t| ready(t) == [first.clone()])
        .await;
    ctl.grpc.scale(scale(&f, 2)).await.unwrap();
    w.until("two ready instances", |t| ready(t).len() == 2).await;

    // Scale down to one: an instance drains and stays until the router
    // reports it idle.
    let (down, draining) = drain_one(&ctl.grpc, &mut w, &f).await;
    assert!(
        sim.live_pod(&draining).await.is_some(),
        "not deleted before the report"
    );
    assert!(!down.is_finished());
    // GetInstance never hands out a draining instance.
    for _ in 0..5 {
        assert_ne!(ctl.instance(&f, LIMIT).await.name.unwrap(), draining);
    }
    w.report_idle(std::slice::from_ref(&draining)).await;
    let resp = tokio::time::timeout(LIMIT, down).await.unwrap().unwrap().unwrap();
    assert_eq!(resp.into_inner().instances.len(), 1);
    w.until("the drained instance removed", |t| !t.contains_key(&draining))
        .await;
    assert!(sim.live_pod(&draining).await.is_none());
    assert_eq!(ready(&w.table).len(), 1);
    let _ = first;
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_ends_at_its_deadline_or_when_every_stream_reported_or_left() {
    let sim = Sim::with_pool("pool", 3).await;
    let mut config = sim.config("127.0.0.1");
    config.drain_timeout = Duration::from_secs(1);
    let ctl = Ctl::start(&sim, config, TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let f = function("pool", "w2", 3);

    // Nobody reports: the pod is deleted once --drain-timeout passed.
    let mut silent = Watcher::open(&ctl.grpc, &f).await;
    let (down, draining) = drain_one(&ctl.grpc, &mut silent, &f).await;
    tokio::time::timeout(LIMIT, down).await.unwrap().unwrap().unwrap();
    silent
        .until("the drained instance removed", |t| !t.contains_key(&draining))
        .await;
    drop(silent);
    ctl.stop().await;

    // Two routers: one reports, the other goes away: the drain is done
    // long before its deadline.
    let mut config = sim.config("127.0.0.1");
    config.drain_timeout = Duration::from_secs(60);
    let ctl = Ctl::start(&sim, config, TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let mut a = Watcher::open(&ctl.grpc, &f).await;
    let b = Watcher::open(&ctl.grpc, &f).await;
    let (down, draining) = drain_one(&ctl.grpc, &mut a, &f).await;
    a.report_idle(std::slice::from_ref(&draining)).await;
    drop(b);
    tokio::time::timeout(LIMIT, down).await.unwrap().unwrap().unwrap();
    a.until("the drained instance removed", |t| !t.contains_key(&draining))
        .await;
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_non_owner_forwards_the_stream_and_a_ring_change_aborts_it() {
    let sim = Sim::with_pool("pool", 2).await;
    let (mut a, b) = sim.ring_of_two(|ip| sim.ring_config(ip)).await;
    // A function A owns, watched through B (forwarded) and on A itself.
    let tenant = tenant_owned_by("pool", &[a.pod_ip(), b.pod_ip()], a.pod_ip());
    let f = function("pool", &tenant, 1);
    let mut via_b = Watcher::open(&b.grpc, &f).await;
    let mut on_a = Watcher::open(&a.grpc, &f).await;
    via_b.next().await;
    on_a.next().await;
    let name = a.instance(&f, LIMIT).await.name.unwrap();
    via_b
        .until("the instance, forwarded", |t| ready(t) == [name.clone()])
        .await;
    on_a.until("the instance", |t| ready(t) == [name.clone()]).await;
    assert!(
        b.core.cluster.feeds.get(f.id()).is_none(),
        "B forwards; it keeps no feed"
    );
    assert!(a.core.cluster.feeds.get(f.id()).is_some());
    // A new owner's snapshot comes from its own cache: B must have seen A's
    // ready-at annotation of the instance (A has it in memory at once and
    // patches it in the background; B sees it through its watch): the
    // patch on the API server, then the barrier.
    eventually("the instance's ready-at annotation", LIMIT, || async {
        let pod = sim.live_pod(&name).await?;
        pod.metadata
            .annotations
            .as_ref()?
            .contains_key(skipper::domain::ANNOTATION_READY_AT)
            .then_some(())
    })
    .await;
    sim.caught_up().await;

    // A leaves the ring: both streams end with ABORTED, and B serves the
    // function from then on.
    sim.delete_pod(CTL_NS, "controller-a").await;
    assert_eq!(via_b.ended().await.code(), Code::Aborted);
    assert_eq!(on_a.ended().await.code(), Code::Aborted);
    eventually("B owns the function", LIMIT, || async {
        b.core.cluster.is_owner(f.id()).then_some(())
    })
    .await;
    let mut again = Watcher::open(&b.grpc, &f).await;
    again.next().await;
    assert_eq!(
        ready(&again.table),
        std::slice::from_ref(&name),
        "the snapshot has the instance"
    );
    drop(again);
    let _ = &mut a;
    a.stop().await;
    b.stop().await;
}
