//! The controller's error type and its one mapping to `tonic::Status`.
//!
//! Codes are chosen for what a client can do about them: `UNAVAILABLE` for
//! transient conditions (not synced, ring empty, API server or peer down) —
//! the client retry policy keys on it; `ABORTED` for a pod that refused or
//! failed its assignment (retrying at once would burn the next pod, so
//! clients do not retry it transparently); `INVALID_ARGUMENT` for bad
//! requests, including functions in a namespace this controller does not
//! manage; `NOT_FOUND` for a Deployment that does not exist;
//! `FAILED_PRECONDITION` for releasing a pod Skipper did not assign;
//! `RESOURCE_EXHAUSTED` when no pool pod arrived before the deadline, a
//! deployment backs off, a function's supervisor has its mailbox full, or a
//! caller is over one of its limits; `UNAUTHENTICATED` for a missing,
//! malformed or refused token and `PERMISSION_DENIED` for a valid token of
//! an identity that may not call; `INTERNAL` only for bugs.

use crate::domain::ValidationError;

/// A failed controller operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("missing function")]
    MissingFunction,
    #[error("invalid function: {0}")]
    InvalidFunction(#[from] ValidationError),
    #[error("missing router_ip")]
    MissingRouterIp,
    #[error("missing instance name or namespace")]
    MissingInstance,
    #[error("namespace {0} is not managed by this controller (not in --function-namespaces or skipped)")]
    UnmanagedNamespace(String),
    #[error("namespace {namespace} is not served yet: {why}")]
    NamespaceNotReady { namespace: String, why: String },
    #[error("pod {namespace}/{name} is not a Skipper-assigned pod of this function")]
    NotAssigned { namespace: String, name: String },
    #[error(
        "deployment {namespace}/{deployment} does not exist (no ReplicaSet or pod carries skipper/deployment={deployment})"
    )]
    DeploymentNotFound { namespace: String, deployment: String },
    #[error(
        "heartbeat batch of {got} entries is over the limit of {limit} (--max-heartbeat-entries); split it"
    )]
    HeartbeatBatchTooLarge { got: usize, limit: usize },
    #[error("{refused} of {got} heartbeat entries refused: {reason}")]
    HeartbeatsRefused {
        refused: usize,
        got: usize,
        #[source]
        reason: super::heartbeat::Refused,
    },
    #[error("controller is starting: the Kubernetes caches have not synced yet")]
    NotSynced,
    #[error(transparent)]
    Ring(#[from] crate::ring::RingError),
    #[error("kubernetes API: {0}")]
    Kube(#[source] Box<kube::Error>),
    #[error("no unassigned pod of deployment {namespace}/{deployment} became available before the deadline")]
    NoPoolPod { namespace: String, deployment: String },
    #[error("failed to assign pod {pod}: {source}")]
    AssignFailed {
        pod: String,
        #[source]
        source: super::assign::AssignError,
    },
    #[error("pod {name} is no longer claimable")]
    Conflict { name: String },
    #[error(
        "deployment {namespace}/{deployment} is backing off after {failures} consecutive failed assignments; next attempt in {retry_in:?}; last: {last}"
    )]
    AssignBackoff {
        namespace: String,
        deployment: String,
        failures: u32,
        retry_in: std::time::Duration,
        last: String,
    },
    #[error("scale did not produce a ready instance before the deadline")]
    NoReadyInstance,
    #[error("peer controller {peer}: {source}")]
    Peer {
        peer: String,
        #[source]
        source: Box<crate::client::Error>,
    },
    #[error("the function's supervisor stopped; retry")]
    SupervisorStopped,
    #[error(
        "the supervisor of {namespace}/{deployment} tenant {tenant} already has {capacity} scale requests waiting, its limit; try again later"
    )]
    MailboxFull {
        namespace: String,
        deployment: String,
        tenant: String,
        capacity: usize,
    },
    #[error("controller is shutting down")]
    ShuttingDown,
    #[error(transparent)]
    Auth(#[from] super::auth::AuthError),
}

impl From<super::kube::pods::WriteError> for Error {
    fn from(e: super::kube::pods::WriteError) -> Self {
        match e {
            super::kube::pods::WriteError::Api(k) => Self::Kube(k),
            super::kube::pods::WriteError::Conflict(name) => Self::Conflict { name },
        }
    }
}

/// Result of controller operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The gRPC code of this error.
    #[must_use]
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::MissingFunction
            | Self::InvalidFunction(_)
            | Self::MissingRouterIp
            | Self::MissingInstance
            | Self::UnmanagedNamespace(_) => Code::InvalidArgument,
            Self::NotAssigned { .. } => Code::FailedPrecondition,
            Self::DeploymentNotFound { .. } => Code::NotFound,
            Self::HeartbeatBatchTooLarge { .. } | Self::HeartbeatsRefused { .. } => Code::ResourceExhausted,
            // The function has more scale requests waiting than its actor
            // queues: one more caller would not be served sooner.
            Self::MailboxFull { .. } => Code::ResourceExhausted,
            // A pod refused or failed its assignment (it is deleted): asking
            // again at once would only burn the next pod, so clients must
            // not retry this transparently.
            Self::AssignFailed { .. } => Code::Aborted,
            Self::Conflict { .. } => Code::Aborted,
            Self::NotSynced
            | Self::NamespaceNotReady { .. }
            | Self::Ring(_)
            | Self::Kube(_)
            | Self::SupervisorStopped
            | Self::ShuttingDown => Code::Unavailable,
            Self::NoPoolPod { .. } | Self::AssignBackoff { .. } => Code::ResourceExhausted,
            Self::NoReadyInstance => Code::DeadlineExceeded,
            Self::Auth(e) => e.code(),
            Self::Peer { source, .. } => match source.code() {
                Code::Internal | Code::Unknown => Code::Unavailable,
                c => c,
            },
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn codes_are_actionable() {
        let s = tonic::Status::from(Error::InvalidFunction(ValidationError::MissingTenant));
        assert_eq!(
            (s.code(), s.message()),
            (Code::InvalidArgument, "invalid function: missing tenant")
        );
        assert_eq!(
            Error::UnmanagedNamespace("x".into()).code(),
            Code::InvalidArgument
        );
        assert_eq!(Error::NotSynced.code(), Code::Unavailable);
        assert_eq!(
            Error::Ring(crate::ring::RingError::Empty(std::time::Duration::ZERO)).code(),
            Code::Unavailable
        );
        assert_eq!(
            Error::NoPoolPod {
                namespace: "n".into(),
                deployment: "d".into()
            }
            .code(),
            Code::ResourceExhausted
        );
        let peer = Error::Peer {
            peer: "p".into(),
            source: Box::new(crate::client::Error::NoEndpoints {
                method: crate::client::Method::Scale,
            }),
        };
        assert_eq!(peer.code(), Code::Unavailable);
        let refused = Error::AssignFailed {
            pod: "p".into(),
            source: crate::controller::assign::AssignError::Post(
                crate::controller::assign::PostError::Refused {
                    status: 401,
                    body: "expired".into(),
                },
            ),
        };
        assert_ne!(
            refused.code(),
            Code::Unavailable,
            "refusals are not retried by clients"
        );
        assert_eq!(
            Error::DeploymentNotFound {
                namespace: "n".into(),
                deployment: "d".into()
            }
            .code(),
            Code::NotFound
        );
        let full = Error::MailboxFull {
            namespace: "n".into(),
            deployment: "d".into(),
            tenant: "t".into(),
            capacity: 1024,
        };
        assert_eq!(full.code(), Code::ResourceExhausted);
        assert_ne!(
            full.code(),
            Error::NoReadyInstance.code(),
            "a full mailbox is not a missing instance"
        );
    }
}
