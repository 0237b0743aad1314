//! [`Cluster`]: the supervisors' [`Context`] over the controller's caches,
//! the API server, the assigner, the ring, the instance feeds, the event log
//! and the metrics. [`super::core::Core`] holds it for the RPC handlers.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::assign::Assigner;
use super::error::{Error, Result};
use super::events;
use super::feeds::{Drained, Feeds};
use super::kube::stores::{Namespace, State};
use super::kube::{Instance, is_scaled_to_zero};
use super::metrics::Metrics;
use super::supervisor::{Context, Scaled, Settings};
use crate::api::{EventSeverity, EventType};
use crate::domain::{Function, FunctionId};
use crate::ring::RingHandle;

/// What supervisors (and the RPC handlers) read and write in the cluster.
#[derive(Debug)]
pub struct Cluster {
    pub settings: Settings,
    pub state: State,
    pub ring: RingHandle,
    /// This controller's ring identity.
    pub pod_ip: String,
    pub assigner: Assigner,
    pub events: Arc<events::Log>,
    pub metrics: Metrics,
    /// Controller-wide limit on concurrent stale-instance replacements.
    pub stale_permits: Arc<Semaphore>,
    pub started_at: SystemTime,
    /// Instance feeds of the functions routers watch.
    pub feeds: Arc<Feeds>,
    /// Bound on waiting for routers to report a draining instance idle.
    pub drain_timeout: Duration,
}

impl Cluster {
    /// A managed namespace whose caches follow the cluster.
    ///
    /// # Errors
    /// [`Error::UnmanagedNamespace`]; [`Error::NamespaceNotReady`] while its
    /// watches have not listed or are refused.
    pub fn namespace(&self, ns: &str) -> Result<&Namespace> {
        let n = self
            .state
            .namespace(ns)
            .ok_or_else(|| Error::UnmanagedNamespace(ns.to_owned()))?;
        match self.state.not_ready(ns) {
            None => Ok(n),
            Some(why) => Err(Error::NamespaceNotReady {
                namespace: ns.to_owned(),
                why,
            }),
        }
    }

    /// Whether this controller owns `id` on its ring.
    #[must_use]
    pub fn is_owner(&self, id: FunctionId) -> bool {
        self.ring.current().owner(id) == Some(self.pod_ip.as_str())
    }

    /// The running instances of a function from the pod cache (spec §4.3).
    /// With `mutate`, pods that cannot be read as instances are deleted.
    ///
    /// # Errors
    /// [`Error::UnmanagedNamespace`].
    pub async fn read_instances(&self, f: &Function, mutate: bool) -> Result<Vec<Instance>> {
        let ns = self.namespace(&f.namespace)?;
        let (instances, invalid) = self.state.instances(f).unwrap_or_default();
        if mutate {
            for (name, e) in invalid {
                tracing::warn!(pod = %name, error = %e, "failed to get instance from pod, deleting invalid pod");
                if let Err(e) = Box::pin(ns.writer.delete(&name)).await {
                    tracing::warn!(pod = %name, error = %e, "failed to delete invalid pod");
                }
            }
        }
        Ok(instances)
    }
}

impl Context for Cluster {
    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn started_at(&self) -> SystemTime {
        self.started_at
    }

    fn is_owner(&self, id: FunctionId) -> bool {
        Cluster::is_owner(self, id)
    }

    async fn instances(&self, f: &Function) -> Result<Vec<Instance>> {
        self.read_instances(f, true).await
    }

    fn replica_set_retired(&self, f: &Function, name: &str) -> bool {
        let Some(ns) = self.state.namespace(&f.namespace) else {
            return false;
        };
        match ns.replica_sets.get(name) {
            Some(rs) => is_scaled_to_zero(&rs),
            None => ns.replica_sets.is_synced(),
        }
    }

    async fn assign(&self, f: &Function, deadline: Instant) -> Result<Instance> {
        let ns = self.namespace(&f.namespace)?;
        Ok(self.assigner.assign(ns, f, deadline).await?)
    }

    async fn wait_for_pool_pod(&self, f: &Function, deadline: Instant) {
        // The assignment that follows reports a namespace that is not ready.
        let Ok(ns) = self.namespace(&f.namespace) else {
            return;
        };
        self.assigner.wait_for_pool_pod(ns, f, deadline).await;
    }

    async fn delete(&self, f: &Function, name: &str) -> Result<bool> {
        let ns = self.namespace(&f.namespace)?;
        Ok(Box::pin(ns.writer.delete(name)).await?)
    }

    fn stale_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.stale_permits.clone().try_acquire_owned().ok()
    }

    fn event(&self, f: &Function, kind: EventType, severity: EventSeverity, message: String) {
        self.events.push(f, kind, severity, message);
    }

    fn count(&self, f: &Function, what: Scaled, n: u64) {
        let family = match what {
            Scaled::Up => &self.metrics.scale_ups_total,
            Scaled::Down => &self.metrics.scale_downs_total,
        };
        family.get_or_create(&Metrics::function(&f.deployment)).inc_by(n);
    }

    async fn drain(&self, f: &Function, names: &[String], deadline: Option<Instant>) {
        if names.is_empty() {
            return;
        }
        let bound = Instant::now() + self.drain_timeout;
        let until = deadline.map_or(bound, |d| d.min(bound));
        if self.feeds.drain(f.id(), names, until).await == Drained::TimedOut {
            tracing::info!(function = %f.id(), instances = ?names, "routers did not report draining instances idle in time; deleting them");
        }
    }

    fn undrain(&self, f: &Function, names: &[String]) {
        self.feeds.undrain(f.id(), names);
    }
}
