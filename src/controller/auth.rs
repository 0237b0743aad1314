//! Who may call a controller: routers and peer controllers present a
//! projected ServiceAccount token with the Skipper audience
//! (`authorization: Bearer <token>`), which the controller verifies with a
//! `TokenReview` and admits only for the configured ServiceAccounts.
//!
//! - A [`Authenticator`] decides: a cheap local look at the token's unverified
//!   claims refuses what cannot pass (wrong shape or audience, expired) without
//!   asking the API server; everything else goes to `TokenReview` (at most
//!   [`MAX_CONCURRENT_REVIEWS`] at once), and the answer is cached by the
//!   token's SHA-256 — a pass until the token expires or [`PASS_TTL`], a
//!   refusal for [`REFUSAL_TTL`] — in at most [`MAX_CACHED`] entries.
//! - [`super::grpc::AuthLayer`] puts it in front of
//!   `skipper.ControllerService` (the health service stays open for probes)
//!   and hands the [`Caller`] to the handlers as a request extension
//!   ([`Caller::of`]); [`super::error`] gives each [`AuthError`] its code.
//! - With `--allow-unauthenticated` a call without a token is admitted as
//!   [`Caller::Anonymous`] (Go routers during a migration); a token that is
//!   presented is still verified.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::metrics::{AuthFailureLabels, Metrics};

/// How long a passing review is reused (never beyond the token's expiry).
pub const PASS_TTL: Duration = Duration::from_secs(60);
/// How long a refused token is refused without asking again.
pub const REFUSAL_TTL: Duration = Duration::from_secs(10);
/// Most cached reviews.
pub const MAX_CACHED: usize = 4096;
/// Most `TokenReview`s in flight at once.
pub const MAX_CONCURRENT_REVIEWS: usize = 16;
/// How long a call waits for a review slot before it is turned away.
const REVIEW_WAIT: Duration = Duration::from_secs(5);
/// Longest token looked at.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// The user-name prefix of ServiceAccounts.
const SERVICE_ACCOUNT_PREFIX: &str = "system:serviceaccount:";
/// The `TokenReview` extra key naming the pod a token is bound to.
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";

/// What an authenticated caller is allowed to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A router: calls on behalf of clients.
    Router,
    /// A peer controller: may forward (`Scale` hops, heartbeats).
    Controller,
}

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No token, admitted by `--allow-unauthenticated`.
    Anonymous,
    /// A verified ServiceAccount.
    ServiceAccount {
        namespace: String,
        name: String,
        /// The pod the token is bound to, when it is.
        pod: Option<String>,
        role: Role,
    },
}

impl Caller {
    /// Whether this caller may forward on behalf of others (a peer
    /// controller, or anyone when callers are not authenticated).
    #[must_use]
    pub fn may_forward(&self) -> bool {
        match self {
            Self::Anonymous => true,
            Self::ServiceAccount { role, .. } => *role == Role::Controller,
        }
    }

    /// Who sent `request` (set by [`super::grpc::AuthLayer`]; a service
    /// used without it sees [`Caller::Anonymous`]).
    #[must_use]
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        request
            .extensions()
            .get::<Self>()
            .cloned()
            .unwrap_or(Self::Anonymous)
    }
}

/// Why a call was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error(
        "missing credentials: send a ServiceAccount token with audience {audience} as 'authorization: Bearer <token>'"
    )]
    Missing { audience: String },
    #[error("malformed credentials: {0}")]
    Malformed(&'static str),
    #[error("token refused: {0}")]
    Refused(String),
    #[error("{user} may not call this controller (allowed: {allowed})")]
    Forbidden { user: String, allowed: String },
    #[error("failed to review the token: {0}")]
    Unavailable(String),
}

impl AuthError {
    /// The failure metric's `reason` label (a fixed set).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "missing",
            Self::Malformed(_) => "malformed",
            Self::Refused(_) => "refused",
            Self::Forbidden { .. } => "forbidden",
            Self::Unavailable(_) => "unavailable",
        }
    }
}

/// A ServiceAccount, `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Who may call, and how tokens are checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Admit calls without a token as [`Caller::Anonymous`].
    pub allow_unauthenticated: bool,
    /// The audience tokens must carry.
    pub audience: String,
    /// ServiceAccounts admitted as routers.
    pub routers: Vec<ServiceAccount>,
    /// ServiceAccounts admitted as peer controllers.
    pub controllers: Vec<ServiceAccount>,
}

impl Policy {
    fn role_of(&self, sa: &ServiceAccount) -> Option<Role> {
        if self.controllers.contains(sa) {
            Some(Role::Controller)
        } else if self.routers.contains(sa) {
            Some(Role::Router)
        } else {
            None
        }
    }

    fn allowed(&self) -> String {
        self.routers
            .iter()
            .chain(&self.controllers)
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What the API server said about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Review {
    /// Authenticated for the audience as `user`.
    Passed { user: String, pod: Option<String> },
    /// Not authenticated; the API server's reason.
    Failed(String),
}

/// The `TokenReview` call, behind a trait so the cache is tested without an
/// API server.
pub trait Reviewer: Send + Sync + 'static {
    /// Reviews `token` for `audience`.
    fn review<'a>(&'a self, token: &'a str, audience: &'a str) -> BoxFuture<'a, Result<Review, String>>;
}

/// `TokenReview` through the controller's Kubernetes client.
#[derive(Clone)]
pub struct KubeReviewer(pub kube::Client);

impl Reviewer for KubeReviewer {
    fn review<'a>(&'a self, token: &'a str, audience: &'a str) -> BoxFuture<'a, Result<Review, String>> {
        Box::pin(async move {
            let api: kube::Api<TokenReview> = kube::Api::all(self.0.clone());
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.to_owned()),
                    audiences: Some(vec![audience.to_owned()]),
                },
                ..TokenReview::default()
            };
            let answer = api
                .create(&kube::api::PostParams::default(), &review)
                .await
                .map_err(|e| e.to_string())?;
            let status = answer.status.unwrap_or_default();
            if status.authenticated != Some(true) {
                return Ok(Review::Failed(
                    status
                        .error
                        .filter(|e| !e.is_empty())
                        .unwrap_or_else(|| "the API server did not authenticate it".into()),
                ));
            }
            if !status.audiences.unwrap_or_default().iter().any(|a| a == audience) {
                return Ok(Review::Failed(format!("not valid for audience {audience}")));
            }
            let user = status.user.unwrap_or_default();
            let pod = user
                .extra
                .as_ref()
                .and_then(|e| e.get(POD_NAME_EXTRA))
                .and_then(|v| v.first().cloned());
            Ok(Review::Passed {
                user: user.username.unwrap_or_default(),
                pod,
            })
        })
    }
}

struct Cached {
    review: Review,
    until: Instant,
}

/// Verifies callers' tokens.
pub struct Authenticator {
    policy: Policy,
    reviewer: Box<dyn Reviewer>,
    cache: Mutex<HashMap<[u8; 32], Cached>>,
    reviews: Semaphore,
    metrics: Metrics,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// The claims looked at before a review (unverified: they only refuse).
#[derive(Debug, serde::Deserialize)]
struct Claims {
    #[serde(default)]
    aud: Audience,
    exp: Option<i64>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(untagged)]
enum Audience {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

impl Audience {
    fn contains(&self, a: &str) -> bool {
        match self {
            Self::None => false,
            Self::One(x) => x == a,
            Self::Many(xs) => xs.iter().any(|x| x == a),
        }
    }
}

/// The unverified claims of a JWT.
fn claims(token: &str) -> Result<Claims, AuthError> {
    let mut parts = token.split('.');
    let (Some(_), Some(payload), Some(_), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::Malformed("the token is not a JWT"));
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| AuthError::Malformed("the token's payload is not base64url"))?;
    serde_json::from_slice(&bytes).map_err(|_| AuthError::Malformed("the token's payload is not JSON claims"))
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

impl Authenticator {
    /// An authenticator applying `policy`, reviewing with `reviewer`.
    #[must_use]
    pub fn new(policy: Policy, reviewer: impl Reviewer, metrics: Metrics) -> Self {
        Self {
            policy,
            reviewer: Box::new(reviewer),
            cache: Mutex::default(),
            reviews: Semaphore::new(MAX_CONCURRENT_REVIEWS),
            metrics,
        }
    }

    /// The policy applied.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Who sent a call with these headers, counting every refusal.
    ///
    /// # Errors
    /// See [`AuthError`].
    pub async fn authenticate(&self, headers: &http::HeaderMap) -> Result<Caller, AuthError> {
        let result = self.check(headers).await;
        if let Err(e) = &result {
            self.metrics
                .authentication_failures_total
                .get_or_create(&AuthFailureLabels { reason: e.reason() })
                .inc();
            tracing::debug!(error = %e, "refusing a call");
        }
        result
    }

    async fn check(&self, headers: &http::HeaderMap) -> Result<Caller, AuthError> {
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            return if self.policy.allow_unauthenticated {
                Ok(Caller::Anonymous)
            } else {
                Err(AuthError::Missing {
                    audience: self.policy.audience.clone(),
                })
            };
        };
        if value.len() > MAX_TOKEN_BYTES + "Bearer ".len() {
            return Err(AuthError::Malformed("the token is too long"));
        }
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::Malformed("expected 'authorization: Bearer <token>'"))?;
        let review = self.review(token).await?;
        self.admit(review)
    }

    /// The review of `token`: cached, else refused locally when its claims
    /// cannot pass, else asked of the API server.
    async fn review(&self, token: &str) -> Result<Review, AuthError> {
        let key: [u8; 32] = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .unwrap_or([0; 32]);
        let now = Instant::now();
        if let Some(r) = self.cached(&key, now) {
            return Ok(r);
        }
        let claims = claims(token)?;
        let unix = unix_now();
        let local = if !claims.aud.contains(&self.policy.audience) {
            Some(Review::Failed(format!(
                "the token's audience is not {}",
                self.policy.audience
            )))
        } else if claims.exp.is_some_and(|exp| exp <= unix) {
            Some(Review::Failed("the token has expired".into()))
        } else {
            None
        };
        let review = match local {
            Some(r) => r,
            None => {
                let permit = tokio::time::timeout(REVIEW_WAIT, self.reviews.acquire())
                    .await
                    .map_err(|_| AuthError::Unavailable("too many token reviews in flight".into()))?
                    .map_err(|_| AuthError::Unavailable("the controller is stopping".into()))?;
                let r = self
                    .reviewer
                    .review(token, &self.policy.audience)
                    .await
                    .map_err(AuthError::Unavailable)?;
                drop(permit);
                r
            }
        };
        let ttl = match (&review, claims.exp) {
            (Review::Passed { .. }, Some(exp)) => {
                PASS_TTL.min(Duration::from_secs(u64::try_from(exp - unix).unwrap_or(0)))
            }
            (Review::Passed { .. }, None) => PASS_TTL,
            (Review::Failed(_), _) => REFUSAL_TTL,
        };
        self.remember(key, review.clone(), Instant::now() + ttl);
        Ok(review)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Cached>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn cached(&self, key: &[u8; 32], now: Instant) -> Option<Review> {
        let cache = self.lock();
        cache.get(key).filter(|c| c.until > now).map(|c| c.review.clone())
    }

    fn remember(&self, key: [u8; 32], review: Review, until: Instant) {
        let mut cache = self.lock();
        if cache.len() >= MAX_CACHED {
            let now = Instant::now();
            cache.retain(|_, c| c.until > now);
            if cache.len() >= MAX_CACHED {
                // Still full of live entries: forget one that expires first.
                if let Some(k) = cache.iter().min_by_key(|(_, c)| c.until).map(|(k, _)| *k) {
                    cache.remove(&k);
                }
            }
        }
        cache.insert(key, Cached { review, until });
    }

    /// Number of cached reviews.
    #[must_use]
    pub fn cached_len(&self) -> usize {
        self.lock().len()
    }

    fn admit(&self, review: Review) -> Result<Caller, AuthError> {
        let (user, pod) = match review {
            Review::Passed { user, pod } => (user, pod),
            Review::Failed(reason) => return Err(AuthError::Refused(reason)),
        };
        let forbidden = || AuthError::Forbidden {
            user: user.clone(),
            allowed: self.policy.allowed(),
        };
        let (namespace, name) = user
            .strip_prefix(SERVICE_ACCOUNT_PREFIX)
            .and_then(|rest| rest.split_once(':'))
            .ok_or_else(forbidden)?;
        let sa = ServiceAccount {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        };
        let role = self.policy.role_of(&sa).ok_or_else(forbidden)?;
        Ok(Caller::ServiceAccount {
            namespace: sa.namespace,
            name: sa.name,
            pod,
            role,
        })
    }
}

#[cfg(test)]
mod tests;
