//! The container runtime side of the agent: starts a container through the
//! sandbox shim and learns its main process, waits for its exit, signals
//! it, runs commands inside it, and samples CPU and memory of every process
//! of a container from `/proc`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use jiff::Timestamp;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::watch;
use tokio_util::task::TaskTracker;

use super::sandbox::{Control, RunSpec, SUBCOMMAND};

/// How a container instance ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// The exit code (128 + signal number when a signal ended it).
    pub code: i32,
    pub finished_at: Timestamp,
}

/// A started container instance.
#[derive(Debug)]
pub struct Started {
    /// Host pid of the container's main process (PID 1 of its namespace).
    pub pid: u32,
    /// Host pid of the shim that waits for it.
    pub shim_pid: u32,
    /// Becomes `Some` when the container ended.
    pub exit: watch::Receiver<Option<Exit>>,
}

/// Why a container did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The runtime could not start it (`StartError`, exit code 128).
    #[error("{0}")]
    Start(String),
    /// The shim could not be run at all.
    #[error("starting the sandbox shim {exe}: {source}")]
    Shim { exe: PathBuf, source: std::io::Error },
}

/// Starts a container with `shim` (the skipper binary) per `spec`; a tracked
/// task waits for it and publishes its exit.
///
/// # Errors
/// [`LaunchError`].
pub async fn launch(shim: &Path, spec: &RunSpec, tracker: &TaskTracker) -> Result<Started, LaunchError> {
    let shim_err = |source| LaunchError::Shim {
        exe: shim.to_path_buf(),
        source,
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(shim_err)?;
    let mut child = tokio::process::Command::new(shim)
        .args([SUBCOMMAND, "run"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        // Its own process group: a terminal's Ctrl-C reaches the agent only.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(shim_err)?;
    let shim_pid = child.id().unwrap_or(0);
    let body = serde_json::to_vec(spec).map_err(|e| LaunchError::Start(e.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(&body).await.map_err(shim_err)?;
        // Dropping stdin closes it: the shim reads to the end.
    }
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let mut reader = tokio::io::BufReader::new(stdout);
        let read = tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut line)).await;
        if !matches!(read, Ok(Ok(_))) {
            line.clear();
        }
    }
    let control: Option<Control> = serde_json::from_str(line.trim()).ok();
    match control {
        Some(Control::Started { pid }) => {
            let (tx, rx) = watch::channel(None);
            tracker.spawn(async move {
                let code = match child.wait().await {
                    Ok(status) => {
                        use std::os::unix::process::ExitStatusExt as _;
                        status
                            .code()
                            .or_else(|| status.signal().map(|s| 128 + s))
                            .unwrap_or(128)
                    }
                    Err(_) => 128,
                };
                let _ = tx.send(Some(Exit {
                    code,
                    finished_at: Timestamp::now(),
                }));
            });
            Ok(Started {
                pid,
                shim_pid,
                exit: rx,
            })
        }
        Some(Control::Failed { message }) => {
            let _ = child.wait().await;
            Err(LaunchError::Start(message))
        }
        None => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            Err(LaunchError::Start(format!(
                "the sandbox shim ended without starting the container (see {})",
                spec.log.display()
            )))
        }
    }
}

/// Sends `sig` to a process (nothing when `pid` is 0 or gone).
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    if pid == 0 {
        return;
    }
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

/// Runs `command` inside the container whose main process is `pid`, with
/// its environment and working directory; the exit code, or why it did not
/// finish within `timeout`.
///
/// # Errors
/// A timeout, or the shim failing to run it, as text.
pub async fn exec(
    shim: &Path,
    pid: u32,
    env: &[(String, String)],
    cwd: Option<&Path>,
    command: &[String],
    timeout: Duration,
) -> Result<i32, String> {
    if command.is_empty() {
        return Err("the command is empty".into());
    }
    let mut cmd = tokio::process::Command::new(shim);
    cmd.args([SUBCOMMAND, "exec", "--target", &pid.to_string()]);
    if let Some(dir) = cwd {
        cmd.arg("--cwd").arg(dir);
    }
    cmd.arg("--")
        .args(command)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| format!("running {command:?}: {e}"))?;
    let mut stderr = child.stderr.take();
    let mut stdout = child.stdout.take();
    let collect = async {
        // The kubelet keeps at most 10 KiB of a probe's output.
        let mut out = Vec::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.take(10 * 1024).read_to_end(&mut out).await;
        }
        let mut err = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.take(10 * 1024).read_to_end(&mut err).await;
        }
        (out, err)
    };
    let run = async {
        let (_, err) = collect.await;
        (child.wait().await, err)
    };
    // On timeout the helper is killed (dropped), and the command with it.
    match tokio::time::timeout(timeout, run).await {
        Ok((Ok(status), err)) => match status.code() {
            Some(c @ (126 | 127)) if !err.is_empty() => Err(format!(
                "command {command:?} failed to run ({c}): {}",
                String::from_utf8_lossy(&err).trim()
            )),
            Some(c) => Ok(c),
            None => Err(format!("command {command:?} was killed")),
        },
        Ok((Err(e), _)) => Err(format!("waiting for {command:?}: {e}")),
        Err(_) => Err(format!("command {command:?} timed out after {timeout:?}")),
    }
}

/// CPU time (clock ticks) and resident memory (bytes) of a process group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    pub ticks: u64,
    pub rss: u64,
}

fn read_sample(pid: &str) -> Option<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Field 22 (index 21 after the command) is RSS in pages.
    let rss_pages = fields.get(21)?.parse::<u64>().ok()?;
    Some(Sample {
        ticks,
        rss: rss_pages * 4096,
    })
}

/// Sums CPU and memory over every process of each container: the processes
/// sharing the PID namespace of the container's main process. `mains` maps
/// a key to the main pid; the result has an entry per key still alive.
#[must_use]
pub fn sample_containers<K: Clone + Eq + std::hash::Hash>(mains: &[(K, u32)]) -> HashMap<K, Sample> {
    let mut by_ns: HashMap<PathBuf, Vec<K>> = HashMap::new();
    for (key, pid) in mains {
        if let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/pid")) {
            by_ns.entry(ns).or_default().push(key.clone());
        }
    }
    let mut totals: HashMap<K, Sample> = HashMap::new();
    if by_ns.is_empty() {
        return totals;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return totals;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|s| s.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/pid")) else {
            continue;
        };
        let Some(keys) = by_ns.get(&ns) else { continue };
        let Some(s) = read_sample(pid) else { continue };
        for key in keys {
            let t = totals.entry(key.clone()).or_default();
            t.ticks += s.ticks;
            t.rss += s.rss;
        }
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_of_this_process_has_memory() {
        let s = read_sample("self").unwrap();
        assert!(s.rss > 0);
    }
}
