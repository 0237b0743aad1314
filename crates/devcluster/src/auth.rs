//! Authentication: who sent a request. A verified client certificate names
//! its user (`CN`) and groups (`O`), as kube-apiserver's x509 authenticator
//! reads them; a bearer token is a ServiceAccount JWT signed by the
//! cluster's key, checked as kube-apiserver checks it (signature, issuer,
//! audience, `exp`/`nbf` with a minute of leeway, the ServiceAccount and any
//! bound Pod or Secret still existing with the same uid). Anything else is
//! `401 Unauthorized` (the simulator runs with anonymous authentication off).
//!
//! Tokens are issued here too, for `TokenRequest`
//! (`POST .../serviceaccounts/{name}/token`) and for
//! [`crate::Cluster::client_for`], and reviewed for
//! `TokenReview`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::error::ApiError;
use super::pki::ServiceAccountKey;
use super::resources::by_kind;
use super::store::{Store, name_of, new_uid, uid_of};

/// The issuer (`iss`) of ServiceAccount tokens, and the API server's
/// default audience (kubeadm's `--service-account-issuer`).
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Added to every authenticated user.
pub const AUTHENTICATED_GROUP: &str = "system:authenticated";
/// The group of every ServiceAccount.
pub const SERVICE_ACCOUNTS_GROUP: &str = "system:serviceaccounts";
/// The group of node credentials.
pub const NODES_GROUP: &str = "system:nodes";
/// The user-name prefix of node credentials.
pub const NODE_USER_PREFIX: &str = "system:node:";
/// The user-name prefix of ServiceAccounts.
pub const SERVICE_ACCOUNT_USER_PREFIX: &str = "system:serviceaccount:";
/// The default and minimum `expirationSeconds` of a TokenRequest.
pub const DEFAULT_TOKEN_SECONDS: i64 = 3600;
/// The shortest token a TokenRequest may ask for.
pub const MIN_TOKEN_SECONDS: i64 = 600;
/// Tolerance on `exp`/`nbf` and on deletion of bound objects (go-jose's `DefaultLeeway`).
const LEEWAY_SECONDS: i64 = 60;

/// An authenticated user, as `user.Info` in kube-apiserver.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UserInfo {
    /// `kubernetes-admin`, `system:node:sim-node-0`, `system:serviceaccount:ns:name`, ...
    pub name: String,
    /// The ServiceAccount's uid for ServiceAccounts; empty otherwise.
    pub uid: String,
    /// Groups, `system:authenticated` included.
    pub groups: Vec<String>,
    /// Extra attributes (`authentication.kubernetes.io/pod-name`, ...).
    pub extra: BTreeMap<String, Vec<String>>,
}

impl UserInfo {
    /// A user with `groups` plus `system:authenticated`.
    #[must_use]
    pub fn new(name: &str, groups: &[String]) -> Self {
        let mut groups = groups.to_vec();
        if !groups.iter().any(|g| g == AUTHENTICATED_GROUP) {
            groups.push(AUTHENTICATED_GROUP.to_owned());
        }
        Self {
            name: name.to_owned(),
            groups,
            ..Self::default()
        }
    }

    /// Whether the user is in `group`.
    #[must_use]
    pub fn in_group(&self, group: &str) -> bool {
        self.groups.iter().any(|g| g == group)
    }

    /// The node name of a node credential (`system:node:<name>` in `system:nodes`).
    #[must_use]
    pub fn node_name(&self) -> Option<&str> {
        self.name
            .strip_prefix(NODE_USER_PREFIX)
            .filter(|n| !n.is_empty() && self.in_group(NODES_GROUP))
    }

    /// `(namespace, name)` of a ServiceAccount user.
    #[must_use]
    pub fn service_account(&self) -> Option<(&str, &str)> {
        self.name
            .strip_prefix(SERVICE_ACCOUNT_USER_PREFIX)?
            .split_once(':')
    }

    /// The `UserInfo` object of TokenReview and SubjectAccessReview.
    #[must_use]
    pub fn to_json(&self) -> Value {
        let mut v = json!({"username": self.name, "groups": self.groups});
        if !self.uid.is_empty() {
            v["uid"] = json!(self.uid);
        }
        if !self.extra.is_empty() {
            v["extra"] = json!(self.extra);
        }
        v
    }
}

/// The identity a verified client certificate presented on a connection
/// (a request extension set by the HTTPS listener).
#[derive(Debug, Clone, Default)]
pub struct PeerCertificate(pub Option<UserInfo>);

/// Why a request or token was not authenticated (`401`, or `authenticated:
/// false` with this text in a TokenReview).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthnError {
    #[error("no credentials")]
    NoCredentials,
    #[error("invalid bearer token")]
    Malformed,
    #[error("[invalid bearer token, square/go-jose: error in cryptographic primitive]")]
    Signature,
    #[error("[invalid bearer token, service account token has expired]")]
    Expired,
    #[error("[invalid bearer token, service account token is not valid yet]")]
    NotYetValid,
    #[error(
        "[invalid bearer token, token audiences {token:?} is invalid for the target audiences {wanted:?}]"
    )]
    Audience { token: Vec<String>, wanted: Vec<String> },
    #[error("[invalid bearer token, {0}]")]
    Invalidated(String),
}

/// A TokenRequest after validation.
#[derive(Debug, Clone, Default)]
pub struct TokenSpec {
    /// `spec.audiences` (the API server's audience when empty).
    pub audiences: Vec<String>,
    /// `spec.expirationSeconds`.
    pub expiration_seconds: i64,
    /// `spec.boundObjectRef` as (kind, name, uid).
    pub bound: Option<(String, String, Option<String>)>,
}

impl TokenSpec {
    /// Reads and validates the `spec` of a `TokenRequest` body.
    ///
    /// # Errors
    /// `Invalid` (422) with the real field messages.
    pub fn from_request(name: &str, body: &Value) -> Result<Self, ApiError> {
        let spec = &body["spec"];
        let audiences = spec
            .get("audiences")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
            .unwrap_or_default();
        let expiration_seconds = spec
            .get("expirationSeconds")
            .and_then(Value::as_i64)
            .unwrap_or(DEFAULT_TOKEN_SECONDS);
        if expiration_seconds < MIN_TOKEN_SECONDS {
            return Err(ApiError::Invalid(format!(
                "TokenRequest.authentication.k8s.io \"{name}\" is invalid: spec.expirationSeconds: Invalid value: {expiration_seconds}: may not specify a duration less than 10 minutes"
            )));
        }
        if expiration_seconds > 1 << 32 {
            return Err(ApiError::Invalid(format!(
                "TokenRequest.authentication.k8s.io \"{name}\" is invalid: spec.expirationSeconds: Invalid value: {expiration_seconds}: may not specify a duration larger than 2^32 seconds"
            )));
        }
        let bound = spec.get("boundObjectRef").filter(|r| r.is_object()).map(|r| {
            (
                r.get("kind").and_then(Value::as_str).unwrap_or("").to_owned(),
                r.get("name").and_then(Value::as_str).unwrap_or("").to_owned(),
                r.get("uid")
                    .and_then(Value::as_str)
                    .filter(|u| !u.is_empty())
                    .map(str::to_owned),
            )
        });
        Ok(Self {
            audiences,
            expiration_seconds,
            bound,
        })
    }
}

fn now_unix() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// Issues and verifies ServiceAccount tokens; turns request credentials into a [`UserInfo`].
pub struct Authenticator {
    key: Arc<ServiceAccountKey>,
    issuer: String,
    audiences: Vec<String>,
    /// Claims of tokens whose signature verified, by token: a signature is
    /// checked once per token (an ECDSA verification costs about 150 µs, on
    /// every request of a client), while the claims' expiry, audience and
    /// bound objects are checked on every request, so a cached token loses
    /// no check but the signature's. At most [`VERIFIED_CACHE_ENTRIES`].
    verified: Mutex<HashMap<String, Arc<Value>>>,
}

/// Bound of [`Authenticator`]'s cache of verified signatures; it starts
/// over when full (tokens live an hour or less, clients reuse theirs).
const VERIFIED_CACHE_ENTRIES: usize = 4096;

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("issuer", &self.issuer)
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    /// Tokens signed by `key`, issued by [`ISSUER`], for the API audience [`ISSUER`].
    #[must_use]
    pub fn new(key: Arc<ServiceAccountKey>) -> Self {
        Self {
            key,
            issuer: ISSUER.to_owned(),
            audiences: vec![ISSUER.to_owned()],
            verified: Mutex::default(),
        }
    }

    /// The claims of `token` when its signature is the key's; each token's
    /// signature is verified once.
    fn verified_claims(&self, token: &str) -> Result<Arc<Value>, AuthnError> {
        let cache = || {
            self.verified
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(claims) = cache().get(token) {
            return Ok(claims.clone());
        }
        let claims = Arc::new(self.key.verify_jwt(token).map_err(|e| match e {
            super::pki::JwtError::Signature => AuthnError::Signature,
            _ => AuthnError::Malformed,
        })?);
        let mut verified = cache();
        if verified.len() >= VERIFIED_CACHE_ENTRIES {
            verified.clear();
        }
        verified.insert(token.to_owned(), claims.clone());
        Ok(claims)
    }

    /// The API server's own audiences (the default of a TokenRequest).
    #[must_use]
    pub fn audiences(&self) -> &[String] {
        &self.audiences
    }

    /// The user of a request: the client certificate's when one was
    /// verified, else the bearer token's.
    ///
    /// # Errors
    /// [`AuthnError`] when there are no credentials or the token is not valid.
    pub fn authenticate(
        &self,
        store: &Store,
        peer: Option<&UserInfo>,
        authorization: Option<&str>,
    ) -> Result<UserInfo, AuthnError> {
        if let Some(user) = peer {
            return Ok(user.clone());
        }
        let Some(header) = authorization else {
            return Err(AuthnError::NoCredentials);
        };
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthnError::NoCredentials)?;
        self.verify(store, token, &self.audiences)
    }

    /// Verifies a ServiceAccount token for `audiences` (any one must match).
    ///
    /// # Errors
    /// [`AuthnError`] naming what is wrong with the token.
    pub fn verify(&self, store: &Store, token: &str, audiences: &[String]) -> Result<UserInfo, AuthnError> {
        self.verify_audiences(store, token, audiences)
            .map(|(user, _)| user)
    }

    /// [`Authenticator::verify`], also returning the token's audiences that were asked for.
    fn verify_audiences(
        &self,
        store: &Store,
        token: &str,
        audiences: &[String],
    ) -> Result<(UserInfo, Vec<String>), AuthnError> {
        let claims = self.verified_claims(token)?;
        if claims.get("iss").and_then(Value::as_str) != Some(self.issuer.as_str()) {
            return Err(AuthnError::Malformed);
        }
        let token_auds: Vec<String> = match claims.get("aud") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
            _ => Vec::new(),
        };
        if !token_auds.iter().any(|a| audiences.contains(a)) {
            return Err(AuthnError::Audience {
                token: token_auds,
                wanted: audiences.to_vec(),
            });
        }
        let now = now_unix();
        let num = |k: &str| claims.get(k).and_then(Value::as_i64);
        if num("exp").is_some_and(|exp| now > exp + LEEWAY_SECONDS) {
            return Err(AuthnError::Expired);
        }
        if num("nbf").is_some_and(|nbf| now + LEEWAY_SECONDS < nbf) {
            return Err(AuthnError::NotYetValid);
        }
        let k8s = &claims["kubernetes.io"];
        let ns = k8s["namespace"].as_str().unwrap_or_default();
        let sa_name = k8s
            .pointer("/serviceaccount/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let sa_uid = k8s
            .pointer("/serviceaccount/uid")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let deleted_too_long = |obj: &Value| {
            obj.pointer("/metadata/deletionTimestamp")
                .and_then(Value::as_str)
                .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                .is_some_and(|t| t.as_second() < now - LEEWAY_SECONDS)
        };
        let sa = store
            .get(by_kind("ServiceAccount"), ns, sa_name)
            .ok_or_else(|| AuthnError::Invalidated(format!("serviceaccounts \"{sa_name}\" not found")))?;
        if deleted_too_long(&sa) {
            return Err(AuthnError::Invalidated(format!(
                "service account {ns}/{sa_name} has been deleted"
            )));
        }
        if uid_of(&sa) != sa_uid {
            return Err(AuthnError::Invalidated(format!(
                "service account UID ({}) does not match claim ({sa_uid})",
                uid_of(&sa)
            )));
        }
        let mut user = UserInfo::new(
            &format!("{SERVICE_ACCOUNT_USER_PREFIX}{ns}:{sa_name}"),
            &[
                SERVICE_ACCOUNTS_GROUP.to_owned(),
                format!("{SERVICE_ACCOUNTS_GROUP}:{ns}"),
            ],
        );
        user.uid = sa_uid.to_owned();
        for (kind, claim) in [("Secret", "secret"), ("Pod", "pod")] {
            let Some(r) = k8s.get(claim).filter(|r| r.is_object()) else {
                continue;
            };
            let name = r["name"].as_str().unwrap_or_default();
            let uid = r["uid"].as_str().unwrap_or_default();
            let invalidated = || AuthnError::Invalidated("service account token has been invalidated".into());
            let obj = store.get(by_kind(kind), ns, name).ok_or_else(invalidated)?;
            if deleted_too_long(&obj) {
                return Err(invalidated());
            }
            if uid_of(&obj) != uid {
                return Err(AuthnError::Invalidated(format!(
                    "{claim} UID ({}) does not match service account {claim} ref claim ({uid})",
                    uid_of(&obj)
                )));
            }
            if kind == "Pod" {
                user.extra.insert(
                    "authentication.kubernetes.io/pod-name".into(),
                    vec![name.to_owned()],
                );
                user.extra.insert(
                    "authentication.kubernetes.io/pod-uid".into(),
                    vec![uid.to_owned()],
                );
            }
        }
        if let Some(node) = k8s.pointer("/node/name").and_then(Value::as_str) {
            user.extra.insert(
                "authentication.kubernetes.io/node-name".into(),
                vec![node.to_owned()],
            );
        }
        if let Some(jti) = claims.get("jti").and_then(Value::as_str) {
            user.extra.insert(
                "authentication.kubernetes.io/credential-id".into(),
                vec![format!("JTI={jti}")],
            );
        }
        let matched = token_auds.into_iter().filter(|a| audiences.contains(a)).collect();
        Ok((user, matched))
    }

    /// Issues a token for ServiceAccount `ns/name` as `TokenRequest` does;
    /// returns the token and its expiry (Unix seconds).
    ///
    /// # Errors
    /// `NotFound` for a missing ServiceAccount or bound object, `BadRequest`
    /// for a pod of another ServiceAccount or an unsupported kind, `Conflict`
    /// for a stale bound uid.
    pub fn issue(
        &self,
        store: &Store,
        ns: &str,
        name: &str,
        spec: &TokenSpec,
    ) -> Result<(String, i64), ApiError> {
        let sares = by_kind("ServiceAccount");
        let sa = store.get(sares, ns, name).ok_or_else(|| ApiError::NotFound {
            res: sares,
            name: name.to_owned(),
        })?;
        let mut k8s = json!({
            "namespace": ns,
            "serviceaccount": {"name": name, "uid": uid_of(&sa)},
        });
        if let Some((kind, bound_name, bound_uid)) = &spec.bound {
            let res = match kind.as_str() {
                "Pod" | "Secret" | "Node" => by_kind(kind),
                other => {
                    return Err(ApiError::BadRequest(format!(
                        "cannot bind token to object of type /v1, Kind={other}"
                    )));
                }
            };
            let obj_ns = if kind == "Node" { "" } else { ns };
            let obj = store
                .get(res, obj_ns, bound_name)
                .ok_or_else(|| ApiError::NotFound {
                    res,
                    name: bound_name.clone(),
                })?;
            if kind == "Pod" {
                let pod_sa = obj
                    .pointer("/spec/serviceAccountName")
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                if pod_sa != name {
                    return Err(ApiError::BadRequest(format!(
                        "cannot bind token for serviceaccount \"{name}\" to pod running with serviceaccount \"{pod_sa}\""
                    )));
                }
            }
            if let Some(u) = bound_uid
                && u != uid_of(&obj)
            {
                return Err(ApiError::ConflictWith {
                    group_resource: kind.clone(),
                    name: bound_name.clone(),
                    cause: format!(
                        "the UID in the bound object reference ({u}) does not match the UID in record ({}). The object might have been deleted and then recreated",
                        uid_of(&obj)
                    ),
                });
            }
            let r = json!({"name": name_of(&obj), "uid": uid_of(&obj)});
            k8s[kind.to_lowercase()] = r;
            if kind == "Pod"
                && let Some(node) = obj.pointer("/spec/nodeName").and_then(Value::as_str)
                && let Some(n) = store.get(by_kind("Node"), "", node)
            {
                k8s["node"] = json!({"name": node, "uid": uid_of(&n)});
            }
        }
        let now = now_unix();
        let exp = now + spec.expiration_seconds;
        let audiences = if spec.audiences.is_empty() {
            self.audiences.clone()
        } else {
            spec.audiences.clone()
        };
        let claims = json!({
            "aud": audiences,
            "exp": exp,
            "iat": now,
            "iss": self.issuer,
            "jti": new_uid(),
            "kubernetes.io": k8s,
            "nbf": now,
            "sub": format!("{SERVICE_ACCOUNT_USER_PREFIX}{ns}:{name}"),
        });
        let token = self
            .key
            .sign_jwt(&claims)
            .map_err(|e| ApiError::Internal(format!("failed to generate token: {e}")))?;
        Ok((token, exp))
    }

    /// The `status` of a TokenReview of `token` for `audiences` (the API
    /// server's when empty).
    #[must_use]
    pub fn review(&self, store: &Store, token: &str, audiences: &[String]) -> Value {
        let wanted = if audiences.is_empty() {
            self.audiences.clone()
        } else {
            audiences.to_vec()
        };
        match self.verify_audiences(store, token, &wanted) {
            Ok((user, matched)) => {
                json!({"authenticated": true, "user": user.to_json(), "audiences": matched})
            }
            Err(e) => json!({"user": {}, "error": e.to_string()}),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn with_robot() -> (Authenticator, Store, String) {
        let auth = Authenticator::new(Arc::new(ServiceAccountKey::generate().unwrap()));
        let store = Store::new(100);
        store
            .create(
                by_kind("Namespace"),
                "",
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}),
            )
            .unwrap();
        store
            .create(
                by_kind("ServiceAccount"),
                "ns",
                json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "robot", "namespace": "ns"}}),
            )
            .unwrap();
        let spec = TokenSpec {
            audiences: Vec::new(),
            expiration_seconds: 3600,
            bound: None,
        };
        let (token, _) = auth.issue(&store, "ns", "robot", &spec).unwrap();
        (auth, store, token)
    }

    #[test]
    fn a_verified_signature_is_remembered_but_every_other_check_runs_each_time() {
        let (auth, store, token) = with_robot();
        let robot = "system:serviceaccount:ns:robot";
        for _ in 0..2 {
            assert_eq!(auth.verify(&store, &token, auth.audiences()).unwrap().name, robot);
        }
        assert_eq!(auth.verified.lock().unwrap().len(), 1);
        // The audience is checked on a remembered token.
        assert!(matches!(
            auth.verify(&store, &token, &["elsewhere".to_owned()]),
            Err(AuthnError::Audience { .. })
        ));
        // So is its ServiceAccount: deleted, the token stops working.
        store
            .remove(by_kind("ServiceAccount"), "ns", "robot", None)
            .unwrap();
        assert!(matches!(
            auth.verify(&store, &token, auth.audiences()),
            Err(AuthnError::Invalidated(_))
        ));
    }

    #[test]
    fn a_forged_signature_is_refused_every_time_and_never_remembered() {
        let (auth, store, token) = with_robot();
        let (head, _) = token.rsplit_once('.').unwrap();
        let forged = format!("{head}.{}", "A".repeat(86));
        for _ in 0..2 {
            assert!(matches!(
                auth.verify(&store, &forged, auth.audiences()),
                Err(AuthnError::Signature)
            ));
        }
        assert!(auth.verified.lock().unwrap().is_empty());
    }
}
