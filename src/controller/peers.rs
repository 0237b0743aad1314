//! Clients of the other controllers, keyed by pod IP and dialled on the
//! controller's own `--port`. Heartbeats and state go through the shared
//! typed client ([`crate::client`]); a forwarded `Scale` carries its hop
//! count in the `x-skipper-forward-hops` metadata entry, which that client
//! cannot set, so it uses a plain channel with one attempt inside the
//! caller's deadline (a hop-limited forward must not be replayed).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::auth::Caller;
use super::error::{Error, Result};
use crate::api::{self, controller_service_client::ControllerServiceClient};
use crate::client::{ChannelSettings, Client, Endpoints, Transport};
use crate::credentials::Credentials;
use crate::domain::{ASSIGN_TIMING_METADATA, AssignTiming};

/// Metadata key carrying how many controllers a `Scale` passed through.
pub const HOPS_METADATA: &str = "x-skipper-forward-hops";

/// Hops a forwarded call (`Scale`, `WatchInstances`) travelled so far.
/// Only a peer controller forwards: a router cannot make a non-owner serve
/// the call by claiming hops.
pub fn forwarded_hops<T>(request: &tonic::Request<T>) -> u32 {
    if !Caller::of(request).may_forward() {
        return 0;
    }
    request
        .metadata()
        .get(HOPS_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Deadline of one peer `GetClusterState`.
const STATE_DEADLINE: Duration = Duration::from_secs(2);

/// Lazily created clients of peer controllers.
#[derive(Debug)]
pub struct Peers {
    port: u16,
    credentials: Credentials,
    clients: scc::HashMap<String, Client>,
    channels: scc::HashMap<String, tonic::transport::Channel>,
}

impl Peers {
    /// Peers dialled on `port`, called with `credentials`.
    #[must_use]
    pub fn new(port: u16, credentials: Credentials) -> Self {
        Self {
            port,
            credentials,
            clients: scc::HashMap::new(),
            channels: scc::HashMap::new(),
        }
    }

    fn client(&self, ip: &str) -> Result<Client> {
        if let Some(c) = self.clients.read_sync(ip, |_, c| c.clone()) {
            return Ok(c);
        }
        let addr: IpAddr = ip.parse().map_err(|_| Self::bad_ip(ip))?;
        let client = Client::new(
            Endpoints::fixed(
                &[SocketAddr::new(addr, self.port)],
                ChannelSettings {
                    connect_timeout: Duration::from_secs(1),
                    ..ChannelSettings::default()
                },
            )
            .with_credentials(self.credentials.clone()),
        );
        let _ = self.clients.insert_sync(ip.to_owned(), client.clone());
        Ok(client)
    }

    /// The channel to peer `ip`.
    fn channel(&self, ip: &str) -> Result<tonic::transport::Channel> {
        if let Some(c) = self.channels.read_sync(ip, |_, c| c.clone()) {
            return Ok(c);
        }
        let addr: IpAddr = ip.parse().map_err(|_| Self::bad_ip(ip))?;
        let uri = format!("http://{}", SocketAddr::new(addr, self.port));
        let channel = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|_| Self::bad_ip(ip))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .connect_lazy();
        let _ = self.channels.insert_sync(ip.to_owned(), channel.clone());
        Ok(channel)
    }

    /// A client of peer `ip` presenting this controller's token (one
    /// attempt per call; for forwards).
    ///
    /// # Errors
    /// [`Error::Peer`] when `ip` is not an IP address.
    pub(crate) fn grpc(&self, ip: &str) -> Result<ControllerServiceClient<Transport>> {
        let channel = self.channel(ip)?;
        Ok(ControllerServiceClient::with_interceptor(
            channel,
            self.credentials.clone(),
        ))
    }

    fn bad_ip(ip: &str) -> Error {
        Self::wrap(
            ip,
            crate::client::Error::NoEndpoints {
                method: crate::client::Method::Scale,
            },
        )
    }

    /// Drops the clients of controllers that left the ring.
    pub fn retain(&self, members: &[impl AsRef<str>]) {
        self.clients
            .retain_sync(|ip, _| members.iter().any(|m| m.as_ref() == ip));
        self.channels
            .retain_sync(|ip, _| members.iter().any(|m| m.as_ref() == ip));
    }

    fn wrap(ip: &str, e: crate::client::Error) -> Error {
        Error::Peer {
            peer: ip.to_owned(),
            source: Box::new(e),
        }
    }

    /// Forwards a `Scale` to `ip`.
    ///
    /// # Errors
    /// [`Error::Peer`].
    pub async fn scale(
        &self,
        ip: &str,
        req: api::ScaleRequest,
        hops: u32,
        deadline: Duration,
    ) -> Result<(api::ScaleResponse, Option<AssignTiming>)> {
        let mut client = self.grpc(ip)?;
        let mut request = tonic::Request::new(req);
        request.set_timeout(deadline);
        if let Ok(v) = hops.to_string().parse() {
            request.metadata_mut().insert(HOPS_METADATA, v);
        }
        crate::telemetry::otel::inject_grpc(request.metadata_mut());
        let call = client.scale(request);
        match tokio::time::timeout(deadline, call).await {
            Ok(Ok(resp)) => {
                let timing = resp
                    .metadata()
                    .get(ASSIGN_TIMING_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .and_then(AssignTiming::decode);
                Ok((resp.into_inner(), timing))
            }
            Ok(Err(status)) => Err(Self::wrap(
                ip,
                crate::client::Error::Rpc {
                    method: crate::client::Method::Scale,
                    status: Box::new(status),
                },
            )),
            Err(_) => Err(Self::wrap(
                ip,
                crate::client::Error::DeadlineExceeded {
                    method: crate::client::Method::Scale,
                    deadline,
                },
            )),
        }
    }

    /// Forwards heartbeats to `ip`.
    ///
    /// # Errors
    /// [`Error::Peer`].
    pub async fn heartbeat(&self, ip: &str, req: api::HeartbeatRequest, deadline: Duration) -> Result<()> {
        let client = self.client(ip)?;
        client
            .heartbeat(req, deadline)
            .await
            .map(|_| ())
            .map_err(|e| Self::wrap(ip, e))
    }

    /// The local state of peer `ip`.
    ///
    /// # Errors
    /// [`Error::Peer`].
    pub async fn cluster_state(&self, ip: &str) -> Result<api::ClusterState> {
        let client = self.client(ip)?;
        let resp = client
            .get_cluster_state(
                api::GetClusterStateRequest {
                    local_only: Some(true),
                },
                STATE_DEADLINE,
            )
            .await
            .map_err(|e| Self::wrap(ip, e))?;
        Ok(resp.cluster_state.unwrap_or_default())
    }
}
