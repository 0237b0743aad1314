//! [`Core`]: what the RPC handlers share, and the controller's operations
//! (get an instance, scale via the ring owner, record heartbeats, release,
//! snapshot the state). Core holds the [`Cluster`] (the caches, the ring,
//! the assigner, events and metrics), which is all the supervisors see of
//! the controller, and adds what only the RPCs need: the configuration,
//! the peers, the supervisors' registry and the routers' heartbeat counts.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rand::seq::IndexedRandom;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::config::Config;
use super::context::Cluster;
use super::error::{Error, Result};
use super::events;
use super::heartbeat::{Refused, Report, Routers, forward_plan};
use super::kube::Instance;
use super::metrics::{HeartbeatRefusedLabels, Metrics};
use super::peers::Peers;
use super::supervisor::converge::Decision;
use super::supervisor::{Handle, Registry};
use crate::api::{self, ScaleReason};
use crate::domain::{Function, FunctionId, LABEL_TENANT};
use crate::shutdown::Shutdown;

/// How many controllers a `Scale` may travel through before the receiver
/// executes it itself (rings that disagree cannot bounce it forever).
pub const MAX_SCALE_HOPS: u32 = 1;

/// Bound on concurrent heartbeat forwards per batch.
const FORWARD_CONCURRENCY: usize = 16;
/// Deadline of one forwarded heartbeat batch.
const FORWARD_DEADLINE: Duration = Duration::from_secs(5);

/// How long a request for a Deployment the caches do not know waits for
/// them before the API server is asked.
pub const UNKNOWN_DEPLOYMENT_WAIT: Duration = Duration::from_secs(1);

fn not_found(f: &Function) -> Error {
    Error::DeploymentNotFound {
        namespace: f.namespace.clone(),
        deployment: f.deployment.clone(),
    }
}

/// The controller's shared parts.
#[derive(Debug)]
pub struct Core {
    pub config: Arc<Config>,
    /// The caches, the ring, the assigner, the feeds, events and metrics:
    /// the supervisors' context.
    pub cluster: Arc<Cluster>,
    pub shutdown: Shutdown,
    pub peers: Peers,
    pub supervisors: Registry<Cluster>,
    /// The routers keeping functions active here, with their counts.
    pub routers: Routers,
}

impl Core {
    /// # Errors
    /// [`Error::NotSynced`] until every cache has listed once.
    pub(crate) fn ensure_synced(&self) -> Result<()> {
        if self.cluster.state.is_synced() {
            Ok(())
        } else {
            Err(Error::NotSynced)
        }
    }

    /// Checks a function from a request: valid, in a managed namespace, of
    /// a Deployment that exists (so nothing — supervisors, metric series —
    /// is created for names a client makes up).
    ///
    /// # Errors
    /// `INVALID_ARGUMENT`, `UNAVAILABLE` before the caches synced, and
    /// `NOT_FOUND` for an unknown Deployment.
    pub fn admit(&self, f: Option<&api::Function>) -> Result<Function> {
        let f = self.managed(f)?;
        if self.cached(&f)? {
            Ok(f)
        } else {
            Err(not_found(&f))
        }
    }

    /// [`Core::admit`] for the calls that serve a request (`GetInstance`,
    /// `Scale`, `WatchInstances`): a Deployment the caches do not know is
    /// waited for (up to [`UNKNOWN_DEPLOYMENT_WAIT`], not past `deadline`;
    /// a pool applied a moment ago), then looked up on the API server before
    /// the call is answered `NOT_FOUND`. Heartbeats use [`Core::admit`]: a
    /// made-up name in them costs no API request.
    ///
    /// # Errors
    /// As [`Core::admit`]; `UNAVAILABLE` when the API server fails the
    /// lookup.
    pub async fn admit_confirmed(&self, f: Option<&api::Function>, deadline: Instant) -> Result<Function> {
        let f = self.managed(f)?;
        let ns = self.cluster.namespace(&f.namespace)?;
        let mut changes = ns.pods.subscribe();
        let until = deadline.min(Instant::now() + UNKNOWN_DEPLOYMENT_WAIT);
        loop {
            changes.mark_unchanged();
            if self.cached(&f)? {
                return Ok(f);
            }
            // A new pool's ReplicaSet brings its pods: each pod change
            // looks again.
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                () = tokio::time::sleep_until(until) => break,
            }
        }
        if ns.writer.deployment_exists(&f.deployment).await? {
            tracing::debug!(namespace = %f.namespace, deployment = %f.deployment,
                "deployment confirmed on the API server before the caches know it");
            return Ok(f);
        }
        Err(not_found(&f))
    }

    /// The validated function of a managed, synced namespace.
    fn managed(&self, f: Option<&api::Function>) -> Result<Function> {
        let f: Function = f.ok_or(Error::MissingFunction)?.into();
        f.validate()?;
        self.cluster.namespace(&f.namespace)?;
        self.ensure_synced()?;
        Ok(f)
    }

    /// Whether the caches know `f`'s Deployment: a ReplicaSet, pool pods
    /// or the function's own pods carry its `skipper/deployment`.
    fn cached(&self, f: &Function) -> Result<bool> {
        let ns = self.cluster.namespace(&f.namespace)?;
        Ok(ns.replica_sets.knows_deployment(&f.deployment)
            || !ns.pods.pool(&f.deployment).is_empty()
            || !ns.pods.of_function(f.id()).is_empty())
    }

    /// The supervisor of a validated, managed function.
    pub async fn supervisor(&self, f: &Function, update_spec: bool) -> Handle {
        self.supervisors.get_or_spawn(f, update_spec).await
    }

    /// `GetInstance` (spec §2.4, §5.10).
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get_instance(
        self: &Arc<Self>,
        f: Function,
        exclude: &[String],
        deadline: Instant,
    ) -> Result<Instance> {
        self.ensure_synced()?;
        // Every function in use has a supervisor (for oneshot functions it
        // is the safety net that deletes orphans).
        self.supervisor(&f, true).await;
        let ns = self.cluster.namespace(&f.namespace)?;
        if f.is_oneshot() {
            return Ok(self.cluster.assigner.assign(ns, &f, deadline).await?);
        }
        let mut changes = ns.pods.subscribe();
        loop {
            changes.mark_unchanged();
            // Instances about to be deleted are not handed out.
            let draining = self.cluster.feeds.draining(f.id());
            let ready: Vec<Instance> = self
                .cluster
                .read_instances(&f, true)
                .await?
                .into_iter()
                .filter(|i| i.ready_at.is_some() && !draining.contains(&i.name))
                .collect();
            if let Some(i) = choose(&f, ready, exclude) {
                return Ok(i);
            }
            let decision = Decision::new(1, ScaleReason::NoReadyInstances);
            let scaled = self.scale(f.clone(), decision, deadline, 0).await?;
            if let Some(i) = choose(&f, scaled, exclude) {
                return Ok(i);
            }
            // Nothing ready yet (e.g. scale-up refused at max + 1 with only
            // unready pods): wait for the pod cache to change, not a busy loop.
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(Error::NoReadyInstance);
            }
        }
    }

    /// Executes `decision` on the function's ring owner: locally when this
    /// controller owns it (or the request already travelled
    /// [`MAX_SCALE_HOPS`]), else forwarded with no lock held.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn scale(
        self: &Arc<Self>,
        f: Function,
        decision: Decision,
        deadline: Instant,
        hops: u32,
    ) -> Result<Vec<Instance>> {
        let ring = self
            .cluster
            .ring
            .wait_non_empty(self.config.hash_ring_wait_time)
            .await?;
        let owner = ring.owner(f.id()).map(str::to_owned);
        match owner {
            Some(o) if o != self.config.pod_ip && hops < MAX_SCALE_HOPS => {
                let req = api::ScaleRequest {
                    function: Some((&f).into()),
                    desired_instances: Some(decision.desired),
                    reason: Some(decision.reason as i32),
                };
                let budget = deadline.saturating_duration_since(Instant::now());
                let (resp, timing) = self.peers.scale(&o, req, hops + 1, budget).await?;
                let mut instances: Vec<Instance> = resp
                    .instances
                    .iter()
                    .filter_map(|i| self.instance_from_api(i))
                    .collect();
                if let Some(t) = timing
                    && let Some(i) = instances.iter_mut().find(|i| i.name == t.instance)
                {
                    i.assign_timing = Some(Box::new(t));
                }
                Ok(instances)
            }
            _ => loop {
                if self.shutdown.is_shutting_down() {
                    return Err(Error::ShuttingDown);
                }
                let handle = self.supervisor(&f, true).await;
                match handle.scale(decision.clone(), deadline).await {
                    // The actor stopped between lookup and send: a fresh
                    // handle spawns a new one.
                    Err(Error::SupervisorStopped) if Instant::now() < deadline => {}
                    other => return other,
                }
            },
        }
    }

    fn instance_from_api(&self, i: &api::Instance) -> Option<Instance> {
        let function = Arc::new(Function::from(i.function.as_ref()?));
        let ts = |t: &Option<prost_types::Timestamp>| t.and_then(|t| SystemTime::try_from(t).ok());
        Some(Instance {
            namespace: function.namespace.clone(),
            name: i.name.clone()?,
            function,
            replica_set: i.replica_set.clone().unwrap_or_default(),
            assigned_at: ts(&i.assigned_at).unwrap_or(SystemTime::UNIX_EPOCH),
            ready_at: ts(&i.ready_at),
            addr: i.addr.clone().unwrap_or_default(),
            cpu_milli: i.cpu_usage_milli.unwrap_or(0),
            memory_mib: i.memory_usage_mib.unwrap_or(0),
            protocol: i.protocol(),
            assign_timing: None,
        })
    }

    /// `Heartbeat` (spec §2.4, §5.2): records each entry on its supervisor
    /// and forwards the batch to the ring peers not yet in the chain.
    /// Entries with an invalid function, an unmanaged namespace or a
    /// Deployment that does not exist are dropped (no supervisor is created
    /// for them). A router keeps at most `--max-functions-per-router`
    /// functions active here: entries for more are refused (no supervisor,
    /// not forwarded), the rest are recorded, and the call answers
    /// `RESOURCE_EXHAUSTED` naming the limit.
    ///
    /// # Errors
    /// [`Error::MissingRouterIp`], [`Error::HeartbeatBatchTooLarge`],
    /// [`Error::HeartbeatsRefused`].
    pub async fn heartbeat(self: &Arc<Self>, mut req: api::HeartbeatRequest) -> Result<()> {
        let router_ip = req
            .router_ip
            .clone()
            .filter(|r| !r.is_empty())
            .ok_or(Error::MissingRouterIp)?;
        let got = req.heartbeats.len();
        let limit = self.config.limits.heartbeat_entries;
        if got > limit {
            return Err(Error::HeartbeatBatchTooLarge { got, limit });
        }
        let router = match self.routers.get(&router_ip) {
            Ok(r) => r,
            Err(reason) => return Err(self.refused(got, got, reason)),
        };
        let now = SystemTime::now();
        let timeout = self.config.scale.heartbeat_timeout;
        let mut refused: Option<(usize, Refused)> = None;
        let mut forward = Vec::with_capacity(got);
        for hb in std::mem::take(&mut req.heartbeats) {
            // A batch is up to --max-heartbeat-entries functions, each maybe
            // a new supervisor: give the worker back when the task's budget
            // is spent, so health probes and other calls are answered while
            // a flood of batches is recorded.
            tokio::task::consume_budget().await;
            let f = match self.admit(hb.function.as_ref()) {
                Ok(f) => f,
                Err(e) => {
                    tracing::debug!(error = %e, "ignoring heartbeat");
                    forward.push(hb);
                    continue;
                }
            };
            self.cluster
                .metrics
                .heartbeats_total
                .get_or_create(&Metrics::function(&f.deployment))
                .inc();
            // A router at its limit gets no new function: not even a
            // supervisor is created for it.
            let known = || {
                self.supervisors
                    .get(f.id())
                    .is_some_and(|h| h.shared.with_heartbeats(|s| s.has(&router)))
            };
            let recorded = if router.is_at_limit() && !known() {
                Err(Refused::RouterLimit {
                    router: router_ip.clone(),
                    limit: self.config.limits.functions_per_router,
                })
            } else {
                let report = Report {
                    timestamp: hb
                        .timestamp
                        .and_then(|t| SystemTime::try_from(t).ok())
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                    in_flight: hb.in_flight_requests.unwrap_or(0),
                };
                let handle = self.supervisor(&f, true).await;
                handle
                    .shared
                    .with_heartbeats(|s| s.record(&router, report, now, timeout))
            };
            match recorded {
                Ok(()) => forward.push(hb),
                Err(reason) => {
                    let n = refused.as_ref().map_or(0, |(n, _)| *n);
                    refused = Some((n + 1, reason));
                }
            }
        }
        req.heartbeats = forward;
        if !req.heartbeats.is_empty() {
            self.forward_heartbeats(req, router_ip);
        }
        match refused {
            Some((n, reason)) => Err(self.refused(n, got, reason)),
            None => Ok(()),
        }
    }

    /// Counts `n` refused heartbeat entries and the error answering them.
    fn refused(&self, n: usize, got: usize, reason: Refused) -> Error {
        self.cluster
            .metrics
            .heartbeats_refused_total
            .get_or_create(&HeartbeatRefusedLabels {
                reason: reason.reason(),
            })
            .inc_by(n as u64);
        tracing::debug!(refused = n, got, %reason, "refusing heartbeats");
        Error::HeartbeatsRefused {
            refused: n,
            got,
            reason,
        }
    }

    fn forward_heartbeats(self: &Arc<Self>, req: api::HeartbeatRequest, router: String) {
        let ring = self.cluster.ring.current();
        let (targets, chain) = forward_plan(ring.sorted_members(), &req.forwarded_for, &self.config.pod_ip);
        if targets.is_empty() {
            return;
        }
        let core = self.clone();
        self.shutdown.spawn("forward-heartbeats", async move {
            let limit = Arc::new(Semaphore::new(FORWARD_CONCURRENCY));
            let mut set = tokio::task::JoinSet::new();
            for target in targets {
                let fwd = api::HeartbeatRequest {
                    router_ip: Some(router.clone()),
                    heartbeats: req.heartbeats.clone(),
                    forwarded_for: chain.clone(),
                };
                let core = core.clone();
                let limit = limit.clone();
                set.spawn(async move {
                    let Ok(_permit) = limit.acquire_owned().await else {
                        return;
                    };
                    if let Err(e) = core.peers.heartbeat(&target, fwd, FORWARD_DEADLINE).await {
                        tracing::warn!(peer = %target, error = %e, "failed to forward heartbeats");
                    }
                });
            }
            while set.join_next().await.is_some() {}
        });
    }

    /// `ReleaseInstance`: deletes a Skipper-assigned pod of the instance's
    /// function; a pod that is already gone is success. Correct on any
    /// controller: a pod this controller's cache does not show as the
    /// function's (a claim it has not seen yet) is read from the API server,
    /// and the delete carries the pod's UID as a precondition, so a pod that
    /// was replaced under the same name is never deleted.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` without name or namespace or for an unmanaged
    /// namespace, `FAILED_PRECONDITION` for a pod that is not assigned to
    /// the instance's tenant.
    pub async fn release(&self, i: Option<&api::Instance>) -> Result<()> {
        let i = i.ok_or(Error::MissingInstance)?;
        let name = i
            .name
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(Error::MissingInstance)?;
        let function = i.function.as_ref();
        let namespace = function
            .and_then(|f| f.namespace.clone())
            .filter(|n| !n.is_empty())
            .ok_or(Error::MissingInstance)?;
        let tenant = function.and_then(|f| f.tenant.clone()).filter(|t| !t.is_empty());
        let belongs =
            |pod: &k8s_openapi::api::core::v1::Pod| match (super::kube::label(pod, LABEL_TENANT), &tenant) {
                (Some(have), Some(want)) => have == want,
                (Some(_), None) => true,
                (None, _) => false,
            };
        let ns = self.cluster.namespace(&namespace)?;
        let pod = match ns.pods.get(&name).filter(|p| belongs(p)) {
            Some(p) => p,
            None => match ns.writer.fetch(&name).await? {
                Some(p) => Arc::new(p),
                None => return Ok(()),
            },
        };
        if !belongs(&pod) {
            return Err(Error::NotAssigned { namespace, name });
        }
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if uid.is_empty() {
            ns.writer.delete(&name).await?;
        } else {
            ns.writer.delete_exact(&name, &uid).await?;
        }
        Ok(())
    }

    /// This controller's state: the supervisors it owns (all of them when
    /// `all`), its ring, events and configuration.
    pub async fn local_state(&self, all: bool) -> api::ClusterState {
        let ring = self.cluster.ring.current();
        let mut supervisors = Vec::new();
        for h in self.supervisors.handles() {
            let f = h.shared.spec();
            let owner = ring.owner(h.id).unwrap_or_default().to_owned();
            if !all && owner != self.config.pod_ip {
                continue;
            }
            let instances = self.cluster.read_instances(&f, false).await.unwrap_or_default();
            let router_heartbeats = h.shared.with_heartbeats(|s| {
                s.iter()
                    .map(|(router, r)| api::HeartbeatState {
                        router_ip: Some(router.to_owned()),
                        heartbeat: Some(api::Heartbeat {
                            function: Some(f.as_ref().into()),
                            timestamp: Some(r.timestamp.into()),
                            in_flight_requests: Some(r.in_flight),
                        }),
                    })
                    .collect()
            });
            let active = self
                .cluster
                .state
                .namespace(&f.namespace)
                .and_then(|ns| ns.replica_sets.active_for(&f.deployment));
            supervisors.push(api::SupervisorState {
                function: Some(f.as_ref().into()),
                instances: instances.iter().map(Instance::to_api).collect(),
                router_heartbeats,
                responsible_controller_ip: Some(owner),
                active_replica_set: active,
                recent_recommendations: h
                    .shared
                    .recommendations()
                    .iter()
                    .map(super::supervisor::Recommendation::to_api)
                    .collect(),
            });
        }
        let events = self
            .cluster
            .events
            .snapshot()
            .into_iter()
            .map(|e| api::Event {
                timestamp: Some(e.timestamp.into()),
                function: Some((&e.function).into()),
                r#type: Some(e.kind as i32),
                message: Some(e.message),
                severity: Some(e.severity as i32),
            })
            .collect();
        api::ClusterState {
            pod_ip: Some(self.config.pod_ip.clone()),
            started_at: Some(self.cluster.started_at.into()),
            controller_ips: ring.sorted_members().iter().map(|s| s.to_string()).collect(),
            supervisors,
            events,
            config: self
                .config
                .describe()
                .into_iter()
                .map(|(n, v, d)| api::ConfigValue {
                    name: Some(n.to_owned()),
                    value: Some(v),
                    description: Some(d.to_owned()),
                })
                .collect(),
        }
    }

    /// `GetClusterState`: with `local_only`, this controller's view of every
    /// local supervisor; otherwise aggregated across the ring, each
    /// controller contributing the supervisors it owns.
    pub async fn cluster_state(&self, local_only: bool) -> api::ClusterState {
        if local_only {
            return self.local_state(true).await;
        }
        let mut state = self.local_state(false).await;
        let ring = self.cluster.ring.current();
        let peers: Vec<String> = ring
            .sorted_members()
            .iter()
            .map(|s| s.to_string())
            .filter(|ip| *ip != self.config.pod_ip)
            .collect();
        let answers = futures::future::join_all(peers.iter().map(|ip| self.peers.cluster_state(ip))).await;
        let mut seen: HashSet<FunctionId> = state
            .supervisors
            .iter()
            .filter_map(|s| s.function.as_ref().map(|f| Function::from(f).id()))
            .collect();
        for (ip, answer) in peers.iter().zip(answers) {
            match answer {
                Ok(peer) => {
                    for s in peer.supervisors {
                        let id = s.function.as_ref().map(|f| Function::from(f).id());
                        let owned = s.responsible_controller_ip.as_deref() == Some(ip.as_str());
                        if owned && id.is_some_and(|id| seen.insert(id)) {
                            state.supervisors.push(s);
                        }
                    }
                    state.events.extend(peer.events);
                }
                Err(e) => tracing::warn!(peer = %ip, error = %e, "failed to get cluster state from peer"),
            }
        }
        let key = |e: &api::Event| e.timestamp.map(|t| (t.seconds, t.nanos)).unwrap_or_default();
        state.events.sort_by_key(|e| std::cmp::Reverse(key(e)));
        state.events.truncate(events::CAPACITY);
        state
    }
}

/// Picks an instance: the newest `max_instances` ready ones, minus the
/// exclusions unless that leaves none, uniformly at random.
fn choose(f: &Function, mut ready: Vec<Instance>, exclude: &[String]) -> Option<Instance> {
    if ready.is_empty() {
        return None;
    }
    let max = f.scale_or_default().max_instances().max(1) as usize;
    if ready.len() > max {
        ready.sort_by_key(|i| std::cmp::Reverse(i.assigned_at));
        ready.truncate(max);
    }
    if !exclude.is_empty() {
        let kept: Vec<Instance> = ready
            .iter()
            .filter(|i| !exclude.contains(&i.name))
            .cloned()
            .collect();
        if kept.is_empty() {
            tracing::warn!(function = %f.id(), "every ready instance is excluded; ignoring the exclusions");
        } else {
            ready = kept;
        }
    }
    ready.choose(&mut rand::rng()).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(name: &str, age: u64) -> Instance {
        Instance {
            namespace: "ns".into(),
            name: name.into(),
            function: Arc::new(Function::default()),
            replica_set: "rs".into(),
            assigned_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1000 - age),
            ready_at: Some(SystemTime::UNIX_EPOCH),
            addr: "1.2.3.4:80".into(),
            cpu_milli: 0,
            memory_mib: 0,
            protocol: Default::default(),
            assign_timing: None,
        }
    }

    fn f(max: u32) -> Function {
        Function {
            scale: Some(crate::domain::Scale {
                max_instances: Some(max),
                ..Default::default()
            }),
            ..Function::default()
        }
    }

    #[test]
    fn choice_honours_max_and_exclusions() {
        assert!(choose(&f(1), vec![], &[]).is_none());
        for _ in 0..20 {
            let c = choose(&f(1), vec![inst("old", 10), inst("new", 1)], &[]).unwrap();
            assert_eq!(c.name, "new", "only the newest max_instances are used");
            let c = choose(&f(3), vec![inst("a", 1), inst("b", 2)], &["a".into()]).unwrap();
            assert_eq!(c.name, "b");
        }
        let c = choose(&f(3), vec![inst("a", 1)], &["a".into()]).unwrap();
        assert_eq!(c.name, "a", "excluding everything keeps everything");
    }
}
