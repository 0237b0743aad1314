//! Fuzz target: the router's `X-Skipper-Function` path — the function JSON
//! decoder, validation, the parsed-header cache and the gRPC conversion.
//!
//! Properties: a decoded function re-encodes to canonical JSON that decodes
//! to the same function (and identity); whatever the router accepts is
//! valid, converts to the wire form (without the router's own concurrency
//! limit, which controllers never see) and back unchanged, and is what the
//! cache answers; the cache answers exactly what parsing answers, refuses
//! headers over the size limit and never holds more bytes than its budget.
//! Run with `make fuzz` (see `fuzz/README.md`).

#![no_main]
// A fuzz target: a failed unwrap is a finding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::LazyLock;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use skipper::api;
use skipper::domain::{Function, HEADER_FUNCTION, Scale};
use skipper::router::entry::{HeaderCache, HeaderError, MAX_FUNCTION_HEADER_BYTES, parse};

/// Small, so eviction runs all the time.
const BUDGET: usize = 64 * 1024;
static CACHE: LazyLock<HeaderCache> = LazyLock::new(|| HeaderCache::new(BUDGET));

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(f) = Function::from_json(raw) {
        let json = f.to_json();
        let again = Function::from_json(&json).unwrap_or_else(|e| panic!("{json:?} does not decode: {e}"));
        assert_eq!(again, f, "decode(encode(f)) != f for {json:?}");
        assert_eq!(again.to_json(), json, "the encoding is not canonical");
        assert_eq!(again.id(), f.id());
    }
    let parsed = parse(raw);
    if let Ok(p) = &parsed {
        assert!(p.function.validate().is_ok());
        assert_eq!(p.id, p.function.id());
        // Controllers get the function without the router-side limit.
        let mut sent = p.function.clone();
        sent.scale = sent.scale.as_ref().map(Scale::for_controllers);
        assert_eq!(
            Function::from(&p.api),
            sent,
            "the wire form loses more than the router's own limit"
        );
        assert_eq!(api::Function::from(&sent), p.api);
    }
    let Ok(value) = HeaderValue::from_str(raw) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert(HEADER_FUNCTION, value);
    let cached = CACHE.function(&headers);
    if raw.len() > MAX_FUNCTION_HEADER_BYTES {
        assert!(matches!(cached, Err(HeaderError::TooLarge { .. })), "{cached:?}");
    } else {
        match (&parsed, &cached) {
            (Ok(p), Ok(c)) => assert_eq!(p.function, c.function),
            (Err(p), Err(c)) => assert_eq!(p, c),
            _ => panic!("parse said {parsed:?}, the cache {cached:?}"),
        }
    }
    assert!(
        CACHE.bytes() <= BUDGET,
        "cache holds {} bytes, budget {BUDGET}",
        CACHE.bytes()
    );
});
