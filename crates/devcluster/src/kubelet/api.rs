//! The node agent's kubelet API: what kube-apiserver calls on a node for
//! `kubectl logs` (`pods/log`) and the node proxy (`nodes/proxy`).
//!
//! One HTTPS listener serves every node of the agent: they share the host's
//! address (each Node's `InternalIP`), and the port is the Nodes'
//! `daemonEndpoints.kubeletEndpoint.Port` ([`ApiSettings::port`]). TLS as a
//! kubelet's: a serving certificate of the cluster CA for that address and
//! the node names (kube-apiserver's `--kubelet-certificate-authority`
//! verifies it), and a client certificate of the cluster CA required of
//! every client (kube-apiserver's `--kubelet-client-certificate`). Every
//! verified client is allowed, as a kubelet with
//! `--authorization-mode=AlwaysAllow`.
//!
//! - `GET /containerLogs/{namespace}/{pod}/{container}`: the container's
//!   log with the query kube-apiserver forwards ([`LogOptions`]); `follow`
//!   streams until the instance ends, the client goes away or the agent
//!   stops. `404` for a pod that does not run here or a container it does
//!   not have, `400` for an instance that is not there (not started, no
//!   previous one) and for what the log files cannot answer
//!   (`timestamps`, `sinceSeconds`, `sinceTime`, a `stream` other than
//!   `All`); the body is the reason, in plain text, which kube-apiserver
//!   passes on as the message of its error.
//! - Any other path: `404`. Exec, attach, port-forward, stats and the other
//!   kubelet endpoints are not served.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::ContainerLogError;
use super::logs::{self, LogFile, LogOptions};
use crate::https::{self, ClientAuth, TlsError};
use crate::pki::CertKey;

/// The kubelet's port.
pub const KUBELET_PORT: u16 = 10250;

/// Where and with what the agent serves its kubelet API.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// The port, on the nodes' address ([`super::Settings::network`]).
    pub port: u16,
    /// The CA client certificates must be issued by (DER).
    pub client_ca_der: Vec<u8>,
    /// The serving certificate: for the nodes' address (and names).
    pub serving: CertKey,
}

/// Why the kubelet API could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
}

/// The containers whose logs the API serves.
pub trait LogSource: Send + Sync + 'static {
    /// The log file of container `container` of pod `ns/pod`: the current
    /// instance's, or with `previous` the one before it.
    ///
    /// # Errors
    /// [`ContainerLogError`]: no such pod or container here, or no such instance.
    fn log_file(
        &self,
        ns: &str,
        pod: &str,
        container: &str,
        previous: bool,
    ) -> Result<PathBuf, ContainerLogError>;

    /// Whether the instance that logs to `log` is starting or running.
    fn writes_log(&self, ns: &str, pod: &str, container: &str, log: &Path) -> bool;
}

/// Listens on `addr`.
///
/// # Errors
/// [`ApiError::Bind`].
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ApiError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ApiError::Bind { addr, source })
}

/// The TLS of the API: `settings.serving`, client certificates of
/// `settings.client_ca_der` required.
///
/// # Errors
/// [`ApiError::Tls`] when the material is unusable.
pub fn tls_config(settings: &ApiSettings) -> Result<Arc<rustls::ServerConfig>, ApiError> {
    Ok(https::server_config_for(
        &settings.client_ca_der,
        &settings.serving,
        ClientAuth::Required,
    )?)
}

#[derive(Clone)]
struct Api {
    source: Arc<dyn LogSource>,
    /// Ends followed logs when the agent stops.
    stop: CancellationToken,
}

/// The API's routes, answering from `source`; followed logs end when
/// `stop` fires. Serve it with [`https::serve`] and [`tls_config`].
pub fn router(source: Arc<dyn LogSource>, stop: &CancellationToken) -> axum::Router {
    axum::Router::new()
        .route(
            "/containerLogs/{namespace}/{pod}/{container}",
            axum::routing::get(container_logs),
        )
        .fallback(|| async { plain(StatusCode::NOT_FOUND, "404 page not found".to_owned()) })
        .with_state(Api {
            source,
            stop: stop.clone(),
        })
}

fn plain(status: StatusCode, text: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        text,
    )
        .into_response()
}

async fn container_logs(
    State(api): State<Api>,
    UrlPath((ns, pod, container)): UrlPath<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let options = match LogOptions::from_query(&query) {
        Ok(o) => o,
        Err(e) => return plain(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let path = match api.source.log_file(&ns, &pod, &container, options.previous) {
        Ok(p) => p,
        Err(e @ (ContainerLogError::PodNotFound { .. } | ContainerLogError::ContainerNotFound { .. })) => {
            return plain(StatusCode::NOT_FOUND, e.to_string());
        }
        Err(e @ ContainerLogError::Log(_)) => return plain(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let file = match LogFile::open(path.clone()) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "container log");
            return plain(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    };
    let source = api.source.clone();
    let writing = move || source.writes_log(&ns, &pod, &container, &path);
    match logs::body(file, &options, writing, api.stop.clone()) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain")],
            Body::from_stream(body),
        )
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "container log");
            plain(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control_plane::{Credential, client_from_kubeconfig, kubeconfig_text};
    use crate::kubelet::LogError;
    use crate::pki::Ca;
    use futures::{AsyncBufReadExt as _, StreamExt as _};
    use std::sync::Mutex;
    use std::time::Duration;
    use tokio_util::task::TaskTracker;

    /// Pod `ns/talker` with container `main`, whose current instance logs
    /// to `0.log` in `dir` while `running` holds.
    struct Fake {
        dir: PathBuf,
        running: Mutex<bool>,
    }

    impl LogSource for Fake {
        fn log_file(
            &self,
            ns: &str,
            pod: &str,
            container: &str,
            previous: bool,
        ) -> Result<PathBuf, ContainerLogError> {
            if (ns, pod) != ("ns", "talker") {
                return Err(ContainerLogError::PodNotFound { pod: pod.to_owned() });
            }
            if container != "main" {
                return Err(ContainerLogError::ContainerNotFound {
                    container: container.to_owned(),
                    pod: pod.to_owned(),
                });
            }
            if previous {
                return Err(LogError::NoPrevious {
                    container: container.to_owned(),
                    pod: pod.to_owned(),
                }
                .into());
            }
            Ok(self.dir.join("0.log"))
        }

        fn writes_log(&self, _: &str, _: &str, _: &str, log: &Path) -> bool {
            log == self.dir.join("0.log") && *self.running.lock().unwrap()
        }
    }

    struct Served {
        addr: SocketAddr,
        ca: Ca,
        fake: Arc<Fake>,
        stop: CancellationToken,
        tracker: TaskTracker,
    }

    async fn serve() -> Served {
        let dir = std::env::temp_dir().join(format!(
            "skipper-kubelet-api-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("0.log"), "one\ntwo\nthree\n").unwrap();
        let ca = Ca::generate("test-ca").unwrap();
        let settings = ApiSettings {
            port: 0,
            client_ca_der: ca.cert_der().to_vec(),
            serving: ca
                .issue_serving("node-agent", &["127.0.0.1".into(), "node-0".into()])
                .unwrap(),
        };
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Arc::new(Fake {
            dir,
            running: Mutex::new(true),
        });
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let app = router(fake.clone(), &stop);
        tracker.spawn(https::serve(
            listener,
            tls_config(&settings).unwrap(),
            app,
            stop.clone(),
        ));
        Served {
            addr,
            ca,
            fake,
            stop,
            tracker,
        }
    }

    impl Served {
        /// A client of the API with a client certificate of `issuer`.
        async fn client(&self, issuer: &Ca) -> kube::Client {
            let cert = issuer
                .issue_client("kube-apiserver-kubelet-client", &["system:masters"])
                .unwrap();
            let text = kubeconfig_text(
                "kubelet",
                &format!("https://{}", self.addr),
                self.ca.cert_pem(),
                &Credential::Certificate(&cert),
            );
            client_from_kubeconfig("the kubelet API", &text).await.unwrap()
        }

        async fn stop(self) {
            self.stop.cancel();
            self.tracker.close();
            tokio::time::timeout(Duration::from_secs(10), self.tracker.wait())
                .await
                .expect("the listener stops");
            std::fs::remove_dir_all(&self.fake.dir).unwrap();
        }
    }

    async fn get(client: &kube::Client, path: &str) -> Result<String, (u16, String)> {
        let req = http::Request::get(path).body(Vec::new()).unwrap();
        match client.request_text(req).await {
            Ok(text) => Ok(text),
            Err(kube::Error::Api(s)) => Err((s.code, s.message)),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }

    #[tokio::test]
    async fn logs_are_served_to_a_client_of_the_cluster_ca_with_the_query_kube_apiserver_sends() {
        let served = serve().await;
        let client = served.client(&served.ca).await;
        let logs = "/containerLogs/ns/talker/main";
        assert_eq!(get(&client, logs).await.unwrap(), "one\ntwo\nthree\n");
        assert_eq!(
            get(&client, &format!("{logs}?tailLines=1")).await.unwrap(),
            "three\n"
        );
        assert_eq!(
            get(&client, &format!("{logs}?tailLines=2&limitBytes=5"))
                .await
                .unwrap(),
            "two\nt"
        );
        assert_eq!(
            get(&client, &format!("{logs}?stream=All")).await.unwrap(),
            "one\ntwo\nthree\n"
        );
        let refused = |code: u16, text: &str| Err((code, text.to_owned()));
        assert!(matches!(get(&client, &format!("{logs}?timestamps=true")).await,
                Err((400, m)) if m.contains("timestamps is not supported by this node agent")),);
        assert!(matches!(
            get(&client, &format!("{logs}?sinceSeconds=5")).await,
            Err((400, m)) if m.contains("sinceSeconds")
        ));
        assert_eq!(
            get(&client, &format!("{logs}?previous=true")).await,
            refused(
                400,
                "previous terminated container \"main\" in pod \"talker\" not found"
            )
        );
        assert_eq!(
            get(&client, "/containerLogs/ns/gone/main").await,
            refused(404, "pod \"gone\" does not exist on this node")
        );
        assert_eq!(
            get(&client, "/containerLogs/ns/talker/other").await,
            refused(404, "container \"other\" not found in pod \"talker\"")
        );
        for path in [
            "/",
            "/exec/ns/talker/main",
            "/containerLogs/ns/talker",
            "/stats/summary",
        ] {
            assert!(matches!(get(&client, path).await, Err((404, _))), "{path}");
        }
        served.stop().await;
    }

    #[tokio::test]
    async fn a_client_without_a_certificate_of_the_cluster_ca_is_refused() {
        let served = serve().await;
        let other = Ca::generate("another-ca").unwrap();
        let stranger = served.client(&other).await;
        let req = http::Request::get("/containerLogs/ns/talker/main")
            .body(Vec::new())
            .unwrap();
        assert!(
            stranger.request_text(req).await.is_err(),
            "a certificate of another CA fails the handshake"
        );
        let text = kubeconfig_text(
            "anonymous",
            &format!("https://{}", served.addr),
            served.ca.cert_pem(),
            &Credential::Token("a-token"),
        );
        let anonymous = client_from_kubeconfig("anonymous", &text).await.unwrap();
        let req = http::Request::get("/containerLogs/ns/talker/main")
            .body(Vec::new())
            .unwrap();
        assert!(
            anonymous.request_text(req).await.is_err(),
            "no certificate fails the handshake"
        );
        served.stop().await;
    }

    #[tokio::test]
    async fn a_followed_log_streams_until_the_instance_ends_or_the_agent_stops() {
        let served = serve().await;
        let client = served.client(&served.ca).await;
        let follow = |path: &str| http::Request::get(path).body(Vec::new()).unwrap();
        let append = |text: &str| {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(served.fake.dir.join("0.log"))
                .unwrap();
            f.write_all(text.as_bytes()).unwrap();
        };
        let wait = Duration::from_secs(10);

        let mut lines = client
            .request_stream(follow("/containerLogs/ns/talker/main?follow=true&tailLines=1"))
            .await
            .unwrap()
            .lines();
        let mut next = async || {
            tokio::time::timeout(wait, lines.next())
                .await
                .expect("a line or the end within 10 s")
        };
        assert_eq!(next().await.unwrap().unwrap(), "three");
        append("four\n");
        assert_eq!(next().await.unwrap().unwrap(), "four");
        append("five\n");
        *served.fake.running.lock().unwrap() = false;
        assert_eq!(
            next().await.unwrap().unwrap(),
            "five",
            "what the instance wrote last"
        );
        assert!(next().await.is_none(), "the stream ends with the instance");

        *served.fake.running.lock().unwrap() = true;
        // A client that goes away ends its followed log: the stream (which
        // holds the source) is dropped.
        let idle = Arc::strong_count(&served.fake);
        let lines = client
            .request_stream(follow("/containerLogs/ns/talker/main?follow=true"))
            .await
            .unwrap()
            .lines();
        assert_eq!(
            Arc::strong_count(&served.fake),
            idle + 1,
            "a followed log holds the source"
        );
        drop(lines);
        let deadline = tokio::time::Instant::now() + wait;
        while Arc::strong_count(&served.fake) > idle {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the followed log of a client that went away still runs after {wait:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let mut lines = client
            .request_stream(follow("/containerLogs/ns/talker/main?follow=1&tailLines=0"))
            .await
            .unwrap()
            .lines();
        append("six\n");
        let line = tokio::time::timeout(wait, lines.next()).await.unwrap();
        assert_eq!(line.unwrap().unwrap(), "six");
        served.stop.cancel();
        let end = tokio::time::timeout(wait, lines.next()).await;
        assert!(
            matches!(end, Ok(None | Some(Err(_)))),
            "a stopping agent ends followed logs: {end:?}"
        );
        served.stop().await;
    }
}
