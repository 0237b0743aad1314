//! Fuzz target: PASETO assignment tokens (`src/token.rs`), as pods verify
//! them.
//!
//! Input byte 0 picks the mode. Odd: the rest is a token verified with the
//! fuzz key at a fixed time; whatever verifies must have been signed by that
//! key (the signature over the PASETO pre-authentication encoding checks out
//! with ed25519-dalek's strict verification), be in canonical encoding (no
//! second spelling of a signed token is accepted), carry exactly the claims
//! of its signed message (the binding claims too), and be valid at that
//! time; a pod trusting another key beside it accepts exactly the same
//! tokens with the same claims, and one trusting only another key none.
//! `2 mod 4`: the rest is `tenant NUL pod NUL uid`; tokens bound to that pod
//! in both versions verify (through the trusted set, by `kid`) to those
//! claims, bind to that pod only (another name or UID is refused), carry a
//! fresh `jti` each, and expire with their lifetime. `0 mod 4`: the rest is
//! a tenant; unbound tokens signed for it in both versions verify to that
//! tenant and the issue time, are refused by another key, before their issue
//! time and after their expiry. Run with `make fuzz`.

#![no_main]
// A fuzz target: a failed unwrap is a finding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use libfuzzer_sys::fuzz_target;
use skipper::token::{
    AUDIENCE, PodRef, SigningKey, TOKEN_LIFETIME, TokenError, TrustedKeys, VerifyingKey, Version,
};

/// 2024-01-15T10:30:00Z: the seed tokens were issued then.
const ISSUED: u64 = 1_705_314_600;

/// The key of the seed corpus: PKCS#8 of the seed `[7; 32]`.
static KEY: LazyLock<SigningKey> = LazyLock::new(|| {
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
    ];
    der.extend_from_slice(&[7u8; 32]);
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    SigningKey::from_pem(&format!(
        "-----BEGIN PRIVATE KEY-----\n{b64}\n-----END PRIVATE KEY-----\n"
    ))
    .unwrap()
});
static PUBLIC: LazyLock<VerifyingKey> = LazyLock::new(|| KEY.verifying_key());
static OTHER: LazyLock<VerifyingKey> = LazyLock::new(|| SigningKey::generate().verifying_key());
/// A pod mid-rotation: it trusts another key and the fuzz key.
static BOTH: LazyLock<TrustedKeys> =
    LazyLock::new(|| TrustedKeys::from_pem(&format!("{}{}", OTHER.to_pem(), PUBLIC.to_pem())).unwrap());
/// A pod that trusts another key only.
static ONLY_OTHER: LazyLock<TrustedKeys> = LazyLock::new(|| TrustedKeys::from_pem(&OTHER.to_pem()).unwrap());

/// PASETO pre-authentication encoding.
fn pae(pieces: &[&[u8]]) -> Vec<u8> {
    let mut out = (pieces.len() as u64).to_le_bytes().to_vec();
    for p in pieces {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn verified(token: &str, now: SystemTime) {
    let through_set = BOTH.verify(token, now);
    assert!(
        ONLY_OTHER.verify(token, now).is_err(),
        "a token verified with a key nobody signs with"
    );
    let Ok(claims) = PUBLIC.verify(token, now) else {
        assert!(
            through_set.is_err(),
            "the trusted set accepted what its key refuses: {through_set:?}"
        );
        return;
    };
    // The set picks the key `kid` names (each key without one): the fuzz key's
    // tokens verify through it unless they name another key.
    let names_other = claims
        .kid
        .as_ref()
        .is_some_and(|k| *k != PUBLIC.key_id(version_of(token)));
    if names_other {
        assert!(
            through_set.is_err(),
            "a token naming another key verified: {through_set:?}"
        );
    } else {
        assert_eq!(through_set.as_ref(), Ok(&claims), "the trusted set disagrees");
    }
    let (header, body) = if let Some(b) = token.strip_prefix("v2.public.") {
        ("v2.public.", b)
    } else if let Some(b) = token.strip_prefix("v4.public.") {
        ("v4.public.", b)
    } else {
        panic!("{token:?} verified without a known header");
    };
    assert!(!body.contains('.'), "a footer was accepted: {token:?}");
    let bytes = URL_SAFE_NO_PAD
        .decode(body)
        .unwrap_or_else(|e| panic!("verified body is not base64url: {e}"));
    assert_eq!(
        URL_SAFE_NO_PAD.encode(&bytes),
        body,
        "a non-canonical spelling verified"
    );
    assert!(bytes.len() > 64);
    let (message, sig) = bytes.split_at(bytes.len() - 64);
    let signed = if header == "v2.public." {
        pae(&[header.as_bytes(), message, b""])
    } else {
        pae(&[header.as_bytes(), message, b"", b""])
    };
    let key = ed25519_dalek::VerifyingKey::from_bytes(&PUBLIC.0).unwrap();
    let sig = ed25519_dalek::Signature::from_slice(sig).unwrap();
    key.verify_strict(&signed, &sig)
        .expect("a token verified that the key did not sign");
    let m: serde_json::Value = serde_json::from_slice(message).expect("signed message is JSON");
    assert_eq!(m["sub"].as_str(), Some(claims.sub.as_str()));
    for (name, value) in [
        ("aud", &claims.aud),
        ("jti", &claims.jti),
        ("kid", &claims.kid),
        ("pod", &claims.pod),
        ("pod_uid", &claims.pod_uid),
    ] {
        assert_eq!(m[name].as_str(), value.as_deref(), "claim {name}");
    }
    assert!(
        claims.iat <= now && claims.nbf <= now && claims.exp >= now,
        "{claims:?}"
    );
}

fn round_trip(tenant: &str) {
    let issued = UNIX_EPOCH + Duration::from_secs(ISSUED);
    for version in [Version::V2, Version::V4] {
        let token = KEY
            .sign(version, tenant, issued + Duration::from_millis(999))
            .unwrap();
        let later = issued + Duration::from_secs(3600);
        let c = PUBLIC.verify(&token, later).unwrap();
        assert_eq!(c.sub, tenant);
        assert_eq!(c.iat, issued, "issue time is kept to the second");
        assert_eq!(c.nbf, issued);
        assert_eq!(c.exp, issued + TOKEN_LIFETIME);
        assert_eq!(OTHER.verify(&token, later), Err(TokenError::BadSignature));
        assert_eq!(
            PUBLIC.verify(&token, issued - Duration::from_secs(1)),
            Err(TokenError::NotYetValid("iat"))
        );
        assert_eq!(
            PUBLIC.verify(&token, issued + TOKEN_LIFETIME + Duration::from_secs(1)),
            Err(TokenError::Expired)
        );
        verified(&token, later);
    }
}

fn version_of(token: &str) -> Version {
    if token.starts_with("v4.") {
        Version::V4
    } else {
        Version::V2
    }
}

/// Tokens bound to one assignment of `tenant` on pod `name`/`uid`.
fn bound_round_trip(tenant: &str, name: &str, uid: &str) {
    let issued = UNIX_EPOCH + Duration::from_secs(ISSUED);
    let lifetime = Duration::from_secs(600);
    let pod = PodRef { name, uid };
    for version in [Version::V2, Version::V4] {
        let (token, jti) = KEY.sign_bound(version, tenant, pod, lifetime, issued).unwrap();
        let (again, jti2) = KEY.sign_bound(version, tenant, pod, lifetime, issued).unwrap();
        assert_ne!(jti, jti2, "two assignments share a jti");
        assert_ne!(token, again);
        let now = issued + Duration::from_secs(1);
        let c = BOTH.verify(&token, now).unwrap();
        assert_eq!(c.sub, tenant);
        assert_eq!(c.aud.as_deref(), Some(AUDIENCE));
        assert_eq!(c.pod.as_deref(), Some(name));
        assert_eq!(c.pod_uid.as_deref(), Some(uid));
        assert_eq!(c.jti.as_deref(), Some(jti.as_str()));
        assert_eq!(c.kid, Some(KEY.key_id(version)));
        assert_eq!(c.exp, issued + lifetime);
        assert!(c.is_bound());
        c.check_binding(Some(name), Some(uid), false).unwrap();
        c.check_binding(Some(name), None, false).unwrap();
        let other = format!("{name}x");
        assert!(matches!(
            c.check_binding(Some(&other), Some(uid), true),
            Err(TokenError::OtherPod { .. })
        ));
        let other_uid = format!("{uid}x");
        assert!(matches!(
            c.check_binding(Some(name), Some(&other_uid), true),
            Err(TokenError::OtherPodUid { .. })
        ));
        assert_eq!(
            c.check_binding(None, Some(uid), true),
            Err(TokenError::PodNameUnknown)
        );
        assert!(ONLY_OTHER.verify(&token, now).is_err());
        assert_eq!(
            BOTH.verify(&token, issued + lifetime + Duration::from_secs(1)),
            Err(TokenError::Expired)
        );
        verified(&token, now);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    if mode & 1 == 1 {
        verified(text, UNIX_EPOCH + Duration::from_secs(ISSUED + 86_400));
    } else if mode & 3 == 2 {
        let mut parts = text.splitn(3, '\0');
        let (tenant, name, uid) = (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        );
        bound_round_trip(tenant, name, uid);
    } else {
        round_trip(text);
    }
});
