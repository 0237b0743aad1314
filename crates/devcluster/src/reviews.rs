//! The create-only APIs that answer questions instead of storing objects:
//! `TokenRequest` (`serviceaccounts/{name}/token`), `TokenReview`,
//! `SelfSubjectReview` (`kubectl auth whoami`), and the authorization
//! reviews (`kubectl auth can-i`).

use serde_json::{Value, json};

use super::auth::{Authenticator, TokenSpec, UserInfo};
use super::error::ApiError;
use super::rbac::{self, Attributes};
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

/// The attributes a `SubjectAccessReview`-family spec asks about.
///
/// # Errors
/// `Invalid` unless exactly one of `resourceAttributes` and `nonResourceAttributes` is given.
fn review_attributes(kind: &str, spec: &Value) -> Result<Attributes, ApiError> {
    let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    match (
        spec.get("resourceAttributes").filter(|v| v.is_object()),
        spec.get("nonResourceAttributes").filter(|v| v.is_object()),
    ) {
        (Some(r), None) => {
            let mut a = Attributes::resource(
                &s(r, "verb"),
                &s(r, "namespace"),
                &s(r, "group"),
                &s(r, "resource"),
                &s(r, "subresource"),
                &s(r, "name"),
            );
            a.field_selector = r
                .pointer("/fieldSelector/rawSelector")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            Ok(a)
        }
        (None, Some(n)) => Ok(Attributes::non_resource(&s(n, "verb"), &s(n, "path"))),
        (r, _) => Err(ApiError::Invalid(format!(
            "{kind}.authorization.k8s.io \"\" is invalid: spec.{}: Invalid value: {}: exactly one of nonResourceAttributes or resourceAttributes must be specified",
            if r.is_some() {
                "resourceAttributes"
            } else {
                "nonResourceAttributes"
            },
            if r.is_some() {
                "\"(resource and non-resource attributes)\""
            } else {
                "\"null\""
            },
        ))),
    }
}

fn access_status(store: &Store, user: &UserInfo, attrs: &Attributes) -> Value {
    let d = rbac::authorize(store, user, attrs);
    let mut status = json!({"allowed": d.allowed});
    if !d.reason.is_empty() {
        status["reason"] = json!(d.reason);
    }
    status
}

fn review_answer(kind: &str, namespace: Option<&str>, spec: Value, status: Value) -> Value {
    let mut meta = json!({"creationTimestamp": null});
    if let Some(ns) = namespace {
        meta["namespace"] = json!(ns);
    }
    json!({
        "kind": kind,
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": meta,
        "spec": spec,
        "status": status,
    })
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews` (`kubectl auth can-i`).
///
/// # Errors
/// `Invalid` for a spec without exactly one kind of attributes.
pub fn self_subject_access_review(store: &Store, user: &UserInfo, body: &Value) -> Result<Value, ApiError> {
    let spec = body.get("spec").cloned().unwrap_or_else(|| json!({}));
    let attrs = review_attributes("SelfSubjectAccessReview", &spec)?;
    let status = access_status(store, user, &attrs);
    Ok(review_answer("SelfSubjectAccessReview", None, spec, status))
}

/// `POST .../subjectaccessreviews` and `.../namespaces/{ns}/localsubjectaccessreviews`:
/// may `spec.user`/`spec.groups` do this?
///
/// # Errors
/// `Invalid` without a user or group, for a spec without exactly one kind of
/// attributes, or (local) a namespace other than the URL's.
pub fn subject_access_review(
    store: &Store,
    namespace: Option<&str>,
    body: &Value,
) -> Result<Value, ApiError> {
    let kind = if namespace.is_some() {
        "LocalSubjectAccessReview"
    } else {
        "SubjectAccessReview"
    };
    let spec = body.get("spec").cloned().unwrap_or_else(|| json!({}));
    let name = spec.get("user").and_then(Value::as_str).unwrap_or("");
    let groups: Vec<String> = spec
        .get("groups")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    if name.is_empty() && groups.is_empty() {
        return Err(ApiError::Invalid(format!(
            "{kind}.authorization.k8s.io \"\" is invalid: spec.user: Invalid value: \"\": at least one of user or group must be specified"
        )));
    }
    let attrs = review_attributes(kind, &spec)?;
    if let Some(ns) = namespace
        && attrs.namespace != ns
    {
        return Err(ApiError::Invalid(format!(
            "{kind}.authorization.k8s.io \"\" is invalid: spec.resourceAttributes.namespace: Invalid value: {:?}: must match metadata.namespace",
            attrs.namespace
        )));
    }
    // The groups are taken as given (no system:authenticated added), as kube-apiserver does.
    let user = UserInfo {
        name: name.to_owned(),
        uid: spec.get("uid").and_then(Value::as_str).unwrap_or("").to_owned(),
        groups,
        extra: std::collections::BTreeMap::new(),
    };
    let status = access_status(store, &user, &attrs);
    Ok(review_answer(kind, namespace, spec, status))
}

/// `POST /apis/authorization.k8s.io/v1/selfsubjectrulesreviews` (`kubectl auth can-i --list`).
///
/// # Errors
/// None today; the signature matches the other reviews.
pub fn self_subject_rules_review(store: &Store, user: &UserInfo, body: &Value) -> Result<Value, ApiError> {
    let spec = body.get("spec").cloned().unwrap_or_else(|| json!({}));
    let ns = spec.get("namespace").and_then(Value::as_str).unwrap_or("");
    let mut resource_rules = Vec::new();
    let mut non_resource_rules = Vec::new();
    for rule in rbac::rules_for(store, user, ns) {
        let verbs = rule.get("verbs").cloned().unwrap_or_else(|| json!([]));
        if let Some(urls) = rule
            .get("nonResourceURLs")
            .filter(|u| u.as_array().is_some_and(|a| !a.is_empty()))
        {
            non_resource_rules.push(json!({"verbs": verbs, "nonResourceURLs": urls}));
        }
        if rule
            .get("resources")
            .is_some_and(|r| r.as_array().is_some_and(|a| !a.is_empty()))
        {
            let mut r = json!({"verbs": verbs, "apiGroups": rule.get("apiGroups").cloned().unwrap_or_else(|| json!([])),
                               "resources": rule["resources"]});
            if let Some(names) = rule
                .get("resourceNames")
                .filter(|n| n.as_array().is_some_and(|a| !a.is_empty()))
            {
                r["resourceNames"] = names.clone();
            }
            resource_rules.push(r);
        }
    }
    let status = json!({
        "resourceRules": resource_rules,
        "nonResourceRules": non_resource_rules,
        "incomplete": user.node_name().is_some(),
    });
    Ok(review_answer("SelfSubjectRulesReview", None, spec, status))
}

/// NodeRestriction on TokenRequest: a node asks only for tokens bound to a
/// pod that runs on it.
///
/// # Errors
/// `Forbidden` with the admission plugin's text.
pub fn node_may_request_token(store: &Store, node: &str, ns: &str, body: &Value) -> Result<(), ApiError> {
    let forbidden = |why: &str| ApiError::Forbidden {
        group_resource: "serviceaccounts".into(),
        name: String::new(),
        group: String::new(),
        resource: "serviceaccounts".into(),
        message: why.to_owned(),
    };
    let r = body.pointer("/spec/boundObjectRef").filter(|r| r.is_object());
    let Some(r) = r.filter(|r| r.get("kind").and_then(Value::as_str) == Some("Pod")) else {
        return Err(forbidden(&format!(
            "node \"{node}\" can only create tokens for pods bound to it"
        )));
    };
    let pod_name = r.get("name").and_then(Value::as_str).unwrap_or("");
    let on_node = store
        .get(super::resources::by_kind("Pod"), ns, pod_name)
        .is_some_and(|p| p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node));
    if on_node {
        Ok(())
    } else {
        Err(forbidden(
            "node requested token bound to a pod scheduled on a different node",
        ))
    }
}
