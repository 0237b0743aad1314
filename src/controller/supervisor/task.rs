//! The supervisor actor: converge ticks and `Scale` commands, one at a time.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tracing::Instrument;

use super::converge::{self, Decision, TickInput, TickPlan, Window};
use super::{Command, Context, Handle, Registry, Scaled};
use crate::api::{EventSeverity, EventType};
use crate::controller::error::{Error, Result};
use crate::controller::heartbeat::Store;
use crate::controller::kube::Instance;
use crate::domain::{Function, FunctionId};

/// The actor's own state.
#[derive(Debug, Default)]
struct Actor {
    window: Window,
    had_instances: bool,
}

/// Runs the actor until it decides to stop, is cancelled or panics, then
/// removes its own handle and answers the commands still waiting.
pub(super) async fn run<C: Context>(registry: Registry<C>, handle: Handle) {
    contain(handle.id, actor_loop(&registry, &handle)).await;
    let waiting = handle.shared.mailbox.close();
    // Boxed: the map's removal future is larger than the actor's loop, and
    // the task is as large as its largest state for the supervisor's life.
    Box::pin(registry.remove(&handle)).await;
    for Command::Scale { reply, .. } in waiting {
        let _ = reply.send(Err(Error::SupervisorStopped));
    }
}

/// Runs `fut`, catching a panic: it is logged and ends only this future.
/// Resolves to whether `fut` completed without panicking. A combinator, not
/// an `async fn`: one would hold `fut` twice (as its argument and inside
/// the future it awaits), and a supervisor's task holds this for its life.
pub(super) fn contain(
    id: FunctionId,
    fut: impl std::future::Future<Output = ()>,
) -> impl std::future::Future<Output = bool> {
    std::panic::AssertUnwindSafe(fut)
        .catch_unwind()
        .map(move |outcome| match outcome {
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
        })
}

/// The loop keeps only what an idle supervisor needs across awaits; the
/// tick and the command execution are boxed while they run.
async fn actor_loop<C: Context>(registry: &Registry<C>, handle: &Handle) {
    let ctx = registry.context();
    let token = &registry.inner.token;
    let interval = ctx.settings().scale_interval;
    let mut actor = Actor::default();
    let mut next_tick = Instant::now() + jittered(interval);
    loop {
        while let Some(Command::Scale {
            decision,
            deadline,
            reply,
            span,
        }) = handle.shared.mailbox.pop()
        {
            let f = handle.shared.spec();
            tokio::select! {
                biased;
                () = token.cancelled() => {
                    let _ = reply.send(Err(Error::ShuttingDown));
                    return;
                }
                result = Box::pin(scale_locally(ctx.as_ref(), &f, &decision, deadline).instrument(span)) => {
                    let _ = reply.send(result);
                }
            }
        }
        tokio::select! {
            biased;
            () = token.cancelled() => return,
            () = handle.shared.mailbox.woken() => {}
            () = tokio::time::sleep_until(next_tick) => {
                next_tick = Instant::now() + jittered(interval);
                let result = tokio::select! {
                    biased;
                    () = token.cancelled() => return,
                    r = Box::pin(tick(ctx.as_ref(), handle, &mut actor)) => r,
                };
                match result {
                    Ok(Ticked::Stop) => return,
                    Ok(Ticked::Continue) => {}
                    // Again once the waiting commands are served.
                    Ok(Ticked::Interrupted) => next_tick = Instant::now(),
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
        .map(|i| converge::Observed {
            name: i.name.clone(),
            assigned_at: i.assigned_at,
            ready_at: i.ready_at,
            cpu_milli: i.cpu_milli,
            memory_mib: i.memory_mib,
        })
        .collect()
}

/// How a converge tick ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ticked {
    /// The supervisor runs on.
    Continue,
    /// The supervisor stops.
    Stop,
    /// A scale-up's wait for a pool pod ended before it acted: a command
    /// arrived or the spec changed. The tick runs again after the commands.
    Interrupted,
}

/// One converge tick. A tick with nothing to do (the common case)
/// allocates nothing that outlives it and opens no span; one that acts runs
/// in a span, boxed, after a scale-up's wait for a pool pod (see
/// [`Context::wait_for_pool_pod`]).
async fn tick<C: Context>(ctx: &C, handle: &Handle, actor: &mut Actor) -> Result<Ticked> {
    let f = handle.shared.spec();
    let instances = ctx.instances(&f).await?;
    let (plan, scale_up_only) = match decide(ctx, handle, actor, &f, &instances) {
        Next::Done { stop: true } => return Ok(Ticked::Stop),
        Next::Done { stop: false } => return Ok(Ticked::Continue),
        Next::Act { plan, scale_up_only } => (plan, scale_up_only),
    };
    // A scale-up waits for a pool pod before it acts, in this small frame
    // and outside any span: a function whose pool has no pod spends its
    // ticks waiting, and holds little while it does. Nothing is done yet,
    // so a command or a new spec ends the wait, and a controller that no
    // longer owns the function once it ends does not act. The assignment's
    // deadline counts from the start of the wait.
    let deadline = if scale_up_only {
        let deadline = Instant::now() + ctx.settings().scale.assign_timeout;
        tokio::select! {
            biased;
            () = news(handle, &f) => return Ok(Ticked::Interrupted),
            () = ctx.wait_for_pool_pod(&f, deadline) => {}
        }
        if !ctx.is_owner(handle.id) {
            return Ok(Ticked::Continue);
        }
        Some(deadline)
    } else {
        None
    };
    // Each tick that acts is a trace of its own.
    let span = tracing::info_span!(parent: None, "controller.supervisor.converge", function = %handle.id);
    let stop = Box::pin(act(ctx, &f, plan, instances, deadline).instrument(span)).await?;
    Ok(if stop { Ticked::Stop } else { Ticked::Continue })
}

/// Resolves once a command waits in the mailbox or the spec is no longer
/// `f` (either wakes the actor).
async fn news(handle: &Handle, f: &Arc<Function>) {
    let shared = &handle.shared;
    while !shared.mailbox.has_commands() && Arc::ptr_eq(&shared.spec(), f) {
        shared.mailbox.woken().await;
    }
}

/// What a tick does once it has planned.
enum Next {
    /// Nothing more; whether the supervisor stops.
    Done { stop: bool },
    /// Carry out `plan`; `scale_up_only` when its only work is a scale-up.
    Act { plan: TickPlan, scale_up_only: bool },
}

/// Plans a tick over `instances` and records its recommendation. Not
/// async: what planning needs stays out of the tick's future, which a
/// waiting supervisor holds.
fn decide<C: Context>(
    ctx: &C,
    handle: &Handle,
    actor: &mut Actor,
    f: &Function,
    instances: &[Instance],
) -> Next {
    if instances.is_empty() {
        if actor.had_instances {
            handle.shared.with_heartbeats(Store::clear);
        }
    } else {
        actor.had_instances = true;
    }
    let now = ctx.now();
    let timeout = ctx.settings().scale.heartbeat_timeout;
    let combined = handle.shared.with_heartbeats(|s| {
        // Reports of routers that went quiet stop counting against them.
        s.expire(now, timeout);
        s.combined(instances.iter().map(|i| i.assigned_at))
    });
    let observed = observe(instances);
    let input = TickInput {
        function: f,
        instances: &observed,
        heartbeat: combined,
        now,
        started_at: ctx.started_at(),
        owner: ctx.is_owner(f.id()),
    };
    let plan = converge::plan_tick(&input, &mut actor.window, &ctx.settings().scale);
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
    // Whether the tick acts, and whether its only work is a scale-up.
    let (busy, scale_up_only) = match &plan {
        TickPlan::Idle { .. } => (false, false),
        TickPlan::OneshotCleanup { .. } => (true, false),
        TickPlan::Act {
            decision,
            event,
            stuck,
            replace_stale,
            ..
        } => {
            let quiet = event.is_none() && stuck.is_empty();
            let execution = converge::execute(f, decision, &observed);
            let scale_up = matches!(execution, converge::Execution::ScaleUp { .. });
            let busy = !quiet
                || !matches!(
                    execution,
                    converge::Execution::Noop | converge::Execution::Guarded
                )
                || (*replace_stale && instances.iter().any(|i| is_stale(ctx, f, i)));
            (busy, quiet && scale_up)
        }
    };
    match plan {
        TickPlan::Idle { stop, .. } => Next::Done { stop },
        TickPlan::Act { stop, .. } if !busy => Next::Done { stop },
        plan => Next::Act { plan, scale_up_only },
    }
}

/// Whether `i` is replaced one for one ([`converge::staleness`]).
fn is_stale<C: Context>(ctx: &C, f: &Function, i: &Instance) -> bool {
    let ready = i.ready_at.is_some();
    converge::staleness(
        &i.function,
        f,
        ready,
        ready && ctx.replica_set_retired(f, &i.replica_set),
    )
    .is_some()
}

/// Carries out a tick's plan other than [`TickPlan::Idle`]; an assignment
/// waits for a pool pod until `deadline` (by default the assign timeout
/// from the execution on).
async fn act<C: Context>(
    ctx: &C,
    f: &Function,
    plan: TickPlan,
    mut instances: Vec<Instance>,
    deadline: Option<Instant>,
) -> Result<bool> {
    match plan {
        TickPlan::Idle { stop, .. } => Ok(stop),
        TickPlan::OneshotCleanup { delete } => {
            for name in delete {
                if let Err(e) = ctx.delete(f, &name).await {
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
                ctx.event(f, ev.kind, ev.severity, ev.message);
            }
            for name in stuck {
                tracing::warn!(pod = %name, "terminating instance stuck in assigned state");
                match ctx.delete(f, &name).await {
                    Ok(_) => {
                        ctx.event(
                            f,
                            EventType::StuckInstanceCleanup,
                            EventSeverity::Warn,
                            format!("terminated stuck instance {name}"),
                        );
                        instances.retain(|i| i.name != name);
                    }
                    Err(e) => tracing::warn!(pod = %name, error = %e, "failed to delete stuck instance"),
                }
            }
            let deadline = deadline.unwrap_or_else(|| Instant::now() + ctx.settings().scale.assign_timeout);
            let after = execute(ctx, f, &decision, instances, deadline).await?;
            if replace_stale {
                replace_stale_instances(ctx, f, after).await;
            }
            Ok(stop)
        }
    }
}

/// Reads the instances and executes `decision` (the `Scale` path); answers
/// the ready instances afterwards.
#[tracing::instrument(name = "controller.supervisor.command", skip_all, fields(function = %f.id()))]
async fn scale_locally<C: Context>(
    ctx: &C,
    f: &Function,
    decision: &Decision,
    deadline: Instant,
) -> Result<Vec<Instance>> {
    let instances = ctx.instances(f).await?;
    let after = execute(ctx, f, decision, instances, deadline).await?;
    Ok(after.into_iter().filter(|i| i.ready_at.is_some()).collect())
}

/// Executes a decision over `instances`; returns the instances afterwards.
async fn execute<C: Context>(
    ctx: &C,
    f: &Function,
    decision: &Decision,
    mut instances: Vec<Instance>,
    deadline: Instant,
) -> Result<Vec<Instance>> {
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
            ctx.count(f, Scaled::Up, u64::from(count));
            ctx.event(
                f,
                EventType::ScaleUp,
                EventSeverity::Info,
                format!("scaling up from {ready} to {} instances", decision.desired),
            );
            for _ in 0..count {
                let inst = ctx.assign(f, deadline).await?;
                ctx.event(
                    f,
                    EventType::PodAssigned,
                    EventSeverity::Info,
                    format!("assigned pod {}", inst.name),
                );
                instances.push(inst);
            }
        }
        converge::Execution::ScaleDown { delete } => {
            ctx.event(
                f,
                EventType::ScaleDown,
                EventSeverity::Info,
                format!(
                    "scaling down from {} to {} instances",
                    instances.len(),
                    decision.desired
                ),
            );
            ctx.count(f, Scaled::Down, delete.len() as u64);
            // Routers stop choosing the ready ones first; their pods go once
            // routers report them idle (or the drain deadline passes).
            let ready_names: Vec<String> = delete
                .iter()
                .filter(|n| instances.iter().any(|i| &i.name == *n && i.ready_at.is_some()))
                .cloned()
                .collect();
            ctx.drain(f, &ready_names, Some(deadline)).await;
            let mut failed = None;
            for name in delete {
                match ctx.delete(f, &name).await {
                    Ok(_) => {
                        ctx.event(
                            f,
                            EventType::PodDeleted,
                            EventSeverity::Info,
                            format!("deleted pod {name}"),
                        );
                        instances.retain(|i| i.name != name);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            ctx.undrain(f, &ready_names);
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    Ok(instances)
}

/// Replaces ready instances whose ReplicaSet was scaled to zero or is gone,
/// or that were assigned with other metadata, one for one (spec §5.8).
async fn replace_stale_instances<C: Context>(ctx: &C, f: &Function, instances: Vec<Instance>) {
    let max_plus_one = f.scale_or_default().max_instances().saturating_add(1) as usize;
    let mut total = instances.len();
    for inst in instances.iter().filter(|i| is_stale(ctx, f, i)) {
        if total >= max_plus_one {
            tracing::info!(pod = %inst.name, "skipping stale instance replacement, already at maxInstances+1");
            continue;
        }
        let Some(permit) = ctx.stale_permit() else {
            tracing::debug!(function = %f.id(), "stale replacement deferred: too many in progress");
            return;
        };
        ctx.event(
            f,
            EventType::StaleReplacement,
            EventSeverity::Info,
            format!("replacing stale instance {}", inst.name),
        );
        let deadline = Instant::now() + ctx.settings().scale.assign_timeout;
        let assigned = ctx.assign(f, deadline).await;
        drop(permit);
        if let Err(e) = assigned {
            tracing::warn!(pod = %inst.name, error = %e, "failed to assign replacement pod for stale instance");
            continue;
        }
        total += 1;
        let name = std::slice::from_ref(&inst.name);
        ctx.drain(f, name, None).await;
        match ctx.delete(f, &inst.name).await {
            Ok(_) => total -= 1,
            Err(e) => tracing::warn!(pod = %inst.name, error = %e, "failed to delete stale instance"),
        }
        ctx.undrain(f, name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_supervisor_is_contained() {
        let id = FunctionId(7);
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
