//! One attempt: connect to the chosen instance, send, wait for the response
//! headers — and tell apart the failures another instance can fix.

use http::{Request, Response, StatusCode};

use super::direct;
use super::select::Chosen;
use super::upstream::{ConnectError, SendError, UpstreamBody};
use super::{Error, Proxy, ReplayBody};

/// How one attempt ended. Moved once per attempt; boxing the response
/// would cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Outcome {
    /// The instance answered.
    Response(Response<UpstreamBody>),
    /// Nothing reached the instance's application (connect failed, the
    /// connection closed before the request was written, or the instance
    /// answered 421): exclude it and try another.
    Unusable(Error),
    /// The instance had the request: no retry.
    Final(Error),
}

impl Proxy {
    /// Sends `req` to `chosen`. A pooled connection that turns out closed
    /// before the request was written gets one fresh connection to the same
    /// instance. An idempotent request whose connection closed before any
    /// response arrived (the instance went away) counts as not delivered.
    pub(super) async fn attempt(&self, chosen: &Chosen, req: Request<ReplayBody>, upgrade: bool) -> Outcome {
        let idempotent = is_idempotent(req.method());
        let name = &chosen.slot.name;
        let addr = chosen.slot.addr;
        let conn = if upgrade {
            self.pool.connect_new(&chosen.slot, true).await
        } else {
            self.pool.connect(&chosen.slot).await
        };
        let mut conn = match conn {
            Ok(c) => c,
            Err(source) => {
                return Outcome::Unusable(Error::Connect {
                    name: name.clone(),
                    source,
                });
            }
        };
        let mut req = req;
        loop {
            let reused = conn.is_reused();
            let sending = conn.send(req, !upgrade);
            let sent = match self.settings.response_header_timeout {
                Some(t) => match tokio::time::timeout(t, sending).await {
                    Ok(r) => r,
                    Err(_) => {
                        return Outcome::Final(Error::ResponseHeaderTimeout {
                            name: name.clone(),
                            timeout: t,
                        });
                    }
                },
                None => sending.await,
            };
            match sent {
                Ok(resp) if resp.status() == StatusCode::MISDIRECTED_REQUEST => {
                    return Outcome::Unusable(Error::Misdirected { name: name.clone() });
                }
                Ok(resp) => return Outcome::Response(resp),
                Err(SendError::NotSent(back)) => {
                    req = *back;
                    // A pooled connection may just have aged out on the
                    // instance's side: one fresh connection, else the
                    // instance is unusable.
                    let fresh = if reused {
                        self.pool.connect_new(&chosen.slot, upgrade).await
                    } else {
                        Err(ConnectError::Closed { addr })
                    };
                    match fresh {
                        Ok(c) => conn = c,
                        Err(source) => {
                            return Outcome::Unusable(Error::Connect {
                                name: name.clone(),
                                source,
                            });
                        }
                    }
                }
                Err(SendError::Failed(source)) if refused_stream(&source) => {
                    return Outcome::Unusable(Error::from_send(name.clone(), source));
                }
                Err(SendError::Failed(source)) if idempotent && closed_before_response(&source) => {
                    return Outcome::Unusable(Error::from_send(name.clone(), source));
                }
                Err(SendError::Failed(source)) => {
                    return Outcome::Final(Error::from_send(name.clone(), source));
                }
            }
        }
    }
}

impl Proxy {
    /// A direct exchange ([`direct`]) of the request `head` with `chosen`,
    /// on a kept connection or a new one. The retry rule is the one of
    /// [`Proxy::attempt`]: a kept connection the instance closed before any
    /// response byte gets one fresh connection (for an idempotent request;
    /// the instance may have closed it while the request was on its way);
    /// a fresh one failing so counts as the instance unusable for an
    /// idempotent request, and is final otherwise.
    pub(super) async fn attempt_direct(
        &self,
        chosen: &Chosen,
        head: &[u8],
        method: &http::Method,
    ) -> Outcome {
        let slot = &chosen.slot;
        let idempotent = is_idempotent(method);
        let connect_failed = |source| {
            Outcome::Unusable(Error::Connect {
                name: slot.name.clone(),
                source,
            })
        };
        let (mut conn, mut reused) = match slot.connections.take_direct() {
            Some(c) => (c, true),
            None => match self.pool.dial_direct(slot).await {
                Ok(c) => (c, false),
                Err(source) => return connect_failed(source),
            },
        };
        loop {
            let exchanging = direct::exchange(conn, head, method, slot.clone());
            let result = match self.settings.response_header_timeout {
                Some(t) => match tokio::time::timeout(t, exchanging).await {
                    Ok(r) => r,
                    Err(_) => {
                        return Outcome::Final(Error::ResponseHeaderTimeout {
                            name: slot.name.clone(),
                            timeout: t,
                        });
                    }
                },
                None => exchanging.await,
            };
            let failed = |source| Error::Exchange {
                name: slot.name.clone(),
                source,
            };
            match result {
                Ok(resp) if resp.status() == StatusCode::MISDIRECTED_REQUEST => {
                    return Outcome::Unusable(Error::Misdirected {
                        name: slot.name.clone(),
                    });
                }
                Ok(resp) => return Outcome::Response(resp.map(UpstreamBody::direct)),
                Err(e) if e.before_response() && idempotent && reused => {
                    tracing::debug!(error = %e, "kept connection closed; one fresh connection");
                    reused = false;
                    conn = match self.pool.dial_direct(slot).await {
                        Ok(c) => c,
                        Err(source) => return connect_failed(source),
                    };
                }
                Err(e) if e.before_response() && idempotent => return Outcome::Unusable(failed(e)),
                Err(e) => return Outcome::Final(failed(e)),
            }
        }
    }
}

/// Methods a retry cannot turn into a second effect (RFC 9110 §9.2.2).
fn is_idempotent(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::TRACE
            | http::Method::PUT
            | http::Method::DELETE
    )
}

/// Whether an h2c instance refused the stream (`REFUSED_STREAM`, also what
/// streams above a `GOAWAY`'s last stream id get): RFC 9113 §8.7 guarantees
/// the instance did not process it, whatever the method.
fn refused_stream(e: &hyper::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        cur = err.source();
    }
    false
}

/// Whether a send failed because the instance's end of the connection
/// closed or reset before a response began (not because of the client's
/// body, and not a malformed response).
fn closed_before_response(e: &hyper::Error) -> bool {
    if super::ClientBodyError::find(e).is_some() {
        return false;
    }
    if e.is_incomplete_message() || e.is_closed() {
        return true;
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            );
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_idempotent_methods_count_as_undelivered() {
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(is_idempotent(&m.parse().unwrap()), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(!is_idempotent(&m.parse().unwrap()), "{m}");
        }
    }
}
