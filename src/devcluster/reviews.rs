//! The create-only APIs that answer questions instead of storing objects:
//! `TokenRequest` (`serviceaccounts/{name}/token`), `TokenReview`,
//! `SelfSubjectReview` (`kubectl auth whoami`), and the authorization
//! reviews (`kubectl auth can-i`).

use serde_json::{Value, json};

use super::auth::{Authenticator, TokenSpec, UserInfo};
use super::error::ApiError;
use super::store::Store;

/// Longest token a review may carry (a JWT is a few hundred bytes).
const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Most audiences a request may name.
const MAX_AUDIENCES: usize = 64;

fn audiences_of(spec: &Value) -> Result<Vec<String>, ApiError> {
    let auds: Vec<String> = spec
        .get("audiences")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    if auds.len() > MAX_AUDIENCES {
        return Err(ApiError::BadRequest(format!(
            "at most {MAX_AUDIENCES} audiences may be named; got {}",
            auds.len()
        )));
    }
    Ok(auds)
}

fn rfc3339(unix: i64) -> String {
    jiff::Timestamp::from_second(unix)
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default()
}

/// `POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token`: the
/// `TokenRequest` with its `status` (token and expiry).
///
/// # Errors
/// As [`Authenticator::issue`], plus validation of the spec.
pub fn token_request(
    auth: &Authenticator,
    store: &Store,
    ns: &str,
    name: &str,
    body: &Value,
) -> Result<Value, ApiError> {
    if let Some(kind) = body.get("kind").and_then(Value::as_str)
        && kind != "TokenRequest"
    {
        return Err(ApiError::BadRequest(format!(
            "the kind {kind:?} of the object does not match TokenRequest"
        )));
    }
    audiences_of(&body["spec"])?;
    let mut spec = TokenSpec::from_request(name, body)?;
    let (token, exp) = auth.issue(store, ns, name, &spec)?;
    if spec.audiences.is_empty() {
        spec.audiences = auth.audiences().to_vec();
    }
    let bound = body
        .pointer("/spec/boundObjectRef")
        .cloned()
        .unwrap_or(Value::Null);
    Ok(json!({
        "kind": "TokenRequest",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": null},
        "spec": {
            "audiences": spec.audiences,
            "expirationSeconds": spec.expiration_seconds,
            "boundObjectRef": bound,
        },
        "status": {"token": token, "expirationTimestamp": rfc3339(exp)},
    }))
}

/// `POST /apis/authentication.k8s.io/v1/tokenreviews`.
///
/// # Errors
/// `BadRequest` without a token.
pub fn token_review(auth: &Authenticator, store: &Store, body: &Value) -> Result<Value, ApiError> {
    let spec = body.get("spec").cloned().unwrap_or_else(|| json!({}));
    let token = spec.get("token").and_then(Value::as_str).unwrap_or("");
    if token.is_empty() {
        return Err(ApiError::BadRequest(
            "token is required for TokenReview in authentication".into(),
        ));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(ApiError::BadRequest(format!(
            "the token is {} bytes; at most {MAX_TOKEN_BYTES} are reviewed",
            token.len()
        )));
    }
    let audiences = audiences_of(&spec)?;
    Ok(json!({
        "kind": "TokenReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "spec": spec,
        "status": auth.review(store, token, &audiences),
    }))
}

/// `POST /apis/authentication.k8s.io/v1/selfsubjectreviews`: who the caller is.
#[must_use]
pub fn self_subject_review(user: &UserInfo) -> Value {
    json!({
        "kind": "SelfSubjectReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "status": {"userInfo": user.to_json()},
    })
}
