//! `WatchInstances`: the streams that feed routers' instance tables from
//! this controller's [`Feeds`](super::feeds::Feeds).
//!
//! Each stream sends a snapshot of its function's view, then the difference
//! between the view it last sent and the current one, naming the version it
//! applies to; a router's messages report draining instances idle.
//!
//! The function's ring owner serves the streams; another controller
//! forwards the stream to the owner (one hop, as `Scale` does). A stream
//! ends with `ABORTED` when the ring moves the function to another
//! controller (routers subscribe again at once), and with `UNAVAILABLE`
//! when the controller shuts down.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::core::{Core, MAX_SCALE_HOPS};
use super::error::Error;
use super::feeds::{StreamSlot, Subscription, View};
use super::peers::{HOPS_METADATA, forwarded_hops};
use crate::api;
use crate::domain::{Function, FunctionId};

/// Bound on the router's first message (the subscription).
pub const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on opening a forwarded stream to the owner.
pub const FORWARD_OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// Responses buffered per stream before the stream waits for its router.
const STREAM_BUFFER: usize = 16;

/// The stream a `WatchInstances` call answers with.
pub type ResponseStream = Pin<Box<dyn Stream<Item = Result<api::WatchInstancesResponse, Status>> + Send>>;

/// Serves one `WatchInstances` call: reads the subscription, then streams
/// locally (this controller owns the function, or the call already
/// travelled [`MAX_SCALE_HOPS`]) or forwards to the owner.
///
/// # Errors
/// `INVALID_ARGUMENT` for a missing or invalid function, `UNAVAILABLE`
/// while starting or when the owner cannot be reached.
pub async fn serve(
    core: Arc<Core>,
    request: Request<Streaming<api::WatchInstancesRequest>>,
) -> Result<Response<ResponseStream>, Status> {
    let hops = forwarded_hops(&request);
    let mut incoming = request.into_inner();
    let first = match tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, incoming.message()).await {
        Ok(Ok(Some(m))) => m,
        Ok(Ok(None)) => return Err(Error::MissingFunction.into()),
        Ok(Err(status)) => return Err(status),
        Err(_) => return Err(Error::NoSubscription(FIRST_MESSAGE_TIMEOUT).into()),
    };
    let f = core.admit(first.function.as_ref())?;
    core.ensure_synced()?;
    let feeds = &core.cluster.feeds;
    let Some(slot) = feeds.open_stream() else {
        return Err(Error::TooManyStreams { limit: feeds.limit() }.into());
    };
    let ring = core.cluster.ring.current();
    let owner = ring
        .owner(f.id())
        .map(str::to_owned)
        .ok_or(Error::Ring(crate::ring::RingError::Empty(Duration::ZERO)))?;
    let router = first.router_ip.clone().unwrap_or_default();
    if owner != core.config.pod_ip && hops < MAX_SCALE_HOPS {
        tracing::debug!(function = %f.id(), %owner, %router, "forwarding instance stream");
        return forward(core, f, owner, first, incoming, hops + 1, slot).await;
    }
    tracing::debug!(function = %f.id(), %router, "serving instance stream");
    let (member, view) = feeds.subscribe(&core.cluster.state, &core.shutdown, &f).await;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let stream = stream_local(core.clone(), f.id(), owner, view, member, incoming, tx);
    core.shutdown.spawn("instance-stream", async move {
        let _slot = slot;
        stream.await;
    });
    Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
}

fn moved(id: FunctionId, owner: &str) -> Status {
    Error::Moved {
        id,
        owner: owner.to_owned(),
    }
    .into()
}

fn shutting_down() -> Status {
    Error::ShuttingDown.into()
}

async fn stream_local(
    core: Arc<Core>,
    id: FunctionId,
    owner: String,
    mut view: watch::Receiver<Arc<View>>,
    member: Subscription,
    mut incoming: Streaming<api::WatchInstancesRequest>,
    tx: mpsc::Sender<Result<api::WatchInstancesResponse, Status>>,
) {
    let stop = core.shutdown.token().clone();
    let mut ring = core.cluster.ring.subscribe();
    let mut sent = view.borrow_and_update().clone();
    if tx.send(Ok(sent.snapshot())).await.is_err() {
        return;
    }
    let mut reading = true;
    loop {
        tokio::select! {
            () = stop.cancelled() => {
                let _ = tx.send(Err(shutting_down())).await;
                return;
            }
            () = tx.closed() => return,
            r = ring.changed() => {
                let now = r.ok().and_then(|()| ring.borrow_and_update().owner(id).map(str::to_owned));
                if now.as_deref() != Some(owner.as_str()) {
                    let _ = tx.send(Err(moved(id, &owner))).await;
                    return;
                }
            }
            r = view.changed() => {
                if r.is_err() {
                    return;
                }
                let next = view.borrow_and_update().clone();
                if let Some(delta) = sent.diff(&next) {
                    if tx.send(Ok(delta)).await.is_err() {
                        return;
                    }
                    sent = next;
                }
            }
            m = incoming.message(), if reading => match m {
                Ok(Some(req)) => {
                    if !req.idle_instance_names.is_empty() {
                        member.report_idle(req.idle_instance_names);
                    }
                }
                // The router closed its half; it still receives.
                Ok(None) => reading = false,
                Err(_) => return,
            },
        }
    }
}

/// Forwards the stream to the owner `owner`, passing messages both ways.
async fn forward(
    core: Arc<Core>,
    f: Function,
    owner: String,
    first: api::WatchInstancesRequest,
    mut incoming: Streaming<api::WatchInstancesRequest>,
    hops: u32,
    slot: StreamSlot,
) -> Result<Response<ResponseStream>, Status> {
    let mut client = core.peers.grpc(&owner)?;
    let (up_tx, up_rx) = mpsc::channel(8);
    // A fresh channel with room for eight: cannot be full.
    let _ = up_tx.try_send(first);
    let mut request = Request::new(ReceiverStream::new(up_rx));
    if let Ok(v) = hops.to_string().parse() {
        request.metadata_mut().insert(HOPS_METADATA, v);
    }
    let mut upstream = match tokio::time::timeout(FORWARD_OPEN_TIMEOUT, client.watch_instances(request)).await
    {
        Ok(Ok(resp)) => resp.into_inner(),
        Ok(Err(status)) => {
            return Err(Error::PeerStream {
                peer: owner,
                code: status.code(),
                message: status.message().to_owned(),
            }
            .into());
        }
        Err(_) => {
            return Err(Error::PeerStream {
                peer: owner,
                code: tonic::Code::DeadlineExceeded,
                message: format!("no answer within {FORWARD_OPEN_TIMEOUT:?}"),
            }
            .into());
        }
    };
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let id = f.id();
    let stop = core.shutdown.token().clone();
    let mut ring = core.cluster.ring.subscribe();
    core.shutdown.spawn("instance-stream-forward", async move {
        let _slot = slot;
        let mut reading = true;
        loop {
            tokio::select! {
                () = stop.cancelled() => {
                    let _ = tx.send(Err(shutting_down())).await;
                    return;
                }
                () = tx.closed() => return,
                r = ring.changed() => {
                    let now = r.ok().and_then(|()| ring.borrow_and_update().owner(id).map(str::to_owned));
                    if now.as_deref() != Some(owner.as_str()) {
                        let _ = tx.send(Err(moved(id, &owner))).await;
                        return;
                    }
                }
                m = upstream.message() => match m {
                    Ok(Some(msg)) => {
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                },
                m = incoming.message(), if reading => match m {
                    Ok(Some(req)) => {
                        if up_tx.send(req).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => reading = false,
                    Err(_) => return,
                },
            }
        }
    });
    Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
}
