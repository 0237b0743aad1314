//! Kubernetes state of the controller.
//!
//! - [`cache`]: in-memory views of function pods (indexed by function and by
//!   pool), fed by watches and by the controller's own writes, with a change
//!   signal that wakes claims waiting for a pool pod.
//! - [`stores`]: the watches (function pods, ReplicaSets, controller pods →
//!   ring membership), the start-up namespace probe and pod metrics.
//! - [`pods`]: every write the controller makes (claim, ready-at, delete).
//! - [`throttle`]: the client-side QPS/burst limit of the Kubernetes client.
//! - this module: pod predicates and the pod → instance conversion (§4.3).

pub mod cache;
pub mod pods;
pub mod stores;
pub mod throttle;
pub mod trace;

use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;

use crate::api::Protocol;
use crate::domain::{
    ANNOTATION_ASSIGNED_AT, ANNOTATION_FUNCTION, ANNOTATION_PORT, ANNOTATION_READY_AT,
    ANNOTATION_REPLICA_SET, Function,
};

/// `status.phase == Running`, a pod IP, and not being deleted.
#[must_use]
pub fn is_running(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().is_some_and(|s| {
            s.phase.as_deref() == Some("Running") && s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
        })
}

/// Running and the `Ready` condition is `True`.
#[must_use]
pub fn is_ready(pod: &Pod) -> bool {
    is_running(pod)
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A pod annotation.
#[must_use]
pub fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// A pod label.
#[must_use]
pub fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

/// Parses an RFC 3339 timestamp (any offset).
#[must_use]
pub fn parse_time(s: &str) -> Option<SystemTime> {
    s.parse::<jiff::Timestamp>().ok().map(SystemTime::from)
}

/// Formats a time as RFC 3339 UTC with second precision.
#[must_use]
pub fn format_time(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Why an assigned pod cannot be read as an instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidPod {
    #[error("missing function annotation")]
    MissingFunction,
    #[error("failed to unmarshal function from pod annotation: {0}")]
    BadFunction(String),
    #[error("invalid function in pod annotation: {0}")]
    InvalidFunction(String),
    #[error("missing replica set annotation")]
    MissingReplicaSet,
    #[error("failed to parse assigned at annotation: {0:?}")]
    BadAssignedAt(Option<String>),
    #[error("failed to parse ready at annotation: {0:?}")]
    BadReadyAt(String),
    #[error("failed to get port for pod {0}")]
    NoPort(String),
    #[error("unknown {annotation} annotation {value:?} (kubernetes.io/h2c, h2c or http)", annotation = crate::domain::ANNOTATION_APP_PROTOCOL)]
    BadAppProtocol { value: String },
}

/// Parses and validates the function annotation of a pod.
///
/// # Errors
/// [`InvalidPod`] naming what is wrong.
pub fn pod_function(pod: &Pod) -> Result<Function, InvalidPod> {
    let raw = annotation(pod, ANNOTATION_FUNCTION).ok_or(InvalidPod::MissingFunction)?;
    let f = Function::from_json(raw).map_err(|e| InvalidPod::BadFunction(e.to_string()))?;
    f.validate()
        .map_err(|e| InvalidPod::InvalidFunction(e.to_string()))?;
    Ok(f)
}

/// The port traffic for `pod` goes to (spec §3.3): the container port named
/// by `skipper/port` (or the annotation verbatim), else the first container
/// port.
///
/// # Errors
/// [`InvalidPod::NoPort`] when neither exists.
pub fn pod_port(pod: &Pod) -> Result<String, InvalidPod> {
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    if let Some(want) = annotation(pod, ANNOTATION_PORT).filter(|p| !p.is_empty()) {
        let named = containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(want));
        return Ok(named.map_or_else(|| want.to_owned(), |p| p.container_port.to_string()));
    }
    containers
        .first()
        .and_then(|c| c.ports.as_ref())
        .and_then(|ps| ps.first())
        .map(|p| p.container_port.to_string())
        .ok_or_else(|| InvalidPod::NoPort(pod.metadata.name.clone().unwrap_or_default()))
}

/// How routers speak to `pod`'s traffic port: the `skipper/app-protocol`
/// annotation when set (`kubernetes.io/h2c` or `h2c`: HTTP/2 over cleartext;
/// `http` or `kubernetes.io/http`: HTTP/1.1), else the traffic port's name
/// as Knative and Istio read it (`h2c`, `grpc` or `grpc-…`: HTTP/2), else
/// HTTP/1.1.
///
/// # Errors
/// [`InvalidPod::BadAppProtocol`] for an annotation value it does not know.
pub fn pod_protocol(pod: &Pod) -> Result<Protocol, InvalidPod> {
    if let Some(value) = annotation(pod, crate::domain::ANNOTATION_APP_PROTOCOL).filter(|v| !v.is_empty()) {
        return match value.to_ascii_lowercase().as_str() {
            "kubernetes.io/h2c" | "h2c" => Ok(Protocol::H2c),
            "http" | "kubernetes.io/http" | "http/1.1" => Ok(Protocol::Unspecified),
            _ => Err(InvalidPod::BadAppProtocol {
                value: value.to_owned(),
            }),
        };
    }
    let ports = || {
        pod.spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
    };
    let name = match annotation(pod, ANNOTATION_PORT).filter(|p| !p.is_empty()) {
        Some(want) => match want.parse::<i32>() {
            Ok(number) => ports()
                .find(|p| p.container_port == number)
                .and_then(|p| p.name.as_deref()),
            Err(_) => Some(want),
        },
        None => pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.ports.as_ref())
            .and_then(|ps| ps.first())
            .and_then(|p| p.name.as_deref()),
    };
    let h2 =
        name.is_some_and(|n| n == "h2c" || n == "grpc" || n.starts_with("grpc-") || n.starts_with("h2c-"));
    Ok(if h2 { Protocol::H2c } else { Protocol::Unspecified })
}

/// `ip:port`, bracketing IPv6 addresses.
#[must_use]
pub fn join_addr(ip: &str, port: &str) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// An assigned pod read as an instance of a function.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    pub namespace: String,
    pub name: String,
    pub function: Arc<Function>,
    pub replica_set: String,
    pub assigned_at: SystemTime,
    /// Set only when the pod is Ready and has accepted its assignment.
    pub ready_at: Option<SystemTime>,
    pub addr: String,
    pub cpu_milli: u32,
    pub memory_mib: u32,
    /// How routers speak to it.
    pub protocol: Protocol,
    /// How the assignment that made this instance went, on the value the
    /// assigning controller returns (never read back from the pod).
    pub assign_timing: Option<Box<crate::domain::AssignTiming>>,
}

impl Instance {
    /// Converts a running assigned pod (spec §4.3). Usage figures are filled
    /// in by the caller.
    ///
    /// # Errors
    /// [`InvalidPod`] when an annotation is missing or malformed.
    pub fn from_pod(pod: &Pod, function: Arc<Function>) -> Result<Self, InvalidPod> {
        let replica_set = annotation(pod, ANNOTATION_REPLICA_SET)
            .filter(|s| !s.is_empty())
            .ok_or(InvalidPod::MissingReplicaSet)?;
        let raw_assigned = annotation(pod, ANNOTATION_ASSIGNED_AT);
        let assigned_at = raw_assigned
            .and_then(parse_time)
            .ok_or_else(|| InvalidPod::BadAssignedAt(raw_assigned.map(str::to_owned)))?;
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .unwrap_or_default();
        let addr = join_addr(ip, &pod_port(pod)?);
        let protocol = pod_protocol(pod)?;
        let ready_at = if is_ready(pod) {
            match annotation(pod, ANNOTATION_READY_AT) {
                Some(raw) => Some(parse_time(raw).ok_or_else(|| InvalidPod::BadReadyAt(raw.to_owned()))?),
                None => None,
            }
        } else {
            None
        };
        Ok(Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            function,
            replica_set: replica_set.to_owned(),
            assigned_at,
            ready_at,
            addr,
            cpu_milli: 0,
            memory_mib: 0,
            protocol,
            assign_timing: None,
        })
    }

    /// The wire form.
    #[must_use]
    pub fn to_api(&self) -> crate::api::Instance {
        let ts = |t: SystemTime| prost_types::Timestamp::from(t);
        crate::api::Instance {
            function: Some(self.function.as_ref().into()),
            name: Some(self.name.clone()),
            addr: Some(self.addr.clone()),
            replica_set: Some(self.replica_set.clone()),
            assigned_at: Some(ts(self.assigned_at)),
            ready_at: self.ready_at.map(ts),
            cpu_usage_milli: Some(self.cpu_milli),
            memory_usage_mib: Some(self.memory_mib),
            // Absent for HTTP/1.1: the wire stays what Go Skipper sends.
            protocol: (self.protocol != Protocol::Unspecified).then_some(self.protocol as i32),
        }
    }
}

/// Whether a Deployment rollout scaled `rs` to zero: its desired replicas
/// (`spec.replicas`, 1 when unset), not the count it last observed. Right
/// after a claim takes the only pod of a pool, `status.replicas` reads 0
/// until the replacement pod exists, and an instance judged on that would
/// be replaced for nothing.
#[must_use]
pub fn is_scaled_to_zero(rs: &k8s_openapi::api::apps::v1::ReplicaSet) -> bool {
    rs.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{ReplicaSet, ReplicaSetSpec, ReplicaSetStatus};
    use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec};

    fn pod_with_ports(annotation_port: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some("p".into());
        if let Some(a) = annotation_port {
            pod.metadata.annotations = Some([(ANNOTATION_PORT.to_owned(), a.to_owned())].into());
        }
        pod.spec = Some(PodSpec {
            containers: vec![Container {
                name: "c".into(),
                ports: Some(vec![
                    ContainerPort {
                        container_port: 9000,
                        ..Default::default()
                    },
                    ContainerPort {
                        name: Some("http".into()),
                        container_port: 8888,
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }],
            ..Default::default()
        });
        pod
    }

    #[test]
    fn protocol_rules() {
        use crate::domain::ANNOTATION_APP_PROTOCOL;
        let named = |first: Option<&str>, annotations: &[(&str, &str)]| {
            let mut pod = pod_with_ports(None);
            let ports = pod.spec.as_mut().unwrap().containers[0].ports.as_mut().unwrap();
            ports[0].name = first.map(str::to_owned);
            pod.metadata.annotations = Some(
                annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            );
            pod_protocol(&pod)
        };
        let h2 = Ok(Protocol::H2c);
        let h1 = Ok(Protocol::Unspecified);
        // The first port serves unless `skipper/port` names another.
        assert_eq!(named(None, &[]), h1);
        assert_eq!(named(Some("h2c"), &[]), h2);
        assert_eq!(named(Some("grpc"), &[]), h2);
        assert_eq!(named(Some("grpc-echo"), &[]), h2);
        assert_eq!(named(Some("grpcish"), &[]), h1);
        assert_eq!(named(Some("http"), &[]), h1);
        assert_eq!(named(Some("h2c"), &[(ANNOTATION_PORT, "http")]), h1);
        assert_eq!(named(Some("h2c"), &[(ANNOTATION_PORT, "9000")]), h2);
        assert_eq!(
            named(None, &[(ANNOTATION_PORT, "grpc")]),
            h2,
            "a port named only by the annotation"
        );
        // The annotation wins over the port's name.
        assert_eq!(named(None, &[(ANNOTATION_APP_PROTOCOL, "kubernetes.io/h2c")]), h2);
        assert_eq!(named(None, &[(ANNOTATION_APP_PROTOCOL, "H2C")]), h2);
        assert_eq!(named(Some("grpc"), &[(ANNOTATION_APP_PROTOCOL, "http")]), h1);
        assert_eq!(named(Some("h2c"), &[(ANNOTATION_APP_PROTOCOL, "")]), h2);
        assert_eq!(
            named(None, &[(ANNOTATION_APP_PROTOCOL, "kubernetes.io/ws")])
                .unwrap_err()
                .to_string(),
            "unknown skipper/app-protocol annotation \"kubernetes.io/ws\" (kubernetes.io/h2c, h2c or http)"
        );
    }

    #[test]
    fn port_resolution_rules() {
        assert_eq!(pod_port(&pod_with_ports(Some("http"))).unwrap(), "8888");
        assert_eq!(pod_port(&pod_with_ports(Some("7070"))).unwrap(), "7070");
        assert_eq!(pod_port(&pod_with_ports(None)).unwrap(), "9000");
        assert_eq!(pod_port(&pod_with_ports(Some(""))).unwrap(), "9000");
        let mut bare = Pod::default();
        bare.metadata.name = Some("bare".into());
        assert_eq!(
            pod_port(&bare).unwrap_err().to_string(),
            "failed to get port for pod bare"
        );
        assert_eq!(join_addr("fd00::1", "80"), "[fd00::1]:80");
    }

    #[test]
    fn times_round_trip_at_second_precision() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_705_314_600_500);
        assert_eq!(format_time(t), "2024-01-15T10:30:00Z");
        assert_eq!(
            parse_time("2024-01-15T10:30:00Z"),
            Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_705_314_600))
        );
        assert_eq!(parse_time("yesterday"), None);
    }

    fn rs(desired: Option<i32>, observed: Option<i32>) -> ReplicaSet {
        ReplicaSet {
            spec: Some(ReplicaSetSpec {
                replicas: desired,
                ..ReplicaSetSpec::default()
            }),
            status: observed.map(|replicas| ReplicaSetStatus {
                replicas,
                ..ReplicaSetStatus::default()
            }),
            ..ReplicaSet::default()
        }
    }

    #[test]
    fn a_replica_set_is_retired_by_its_desired_replicas_not_its_observed_ones() {
        let table = [
            // (spec.replicas, status.replicas, retired)
            (Some(0), Some(0), true),
            (Some(0), Some(3), true),  // scaled down, pods still terminating
            (Some(1), Some(0), false), // the only pod claimed, replacement not yet counted
            (Some(4), None, false),    // not yet observed
            (None, Some(0), false),    // spec.replicas defaults to 1
        ];
        for (desired, observed, retired) in table {
            assert_eq!(
                is_scaled_to_zero(&rs(desired, observed)),
                retired,
                "spec {desired:?} status {observed:?}"
            );
        }
        assert!(!is_scaled_to_zero(&ReplicaSet::default()), "no spec: one replica");
    }
}
