//! [`Function`] and [`Scale`]: what a tenant's server is and how it scales.

use super::FunctionId;

/// Scaling configuration of a function.
///
/// Every field keeps its presence: a field given as `0` is distinct from an
/// absent one in the JSON form, exactly as in the wire contract. Use
/// [`Scale::min_instances`] and friends for the effective values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Scale {
    pub min_instances: Option<u32>,
    pub max_instances: Option<u32>,
    pub target_cpu_usage_milli: Option<u32>,
    pub target_memory_usage_mib: Option<u32>,
    pub target_in_flight_requests: Option<u32>,
    /// Requests one router sends to one instance at a time (absent or 0:
    /// no limit). Router-side only: it is not scaling configuration of the
    /// controllers (see [`Scale::for_controllers`]).
    pub max_in_flight_requests: Option<u32>,
}

impl Scale {
    /// Effective minimum instance count (absent = 0).
    #[must_use]
    pub fn min_instances(&self) -> u32 {
        self.min_instances.unwrap_or(0)
    }
    /// Effective maximum instance count (absent = 0, which validation rejects).
    #[must_use]
    pub fn max_instances(&self) -> u32 {
        self.max_instances.unwrap_or(0)
    }
    /// Effective CPU target in millicores (0 = no CPU target).
    #[must_use]
    pub fn target_cpu_usage_milli(&self) -> u32 {
        self.target_cpu_usage_milli.unwrap_or(0)
    }
    /// Effective memory target in MiB (0 = no memory target).
    #[must_use]
    pub fn target_memory_usage_mib(&self) -> u32 {
        self.target_memory_usage_mib.unwrap_or(0)
    }
    /// Effective in-flight request target (0 = no in-flight target).
    #[must_use]
    pub fn target_in_flight_requests(&self) -> u32 {
        self.target_in_flight_requests.unwrap_or(0)
    }

    /// Effective per-instance concurrency limit of one router (0 = none).
    #[must_use]
    pub fn max_in_flight_requests(&self) -> u32 {
        self.max_in_flight_requests.unwrap_or(0)
    }

    /// This configuration as controllers get it: without the router-side
    /// [`Scale::max_in_flight_requests`]. A Go controller would keep the
    /// field it does not know as an unknown one and find every instance's
    /// spec (its annotation has no such field) different from the
    /// function's, replacing the instances on every converge.
    #[must_use]
    pub fn for_controllers(&self) -> Self {
        Self {
            max_in_flight_requests: None,
            ..self.clone()
        }
    }

    /// The fields whose change is a change of the function's spec (the
    /// router-side limit is not one).
    fn effective(&self) -> [u32; 5] {
        [
            self.min_instances(),
            self.max_instances(),
            self.target_cpu_usage_milli(),
            self.target_memory_usage_mib(),
            self.target_in_flight_requests(),
        ]
    }
}

/// A function: identity (namespace, deployment, tenant, oneshot) plus mutable
/// configuration (metadata, scale).
///
/// Build one from the header JSON with [`Function::from_json`], then check it
/// with [`Function::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Function {
    pub namespace: String,
    pub deployment: String,
    pub tenant: String,
    /// Opaque string delivered to the pod at assignment.
    pub metadata: Option<String>,
    pub scale: Option<Scale>,
    pub oneshot: Option<bool>,
}

impl Function {
    /// The identity hash of this function (see [`FunctionId::of`]).
    #[must_use]
    pub fn id(&self) -> FunctionId {
        FunctionId::of(&self.namespace, &self.deployment, &self.tenant, self.is_oneshot())
    }

    /// Whether every request gets its own pod.
    #[must_use]
    pub fn is_oneshot(&self) -> bool {
        self.oneshot.unwrap_or(false)
    }

    /// The scale configuration, or the all-zero default when absent.
    #[must_use]
    pub fn scale_or_default(&self) -> Scale {
        self.scale.clone().unwrap_or_default()
    }

    /// Whether `other` has the same identity and the same effective
    /// configuration.
    ///
    /// Absent and zero-valued fields compare equal here (`"min_instances":0`
    /// and no `min_instances` are the same configuration), so callers that
    /// spell the same function differently do not count as a spec change.
    #[must_use]
    pub fn same_config(&self, other: &Function) -> bool {
        self.namespace == other.namespace
            && self.deployment == other.deployment
            && self.tenant == other.tenant
            && self.is_oneshot() == other.is_oneshot()
            && self.metadata.as_deref().unwrap_or("") == other.metadata.as_deref().unwrap_or("")
            && self.scale_or_default().effective() == other.scale_or_default().effective()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_side_limit_is_not_part_of_the_spec_and_stays_with_the_router() {
        let with = |limit| Function {
            namespace: "ns".into(),
            deployment: "d".into(),
            tenant: "t".into(),
            scale: Some(Scale {
                max_instances: Some(2),
                max_in_flight_requests: limit,
                ..Scale::default()
            }),
            ..Function::default()
        };
        assert!(
            with(Some(1)).same_config(&with(None)),
            "a new limit replaces no instance"
        );
        let sent = with(Some(1)).scale.unwrap().for_controllers();
        assert_eq!(sent.max_in_flight_requests, None);
        assert_eq!(sent.max_instances, Some(2));
    }
}
