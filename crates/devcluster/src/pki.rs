//! The cluster's public-key infrastructure, generated in process: a
//! certificate authority, serving certificates (IP and DNS subject
//! alternative names), client certificates whose subject names a Kubernetes
//! user (`CN`) and group (`O`), and the ServiceAccount token signing key
//! (ES256 JWTs, `kid` computed as kube-apiserver computes it).
//!
//! The simulator uses it for HTTPS and authentication; the real control
//! plane gets the same material as files ([`ClusterPki::write_dir`]), so
//! kube-apiserver, kube-controller-manager, kube-scheduler and our kubelet
//! agent trust one CA in both backends.
//!
//! Every key is ECDSA P-256: ring (already the TLS provider of the
//! Kubernetes client) generates it in microseconds, kube-apiserver accepts
//! it for TLS, client certificates and `--service-account-signing-key-file`
//! (tokens are signed ES256), and Go's and rustls's TLS stacks both speak it.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, PublicKeyData as _, SanType,
};
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};
use serde_json::Value;

/// Why key material could not be made, read or written.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("generating a certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("a subject alternative name {0:?} is neither an IP address nor a DNS name")]
    SubjectAltName(String),
    #[error("a client certificate carries at most one group (O); asked for {0:?}")]
    TooManyGroups(Vec<String>),
    #[error("loading the ECDSA signing key: {0}")]
    SigningKey(String),
    #[error("signing: {0}")]
    Sign(String),
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("reading a certificate: {0}")]
    ParseCertificate(String),
}

/// How long the CA is valid.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long issued certificates are valid.
const LEAF_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Certificates start this long before they are made, for clock skew between processes.
const BACKDATE: Duration = Duration::from_secs(3600);

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct CertKey {
    /// The certificate (`CERTIFICATE`).
    pub cert_pem: String,
    /// The certificate, DER.
    pub cert_der: Vec<u8>,
    /// The private key (`PRIVATE KEY`, PKCS#8).
    pub key_pem: String,
    /// The private key, PKCS#8 DER.
    pub key_der: Vec<u8>,
}

impl std::fmt::Debug for CertKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertKey")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"[elided]")
            .finish_non_exhaustive()
    }
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + lifetime;
}

fn random_serial(params: &mut CertificateParams) {
    let mut serial: [u8; 16] = rand::random();
    serial[0] &= 0x7f; // positive
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
}

/// A certificate authority that issues serving and client certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    cert_der: Vec<u8>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// A fresh self-signed CA named `common_name`.
    ///
    /// # Errors
    /// [`PkiError::Certificate`] when the key or certificate cannot be made.
    pub fn generate(common_name: &str) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyCertSign,
        ];
        validity(&mut params, CA_VALIDITY);
        random_serial(&mut params);
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM (what `ca.crt` and `--client-ca-file` hold).
    #[must_use]
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate, DER.
    #[must_use]
    pub fn cert_der(&self) -> &[u8] {
        &self.cert_der
    }

    /// The CA private key, PEM (kube-controller-manager's `--cluster-signing-key-file`).
    #[must_use]
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    fn issue(&self, mut params: CertificateParams) -> Result<CertKey, PkiError> {
        let key = KeyPair::generate()?;
        validity(&mut params, LEAF_VALIDITY);
        random_serial(&mut params);
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        })
    }

    /// A TLS server certificate for `names`: each is an IP address (an IP
    /// SAN) or a DNS name (a DNS SAN).
    ///
    /// # Errors
    /// [`PkiError::SubjectAltName`] for a name that is neither.
    pub fn issue_serving(&self, common_name: &str, names: &[String]) -> Result<CertKey, PkiError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        for n in names {
            params.subject_alt_names.push(match n.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => {
                    let valid = matches!(
                        rustls::pki_types::ServerName::try_from(n.as_str()),
                        Ok(rustls::pki_types::ServerName::DnsName(_))
                    );
                    let dns = n.clone().try_into().ok().filter(|_| valid);
                    SanType::DnsName(dns.ok_or_else(|| PkiError::SubjectAltName(n.clone()))?)
                }
            });
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params)
    }

    /// A TLS client certificate for Kubernetes user `user` (`CN`) in `groups`
    /// (`O`; at most one, a limit of the certificate generator).
    ///
    /// # Errors
    /// [`PkiError::TooManyGroups`] for more than one group.
    pub fn issue_client(&self, user: &str, groups: &[&str]) -> Result<CertKey, PkiError> {
        if groups.len() > 1 {
            return Err(PkiError::TooManyGroups(
                groups.iter().map(|g| (*g).to_owned()).collect(),
            ));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        if let Some(g) = groups.first() {
            params.distinguished_name.push(DnType::OrganizationName, *g);
        }
        params.distinguished_name.push(DnType::CommonName, user);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params)
    }
}

/// The user (`CN`) and groups (every `O`) a client certificate names, as
/// kube-apiserver's x509 authenticator reads them.
///
/// # Errors
/// [`PkiError::ParseCertificate`] when `der` is not a certificate.
pub fn subject_identity(der: &[u8]) -> Result<(String, Vec<String>), PkiError> {
    use x509_cert::der::Decode as _;
    use x509_cert::der::asn1::{PrintableStringRef, Utf8StringRef};
    const CN: x509_cert::der::oid::ObjectIdentifier =
        x509_cert::der::oid::ObjectIdentifier::new_unwrap("2.5.4.3");
    const O: x509_cert::der::oid::ObjectIdentifier =
        x509_cert::der::oid::ObjectIdentifier::new_unwrap("2.5.4.10");
    let cert =
        x509_cert::Certificate::from_der(der).map_err(|e| PkiError::ParseCertificate(e.to_string()))?;
    let mut user = String::new();
    let mut groups = Vec::new();
    for rdn in cert.tbs_certificate.subject.0.iter() {
        for atv in rdn.0.iter() {
            let text = Utf8StringRef::try_from(&atv.value)
                .map(|s| s.as_str().to_owned())
                .or_else(|_| PrintableStringRef::try_from(&atv.value).map(|s| s.as_str().to_owned()));
            let Ok(text) = text else { continue };
            if atv.oid == CN {
                user = text;
            } else if atv.oid == O {
                groups.push(text);
            }
        }
    }
    Ok((user, groups))
}

/// The ServiceAccount token key: signs and verifies ES256 JWTs.
pub struct ServiceAccountKey {
    rcgen_key: KeyPair,
    signer: EcdsaKeyPair,
    kid: String,
}

impl std::fmt::Debug for ServiceAccountKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceAccountKey")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

/// Why a JWT did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    #[error("not a JWT (three dot-separated base64url parts)")]
    Malformed,
    #[error("unsupported JWT header: {0}")]
    Header(String),
    #[error("the JWT was signed by another key")]
    Signature,
}

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

impl ServiceAccountKey {
    /// A fresh P-256 key.
    ///
    /// # Errors
    /// [`PkiError`] when key generation fails.
    pub fn generate() -> Result<Self, PkiError> {
        let rcgen_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let signer = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            rcgen_key.serialized_der(),
            &ring::rand::SystemRandom::new(),
        )
        .map_err(|e| PkiError::SigningKey(e.to_string()))?;
        // kube-apiserver's keyIDFromPublicKey: base64url(sha256(PKIX DER)).
        let spki = rcgen_key.subject_public_key_info();
        let kid = b64(ring::digest::digest(&ring::digest::SHA256, &spki).as_ref());
        Ok(Self {
            rcgen_key,
            signer,
            kid,
        })
    }

    /// The private key, PEM (`--service-account-signing-key-file`,
    /// `--service-account-private-key-file`).
    #[must_use]
    pub fn private_key_pem(&self) -> String {
        self.rcgen_key.serialize_pem()
    }

    /// The public key, PEM (`--service-account-key-file`).
    #[must_use]
    pub fn public_key_pem(&self) -> String {
        self.rcgen_key.public_key_pem()
    }

    /// The JWT `kid` of this key.
    #[must_use]
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// A compact JWS (`{"alg":"ES256","kid":...}`) over `claims`.
    ///
    /// # Errors
    /// [`PkiError::Sign`] when signing fails.
    pub fn sign_jwt(&self, claims: &Value) -> Result<String, PkiError> {
        let header = serde_json::json!({"alg": "ES256", "kid": self.kid});
        let input = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let sig = self
            .signer
            .sign(&ring::rand::SystemRandom::new(), input.as_bytes())
            .map_err(|e| PkiError::Sign(e.to_string()))?;
        Ok(format!("{input}.{}", b64(sig.as_ref())))
    }

    /// The claims of a JWT this key signed. Only the signature and header
    /// are checked here; expiry, audience and binding are the caller's.
    ///
    /// # Errors
    /// [`JwtError`] for a malformed token, another algorithm or key, or a bad signature.
    pub fn verify_jwt(&self, token: &str) -> Result<Value, JwtError> {
        let mut parts = token.split('.');
        let (Some(h), Some(c), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(JwtError::Malformed);
        };
        let decode = |p: &str| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(p)
                .map_err(|_| JwtError::Malformed)
        };
        let header: Value = serde_json::from_slice(&decode(h)?).map_err(|_| JwtError::Malformed)?;
        if header.get("alg").and_then(Value::as_str) != Some("ES256") {
            return Err(JwtError::Header(format!("alg {}", header["alg"])));
        }
        if header
            .get("kid")
            .and_then(Value::as_str)
            .is_some_and(|k| k != self.kid)
        {
            return Err(JwtError::Signature);
        }
        let public = signature::UnparsedPublicKey::new(
            &signature::ECDSA_P256_SHA256_FIXED,
            self.signer.public_key().as_ref(),
        );
        public
            .verify(format!("{h}.{c}").as_bytes(), &decode(s)?)
            .map_err(|_| JwtError::Signature)?;
        serde_json::from_slice(&decode(c)?).map_err(|_| JwtError::Malformed)
    }
}

/// The user and group of the cluster administrator's client certificate
/// (as kubeadm names it; `system:masters` is bound to `cluster-admin`).
pub const ADMIN_USER: &str = "kubernetes-admin";
/// The group that RBAC's bootstrap policy makes cluster-admin.
pub const MASTERS_GROUP: &str = "system:masters";

/// The DNS names and addresses a cluster's API server answers to, besides
/// the ones given: loopback and the in-cluster `kubernetes` Service names.
#[must_use]
pub fn default_serving_names() -> Vec<String> {
    [
        "127.0.0.1",
        "::1",
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Everything one cluster needs: CA, API server serving certificate,
/// ServiceAccount key and the administrator's client certificate.
pub struct ClusterPki {
    /// Issues every certificate of the cluster.
    pub ca: Ca,
    /// The API server's serving certificate.
    pub serving: CertKey,
    /// Signs ServiceAccount tokens.
    pub service_account: std::sync::Arc<ServiceAccountKey>,
    /// `kubernetes-admin` in `system:masters`.
    pub admin: CertKey,
}

impl std::fmt::Debug for ClusterPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPki")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

/// Where [`ClusterPki::write_dir`] put each file.
#[derive(Debug, Clone)]
pub struct PkiFiles {
    /// `ca.crt`.
    pub ca_cert: PathBuf,
    /// `ca.key`.
    pub ca_key: PathBuf,
    /// `apiserver.crt`.
    pub serving_cert: PathBuf,
    /// `apiserver.key`.
    pub serving_key: PathBuf,
    /// `sa.key` (private, PKCS#8).
    pub service_account_key: PathBuf,
    /// `sa.pub` (public, PKIX).
    pub service_account_pub: PathBuf,
    /// `admin.crt`.
    pub admin_cert: PathBuf,
    /// `admin.key`.
    pub admin_key: PathBuf,
}

/// Writes `contents` to `path`, readable by the owner only when `secret`.
///
/// # Errors
/// [`PkiError::Write`].
pub fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), PkiError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let err = |source| PkiError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)
        .map_err(err)?;
    f.write_all(contents.as_bytes()).map_err(err)
}

impl ClusterPki {
    /// Fresh material; the serving certificate covers
    /// [`default_serving_names`] plus `extra_names`.
    ///
    /// # Errors
    /// [`PkiError`] when a name is invalid or generation fails.
    pub fn generate(extra_names: &[String]) -> Result<Self, PkiError> {
        let ca = Ca::generate("skipper-cluster-ca")?;
        let mut names = default_serving_names();
        for n in extra_names {
            if !names.contains(n) {
                names.push(n.clone());
            }
        }
        let serving = ca.issue_serving("kube-apiserver", &names)?;
        let admin = ca.issue_client(ADMIN_USER, &[MASTERS_GROUP])?;
        Ok(Self {
            ca,
            serving,
            service_account: std::sync::Arc::new(ServiceAccountKey::generate()?),
            admin,
        })
    }

    /// Writes every file into `dir` (created if missing); private keys are mode 0600.
    ///
    /// # Errors
    /// [`PkiError::Write`].
    pub fn write_dir(&self, dir: &Path) -> Result<PkiFiles, PkiError> {
        std::fs::create_dir_all(dir).map_err(|source| PkiError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let files = PkiFiles {
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            service_account_key: dir.join("sa.key"),
            service_account_pub: dir.join("sa.pub"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
        };
        write_file(&files.ca_cert, self.ca.cert_pem(), false)?;
        write_file(&files.ca_key, &self.ca.key_pem(), true)?;
        write_file(&files.serving_cert, &self.serving.cert_pem, false)?;
        write_file(&files.serving_key, &self.serving.key_pem, true)?;
        write_file(
            &files.service_account_key,
            &self.service_account.private_key_pem(),
            true,
        )?;
        write_file(
            &files.service_account_pub,
            &self.service_account.public_key_pem(),
            false,
        )?;
        write_file(&files.admin_cert, &self.admin.cert_pem, false)?;
        write_file(&files.admin_key, &self.admin.key_pem, true)?;
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn roots(ca: &Ca) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(ca.cert_der().to_vec()))
            .unwrap();
        roots
    }

    #[test]
    fn client_certificates_name_the_user_and_group() {
        let ca = Ca::generate("test-ca").unwrap();
        let node = ca
            .issue_client("system:node:sim-node-0", &["system:nodes"])
            .unwrap();
        assert_eq!(
            subject_identity(&node.cert_der).unwrap(),
            (
                "system:node:sim-node-0".to_owned(),
                vec!["system:nodes".to_owned()]
            )
        );
        let plain = ca.issue_client("alice", &[]).unwrap();
        assert_eq!(
            subject_identity(&plain.cert_der).unwrap(),
            ("alice".to_owned(), vec![])
        );
        assert!(matches!(
            ca.issue_client("bob", &["a", "b"]),
            Err(PkiError::TooManyGroups(_))
        ));
    }

    #[test]
    fn client_certificates_verify_against_their_ca_only() {
        let ca = Ca::generate("test-ca").unwrap();
        let other = Ca::generate("other-ca").unwrap();
        let cert = ca.issue_client("alice", &[]).unwrap();
        let der = rustls::pki_types::CertificateDer::from(cert.cert_der.clone());
        let now = rustls::pki_types::UnixTime::now();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots(&ca).into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        verifier.verify_client_cert(&der, &[], now).unwrap();
        let foreign = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots(&other).into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        assert!(foreign.verify_client_cert(&der, &[], now).is_err());
    }

    #[test]
    fn serving_certificates_cover_ip_and_dns_names() {
        use rustls::client::danger::ServerCertVerifier as _;
        let ca = Ca::generate("test-ca").unwrap();
        let serving = ca
            .issue_serving(
                "kube-apiserver",
                &["127.0.0.1".into(), "kubernetes.default.svc".into()],
            )
            .unwrap();
        let der = rustls::pki_types::CertificateDer::from(serving.cert_der.clone());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots(&ca).into(),
            rustls::crypto::ring::default_provider().into(),
        )
        .build()
        .unwrap();
        let now = rustls::pki_types::UnixTime::now();
        for name in ["127.0.0.1", "kubernetes.default.svc"] {
            let server = rustls::pki_types::ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(&der, &[], &server, &[], now)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let wrong = rustls::pki_types::ServerName::try_from("example.com").unwrap();
        assert!(verifier.verify_server_cert(&der, &[], &wrong, &[], now).is_err());
        assert!(matches!(
            ca.issue_serving("x", &["not a name".into()]),
            Err(PkiError::SubjectAltName(_))
        ));
    }

    #[test]
    fn jwts_verify_with_their_key_only() {
        let key = ServiceAccountKey::generate().unwrap();
        let claims = json!({"sub": "system:serviceaccount:default:default", "aud": ["https://kubernetes.default.svc"]});
        let token = key.sign_jwt(&claims).unwrap();
        assert_eq!(key.verify_jwt(&token).unwrap(), claims);
        let other = ServiceAccountKey::generate().unwrap();
        assert_eq!(other.verify_jwt(&token), Err(JwtError::Signature));
        let mut parts: Vec<&str> = token.split('.').collect();
        let forged = b64(json!({"sub": "system:serviceaccount:kube-system:admin"})
            .to_string()
            .as_bytes());
        parts[1] = &forged;
        assert_eq!(key.verify_jwt(&parts.join(".")), Err(JwtError::Signature));
        assert_eq!(key.verify_jwt("abc"), Err(JwtError::Malformed));
        let none = format!("{}.{}.", b64(br#"{"alg":"none"}"#), b64(b"{}"));
        assert!(matches!(key.verify_jwt(&none), Err(JwtError::Header(_))));
    }

    #[test]
    fn kid_is_the_hash_of_the_public_key() {
        let key = ServiceAccountKey::generate().unwrap();
        let pem = key.public_key_pem();
        let der = base64::engine::general_purpose::STANDARD
            .decode(
                pem.lines()
                    .filter(|l| !l.starts_with("-----"))
                    .collect::<String>(),
            )
            .unwrap();
        assert_eq!(
            key.kid(),
            b64(ring::digest::digest(&ring::digest::SHA256, &der).as_ref())
        );
        assert!(key.private_key_pem().starts_with("-----BEGIN PRIVATE KEY-----"));
    }

    #[test]
    fn write_dir_writes_private_keys_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let pki = ClusterPki::generate(&["10.0.0.1".into()]).unwrap();
        let dir = std::env::temp_dir().join(format!("skipper-pki-{:x}", rand::random::<u64>()));
        let files = pki.write_dir(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&files.ca_key), 0o600);
        assert_eq!(mode(&files.service_account_key), 0o600);
        assert_eq!(mode(&files.ca_cert), 0o644);
        assert_eq!(
            std::fs::read_to_string(&files.ca_cert).unwrap(),
            pki.ca.cert_pem()
        );
        let (user, groups) = subject_identity(&pki.admin.cert_der).unwrap();
        assert_eq!(
            (user.as_str(), groups),
            (ADMIN_USER, vec![MASTERS_GROUP.to_owned()])
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
