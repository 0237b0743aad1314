//! Header rewriting of the request sent to an instance (spec §6.4).
//!
//! Hop-by-hop headers (and those `Connection` lists, never `Host`), the
//! function header and any client-sent instance headers are dropped; `Host`
//! stays the inbound one; the forwarding headers are written by
//! [`super::forwarding`]. Everything else passes through in order. Pure
//! functions, tested table-style.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::forwarding;
use crate::domain::{HEADER_FUNCTION, HEADER_GET_INSTANCE_DURATION_MS, HEADER_INSTANCE, HEADER_TENANT};

/// The function header (`X-Skipper-Function`), parsed once.
pub const FUNCTION: HeaderName = HeaderName::from_static(HEADER_FUNCTION);
/// The instance header the router writes (`X-Skipper-Instance`).
pub const INSTANCE: HeaderName = HeaderName::from_static(HEADER_INSTANCE);
/// The tenant header the router writes (`X-Skipper-Tenant`).
pub const TENANT: HeaderName = HeaderName::from_static(HEADER_TENANT);
/// How long the router's `GetInstance` calls took for a response.
pub const GET_INSTANCE_DURATION_MS: HeaderName = HeaderName::from_static(HEADER_GET_INSTANCE_DURATION_MS);

/// Fields the proxy may add to a request it sends on: the four forwarding
/// headers and the trace context (`traceparent`, `tracestate`). A request
/// map built with this much room beyond the client's fields does not grow
/// (a reallocation and a rehash) while it is rewritten.
pub const ADDED_FIELDS: usize = 6;

/// The header name for `name` when it is the function header, without the
/// allocation [`HeaderName::from_bytes`] makes for a name it does not
/// know (every routed request carries it).
#[must_use]
pub fn known_name(name: &[u8]) -> Option<HeaderName> {
    name.eq_ignore_ascii_case(HEADER_FUNCTION.as_bytes())
        .then_some(FUNCTION)
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Hop-by-hop headers never forwarded (besides those `Connection` lists). A
/// static: a const would be built and dropped at every use.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    KEEP_ALIVE,
    PROXY_CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The protocol a request asks to upgrade to (`Connection: upgrade` plus an
/// `Upgrade` value), if any.
#[must_use]
pub fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let wants = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if wants {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// Whether a request's `TE` lists `trailers` (gRPC clients send it; it is
/// hop-by-hop, so the router says it again to instances that take it).
#[must_use]
pub fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("trailers"))
        })
}

/// Drops hop-by-hop headers (and those `Connection` lists) from an
/// instance's response before it is passed back. Not for `101` responses,
/// whose `Connection` and `Upgrade` belong to the protocol switch.
pub fn strip_response(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
}

/// Removes the hop-by-hop headers and every header `Connection` lists but
/// `Host` (which names the request's target, not a hop).
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry none: one pass over the names says so (a header
    // `Connection` lists comes with `Connection`, itself hop-by-hop).
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|n| *n != header::HOST)
        .collect();
    for name in listed.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// Rewrites inbound request headers into the headers sent to the instance.
/// `client` is the peer; `trusted`: it is a trusted proxy, whose forwarding
/// headers are kept. `upgrade` re-adds `Connection: upgrade` and `Upgrade`
/// for upgrade requests.
pub fn rewrite(
    headers: &mut HeaderMap,
    client: Option<SocketAddr>,
    trusted: bool,
    upgrade: Option<HeaderValue>,
) {
    let node = client.map(|a| forwarding::node(a.ip()));
    rewrite_from(headers, node.as_ref(), trusted, upgrade);
}

/// [`rewrite`] for a peer whose `X-Forwarded-For` node is worked out
/// already ([`forwarding::Peer`], once per client connection).
pub fn rewrite_from(
    headers: &mut HeaderMap,
    node: Option<&HeaderValue>,
    trusted: bool,
    upgrade: Option<HeaderValue>,
) {
    rewrite_apart(headers, node, trusted).insert_into(headers);
    if let Some(proto) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto);
    }
}

/// [`rewrite_from`] for a request without an upgrade, except that the
/// forwarding headers are returned instead of inserted: a request head
/// written from the map writes them after it ([`forwarding::Forwarding::write`]).
pub fn rewrite_apart(
    headers: &mut HeaderMap,
    node: Option<&HeaderValue>,
    trusted: bool,
) -> forwarding::Forwarding {
    strip_hop_by_hop(headers);
    headers.remove(FUNCTION);
    // The router names the instance itself, per attempt.
    if headers.keys().any(|n| *n == INSTANCE || *n == TENANT) {
        headers.remove(INSTANCE);
        headers.remove(TENANT);
    }
    forwarding::Forwarding::take(headers, node, trusted)
}

#[cfg(test)]
mod tests {
    use super::super::forwarding::tests::map;
    use super::*;

    fn pairs(h: &HeaderMap) -> Vec<(String, String)> {
        h.iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().to_owned()))
            .collect()
    }

    fn client() -> Option<SocketAddr> {
        Some("203.0.113.5:1234".parse().unwrap())
    }

    #[test]
    fn minimal_request_gains_exactly_the_forwarding_headers() {
        let mut h = map(&[("host", "t.example.com"), (HEADER_FUNCTION, "{}")]);
        rewrite(&mut h, client(), false, None);
        let mut got = pairs(&h);
        got.sort();
        assert_eq!(
            got,
            vec![
                (
                    "forwarded".into(),
                    "for=203.0.113.5;host=t.example.com;proto=http".into()
                ),
                ("host".into(), "t.example.com".into()),
                ("x-forwarded-for".into(), "203.0.113.5".into()),
                ("x-forwarded-host".into(), "t.example.com".into()),
                ("x-forwarded-proto".into(), "http".into()),
            ]
        );
    }

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_dropped_but_never_host() {
        let mut h = map(&[
            ("host", "h"),
            ("connection", "keep-alive, x-secret, Host"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("transfer-encoding", "chunked"),
            ("proxy-authorization", "basic x"),
            ("proxy-connection", "keep-alive"),
            ("upgrade", "h2c"),
            ("x-keep", "yes"),
            (HEADER_FUNCTION, "{}"),
            (HEADER_INSTANCE, "pod-x"),
            (HEADER_TENANT, "evil"),
        ]);
        rewrite(&mut h, client(), false, None);
        for k in [
            "connection",
            "keep-alive",
            "x-secret",
            "te",
            "trailer",
            "transfer-encoding",
            "proxy-authorization",
            "proxy-connection",
            "upgrade",
            HEADER_FUNCTION,
            HEADER_INSTANCE,
            HEADER_TENANT,
        ] {
            assert!(!h.contains_key(k), "{k} should be absent");
        }
        assert_eq!(h.get("x-keep").unwrap(), "yes");
        assert_eq!(h.get("host").unwrap(), "h", "Connection cannot strip Host");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "h");
    }

    #[test]
    fn response_hop_by_hop_headers_are_dropped() {
        let mut h = map(&[
            ("connection", "close, x-conn"),
            ("x-conn", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("content-type", "text/plain"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
        ]);
        strip_response(&mut h);
        let mut got = pairs(&h);
        got.sort();
        assert_eq!(
            got,
            vec![
                ("content-type".into(), "text/plain".into()),
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
            ]
        );
    }

    #[test]
    fn multi_valued_headers_keep_their_order() {
        let mut h = map(&[
            ("host", "h"),
            ("x-multi", "1"),
            ("x-multi", "2"),
            ("x-multi", "3"),
        ]);
        rewrite(&mut h, client(), false, None);
        let got: Vec<_> = h.get_all("x-multi").iter().map(|x| x.to_str().unwrap()).collect();
        assert_eq!(got, vec!["1", "2", "3"]);
    }

    #[test]
    fn upgrade_requests_keep_connection_upgrade() {
        let mut h = map(&[
            ("host", "h"),
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "k"),
        ]);
        let proto = upgrade_protocol(&h);
        assert_eq!(proto, Some(HeaderValue::from_static("websocket")));
        rewrite(&mut h, client(), false, proto);
        assert_eq!(h.get("connection").unwrap(), "upgrade");
        assert_eq!(h.get("upgrade").unwrap(), "websocket");
        assert_eq!(h.get("sec-websocket-key").unwrap(), "k");
        assert_eq!(upgrade_protocol(&map(&[("upgrade", "websocket")])), None);
    }
}
