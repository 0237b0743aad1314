//! Request entry: the function header, its parse cache (bounded in bytes),
//! `/healthz` and the 4xx answers for bad headers (spec §6.1, §13.1).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use http::{HeaderMap, Method};

use crate::api;
use crate::domain::{self, FunctionId};

/// Bytes the header cache may hold (keys and parsed values).
pub const CACHE_BYTES: usize = 4 * 1024 * 1024;
/// Longest accepted `X-Skipper-Function` value: the per-line limit of common
/// ingress proxies (nginx `large_client_header_buffers`), so a header that
/// passes them passes the router.
pub const MAX_FUNCTION_HEADER_BYTES: usize = 8 * 1024;
/// Shards of the header cache (independent locks).
const SHARDS: usize = 16;
/// Fixed per-entry overhead counted besides the strings (map slot, queue
/// slot, `Arc` headers, the parsed structs).
const ENTRY_OVERHEAD: usize = 512;

/// A validated function with everything the request path derives from it.
#[derive(Debug)]
pub struct Parsed {
    pub function: domain::Function,
    /// The function as controllers get it (without the router-side
    /// concurrency limit).
    pub api: api::Function,
    pub id: FunctionId,
}

impl Parsed {
    /// Heap and inline bytes this value occupies (approximate, never below
    /// the real figure by more than the fixed overhead).
    #[must_use]
    pub fn footprint(&self) -> usize {
        let f = &self.function;
        let strings = f.namespace.len()
            + f.deployment.len()
            + f.tenant.len()
            + f.metadata.as_ref().map_or(0, String::len);
        // `api` holds a copy of each string.
        2 * strings + std::mem::size_of::<Self>()
    }
}

/// Why a request's function header is unusable. `Display` is the one-line
/// body of the 4xx answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("missing X-Skipper-Function")]
    Missing,
    #[error("failed to unmarshal X-Skipper-Function header: X-Skipper-Function is not valid UTF-8")]
    NotUtf8,
    #[error("X-Skipper-Function is {len} bytes; the limit is {MAX_FUNCTION_HEADER_BYTES}")]
    TooLarge { len: usize },
    #[error("failed to unmarshal X-Skipper-Function header: {0}")]
    Malformed(#[source] domain::ParseError),
    #[error("{0}")]
    Invalid(#[source] domain::ValidationError),
}

/// One cache shard: entries by raw header, and the insertion order with a
/// second-chance bit (CLOCK) for eviction. A std mutex: every critical
/// section is a map lookup or update, never across an await.
#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Arc<str>, Slot>,
    order: VecDeque<Arc<str>>,
    bytes: usize,
}

#[derive(Debug)]
struct Slot {
    parsed: Arc<Parsed>,
    bytes: usize,
    referenced: bool,
}

impl Shard {
    fn evict_one(&mut self) -> bool {
        while let Some(key) = self.order.pop_front() {
            let Some(slot) = self.map.get_mut(&key) else {
                continue;
            };
            if slot.referenced {
                slot.referenced = false;
                self.order.push_back(key);
                continue;
            }
            let bytes = slot.bytes;
            self.map.remove(&key);
            self.bytes -= bytes;
            return true;
        }
        false
    }
}

/// Parsed, validated functions keyed by the raw header value. Bounded in
/// bytes: keys and parsed values together stay within the budget (entries
/// evicted least-recently-used first, approximately). Only valid headers
/// are cached.
#[derive(Debug)]
pub struct HeaderCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    shard_budget: usize,
}

impl Default for HeaderCache {
    fn default() -> Self {
        Self::new(CACHE_BYTES)
    }
}

impl HeaderCache {
    /// A cache holding at most `budget` bytes.
    #[must_use]
    pub fn new(budget: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            shard_budget: budget / SHARDS,
        }
    }

    fn shard(&self, raw: &str) -> std::sync::MutexGuard<'_, Shard> {
        // Truncation is fine: only the low bits pick the shard.
        #[allow(clippy::cast_possible_truncation)]
        let i = self.hasher.hash_one(raw) as usize % SHARDS;
        // Poisoning needs a panic inside a map update, which cannot happen.
        self.shards[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The function named by the first `X-Skipper-Function` value.
    ///
    /// # Errors
    /// [`HeaderError`] when the header is absent, too large, malformed or
    /// invalid.
    pub fn function(&self, headers: &HeaderMap) -> Result<Arc<Parsed>, HeaderError> {
        let raw = headers
            .get(super::proxy::headers::FUNCTION)
            .ok_or(HeaderError::Missing)?;
        if raw.len() > MAX_FUNCTION_HEADER_BYTES {
            return Err(HeaderError::TooLarge { len: raw.len() });
        }
        // Any UTF-8 (not only visible ASCII): metadata is an opaque string.
        let raw = std::str::from_utf8(raw.as_bytes()).map_err(|_| HeaderError::NotUtf8)?;
        if let Some(slot) = self.shard(raw).map.get_mut(raw) {
            slot.referenced = true;
            return Ok(slot.parsed.clone());
        }
        let parsed = Arc::new(parse(raw)?);
        self.insert(raw, parsed.clone());
        Ok(parsed)
    }

    fn insert(&self, raw: &str, parsed: Arc<Parsed>) {
        let bytes = raw.len() + parsed.footprint() + ENTRY_OVERHEAD;
        if bytes > self.shard_budget {
            return;
        }
        let mut shard = self.shard(raw);
        if shard.map.contains_key(raw) {
            return;
        }
        while shard.bytes + bytes > self.shard_budget {
            if !shard.evict_one() {
                break;
            }
        }
        let key: Arc<str> = Arc::from(raw);
        shard.order.push_back(key.clone());
        shard.map.insert(
            key,
            Slot {
                parsed,
                bytes,
                referenced: false,
            },
        );
        shard.bytes += bytes;
    }

    /// Number of cached functions.
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .map
                    .len()
            })
            .sum()
    }

    /// Bytes accounted to the cached entries.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(std::sync::PoisonError::into_inner).bytes)
            .sum()
    }

    /// Whether nothing is cached.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Parses and validates one header value.
///
/// # Errors
/// [`HeaderError::Malformed`] or [`HeaderError::Invalid`].
pub fn parse(raw: &str) -> Result<Parsed, HeaderError> {
    let function = domain::Function::from_json(raw).map_err(HeaderError::Malformed)?;
    function.validate().map_err(HeaderError::Invalid)?;
    let mut sent = api::Function::from(&function);
    // The concurrency limit is the router's own (see `Scale::for_controllers`).
    sent.scale = function
        .scale
        .as_ref()
        .map(|s| api::Scale::from(&s.for_controllers()));
    Ok(Parsed {
        api: sent,
        id: function.id(),
        function,
    })
}

/// The router's own checks, asked without a function header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// `GET /healthz` (readiness): whether the router should get traffic.
    Health,
    /// `GET /livez` (liveness): whether the process answers at all.
    Live,
}

/// Which check a request without a usable function header is, if any.
#[must_use]
pub fn check(method: &Method, path: &str) -> Option<Check> {
    if method != Method::GET {
        return None;
    }
    match path {
        "/healthz" => Some(Check::Health),
        "/livez" => Some(Check::Live),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use crate::domain::HEADER_FUNCTION;

    use super::*;

    const VALID: &str = r#"{"namespace":"ns","deployment":"app","tenant":"t1","scale":{"max_instances":2}}"#;

    #[test]
    fn the_concurrency_limit_stays_with_the_router() {
        let p = parse(
            r#"{"namespace":"ns","deployment":"app","tenant":"t1","scale":{"max_instances":2,"max_in_flight_requests":3}}"#,
        )
        .unwrap();
        assert_eq!(
            p.function.scale.as_ref().unwrap().max_in_flight_requests(),
            3,
            "the router reads it"
        );
        let sent = p.api.scale.unwrap();
        assert_eq!(sent.max_in_flight_requests, None, "controllers never see it");
        assert_eq!(sent.max_instances, Some(2));
        assert_eq!(p.id, parse(VALID).unwrap().id, "it is not part of the identity");
    }

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(HEADER_FUNCTION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn header_matrix() {
        let cache = HeaderCache::default();
        let cases: &[(&[&str], Result<(), &str>)] = &[
            (&[], Err("missing X-Skipper-Function")),
            (&["{"], Err("failed to unmarshal X-Skipper-Function header: ")),
            (
                &[r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"max_instances":-1}}"#],
                Err("failed to unmarshal X-Skipper-Function header: "),
            ),
            (
                &[
                    r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"min_instances":1,"minInstances":1,"max_instances":1}}"#,
                ],
                Err("failed to unmarshal X-Skipper-Function header: "),
            ),
            (
                &[r#"{"deployment":"app","tenant":"t","scale":{"max_instances":1}}"#],
                Err("missing namespace"),
            ),
            (
                &[r#"{"namespace":"ns","tenant":"t","scale":{"max_instances":1}}"#],
                Err("missing deployment"),
            ),
            (
                &[r#"{"namespace":"ns","deployment":"app","scale":{"max_instances":1}}"#],
                Err("missing tenant"),
            ),
            (
                &[r#"{"namespace":"ns","deployment":"app","tenant":"t"}"#],
                Err("missing scale"),
            ),
            (
                &[r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"max_instances":0}}"#],
                Err("scale.max_instances must be >= 1"),
            ),
            (
                &[
                    r#"{"namespace":"ns","deployment":"app","tenant":"t","scale":{"min_instances":3,"max_instances":2}}"#,
                ],
                Err("scale.min_instances (3) must be <= scale.max_instances (2)"),
            ),
            (&[VALID], Ok(())),
            (&[VALID, "{"], Ok(())),
            (
                &[
                    r#"{"namespace":"ns","deployment":"app","tenant":"t","nonce":1,"scale":{"maxInstances":"5"}}"#,
                ],
                Ok(()),
            ),
        ];
        for (values, want) in cases {
            let got = cache.function(&headers(values));
            match (want, got) {
                (Ok(()), Ok(_)) => {}
                (Err(prefix), Err(e)) => {
                    assert!(e.to_string().starts_with(prefix), "{values:?}: {e}");
                }
                (want, got) => panic!("{values:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn utf8_beyond_ascii_is_accepted_and_other_bytes_are_not() {
        let cache = HeaderCache::default();
        let raw = r#"{"namespace":"ns","deployment":"app","tenant":"t","metadata":"café ☕","scale":{"max_instances":1}}"#;
        let mut h = HeaderMap::new();
        h.insert(HEADER_FUNCTION, HeaderValue::from_bytes(raw.as_bytes()).unwrap());
        let parsed = cache.function(&h).unwrap();
        assert_eq!(parsed.function.metadata.as_deref(), Some("café ☕"));
        h.insert(
            HEADER_FUNCTION,
            HeaderValue::from_bytes(b"{\"tenant\":\"\xff\"}").unwrap(),
        );
        assert_eq!(cache.function(&h).unwrap_err(), HeaderError::NotUtf8);
    }

    #[test]
    fn only_valid_headers_are_cached_and_hits_share_the_value() {
        let cache = HeaderCache::default();
        let a = cache.function(&headers(&[VALID])).unwrap();
        let b = cache.function(&headers(&[VALID])).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(cache.function(&headers(&["{"])).is_err());
        assert_eq!(cache.len(), 1);
        assert_eq!(a.id, a.function.id());
    }

    #[test]
    fn the_cache_is_bounded_in_bytes_and_keeps_hot_entries() {
        let budget = 256 * 1024;
        let cache = HeaderCache::new(budget);
        let hot = headers(&[VALID]);
        cache.function(&hot).unwrap();
        let filler = "x".repeat(6000);
        for i in 0..2000 {
            let v = format!(
                r#"{{"namespace":"ns","deployment":"app","tenant":"t{i}","unknown":"{filler}","scale":{{"max_instances":1}}}}"#
            );
            cache.function(&headers(&[&v])).unwrap();
            cache.function(&hot).unwrap();
            assert!(cache.bytes() <= budget, "{} > {budget}", cache.bytes());
        }
        assert!(cache.len() < 2000 && !cache.is_empty());
        let a = cache.function(&hot).unwrap();
        let b = cache.function(&hot).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "a header in use stays cached");
    }

    #[test]
    fn oversized_headers_are_refused_before_parsing() {
        let cache = HeaderCache::default();
        let big = format!(
            r#"{{"namespace":"ns","deployment":"app","tenant":"t","x":"{}","scale":{{"max_instances":1}}}}"#,
            "y".repeat(MAX_FUNCTION_HEADER_BYTES)
        );
        let err = cache.function(&headers(&[&big])).unwrap_err();
        assert_eq!(err, HeaderError::TooLarge { len: big.len() });
        assert_eq!(
            err.to_string(),
            format!("X-Skipper-Function is {} bytes; the limit is 8192", big.len())
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn health_check_is_get_healthz_only() {
        assert_eq!(check(&Method::GET, "/healthz"), Some(Check::Health));
        assert_eq!(check(&Method::GET, "/livez"), Some(Check::Live));
        assert_eq!(check(&Method::HEAD, "/healthz"), None);
        assert_eq!(check(&Method::POST, "/livez"), None);
        assert_eq!(check(&Method::GET, "/healthz/"), None);
    }
}
