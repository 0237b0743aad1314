//! The pod status the kubelet reports, computed from the states of the
//! pod's containers (pure): phase (the kubelet's `getPhase`), the
//! kubelet-owned conditions (`PodReadyToStartContainers`, `Initialized`,
//! `ContainersReady`, `Ready`, `PodScheduled`) with their reasons and
//! messages, container statuses, QoS class and IPs. Conditions keep their
//! `lastTransitionTime` while their status does not change.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, HostIP, Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::restart::RestartPolicy;

/// A terminated container instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminated {
    pub exit_code: i32,
    pub signal: Option<i32>,
    /// `Completed`, `Error`, `StartError`, ...
    pub reason: String,
    pub message: Option<String>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Timestamp,
    pub container_id: Option<String>,
}

/// What a container is doing now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Waiting { reason: String, message: Option<String> },
    Running { started_at: Timestamp },
    Terminated(Terminated),
}

/// One container as the runtime sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub state: State,
    pub last_terminated: Option<Terminated>,
    pub restart_count: i32,
    pub ready: bool,
    pub started: bool,
    pub container_id: Option<String>,
}

/// Everything the status is computed from.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    /// The pod as the API server has it (spec, previous status).
    pub pod: &'a Pod,
    /// `spec.initContainers`, in order.
    pub init: &'a [ContainerView],
    /// `spec.containers`, in order.
    pub containers: &'a [ContainerView],
    /// The sandbox (directories, IP, volumes) is set up.
    pub sandbox_ready: bool,
    pub pod_ip: Option<String>,
    pub host_ip: String,
    pub start_time: Option<Timestamp>,
    /// No container of the pod runs or will run again.
    pub terminal: bool,
    pub now: Timestamp,
}

fn terminated_api(t: &Terminated) -> ContainerStateTerminated {
    ContainerStateTerminated {
        exit_code: t.exit_code,
        signal: t.signal,
        reason: Some(t.reason.clone()),
        message: t.message.clone(),
        started_at: t.started_at.map(Time),
        finished_at: Some(Time(t.finished_at)),
        container_id: t.container_id.clone(),
    }
}

fn state_api(s: &State) -> ContainerState {
    match s {
        State::Waiting { reason, message } => ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some(reason.clone()),
                message: message.clone(),
            }),
            ..ContainerState::default()
        },
        State::Running { started_at } => ContainerState {
            running: Some(ContainerStateRunning {
                started_at: Some(Time(*started_at)),
            }),
            ..ContainerState::default()
        },
        State::Terminated(t) => ContainerState {
            terminated: Some(terminated_api(t)),
            ..ContainerState::default()
        },
    }
}

fn status_api(c: &ContainerView) -> ContainerStatus {
    ContainerStatus {
        name: c.name.clone(),
        image: c.image.clone(),
        image_id: String::new(),
        container_id: c.container_id.clone(),
        ready: c.ready,
        started: Some(c.started),
        restart_count: c.restart_count,
        state: Some(state_api(&c.state)),
        last_state: Some(
            c.last_terminated
                .as_ref()
                .map_or_else(ContainerState::default, |t| ContainerState {
                    terminated: Some(terminated_api(t)),
                    ..ContainerState::default()
                }),
        ),
        ..ContainerStatus::default()
    }
}

fn is_sidecar(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

/// The kubelet's `getPhase`.
#[must_use]
pub fn phase(
    pod: &Pod,
    init: &[ContainerView],
    containers: &[ContainerView],
    terminal: bool,
) -> &'static str {
    let spec = pod.spec.as_ref();
    let policy = RestartPolicy::parse(spec.and_then(|s| s.restart_policy.as_deref()));
    let init_specs = spec.and_then(|s| s.init_containers.as_deref()).unwrap_or(&[]);
    let (mut pending_init, mut failed_init) = (0, 0);
    let (mut waiting, mut running, mut stopped, mut succeeded) = (0, 0, 0, 0);
    for (spec, c) in init_specs.iter().zip(init) {
        if is_sidecar(spec) {
            match &c.state {
                State::Running { .. } => {
                    if !c.started {
                        pending_init += 1;
                    }
                }
                State::Terminated(_) => {}
                State::Waiting { .. } => {
                    if c.last_terminated.is_none() {
                        pending_init += 1;
                        waiting += 1;
                    }
                }
            }
            continue;
        }
        match &c.state {
            State::Running { .. } => pending_init += 1,
            State::Terminated(t) => {
                if t.exit_code != 0 {
                    failed_init += 1;
                }
            }
            State::Waiting { .. } => match &c.last_terminated {
                Some(t) if t.exit_code != 0 => failed_init += 1,
                Some(_) => {}
                None => pending_init += 1,
            },
        }
    }
    for c in containers {
        match &c.state {
            State::Running { .. } => running += 1,
            State::Terminated(t) => {
                stopped += 1;
                if t.exit_code == 0 {
                    succeeded += 1;
                }
            }
            State::Waiting { .. } => {
                if c.last_terminated.is_some() {
                    stopped += 1;
                } else {
                    waiting += 1;
                }
            }
        }
    }
    if failed_init > 0 && policy == RestartPolicy::Never {
        return "Failed";
    }
    let regular_started = containers
        .iter()
        .any(|c| !matches!(c.state, State::Waiting { .. }) || c.last_terminated.is_some());
    if (pending_init > 0 && !regular_started) || waiting > 0 {
        return "Pending";
    }
    if running > 0 {
        return "Running";
    }
    if stopped > 0 {
        if terminal {
            return if stopped == succeeded {
                "Succeeded"
            } else {
                "Failed"
            };
        }
        return match policy {
            RestartPolicy::Always => "Running",
            _ if stopped == succeeded => "Succeeded",
            RestartPolicy::Never => "Failed",
            RestartPolicy::OnFailure => "Running",
        };
    }
    "Pending"
}

/// The QoS class: `Guaranteed` when every container's CPU and memory
/// requests equal their limits, `BestEffort` when none has any, else `Burstable`.
#[must_use]
pub fn qos_class(pod: &Pod) -> &'static str {
    let Some(spec) = pod.spec.as_ref() else {
        return "BestEffort";
    };
    let all: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    let mut any = false;
    let mut guaranteed = true;
    for c in &all {
        let r = c.resources.as_ref();
        let requests = r.and_then(|r| r.requests.as_ref());
        let limits = r.and_then(|r| r.limits.as_ref());
        for res in ["cpu", "memory"] {
            let limit = limits.and_then(|l| l.get(res));
            let request = requests.and_then(|q| q.get(res)).or(limit);
            any |= limit.is_some() || request.is_some();
            if limit.is_none() || request != limit {
                guaranteed = false;
            }
        }
    }
    if !any {
        "BestEffort"
    } else if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

fn condition(
    old: &BTreeMap<String, PodCondition>,
    now: Timestamp,
    kind: &str,
    ok: bool,
    reason: Option<&str>,
    message: Option<String>,
) -> PodCondition {
    let status = if ok { "True" } else { "False" };
    let since = old
        .get(kind)
        .filter(|c| c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    PodCondition {
        type_: kind.to_owned(),
        status: status.to_owned(),
        reason: reason.map(str::to_owned),
        message,
        last_transition_time: Some(since),
        last_probe_time: None,
        observed_generation: None,
    }
}

fn names(list: &[&str]) -> String {
    format!("[{}]", list.join(" "))
}

/// The full pod status.
#[must_use]
pub fn pod_status(input: &Input<'_>) -> PodStatus {
    let pod = input.pod;
    let spec = pod.spec.clone().unwrap_or_default();
    let old_status = pod.status.clone().unwrap_or_default();
    let old: BTreeMap<String, PodCondition> = old_status
        .conditions
        .iter()
        .flatten()
        .map(|c| (c.type_.clone(), c.clone()))
        .collect();
    let mut phase = phase(pod, input.init, input.containers, input.terminal);
    // A pod never leaves a terminal phase.
    if let Some(p @ ("Succeeded" | "Failed")) = old_status.phase.as_deref() {
        phase = if p == "Succeeded" { "Succeeded" } else { "Failed" };
    }
    let succeeded = phase == "Succeeded";
    let now = input.now;
    let init_specs = spec.init_containers.clone().unwrap_or_default();

    let incomplete: Vec<&str> = init_specs
        .iter()
        .zip(input.init)
        .filter(|(s, c)| {
            if is_sidecar(s) {
                !c.started
            } else {
                !matches!(&c.state, State::Terminated(t) if t.exit_code == 0)
            }
        })
        .map(|(_, c)| c.name.as_str())
        .collect();
    let regular_started = input
        .containers
        .iter()
        .any(|c| !matches!(c.state, State::Waiting { .. }) || c.last_terminated.is_some());
    let initialized = incomplete.is_empty() || regular_started || succeeded;
    let initialized_cond = if initialized {
        condition(
            &old,
            now,
            "Initialized",
            true,
            succeeded.then_some("PodCompleted"),
            None,
        )
    } else {
        condition(
            &old,
            now,
            "Initialized",
            false,
            Some("ContainersNotInitialized"),
            Some(format!(
                "containers with incomplete status: {}",
                names(&incomplete)
            )),
        )
    };

    let unready: Vec<&str> = init_specs
        .iter()
        .zip(input.init)
        .filter(|(s, c)| is_sidecar(s) && !c.ready)
        .map(|(_, c)| c.name.as_str())
        .chain(
            input
                .containers
                .iter()
                .filter(|c| !c.ready)
                .map(|c| c.name.as_str()),
        )
        .collect();
    let (containers_ready, ready) = if succeeded {
        let c = |kind| condition(&old, now, kind, false, Some("PodCompleted"), None);
        (c("ContainersReady"), c("Ready"))
    } else if unready.is_empty() {
        let c = |kind| condition(&old, now, kind, true, None, None);
        (c("ContainersReady"), c("Ready"))
    } else {
        let message = format!("containers with unready status: {}", names(&unready));
        let c = |kind| {
            condition(
                &old,
                now,
                kind,
                false,
                Some("ContainersNotReady"),
                Some(message.clone()),
            )
        };
        (c("ContainersReady"), c("Ready"))
    };
    let ready = readiness_gates(&spec, &old, ready, now);

    let mut conditions: Vec<PodCondition> = old_status
        .conditions
        .iter()
        .flatten()
        .filter(|c| {
            !matches!(
                c.type_.as_str(),
                "PodReadyToStartContainers" | "Initialized" | "ContainersReady" | "Ready" | "PodScheduled"
            )
        })
        .cloned()
        .collect();
    conditions.push(condition(
        &old,
        now,
        "PodReadyToStartContainers",
        input.sandbox_ready && !input.terminal,
        None,
        None,
    ));
    conditions.push(initialized_cond);
    conditions.push(ready);
    conditions.push(containers_ready);
    conditions.push(condition(&old, now, "PodScheduled", true, None, None));

    let pod_ips = input.pod_ip.as_ref().map(|ip| vec![PodIP { ip: ip.clone() }]);
    PodStatus {
        phase: Some(phase.to_owned()),
        conditions: Some(conditions),
        host_ip: Some(input.host_ip.clone()),
        host_ips: Some(vec![HostIP {
            ip: input.host_ip.clone(),
        }]),
        pod_ip: input.pod_ip.clone(),
        pod_ips,
        start_time: input.start_time.map(Time),
        qos_class: Some(qos_class(pod).to_owned()),
        container_statuses: Some(input.containers.iter().map(status_api).collect()),
        init_container_statuses: (!input.init.is_empty())
            .then(|| input.init.iter().map(status_api).collect()),
        reason: old_status.reason,
        message: old_status.message,
        ..PodStatus::default()
    }
}

/// `Ready` also waits for every `readinessGates` condition to be `True`.
fn readiness_gates(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    old: &BTreeMap<String, PodCondition>,
    ready: PodCondition,
    now: Timestamp,
) -> PodCondition {
    if ready.status != "True" {
        return ready;
    }
    for gate in spec.readiness_gates.iter().flatten() {
        let kind = &gate.condition_type;
        match old.get(kind) {
            Some(c) if c.status == "True" => {}
            Some(_) => {
                return condition(
                    old,
                    now,
                    "Ready",
                    false,
                    Some("ReadinessGatesNotReady"),
                    Some(format!(
                        "the status of pod readiness gate {kind:?} is not \"True\", but False"
                    )),
                );
            }
            None => {
                return condition(
                    old,
                    now,
                    "Ready",
                    false,
                    Some("ReadinessGatesNotReady"),
                    Some(format!(
                        "corresponding condition of pod readiness gate {kind:?} does not exist."
                    )),
                );
            }
        }
    }
    ready
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    fn view(name: &str, state: State) -> ContainerView {
        ContainerView {
            name: name.into(),
            image: "img".into(),
            ready: matches!(state, State::Running { .. }),
            started: matches!(state, State::Running { .. }),
            state,
            last_terminated: None,
            restart_count: 0,
            container_id: None,
        }
    }

    fn t() -> Timestamp {
        Timestamp::UNIX_EPOCH
    }

    fn running() -> State {
        State::Running { started_at: t() }
    }

    fn waiting(reason: &str) -> State {
        State::Waiting {
            reason: reason.into(),
            message: None,
        }
    }

    fn exited(code: i32) -> State {
        State::Terminated(Terminated {
            exit_code: code,
            signal: None,
            reason: if code == 0 { "Completed" } else { "Error" }.into(),
            message: None,
            started_at: Some(t()),
            finished_at: t(),
            container_id: None,
        })
    }

    fn crashed(mut v: ContainerView, code: i32) -> ContainerView {
        let State::Terminated(term) = exited(code) else {
            unreachable!()
        };
        v.last_terminated = Some(term);
        v.state = waiting("CrashLoopBackOff");
        v.ready = false;
        v.started = false;
        v
    }

    #[test]
    fn phase_table() {
        let always = pod(json!({"containers": [{"name": "a"}, {"name": "b"}]}));
        let never = pod(json!({"restartPolicy": "Never", "containers": [{"name": "a"}, {"name": "b"}]}));
        let on_failure =
            pod(json!({"restartPolicy": "OnFailure", "containers": [{"name": "a"}, {"name": "b"}]}));
        let cases = [
            (
                &always,
                vec![view("a", waiting("ContainerCreating")), view("b", running())],
                "Pending",
            ),
            (
                &always,
                vec![view("a", running()), view("b", running())],
                "Running",
            ),
            (
                &always,
                vec![crashed(view("a", running()), 1), view("b", running())],
                "Running",
            ),
            (
                &always,
                vec![crashed(view("a", running()), 1), crashed(view("b", running()), 0)],
                "Running",
            ),
            (
                &never,
                vec![view("a", exited(0)), view("b", exited(0))],
                "Succeeded",
            ),
            (&never, vec![view("a", exited(0)), view("b", exited(2))], "Failed"),
            (
                &never,
                vec![view("a", exited(0)), view("b", running())],
                "Running",
            ),
            (
                &on_failure,
                vec![view("a", exited(0)), view("b", exited(0))],
                "Succeeded",
            ),
            (
                &on_failure,
                vec![view("a", exited(0)), crashed(view("b", running()), 1)],
                "Running",
            ),
        ];
        for (i, (p, containers, want)) in cases.into_iter().enumerate() {
            assert_eq!(phase(p, &[], &containers, false), want, "case {i}");
        }
        let stopped = [view("a", exited(0)), view("b", exited(137))];
        assert_eq!(
            phase(&always, &[], &stopped, true),
            "Failed",
            "a deleted pod is terminal"
        );
    }

    #[test]
    fn init_containers_gate_the_phase_and_initialized() {
        let p =
            pod(json!({"initContainers": [{"name": "i1"}, {"name": "i2"}], "containers": [{"name": "a"}]}));
        let init = [view("i1", exited(0)), view("i2", running())];
        let main = [view("a", waiting("PodInitializing"))];
        assert_eq!(phase(&p, &init, &main, false), "Pending");
        let s = pod_status(&Input {
            pod: &p,
            init: &init,
            containers: &main,
            sandbox_ready: true,
            pod_ip: Some("127.0.0.9".into()),
            host_ip: "127.0.0.1".into(),
            start_time: None,
            terminal: false,
            now: t(),
        });
        let cond = |k: &str| {
            s.conditions
                .as_ref()
                .unwrap()
                .iter()
                .find(|c| c.type_ == k)
                .unwrap()
                .clone()
        };
        let init_cond = cond("Initialized");
        assert_eq!(init_cond.status, "False");
        assert_eq!(init_cond.reason.as_deref(), Some("ContainersNotInitialized"));
        assert_eq!(
            init_cond.message.as_deref(),
            Some("containers with incomplete status: [i2]")
        );
        assert_eq!(
            cond("Ready").message.as_deref(),
            Some("containers with unready status: [a]")
        );
        assert_eq!(cond("PodReadyToStartContainers").status, "True");
        assert_eq!(s.init_container_statuses.unwrap().len(), 2);

        let never = pod(
            json!({"restartPolicy": "Never", "initContainers": [{"name": "i1"}], "containers": [{"name": "a"}]}),
        );
        assert_eq!(
            phase(
                &never,
                &[view("i1", exited(1))],
                &[view("a", waiting("PodInitializing"))],
                false
            ),
            "Failed"
        );
        assert_eq!(
            phase(
                &p,
                &[
                    crashed(view("i1", running()), 1),
                    view("i2", waiting("PodInitializing"))
                ],
                &main,
                false
            ),
            "Pending",
            "a failed init container under restartPolicy Always retries"
        );
    }

    #[test]
    fn ready_conditions_name_unready_containers_and_keep_transition_times() {
        let mut p = pod(json!({"containers": [{"name": "a"}, {"name": "b"}]}));
        let mut b = view("b", running());
        b.ready = false;
        let containers = [view("a", running()), b];
        let later = Timestamp::from_second(100).unwrap();
        let input = Input {
            pod: &p,
            init: &[],
            containers: &containers,
            sandbox_ready: true,
            pod_ip: None,
            host_ip: "127.0.0.1".into(),
            start_time: None,
            terminal: false,
            now: later,
        };
        let s = pod_status(&input);
        let ready = s
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(ready.status, "False");
        assert_eq!(
            ready.message.as_deref(),
            Some("containers with unready status: [b]")
        );
        assert_eq!(s.phase.as_deref(), Some("Running"));
        // Unchanged status keeps the old transition time.
        p.status = Some(s.clone());
        let even_later = Timestamp::from_second(200).unwrap();
        let again = pod_status(&Input {
            pod: &p,
            init: &[],
            containers: &containers,
            sandbox_ready: true,
            pod_ip: None,
            host_ip: "127.0.0.1".into(),
            start_time: None,
            terminal: false,
            now: even_later,
        });
        let ready = again
            .conditions
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(ready.last_transition_time, Some(Time(later)));
    }

    #[test]
    fn qos_classes() {
        let q = |spec| qos_class(&pod(spec));
        assert_eq!(q(json!({"containers": [{"name": "a"}]})), "BestEffort");
        assert_eq!(
            q(json!({"containers": [{"name": "a", "resources": {"requests": {"cpu": "10m"}}}]})),
            "Burstable"
        );
        assert_eq!(
            q(json!({"containers": [{"name": "a", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}]})),
            "Guaranteed"
        );
    }
}
