//! Header rewriting of the request sent to an instance (spec §6.4).
//!
//! Hop-by-hop headers, the function header and any client-sent instance
//! headers are dropped; `Host` stays the
//! inbound one; `X-Forwarded-For/Host/Proto` and RFC 7239 `Forwarded` are kept
//! when the client sent them and filled in otherwise. Everything else passes
//! through in order. Pure functions, tested table-style.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use crate::domain::{HEADER_FUNCTION, HEADER_INSTANCE, HEADER_TENANT};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Hop-by-hop headers never forwarded (besides those `Connection` lists).
const HOP_BY_HOP: [HeaderName; 9] = [
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

/// Drops hop-by-hop headers (and those `Connection` lists) from an
/// instance's response before it is passed back. Not for `101` responses,
/// whose `Connection` and `Upgrade` belong to the protocol switch.
pub fn strip_response(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
}

/// Removes the hop-by-hop headers and every header `Connection` lists.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in listed.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// Rewrites inbound request headers into the headers sent to the instance.
/// `upgrade` re-adds `Connection: upgrade` and `Upgrade` for upgrade requests.
pub fn rewrite(headers: &mut HeaderMap, client: Option<SocketAddr>, upgrade: Option<HeaderValue>) {
    strip_hop_by_hop(headers);
    headers.remove(HEADER_FUNCTION);
    // The router names the instance itself, per attempt.
    headers.remove(HEADER_INSTANCE);
    headers.remove(HEADER_TENANT);

    if !headers.contains_key(&X_FORWARDED_FOR)
        && let Some(addr) = client
    {
        headers.insert(X_FORWARDED_FOR, ip_value(addr.ip().to_canonical()));
    }
    if !headers.contains_key(&X_FORWARDED_HOST)
        && let Some(host) = headers.get(header::HOST).cloned()
    {
        headers.insert(X_FORWARDED_HOST, host);
    }
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if !headers.contains_key(header::FORWARDED)
        && let Some(v) = forwarded(headers)
    {
        headers.insert(header::FORWARDED, v);
    }
    if let Some(proto) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, proto);
    }
}

fn ip_value(ip: IpAddr) -> HeaderValue {
    // An IP address renders to ASCII digits, '.', ':' and hex letters only.
    HeaderValue::from_str(&ip.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// RFC 7239 `Forwarded` from the `X-Forwarded-*` headers: one `for=` per
/// `X-Forwarded-For` line (IPv6 quoted and bracketed), then the first host
/// and proto.
fn forwarded(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut out = Vec::<u8>::with_capacity(64);
    for (i, v) in headers.get_all(&X_FORWARDED_FOR).iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(b"for=");
        let is_v6 = v
            .to_str()
            .ok()
            .is_some_and(|s| s.trim().parse::<Ipv6Addr>().is_ok());
        if is_v6 {
            out.extend_from_slice(b"\"[");
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"]\"");
        } else {
            out.extend_from_slice(v.as_bytes());
        }
    }
    if let Some(h) = headers.get(&X_FORWARDED_HOST) {
        out.extend_from_slice(b";host=");
        out.extend_from_slice(h.as_bytes());
    }
    if let Some(p) = headers.get(&X_FORWARDED_PROTO) {
        out.extend_from_slice(b";proto=");
        out.extend_from_slice(p.as_bytes());
    }
    HeaderValue::from_bytes(&out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

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
        rewrite(&mut h, client(), None);
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
    fn rewrite_table() {
        struct Case {
            name: &'static str,
            inbound: &'static [(&'static str, &'static str)],
            client: Option<SocketAddr>,
            want: &'static [(&'static str, &'static str)],
            absent: &'static [&'static str],
        }
        let cases = [
            Case {
                name: "ipv6 inbound xff is quoted in forwarded",
                inbound: &[("host", "example.com"), ("x-forwarded-for", "2001:db8::1")],
                client: client(),
                want: &[
                    ("x-forwarded-for", "2001:db8::1"),
                    ("forwarded", "for=\"[2001:db8::1]\";host=example.com;proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "inbound forwarding headers are kept verbatim",
                inbound: &[
                    ("host", "a"),
                    ("x-forwarded-for", "1.1.1.1, 2.2.2.2"),
                    ("x-forwarded-host", "orig"),
                    ("x-forwarded-proto", "https"),
                    ("forwarded", "for=9.9.9.9"),
                ],
                client: client(),
                want: &[
                    ("x-forwarded-for", "1.1.1.1, 2.2.2.2"),
                    ("x-forwarded-host", "orig"),
                    ("x-forwarded-proto", "https"),
                    ("forwarded", "for=9.9.9.9"),
                ],
                absent: &[],
            },
            Case {
                name: "forwarded has one for= per xff line",
                inbound: &[
                    ("host", "h"),
                    ("x-forwarded-for", "1.1.1.1"),
                    ("x-forwarded-for", "::1"),
                ],
                client: client(),
                want: &[("forwarded", "for=1.1.1.1, for=\"[::1]\";host=h;proto=http")],
                absent: &[],
            },
            Case {
                name: "hop-by-hop and connection-listed headers are dropped",
                inbound: &[
                    ("host", "h"),
                    ("connection", "keep-alive, x-secret"),
                    ("keep-alive", "timeout=5"),
                    ("x-secret", "1"),
                    ("te", "trailers"),
                    ("trailer", "x"),
                    ("transfer-encoding", "chunked"),
                    ("proxy-authorization", "basic x"),
                    ("proxy-connection", "keep-alive"),
                    ("upgrade", "h2c"),
                    ("x-keep", "yes"),
                ],
                client: client(),
                want: &[("x-keep", "yes"), ("host", "h")],
                absent: &[
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
                ],
            },
            Case {
                name: "no client address leaves xff unset and forwarded starts with host",
                inbound: &[("host", "h")],
                client: None,
                want: &[("forwarded", ";host=h;proto=http")],
                absent: &["x-forwarded-for"],
            },
            Case {
                name: "ipv4-mapped client address is written as ipv4",
                inbound: &[("host", "h")],
                client: Some("[::ffff:192.0.2.1]:80".parse().unwrap()),
                want: &[
                    ("x-forwarded-for", "192.0.2.1"),
                    ("forwarded", "for=192.0.2.1;host=h;proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "ipv6 client address",
                inbound: &[("host", "h")],
                client: Some("[2001:db8::7]:80".parse().unwrap()),
                want: &[
                    ("x-forwarded-for", "2001:db8::7"),
                    ("forwarded", "for=\"[2001:db8::7]\";host=h;proto=http"),
                ],
                absent: &[],
            },
        ];
        for c in cases {
            let mut h = map(c.inbound);
            rewrite(&mut h, c.client, None);
            for (k, v) in c.want {
                let got: Vec<_> = h.get_all(*k).iter().map(|x| x.to_str().unwrap()).collect();
                assert_eq!(got, vec![*v], "{}: header {k}", c.name);
            }
            for k in c.absent {
                assert!(!h.contains_key(*k), "{}: {k} should be absent", c.name);
            }
        }
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
        rewrite(&mut h, client(), None);
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
        rewrite(&mut h, client(), proto);
        assert_eq!(h.get("connection").unwrap(), "upgrade");
        assert_eq!(h.get("upgrade").unwrap(), "websocket");
        assert_eq!(h.get("sec-websocket-key").unwrap(), "k");
        assert_eq!(upgrade_protocol(&map(&[("upgrade", "websocket")])), None);
    }
}
