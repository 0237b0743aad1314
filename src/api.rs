//! Generated protobuf/gRPC types (package `skipper`) and conversions between
//! them and the domain types. Nothing else lives here.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("skipper");

use crate::domain;

impl From<&domain::Scale> for Scale {
    fn from(s: &domain::Scale) -> Self {
        Self {
            min_instances: s.min_instances,
            max_instances: s.max_instances,
            target_cpu_usage_milli: s.target_cpu_usage_milli,
            target_memory_usage_mib: s.target_memory_usage_mib,
            target_in_flight_requests: s.target_in_flight_requests,
            max_in_flight_requests: s.max_in_flight_requests,
        }
    }
}

impl From<&Scale> for domain::Scale {
    fn from(s: &Scale) -> Self {
        Self {
            min_instances: s.min_instances,
            max_instances: s.max_instances,
            target_cpu_usage_milli: s.target_cpu_usage_milli,
            target_memory_usage_mib: s.target_memory_usage_mib,
            target_in_flight_requests: s.target_in_flight_requests,
            max_in_flight_requests: s.max_in_flight_requests,
        }
    }
}

impl From<&domain::Function> for Function {
    fn from(f: &domain::Function) -> Self {
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Self {
            namespace: non_empty(&f.namespace),
            deployment: non_empty(&f.deployment),
            tenant: non_empty(&f.tenant),
            metadata: f.metadata.clone(),
            scale: f.scale.as_ref().map(Into::into),
            oneshot: f.oneshot,
        }
    }
}

impl From<&Function> for domain::Function {
    fn from(f: &Function) -> Self {
        Self {
            namespace: f.namespace.clone().unwrap_or_default(),
            deployment: f.deployment.clone().unwrap_or_default(),
            tenant: f.tenant.clone().unwrap_or_default(),
            metadata: f.metadata.clone(),
            scale: f.scale.as_ref().map(Into::into),
            oneshot: f.oneshot,
        }
    }
}
