//! The real `skipper router` binary as a separate process on loopback, for
//! the load benchmarks: free ports, a health wait, its metrics, SIGTERM.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;

/// A free loopback port (bound and released).
#[must_use]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (at most 20 s) until `GET /healthz` at `addr` answers 200.
pub async fn wait_healthy(addr: SocketAddr, what: &str) {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(stream) = tokio::net::TcpStream::connect(addr).await
                && let Ok((mut s, conn)) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await
            {
                tokio::spawn(conn);
                let req = http::Request::get("/healthz")
                    .header("host", "x")
                    .body(Empty::new())
                    .unwrap();
                if s.send_request(req).await.is_ok_and(|r| r.status() == 200) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} did not become healthy"));
}

/// Linux reports process CPU times in USER_HZ ticks, 100 per second.
pub const TICKS_PER_SEC: f64 = 100.0;

/// CPU ticks (user and system) `pid` has used.
///
/// # Panics
/// When `pid` is gone.
#[must_use]
pub fn proc_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// CPU ticks of `pid` and of its child processes (nginx's workers).
#[must_use]
pub fn tree_cpu_ticks(pid: u32) -> u64 {
    let mut ticks = proc_cpu_ticks(pid);
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                continue;
            };
            let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
            if rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid) {
                ticks += proc_cpu_ticks(child);
            }
        }
    }
    ticks
}

/// A running `skipper router`.
pub struct RouterProcess {
    pub child: tokio::process::Child,
    pub pid: u32,
    /// Its HTTP port.
    pub addr: SocketAddr,
    /// Its `/metrics`.
    pub metrics: SocketAddr,
    /// Its `/debug/pprof/`.
    pub pprof: SocketAddr,
}

/// Starts `exe router` on loopback against the controller at `controller`
/// (no token), with `env` set and everything else at its defaults; waits
/// until it is healthy.
pub async fn start_router(exe: &str, controller: SocketAddr, env: &[(&str, &str)]) -> RouterProcess {
    let port = free_port();
    let metrics_port = free_port();
    let pprof_port = free_port();
    let child = tokio::process::Command::new(exe)
        .args([
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--pod-ip",
            "127.0.0.1",
            "--controller-service-host",
            "127.0.0.1",
            "--controller-port",
            &controller.port().to_string(),
            "--controller-token-file",
            "",
            "--pprof-host",
            "127.0.0.1",
            "--pprof-port",
            &pprof_port.to_string(),
            "--log-level",
            &std::env::var("SKIPPER_BENCH_ROUTER_LOG").unwrap_or_else(|_| "warn".into()),
            "--telemetry",
            "--telemetry-prometheus-host",
            "127.0.0.1",
            "--telemetry-prometheus-port",
            &metrics_port.to_string(),
        ])
        .env_clear()
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start skipper router");
    let pid = child.id().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_healthy(addr, "the router").await;
    RouterProcess {
        child,
        pid,
        addr,
        metrics: format!("127.0.0.1:{metrics_port}").parse().unwrap(),
        pprof: format!("127.0.0.1:{pprof_port}").parse().unwrap(),
    }
}

impl RouterProcess {
    /// The sum of the series of metric `name` (a counter's `_total`
    /// included), `None` when the router does not export it.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let text = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("http://{}/metrics", self.metrics))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        if !text.contains(&format!("# TYPE {name} ")) {
            return None;
        }
        let total = format!("{name}_total");
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                let series = l.split(['{', ' ']).next().unwrap_or_default();
                series == name || series == total
            })
            .collect();
        Some(
            lines
                .iter()
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
        )
    }

    /// SIGTERM, then waits (at most 10 s) for the exit.
    pub async fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.pid).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("router did not exit after SIGTERM")
            .unwrap();
        println!("router exit after SIGTERM: {status}");
    }
}

/// Stops a server that owns worker processes (nginx) as its operator
/// would: SIGTERM to the master, which stops its workers, then waits up to
/// 10 s; SIGKILL (which would leave the workers behind) only after that.
pub async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        if tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .is_ok()
        {
            return;
        }
    }
    let _ = child.kill().await;
}
