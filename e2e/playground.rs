//! `skipper dev` itself: Ctrl-C stops every process and exits 0, a busy
//! `--listen` or `--metrics-listen` fails at once naming the flag,
//! `--command` runs your own pod program, pods bind the wildcard address in
//! a network namespace each (loopback addresses without the privileges for
//! one), and a pod that fails its start stops the start, saying why.

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

/// `skipper dev` with `flag` on a port another process holds: it fails at
/// once, in one line naming the flag and the address, and prints nothing.
async fn a_busy_port_fails_at_once(flag: &str) {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut args = vec!["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"];
    let at = args.iter().position(|a| *a == flag).unwrap();
    args[at + 1] = &addr;
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .arg("dev")
            .args(control_plane_args())
            .args(&args)
            .output(),
    )
    .await
    .expect("skipper dev did not fail within 10s")
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("{flag} {addr}: cannot listen there"))
            && stderr.contains("another `skipper dev`")
            && stderr.contains(&format!("choose another address with {flag}")),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty());
}

/// A second `skipper dev` on a busy port fails at once with a clear message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_listen_port_fails_at_once() {
    let _t = Timer::start("playground busy port");
    a_busy_port_fails_at_once("--listen").await;
}

/// A busy `--metrics-listen` fails the start at once, naming the flag,
/// rather than advertising another process's metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_metrics_port_fails_at_once() {
    let _t = Timer::start("playground busy metrics port");
    a_busy_port_fails_at_once("--metrics-listen").await;
}

/// A pool pod that exits during start-up stops `skipper dev` within
/// seconds, naming the pod and its exit code, and the logs of the start are
/// kept where the error says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_exits_stops_the_start_naming_it() {
    let _t = Timer::start("playground pod exits at start");
    // 15 s on the simulator; the real control plane first boots etcd,
    // kube-apiserver, the controller manager and the scheduler (5-10 s of
    // a loaded 2-core machine), so it has that much more.
    let bound = if real_control_plane() { 30 } else { 15 };
    let started = std::time::Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(bound),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .arg("dev")
            .args(control_plane_args())
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(["--command", r#"sh -c "echo about to fail; exit 3""#])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("skipper dev did not stop within {bound}s"))
    .unwrap();
    eprintln!(
        "e2e: a failing pool pod stopped skipper dev in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(
        line.starts_with("error: pod default/fixture-")
            && line.contains("exited with code 3 during start-up"),
        "stderr: {stderr}"
    );
    assert!(
        stderr.contains("\n    about to fail\n"),
        "the log's last lines: {stderr}"
    );
    let kept = stderr
        .lines()
        .find_map(|l| l.strip_prefix("the logs of this start are kept in "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("where the logs are: {stderr}"));
    let kept = std::path::Path::new(kept);
    let pods: Vec<_> = std::fs::read_dir(kept.join("pods"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(pods.iter().any(|p| p.starts_with("default_fixture-")), "{pods:?}");
    assert!(kept.join("router.log").is_file());
    std::fs::remove_dir_all(kept).unwrap();
    assert!(out.stdout.is_empty());
}

/// Whether this process can give pods a network namespace each (root and
/// iproute2's `ip`).
fn can_make_pod_networks() -> bool {
    nix::unistd::geteuid().is_root()
        && ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
            .iter()
            .any(|p| std::path::Path::new(p).is_file())
}

/// The network namespaces (by `/proc/<pid>/ns/net`) in which one of `pids`
/// listens on `0.0.0.0:port`.
fn wildcard_listeners(pids: &[u32], port: u16) -> std::collections::BTreeSet<std::path::PathBuf> {
    let want = format!("00000000:{port:04X}");
    pids.iter()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).is_ok_and(|t| {
                t.lines().skip(1).any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.get(1) == Some(&want.as_str()) && f.get(3) == Some(&"0A")
                })
            })
        })
        .filter_map(|pid| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok())
        .collect()
}

/// A pool written as for a real cluster — its program binds `0.0.0.0:8888`,
/// as `skipper fixture` does without `SKIPPER_HOST` — serves: every pod has
/// a network namespace of its own on the playground's bridge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_binding_the_wildcard_address_serves() {
    let _t = Timer::start("playground wildcard pool");
    if !can_make_pod_networks() {
        eprintln!(
            "a_pool_binding_the_wildcard_address_serves: needs root and iproute2 for pod networks, skipped"
        );
        return;
    }
    let program = NodeProgram::link(env!("CARGO_BIN_EXE_skipper"));
    let dev = Dev::start(Opts {
        pool: 3,
        extra: vec![
            "--command".into(),
            format!(
                "SKIPPER_HOST=0.0.0.0 exec {} fixture --log-format text",
                program.path.display()
            ),
        ],
        ..Opts::default()
    })
    .await;
    assert!(
        dev.output()
            .contains("pod network:   a network namespace per pod on bridge skpod"),
        "{}",
        dev.output()
    );
    for tenant in ["w1", "w2", "w3"] {
        assert_eq!(dev.echo_tenant(&single(tenant), "/").await, tenant);
    }
    // Three tenants' pods and the pool's replacements, each listening on
    // the wildcard address in a namespace of its own.
    let namespaces = wildcard_listeners(&dev.process_tree(), 8888);
    assert!(
        namespaces.len() >= 3,
        "namespaces with 0.0.0.0:8888: {namespaces:?}"
    );
    assert!(
        !dev.stderr().contains("pods share the host's network"),
        "{}",
        dev.stderr()
    );
}

/// Without the privileges for pod networks — unprivileged (user `nobody`,
/// with user namespaces), or else root without `CAP_NET_ADMIN` — pods share
/// the host's network on loopback addresses, `skipper dev` says so in one
/// line, and the pool (binding `$POD_IP`) serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pod_networks_pods_share_the_host_network() {
    let _t = Timer::start("playground loopback fallback");
    if real_control_plane() {
        eprintln!(
            "without_pod_networks_pods_share_the_host_network: the real control plane needs root, skipped"
        );
        return;
    }
    let skipper = env!("CARGO_BIN_EXE_skipper");
    let nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"];
    let wrapper: Vec<String> = if !nix::unistd::geteuid().is_root() {
        Vec::new()
    } else if std::process::Command::new(nobody[0])
        .args(&nobody[1..])
        .args([skipper, "__sandbox", "check"])
        .status()
        .is_ok_and(|s| s.success())
    {
        nobody.iter().map(|s| (*s).to_owned()).collect()
    } else {
        eprintln!(
            "without_pod_networks_pods_share_the_host_network: no user namespaces for nobody; as root without CAP_NET_ADMIN"
        );
        ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    };
    let dev = Dev::start(Opts {
        wrapper,
        ..Opts::default()
    })
    .await;
    assert_eq!(dev.echo_tenant(&single("t1"), "/").await, "t1");
    let stderr = dev.stderr();
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("skipper dev: pods share the host's network"))
        .collect();
    assert_eq!(said.len(), 1, "one line: {stderr}");
    assert!(said[0].contains("CAP_NET_ADMIN"), "{}", said[0]);
    assert!(
        dev.output()
            .contains("pod network:   the host's, a loopback address per pod"),
        "{}",
        dev.output()
    );
    let ip = dev.controller_ips[0].parse::<std::net::Ipv4Addr>().unwrap();
    assert!(ip.is_loopback(), "{ip}");
    assert_eq!(dev.interrupt().await.code(), Some(0));
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
/// into a directory of its own under `/var/tmp` (tests running at once each
/// have theirs), and removed on drop.
struct NodeProgram {
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
}

impl NodeProgram {
    fn link(source: &str) -> Self {
        let dir = std::path::PathBuf::from(format!(
            "/var/tmp/skipper-e2e-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
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
