//! PASETO assignment tokens: signed by the controller, verified by pods.
//!
//! A token is `v2.public` (Ed25519, the default, compatible with existing
//! pods) or `v4.public`, with no footer. Its message is the JSON object
//! `{"exp":..,"iat":..,"nbf":..,"sub":<tenant>}` (keys sorted), times in
//! RFC 3339 with second precision; `exp` is `iat` + 7 days.
//!
//! Keys are PEM: the private key is PKCS#8 (`PRIVATE KEY`), the public key is
//! SPKI (`PUBLIC KEY`), both Ed25519.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use ed25519_dalek::pkcs8::spki::der::Decode as _;
use ed25519_dalek::pkcs8::{ObjectIdentifier, PrivateKeyInfo, spki::SubjectPublicKeyInfoRef};
use pasetors::Public;
use pasetors::keys::{AsymmetricPublicKey, AsymmetricSecretKey};
use pasetors::token::UntrustedToken;
use pasetors::version2::V2;
use pasetors::version4::V4;

/// How long a token is valid after it is issued.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

const ED25519_OID: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.101.112");

/// PASETO version of the tokens a controller issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Version {
    /// `v2.public` (Ed25519): what every existing pod accepts.
    #[default]
    V2,
    /// `v4.public` (Ed25519 with BLAKE2b pre-authentication).
    V4,
}

/// A key could not be read. The messages are what operators see at start-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("invalid PEM block")]
    NoPrivatePem,
    #[error("invalid PEM block type: {0}")]
    PrivatePemType(String),
    #[error("failed to parse pkcs8 private key: {0}")]
    Pkcs8(String),
    #[error("invalid private key type")]
    NotEd25519Private,
    #[error("parsing public key: no PEM block found")]
    NoPublicPem,
    #[error("parsing PKIX public key: {0}")]
    Pkix(String),
    #[error("expected ed25519 public key, got {0}")]
    NotEd25519Public(String),
}

/// A token was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("token is not a v2.public or v4.public PASETO token")]
    Malformed,
    #[error("token signature is invalid")]
    BadSignature,
    #[error("token claims are not a JSON object with string claims: {0}")]
    BadClaims(String),
    #[error("token claim {0} is missing")]
    MissingClaim(&'static str),
    #[error("token claim {claim} is not an RFC 3339 time: {value:?}")]
    BadTime { claim: &'static str, value: String },
    #[error("token is not valid yet ({0} is in the future)")]
    NotYetValid(&'static str),
    #[error("token has expired")]
    Expired,
    #[error("signing failed: {0}")]
    Sign(String),
}

/// The Ed25519 key that signs tokens (seed followed by the public key).
#[derive(Clone)]
pub struct SigningKey {
    seed_and_public: [u8; 64],
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningKey(********)")
    }
}

/// The Ed25519 public key that verifies tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyingKey(pub [u8; 32]);

/// The claims of a verified token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The tenant the pod is assigned to.
    pub sub: String,
    pub iat: SystemTime,
    pub nbf: SystemTime,
    pub exp: SystemTime,
}

/// The first PEM block of `text`: `(label, der bytes)`, or `None` when there is none.
fn first_pem_block(text: &str) -> Option<(String, Result<Vec<u8>, String>)> {
    let start = text.find("-----BEGIN ")?;
    let rest = &text[start + "-----BEGIN ".len()..];
    let label_end = rest.find("-----")?;
    let label = rest[..label_end].to_owned();
    let body = &rest[label_end + 5..];
    let end = body.find("-----END ")?;
    let b64: String = body[..end].chars().filter(|c| !c.is_whitespace()).collect();
    let der = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| e.to_string());
    Some((label, der))
}

impl SigningKey {
    /// Reads a PKCS#8 PEM Ed25519 private key (only the first PEM block).
    ///
    /// # Errors
    /// [`KeyError`] naming what is wrong with the key.
    pub fn from_pem(pem: &str) -> Result<Self, KeyError> {
        let (label, der) = first_pem_block(pem).ok_or(KeyError::NoPrivatePem)?;
        if label != "PRIVATE KEY" {
            return Err(KeyError::PrivatePemType(label));
        }
        let der = der.map_err(KeyError::Pkcs8)?;
        let info = PrivateKeyInfo::from_der(&der).map_err(|e| KeyError::Pkcs8(e.to_string()))?;
        if info.algorithm.oid != ED25519_OID {
            return Err(KeyError::NotEd25519Private);
        }
        let key = <ed25519_dalek::SigningKey as ed25519_dalek::pkcs8::DecodePrivateKey>::from_pkcs8_der(&der)
            .map_err(|e| KeyError::Pkcs8(e.to_string()))?;
        Ok(Self::from_dalek(&key))
    }

    fn from_dalek(key: &ed25519_dalek::SigningKey) -> Self {
        let mut seed_and_public = [0u8; 64];
        seed_and_public[..32].copy_from_slice(&key.to_bytes());
        seed_and_public[32..].copy_from_slice(key.verifying_key().as_bytes());
        Self { seed_and_public }
    }

    /// A fresh random key.
    #[must_use]
    pub fn generate() -> Self {
        let mut seed = [0u8; 32];
        rand::fill(&mut seed);
        Self::from_dalek(&ed25519_dalek::SigningKey::from_bytes(&seed))
    }

    /// The matching public key.
    #[must_use]
    pub fn verifying_key(&self) -> VerifyingKey {
        let mut pk = [0u8; 32];
        pk.copy_from_slice(&self.seed_and_public[32..]);
        VerifyingKey(pk)
    }

    /// The key as PKCS#8 PEM (`PRIVATE KEY`).
    #[must_use]
    pub fn to_pem(&self) -> String {
        // PKCS#8 v1 for Ed25519 (RFC 8410): fixed 16-byte prefix + 32-byte seed.
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
        ];
        der.extend_from_slice(&self.seed_and_public[..32]);
        pem_encode("PRIVATE KEY", &der)
    }

    /// Signs an assignment token for `tenant`, issued at `now`.
    ///
    /// # Errors
    /// [`TokenError::Sign`] if the PASETO library rejects the key.
    pub fn sign(&self, version: Version, tenant: &str, now: SystemTime) -> Result<String, TokenError> {
        let message = claims_json(tenant, now);
        let sign_err = |e: pasetors::errors::Error| TokenError::Sign(e.to_string());
        match version {
            Version::V2 => {
                let sk = AsymmetricSecretKey::<V2>::from(&self.seed_and_public).map_err(sign_err)?;
                pasetors::version2::PublicToken::sign(&sk, message.as_bytes(), None).map_err(sign_err)
            }
            Version::V4 => {
                let sk = AsymmetricSecretKey::<V4>::from(&self.seed_and_public).map_err(sign_err)?;
                pasetors::version4::PublicToken::sign(&sk, message.as_bytes(), None, None).map_err(sign_err)
            }
        }
    }
}

/// The claims message: keys sorted, second-precision RFC 3339 UTC times.
fn claims_json(tenant: &str, now: SystemTime) -> String {
    let secs = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let now = UNIX_EPOCH + Duration::from_secs(secs);
    let ts = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
    let iat = ts(now);
    let exp = ts(now + TOKEN_LIFETIME);
    let sub = serde_json::Value::String(tenant.to_owned());
    format!(r#"{{"exp":"{exp}","iat":"{iat}","nbf":"{iat}","sub":{sub}}}"#)
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

impl VerifyingKey {
    /// Reads an SPKI PEM Ed25519 public key (`PUBLIC KEY`).
    ///
    /// # Errors
    /// [`KeyError`] naming what is wrong with the key.
    pub fn from_pem(pem: &str) -> Result<Self, KeyError> {
        let (_, der) = first_pem_block(pem).ok_or(KeyError::NoPublicPem)?;
        let der = der.map_err(KeyError::Pkix)?;
        let spki = SubjectPublicKeyInfoRef::from_der(&der).map_err(|e| KeyError::Pkix(e.to_string()))?;
        if spki.algorithm.oid != ED25519_OID {
            return Err(KeyError::NotEd25519Public(spki.algorithm.oid.to_string()));
        }
        let bytes = spki.subject_public_key.raw_bytes();
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|_| KeyError::Pkix(format!("ed25519 key has {} bytes, want 32", bytes.len())))?;
        Ok(Self(key))
    }

    /// The key as SPKI PEM (`PUBLIC KEY`).
    #[must_use]
    pub fn to_pem(&self) -> String {
        let mut der = vec![
            0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
        ];
        der.extend_from_slice(&self.0);
        pem_encode("PUBLIC KEY", &der)
    }

    /// Verifies a `v2.public` or `v4.public` token at time `now`: the
    /// signature, and `iat <= now`, `nbf <= now`, `exp >= now`.
    ///
    /// # Errors
    /// [`TokenError`] naming why the token is not accepted.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, TokenError> {
        let payload = if token.starts_with("v2.public.") {
            let pk = AsymmetricPublicKey::<V2>::from(&self.0).map_err(|_| TokenError::BadSignature)?;
            let t = UntrustedToken::<Public, V2>::try_from(token).map_err(|_| TokenError::Malformed)?;
            pasetors::version2::PublicToken::verify(&pk, &t, None).map_err(|_| TokenError::BadSignature)?
        } else if token.starts_with("v4.public.") {
            let pk = AsymmetricPublicKey::<V4>::from(&self.0).map_err(|_| TokenError::BadSignature)?;
            let t = UntrustedToken::<Public, V4>::try_from(token).map_err(|_| TokenError::Malformed)?;
            pasetors::version4::PublicToken::verify(&pk, &t, None, None)
                .map_err(|_| TokenError::BadSignature)?
        } else {
            return Err(TokenError::Malformed);
        };
        let claims: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(payload.payload()).map_err(|e| TokenError::BadClaims(e.to_string()))?;
        let text = |name: &'static str| -> Result<&str, TokenError> {
            match claims.get(name) {
                None => Err(TokenError::MissingClaim(name)),
                Some(serde_json::Value::String(s)) => Ok(s),
                Some(other) => Err(TokenError::BadClaims(format!("{name} is {other}"))),
            }
        };
        let time = |name: &'static str| -> Result<SystemTime, TokenError> {
            let v = text(name)?;
            let ts: jiff::Timestamp = v.parse().map_err(|_| TokenError::BadTime {
                claim: name,
                value: v.to_owned(),
            })?;
            Ok(SystemTime::from(ts))
        };
        let c = Claims {
            sub: text("sub")?.to_owned(),
            iat: time("iat")?,
            nbf: time("nbf")?,
            exp: time("exp")?,
        };
        if c.iat > now {
            return Err(TokenError::NotYetValid("iat"));
        }
        if c.nbf > now {
            return Err(TokenError::NotYetValid("nbf"));
        }
        if c.exp < now {
            return Err(TokenError::Expired);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_and_verify_both_versions() {
        let key = SigningKey::generate();
        let pk = VerifyingKey::from_pem(&key.verifying_key().to_pem()).unwrap();
        let now = SystemTime::now();
        for (v, prefix) in [(Version::V2, "v2.public."), (Version::V4, "v4.public.")] {
            let t = key.sign(v, "tenant-1", now).unwrap();
            assert!(t.starts_with(prefix));
            let c = pk.verify(&t, now).unwrap();
            assert_eq!(c.sub, "tenant-1");
            assert_eq!(c.exp.duration_since(c.iat).unwrap(), TOKEN_LIFETIME);
            assert_eq!(
                pk.verify(&t, now + TOKEN_LIFETIME + Duration::from_secs(1)),
                Err(TokenError::Expired)
            );
            assert_eq!(
                pk.verify(&t, now - Duration::from_secs(5)),
                Err(TokenError::NotYetValid("iat"))
            );
            let other = SigningKey::generate().verifying_key();
            assert_eq!(other.verify(&t, now), Err(TokenError::BadSignature));
        }
    }

    #[test]
    fn claims_are_sorted_second_precision_json() {
        let now = UNIX_EPOCH + Duration::from_millis(1_705_314_600_750);
        assert_eq!(
            claims_json("t\"1", now),
            r#"{"exp":"2024-01-22T10:30:00Z","iat":"2024-01-15T10:30:00Z","nbf":"2024-01-15T10:30:00Z","sub":"t\"1"}"#
        );
    }

    #[test]
    fn pem_round_trip_and_errors() {
        let key = SigningKey::generate();
        let again = SigningKey::from_pem(&key.to_pem()).unwrap();
        assert_eq!(again.verifying_key(), key.verifying_key());
        assert_eq!(
            SigningKey::from_pem("nothing").unwrap_err(),
            KeyError::NoPrivatePem
        );
        assert_eq!(
            SigningKey::from_pem(&key.verifying_key().to_pem()).unwrap_err(),
            KeyError::PrivatePemType("PUBLIC KEY".into())
        );
        let garbage = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert!(matches!(SigningKey::from_pem(garbage), Err(KeyError::Pkcs8(_))));
        assert_eq!(VerifyingKey::from_pem("x").unwrap_err(), KeyError::NoPublicPem);
    }
}
