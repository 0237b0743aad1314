//! The supervisor actor: converge ticks and `Scale` commands, one at a time.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::converge::{self, Decision, TickInput, TickPlan, Window};
use super::{Command, Handle, now};
use crate::api::{EventSeverity, EventType};
use crate::controller::core::Core;
use crate::controller::error::Result;
use crate::controller::kube::Instance;
use crate::controller::metrics::Metrics;
use crate::domain::Function;

/// The actor's own state.
#[derive(Debug, Default)]
struct Actor {
    window: Window,
    had_instances: bool,
}

/// Runs the actor until it decides to stop, is cancelled or panics, then
/// removes its own handle.
pub(super) async fn run(
    core: Arc<Core>,
    handle: Handle,
    mut rx: mpsc::Receiver<Command>,
    cancel: CancellationToken,
) {
    let id = handle.id;
    contain(id, actor_loop(&core, &handle, &mut rx, &cancel)).await;
    rx.close();
    core.supervisors.remove(&handle).await;
    // Answer commands that arrived while stopping so no caller waits in vain.
    while let Ok(Command::Scale { reply, .. }) = rx.try_recv() {
        let _ = reply.send(Err(crate::controller::error::Error::SupervisorStopped));
    }
}

/// Runs `fut`, catching a panic: it is logged and ends only this future.
/// Returns whether `fut` completed without panicking.
pub(super) async fn contain(
    id: crate::domain::FunctionId,
    fut: impl std::future::Future<Output = ()>,
) -> bool {
    match std::panic::AssertUnwindSafe(fut).catch_unwind().await {
        Ok(()) => true,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(function = %id, panic = %msg, "panic in supervisor loop; supervisor stopped");
            false
        }
    }
}

async fn actor_loop(
    core: &Arc<Core>,
    handle: &Handle,
    rx: &mut mpsc::Receiver<Command>,
    cancel: &CancellationToken,
) {
    let interval = core.config.scale_interval;
    let mut actor = Actor::default();
    let mut next_tick = Instant::now() + jittered(interval);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            cmd = rx.recv() => match cmd {
                None => return,
                Some(Command::Scale { decision, deadline, reply }) => {
                    let f = handle.shared.spec();
                    let result = scale_locally(core, &f, &decision, deadline).await;
                    let _ = reply.send(result);
                }
            },
            () = tokio::time::sleep_until(next_tick) => {
                next_tick = Instant::now() + jittered(interval);
                match tick(core, handle, &mut actor).await {
                    Ok(true) => return,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(function = %handle.id, error = %e, "failed to converge"),
                }
            }
        }
    }
}

/// `interval` ± up to 200 ms (never below a tenth of the interval).
fn jittered(interval: Duration) -> Duration {
    let jitter = Duration::from_millis(200).min(interval / 10);
    let nanos = u64::try_from(jitter.as_nanos()).unwrap_or(0);
    if nanos == 0 {
        return interval;
    }
    let offset = rand::random_range(0..=2 * nanos);
    (interval + Duration::from_nanos(offset)).saturating_sub(jitter)
}

fn observe(instances: &[Instance]) -> Vec<converge::Observed> {
    instances
        .iter()
        .map(|i| {
            let s = i.function.scale_or_default();
            converge::Observed {
                name: i.name.clone(),
                assigned_at: i.assigned_at,
                ready_at: i.ready_at,
                cpu_milli: i.cpu_milli,
                memory_mib: i.memory_mib,
                target_cpu_milli: s.target_cpu_usage_milli(),
                target_memory_mib: s.target_memory_usage_mib(),
            }
        })
        .collect()
}

/// One converge tick. Returns whether the supervisor should stop.
#[tracing::instrument(name = "controller.supervisor.converge", skip_all, fields(function = %handle.id))]
async fn tick(core: &Arc<Core>, handle: &Handle, actor: &mut Actor) -> Result<bool> {
    let f = handle.shared.spec();
    let mut instances = core.read_instances(&f, true).await?;
    if instances.is_empty() {
        if actor.had_instances {
            handle
                .shared
                .with_heartbeats(crate::controller::heartbeat::Store::clear);
        }
    } else {
        actor.had_instances = true;
    }
    let combined = handle
        .shared
        .with_heartbeats(|s| s.combined(instances.iter().map(|i| i.assigned_at)));
    let observed = observe(&instances);
    let input = TickInput {
        function: &f,
        instances: &observed,
        heartbeat: combined,
        now: now(),
        started_at: core.started_at,
        owner: core.is_owner(f.id()),
    };
    let plan = converge::plan_tick(&input, &mut actor.window, &core.config.scale);
    let recommended = match &plan {
        TickPlan::Idle { decision, .. } => Some((decision.clone(), false)),
        TickPlan::Act { decision, .. } => Some((decision.clone(), true)),
        TickPlan::OneshotCleanup { .. } => None,
    };
    if let Some((decision, acted)) = recommended {
        handle
            .shared
            .record_recommendation(super::Recommendation::new(input.now, decision, acted));
    }
    match plan {
        TickPlan::Idle { stop, .. } => Ok(stop),
        TickPlan::OneshotCleanup { delete } => {
            let ns = core.namespace(&f.namespace)?;
            for name in delete {
                if let Err(e) = ns.writer.delete(&name).await {
                    tracing::warn!(pod = %name, error = %e, "failed to delete orphaned oneshot pod");
                }
            }
            Ok(true)
        }
        TickPlan::Act {
            decision,
            event,
            stuck,
            replace_stale,
            stop,
        } => {
            if let Some(ev) = event {
                core.events.push(&f, ev.kind, ev.severity, ev.message);
            }
            let ns = core.namespace(&f.namespace)?;
            for name in stuck {
                tracing::warn!(pod = %name, "terminating instance stuck in assigned state");
                match ns.writer.delete(&name).await {
                    Ok(_) => {
                        core.events.push(
                            &f,
                            EventType::StuckInstanceCleanup,
                            EventSeverity::Warn,
                            format!("terminated stuck instance {name}"),
                        );
                        instances.retain(|i| i.name != name);
                    }
                    Err(e) => tracing::warn!(pod = %name, error = %e, "failed to delete stuck instance"),
                }
            }
            let deadline = Instant::now() + core.config.scale.assign_timeout;
            let after = execute(core, &f, &decision, instances, deadline).await?;
            if replace_stale {
                replace_stale_instances(core, &f, after).await;
            }
            Ok(stop)
        }
    }
}

/// Reads the instances and executes `decision` (the `Scale` path).
pub(crate) async fn scale_locally(
    core: &Arc<Core>,
    f: &Function,
    decision: &Decision,
    deadline: Instant,
) -> Result<Vec<Instance>> {
    let instances = core.read_instances(f, true).await?;
    let after = execute(core, f, decision, instances, deadline).await?;
    Ok(after.into_iter().filter(|i| i.ready_at.is_some()).collect())
}

/// Executes a decision over `instances`; returns the instances afterwards.
#[tracing::instrument(name = "controller.supervisor.scale", skip_all, fields(function = %f.id(), desired = decision.desired))]
async fn execute(
    core: &Arc<Core>,
    f: &Function,
    decision: &Decision,
    mut instances: Vec<Instance>,
    deadline: Instant,
) -> Result<Vec<Instance>> {
    let labels = Metrics::function(&f.deployment);
    let max = f.scale_or_default().max_instances();
    if max > 1 && decision.unclamped > decision.desired {
        tracing::info!(function = %f.id(), desired = decision.desired, unclamped = decision.unclamped, "scaling decision was clamped");
    }
    let ready = instances.iter().filter(|i| i.ready_at.is_some()).count();
    match converge::execute(f, decision, &observe(&instances)) {
        converge::Execution::Noop | converge::Execution::Guarded => {}
        converge::Execution::TooMany => {
            tracing::info!(function = %f.id(), "skipping scale up because function has too many instances");
        }
        converge::Execution::ScaleUp { count } => {
            core.metrics
                .scale_ups_total
                .get_or_create(&labels)
                .inc_by(u64::from(count));
            core.events.push(
                f,
                EventType::ScaleUp,
                EventSeverity::Info,
                format!("scaling up from {ready} to {} instances", decision.desired),
            );
            let ns = core.namespace(&f.namespace)?;
            for _ in 0..count {
                let inst = core.assigner.assign(ns, f, deadline).await?;
                core.events.push(
                    f,
                    EventType::PodAssigned,
                    EventSeverity::Info,
                    format!("assigned pod {}", inst.name),
                );
                instances.push(inst);
            }
        }
        converge::Execution::ScaleDown { delete } => {
            core.events.push(
                f,
                EventType::ScaleDown,
                EventSeverity::Info,
                format!(
                    "scaling down from {} to {} instances",
                    instances.len(),
                    decision.desired
                ),
            );
            core.metrics
                .scale_downs_total
                .get_or_create(&labels)
                .inc_by(delete.len() as u64);
            let ns = core.namespace(&f.namespace)?;
            for name in delete {
                ns.writer.delete(&name).await?;
                core.events.push(
                    f,
                    EventType::PodDeleted,
                    EventSeverity::Info,
                    format!("deleted pod {name}"),
                );
                instances.retain(|i| i.name != name);
            }
        }
    }
    Ok(instances)
}

/// Replaces ready instances whose ReplicaSet was scaled to zero or is gone,
/// or whose spec differs from the current one, one for one (spec §5.8).
async fn replace_stale_instances(core: &Arc<Core>, f: &Function, instances: Vec<Instance>) {
    let Ok(ns) = core.namespace(&f.namespace) else {
        return;
    };
    let max_plus_one = f.scale_or_default().max_instances().saturating_add(1) as usize;
    let mut total = instances.len();
    for inst in instances.iter().filter(|i| i.ready_at.is_some()) {
        let rs_stale = match ns.replica_sets.get(&inst.replica_set) {
            Some(rs) => rs.status.as_ref().is_none_or(|s| s.replicas == 0),
            None => ns.replica_sets.is_synced(),
        };
        if !rs_stale && inst.function.same_config(f) {
            continue;
        }
        if total >= max_plus_one {
            tracing::info!(pod = %inst.name, "skipping stale instance replacement, already at maxInstances+1");
            continue;
        }
        let Ok(permit) = core.stale_permits.clone().try_acquire_owned() else {
            tracing::debug!(function = %f.id(), "stale replacement deferred: too many in progress");
            return;
        };
        core.events.push(
            f,
            EventType::StaleReplacement,
            EventSeverity::Info,
            format!("replacing stale instance {}", inst.name),
        );
        let deadline = Instant::now() + core.config.scale.assign_timeout;
        let assigned = core.assigner.assign(ns, f, deadline).await;
        drop(permit);
        if let Err(e) = assigned {
            tracing::warn!(pod = %inst.name, error = %e, "failed to assign replacement pod for stale instance");
            continue;
        }
        total += 1;
        match ns.writer.delete(&inst.name).await {
            Ok(_) => total -= 1,
            Err(e) => tracing::warn!(pod = %inst.name, error = %e, "failed to delete stale instance"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_supervisor_is_contained() {
        let id = crate::domain::FunctionId(7);
        assert!(contain(id, async {}).await);
        let boom = async {
            tokio::task::yield_now().await;
            panic!("converge bug");
        };
        assert!(!contain(id, boom).await, "the panic is caught, not propagated");
    }

    #[test]
    fn jitter_stays_near_the_interval() {
        for _ in 0..1000 {
            let d = jittered(Duration::from_secs(15));
            assert!(
                d >= Duration::from_millis(14_800) && d <= Duration::from_millis(15_200),
                "{d:?}"
            );
            let d = jittered(Duration::from_millis(100));
            assert!(
                d >= Duration::from_millis(90) && d <= Duration::from_millis(110),
                "{d:?}"
            );
        }
    }
}
