//! The upgrade tunnel: a `101 Switching Protocols` passes through to the
//! client, and a tracked task copies bytes both ways until either side
//! closes or tunnels are closed at shutdown.

use axum::body::Body;
use http::{HeaderValue, Response, header};
use hyper_util::rt::TokioIo;

use super::upstream::UpstreamBody;
use super::{Error, Hold, Proxy};

impl Proxy {
    /// Passes the instance's 101 through (after checking it switched to the
    /// protocol asked for) and starts the byte copy; `hold` lives as long
    /// as the tunnel.
    pub(super) fn tunnel(
        &self,
        mut resp: Response<UpstreamBody>,
        client_upgrade: hyper::upgrade::OnUpgrade,
        want: &HeaderValue,
        name: String,
        hold: Hold,
        ms: u64,
    ) -> Result<Response<Body>, Error> {
        let got = resp.headers().get(header::UPGRADE).cloned();
        let matches = got.as_ref().is_some_and(|g| {
            g.to_str()
                .unwrap_or_default()
                .eq_ignore_ascii_case(want.to_str().unwrap_or_default())
        });
        if !matches {
            return Err(Error::UpgradeMismatch {
                name,
                want: want.to_str().unwrap_or_default().to_owned(),
                got: got
                    .map(|g| g.to_str().unwrap_or_default().to_owned())
                    .unwrap_or_default(),
            });
        }
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let stop = self.tunnels.clone();
        self.tracker.spawn(tracing::Instrument::instrument(
            async move {
                let _hold = hold;
                let (client, upstream) = match tokio::try_join!(client_upgrade, upstream_upgrade) {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::warn!(instance = %name, error = %e, "upgrade failed");
                        return;
                    }
                };
                let mut client = TokioIo::new(client);
                let mut upstream = TokioIo::new(upstream);
                tokio::select! {
                    r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
                        if let Err(e) = r {
                            tracing::debug!(instance = %name, error = %e, "tunnel ended");
                        }
                    }
                    () = stop.cancelled() => tracing::debug!(instance = %name, "tunnel closed at shutdown"),
                }
            },
            tracing::Span::current(),
        ));
        let (mut parts, _) = resp.into_parts();
        parts
            .headers
            .insert(super::headers::GET_INSTANCE_DURATION_MS, super::duration_ms(ms));
        Ok(Response::from_parts(parts, Body::empty()))
    }
}
