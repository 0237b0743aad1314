//! What `skipper dev` watches while it starts: a pod of the playground
//! that fails — a container that exits, or a pool pod that is not Ready
//! within `--pod-ready-timeout` — stops the start at once, naming the pod,
//! how it failed and the last lines of its log; and the logs of a start
//! that failed are kept past the exit (the work directory is removed).

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus, Pod};

/// How many lines of a failed container's log the error shows.
pub const LOG_TAIL_LINES: usize = 15;

/// Which pods of the playground a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A pool pod: any exit during start-up fails it, and so does not being
    /// Ready in time.
    Pool,
    /// A controller pod: an exit of its own fails it; a container stopped
    /// by the node agent (a failed liveness or startup probe, exit code
    /// above 128) restarts and is given the whole `--ready-timeout`.
    Controller,
}

/// How a pod failed during start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A container ended.
    Exited {
        code: i32,
        /// The kubelet's reason (`Error`, `Completed`, `StartError`, ...).
        reason: String,
        /// Why it could not start, when it could not.
        message: String,
    },
    /// A container runs but the pod is not Ready.
    Unready {
        /// How long the container has run.
        running: Duration,
        /// The container's readiness probe (`tcpSocket :8888`), when it has one.
        probe: String,
    },
    /// No container runs yet.
    Waiting {
        /// Since the pod was created.
        waited: Duration,
        /// The waiting reason (`ContainerCreating`, ...) or the pod's phase.
        reason: String,
        /// The kubelet's or scheduler's message, when there is one.
        message: String,
    },
}

/// A pod that failed during start-up, and the container it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodProblem {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The log file of the container instance that failed (by its restart count).
    pub restart: i32,
    pub problem: Problem,
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn since(t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>, now: jiff::Timestamp) -> Duration {
    t.and_then(|t| Duration::try_from(now.duration_since(t.0)).ok())
        .unwrap_or(Duration::ZERO)
}

fn exited(t: &ContainerStateTerminated) -> Problem {
    Problem::Exited {
        code: t.exit_code,
        reason: t.reason.clone().unwrap_or_default(),
        message: t.message.clone().unwrap_or_default(),
    }
}

/// Whether `pod` (not being deleted) has failed its start at `now`:
/// `None` while it is fine or still has time. `ready_timeout` applies to
/// pool pods (from the pod's creation).
#[must_use]
pub fn pod_problem(
    pod: &Pod,
    role: Role,
    now: jiff::Timestamp,
    ready_timeout: Duration,
) -> Option<PodProblem> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref();
    let statuses: Vec<&ContainerStatus> = status
        .into_iter()
        .flat_map(|s| {
            s.init_container_statuses
                .iter()
                .flatten()
                .chain(s.container_statuses.iter().flatten())
        })
        .collect();
    let named = |c: &ContainerStatus, restart: i32, problem: Problem| PodProblem {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        container: c.name.clone(),
        restart,
        problem,
    };
    for c in &statuses {
        // The instance that ended: the current one, or the one before a restart.
        let ended = match c.state.as_ref().and_then(|s| s.terminated.as_ref()) {
            Some(t) => Some((t, c.restart_count)),
            None => c
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .map(|t| (t, c.restart_count - 1)),
        };
        let Some((t, restart)) = ended else { continue };
        // An init container that completed did its job.
        let init = status
            .and_then(|s| s.init_container_statuses.as_ref())
            .is_some_and(|i| i.iter().any(|i| i.name == c.name));
        if init && t.exit_code == 0 && c.state.as_ref().and_then(|s| s.terminated.as_ref()).is_some() {
            continue;
        }
        if role == Role::Controller && t.exit_code > 128 {
            continue;
        }
        return Some(named(c, restart.max(0), exited(t)));
    }
    if role == Role::Controller || ready(pod) {
        return None;
    }
    let waited = since(pod.metadata.creation_timestamp.as_ref(), now);
    if waited < ready_timeout {
        return None;
    }
    let first = statuses.first();
    let running = first.and_then(|c| c.state.as_ref()?.running.as_ref());
    let problem = match (first, running) {
        (Some(c), Some(r)) => Problem::Unready {
            running: since(r.started_at.as_ref(), now),
            probe: readiness_probe(pod, &c.name),
        },
        _ => {
            let waiting = first.and_then(|c| c.state.as_ref()?.waiting.as_ref());
            let condition = status
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.status == "False" && c.message.is_some()));
            Problem::Waiting {
                waited,
                reason: waiting
                    .and_then(|w| w.reason.clone())
                    .or_else(|| condition.and_then(|c| c.reason.clone()))
                    .or_else(|| status.and_then(|s| s.phase.clone()))
                    .unwrap_or_else(|| "Pending".into()),
                message: waiting
                    .and_then(|w| w.message.clone())
                    .or_else(|| condition.and_then(|c| c.message.clone()))
                    .unwrap_or_default(),
            }
        }
    };
    Some(PodProblem {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        container: first.map(|c| c.name.clone()).unwrap_or_default(),
        restart: first.map_or(0, |c| c.restart_count),
        problem,
    })
}

/// What a container's readiness probe asks, in a few words.
fn readiness_probe(pod: &Pod, container: &str) -> String {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let port = |p: &IntOrString| match p {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => s.clone(),
    };
    let probe = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == container))
        .and_then(|c| c.readiness_probe.as_ref());
    let Some(probe) = probe else {
        return String::new();
    };
    if let Some(h) = &probe.http_get {
        format!(
            "httpGet {} on port {}",
            h.path.as_deref().unwrap_or("/"),
            port(&h.port)
        )
    } else if let Some(t) = &probe.tcp_socket {
        format!("tcpSocket on port {}", port(&t.port))
    } else if let Some(g) = &probe.grpc {
        format!("grpc on port {}", g.port)
    } else if let Some(e) = &probe.exec {
        format!("exec {}", e.command.as_deref().unwrap_or_default().join(" "))
    } else {
        String::new()
    }
}

impl std::fmt::Display for PodProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ns, pod, c) = (&self.namespace, &self.pod, &self.container);
        match &self.problem {
            Problem::Exited {
                code,
                reason,
                message,
            } => {
                write!(
                    f,
                    "pod {ns}/{pod} exited with code {code} during start-up (container {c}"
                )?;
                if !reason.is_empty() {
                    write!(f, ", {reason}")?;
                }
                write!(f, ")")?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                Ok(())
            }
            Problem::Unready { running, probe } => {
                write!(
                    f,
                    "pod {ns}/{pod} is not Ready: container {c} has run for {}s and its readiness probe",
                    running.as_secs()
                )?;
                if !probe.is_empty() {
                    write!(f, " ({probe})")?;
                }
                write!(f, " still fails (see --pod-ready-timeout)")
            }
            Problem::Waiting {
                waited,
                reason,
                message,
            } => {
                write!(
                    f,
                    "pod {ns}/{pod} is not running after {}s: {reason}",
                    waited.as_secs()
                )?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                write!(f, " (see --pod-ready-timeout)")
            }
        }
    }
}

/// `pods/<namespace>_<pod>/logs/<container>/<restart>.log` under `work_dir`
/// (the node agent's layout).
#[must_use]
pub fn log_file(work_dir: &Path, p: &PodProblem) -> PathBuf {
    work_dir
        .join("pods")
        .join(format!("{}_{}", p.namespace, p.pod))
        .join("logs")
        .join(&p.container)
        .join(format!("{}.log", p.restart))
}

/// The last `n` lines of `path` (none when it cannot be read).
#[must_use]
pub fn log_tail(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| (*l).to_owned())
        .collect()
}

/// Copies what the playground logged — `router.log` and every pod's
/// `logs/` — from `work_dir` to a new directory under `into` (kept after
/// the playground exits), and returns it.
///
/// # Errors
/// When the directory cannot be created; files that cannot be copied are
/// left out.
pub fn keep_logs(work_dir: &Path, into: &Path) -> std::io::Result<PathBuf> {
    let stamp = jiff::Timestamp::now().strftime("%Y%m%dT%H%M%SZ");
    let kept = into.join(format!("skipper-dev-logs-{stamp}-{}", std::process::id()));
    std::fs::create_dir_all(&kept)?;
    let _ = std::fs::copy(work_dir.join("router.log"), kept.join("router.log"));
    for pod in std::fs::read_dir(work_dir.join("pods"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let logs = pod.path().join("logs");
        if logs.is_dir() {
            copy_tree(&logs, &kept.join("pods").join(pod.file_name()).join("logs"));
        }
    }
    Ok(kept)
}

fn copy_tree(from: &Path, to: &Path) {
    if std::fs::create_dir_all(to).is_err() {
        return;
    }
    for entry in std::fs::read_dir(from).into_iter().flatten().flatten() {
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        match entry.file_type() {
            Ok(t) if t.is_dir() => copy_tree(&src, &dst),
            Ok(t) if t.is_file() => {
                let _ = std::fs::copy(&src, &dst);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: &str = "2026-01-01T00:01:00Z";

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "fixture-a", "namespace": "default",
                         "creationTimestamp": "2026-01-01T00:00:50Z"},
            "spec": {"containers": [{"name": "fixture",
                "readinessProbe": {"tcpSocket": {"port": "http"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    fn problem(p: &Pod, role: Role, timeout_secs: u64) -> Option<Problem> {
        pod_problem(p, role, NOW.parse().unwrap(), Duration::from_secs(timeout_secs)).map(|p| p.problem)
    }

    #[test]
    fn what_fails_a_start_and_what_does_not() {
        let running = |ready: bool, restarts: i32, last: serde_json::Value| {
            pod(json!({
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
                "containerStatuses": [{"name": "fixture", "ready": ready, "restartCount": restarts,
                    "image": "skipper", "imageID": "",
                    "state": {"running": {"startedAt": "2026-01-01T00:00:52Z"}},
                    "lastState": last}],
            }))
        };
        let crashed = running(
            false,
            1,
            json!({"terminated": {"exitCode": 3, "reason": "Error"}}),
        );
        let killed = running(
            false,
            1,
            json!({"terminated": {"exitCode": 137, "reason": "Error"}}),
        );
        let ended = pod(json!({
            "phase": "Running",
            "containerStatuses": [{"name": "fixture", "ready": false, "restartCount": 0,
                "image": "skipper", "imageID": "",
                "state": {"terminated": {"exitCode": 127, "reason": "StartError",
                                         "message": "exec: \"nope\": executable file not found in $PATH"}}}],
        }));
        let pending = pod(json!({
            "phase": "Pending",
            "containerStatuses": [{"name": "fixture", "ready": false, "restartCount": 0,
                "image": "skipper", "imageID": "",
                "state": {"waiting": {"reason": "ContainerCreating",
                                      "message": "failed to set up the pod's network"}}}],
        }));
        let unscheduled = pod(json!({
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 3 Too many pods."}],
        }));
        let exited = |code: i32, reason: &str, message: &str| {
            Some(Problem::Exited {
                code,
                reason: reason.into(),
                message: message.into(),
            })
        };
        let not_found = "exec: \"nope\": executable file not found in $PATH";
        // (pod, role, --pod-ready-timeout seconds, what it is)
        let cases = [
            (running(true, 0, json!({})), Role::Pool, 5, None),
            (running(false, 0, json!({})), Role::Pool, 30, None),
            (
                running(false, 0, json!({})),
                Role::Pool,
                5,
                Some(Problem::Unready {
                    running: Duration::from_secs(8),
                    probe: "tcpSocket on port http".into(),
                }),
            ),
            (running(false, 0, json!({})), Role::Controller, 5, None),
            (crashed.clone(), Role::Pool, 30, exited(3, "Error", "")),
            (crashed, Role::Controller, 30, exited(3, "Error", "")),
            (killed.clone(), Role::Pool, 30, exited(137, "Error", "")),
            (killed, Role::Controller, 30, None),
            (ended, Role::Pool, 30, exited(127, "StartError", not_found)),
            (pending.clone(), Role::Pool, 30, None),
            (
                pending,
                Role::Pool,
                5,
                Some(Problem::Waiting {
                    waited: Duration::from_secs(10),
                    reason: "ContainerCreating".into(),
                    message: "failed to set up the pod's network".into(),
                }),
            ),
            (
                unscheduled,
                Role::Pool,
                5,
                Some(Problem::Waiting {
                    waited: Duration::from_secs(10),
                    reason: "Unschedulable".into(),
                    message: "0/3 nodes are available: 3 Too many pods.".into(),
                }),
            ),
        ];
        for (i, (p, role, timeout, want)) in cases.into_iter().enumerate() {
            assert_eq!(problem(&p, role, timeout), want, "case {i}");
        }
    }

    #[test]
    fn the_failed_instance_names_its_log_and_the_message_names_pod_and_code() {
        let p = pod(json!({
            "containerStatuses": [{"name": "fixture", "ready": false, "restartCount": 2,
                "image": "skipper", "imageID": "",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 3, "reason": "Error"}}}],
        }));
        let found = pod_problem(&p, Role::Pool, NOW.parse().unwrap(), Duration::from_secs(30)).unwrap();
        assert_eq!(found.restart, 1, "the instance before the restart");
        assert_eq!(
            log_file(Path::new("/w"), &found),
            Path::new("/w/pods/default_fixture-a/logs/fixture/1.log")
        );
        assert_eq!(
            found.to_string(),
            "pod default/fixture-a exited with code 3 during start-up (container fixture, Error)"
        );
    }

    #[test]
    fn logs_are_kept_with_their_layout_and_tails_read() {
        let root = std::env::temp_dir().join(format!("skipper-keep-{:016x}", rand::random::<u64>()));
        let work = root.join("work");
        let dir = work.join("pods/default_fixture-a/logs/fixture");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(work.join("router.log"), "router\n").unwrap();
        let lines: String = (1..=40).map(|i| format!("line {i}\n")).collect();
        std::fs::write(dir.join("0.log"), &lines).unwrap();
        std::fs::create_dir_all(work.join("pods/default_fixture-a/volumes/key")).unwrap();
        std::fs::write(work.join("pods/default_fixture-a/volumes/key/k"), "secret").unwrap();
        let kept = keep_logs(&work, &root).unwrap();
        assert_eq!(
            std::fs::read_to_string(kept.join("router.log")).unwrap(),
            "router\n"
        );
        let copied = kept.join("pods/default_fixture-a/logs/fixture/0.log");
        assert_eq!(std::fs::read_to_string(&copied).unwrap(), lines);
        assert!(!kept.join("pods/default_fixture-a/volumes").exists(), "logs only");
        let tail = log_tail(&copied, 3);
        assert_eq!(tail, ["line 38", "line 39", "line 40"]);
        assert!(log_tail(&kept.join("missing.log"), 3).is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }
}
