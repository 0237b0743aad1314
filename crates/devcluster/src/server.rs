//! The HTTP face of the simulator: discovery, REST and watch for every
//! resource in [`crate::resources::RESOURCES`], Table output for kubectl,
//! pod logs, pod metrics, and the fault-injection endpoints under `/_sim/`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::auth::{Authenticator, PeerCertificate, UserInfo};
use super::controllers::{FOREGROUND_DELETION, ORPHAN, delete_pod};
use super::error::ApiError;
use super::kubelet::Kubelet;
use super::kubelet::logs::{self, LogFile, LogOptions};
use super::patch::{self, PatchKind};
use super::pki::MASTERS_GROUP;
use super::protobuf;
use super::resources::{self, ResourceDef, by_kind};
use super::reviews;
use super::selector::{FieldSelector, LabelSelector};
use super::store::{EventType, Store, name_of, namespace_of, uid_of};
use super::table;
use super::{auth, rbac};

/// Injected faults, shared by the Rust API and `/_sim/`.
#[derive(Debug, Default)]
pub struct Faults {
    fail_writes: AtomicU32,
    fail_status: AtomicU16,
    /// Only writes in this namespace fail (all writes when `None`).
    fail_namespace: Mutex<Option<String>>,
    latency_ms: AtomicU64,
    forbidden: Mutex<std::collections::HashSet<String>>,
}

impl Faults {
    /// The next `n` writes (create, update, patch, delete) fail with
    /// `status`; with `namespace`, only writes in that namespace (and count).
    pub fn fail_next_writes(&self, n: u32, status: StatusCode, namespace: Option<&str>) {
        *self
            .fail_namespace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = namespace.map(str::to_owned);
        self.fail_status.store(status.as_u16(), Ordering::SeqCst);
        self.fail_writes.store(n, Ordering::SeqCst);
    }

    /// Every API request waits this long before it is handled.
    pub fn set_latency(&self, d: Duration) {
        self.latency_ms
            .store(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Every request in namespace `ns` is answered `403 Forbidden` (as
    /// without RBAC permission) until [`Faults::allow_namespace`].
    pub fn forbid_namespace(&self, ns: &str) {
        self.forbidden
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(ns.to_owned());
    }

    /// Lifts [`Faults::forbid_namespace`].
    pub fn allow_namespace(&self, ns: &str) {
        self.forbidden
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(ns);
    }

    fn is_forbidden(&self, ns: &str) -> bool {
        self.forbidden
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(ns)
    }

    fn take_write_failure(&self, namespace: Option<&str>) -> Option<StatusCode> {
        let scope = self
            .fail_namespace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if scope.is_some_and(|s| Some(s.as_str()) != namespace) {
            return None;
        }
        self.fail_writes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()
            .map(|_| {
                StatusCode::from_u16(self.fail_status.load(Ordering::SeqCst))
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            })
    }
}

/// Everything a request handler needs.
pub struct Shared {
    /// The objects.
    pub store: Arc<Store>,
    /// The pod runtime (logs, metrics, kills).
    pub kubelet: Arc<Kubelet>,
    /// Injected faults.
    pub faults: Faults,
    /// Cancelled (and replaced) to drop every open watch.
    pub watches: Mutex<CancellationToken>,
    /// Cancelled when the cluster stops.
    pub root: CancellationToken,
    /// Bookmark period of watches that ask for them.
    pub bookmark_interval: Duration,
    /// Upper bound on `timeoutSeconds`.
    pub max_watch_timeout: Duration,
    /// Verifies and issues credentials.
    pub auth: Authenticator,
}

impl Shared {
    /// Ends every open watch; clients re-watch from their last resourceVersion.
    pub fn drop_watches(&self) {
        let mut guard = self
            .watches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.cancel();
        *guard = self.root.child_token();
    }

    fn watch_token(&self) -> CancellationToken {
        self.watches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// How objects are rendered, from the `Accept` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    /// `meta.k8s.io/v1` Table (kubectl get).
    Table,
    /// `PartialObjectMetadata` (metadata-only clients).
    Meta,
}

impl Format {
    fn of(accept: &str) -> Self {
        if table::wants_table(accept) {
            Self::Table
        } else if accept
            .split(',')
            .any(|p| p.contains("as=PartialObjectMetadata") && p.contains("g=meta.k8s.io"))
        {
            Self::Meta
        } else {
            Self::Json
        }
    }
}

/// The `PartialObjectMetadata` of an object.
fn partial(obj: &Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]})
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// What a path names.
enum Target {
    Doc(Value),
    Res {
        res: &'static ResourceDef,
        ns: Option<String>,
        name: Option<String>,
        sub: Option<String>,
    },
}

fn route(path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, version, rest): (&str, &str, &[&str]) = match segs.as_slice() {
        ["version"] => return Ok(Target::Doc(resources::version())),
        ["api"] => return Ok(Target::Doc(resources::core_versions())),
        ["apis"] => return Ok(Target::Doc(resources::group_list())),
        ["apis", g] => return resources::group(g).map(Target::Doc).ok_or(ApiError::UnknownPath),
        ["api", "v1"] => {
            return resources::resource_list("", "v1")
                .map(Target::Doc)
                .ok_or(ApiError::UnknownPath);
        }
        ["apis", g, v] => {
            return resources::resource_list(g, v)
                .map(Target::Doc)
                .ok_or(ApiError::UnknownPath);
        }
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", g, v, rest @ ..] => (g, v, rest),
        _ => return Err(ApiError::UnknownPath),
    };
    let namespaced =
        rest.len() >= 3 && rest[0] == "namespaces" && resources::find(group, version, rest[2]).is_some();
    let (ns, rest) = if namespaced {
        (Some(rest[1].to_owned()), &rest[2..])
    } else {
        (None, rest)
    };
    let res = resources::find(group, version, rest[0]).ok_or(ApiError::UnknownPath)?;
    if ns.is_some() && !res.namespaced {
        return Err(ApiError::UnknownPath);
    }
    let name = rest.get(1).map(|s| (*s).to_owned());
    let sub = rest.get(2).map(|s| (*s).to_owned());
    if rest.len() > 3 || sub.as_deref().is_some_and(|s| !res.subresources.contains(&s)) {
        return Err(ApiError::UnknownPath);
    }
    Ok(Target::Res { res, ns, name, sub })
}

fn query_map(query: Option<&str>) -> HashMap<String, String> {
    let Some(q) = query else {
        return HashMap::new();
    };
    let uri: axum::http::Uri = match format!("/?{q}").parse() {
        Ok(u) => u,
        Err(_) => return HashMap::new(),
    };
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(&uri)
        .map(|axum::extract::Query(m)| m)
        .unwrap_or_default()
}

/// The single entry point of the HTTP server.
pub async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let peer = req
        .extensions()
        .get::<PeerCertificate>()
        .and_then(|p| p.0.as_ref());
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let user = match shared.auth.authenticate(&shared.store, peer, authorization) {
        Ok(u) => u,
        Err(e) => {
            tracing::debug!(error = %e, path = req.uri().path(), "unauthenticated request");
            return ApiError::Unauthorized.into_response();
        }
    };
    let user = match impersonate(&shared.store, user, req.headers()) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let path = req.uri().path().to_owned();
    let q = query_map(req.uri().query());
    if let Some(rest) = path.strip_prefix("/_sim/") {
        if !user.in_group(MASTERS_GROUP) {
            let attrs = rbac::Attributes::non_resource(&req.method().as_str().to_lowercase(), &path);
            return ApiError::forbidden(&user.name, &attrs).into_response();
        }
        return sim_endpoint(&shared, req.method(), rest, &q);
    }
    let attrs = request_attributes(req.method(), &path, &q);
    let decision = rbac::authorize(&shared.store, &user, &attrs);
    if !decision.allowed {
        return ApiError::forbidden_because(&user.name, &attrs, &decision.reason).into_response();
    }
    let latency = shared.faults.latency_ms.load(Ordering::SeqCst);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return ApiError::BadRequest(format!("reading the request body: {e}")).into_response(),
    };
    if let Some(node) = user.node_name()
        && matches!(
            parts.method,
            Method::POST | Method::PUT | Method::PATCH | Method::DELETE
        )
    {
        let parsed: Option<Value> = if parts.method == Method::PATCH {
            serde_json::from_slice(&body).ok()
        } else {
            parse_object(
                &Decoding::new(FieldValidation::Ignore),
                &parts.headers,
                &body,
                Expect::ANY,
            )
            .ok()
        };
        if let Err(why) = rbac::node_restriction(&shared.store, node, &attrs, parsed.as_ref()) {
            let mut e = ApiError::forbidden(&user.name, &attrs);
            if let ApiError::Forbidden { message, name, .. } = &mut e {
                *message = why;
                if name.is_empty()
                    && let Some(n) = parsed
                        .as_ref()
                        .and_then(|b| b.pointer("/metadata/name"))
                        .and_then(Value::as_str)
                {
                    *name = n.to_owned();
                }
            }
            return e.into_response();
        }
    }
    let validation = if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) {
        match FieldValidation::from_query(&parts.method, &q) {
            Ok(v) => v,
            Err(e) => return e.into_response(),
        }
    } else {
        FieldValidation::Ignore
    };
    let decoding = Decoding::new(validation);
    let request = Req {
        user: &user,
        attrs: &attrs,
        method: &parts.method,
        path: &path,
        q: &q,
        headers: &parts.headers,
        decoding: &decoding,
    };
    let mut response = match serve(&shared, &request, body) {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    for warning in decoding.take_warnings() {
        if let Some(value) = warning_header(&warning) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    response
}

/// What kube-apiserver's RequestInfo makes of a request: a resource request
/// under `/api/v1/...` or `/apis/<group>/<version>/...` (namespace, resource,
/// name, subresource, verb from the method), or a non-resource path.
#[must_use]
pub fn request_attributes(method: &Method, path: &str, q: &HashMap<String, String>) -> rbac::Attributes {
    let lower = method.as_str().to_lowercase();
    let parts: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, mut rest): (&str, &[&str]) = match parts.as_slice() {
        ["api", _version, rest @ ..] if !rest.is_empty() => ("", rest),
        ["apis", group, _version, rest @ ..] if !rest.is_empty() => (group, rest),
        _ => {
            let verb = if *method == Method::HEAD {
                "get"
            } else {
                lower.as_str()
            };
            return rbac::Attributes::non_resource(verb, path);
        }
    };
    let mut legacy_watch = false;
    if rest.first() == Some(&"watch") {
        legacy_watch = true;
        rest = &rest[1..];
    }
    let mut namespace = "";
    if rest.first() == Some(&"namespaces") && rest.len() > 1 {
        namespace = rest[1];
        if rest.len() > 2 && !matches!(rest[2], "status" | "finalize") {
            rest = &rest[2..];
        }
    }
    let resource = rest.first().copied().unwrap_or("");
    let name = rest.get(1).copied().unwrap_or("");
    let subresource = rest.get(2).copied().unwrap_or("");
    let watch = legacy_watch || q.get("watch").is_some_and(|w| w == "1" || w == "true");
    let verb = match *method {
        Method::GET | Method::HEAD if watch => "watch",
        Method::GET | Method::HEAD if name.is_empty() => "list",
        Method::GET | Method::HEAD => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if name.is_empty() => "deletecollection",
        Method::DELETE => "delete",
        _ => lower.as_str(),
    };
    let field_selector = q.get("fieldSelector").cloned().unwrap_or_default();
    // A list or watch of one object by `metadata.name=` names it (RequestInfo does the same).
    let selected = if matches!(verb, "list" | "watch") && name.is_empty() {
        field_selector.split(',').find_map(|r| {
            let (f, v) = r.split_once('=')?;
            (f.trim() == "metadata.name").then(|| v.trim_start_matches('=').trim().to_owned())
        })
    } else {
        None
    };
    let mut attrs = rbac::Attributes::resource(
        verb,
        namespace,
        group,
        resource,
        subresource,
        selected.as_deref().unwrap_or(name),
    );
    attrs.field_selector = field_selector;
    attrs
}

/// Applies `Impersonate-*` headers: the caller must be allowed to
/// `impersonate` each requested user (or ServiceAccount), group, uid and extra.
///
/// # Errors
/// `Forbidden` for a missing permission; `BadRequest` for groups or extras without a user.
fn impersonate(store: &Store, user: UserInfo, headers: &HeaderMap) -> Result<UserInfo, ApiError> {
    let values = |name: &str| -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::to_owned)
            .collect()
    };
    let target = values("impersonate-user").into_iter().next();
    let groups = values("impersonate-group");
    let uid = values("impersonate-uid").into_iter().next();
    let mut extra: std::collections::BTreeMap<String, Vec<String>> = std::collections::BTreeMap::new();
    for (k, v) in headers {
        if let Some(key) = k.as_str().strip_prefix("impersonate-extra-")
            && let Ok(v) = v.to_str()
        {
            let key = percent_decode(key);
            extra.entry(key).or_default().push(v.to_owned());
        }
    }
    let Some(target) = target else {
        if !groups.is_empty() || uid.is_some() || !extra.is_empty() {
            return Err(ApiError::BadRequest(format!(
                "requested {groups:?} without impersonating a user"
            )));
        }
        return Ok(user);
    };
    let check = |attrs: rbac::Attributes| {
        if rbac::authorize(store, &user, &attrs).allowed {
            Ok(())
        } else {
            Err(ApiError::forbidden(&user.name, &attrs))
        }
    };
    let service_account = target
        .strip_prefix(auth::SERVICE_ACCOUNT_USER_PREFIX)
        .and_then(|r| r.split_once(':'));
    match service_account {
        Some((ns, name)) => check(rbac::Attributes::resource(
            "impersonate",
            ns,
            "",
            "serviceaccounts",
            "",
            name,
        ))?,
        None => check(rbac::Attributes::resource(
            "impersonate",
            "",
            "",
            "users",
            "",
            &target,
        ))?,
    }
    for g in &groups {
        check(rbac::Attributes::resource("impersonate", "", "", "groups", "", g))?;
    }
    if let Some(u) = &uid {
        check(rbac::Attributes::resource(
            "impersonate",
            "",
            "authentication.k8s.io",
            "uids",
            "",
            u,
        ))?;
    }
    for (k, vs) in &extra {
        for v in vs {
            check(rbac::Attributes::resource(
                "impersonate",
                "",
                "authentication.k8s.io",
                "userextras",
                k,
                v,
            ))?;
        }
    }
    let mut groups = groups;
    if groups.is_empty()
        && let Some((ns, _)) = service_account
    {
        groups = vec![
            auth::SERVICE_ACCOUNTS_GROUP.to_owned(),
            format!("{}:{ns}", auth::SERVICE_ACCOUNTS_GROUP),
        ];
    }
    let mut out = if target == "system:anonymous" {
        let mut u = UserInfo {
            name: target,
            groups,
            ..UserInfo::default()
        };
        if !u.in_group("system:unauthenticated") {
            u.groups.push("system:unauthenticated".into());
        }
        u
    } else {
        UserInfo::new(&target, &groups)
    };
    out.uid = uid.unwrap_or_default();
    out.extra = extra;
    Ok(out)
}

/// Decodes `%XX` escapes (impersonation extra keys are percent-encoded).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The parts of one authenticated, authorized request.
struct Req<'a> {
    user: &'a UserInfo,
    attrs: &'a rbac::Attributes,
    method: &'a Method,
    path: &'a str,
    q: &'a HashMap<String, String>,
    headers: &'a HeaderMap,
    decoding: &'a Decoding,
}

fn sim_endpoint(shared: &Shared, method: &Method, rest: &str, q: &HashMap<String, String>) -> Response {
    if method != Method::POST {
        return ApiError::MethodNotAllowed.into_response();
    }
    let segs: Vec<&str> = rest.split('/').collect();
    let result: Result<Value, ApiError> = match segs.as_slice() {
        ["pods", ns, name, "kill"] => shared
            .kubelet
            .kill_process(ns, name)
            .map(|pid| json!({"killed": pid}))
            .ok_or_else(|| ApiError::NotFound {
                res: by_kind("Pod"),
                name: (*name).to_owned(),
            }),
        ["drop-watches"] => {
            shared.drop_watches();
            Ok(json!({}))
        }
        ["compact"] => {
            shared.store.compact();
            Ok(json!({}))
        }
        ["fail-writes"] => {
            let n = q.get("count").and_then(|c| c.parse().ok()).unwrap_or(1);
            let status = q
                .get("status")
                .and_then(|s| s.parse::<u16>().ok())
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let namespace = q.get("namespace").filter(|n| !n.is_empty());
            shared
                .faults
                .fail_next_writes(n, status, namespace.map(String::as_str));
            Ok(json!({"count": n, "status": status.as_u16(), "namespace": namespace}))
        }
        ["forbid"] => {
            let ns = q.get("namespace").cloned().unwrap_or_default();
            if q.get("allow").is_some_and(|a| a == "true") {
                shared.faults.allow_namespace(&ns);
            } else {
                shared.faults.forbid_namespace(&ns);
            }
            Ok(json!({"namespace": ns}))
        }
        ["latency"] => {
            let ms = q.get("ms").and_then(|c| c.parse().ok()).unwrap_or(0);
            shared.faults.set_latency(Duration::from_millis(ms));
            Ok(json!({"ms": ms}))
        }
        _ => Err(ApiError::UnknownPath),
    };
    match result {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

fn serve(shared: &Arc<Shared>, req: &Req<'_>, body: Bytes) -> Result<Response, ApiError> {
    let Req {
        user,
        attrs,
        method,
        path,
        q,
        headers,
        decoding,
    } = *req;
    if path == "/openapi/v3" || path == "/openapi/v3/" {
        return Ok(json_response(StatusCode::OK, &resources::openapi_v3_root()));
    }
    if let Some(gv) = path.strip_prefix("/openapi/v3/") {
        let doc = resources::openapi_v3_gv(gv.trim_end_matches('/')).ok_or(ApiError::UnknownPath)?;
        return Ok(json_response(StatusCode::OK, &doc));
    }
    if path.starts_with("/openapi/") {
        return Err(ApiError::UnknownPath);
    }
    let (res, ns, name, sub) = match route(path)? {
        Target::Doc(doc) if method == Method::GET => return Ok(json_response(StatusCode::OK, &doc)),
        Target::Doc(_) => return Err(ApiError::MethodNotAllowed),
        Target::Res { res, ns, name, sub } => (res, ns, name, sub),
    };
    if let Some(ns) = ns.as_deref()
        && shared.faults.is_forbidden(ns)
    {
        return Err(ApiError::forbidden(&user.name, attrs));
    }
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let format = Format::of(accept);
    let is_write = matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    if is_write {
        if res.computed {
            return Err(ApiError::MethodNotAllowed);
        }
        if let Some(code) = shared.faults.take_write_failure(ns.as_deref()) {
            return Err(ApiError::Injected(code));
        }
    }
    if res.review {
        if *method != Method::POST || name.is_some() {
            return Err(ApiError::MethodNotAllowed);
        }
        let obj = parse_object(decoding, headers, &body, Expect::of(res))?;
        let answer = match res.kind {
            "TokenReview" => reviews::token_review(&shared.auth, &shared.store, &obj)?,
            "SelfSubjectReview" => reviews::self_subject_review(user),
            "SelfSubjectAccessReview" => reviews::self_subject_access_review(&shared.store, user, &obj)?,
            "SelfSubjectRulesReview" => reviews::self_subject_rules_review(&shared.store, user, &obj)?,
            "SubjectAccessReview" => reviews::subject_access_review(&shared.store, None, &obj)?,
            "LocalSubjectAccessReview" => reviews::subject_access_review(&shared.store, ns.as_deref(), &obj)?,
            _ => return Err(ApiError::UnknownPath),
        };
        return Ok(json_response(StatusCode::CREATED, &answer));
    }
    if sub.as_deref() == Some("token") {
        let (Some(name), Some(ns)) = (name.as_deref(), ns.as_deref()) else {
            return Err(ApiError::MethodNotAllowed);
        };
        if *method != Method::POST {
            return Err(ApiError::MethodNotAllowed);
        }
        let obj = parse_object(decoding, headers, &body, Expect::TOKEN_REQUEST)?;
        if let Some(node) = user.node_name() {
            reviews::node_may_request_token(&shared.store, node, ns, &obj)?;
        }
        let answer = reviews::token_request(&shared.auth, &shared.store, ns, name, &obj)?;
        return Ok(json_response(StatusCode::CREATED, &answer));
    }
    let dry_run = match q.get("dryRun").map(String::as_str) {
        None | Some("") => false,
        Some("All") => true,
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "Invalid dry run value {other:?}: supported values are [\"All\"]"
            )));
        }
    };
    let store = &shared.store;
    let ns_str = ns.clone().unwrap_or_default();
    match (method.clone(), name, sub.as_deref()) {
        (Method::GET, None, None) => {
            let watch = q.get("watch").is_some_and(|w| w == "1" || w == "true");
            if watch {
                if res.computed {
                    return Err(ApiError::MethodNotAllowed);
                }
                return Ok(watch_response(shared, res, ns, q, format));
            }
            list(shared, res, ns.as_deref(), q, format)
        }
        (Method::GET, Some(name), None | Some("status")) => {
            let obj = if res.computed {
                pod_metrics(shared, Some(&ns_str))
                    .into_iter()
                    .find(|m| name_of(m) == name)
                    .ok_or(ApiError::NotFound { res, name })?
            } else {
                store
                    .get(res, &ns_str, &name)
                    .ok_or(ApiError::NotFound { res, name })?
            };
            match format {
                Format::Table => {
                    let rv = obj
                        .pointer("/metadata/resourceVersion")
                        .map(|v| table_str(v.as_str()))
                        .unwrap_or_default();
                    Ok(json_response(StatusCode::OK, &table::table(res, &[obj], &rv)))
                }
                Format::Meta => Ok(json_response(StatusCode::OK, &partial(&obj))),
                Format::Json => Ok(json_response(StatusCode::OK, &obj)),
            }
        }
        (Method::GET, Some(name), Some("scale")) => {
            let obj = store
                .get(res, &ns_str, &name)
                .ok_or(ApiError::NotFound { res, name })?;
            Ok(json_response(StatusCode::OK, &scale_of(&obj)))
        }
        (Method::GET, Some(name), Some("log")) => {
            let pod = store.get(res, &ns_str, &name).ok_or_else(|| ApiError::NotFound {
                res,
                name: name.clone(),
            })?;
            let container = log_container(&pod, q.get("container").map(String::as_str))?;
            let options = LogOptions::from_query(q).map_err(|e| ApiError::BadRequest(e.to_string()))?;
            let path = shared
                .kubelet
                .log_file(&ns_str, &name, &container, options.previous)
                .map_err(|e| ApiError::BadRequest(e.to_string()))?;
            let file = LogFile::open(path.clone()).map_err(|e| ApiError::Internal(e.to_string()))?;
            // As on a kubelet: a followed log ends with its instance.
            let kubelet = shared.kubelet.clone();
            let writing = move || kubelet.writes_log(&ns_str, &name, &container, &path);
            Ok((
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/plain")],
                Body::from_stream(
                    logs::body(file, &options, writing, shared.root.clone())
                        .map_err(|e| ApiError::Internal(e.to_string()))?,
                ),
            )
                .into_response())
        }
        (Method::POST, None, None) => {
            let ns = if res.namespaced {
                ns.ok_or(ApiError::MethodNotAllowed)?
            } else {
                String::new()
            };
            let obj = parse_object(decoding, headers, &body, Expect::of(res))?;
            let mut obj = prepare_create(res, obj)?;
            if res.kind == "Pod" {
                obj = super::admission::admit_pod(store, &ns, obj);
            }
            let created = store.create_with(res, &ns, obj, dry_run)?;
            Ok(json_response(StatusCode::CREATED, &created))
        }
        (Method::PUT, Some(name), sub) => {
            let expect = if sub == Some("scale") {
                Expect::SCALE
            } else {
                Expect::of(res)
            };
            let mut new = parse_object(decoding, headers, &body, expect)?;
            fold_string_data(res, &mut new);
            let updated = match sub {
                Some("scale") => {
                    let replicas = new.pointer("/spec/replicas").cloned().unwrap_or(json!(0));
                    let rv = new.pointer("/metadata/resourceVersion").cloned();
                    let o = store.update_with(res, &ns_str, &name, dry_run, |cur| {
                        if let Some(rv) = rv {
                            cur["metadata"]["resourceVersion"] = rv;
                        }
                        cur["spec"]["replicas"] = replicas;
                        Ok(())
                    })?;
                    scale_of(&o)
                }
                _ => store.update_with(res, &ns_str, &name, dry_run, |cur| {
                    *cur = merge_status(res, sub, cur, new);
                    Ok(())
                })?,
            };
            Ok(json_response(StatusCode::OK, &updated))
        }
        (Method::PATCH, Some(name), sub) => {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let kind = PatchKind::from_content_type(ct)?;
            let updated = if sub == Some("scale") {
                let o = store.update_with(res, &ns_str, &name, dry_run, |cur| {
                    let mut scale = scale_of(cur);
                    patch::apply(&mut scale, kind, &body)?;
                    cur["spec"]["replicas"] = scale.pointer("/spec/replicas").cloned().unwrap_or(json!(0));
                    if let Some(rv) = scale.pointer("/metadata/resourceVersion") {
                        cur["metadata"]["resourceVersion"] = rv.clone();
                    }
                    Ok(())
                })?;
                scale_of(&o)
            } else {
                store.update_with(res, &ns_str, &name, dry_run, |cur| {
                    let mut doc = cur.clone();
                    patch::apply(&mut doc, kind, &body)?;
                    strict_patch(decoding, res, cur, &mut doc)?;
                    fold_string_data(res, &mut doc);
                    *cur = merge_status(res, sub, cur, doc);
                    Ok(())
                })?
            };
            Ok(json_response(StatusCode::OK, &updated))
        }
        (Method::DELETE, Some(name), None) => {
            let opts = delete_options(headers, &body, q)?;
            let obj = store.get(res, &ns_str, &name).ok_or_else(|| ApiError::NotFound {
                res,
                name: name.clone(),
            })?;
            check_preconditions(res, &obj, &opts)?;
            if dry_run || opts.dry_run {
                return Ok(json_response(StatusCode::OK, &obj));
            }
            let out = delete_one(shared, res, &ns_str, &name, &opts)?;
            Ok(json_response(StatusCode::OK, &out))
        }
        (Method::DELETE, None, None) => {
            let opts = delete_options(headers, &body, q)?;
            let (items, rv) = store.list(res, ns.as_deref());
            let items = filter(res, items, q)?;
            if dry_run || opts.dry_run {
                return Ok(json_response(StatusCode::OK, &list_doc(res, items, rv, None)));
            }
            let mut deleted = Vec::new();
            for item in &items {
                if let Ok(o) = delete_one(shared, res, namespace_of(item), name_of(item), &opts) {
                    deleted.push(o);
                }
            }
            Ok(json_response(StatusCode::OK, &list_doc(res, deleted, rv, None)))
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

/// Drops the members a patch added that the kind has no field for; under
/// `fieldValidation=Strict` refuses the patch instead (`422`, as
/// kube-apiserver's patcher).
fn strict_patch(
    decoding: &Decoding,
    res: &'static ResourceDef,
    cur: &Value,
    doc: &mut Value,
) -> Result<(), ApiError> {
    let (api_version, kind) = (res.api_version(), res.kind);
    if !protobuf::has_unknown(doc, &api_version, kind) {
        return Ok(());
    }
    let Some(unknown) = protobuf::drop_unknown(&mut doc.clone(), &api_version, kind) else {
        return Ok(());
    };
    // Members the stored object already had are not the patch's doing.
    let before = protobuf::drop_unknown(&mut cur.clone(), &api_version, kind).unwrap_or_default();
    let added: Vec<String> = unknown
        .into_iter()
        .filter(|p| !before.contains(p))
        .map(|p| protobuf::Issue::Unknown(p).to_string())
        .collect();
    if added.is_empty() {
        return Ok(());
    }
    let patched = doc.to_string();
    protobuf::drop_unknown(doc, &api_version, kind);
    match decoding.validation {
        FieldValidation::Strict => Err(ApiError::Invalid(format!(
            " \"\" is invalid: patch: Invalid value: {patched:?}: {}",
            strict_decoding_error(&added)
        ))),
        FieldValidation::Warn => {
            decoding.warn(added);
            Ok(())
        }
        FieldValidation::Ignore => Ok(()),
    }
}

/// The container whose log is asked for: the one named, or the only one.
fn log_container(pod: &Value, asked: Option<&str>) -> Result<String, ApiError> {
    let names: Vec<&str> = ["/spec/initContainers", "/spec/containers"]
        .iter()
        .filter_map(|p| pod.pointer(p).and_then(Value::as_array))
        .flatten()
        .filter_map(|c| c.get("name").and_then(Value::as_str))
        .collect();
    let regular: Vec<&str> = pod
        .pointer("/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("name").and_then(Value::as_str))
        .collect();
    match asked.filter(|a| !a.is_empty()) {
        Some(c) if names.contains(&c) => Ok(c.to_owned()),
        Some(c) => Err(ApiError::BadRequest(format!(
            "container {c} is not valid for pod {}",
            name_of(pod)
        ))),
        None if regular.len() == 1 => Ok(regular[0].to_owned()),
        None => Err(ApiError::BadRequest(format!(
            "a container name must be specified for pod {}, choose one of: [{}]",
            name_of(pod),
            regular.join(" ")
        ))),
    }
}

fn table_str(s: Option<&str>) -> String {
    s.unwrap_or("").to_owned()
}

/// `?fieldValidation=`: what a write does with members of its body that the
/// kind has no field for (they are never stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FieldValidation {
    /// Drop them silently.
    Ignore,
    /// Drop them with a `Warning` header each (the default).
    Warn,
    /// Refuse the request (`400`, or `422` for a patch).
    Strict,
}

impl FieldValidation {
    fn from_query(method: &Method, q: &HashMap<String, String>) -> Result<Self, ApiError> {
        match q.get("fieldValidation").map(String::as_str) {
            None | Some("" | "Warn") => Ok(Self::Warn),
            Some("Ignore") => Ok(Self::Ignore),
            Some("Strict") => Ok(Self::Strict),
            Some(other) => {
                let options = match *method {
                    Method::PUT => "UpdateOptions",
                    Method::PATCH => "PatchOptions",
                    _ => "CreateOptions",
                };
                Err(ApiError::Invalid(format!(
                    "{options}.meta.k8s.io \"\" is invalid: fieldValidation: Unsupported value: {other:?}: supported values: \"\", \"Ignore\", \"Strict\", \"Warn\""
                )))
            }
        }
    }
}

/// How one request's bodies are decoded, and the warnings they leave.
struct Decoding {
    validation: FieldValidation,
    warnings: Mutex<Vec<String>>,
}

impl Decoding {
    fn new(validation: FieldValidation) -> Self {
        Self {
            validation,
            warnings: Mutex::new(Vec::new()),
        }
    }

    fn warn(&self, texts: Vec<String>) {
        self.warnings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(texts);
    }

    fn take_warnings(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .warnings
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// `strict decoding error: unknown field "a", duplicate field "b"`.
fn strict_decoding_error(issues: &[String]) -> String {
    format!("strict decoding error: {}", issues.join(", "))
}

/// The `Warning` header value of one warning (RFC 7234 `299 - "text"`).
fn warning_header(text: &str) -> Option<axum::http::HeaderValue> {
    let quoted = text.replace('\\', "\\\\").replace('"', "\\\"");
    axum::http::HeaderValue::from_str(&format!("299 - \"{quoted}\"")).ok()
}

/// The media types a request body may have (a `415` lists them).
const BODY_MEDIA_TYPES: &str = "application/json, application/yaml, application/vnd.kubernetes.protobuf";

/// The kind a request body must hold: the resource's, or its subresource's.
#[derive(Debug, Clone, Copy)]
struct Expect<'a> {
    group: &'a str,
    version: &'a str,
    kind: &'a str,
}

impl Expect<'static> {
    const TOKEN_REQUEST: Self = Self {
        group: "authentication.k8s.io",
        version: "v1",
        kind: "TokenRequest",
    };
    const SCALE: Self = Self {
        group: "autoscaling",
        version: "v1",
        kind: "Scale",
    };
    /// Whatever kind the body names (NodeRestriction reads bodies before routing).
    const ANY: Self = Self {
        group: "",
        version: "",
        kind: "",
    };
    const DELETE_OPTIONS: Self = Self {
        group: "meta.k8s.io",
        version: "v1",
        kind: "DeleteOptions",
    };

    fn of(res: &'static ResourceDef) -> Self {
        Self {
            group: res.group,
            version: res.version,
            kind: res.kind,
        }
    }
}

impl Expect<'_> {
    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The package of the internal type a real API server converts to
    /// (`core.Secret`, `apps.Deployment`, `rbac.Role`).
    fn internal_package(&self) -> &str {
        match self.group {
            "" => "core",
            g => g.split('.').next().unwrap_or(g),
        }
    }

    /// kube-apiserver's `400` for a body it decoded as `kind` of `api_version`
    /// but cannot use as this kind.
    fn cannot_handle(&self, api_version: &str, kind: &str, why: &str) -> ApiError {
        let version = api_version.rsplit('/').next().unwrap_or(api_version);
        ApiError::BadRequest(format!(
            "{kind} in version {version:?} cannot be handled as a {}: {why}",
            self.kind
        ))
    }

    /// kube-apiserver's `400` for a body it could not even type.
    fn unrecognized(&self, body: &[u8], why: &str) -> ApiError {
        ApiError::BadRequest(format!(
            "the object provided is unrecognized (must be of type {}): {why} ({})",
            self.kind,
            summarize(body)
        ))
    }

    /// Refuses a body whose `apiVersion`/`kind` is not this kind.
    fn check(&self, obj: &Value) -> Result<(), ApiError> {
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind.is_empty() || self.kind.is_empty() {
            return Ok(());
        }
        let api_version = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let want = self.api_version();
        if kind == self.kind && (api_version == want || api_version.is_empty()) {
            return Ok(());
        }
        let version = api_version.rsplit('/').next().unwrap_or(api_version);
        let registered = resources::RESOURCES
            .iter()
            .any(|r| r.kind == kind && r.api_version() == api_version)
            || protobuf::has_kind(api_version, kind);
        let why = if registered {
            format!(
                "converting ({version}.{kind}) to ({}.{}): unknown conversion",
                self.internal_package(),
                self.kind
            )
        } else {
            format!(
                "no kind {kind:?} is registered for version {api_version:?} in scheme \"pkg/runtime/scheme.go:111\""
            )
        };
        Err(self.cannot_handle(api_version, kind, &why))
    }
}

/// The start of a body as kube-apiserver quotes it in a `400`: text when it
/// looks like JSON, else hex; 30 bytes at most.
fn summarize(body: &[u8]) -> String {
    const MAX: usize = 30;
    let head = &body[..body.len().min(MAX)];
    let more = if body.len() > MAX { " ..." } else { "" };
    match body.first() {
        None => "<empty>".to_owned(),
        Some(b'{') => format!("{}{more}", String::from_utf8_lossy(head)),
        Some(_) => {
            let hex: String = head.iter().map(|b| format!("{b:02x}")).collect();
            format!("{hex}{more}")
        }
    }
}

/// The media type of a request body, without parameters.
fn body_media_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// The object in a request body, of kind `expect`: JSON, YAML, or Kubernetes'
/// protobuf encoding (client-go's typed clients, such as kubectl's `create`
/// and `auth can-i`). Other media types answer `415`.
fn parse_object(
    decoding: &Decoding,
    headers: &HeaderMap,
    body: &[u8],
    expect: Expect<'_>,
) -> Result<Value, ApiError> {
    let media_type = body_media_type(headers);
    let (mut v, mut issues): (Value, Vec<protobuf::Issue>) = match media_type.as_str() {
        "" | "application/json" => protobuf::decode_json(body, &expect.api_version(), expect.kind)
            .map_err(|e| ApiError::BadRequest(format!("the object could not be decoded as JSON: {e}")))?,
        "application/yaml" => (
            serde_yaml_ng::from_slice(body)
                .map_err(|e| ApiError::BadRequest(format!("the object could not be decoded as YAML: {e}")))?,
            Vec::new(),
        ),
        protobuf::MEDIA_TYPE => (
            protobuf::decode(body, (&expect.api_version(), expect.kind)).map_err(|e| {
                match e.type_meta() {
                    Some((api_version, kind)) => expect.cannot_handle(api_version, kind, &e.to_string()),
                    None => expect.unrecognized(body, &e.to_string()),
                }
            })?,
            Vec::new(),
        ),
        _ => return Err(ApiError::UnsupportedMediaType(BODY_MEDIA_TYPES)),
    };
    if !v.is_object() {
        return Err(ApiError::BadRequest("the body must be a JSON object".into()));
    }
    expect.check(&v)?;
    if protobuf::has_malformed_quantity(&v, &expect.api_version(), expect.kind) {
        let api_version = v
            .get("apiVersion")
            .and_then(Value::as_str)
            .map_or_else(|| expect.api_version(), str::to_owned);
        return Err(expect.cannot_handle(&api_version, expect.kind, protobuf::QUANTITY_FORMAT_ERROR));
    }
    if media_type == "application/yaml"
        && let Some(unknown) = protobuf::drop_unknown(&mut v, &expect.api_version(), expect.kind)
    {
        issues.extend(unknown.into_iter().map(protobuf::Issue::Unknown));
    }
    if !issues.is_empty() {
        let texts: Vec<String> = issues.iter().map(ToString::to_string).collect();
        match decoding.validation {
            FieldValidation::Strict => {
                let api_version = v
                    .get("apiVersion")
                    .and_then(Value::as_str)
                    .map_or_else(|| expect.api_version(), str::to_owned);
                return Err(expect.cannot_handle(&api_version, expect.kind, &strict_decoding_error(&texts)));
            }
            FieldValidation::Warn => decoding.warn(texts),
            FieldValidation::Ignore => {}
        }
    }
    Ok(v)
}

/// Validation and conversions a real API server applies on create.
fn prepare_create(res: &'static ResourceDef, mut obj: Value) -> Result<Value, ApiError> {
    Expect::of(res).check(&obj)?;
    match res.kind {
        "Pod" => {
            let has_containers = obj
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .is_some_and(|c| !c.is_empty());
            if !has_containers {
                return Err(ApiError::Invalid(format!(
                    "Pod \"{}\" is invalid: spec.containers: Required value",
                    name_of(&obj)
                )));
            }
        }
        "Deployment" | "ReplicaSet" => {
            let sel = obj.pointer("/spec/selector").cloned().unwrap_or(Value::Null);
            let selector = LabelSelector::from_object(&sel).map_err(ApiError::Invalid)?;
            if selector.0.is_empty() {
                return Err(ApiError::Invalid(format!(
                    "{} \"{}\" is invalid: spec.selector: Required value",
                    res.kind,
                    name_of(&obj)
                )));
            }
            let labels = super::selector::labels_of(
                &json!({"metadata": obj.pointer("/spec/template/metadata").cloned().unwrap_or(Value::Null)}),
            );
            if !selector.matches(&labels) {
                return Err(ApiError::Invalid(format!(
                    "{} \"{}\" is invalid: spec.template.metadata.labels: Invalid value: `selector` does not match template `labels`",
                    res.kind,
                    name_of(&obj)
                )));
            }
        }
        "Secret" => fold_string_data(res, &mut obj),
        _ => {}
    }
    Ok(obj)
}

/// A Secret's `stringData` written into `data` (it wins over `data` for its
/// keys) and removed, as the API server does on every write: create,
/// update and patch.
fn fold_string_data(res: &ResourceDef, obj: &mut Value) {
    if res.kind != "Secret" {
        return;
    }
    if let Some(Value::Object(sd)) = obj.as_object_mut().and_then(|m| m.remove("stringData")) {
        for (k, v) in sd {
            let enc = base64::engine::general_purpose::STANDARD.encode(v.as_str().unwrap_or(""));
            obj["data"][k] = json!(enc);
        }
    }
}

/// Main-resource writes keep the stored status; `/status` writes change only the status.
fn merge_status(res: &ResourceDef, sub: Option<&str>, cur: &Value, mut new: Value) -> Value {
    if !res.subresources.contains(&"status") {
        return new;
    }
    if sub == Some("status") {
        let mut out = cur.clone();
        out["status"] = new.get("status").cloned().unwrap_or(Value::Null);
        if let Some(rv) = new.pointer("/metadata/resourceVersion") {
            out["metadata"]["resourceVersion"] = rv.clone();
        }
        return out;
    }
    match cur.get("status") {
        Some(s) => new["status"] = s.clone(),
        None => {
            if let Some(m) = new.as_object_mut() {
                m.remove("status");
            }
        }
    }
    new
}

fn selector_string(sel: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(m) = sel.get("matchLabels").and_then(Value::as_object) {
        for (k, v) in m {
            parts.push(format!("{k}={}", v.as_str().unwrap_or("")));
        }
    }
    if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
        for e in exprs {
            let key = e["key"].as_str().unwrap_or("");
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            parts.push(match e["operator"].as_str().unwrap_or("") {
                "In" => format!("{key} in ({})", values.join(",")),
                "NotIn" => format!("{key} notin ({})", values.join(",")),
                "Exists" => key.to_owned(),
                _ => format!("!{key}"),
            });
        }
    }
    parts.join(",")
}

fn scale_of(obj: &Value) -> Value {
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": obj["metadata"]["name"],
            "namespace": obj["metadata"]["namespace"],
            "uid": obj["metadata"]["uid"],
            "resourceVersion": obj["metadata"]["resourceVersion"],
            "creationTimestamp": obj["metadata"]["creationTimestamp"],
        },
        "spec": {"replicas": obj.pointer("/spec/replicas").cloned().unwrap_or(json!(0))},
        "status": {
            "replicas": obj.pointer("/status/replicas").cloned().unwrap_or(json!(0)),
            "selector": selector_string(obj.pointer("/spec/selector").unwrap_or(&Value::Null)),
        },
    })
}

/// Parsed `DeleteOptions` (body or query).
/// What happens to an object's dependents when it is deleted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Propagation {
    /// The object goes; the garbage collector removes its dependents.
    #[default]
    Background,
    /// The object stays (`foregroundDeletion`) until its dependents are gone.
    Foreground,
    /// The dependents stay, released (`orphan`).
    Orphan,
}

impl Propagation {
    fn parse(s: &str) -> Result<Self, ApiError> {
        match s {
            "Background" => Ok(Self::Background),
            "Foreground" => Ok(Self::Foreground),
            "Orphan" => Ok(Self::Orphan),
            other => Err(ApiError::BadRequest(format!(
                "DeleteOptions.meta.k8s.io \"\" is invalid: propagationPolicy: Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
            ))),
        }
    }
}

#[derive(Debug, Default)]
struct DeleteOpts {
    grace: Option<i64>,
    /// `dryRun: ["All"]` in the body.
    dry_run: bool,
    /// `propagationPolicy` (or `orphanDependents`).
    policy: Propagation,
    uid: Option<String>,
    rv: Option<String>,
}

fn delete_options(
    headers: &HeaderMap,
    body: &[u8],
    q: &HashMap<String, String>,
) -> Result<DeleteOpts, ApiError> {
    let mut o = DeleteOpts::default();
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = if body_media_type(headers) == protobuf::MEDIA_TYPE {
            let e = Expect::DELETE_OPTIONS;
            protobuf::decode(body, (&e.api_version(), e.kind)).map_err(|err| match err.type_meta() {
                Some((api_version, kind)) => e.cannot_handle(api_version, kind, &err.to_string()),
                None => e.unrecognized(body, &err.to_string()),
            })?
        } else {
            serde_json::from_slice(body)
                .map_err(|e| ApiError::BadRequest(format!("the DeleteOptions could not be decoded: {e}")))?
        };
        o.grace = v.get("gracePeriodSeconds").and_then(Value::as_i64);
        o.dry_run = v
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| d.iter().any(|x| x == "All"));
        if let Some(p) = v.get("propagationPolicy").and_then(Value::as_str) {
            o.policy = Propagation::parse(p)?;
        } else if v.get("orphanDependents").and_then(Value::as_bool) == Some(true) {
            o.policy = Propagation::Orphan;
        }
        o.uid = v
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_owned);
        o.rv = v
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_owned);
    }
    if let Some(g) = q.get("gracePeriodSeconds") {
        o.grace = Some(
            g.parse()
                .map_err(|_| ApiError::BadRequest(format!("gracePeriodSeconds {g:?} is not a number")))?,
        );
    }
    if let Some(p) = q.get("propagationPolicy") {
        o.policy = Propagation::parse(p)?;
    } else if q.get("orphanDependents").map(String::as_str) == Some("true") {
        o.policy = Propagation::Orphan;
    }
    Ok(o)
}

fn check_preconditions(res: &'static ResourceDef, obj: &Value, opts: &DeleteOpts) -> Result<(), ApiError> {
    let uid_ok = opts.uid.as_deref().is_none_or(|u| u == uid_of(obj));
    let rv_ok = opts
        .rv
        .as_deref()
        .is_none_or(|rv| Some(rv) == obj.pointer("/metadata/resourceVersion").and_then(Value::as_str));
    if uid_ok && rv_ok {
        Ok(())
    } else {
        Err(ApiError::Conflict {
            res,
            name: name_of(obj).to_owned(),
        })
    }
}

fn delete_one(
    shared: &Shared,
    res: &'static ResourceDef,
    ns: &str,
    name: &str,
    opts: &DeleteOpts,
) -> Result<Value, ApiError> {
    let store = &shared.store;
    match res.kind {
        "Pod" => delete_pod(store, ns, name, opts.grace),
        "Namespace" => {
            if matches!(name, "default" | "kube-system" | "kube-public") {
                return Err(ApiError::Forbidden {
                    group_resource: "namespaces".into(),
                    name: name.to_owned(),
                    group: String::new(),
                    resource: "namespaces".into(),
                    message: "this namespace may not be deleted".into(),
                });
            }
            // The namespace controller removes the content, then the namespace.
            store.delete_with_finalizer(res, "", name, None, None)
        }
        _ => {
            // The garbage collector honours `foregroundDeletion` and `orphan`.
            let finalizer = match opts.policy {
                Propagation::Background => None,
                Propagation::Foreground => Some(FOREGROUND_DELETION),
                Propagation::Orphan => Some(ORPHAN),
            };
            store.delete_with_finalizer(res, ns, name, None, finalizer)
        }
    }
}

fn filter(res: &ResourceDef, items: Vec<Value>, q: &HashMap<String, String>) -> Result<Vec<Value>, ApiError> {
    let labels = LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str))
        .map_err(ApiError::BadRequest)?;
    let fields = FieldSelector::parse_for(res.kind, q.get("fieldSelector").map_or("", String::as_str))
        .map_err(ApiError::BadRequest)?;
    Ok(items
        .into_iter()
        .filter(|o| labels.matches_object(o) && fields.matches(o))
        .collect())
}

fn list_doc(res: &ResourceDef, items: Vec<Value>, rv: u64, cont: Option<String>) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let Some(c) = cont {
        meta["continue"] = json!(c);
    }
    json!({"kind": format!("{}List", res.kind), "apiVersion": res.api_version(), "metadata": meta, "items": items})
}

fn list(
    shared: &Shared,
    res: &'static ResourceDef,
    ns: Option<&str>,
    q: &HashMap<String, String>,
    format: Format,
) -> Result<Response, ApiError> {
    let requested_rv = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    let version_match = q.get("resourceVersionMatch").map(String::as_str).unwrap_or("");
    let continue_token = q.get("continue").filter(|c| !c.is_empty());
    match version_match {
        "" => {}
        _ if requested_rv.is_empty() => {
            return Err(ApiError::BadRequest(
                "resourceVersionMatch is forbidden unless resourceVersion is provided".into(),
            ));
        }
        _ if continue_token.is_some() => {
            return Err(ApiError::BadRequest(
                "resourceVersionMatch is forbidden when continue is provided".into(),
            ));
        }
        "Exact" if requested_rv == "0" => {
            return Err(ApiError::BadRequest(
                "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"".into(),
            ));
        }
        "Exact" | "NotOlderThan" => {}
        other => {
            return Err(ApiError::BadRequest(format!(
                "resourceVersionMatch: Unsupported value: {other:?}: supported values: \"Exact\", \"NotOlderThan\""
            )));
        }
    }
    let parse_rv = |v: &str| {
        v.parse::<u64>().map_err(|_| {
            ApiError::BadRequest(format!("resourceVersion: Invalid value: {v:?}: must be a number"))
        })
    };
    // A continue token carries the resourceVersion of the first page, so
    // every page is the same snapshot and a watch from it misses nothing.
    let decoded = match continue_token {
        None => None,
        Some(token) => Some(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(token)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .and_then(|t| {
                    let (first_rv, after) = t.split_once('|')?;
                    Some((first_rv.parse::<u64>().ok()?, after.to_owned()))
                })
                .ok_or_else(|| ApiError::BadRequest("continue key is not valid".into()))?,
        ),
    };
    let (items, rv) = if res.computed {
        (pod_metrics(shared, ns), shared.store.current_rv())
    } else if let Some((first_rv, _)) = &decoded {
        let items = shared.store.list_at(res, ns, *first_rv).map_err(|e| match e {
            ApiError::ListTooOld => ApiError::ContinueTooOld,
            other => other,
        })?;
        (items, *first_rv)
    } else if version_match == "Exact" {
        let at = parse_rv(requested_rv)?;
        (shared.store.list_at(res, ns, at)?, at)
    } else {
        if !requested_rv.is_empty() {
            parse_rv(requested_rv)?;
        }
        shared.store.list(res, ns)
    };
    let mut items = filter(res, items, q)?;
    if let Some(decoded) = decoded {
        items.retain(|o| format!("{}/{}", namespace_of(o), name_of(o)) > decoded.1);
    }
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(0);
    let cont = if limit > 0 && items.len() > limit {
        items.truncate(limit);
        items.last().map(|o| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!(
                "{rv}|{}/{}",
                namespace_of(o),
                name_of(o)
            ))
        })
    } else {
        None
    };
    match format {
        Format::Table => {
            let mut t = table::table(res, &items, &rv.to_string());
            if let Some(c) = cont {
                t["metadata"]["continue"] = json!(c);
            }
            Ok(json_response(StatusCode::OK, &t))
        }
        Format::Meta => {
            let mut l = list_doc(res, items.iter().map(partial).collect(), rv, cont);
            l["kind"] = json!("PartialObjectMetadataList");
            l["apiVersion"] = json!("meta.k8s.io/v1");
            Ok(json_response(StatusCode::OK, &l))
        }
        Format::Json => Ok(json_response(StatusCode::OK, &list_doc(res, items, rv, cont))),
    }
}

/// `PodMetrics` of the running pods of a namespace (all namespaces when `scope` is `None`).
fn pod_metrics(shared: &Shared, ns: Option<&str>) -> Vec<Value> {
    let (pods, _) = shared.store.list(by_kind("Pod"), ns);
    pods.iter()
        .filter_map(|p| {
            let u = shared.kubelet.usage(namespace_of(p), name_of(p))?;
            Some(json!({
                "kind": "PodMetrics",
                "apiVersion": "metrics.k8s.io/v1beta1",
                "metadata": {
                    "name": name_of(p),
                    "namespace": namespace_of(p),
                    "labels": p.pointer("/metadata/labels").cloned().unwrap_or(json!({})),
                    "creationTimestamp": super::store::now_rfc3339(),
                },
                "timestamp": u.timestamp,
                "window": format!("{}ms", u.window.as_millis()),
                "containers": u.containers.iter().map(|c| json!({"name": c.name, "usage": {
                    "cpu": format!("{}m", c.cpu_millis),
                    "memory": format!("{}Ki", c.memory_bytes / 1024),
                }})).collect::<Vec<_>>(),
            }))
        })
        .collect()
}

struct WatchState {
    shared: Arc<Shared>,
    res: &'static ResourceDef,
    ns: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
    last_rv: u64,
    pending: std::collections::VecDeque<Bytes>,
    rx: tokio::sync::watch::Receiver<u64>,
    deadline: tokio::time::Instant,
    bookmarks: bool,
    next_bookmark: tokio::time::Instant,
    stop: CancellationToken,
    format: Format,
    done: bool,
}

impl WatchState {
    fn line(&self, kind: &str, obj: &Value) -> Bytes {
        /// A watch event as written: the object serialized where it is,
        /// not cloned into a new `Value` per watcher.
        #[derive(serde::Serialize)]
        struct Line<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            object: &'a Value,
        }
        let converted;
        let object = if kind == "ERROR" || kind == "BOOKMARK" {
            obj
        } else if self.format == Format::Meta {
            converted = partial(obj);
            &converted
        } else if self.format == Format::Table {
            converted = table::table(
                self.res,
                std::slice::from_ref(obj),
                obj.pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            );
            &converted
        } else {
            obj
        };
        let mut line = serde_json::to_vec(&Line { kind, object }).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }

    fn matches(&self, obj: &Value) -> bool {
        self.labels.matches_object(obj) && self.fields.matches(obj)
    }

    fn bookmark(&self) -> Bytes {
        self.line(
            "BOOKMARK",
            &json!({"kind": self.res.kind, "apiVersion": self.res.api_version(),
                    "metadata": {"resourceVersion": self.last_rv.to_string()}}),
        )
    }

    /// Queues the events after `last_rv`; returns false when the history is gone.
    fn drain(&mut self) -> bool {
        let current = *self.rx.borrow_and_update();
        match self.shared.store.events_since(self.last_rv) {
            Ok(events) => {
                for e in events {
                    self.last_rv = e.rv;
                    if e.res != self.res || self.ns.as_ref().is_some_and(|ns| *ns != e.namespace) {
                        continue;
                    }
                    let now = self.matches(&e.object);
                    let before = e.old.as_ref().is_some_and(|o| self.matches(o));
                    let kind = match (e.kind, before, now) {
                        (EventType::Added, _, true) => "ADDED",
                        (EventType::Deleted, _, true) => "DELETED",
                        (EventType::Modified, true, true) => "MODIFIED",
                        (EventType::Modified, false, true) => "ADDED",
                        (EventType::Modified, true, false) => "DELETED",
                        _ => continue,
                    };
                    let line = self.line(kind, &e.object);
                    self.pending.push_back(line);
                }
                self.last_rv = self.last_rv.max(current.min(self.shared.store.current_rv()));
                true
            }
            Err(e) => {
                let line = self.line("ERROR", &e.status());
                self.pending.push_back(line);
                false
            }
        }
    }
}

fn watch_response(
    shared: &Arc<Shared>,
    res: &'static ResourceDef,
    ns: Option<String>,
    q: &HashMap<String, String>,
    format: Format,
) -> Response {
    let labels = match LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str)) {
        Ok(l) => l,
        Err(e) => return ApiError::BadRequest(e).into_response(),
    };
    let fields = match FieldSelector::parse_for(res.kind, q.get("fieldSelector").map_or("", String::as_str)) {
        Ok(f) => f,
        Err(e) => return ApiError::BadRequest(e).into_response(),
    };
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(shared.max_watch_timeout, |t| {
            Duration::from_secs(t).min(shared.max_watch_timeout)
        });
    let now = tokio::time::Instant::now();
    let mut state = WatchState {
        shared: shared.clone(),
        res,
        ns: ns.clone(),
        labels,
        fields,
        last_rv: 0,
        pending: std::collections::VecDeque::new(),
        rx: shared.store.subscribe(),
        deadline: now + timeout,
        bookmarks: q
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true" || b == "1"),
        next_bookmark: now + shared.bookmark_interval,
        stop: shared.watch_token(),
        format,
        done: false,
    };
    let rv = q.get("resourceVersion").map_or("", String::as_str);
    let send_initial = q.get("sendInitialEvents").is_some_and(|s| s == "true");
    if rv.is_empty() || rv == "0" || send_initial {
        let (items, snapshot_rv) = shared.store.list(res, ns.as_deref());
        state.rx.borrow_and_update();
        let lines: Vec<Bytes> = items
            .iter()
            .filter(|o| state.matches(o))
            .map(|item| state.line("ADDED", item))
            .collect();
        state.pending.extend(lines);
        state.last_rv = snapshot_rv;
        if send_initial {
            let line = state.line(
                "BOOKMARK",
                &json!({"kind": res.kind, "apiVersion": res.api_version(), "metadata": {
                    "resourceVersion": snapshot_rv.to_string(),
                    "annotations": {"k8s.io/initial-events-end": "true"}}}),
            );
            state.pending.push_back(line);
        }
    } else {
        match rv.parse::<u64>() {
            Ok(n) => {
                state.last_rv = n;
                if !state.drain() {
                    state.done = true;
                }
            }
            Err(_) => {
                return ApiError::BadRequest(format!("resourceVersion {rv:?} is not valid")).into_response();
            }
        }
    }
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(line) = st.pending.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(line), st));
            }
            if st.done {
                return None;
            }
            tokio::select! {
                changed = st.rx.changed() => {
                    if changed.is_err() || !st.drain() {
                        st.done = true;
                    }
                }
                () = tokio::time::sleep_until(st.next_bookmark), if st.bookmarks => {
                    if st.drain() {
                        let b = st.bookmark();
                        st.pending.push_back(b);
                    } else {
                        st.done = true;
                    }
                    st.next_bookmark = tokio::time::Instant::now() + st.shared.bookmark_interval;
                }
                () = tokio::time::sleep_until(st.deadline) => return None,
                () = st.stop.cancelled() => return None,
            }
        }
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}
