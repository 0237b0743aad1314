//! Request entry: the function header, its bounded parse cache, `/healthz`
//! and the 400 answers for bad headers (spec §6.1, §13.1).

use std::sync::Arc;

use http::{HeaderMap, Method};

use crate::api;
use crate::domain::{self, FunctionId, HEADER_FUNCTION};

/// Capacity of the header cache.
pub const CACHE_CAPACITY: usize = 4096;

/// A validated function with everything the request path derives from it.
#[derive(Debug)]
pub struct Parsed {
    pub function: domain::Function,
    pub api: api::Function,
    pub id: FunctionId,
}

/// Why a request's function header is unusable. `Display` is the one-line
/// body of the 400 answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("missing X-Skipper-Function")]
    Missing,
    #[error("failed to unmarshal X-Skipper-Function header: X-Skipper-Function is not valid UTF-8")]
    NotUtf8,
    #[error("failed to unmarshal X-Skipper-Function header: {0}")]
    Malformed(#[source] domain::ParseError),
    #[error("{0}")]
    Invalid(#[source] domain::ValidationError),
}

/// Parsed, validated functions keyed by the raw header value (bounded,
/// concurrent, least recently used entries evicted). Only valid headers are
/// cached.
#[derive(Debug)]
pub struct HeaderCache {
    cache: scc::HashCache<String, Arc<Parsed>>,
}

impl Default for HeaderCache {
    fn default() -> Self {
        Self::new(CACHE_CAPACITY)
    }
}

impl HeaderCache {
    /// A cache holding at most `capacity` functions.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            cache: scc::HashCache::with_capacity(0, capacity),
        }
    }

    /// The function named by the first `X-Skipper-Function` value.
    ///
    /// # Errors
    /// [`HeaderError`] when the header is absent, malformed or invalid.
    pub async fn function(&self, headers: &HeaderMap) -> Result<Arc<Parsed>, HeaderError> {
        let raw = headers.get(HEADER_FUNCTION).ok_or(HeaderError::Missing)?;
        let raw = raw.to_str().map_err(|_| HeaderError::NotUtf8)?;
        if let Some(hit) = self.cache.read_async(raw, |_, v| v.clone()).await {
            return Ok(hit);
        }
        let parsed = Arc::new(parse(raw)?);
        let _ = self.cache.put_async(raw.to_owned(), parsed.clone()).await;
        Ok(parsed)
    }

    /// Number of cached functions.
    #[must_use]
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether nothing is cached.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

/// Parses and validates one header value.
///
/// # Errors
/// [`HeaderError::Malformed`] or [`HeaderError::Invalid`].
pub fn parse(raw: &str) -> Result<Parsed, HeaderError> {
    let function = domain::Function::from_json(raw).map_err(HeaderError::Malformed)?;
    function.validate().map_err(HeaderError::Invalid)?;
    Ok(Parsed {
        api: api::Function::from(&function),
        id: function.id(),
        function,
    })
}

/// Whether a request without a usable function header is the health check.
#[must_use]
pub fn is_health_check(method: &Method, path: &str) -> bool {
    method == Method::GET && path == "/healthz"
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const VALID: &str = r#"{"namespace":"ns","deployment":"app","tenant":"t1","scale":{"max_instances":2}}"#;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(HEADER_FUNCTION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[tokio::test]
    async fn header_matrix() {
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
            let got = cache.function(&headers(values)).await;
            match (want, got) {
                (Ok(()), Ok(_)) => {}
                (Err(prefix), Err(e)) => {
                    assert!(e.to_string().starts_with(prefix), "{values:?}: {e}");
                }
                (want, got) => panic!("{values:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[tokio::test]
    async fn only_valid_headers_are_cached_and_hits_share_the_value() {
        let cache = HeaderCache::default();
        let a = cache.function(&headers(&[VALID])).await.unwrap();
        let b = cache.function(&headers(&[VALID])).await.unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(cache.function(&headers(&["{"])).await.is_err());
        assert_eq!(cache.len(), 1);
        assert_eq!(a.id, a.function.id());
    }

    #[tokio::test]
    async fn the_cache_is_bounded() {
        let cache = HeaderCache::new(64);
        for i in 0..1000 {
            let v = format!(
                r#"{{"namespace":"ns","deployment":"app","tenant":"t{i}","scale":{{"max_instances":1}}}}"#
            );
            cache.function(&headers(&[&v])).await.unwrap();
        }
        assert!(cache.len() <= 64 * 2, "{}", cache.len());
    }

    #[test]
    fn health_check_is_get_healthz_only() {
        assert!(is_health_check(&Method::GET, "/healthz"));
        assert!(!is_health_check(&Method::HEAD, "/healthz"));
        assert!(!is_health_check(&Method::POST, "/healthz"));
        assert!(!is_health_check(&Method::GET, "/healthz/"));
    }
}
