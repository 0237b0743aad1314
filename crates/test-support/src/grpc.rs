//! A gRPC client that writes the way Go's and C-core's do: every HTTP/2
//! frame in its own write (so each its own TCP segment), and a BDP `PING`
//! after the data it receives (so the server's small `PING`
//! acknowledgement goes out just before its next reply). Against a server
//! socket without `TCP_NODELAY` that pattern waits for a delayed
//! acknowledgement, about 40 ms; tonic's own client batches its writes and
//! rarely shows it.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::Channel;

/// A TCP stream that hands the kernel one HTTP/2 frame per write (the
/// client preface on its own).
struct FramePerWrite {
    inner: tokio::net::TcpStream,
    /// Bytes left of the preface or frame being written.
    left: usize,
    preface: bool,
}

impl FramePerWrite {
    /// How much of `buf` (which starts where the last write stopped)
    /// belongs to the current preface or frame.
    fn unit(&mut self, buf: &[u8]) -> usize {
        if self.left == 0 {
            self.left = if self.preface {
                self.preface = false;
                // "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                24
            } else if buf.len() >= 9 {
                // A frame header: 24-bit payload length, then 6 more bytes.
                9 + ((usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]))
            } else {
                buf.len()
            };
        }
        self.left.min(buf.len())
    }
}

impl AsyncRead for FramePerWrite {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for FramePerWrite {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let n = self.unit(buf);
        match Pin::new(&mut self.inner).poll_write(cx, &buf[..n]) {
            Poll::Ready(Ok(w)) => {
                self.left -= w;
                Poll::Ready(Ok(w))
            }
            other => other,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &**b);
        self.poll_write(cx, first)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A channel to `addr` through a [`FramePerWrite`] connection with
/// `TCP_NODELAY` and BDP pings (`http2_adaptive_window`).
///
/// # Panics
/// When the connection cannot be made.
pub async fn go_style_channel(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .http2_adaptive_window(true)
        .connect_with_connector(tower::service_fn(move |_: http::Uri| async move {
            let s = tokio::net::TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(FramePerWrite {
                inner: s,
                left: 0,
                preface: true,
            }))
        }))
        .await
        .unwrap()
}
