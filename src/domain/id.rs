//! [`FunctionId`]: the 64-bit identity hash of a function.

use std::fmt;

/// XXH64 (seed 0) over `namespace 0x00 deployment 0x00 tenant 0x00 oneshot`,
/// where `oneshot` is one byte, `0x01` or `0x00`.
///
/// Metadata and scale are not part of the identity. This value decides ring
/// ownership and keys every per-function map, so it is bit-exact with the Go
/// implementation (pinned by `tests/data/function_ids.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FunctionId(pub u64);

impl FunctionId {
    /// Computes the identity of a function from its identity fields.
    #[must_use]
    pub fn of(namespace: &str, deployment: &str, tenant: &str, oneshot: bool) -> Self {
        let len = namespace.len() + deployment.len() + tenant.len() + 4;
        let mut stack = [0u8; 256];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= stack.len() {
            &mut stack[..len]
        } else {
            heap.resize(len, 0);
            &mut heap
        };
        let mut at = 0;
        for part in [namespace, deployment, tenant] {
            buf[at..at + part.len()].copy_from_slice(part.as_bytes());
            at += part.len() + 1; // the separator byte is already 0
        }
        buf[at] = u8::from(oneshot);
        Self(xxhash_rust::xxh64::xxh64(buf, 0))
    }

    /// The 32-bit ring key: low 32 bits XOR high 32 bits.
    #[must_use]
    pub fn fold32(self) -> u32 {
        // Truncation to the low half is the point of the fold.
        #[allow(clippy::cast_possible_truncation)]
        let folded = (self.0 ^ (self.0 >> 32)) as u32;
        folded
    }
}

impl fmt::Display for FunctionId {
    /// Decimal, as used for index keys and JSON (`"11147987099846445000"`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_keep_fields_apart() {
        let ids = [
            FunctionId::of("ab", "cd", "", false),
            FunctionId::of("abc", "d", "", false),
            FunctionId::of("a", "bcd", "", false),
            FunctionId::of("abcd", "", "", false),
        ];
        for (i, a) in ids.iter().enumerate() {
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_ne!(
            FunctionId::of("ns", "dep", "t", true),
            FunctionId::of("ns", "dep", "t", false)
        );
    }

    #[test]
    fn long_names_hash_like_short_ones() {
        let long = "t".repeat(300);
        let mut bytes = b"ns\0dep\0".to_vec();
        bytes.extend_from_slice(long.as_bytes());
        bytes.extend_from_slice(&[0, 1]);
        assert_eq!(
            FunctionId::of("ns", "dep", &long, true).0,
            xxhash_rust::xxh64::xxh64(&bytes, 0)
        );
    }

    #[test]
    fn empty_input_matches_canonical_vector() {
        assert_eq!(xxhash_rust::xxh64::xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
    }
}
