//! `skipper dev` itself: Ctrl-C stops every process and exits 0, a busy
//! `--listen` fails at once naming the flag, `--command` runs your own pod
//! program.

use std::time::Duration;

use crate::Timer;
use crate::harness::{Dev, Opts, process_alive, single};

/// SIGINT: exit status 0, no process it started (router, pod processes and
/// their children) left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_everything() {
    let _t = Timer::start("playground ctrl-c");
    let dev = Dev::start(Opts {
        controllers: 2,
        ..Opts::default()
    })
    .await;
    assert_eq!(dev.echo_tenant(&single("t1"), "/").await, "t1");
    let pids = dev.process_tree();
    // The router, and a shim and a main process for each of 2 controllers
    // and 3 pool pods (and the assigned one's replacement as it starts).
    assert!(pids.len() >= 11, "processes: {pids:?}");
    let router = dev.router.trim_start_matches("http://").to_owned();
    let status = dev.interrupt().await;
    assert_eq!(status.code(), Some(0));
    // Gone, or a zombie waiting for init to reap it.
    let survivors: Vec<u32> = pids.iter().copied().filter(|p| process_alive(*p)).collect();
    assert!(survivors.is_empty(), "processes survived: {survivors:?}");
    assert!(
        tokio::net::TcpStream::connect(&router).await.is_err(),
        "router still listening"
    );
}

/// A second `skipper dev` on a busy port fails at once with a clear message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_listen_port_fails_at_once() {
    let _t = Timer::start("playground busy port");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .args(["dev", "--listen", &addr.to_string()])
            .output(),
    )
    .await
    .expect("skipper dev did not fail within 10s")
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("--listen {addr}")) && stderr.contains("another `skipper dev`"),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty());
}

/// Without the right to create mount and PID namespaces (here: root with
/// every capability dropped), `skipper dev` fails at start with one line
/// naming what is missing, before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_namespaces_dev_fails_with_one_line() {
    let _t = Timer::start("playground without namespaces");
    if !nix::unistd::geteuid().is_root() {
        // Unprivileged, the playground uses user namespaces, which dropping
        // capabilities does not take away.
        eprintln!("without_namespaces_dev_fails_with_one_line: needs root, skipped");
        return;
    }
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new("setpriv")
            .args([
                "--bounding-set=-all",
                "--inh-caps=-all",
                env!("CARGO_BIN_EXE_skipper"),
            ])
            .args([
                "dev",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
            ])
            .output(),
    )
    .await
    .expect("skipper dev did not fail within 20s")
    .expect("setpriv (util-linux) runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    assert!(
        stderr.contains("pods need private mount and PID namespaces") && stderr.contains("CAP_SYS_ADMIN"),
        "stderr: {stderr}"
    );
    assert_eq!(stderr.matches("pods need").count(), 1, "said once: {stderr}");
    assert!(out.stdout.is_empty());
}

/// `--command` replaces the fixture with your own program (here the fixture
/// binary started by path through `sh -c`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_pod_command() {
    let _t = Timer::start("playground --command");
    let dev = Dev::start(Opts {
        pool: 2,
        extra: vec![
            "--command".into(),
            format!("exec {} fixture --log-format text", env!("CARGO_BIN_EXE_skipper")),
        ],
        ..Opts::default()
    })
    .await;
    assert_eq!(dev.echo_tenant(&single("mine"), "/").await, "mine");
    let pods = dev.pods().await;
    let c = &pods[0].spec.as_ref().unwrap().containers[0];
    assert_eq!(
        c.command.as_ref().unwrap()[..2],
        ["sh".to_owned(), "-c".to_owned()]
    );
}
