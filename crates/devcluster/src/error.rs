//! Errors of the simulated API server and their one mapping to a Kubernetes
//! `Status` response (reason and code as a real API server sends them).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::resources::ResourceDef;

/// A failed API request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{} \"{name}\" not found", res.group_resource())]
    NotFound { res: &'static ResourceDef, name: String },
    #[error("namespaces \"{0}\" not found")]
    NamespaceNotFound(String),
    #[error("{} \"{name}\" already exists", res.group_resource())]
    AlreadyExists { res: &'static ResourceDef, name: String },
    #[error(
        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
        res.group_resource()
    )]
    Conflict { res: &'static ResourceDef, name: String },
    #[error("Operation cannot be fulfilled on {group_resource} \"{name}\": {cause}")]
    ConflictWith {
        group_resource: String,
        name: String,
        cause: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("Unauthorized")]
    Unauthorized,
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("the server could not find the requested resource")]
    UnknownPath,
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    #[error("the body of the request was in an unknown format - accepted media types include: {0}")]
    UnsupportedMediaType(&'static str),
    #[error("injected failure")]
    Injected(StatusCode),
    #[error("too old resource version: {requested} ({oldest})")]
    Gone { requested: u64, oldest: u64 },
    #[error("The resourceVersion for the provided list is too old.")]
    ListTooOld,
    #[error(
        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list."
    )]
    ContinueTooOld,
    /// Fields that may not be stored as they are (`422` with `details.causes`).
    #[error("{}", super::validation::invalid_message(res, name, errors))]
    InvalidFields {
        /// The kind.
        res: &'static ResourceDef,
        /// The object's name.
        name: String,
        /// What is wrong, field by field.
        errors: Vec<super::validation::FieldError>,
    },
    /// A create in a namespace being deleted (`NamespaceLifecycle` admission).
    #[error("{}", forbidden_text(&res.group_resource(), name, &format!("unable to create new content in namespace {namespace} because it is being terminated")))]
    Terminating {
        /// The kind being created.
        res: &'static ResourceDef,
        /// Its name (empty for `generateName`).
        name: String,
        /// The namespace being deleted.
        namespace: String,
    },
    /// A request the authorizer (or an admission rule) refused. `message`
    /// is the part after `is forbidden: `.
    #[error("{}", forbidden_text(group_resource, name, message))]
    Forbidden {
        /// `pods`, `deployments.apps`; empty for a non-resource path.
        group_resource: String,
        /// The object's name, when the request named one.
        name: String,
        /// API group (for `details.group`).
        group: String,
        /// Plural resource (for `details.kind`).
        resource: String,
        /// Why.
        message: String,
    },
}

impl ApiError {
    /// HTTP status and `Status.reason`.
    #[must_use]
    pub fn code_reason(&self) -> (StatusCode, &'static str) {
        match self {
            Self::NotFound { .. } | Self::NamespaceNotFound(_) | Self::UnknownPath => {
                (StatusCode::NOT_FOUND, "NotFound")
            }
            Self::AlreadyExists { .. } => (StatusCode::CONFLICT, "AlreadyExists"),
            Self::Conflict { .. } | Self::ConflictWith { .. } => (StatusCode::CONFLICT, "Conflict"),
            Self::Unauthorized => (StatusCode::UNAUTHORIZED, "Unauthorized"),
            Self::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
            Self::Invalid(_) | Self::InvalidFields { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "Invalid"),
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "BadRequest"),
            Self::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed"),
            Self::UnsupportedMediaType(_) => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType"),
            Self::Gone { .. } | Self::ListTooOld | Self::ContinueTooOld => (StatusCode::GONE, "Expired"),
            Self::Terminating { .. } | Self::Forbidden { .. } => (StatusCode::FORBIDDEN, "Forbidden"),
            Self::Injected(code) => (*code, reason_for(*code)),
        }
    }

    /// The `Status` object a real API server sends for this error.
    #[must_use]
    pub fn status(&self) -> Value {
        let (code, reason) = self.code_reason();
        let mut details = serde_json::Map::new();
        match self {
            Self::NotFound { res, name }
            | Self::AlreadyExists { res, name }
            | Self::Conflict { res, name } => {
                details.insert("name".into(), json!(name));
                if !res.group.is_empty() {
                    details.insert("group".into(), json!(res.group));
                }
                details.insert("kind".into(), json!(res.plural));
            }
            Self::Forbidden {
                name,
                group,
                resource,
                ..
            } => {
                if !name.is_empty() {
                    details.insert("name".into(), json!(name));
                }
                if !group.is_empty() {
                    details.insert("group".into(), json!(group));
                }
                if !resource.is_empty() {
                    details.insert("kind".into(), json!(resource));
                }
            }
            Self::InvalidFields { res, name, errors } => {
                details.insert("name".into(), json!(name));
                if !res.group.is_empty() {
                    details.insert("group".into(), json!(res.group));
                }
                details.insert("kind".into(), json!(res.kind));
                let causes: Vec<Value> = errors
                    .iter()
                    .map(|e| json!({"reason": e.reason, "message": e.message, "field": e.field}))
                    .collect();
                details.insert("causes".into(), json!(causes));
            }
            Self::Terminating { res, name, namespace } => {
                if !name.is_empty() {
                    details.insert("name".into(), json!(name));
                }
                if !res.group.is_empty() {
                    details.insert("group".into(), json!(res.group));
                }
                details.insert("kind".into(), json!(res.plural));
                details.insert(
                    "causes".into(),
                    json!([{
                        "reason": "NamespaceTerminating",
                        "message": format!("namespace {namespace} is being terminated"),
                        "field": "metadata.namespace",
                    }]),
                );
            }
            Self::NamespaceNotFound(name) => {
                details.insert("name".into(), json!(name));
                details.insert("kind".into(), json!("namespaces"));
            }
            _ => {}
        }
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": reason,
            "code": code.as_u16(),
        });
        if !details.is_empty() {
            status["details"] = Value::Object(details);
        }
        status
    }
}

fn forbidden_text(group_resource: &str, name: &str, message: &str) -> String {
    match (group_resource.is_empty(), name.is_empty()) {
        (true, _) => format!("forbidden: {message}"),
        (false, true) => format!("{group_resource} is forbidden: {message}"),
        (false, false) => format!("{group_resource} \"{name}\" is forbidden: {message}"),
    }
}

impl ApiError {
    /// The 403 of a request `attrs` that `user` may not make.
    #[must_use]
    pub fn forbidden(user: &str, attrs: &super::rbac::Attributes) -> Self {
        Self::forbidden_because(user, attrs, "")
    }

    /// [`ApiError::forbidden`] with the authorizer's reason appended (`: reason`).
    #[must_use]
    pub fn forbidden_because(user: &str, attrs: &super::rbac::Attributes, reason: &str) -> Self {
        let mut message = super::rbac::forbidden_message(user, attrs);
        if !reason.is_empty() {
            message = format!("{message}: {reason}");
        }
        let group_resource = if !attrs.resource_request {
            String::new()
        } else if attrs.api_group.is_empty() {
            attrs.resource.clone()
        } else {
            format!("{}.{}", attrs.resource, attrs.api_group)
        };
        Self::Forbidden {
            group_resource,
            name: attrs.name.clone(),
            group: attrs.api_group.clone(),
            resource: attrs.resource.clone(),
            message,
        }
    }
}

/// `Status.reason` for an HTTP status code (used for injected failures).
#[must_use]
pub fn reason_for(code: StatusCode) -> &'static str {
    match code.as_u16() {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (code, _) = self.code_reason();
        (
            code,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            self.status().to_string(),
        )
            .into_response()
    }
}
