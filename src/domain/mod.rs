//! Pure domain data: functions, their identity and their JSON form.
//!
//! Nothing here is async or talks to the network; everything is deterministic
//! and tested table-style.

mod function;
mod id;
mod json;
mod timing;
mod validate;

pub use function::{Function, Scale};
pub use id::FunctionId;
pub use json::ParseError;
pub use timing::{ASSIGN_TIMING_METADATA, AssignTiming};
pub use validate::{ValidationError, is_dns1123_subdomain, is_label_value};

/// Label on pool and assigned pods naming the function deployment.
pub const LABEL_DEPLOYMENT: &str = "skipper/deployment";
/// Label on an assigned pod naming its tenant (absent on pool pods).
pub const LABEL_TENANT: &str = "skipper/tenant";
/// Annotation holding the function JSON of an assigned pod.
pub const ANNOTATION_FUNCTION: &str = "skipper/function";
/// Annotation holding the RFC 3339 time the pod was claimed.
pub const ANNOTATION_ASSIGNED_AT: &str = "skipper/assigned-at";
/// Annotation holding the ReplicaSet that owned the pod when it was claimed.
pub const ANNOTATION_REPLICA_SET: &str = "skipper/replica-set";
/// Annotation holding the RFC 3339 time the pod accepted its assignment.
pub const ANNOTATION_READY_AT: &str = "skipper/ready-at";
/// Annotation naming the container port (name or number) that serves traffic.
pub const ANNOTATION_PORT: &str = "skipper/port";
/// Annotation on pool pods naming the protocol of the traffic port, as a
/// Service port's `appProtocol` would (`kubernetes.io/h2c`: HTTP/2 over
/// cleartext; `http`: HTTP/1.1). Container ports have no `appProtocol`.
pub const ANNOTATION_APP_PROTOCOL: &str = "skipper/app-protocol";
/// Request header carrying the function JSON.
pub const HEADER_FUNCTION: &str = "x-skipper-function";
/// Request header carrying the assignment token.
pub const HEADER_TOKEN: &str = "x-skipper-token";
/// Request header naming the instance (pod name) the router chose; a pod
/// that is not that instance answers `421 Misdirected Request`.
pub const HEADER_INSTANCE: &str = "x-skipper-instance";
/// Request header naming the tenant of the function the router routes for;
/// a pod serving another tenant answers `421 Misdirected Request`.
pub const HEADER_TENANT: &str = "x-skipper-tenant";
/// Response header with the time spent obtaining an instance, in milliseconds.
pub const HEADER_GET_INSTANCE_DURATION_MS: &str = "x-skipper-get-instance-duration-ms";
/// Field manager of every write the controller makes.
pub const FIELD_MANAGER: &str = "skipper/controller";
/// Default path the controller POSTs to assign a pod.
pub const DEFAULT_ASSIGN_PATH: &str = "/__skipper/assign";
