//! TCP sockets as every server of the product accepts them: with
//! `TCP_NODELAY`.
//!
//! Without it, a response written in two parts (a gRPC reply's headers
//! before its message, an HTTP/2 `PING` acknowledgement before a reply, a
//! streamed body's second chunk) waits in the kernel for the peer to
//! acknowledge the first part (Nagle's algorithm), and a peer that delays
//! its acknowledgements sends it only after about 40 ms. Every server the
//! product runs — the controller's gRPC service and web UI, the router, the
//! metrics and profiling endpoints, the fixture — accepts through here; the
//! sockets it dials set the option where they are made.

use tokio::net::{TcpListener, TcpStream};

/// Sets `TCP_NODELAY` on `stream`; a failure (the socket is already gone)
/// is logged at debug and otherwise ignored, as the connection fails on
/// its own.
pub fn nodelay(stream: &TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on an accepted connection");
    }
}

/// A listener for `axum::serve` whose connections get `TCP_NODELAY`.
pub type HttpListener = axum::serve::TapIo<TcpListener, fn(&mut TcpStream)>;

/// `listener` for `axum::serve`, with `TCP_NODELAY` on every accepted
/// connection (connection info, `ConnectInfo<SocketAddr>`, works as on a
/// plain listener).
pub fn http_listener(listener: TcpListener) -> HttpListener {
    axum::serve::ListenerExt::tap_io(listener, |s: &mut TcpStream| nodelay(s))
}

/// `listener` as the incoming stream of a tonic server, with `TCP_NODELAY`
/// on every accepted connection (tonic's own `tcp_nodelay` setting applies
/// only to servers that bind their own port).
#[must_use]
pub fn grpc_incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accepting through the helpers gives sockets with the option set.
    #[tokio::test]
    async fn accepted_sockets_have_nodelay() {
        use futures::StreamExt as _;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut incoming = grpc_incoming(l);
        let _c = TcpStream::connect(addr).await.unwrap();
        let s = incoming.next().await.unwrap().unwrap();
        assert!(s.nodelay().unwrap());

        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut l = http_listener(l);
        let _c = TcpStream::connect(addr).await.unwrap();
        let (s, _) = axum::serve::Listener::accept(&mut l).await;
        assert!(s.nodelay().unwrap());
    }

    /// A response whose body goes out in two writes, on a kept-alive
    /// connection that has settled into request/response (so the client
    /// delays its acknowledgements): without `TCP_NODELAY` the second
    /// write waits for the acknowledgement of the first, about 40 ms.
    #[tokio::test]
    async fn a_response_written_in_two_parts_does_not_wait_for_an_acknowledgement() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = axum::Router::new().route(
            "/two",
            axum::routing::get(|| async {
                let parts = futures::stream::unfold(0u8, |i| async move {
                    match i {
                        0 => Some((Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"first")), 1)),
                        1 => {
                            // Pending once: the first part is written on its own.
                            tokio::task::yield_now().await;
                            Some((Ok(bytes::Bytes::from_static(b"second")), 2))
                        }
                        _ => None,
                    }
                });
                axum::body::Body::from_stream(parts)
            }),
        );
        let server = tokio::spawn(async move { axum::serve(http_listener(l), app).await });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.set_nodelay(true).unwrap();
        let mut took = Vec::new();
        for _ in 0..40 {
            let t0 = tokio::time::Instant::now();
            c.write_all(b"GET /two HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !got.ends_with(b"0\r\n\r\n") {
                let n = c.read(&mut buf).await.unwrap();
                assert!(n > 0, "the server closed the connection");
                got.extend_from_slice(&buf[..n]);
            }
            took.push(t0.elapsed());
        }
        // The first exchanges run before the client delays acknowledgements.
        let mut settled = took.split_off(10);
        settled.sort();
        let median = settled[settled.len() / 2];
        assert!(
            median < std::time::Duration::from_millis(20),
            "two-part responses took {median:?} (median; all: {settled:?})"
        );
        server.abort();
    }
}
