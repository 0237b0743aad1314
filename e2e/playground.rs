//! `skipper dev` itself: Ctrl-C stops every process and exits 0, a busy
//! `--listen` fails at once naming the flag, `--command` runs your own pod
//! program.

use std::time::Duration;

use crate::Timer;
use crate::harness::{Dev, Opts, control_plane_args, process_alive, real_control_plane, single};

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
            .arg("dev")
            .args(control_plane_args())
            .args(["--listen", &addr.to_string()])
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

/// Without the privileges pods need (here: root with every capability
/// dropped), `skipper dev` fails at start with one line naming what is
/// missing, before anything runs: mount and PID namespaces on the
/// simulator; on the real control plane the pod network (network
/// namespaces on a bridge) is checked first.
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
            .arg("dev")
            .args(control_plane_args())
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .output(),
    )
    .await
    .expect("skipper dev did not fail within 20s")
    .expect("setpriv (util-linux) runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    let missing = if real_control_plane() {
        "pod networking needs CAP_NET_ADMIN and CAP_SYS_ADMIN"
    } else {
        "pods need private mount and PID namespaces"
    };
    assert!(
        stderr.contains(missing) && stderr.contains("CAP_SYS_ADMIN"),
        "stderr: {stderr}"
    );
    assert_eq!(stderr.matches(missing).count(), 1, "said once: {stderr}");
    assert!(out.stdout.is_empty());
}

/// `--command` replaces the fixture with your own program (here the fixture
/// binary started by path through `sh -c`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_pod_command() {
    let _t = Timer::start("playground --command");
    let program = NodeProgram::link(env!("CARGO_BIN_EXE_skipper"));
    let dev = Dev::start(Opts {
        pool: 2,
        extra: vec![
            "--command".into(),
            format!("exec {} fixture --log-format text", program.path.display()),
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

/// `--control-plane real` without the binaries `make control-plane` builds
/// fails at start with one line naming the flag and the make target, before
/// anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_control_plane_without_its_build_fails_with_one_line() {
    let _t = Timer::start("playground without the control plane build");
    let empty = std::env::temp_dir().join(format!("skipper-e2e-no-cp-{:x}", rand::random::<u64>()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .args(["dev", "--control-plane", "real", "--listen", "127.0.0.1:0"])
            .arg("--control-plane-dir")
            .arg(&empty)
            .output(),
    )
    .await
    .expect("skipper dev did not fail within 10s")
    .unwrap();
    let _ = std::fs::remove_dir_all(&empty);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("--control-plane-dir: no etcd in {}", empty.display()))
            && stderr.contains("`make control-plane`"),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty());
}

/// A program on the node's filesystem where a pod can see it. A pod's `/tmp`
/// is its own, as a container's is, so a binary under the host's `/tmp` (a
/// checkout there) is out of its sight: the program is linked (or copied)
/// into `/var/tmp`, and removed on drop.
struct NodeProgram {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl NodeProgram {
    fn link(source: &str) -> Self {
        let dir = std::path::PathBuf::from(format!("/var/tmp/skipper-e2e-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("skipper");
        let _ = std::fs::remove_file(&path);
        if std::fs::hard_link(source, &path).is_err() {
            std::fs::copy(source, &path).unwrap();
        }
        Self { dir, path }
    }
}

impl Drop for NodeProgram {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
