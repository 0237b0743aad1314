//! Who a request came from and where it was addressed: the `Host` check
//! and the forwarding headers of the request sent to an instance.
//!
//! The router is an edge: a client can write any `X-Forwarded-*` or
//! `Forwarded` header, so those are believed only from the peers listed in
//! `--trusted-proxies` (a load balancer in front of the routers). From any
//! other peer they are dropped and written afresh. The instance gets
//!
//! | Header | From a trusted proxy | From anyone else |
//! |---|---|---|
//! | `X-Forwarded-For` | its values, then the peer | the peer |
//! | `X-Forwarded-Host` | its value, else `Host` | `Host` |
//! | `X-Forwarded-Proto` | its value, else `http` | `http` |
//! | `Forwarded` | built from the three above | built from the three above |
//!
//! `Forwarded` (RFC 7239) always tells the same story as the `X-Forwarded-*`
//! headers beside it: one `for=` element per `X-Forwarded-For` entry, the
//! last carrying `host=` and `proto=`, values quoted where the grammar asks
//! (IPv6 as `"[...]"`, a host with a port).
//!
//! [`check_host`] answers the RFC 9112 §3.2 cases: an HTTP/1.1 request
//! without `Host`, with more than one, or with one that is not a host and
//! optional port is refused (400). An absolute-form request target names
//! the host itself and wins over `Host`.
//!
//! Pure functions over a `HeaderMap`, tested table-style and fuzzed.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Uri, Version};

/// `X-Forwarded-For`.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Host`.
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// `X-Forwarded-Proto`.
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// An IP network (`10.0.0.0/8`, `2001:db8::/32`, or one address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl Network {
    /// Whether `ip` is in this network (IPv4-mapped IPv6 addresses count as
    /// IPv4).
    #[must_use]
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Network {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or network (a.b.c.d/n, x::y/n)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// The peers whose forwarding headers are believed (`--trusted-proxies`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<Network>);

impl TrustedProxies {
    /// Nobody is trusted.
    #[must_use]
    pub fn none() -> Self {
        Self::default()
    }

    /// Parses a comma-separated list of addresses and networks (empty:
    /// nobody).
    ///
    /// # Errors
    /// The entry that is not an address or network.
    pub fn parse(list: &str) -> Result<Self, String> {
        list.split(',')
            .filter(|e| !e.trim().is_empty())
            .map(str::parse)
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }

    /// Whether `peer` is a trusted proxy.
    #[must_use]
    pub fn contains(&self, peer: IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(peer))
    }

    /// The networks, as configured.
    #[must_use]
    pub fn networks(&self) -> &[Network] {
        &self.0
    }
}

/// The peer of a client connection as the forwarding headers name it,
/// worked out once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The peer is a trusted proxy: its forwarding headers are kept.
    pub trusted: bool,
    /// Its address as an `X-Forwarded-For` node.
    node: HeaderValue,
}

impl Peer {
    /// The peer at `addr`, trusted when `trusted` lists it.
    #[must_use]
    pub fn new(addr: SocketAddr, trusted: &TrustedProxies) -> Self {
        Self {
            addr,
            trusted: trusted.contains(addr.ip()),
            node: node(addr.ip()),
        }
    }

    /// Its address as an `X-Forwarded-For` node.
    #[must_use]
    pub fn node(&self) -> &HeaderValue {
        &self.node
    }
}

/// Why a request's `Host` is refused (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("missing Host header (HTTP/1.1 requires one)")]
    Missing,
    #[error("more than one Host header")]
    Conflicting,
    #[error("invalid Host header {0:?}: not a host and optional port")]
    Invalid(String),
}

/// Checks the request's `Host` (RFC 9112 §3.2): exactly one, a host with
/// an optional port; HTTP/1.0 may omit it.
///
/// # Errors
/// [`HostError`].
pub fn check_host(version: Version, headers: &HeaderMap) -> Result<(), HostError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => Err(HostError::Conflicting),
        (Some(h), None) => {
            if is_host_and_port(h.as_bytes()) {
                Ok(())
            } else {
                Err(HostError::Invalid(
                    String::from_utf8_lossy(h.as_bytes()).into_owned(),
                ))
            }
        }
        (None, _) if version == Version::HTTP_10 || version == Version::HTTP_09 => Ok(()),
        // An absolute-form target names the host, but HTTP/1.1 still
        // requires the header.
        (None, _) => Err(HostError::Missing),
    }
}

/// [`check_host`], except that an HTTP/2 request names its host in
/// `:authority` (RFC 9113 §8.3.1), which then stands for `Host`.
///
/// # Errors
/// [`HostError`].
pub fn check_request_host(version: Version, uri: &Uri, headers: &HeaderMap) -> Result<(), HostError> {
    if version == Version::HTTP_2 && uri.authority().is_some() {
        return Ok(());
    }
    check_host(version, headers)
}

/// `uri-host [ ":" port ]` (no userinfo, no path).
fn is_host_and_port(v: &[u8]) -> bool {
    if v.is_empty() || v.contains(&b'@') {
        return false;
    }
    // Most hosts are a name or an IPv4 address with an optional port:
    // checked here without the copy an `Authority` makes.
    simple_host_and_port(v).unwrap_or_else(|| authority_host_and_port(v))
}

/// [`is_host_and_port`] by parsing `v` as an `Authority` (a copy).
fn authority_host_and_port(v: &[u8]) -> bool {
    match http::uri::Authority::try_from(v) {
        Ok(a) => {
            let has_port = a.as_str().len() > a.host().len();
            a.as_str().len() == v.len() && !a.host().is_empty() && (!has_port || a.port_u16().is_some())
        }
        Err(_) => false,
    }
}

/// `v` checked without allocating when it is a name or IPv4 address
/// (letters, digits, `-`, `.`) with an optional port of digits; `None` for
/// anything else (IPv6 literals, percent-encoding, other characters), which
/// [`authority_host_and_port`] decides.
fn simple_host_and_port(v: &[u8]) -> Option<bool> {
    let (host, port) = match v.iter().position(|&b| b == b':') {
        Some(i) => (&v[..i], Some(&v[i + 1..])),
        None => (v, None),
    };
    if host.is_empty()
        || !host
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return None;
    }
    match port {
        None => Some(true),
        Some(p) if !p.is_empty() && p.iter().all(u8::is_ascii_digit) => {
            Some(std::str::from_utf8(p).is_ok_and(|p| p.parse::<u16>().is_ok()))
        }
        Some(_) => None,
    }
}

/// The host the request is for: the absolute-form target's authority
/// (which wins over `Host`, RFC 9112 §3.2.2), else `Host`. Applied to the
/// request sent on, whose target is origin-form.
pub fn set_host_from_target(uri: &Uri, headers: &mut HeaderMap) {
    if let Some(authority) = uri.authority()
        && let Ok(v) = HeaderValue::from_str(authority.as_str())
    {
        headers.insert(header::HOST, v);
    }
}

/// Rewrites the forwarding headers for a request from `peer` (see the
/// module docs); `trusted`: the peer is a trusted proxy. Call after the
/// hop-by-hop headers are gone.
pub fn rewrite(headers: &mut HeaderMap, peer: Option<IpAddr>, trusted: bool) {
    rewrite_from(headers, peer.map(node).as_ref(), trusted);
}

/// [`rewrite`] for a peer whose `X-Forwarded-For` node ([`node`]) is
/// worked out already.
pub fn rewrite_from(headers: &mut HeaderMap, peer: Option<&HeaderValue>, trusted: bool) {
    Forwarding::take(headers, peer, trusted).insert_into(headers);
}

/// The forwarding headers of a request sent on (the module docs' table),
/// worked out once per request: inserted into the request's header map
/// ([`Forwarding::insert_into`]), or written as header lines straight into
/// a request head ([`Forwarding::write`]), the same fields either way.
#[derive(Debug, Clone)]
pub struct Forwarding {
    xff: Option<HeaderValue>,
    host: Option<HeaderValue>,
    proto: HeaderValue,
}

impl Forwarding {
    /// Takes the client's forwarding headers out of `headers` (believed
    /// only when `trusted`) and works out those of the request sent on
    /// for `peer` (its [`node`]). Call after the hop-by-hop headers are
    /// gone.
    pub fn take(headers: &mut HeaderMap, peer: Option<&HeaderValue>, trusted: bool) -> Self {
        let mut chain: Vec<HeaderValue> = Vec::new();
        let (host, proto) = if trusted {
            chain.extend(headers.get_all(&X_FORWARDED_FOR).iter().cloned());
            (
                headers.get(&X_FORWARDED_HOST).cloned(),
                headers.get(&X_FORWARDED_PROTO).cloned(),
            )
        } else {
            (None, None)
        };
        // Most clients send none of them: one pass over the names says so.
        if headers.keys().any(|n| {
            *n == X_FORWARDED_FOR
                || *n == X_FORWARDED_HOST
                || *n == X_FORWARDED_PROTO
                || *n == header::FORWARDED
        }) {
            for name in [&X_FORWARDED_FOR, &X_FORWARDED_HOST, &X_FORWARDED_PROTO] {
                headers.remove(name);
            }
            headers.remove(header::FORWARDED);
        }
        let xff = match (join(&chain), peer) {
            (Some(mut v), Some(p)) => {
                v.extend_from_slice(b", ");
                v.extend_from_slice(p.as_bytes());
                owned_value(v)
            }
            (Some(v), None) => owned_value(v),
            (None, p) => p.cloned(),
        };
        Self {
            xff,
            host: host.or_else(|| headers.get(header::HOST).cloned()),
            proto: proto.unwrap_or_else(|| HeaderValue::from_static("http")),
        }
    }

    /// Inserts the fields into `headers`: `Forwarded`, `X-Forwarded-For`,
    /// `X-Forwarded-Host`, `X-Forwarded-Proto`, in that order.
    pub fn insert_into(&self, headers: &mut HeaderMap) {
        let mut value = Vec::with_capacity(64);
        self.forwarded(&mut value);
        if let Some(v) = owned_value(value) {
            headers.insert(header::FORWARDED, v);
        }
        if let Some(v) = &self.xff {
            headers.insert(X_FORWARDED_FOR, v.clone());
        }
        if let Some(v) = &self.host {
            headers.insert(X_FORWARDED_HOST, v.clone());
        }
        headers.insert(X_FORWARDED_PROTO, self.proto.clone());
    }

    /// Writes the fields [`Forwarding::insert_into`] inserts, in its order,
    /// as HTTP/1.1 header lines with lower-case names (as hyper writes a
    /// map): no map, no allocation.
    pub fn write(&self, out: &mut Vec<u8>) {
        let line = out.len();
        out.extend_from_slice(b"forwarded: ");
        let value = out.len();
        self.forwarded(out);
        if out[value..].iter().all(|&b| is_value_byte(b)) {
            out.extend_from_slice(b"\r\n");
        } else {
            // What `insert_into` leaves out (a value no header may carry).
            out.truncate(line);
        }
        let fields = [
            (&X_FORWARDED_FOR, self.xff.as_ref()),
            (&X_FORWARDED_HOST, self.host.as_ref()),
            (&X_FORWARDED_PROTO, Some(&self.proto)),
        ];
        for (name, value) in fields {
            if let Some(v) = value {
                out.extend_from_slice(name.as_str().as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(v.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
        }
    }

    /// RFC 7239 `Forwarded`'s value: one `for=` element per
    /// `X-Forwarded-For` entry, the last with `;host=` and `;proto=`.
    fn forwarded(&self, out: &mut Vec<u8>) {
        if let Some(xff) = &self.xff {
            for (i, node) in xff
                .as_bytes()
                .split(|b| *b == b',')
                .map(<[u8]>::trim_ascii)
                .filter(|n| !n.is_empty())
                .enumerate()
            {
                if i > 0 {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(b"for=");
                node_value(node, out);
            }
        }
        if let Some(h) = &self.host {
            out.extend_from_slice(b";host=");
            param_value(h.as_bytes(), out);
        }
        out.extend_from_slice(b";proto=");
        param_value(self.proto.as_bytes(), out);
    }
}

/// A byte [`HeaderValue::from_bytes`] takes: visible ASCII, space, tab and
/// obs-text.
fn is_value_byte(b: u8) -> bool {
    (b >= 0x20 && b != 0x7f) || b == b'\t'
}

/// Header lines joined with `", "` (`None` when there are none).
fn join(values: &[HeaderValue]) -> Option<Vec<u8>> {
    let (first, rest) = values.split_first()?;
    let mut out = first.as_bytes().to_vec();
    for v in rest {
        out.extend_from_slice(b", ");
        out.extend_from_slice(v.as_bytes());
    }
    Some(out)
}

/// `ip` as an `X-Forwarded-For` node (an IPv4-mapped IPv6 address as
/// IPv4).
#[must_use]
pub fn node(ip: IpAddr) -> HeaderValue {
    ip_value(ip.to_canonical())
}

fn ip_value(ip: IpAddr) -> HeaderValue {
    // An IP address renders to ASCII digits, '.', ':' and hex letters only.
    HeaderValue::from_str(&ip.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// A header value that takes `bytes` (checked as [`HeaderValue::from_bytes`]
/// checks) instead of copying them.
fn owned_value(bytes: Vec<u8>) -> Option<HeaderValue> {
    HeaderValue::from_maybe_shared(bytes::Bytes::from(bytes)).ok()
}

/// A `for=` node: an IPv4 address as it is, an IPv6 address as `"[v6]"`,
/// anything else as a token or a quoted string.
fn node_value(node: &[u8], out: &mut Vec<u8>) {
    // Only a node with a colon can be an IPv6 address.
    let v6 = node.contains(&b':')
        && std::str::from_utf8(node)
            .ok()
            .is_some_and(|s| s.parse::<std::net::Ipv6Addr>().is_ok());
    if v6 {
        out.extend_from_slice(b"\"[");
        out.extend_from_slice(node);
        out.extend_from_slice(b"]\"");
    } else {
        param_value(node, out);
    }
}

/// A parameter value: a token as it is, else a quoted string.
fn param_value(v: &[u8], out: &mut Vec<u8>) {
    if !v.is_empty() && v.iter().all(|b| is_tchar(*b)) {
        out.extend_from_slice(v);
        return;
    }
    out.reserve(v.len() + 2);
    out.push(b'"');
    let mut rest = v;
    while let Some(at) = rest.iter().position(|b| matches!(b, b'"' | b'\\')) {
        out.extend_from_slice(&rest[..at]);
        out.push(b'\\');
        out.push(rest[at]);
        rest = &rest[at + 1..];
    }
    out.extend_from_slice(rest);
    out.push(b'"');
}

/// RFC 9110 `tchar`, by byte.
static TCHAR: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        #[allow(clippy::cast_possible_truncation)]
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        b += 1;
    }
    table
};

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    TCHAR[usize::from(b)]
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A header map of `pairs`, in order.
    pub(in crate::router::proxy) fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn values<'a>(h: &'a HeaderMap, k: &str) -> Vec<&'a str> {
        h.get_all(k).iter().map(|v| v.to_str().unwrap()).collect()
    }

    const PEER: &str = "203.0.113.5";

    fn peer() -> Option<IpAddr> {
        Some(PEER.parse().unwrap())
    }

    #[test]
    fn rewrite_table() {
        struct Case {
            name: &'static str,
            inbound: &'static [(&'static str, &'static str)],
            peer: Option<IpAddr>,
            trusted: bool,
            want: &'static [(&'static str, &'static str)],
            absent: &'static [&'static str],
        }
        let cases = [
            Case {
                name: "a minimal request",
                inbound: &[("host", "t.example.com")],
                peer: peer(),
                trusted: false,
                want: &[
                    ("x-forwarded-for", PEER),
                    ("x-forwarded-host", "t.example.com"),
                    ("x-forwarded-proto", "http"),
                    ("forwarded", "for=203.0.113.5;host=t.example.com;proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "client-written forwarding headers are replaced",
                inbound: &[
                    ("host", "a"),
                    ("x-forwarded-for", "10.6.6.6"),
                    ("x-forwarded-for", "10.7.7.7"),
                    ("x-forwarded-host", "bank.example"),
                    ("x-forwarded-proto", "https"),
                    ("forwarded", "for=10.6.6.6;proto=https"),
                ],
                peer: peer(),
                trusted: false,
                want: &[
                    ("x-forwarded-for", PEER),
                    ("x-forwarded-host", "a"),
                    ("x-forwarded-proto", "http"),
                    ("forwarded", "for=203.0.113.5;host=a;proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "a trusted proxy's chain is kept and the peer appended",
                inbound: &[
                    ("host", "a"),
                    ("x-forwarded-for", "198.51.100.1, 10.0.0.1"),
                    ("x-forwarded-for", "10.0.0.2"),
                    ("x-forwarded-host", "shop.example"),
                    ("x-forwarded-proto", "https"),
                    ("forwarded", "for=1.1.1.1"),
                ],
                peer: peer(),
                trusted: true,
                want: &[
                    ("x-forwarded-for", "198.51.100.1, 10.0.0.1, 10.0.0.2, 203.0.113.5"),
                    ("x-forwarded-host", "shop.example"),
                    ("x-forwarded-proto", "https"),
                    (
                        "forwarded",
                        "for=198.51.100.1, for=10.0.0.1, for=10.0.0.2, for=203.0.113.5;host=shop.example;proto=https",
                    ),
                ],
                absent: &[],
            },
            Case {
                name: "a trusted proxy that sent nothing",
                inbound: &[("host", "a:8080")],
                peer: peer(),
                trusted: true,
                want: &[
                    ("x-forwarded-for", PEER),
                    ("x-forwarded-host", "a:8080"),
                    ("forwarded", "for=203.0.113.5;host=\"a:8080\";proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "IPv6 nodes are bracketed and quoted, odd nodes quoted",
                inbound: &[("host", "h"), ("x-forwarded-for", "2001:db8::1, unknown, a\"b")],
                peer: Some("2001:db8::7".parse().unwrap()),
                trusted: true,
                want: &[
                    ("x-forwarded-for", "2001:db8::1, unknown, a\"b, 2001:db8::7"),
                    (
                        "forwarded",
                        "for=\"[2001:db8::1]\", for=unknown, for=\"a\\\"b\", for=\"[2001:db8::7]\";host=h;proto=http",
                    ),
                ],
                absent: &[],
            },
            Case {
                name: "an IPv4-mapped peer is written as IPv4",
                inbound: &[("host", "h")],
                peer: Some("::ffff:192.0.2.1".parse().unwrap()),
                trusted: false,
                want: &[
                    ("x-forwarded-for", "192.0.2.1"),
                    ("forwarded", "for=192.0.2.1;host=h;proto=http"),
                ],
                absent: &[],
            },
            Case {
                name: "no peer and no Host (HTTP/1.0)",
                inbound: &[("x-forwarded-for", "1.2.3.4")],
                peer: None,
                trusted: false,
                want: &[("x-forwarded-proto", "http"), ("forwarded", ";proto=http")],
                absent: &["x-forwarded-for", "x-forwarded-host"],
            },
        ];
        for c in cases {
            let mut h = map(c.inbound);
            let mut apart = h.clone();
            rewrite(&mut h, c.peer, c.trusted);
            // Taken apart and written: the same fields as lines.
            let taken = Forwarding::take(&mut apart, c.peer.map(node).as_ref(), c.trusted);
            let mut lines = Vec::new();
            taken.write(&mut lines);
            let mut want = String::new();
            for k in [
                "forwarded",
                "x-forwarded-for",
                "x-forwarded-host",
                "x-forwarded-proto",
            ] {
                for v in values(&h, k) {
                    want.push_str(&format!("{k}: {v}\r\n"));
                }
                assert!(!apart.contains_key(k), "{}: {k} left in the map", c.name);
            }
            assert_eq!(
                String::from_utf8(lines).unwrap(),
                want,
                "{}: written lines",
                c.name
            );
            for (k, v) in c.want {
                assert_eq!(values(&h, k), vec![*v], "{}: header {k}", c.name);
            }
            for k in c.absent {
                assert!(!h.contains_key(*k), "{}: {k} should be absent", c.name);
            }
            assert_eq!(
                values(&h, "host").len(),
                usize::from(h.contains_key("host")),
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn host_table() {
        let v11 = Version::HTTP_11;
        let v10 = Version::HTTP_10;
        type Case<'a> = (&'a str, Version, &'a [&'a str], Result<(), HostError>);
        let cases: &[Case<'_>] = &[
            ("one host", v11, &["example.com"], Ok(())),
            ("host and port", v11, &["example.com:8080"], Ok(())),
            ("ipv6 literal", v11, &["[::1]:80"], Ok(())),
            ("missing", v11, &[], Err(HostError::Missing)),
            ("HTTP/1.0 may omit it", v10, &[], Ok(())),
            ("two", v11, &["a", "b"], Err(HostError::Conflicting)),
            ("two equal", v11, &["a", "a"], Err(HostError::Conflicting)),
            ("two in HTTP/1.0", v10, &["a", "b"], Err(HostError::Conflicting)),
            (
                "userinfo",
                v11,
                &["user@h"],
                Err(HostError::Invalid("user@h".into())),
            ),
            ("a path", v11, &["h/x"], Err(HostError::Invalid("h/x".into()))),
            ("empty", v11, &[""], Err(HostError::Invalid(String::new()))),
            ("a space", v11, &["a b"], Err(HostError::Invalid("a b".into()))),
            ("a bad port", v11, &["h:x"], Err(HostError::Invalid("h:x".into()))),
        ];
        for (name, version, hosts, want) in cases {
            let mut h = HeaderMap::new();
            for v in *hosts {
                h.append(header::HOST, HeaderValue::from_str(v).unwrap());
            }
            assert_eq!(check_host(*version, &h), *want, "{name}");
        }
        let origin: Uri = "/x".parse().unwrap();
        let absolute: Uri = "http://target.example/x".parse().unwrap();
        let mut h = map(&[("host", "client-said")]);
        set_host_from_target(&absolute, &mut h);
        assert_eq!(values(&h, "host"), vec!["target.example"]);
        set_host_from_target(&origin, &mut h);
        assert_eq!(
            values(&h, "host"),
            vec!["target.example"],
            "origin form keeps Host"
        );
    }

    #[test]
    fn parameter_values_are_tokens_or_quoted_strings() {
        let reference = |v: &[u8]| {
            let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
            if !v.is_empty() && v.iter().all(tchar) {
                return v.to_vec();
            }
            let mut out = vec![b'"'];
            for b in v {
                if matches!(b, b'"' | b'\\') {
                    out.push(b'\\');
                }
                out.push(*b);
            }
            out.push(b'"');
            out
        };
        let mut values: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        values.extend(
            [
                "",
                "a.b:80",
                "\"",
                "\\",
                "a\"b\\c\"",
                "[::1]:8080",
                "x y",
                "\"\"\\",
            ]
            .map(|s| s.as_bytes().to_vec()),
        );
        for v in values {
            let mut out = b"x=".to_vec();
            param_value(&v, &mut out);
            assert_eq!(out[2..], reference(&v)[..], "{:?}", String::from_utf8_lossy(&v));
        }
    }

    #[test]
    fn the_simple_host_check_agrees_with_the_authority_parse() {
        let alphabet = b"a1-.:+[]@%9 0";
        let mut decided = 0;
        let mut check = |v: &[u8]| {
            if let Some(simple) = simple_host_and_port(v) {
                decided += 1;
                assert_eq!(
                    simple,
                    authority_host_and_port(v),
                    "{:?}",
                    String::from_utf8_lossy(v)
                );
            }
        };
        for len in 1..=4u32 {
            for n in 0..alphabet.len().pow(len) {
                let v: Vec<u8> = (0..len)
                    .map(|i| alphabet[n / alphabet.len().pow(i) % alphabet.len()])
                    .collect();
                check(&v);
            }
        }
        for v in [
            "example.com:8080",
            "h:65535",
            "h:65536",
            "h:000080",
            "h:99999999999",
            "10.0.0.1:80",
            "a.b.c.d.e.f",
            "xn--bcher-kva.example:1",
        ] {
            check(v.as_bytes());
        }
        assert!(decided > 1000, "the simple check decided only {decided} cases");
    }

    #[test]
    fn trusted_proxies_parse_and_match() {
        let t = TrustedProxies::parse("10.0.0.0/8, 192.0.2.7,2001:db8::/32").unwrap();
        for (ip, want) in [
            ("10.1.2.3", true),
            ("11.0.0.1", false),
            ("192.0.2.7", true),
            ("192.0.2.8", false),
            ("::ffff:10.9.9.9", true),
            ("2001:db8:1::1", true),
            ("2001:db9::1", false),
        ] {
            assert_eq!(t.contains(ip.parse().unwrap()), want, "{ip}");
        }
        assert_eq!(
            t.networks().iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"]
        );
        assert!(TrustedProxies::parse("").unwrap().networks().is_empty());
        assert!(
            TrustedProxies::parse("0.0.0.0/0")
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
        assert!(
            TrustedProxies::parse("10.0.0.0/33")
                .unwrap_err()
                .contains("0 to 32")
        );
        assert!(TrustedProxies::parse("ten").unwrap_err().contains("\"ten\""));
    }
}
