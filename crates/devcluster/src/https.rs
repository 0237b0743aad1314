//! The HTTPS listener of the simulated API server and of the node agent's
//! kubelet API ([`crate::kubelet::api`]): TLS with a serving certificate of
//! the cluster CA, client certificates verified against the cluster CA —
//! when a client offers one (as kube-apiserver's `--client-ca-file`), or
//! always ([`ClientAuth::Required`], as a kubelet's `--client-ca-file`) —
//! and the verified certificate's user attached to every request of the
//! connection ([`PeerCertificate`](crate::auth::PeerCertificate)). HTTP/1.1
//! only.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::Service as _;
use tracing::Instrument as _;

use super::auth::{PeerCertificate, UserInfo};
use super::pki::{CertKey, ClusterPki, subject_identity};

/// Open connections at most; further clients wait in the accept queue.
const MAX_CONNECTIONS: usize = 4096;
/// A TLS handshake that takes longer is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A request head that takes longer to arrive is dropped. hyper runs this
/// clock while a keep-alive connection waits for its next request too, so it
/// is longer than clients keep idle connections (90 s in hyper's pool, as in
/// Go's): a client never sends on a connection the server is closing.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(120);
/// How long open connections get to finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the cluster CA certificate: {0}")]
    Ca(rustls::Error),
    #[error("the client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("the serving certificate: {0}")]
    Serving(rustls::Error),
}

/// Whether a client must present a certificate of the CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client without one is served (and authenticates otherwise, e.g.
    /// with a bearer token); one it offers is verified.
    Optional,
    /// A client without one fails the handshake.
    Required,
}

/// The server side of the cluster's TLS for the API server: its serving
/// certificate, client certificates optional.
///
/// # Errors
/// [`TlsError`] when the generated material is unusable.
pub fn server_config(pki: &ClusterPki) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    server_config_for(pki.ca.cert_der(), &pki.serving, ClientAuth::Optional)
}

/// The server side of TLS with `serving` as the certificate, verifying
/// client certificates against the CA certificate `ca_der`.
///
/// # Errors
/// [`TlsError`] when the material is unusable.
pub fn server_config_for(
    ca_der: &[u8],
    serving: &CertKey,
    client_auth: ClientAuth,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca_der.to_vec()))
        .map_err(TlsError::Ca)?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone());
    let verifier = match client_auth {
        ClientAuth::Optional => verifier.allow_unauthenticated().build()?,
        ClientAuth::Required => verifier.build()?,
    };
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(serving.key_der.clone()));
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Serving)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![CertificateDer::from(serving.cert_der.clone())], key)
        .map_err(TlsError::Serving)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The user a verified client certificate names (`None` without one).
fn peer_identity(conn: &rustls::ServerConnection) -> Option<UserInfo> {
    let der = conn.peer_certificates()?.first()?;
    match subject_identity(der) {
        Ok((user, groups)) if !user.is_empty() => Some(UserInfo::new(&user, &groups)),
        _ => None,
    }
}

/// Serves `app` over TLS on `listener` until `shutdown`, then gives open
/// connections five seconds to finish.
pub async fn serve(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let connections = TaskTracker::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::debug!(error = %e, "accept");
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        // Watch events and streamed lists are written piece by piece: without
        // TCP_NODELAY a piece waits for the previous one's acknowledgement
        // (Nagle), which a client delays by up to 40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let (acceptor, app, shutdown) = (acceptor.clone(), app.clone(), shutdown.clone());
        connections.spawn(
            async move {
                let _permit = permit;
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
                let peer = PeerCertificate(peer_identity(tls.get_ref().1));
                let service =
                    hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                        req.extensions_mut().insert(peer.clone());
                        let mut app = app.clone();
                        async move { app.call(req).await }
                    });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades();
                tokio::pin!(conn);
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended");
                        }
                    }
                    () = shutdown.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(DRAIN_TIMEOUT, conn).await;
                    }
                }
            }
            .instrument(tracing::debug_span!("api connection", %remote)),
        );
    }
    connections.close();
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, connections.wait()).await;
}
