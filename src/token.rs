//! PASETO assignment tokens: signed by the controller, verified by pods.
//!
//! A token is `v2.public` (Ed25519, the default, compatible with existing
//! pods) or `v4.public`, with no footer (pods that expect none keep
//! verifying it). Its message is a JSON object, keys sorted, times in
//! RFC 3339 with second precision.
//!
//! A controller issues **bound** tokens, one per assignment:
//! `{"aud":"skipper/assign","exp":..,"iat":..,"jti":<random>,"kid":<key id>,
//! "nbf":..,"pod":<pod name>,"pod_uid":<pod UID>,"sub":<tenant>}` with `exp` =
//! `iat` + [`BOUND_TOKEN_LIFETIME`]. `sub`, `iat`, `nbf` and `exp` are what
//! a pod that only checks the subject reads, as before; the others bind the
//! token to one pod and one assignment ([`Claims::check_binding`]), so a
//! tenant that reads its own token cannot replay it to a pool pod. The
//! unbound form `{"exp","iat","nbf","sub"}` with a 7-day lifetime is what
//! Go controllers issue ([`SigningKey::sign`]).
//!
//! The key id `kid` is the PASERK id of the public key for the token's
//! version (`k2.pid.…` for v2, `k4.pid.…` for v4): a pod trusting several
//! keys ([`TrustedKeys`]) verifies with the one it names, and tries each for
//! a token without one.
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

/// How long an unbound token ([`SigningKey::sign`], the Go controllers'
/// form) is valid after it is issued.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long a bound token is valid after it is issued: it is only
/// presented once, in the assign request (at most
/// `--function-assign-timeout`, 30 s by default), and the margin covers
/// clock skew between nodes. A pod keeps the token it accepted and does not
/// check its expiry again (see [`TrustedKeys::verify_signed`]).
pub const BOUND_TOKEN_LIFETIME: Duration = Duration::from_secs(10 * 60);

/// The audience (`aud`) of a bound assignment token.
pub const AUDIENCE: &str = "skipper/assign";

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
    #[error("token key id {0:?} is not one of the trusted keys")]
    UnknownKey(String),
    #[error(
        "token is not bound to a pod (no aud, pod or jti claim, as Go controllers issue); such tokens are refused unless the pod runs with --accept-unbound-tokens"
    )]
    Unbound,
    #[error("token audience is {0:?}, not \"skipper/assign\"")]
    Audience(String),
    #[error("token is for pod {token:?}, not this pod {pod:?}")]
    OtherPod { token: String, pod: String },
    #[error("token is for pod UID {token:?}, not this pod's UID {pod:?}")]
    OtherPodUid { token: String, pod: String },
    #[error(
        "this pod does not know its name (--pod-name / SKIPPER_POD_NAME), so it cannot check a bound token"
    )]
    PodNameUnknown,
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
    /// Audience: [`AUDIENCE`] in a bound token.
    pub aud: Option<String>,
    /// Unique id of the assignment.
    pub jti: Option<String>,
    /// PASERK id of the signing key.
    pub kid: Option<String>,
    /// Name of the pod the token is for.
    pub pod: Option<String>,
    /// UID of the pod the token is for.
    pub pod_uid: Option<String>,
}

/// The pod a bound token is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodRef<'a> {
    pub name: &'a str,
    pub uid: &'a str,
}

impl Claims {
    /// Whether the token is bound to a pod (carries `aud`, `pod` or `jti`).
    #[must_use]
    pub fn is_bound(&self) -> bool {
        self.aud.is_some() || self.pod.is_some() || self.jti.is_some()
    }

    /// What a pod checks after the signature, times and `sub`: the token is
    /// for [`AUDIENCE`], names this pod (`pod_name`, and `pod_uid` when the
    /// pod knows it) and carries a `jti`. An unbound token passes only with
    /// `accept_unbound`.
    ///
    /// # Errors
    /// [`TokenError`] naming the claim that does not bind the token to
    /// this pod.
    pub fn check_binding(
        &self,
        pod_name: Option<&str>,
        pod_uid: Option<&str>,
        accept_unbound: bool,
    ) -> Result<(), TokenError> {
        if !self.is_bound() {
            return if accept_unbound {
                Ok(())
            } else {
                Err(TokenError::Unbound)
            };
        }
        let aud = self.aud.as_deref().ok_or(TokenError::MissingClaim("aud"))?;
        if aud != AUDIENCE {
            return Err(TokenError::Audience(aud.to_owned()));
        }
        let pod = self.pod.as_deref().ok_or(TokenError::MissingClaim("pod"))?;
        let uid = self
            .pod_uid
            .as_deref()
            .ok_or(TokenError::MissingClaim("pod_uid"))?;
        if self.jti.as_deref().is_none_or(str::is_empty) {
            return Err(TokenError::MissingClaim("jti"));
        }
        let mine = pod_name.ok_or(TokenError::PodNameUnknown)?;
        if pod != mine {
            return Err(TokenError::OtherPod {
                token: pod.to_owned(),
                pod: mine.to_owned(),
            });
        }
        if let Some(mine) = pod_uid
            && uid != mine
        {
            return Err(TokenError::OtherPodUid {
                token: uid.to_owned(),
                pod: mine.to_owned(),
            });
        }
        Ok(())
    }
}

/// A PEM block: its label and its DER bytes (or why they do not decode).
type PemBlock = (String, Result<Vec<u8>, String>);

/// The first PEM block of `text` and the text after it, or `None` when
/// there is none.
fn next_pem_block(text: &str) -> Option<(PemBlock, &str)> {
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
    let after = &body[end + "-----END ".len()..];
    let after = after.find("-----").map_or("", |i| &after[i + 5..]);
    Some(((label, der), after))
}

/// The first PEM block of `text`, or `None` when there is none.
fn first_pem_block(text: &str) -> Option<PemBlock> {
    next_pem_block(text).map(|(block, _)| block)
}

/// Every PEM block of `text`, in order.
fn pem_blocks(mut text: &str) -> Vec<PemBlock> {
    let mut blocks = Vec::new();
    while let Some((block, rest)) = next_pem_block(text) {
        blocks.push(block);
        text = rest;
    }
    blocks
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

    /// The PASERK id (`kid`) of this key for tokens of `version`.
    #[must_use]
    pub fn key_id(&self, version: Version) -> String {
        self.verifying_key().key_id(version)
    }

    /// Signs an unbound token for `tenant`, issued at `now`, valid for
    /// [`TOKEN_LIFETIME`]: the form Go controllers issue (and the one Go
    /// pods were written against).
    ///
    /// # Errors
    /// [`TokenError::Sign`] if the PASETO library rejects the key.
    pub fn sign(&self, version: Version, tenant: &str, now: SystemTime) -> Result<String, TokenError> {
        self.sign_message(version, &claims_json(tenant, now))
    }

    /// Signs a token for one assignment: `tenant` on `pod`, issued at `now`,
    /// valid for `lifetime`, with a fresh random `jti`. Returns the token and
    /// its `jti`.
    ///
    /// # Errors
    /// [`TokenError::Sign`] if the PASETO library rejects the key.
    pub fn sign_bound(
        &self,
        version: Version,
        tenant: &str,
        pod: PodRef<'_>,
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<(String, String), TokenError> {
        let jti = format!("{:032x}", rand::random::<u128>());
        let message = bound_claims_json(tenant, pod, &jti, &self.key_id(version), lifetime, now);
        Ok((self.sign_message(version, &message)?, jti))
    }

    fn sign_message(&self, version: Version, message: &str) -> Result<String, TokenError> {
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

/// `(iat, exp)` of a token issued at `now`: second-precision RFC 3339 UTC.
fn times(now: SystemTime, lifetime: Duration) -> (String, String) {
    let secs = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let now = UNIX_EPOCH + Duration::from_secs(secs);
    let ts = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
    (ts(now), ts(now + lifetime))
}

/// A JSON string.
fn js(s: &str) -> serde_json::Value {
    serde_json::Value::String(s.to_owned())
}

/// The unbound claims message: keys sorted.
fn claims_json(tenant: &str, now: SystemTime) -> String {
    let (iat, exp) = times(now, TOKEN_LIFETIME);
    let sub = js(tenant);
    format!(r#"{{"exp":"{exp}","iat":"{iat}","nbf":"{iat}","sub":{sub}}}"#)
}

/// The bound claims message: the unbound claims plus the binding, keys
/// sorted.
fn bound_claims_json(
    tenant: &str,
    pod: PodRef<'_>,
    jti: &str,
    kid: &str,
    lifetime: Duration,
    now: SystemTime,
) -> String {
    let (iat, exp) = times(now, lifetime);
    let (aud, jti, kid, name, uid, sub) = (
        js(AUDIENCE),
        js(jti),
        js(kid),
        js(pod.name),
        js(pod.uid),
        js(tenant),
    );
    format!(
        r#"{{"aud":{aud},"exp":"{exp}","iat":"{iat}","jti":{jti},"kid":{kid},"nbf":"{iat}","pod":{name},"pod_uid":{uid},"sub":{sub}}}"#
    )
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
        Self::from_der(der)
    }

    fn from_der(der: Result<Vec<u8>, String>) -> Result<Self, KeyError> {
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

    /// The PASERK id (`kid`) of this key for tokens of `version`.
    #[must_use]
    pub fn key_id(&self, version: Version) -> String {
        use pasetors::paserk::FormatAsPaserk as _;
        let id = match version {
            Version::V2 => AsymmetricPublicKey::<V2>::from(&self.0).map(|k| pasetors::paserk::Id::from(&k)),
            Version::V4 => AsymmetricPublicKey::<V4>::from(&self.0).map(|k| pasetors::paserk::Id::from(&k)),
        };
        let mut out = String::new();
        if let Ok(id) = id {
            let _ = id.fmt(&mut out);
        }
        out
    }

    /// Verifies a `v2.public` or `v4.public` token at time `now`: the
    /// signature, and `iat <= now`, `nbf <= now`, `exp >= now`.
    ///
    /// # Errors
    /// [`TokenError`] naming why the token is not accepted.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, TokenError> {
        let c = self.verify_signed(token)?;
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

    /// Verifies the signature and the claims' form, not their times: for a
    /// token the pod accepted earlier (and persisted), whose short lifetime
    /// may be over.
    ///
    /// # Errors
    /// [`TokenError`] naming why the token is not accepted.
    pub fn verify_signed(&self, token: &str) -> Result<Claims, TokenError> {
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
        let optional = |name: &'static str| -> Result<Option<String>, TokenError> {
            match text(name) {
                Ok(s) => Ok(Some(s.to_owned())),
                Err(TokenError::MissingClaim(_)) => Ok(None),
                Err(e) => Err(e),
            }
        };
        Ok(Claims {
            sub: text("sub")?.to_owned(),
            iat: time("iat")?,
            nbf: time("nbf")?,
            exp: time("exp")?,
            aud: optional("aud")?,
            jti: optional("jti")?,
            kid: optional("kid")?,
            pod: optional("pod")?,
            pod_uid: optional("pod_uid")?,
        })
    }
}

/// The `kid` claim of a token, read before its signature is checked (only to
/// pick the key that checks it); `None` when the token names none or is not
/// readable.
fn unverified_kid(token: &str) -> Option<String> {
    let body = token
        .strip_prefix("v2.public.")
        .or_else(|| token.strip_prefix("v4.public."))?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(body)
        .ok()?;
    let message = bytes.get(..bytes.len().checked_sub(64)?)?;
    let claims: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(message).ok()?;
    match claims.get("kid") {
        Some(serde_json::Value::String(k)) => Some(k.clone()),
        _ => None,
    }
}

/// The public keys a pod trusts: every `PUBLIC KEY` block of its key file,
/// so that a new key can be trusted before controllers sign with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedKeys {
    keys: Vec<VerifyingKey>,
}

impl TrustedKeys {
    /// Reads one or more SPKI PEM Ed25519 public keys; text outside the PEM
    /// blocks is ignored.
    ///
    /// # Errors
    /// [`KeyError`] for text with no PEM block or a block that is not an
    /// Ed25519 public key.
    pub fn from_pem(pem: &str) -> Result<Self, KeyError> {
        let keys = pem_blocks(pem)
            .into_iter()
            .map(|(_, der)| VerifyingKey::from_der(der))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(KeyError::NoPublicPem);
        }
        Ok(Self { keys })
    }

    /// The keys, in the order of the file.
    #[must_use]
    pub fn keys(&self) -> &[VerifyingKey] {
        &self.keys
    }

    fn select<T>(
        &self,
        token: &str,
        verify: impl Fn(&VerifyingKey) -> Result<T, TokenError>,
    ) -> Result<T, TokenError> {
        if let Some(kid) = unverified_kid(token) {
            let version = if token.starts_with("v4.") {
                Version::V4
            } else {
                Version::V2
            };
            let key = self
                .keys
                .iter()
                .find(|k| k.key_id(version) == kid)
                .ok_or(TokenError::UnknownKey(kid))?;
            return verify(key);
        }
        let mut last = TokenError::BadSignature;
        for key in &self.keys {
            match verify(key) {
                Err(e @ (TokenError::BadSignature | TokenError::Malformed)) => last = e,
                other => return other,
            }
        }
        Err(last)
    }

    /// [`VerifyingKey::verify`] with the key the token's `kid` names, or
    /// with each key in turn for a token without one.
    ///
    /// # Errors
    /// [`TokenError::UnknownKey`] for a `kid` of no trusted key, else as
    /// [`VerifyingKey::verify`].
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, TokenError> {
        self.select(token, |k| k.verify(token, now))
    }

    /// [`VerifyingKey::verify_signed`] with the key the token names (or each).
    ///
    /// # Errors
    /// As [`TrustedKeys::verify`], without the time checks.
    pub fn verify_signed(&self, token: &str) -> Result<Claims, TokenError> {
        self.select(token, |k| k.verify_signed(token))
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

    const POD: PodRef<'static> = PodRef {
        name: "pool-abc",
        uid: "0f1e2d3c-0000-4000-8000-000000000001",
    };

    #[test]
    fn bound_tokens_keep_the_unbound_claims_and_name_their_pod() {
        let key = SigningKey::generate();
        let trusted = TrustedKeys::from_pem(&key.verifying_key().to_pem()).unwrap();
        let now = SystemTime::now();
        for version in [Version::V2, Version::V4] {
            let (t, jti) = key
                .sign_bound(version, "tenant-1", POD, BOUND_TOKEN_LIFETIME, now)
                .unwrap();
            let c = trusted.verify(&t, now).unwrap();
            assert_eq!(c.sub, "tenant-1");
            assert_eq!(c.aud.as_deref(), Some(AUDIENCE));
            assert_eq!(c.pod.as_deref(), Some(POD.name));
            assert_eq!(c.pod_uid.as_deref(), Some(POD.uid));
            assert_eq!(c.jti.as_deref(), Some(jti.as_str()));
            assert_eq!(c.kid, Some(key.key_id(version)));
            assert_eq!(c.exp.duration_since(c.iat).unwrap(), BOUND_TOKEN_LIFETIME);
            assert_eq!(c.iat, c.nbf);
            assert!(c.is_bound());
            // A pod that reads only `sub` and the times (a single key, as
            // Go pods do) accepts it as before.
            let plain = key.verifying_key().verify(&t, now).unwrap();
            assert_eq!(plain.sub, "tenant-1");
            assert_eq!(
                trusted.verify(&t, now + BOUND_TOKEN_LIFETIME + Duration::from_secs(1)),
                Err(TokenError::Expired)
            );
            // A token accepted earlier still names its tenant after expiry.
            let later = trusted.verify_signed(&t).unwrap();
            assert_eq!(later.sub, "tenant-1");
        }
        let (a, ja) = key
            .sign_bound(Version::V2, "t", POD, BOUND_TOKEN_LIFETIME, now)
            .unwrap();
        let (b, jb) = key
            .sign_bound(Version::V2, "t", POD, BOUND_TOKEN_LIFETIME, now)
            .unwrap();
        assert_ne!(ja, jb, "every assignment has its own jti");
        assert_ne!(a, b);
        assert_eq!(ja.len(), 32);
    }

    #[test]
    fn bound_claims_are_sorted_second_precision_json() {
        let now = UNIX_EPOCH + Duration::from_millis(1_705_314_600_750);
        let pod = PodRef {
            name: "p\"1",
            uid: "u-1",
        };
        assert_eq!(
            bound_claims_json("t1", pod, "j1", "k2.pid.x", BOUND_TOKEN_LIFETIME, now),
            r#"{"aud":"skipper/assign","exp":"2024-01-15T10:40:00Z","iat":"2024-01-15T10:30:00Z","jti":"j1","kid":"k2.pid.x","nbf":"2024-01-15T10:30:00Z","pod":"p\"1","pod_uid":"u-1","sub":"t1"}"#
        );
    }

    fn bound() -> Claims {
        let now = UNIX_EPOCH;
        Claims {
            sub: "t".into(),
            iat: now,
            nbf: now,
            exp: now,
            aud: Some(AUDIENCE.into()),
            jti: Some("j".into()),
            kid: None,
            pod: Some("pod-a".into()),
            pod_uid: Some("uid-a".into()),
        }
    }

    #[test]
    fn binding_rules() {
        let unbound = Claims {
            aud: None,
            jti: None,
            pod: None,
            pod_uid: None,
            ..bound()
        };
        let with = |f: fn(&mut Claims)| {
            let mut c = bound();
            f(&mut c);
            c
        };
        let other_pod = TokenError::OtherPod {
            token: "pod-a".into(),
            pod: "pod-b".into(),
        };
        let other_uid = TokenError::OtherPodUid {
            token: "uid-a".into(),
            pod: "uid-b".into(),
        };
        // (case, claims, pod name, pod UID, accept unbound, outcome)
        type Case = (
            &'static str,
            Claims,
            Option<&'static str>,
            Option<&'static str>,
            bool,
            Result<(), TokenError>,
        );
        let cases: Vec<Case> = vec![
            (
                "bound to this pod",
                bound(),
                Some("pod-a"),
                Some("uid-a"),
                false,
                Ok(()),
            ),
            (
                "uid unknown to the pod",
                bound(),
                Some("pod-a"),
                None,
                false,
                Ok(()),
            ),
            (
                "another pod",
                bound(),
                Some("pod-b"),
                Some("uid-a"),
                false,
                Err(other_pod),
            ),
            (
                "same name, another uid",
                bound(),
                Some("pod-a"),
                Some("uid-b"),
                false,
                Err(other_uid),
            ),
            (
                "pod name unknown",
                bound(),
                None,
                None,
                true,
                Err(TokenError::PodNameUnknown),
            ),
            (
                "unbound refused",
                unbound.clone(),
                Some("pod-a"),
                None,
                false,
                Err(TokenError::Unbound),
            ),
            ("unbound admitted", unbound, Some("pod-a"), None, true, Ok(())),
            (
                "another audience",
                with(|c| c.aud = Some("other".into())),
                Some("pod-a"),
                None,
                false,
                Err(TokenError::Audience("other".into())),
            ),
            (
                "no audience",
                with(|c| c.aud = None),
                Some("pod-a"),
                None,
                true,
                Err(TokenError::MissingClaim("aud")),
            ),
            (
                "no pod",
                with(|c| c.pod = None),
                Some("pod-a"),
                None,
                true,
                Err(TokenError::MissingClaim("pod")),
            ),
            (
                "no uid",
                with(|c| c.pod_uid = None),
                Some("pod-a"),
                None,
                false,
                Err(TokenError::MissingClaim("pod_uid")),
            ),
            (
                "empty jti",
                with(|c| c.jti = Some(String::new())),
                Some("pod-a"),
                None,
                false,
                Err(TokenError::MissingClaim("jti")),
            ),
        ];
        for (name, claims, pod, uid, accept_unbound, want) in cases {
            assert_eq!(claims.check_binding(pod, uid, accept_unbound), want, "{name}");
        }
        assert!(
            TokenError::Unbound
                .to_string()
                .contains("--accept-unbound-tokens"),
            "the refusal names the way out"
        );
    }

    #[test]
    fn trusted_keys_pick_the_key_the_token_names_and_try_each_otherwise() {
        let (old, new, stranger) = (
            SigningKey::generate(),
            SigningKey::generate(),
            SigningKey::generate(),
        );
        let pem = format!(
            "# current\n{}\n# next\n{}",
            old.verifying_key().to_pem(),
            new.verifying_key().to_pem()
        );
        let trusted = TrustedKeys::from_pem(&pem).unwrap();
        assert_eq!(trusted.keys(), &[old.verifying_key(), new.verifying_key()]);
        let now = SystemTime::now();
        for key in [&old, &new] {
            for v in [Version::V2, Version::V4] {
                let (bound, _) = key.sign_bound(v, "t", POD, BOUND_TOKEN_LIFETIME, now).unwrap();
                assert_eq!(trusted.verify(&bound, now).unwrap().kid, Some(key.key_id(v)));
                let unbound = key.sign(v, "t", now).unwrap();
                assert_eq!(
                    trusted.verify(&unbound, now).unwrap().sub,
                    "t",
                    "no kid: each key is tried"
                );
            }
        }
        let (foreign, _) = stranger
            .sign_bound(Version::V2, "t", POD, BOUND_TOKEN_LIFETIME, now)
            .unwrap();
        assert_eq!(
            trusted.verify(&foreign, now),
            Err(TokenError::UnknownKey(stranger.key_id(Version::V2)))
        );
        let unbound = stranger.sign(Version::V2, "t", now).unwrap();
        assert_eq!(trusted.verify(&unbound, now), Err(TokenError::BadSignature));
        assert_eq!(trusted.verify("v2.public.AAAA", now), Err(TokenError::Malformed));
        // Expiry is reported as such, not as a signature failure of the other key.
        let late = now + TOKEN_LIFETIME + Duration::from_secs(1);
        assert_eq!(
            trusted.verify(&new.sign(Version::V2, "t", now).unwrap(), late),
            Err(TokenError::Expired)
        );

        // Key ids are PASERK ids, distinct per key and version.
        let id = old.key_id(Version::V2);
        assert!(
            id.starts_with("k2.pid.") && id.len() == "k2.pid.".len() + 44,
            "{id}"
        );
        assert!(old.key_id(Version::V4).starts_with("k4.pid."));
        assert_ne!(id, new.key_id(Version::V2));
        assert_eq!(id, old.verifying_key().key_id(Version::V2));

        assert_eq!(TrustedKeys::from_pem("none"), Err(KeyError::NoPublicPem));
        let bad = format!(
            "{}-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
            old.verifying_key().to_pem()
        );
        assert!(
            matches!(TrustedKeys::from_pem(&bad), Err(KeyError::Pkix(_))),
            "a bad block is an error, not skipped"
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
