//! Fuzz target: the router's rewrite of a request's headers for the
//! instance (`src/router/proxy/headers.rs`, `forwarding.rs`) and its `Host`
//! check.
//!
//! Input: byte 0 picks the peer (IPv4, IPv6, IPv4-mapped) and whether it is
//! a trusted proxy; the rest is header lines `name: value` separated by
//! `\n` (lines that are not a valid header are skipped). Properties: the
//! `Host` check accepts exactly one host-and-port `Host` (none for
//! HTTP/1.0) and never panics; after the rewrite there is exactly one
//! `X-Forwarded-For`, `X-Forwarded-Host` (when there is a `Host`),
//! `X-Forwarded-Proto` and `Forwarded`; `X-Forwarded-For` ends with the
//! peer and, from an untrusted peer, is the peer alone, with `Host` and
//! `http` beside it whatever the client wrote; `Forwarded` parses as RFC
//! 7239 (elements of `token=value` pairs, values tokens or quoted strings)
//! with one `for=` per `X-Forwarded-For` entry and `host`/`proto` equal to
//! the `X-Forwarded-*` values; `Host` survives unchanged (`Connection`
//! cannot strip it); no hop-by-hop header, no header `Connection` listed
//! and no client-sent `X-Skipper-*` routing header is left; the rewrite
//! for a head written apart (`headers::rewrite_apart`) leaves the same map
//! without the forwarding fields and writes those as the same lines. Run
//! with `make fuzz`.

#![no_main]
// A fuzz target: a failed unwrap is a finding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};

use http::Version;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use skipper::domain::{HEADER_FUNCTION, HEADER_INSTANCE, HEADER_TENANT};
use skipper::router::proxy::forwarding::{self, HostError};
use skipper::router::proxy::headers;

const PEERS: [&str; 4] = ["203.0.113.5", "2001:db8::7", "::ffff:192.0.2.1", "10.0.0.1"];

fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// One `Forwarded` element: its `(name, value)` pairs.
type Element = Vec<(String, Vec<u8>)>;

/// Parses a `Forwarded` value into elements, unquoting quoted strings;
/// `None` when it does not follow the grammar.
fn parse_forwarded(v: &[u8]) -> Option<Vec<Element>> {
    let mut elements = vec![Vec::new()];
    let mut i = 0;
    loop {
        // An element may be empty only as the very first (pairs start with `;`).
        let start = i;
        while i < v.len() && tchar(v[i]) {
            i += 1;
        }
        if i == start {
            if i < v.len() && v[i] == b';' && elements.len() == 1 && elements[0].is_empty() {
                i += 1;
                continue;
            }
            return None;
        }
        let name = String::from_utf8(v[start..i].to_vec()).ok()?.to_ascii_lowercase();
        if v.get(i) != Some(&b'=') {
            return None;
        }
        i += 1;
        let mut value = Vec::new();
        if v.get(i) == Some(&b'"') {
            i += 1;
            loop {
                match v.get(i)? {
                    b'"' => {
                        i += 1;
                        break;
                    }
                    b'\\' => {
                        value.push(*v.get(i + 1)?);
                        i += 2;
                    }
                    b => {
                        value.push(*b);
                        i += 1;
                    }
                }
            }
        } else {
            let s = i;
            while i < v.len() && tchar(v[i]) {
                i += 1;
            }
            if i == s {
                return None;
            }
            value.extend_from_slice(&v[s..i]);
        }
        elements.last_mut()?.push((name, value));
        match v.get(i) {
            None => return Some(elements),
            Some(b';') => i += 1,
            Some(b',') => {
                i += 1;
                while v.get(i) == Some(&b' ') {
                    i += 1;
                }
                elements.push(Vec::new());
            }
            Some(_) => return None,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let peer: IpAddr = PEERS[usize::from(mode & 3)].parse().unwrap();
    let trusted = mode & 4 == 4;
    let version = if mode & 8 == 8 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let mut h = HeaderMap::new();
    for line in rest.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        h.append(name, value);
    }

    let hosts: Vec<HeaderValue> = h.get_all(header::HOST).iter().cloned().collect();
    match forwarding::check_host(version, &h) {
        Ok(()) => {
            assert!(
                hosts.len() == 1 || (hosts.is_empty() && version == Version::HTTP_10),
                "{hosts:?}"
            );
            if let Some(host) = hosts.first() {
                let a = http::uri::Authority::try_from(host.as_bytes())
                    .expect("an accepted Host is an authority");
                assert!(!a.as_str().contains('@') && !a.host().is_empty());
            }
        }
        Err(HostError::Missing) => assert!(hosts.is_empty() && version == Version::HTTP_11),
        Err(HostError::Conflicting) => assert!(hosts.len() > 1),
        Err(HostError::Invalid(_)) => assert_eq!(hosts.len(), 1),
    }

    let inbound_xff: Vec<u8> = h
        .get_all(forwarding::X_FORWARDED_FOR)
        .iter()
        .map(|v| v.as_bytes().to_vec())
        .collect::<Vec<_>>()
        .join(&b", "[..]);
    let listed: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    let host_before = if hosts.len() == 1 {
        hosts.first().cloned()
    } else {
        None
    };
    let mut apart = h.clone();
    headers::rewrite(&mut h, Some(SocketAddr::new(peer, 1234)), trusted, None);

    // The rewrite for a head written apart leaves the same map without the
    // forwarding fields, and writes those as the lines of the map's.
    let fields = [
        header::FORWARDED,
        forwarding::X_FORWARDED_FOR,
        forwarding::X_FORWARDED_HOST,
        forwarding::X_FORWARDED_PROTO,
    ];
    let taken = headers::rewrite_apart(&mut apart, Some(&forwarding::node(peer)), trusted);
    let mut lines = Vec::new();
    taken.write(&mut lines);
    let mut want = Vec::new();
    for name in &fields {
        for v in h.get_all(name) {
            want.extend_from_slice(format!("{name}: ").as_bytes());
            want.extend_from_slice(v.as_bytes());
            want.extend_from_slice(b"\r\n");
        }
    }
    assert_eq!(
        String::from_utf8_lossy(&lines),
        String::from_utf8_lossy(&want),
        "the written forwarding lines differ from the map's"
    );
    let mut rest = h.clone();
    for name in &fields {
        rest.remove(name);
    }
    assert_eq!(apart, rest, "the map written apart differs");

    let one = |name: &HeaderName| -> Option<HeaderValue> {
        let all: Vec<&HeaderValue> = h.get_all(name).iter().collect();
        assert!(all.len() <= 1, "{name} appears {} times", all.len());
        all.first().map(|v| (*v).clone())
    };
    let peer_text = peer.to_canonical().to_string();
    let xff = one(&forwarding::X_FORWARDED_FOR).expect("X-Forwarded-For is set");
    let xfp = one(&forwarding::X_FORWARDED_PROTO).expect("X-Forwarded-Proto is set");
    let xfh = one(&forwarding::X_FORWARDED_HOST);
    let fwd = one(&header::FORWARDED).expect("Forwarded is set");
    assert!(
        xff.as_bytes().ends_with(peer_text.as_bytes()),
        "{xff:?} does not end with the peer"
    );
    if let Some(host) = &host_before {
        assert_eq!(h.get(header::HOST), Some(host), "Host was changed or stripped");
    }
    if trusted {
        let inbound = String::from_utf8_lossy(&inbound_xff).into_owned();
        let kept = String::from_utf8_lossy(xff.as_bytes()).into_owned();
        // The proxy's chain, unless `Connection` named it, then the peer.
        assert!(
            kept == peer_text || kept == format!("{inbound}, {peer_text}"),
            "{kept:?} from {inbound:?}"
        );
    } else {
        assert_eq!(
            xff.as_bytes(),
            peer_text.as_bytes(),
            "an untrusted peer's chain was believed"
        );
        assert_eq!(xfp, "http");
        assert_eq!(xfh, h.get(header::HOST).cloned(), "X-Forwarded-Host is not Host");
    }
    let elements =
        parse_forwarded(fwd.as_bytes()).unwrap_or_else(|| panic!("Forwarded {fwd:?} does not parse"));
    let nodes: Vec<&[u8]> = xff
        .as_bytes()
        .split(|b| *b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|n| !n.is_empty())
        .collect();
    let fors: Vec<&Vec<u8>> = elements
        .iter()
        .flatten()
        .filter(|(k, _)| k == "for")
        .map(|(_, v)| v)
        .collect();
    assert_eq!(fors.len(), nodes.len(), "{fwd:?} vs {xff:?}");
    for (f, n) in fors.iter().zip(&nodes) {
        let bracketed = [b"[".as_slice(), n, b"]"].concat();
        assert!(f.as_slice() == *n || *f == &bracketed, "{f:?} for {n:?}");
    }
    let last = elements.last().unwrap();
    let param = |k: &str| last.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(param("proto"), Some(xfp.as_bytes().to_vec()));
    assert_eq!(param("host"), xfh.as_ref().map(|v| v.as_bytes().to_vec()));

    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        HeaderName::from_static(HEADER_FUNCTION),
        HeaderName::from_static(HEADER_INSTANCE),
        HeaderName::from_static(HEADER_TENANT),
    ] {
        assert!(!h.contains_key(&name), "{name} is left");
    }
    let written = [
        header::HOST,
        header::FORWARDED,
        forwarding::X_FORWARDED_FOR,
        forwarding::X_FORWARDED_HOST,
        forwarding::X_FORWARDED_PROTO,
    ];
    for name in listed.iter().filter(|n| !written.contains(n)) {
        assert!(
            !h.contains_key(name),
            "{name} was listed in Connection but is left"
        );
    }
});
