//! The controller's error type and its one mapping to `tonic::Status`.
//!
//! The leaves own their errors ([`assign::Error`], [`AuthError`],
//! [`WriteError`], [`Refused`]); this umbrella wraps them for the RPC
//! handlers and gives every one its code in [`Error::code`], the only table
//! of codes (the auth layer, the service and the instance streams all answer
//! through it).
//!
//! Codes are chosen for what a client can do about them: `UNAVAILABLE` for
//! transient conditions (not synced, ring empty, API server or peer down) —
//! the client retry policy keys on it; `ABORTED` for a pod that refused or
//! failed its assignment (retrying at once would burn the next pod, so
//! clients do not retry it transparently); `INVALID_ARGUMENT` for bad
//! requests, including functions in a namespace this controller does not
//! manage, and a stream without its subscription; `ABORTED` too for an
//! instance stream whose function moved on the ring (routers subscribe
//! again at once); `NOT_FOUND` for a Deployment that does not exist;
//! `FAILED_PRECONDITION` for releasing a pod Skipper did not assign;
//! `RESOURCE_EXHAUSTED` when no pool pod arrived before the deadline, a
//! deployment backs off, a function's supervisor has its mailbox full, or a
//! caller is over one of its limits; `UNAUTHENTICATED` for a missing,
//! malformed or refused token and `PERMISSION_DENIED` for a valid token of
//! an identity that may not call; `INTERNAL` only for bugs.

use std::time::Duration;

use super::assign;
use super::auth::AuthError;
use super::heartbeat::Refused;
use super::kube::pods::WriteError;
use crate::domain::{FunctionId, ValidationError};

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
        reason: Refused,
    },
    #[error("controller is starting: the Kubernetes caches have not synced yet")]
    NotSynced,
    #[error(transparent)]
    Ring(#[from] crate::ring::RingError),
    /// A pod write (delete, fetch) failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Assign(#[from] assign::Error),
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
    Auth(#[from] AuthError),
    /// A `WatchInstances` call sent no subscription in time.
    #[error("no subscription message within {0:?}")]
    NoSubscription(Duration),
    /// The function of an instance stream moved to another controller.
    #[error("function {id} moved on the hash ring (owner was {owner}); subscribe again")]
    Moved { id: FunctionId, owner: String },
    #[error("{limit} instance streams are open, the most this controller serves")]
    TooManyStreams { limit: usize },
    /// The owner refused or failed a forwarded instance stream.
    #[error("peer controller {peer}: {message}")]
    PeerStream {
        peer: String,
        code: tonic::Code,
        message: String,
    },
}

/// Result of controller operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The gRPC code of this error: the controller's one table of codes.
    #[must_use]
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        // A write the API server refused as a conflict: the pod changed
        // under the claim, asking again at once would not help.
        let write = |e: &WriteError| match e {
            WriteError::Conflict(_) => Code::Aborted,
            WriteError::Api(_) => Code::Unavailable,
        };
        // A peer's internal failure is this controller's unavailability.
        let peer = |c: Code| match c {
            Code::Internal | Code::Unknown => Code::Unavailable,
            c => c,
        };
        match self {
            Self::MissingFunction
            | Self::InvalidFunction(_)
            | Self::MissingRouterIp
            | Self::MissingInstance
            | Self::UnmanagedNamespace(_)
            | Self::NoSubscription(_) => Code::InvalidArgument,
            Self::NotAssigned { .. } => Code::FailedPrecondition,
            Self::DeploymentNotFound { .. } => Code::NotFound,
            Self::HeartbeatBatchTooLarge { .. } | Self::HeartbeatsRefused { .. } => Code::ResourceExhausted,
            // The function has more scale requests waiting than its actor
            // queues: one more caller would not be served sooner.
            Self::MailboxFull { .. } | Self::TooManyStreams { .. } => Code::ResourceExhausted,
            Self::Assign(e) => match e {
                // A pod refused or failed its assignment (it is deleted):
                // asking again at once would only burn the next pod, so
                // clients must not retry this transparently.
                assign::Error::AssignFailed { .. } => Code::Aborted,
                assign::Error::NoPoolPod { .. } | assign::Error::AssignBackoff { .. } => {
                    Code::ResourceExhausted
                }
                assign::Error::Write(w) => write(w),
            },
            Self::Write(w) => write(w),
            // Routers subscribe again at once.
            Self::Moved { .. } => Code::Aborted,
            Self::NotSynced
            | Self::NamespaceNotReady { .. }
            | Self::Ring(_)
            | Self::SupervisorStopped
            | Self::ShuttingDown => Code::Unavailable,
            Self::NoReadyInstance => Code::DeadlineExceeded,
            // Missing, malformed or refused tokens are unauthenticated, a
            // valid token of another identity is denied, a review that
            // failed is unavailable (retry).
            Self::Auth(e) => match e {
                AuthError::Missing { .. } | AuthError::Malformed(_) | AuthError::Refused(_) => {
                    Code::Unauthenticated
                }
                AuthError::Forbidden { .. } => Code::PermissionDenied,
                AuthError::Unavailable(_) => Code::Unavailable,
            },
            Self::Peer { source, .. } => peer(source.code()),
            Self::PeerStream { code, .. } => match code {
                Code::DeadlineExceeded => Code::Unavailable,
                c => peer(*c),
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
    use tonic::Code;

    use super::*;
    use crate::controller::assign::{AssignError, PostError};

    fn nd() -> (String, String) {
        ("n".into(), "d".into())
    }

    #[test]
    fn codes_are_actionable() {
        let s = tonic::Status::from(Error::InvalidFunction(ValidationError::MissingTenant));
        assert_eq!(
            (s.code(), s.message()),
            (Code::InvalidArgument, "invalid function: missing tenant")
        );
        let (namespace, deployment) = nd();
        let refused = || {
            AssignError::Post(PostError::Refused {
                status: 401,
                body: "expired".into(),
            })
        };
        let peer = |code| Error::PeerStream {
            peer: "p".into(),
            code,
            message: "m".into(),
        };
        let api = || WriteError::Api(Box::new(kube::Error::LinesCodecMaxLineLengthExceeded));
        let table: Vec<(Error, Code)> = vec![
            (Error::UnmanagedNamespace("x".into()), Code::InvalidArgument),
            (Error::NotSynced, Code::Unavailable),
            (
                Error::NamespaceNotReady {
                    namespace: "n".into(),
                    why: "refused".into(),
                },
                Code::Unavailable,
            ),
            (
                Error::Ring(crate::ring::RingError::Empty(Duration::ZERO)),
                Code::Unavailable,
            ),
            (
                assign::Error::NoPoolPod {
                    namespace: namespace.clone(),
                    deployment: deployment.clone(),
                }
                .into(),
                Code::ResourceExhausted,
            ),
            (
                assign::Error::AssignBackoff {
                    namespace: namespace.clone(),
                    deployment: deployment.clone(),
                    failures: 3,
                    retry_in: Duration::from_secs(2),
                    last: "refused".into(),
                }
                .into(),
                Code::ResourceExhausted,
            ),
            // Refusals are not retried by clients.
            (
                assign::Error::AssignFailed {
                    pod: "p".into(),
                    source: refused(),
                }
                .into(),
                Code::Aborted,
            ),
            (
                assign::Error::Write(WriteError::Conflict("p".into())).into(),
                Code::Aborted,
            ),
            (assign::Error::Write(api()).into(), Code::Unavailable),
            (WriteError::Conflict("p".into()).into(), Code::Aborted),
            (api().into(), Code::Unavailable),
            (
                Error::Peer {
                    peer: "p".into(),
                    source: Box::new(crate::client::Error::NoEndpoints {
                        method: crate::client::Method::Scale,
                    }),
                },
                Code::Unavailable,
            ),
            (
                Error::DeploymentNotFound {
                    namespace: namespace.clone(),
                    deployment: deployment.clone(),
                },
                Code::NotFound,
            ),
            // A full mailbox is not a missing instance.
            (
                Error::MailboxFull {
                    namespace,
                    deployment,
                    tenant: "t".into(),
                    capacity: 1024,
                },
                Code::ResourceExhausted,
            ),
            (Error::NoReadyInstance, Code::DeadlineExceeded),
            (
                AuthError::Missing { audience: "a".into() }.into(),
                Code::Unauthenticated,
            ),
            (AuthError::Malformed("m").into(), Code::Unauthenticated),
            (AuthError::Refused("r".into()).into(), Code::Unauthenticated),
            (
                AuthError::Forbidden {
                    user: "u".into(),
                    allowed: "a".into(),
                }
                .into(),
                Code::PermissionDenied,
            ),
            (AuthError::Unavailable("u".into()).into(), Code::Unavailable),
            (
                Error::NoSubscription(Duration::from_secs(10)),
                Code::InvalidArgument,
            ),
            (
                Error::Moved {
                    id: FunctionId(9),
                    owner: "10.0.0.1".into(),
                },
                Code::Aborted,
            ),
            (Error::TooManyStreams { limit: 2 }, Code::ResourceExhausted),
            (peer(Code::Internal), Code::Unavailable),
            (peer(Code::DeadlineExceeded), Code::Unavailable),
            (peer(Code::NotFound), Code::NotFound),
        ];
        for (e, code) in table {
            let message = e.to_string();
            let s = tonic::Status::from(e);
            assert_eq!((s.code(), s.message()), (code, message.as_str()));
        }
        assert_eq!(
            Error::from(assign::Error::NoPoolPod {
                namespace: "n".into(),
                deployment: "d".into()
            })
            .to_string(),
            "no unassigned pod of deployment n/d became available before the deadline",
            "a leaf's message is the answer's"
        );
    }
}
