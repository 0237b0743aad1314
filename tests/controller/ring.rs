//! Several controllers against the simulator: ring membership from
//! controller pods, heartbeat forwarding, aggregated cluster state, owner
//! change, forwarding between disagreeing rings, health and an empty ring.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::Duration;

use harness::{CTL_NS, Ctl, NS, Sim, eventually, function, heartbeat, listeners, scale, tenant_owned_by};
use skipper::api;
use tokio::net::TcpListener;

fn ring_config(sim: &Sim<'_>, namespace: &str, pod_ip: &str) -> skipper::controller::Config {
    let mut c = sim.ring_config(pod_ip);
    c.namespace = namespace.into();
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_controllers_share_a_ring_forward_heartbeats_and_take_over() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    let (mut a, b) = sim.ring_of_two(|ip| sim.ring_config(ip)).await;
    let (ip1, ip2) = (a.pod_ip().to_owned(), b.pod_ip().to_owned());

    // Health reports SERVING once ready.
    assert_eq!(harness::health_status(a.addr, "").await, Some(harness::SERVING));

    // A heartbeat sent to A reaches B through forwarding.
    let tenant = tenant_owned_by("pool", &[&ip1, &ip2], &ip2);
    let f = function("pool", &tenant, 1);
    a.grpc.heartbeat(heartbeat("10.7.7.7", &f, 4)).await.unwrap();
    eventually("forwarded heartbeat on B", Duration::from_secs(5), || async {
        let h = b.core.supervisors.get(f.id())?;
        let n = h.shared.with_heartbeats(|s| s.combined([]).in_flight);
        (n == 4).then_some(())
    })
    .await;
    let forwarded = b
        .core
        .cluster
        .metrics
        .heartbeats_total
        .get_or_create(&skipper::controller::metrics::Metrics::function("pool"))
        .get();
    assert_eq!(forwarded, 1, "counted once on B");

    // The aggregated state lists the function once, contributed by its owner.
    let state = a
        .grpc
        .get_cluster_state(api::GetClusterStateRequest { local_only: None })
        .await
        .unwrap()
        .into_inner()
        .cluster_state
        .unwrap();
    assert_eq!(state.controller_ips.len(), 2);
    let sups: Vec<_> = state
        .supervisors
        .iter()
        .filter(|s| s.function.as_ref().and_then(|f| f.tenant.as_deref()) == Some(tenant.as_str()))
        .collect();
    assert_eq!(sups.len(), 1);
    assert_eq!(sups[0].responsible_controller_ip.as_deref(), Some(ip2.as_str()));
    assert_eq!(sups[0].router_heartbeats.len(), 1);
    let local = a.local_state().await;
    assert_eq!(local.pod_ip.as_deref(), Some(ip1.as_str()));
    assert!(
        local
            .config
            .iter()
            .any(|c| c.name.as_deref() == Some("paseto-private-key") && c.value.as_deref() == Some("****"))
    );

    // B's pod goes away: A owns everything.
    assert!(!a.core.cluster.is_owner(f.id()));
    sim.delete_pod(CTL_NS, "controller-b").await;
    eventually("A takes over", Duration::from_secs(10), || async {
        a.core.cluster.is_owner(f.id()).then_some(())
    })
    .await;
    assert_eq!(&*a.core.cluster.ring.current().sorted_members()[0], ip1.as_str());
    let _ = NS;
    a.stop().await;
    b.stop().await;
}

/// Scales `f` to one instance through `ctl`: answered with it within 5 s
/// (however the call was forwarded, it did not deadlock).
async fn scales_to_one_at_once(ctl: &mut Ctl, f: &skipper::domain::Function) {
    let started = tokio::time::Instant::now();
    let resp = ctl
        .grpc
        .scale(scale(f, 1, Duration::from_secs(10)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.instances.len(), 1);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "no deadlock: {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarded_scale_between_disagreeing_rings_does_not_deadlock() {
    let sim = Sim::with_pool("pool", 2).await;
    // A's ring holds only B and B's ring holds only A: each thinks the other
    // owns every function.
    let ip1 = sim.controller_pod("ring-a", "controller-a").await;
    let ip2 = sim.controller_pod("ring-b", "controller-b").await;
    let (la, lb) = listeners(&ip1, &ip2).await;
    let (a, b) = tokio::join!(
        Ctl::start(&sim, ring_config(&sim, "ring-b", &ip1), la),
        Ctl::start(&sim, ring_config(&sim, "ring-a", &ip2), lb)
    );
    let mut a = a;
    let f = function("pool", "pingpong", 1);
    scales_to_one_at_once(&mut a, &f).await;
    // B executed it (the hop limit stops the bounce).
    assert_eq!(sim.tenant_pods("pingpong").await.len(), 1);
    assert!(b.core.supervisors.get(f.id()).is_some());
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_ring_fails_lookups_not_start_up() {
    let sim = Sim::start().await;
    sim.deploy_pool("pool", 1, &[]).await;
    // No controller pod in "other": the ring stays empty.
    let mut config = ring_config(&sim, "other", "127.0.0.1");
    config.hash_ring_wait_time = Duration::from_millis(300);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut ctl = Ctl::start(&sim, config, listener).await;
    let f = function("pool", "lonely", 1);
    let started = tokio::time::Instant::now();
    let err = ctl.refusal(&f, Duration::from_secs(10)).await;
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains("hash ring is still empty"), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ring_inspect_reads_live_membership() {
    let sim = Sim::start().await;
    let ip1 = sim.controller_pod(CTL_NS, "controller-a").await;
    let ip2 = sim.controller_pod(CTL_NS, "controller-b").await;
    let (la, _lb) = listeners(&ip1, &ip2).await;
    let a = Ctl::start(&sim, sim.ring_config(&ip1), la).await;
    Ctl::await_rings(&[&a], 2).await;
    let mut expected = vec![ip1.clone(), ip2.clone()];
    expected.sort();
    let kubeconfig = sim.backend.kubeconfig();
    for argv in [
        vec!["--controller".to_owned(), a.addr.to_string()],
        vec![
            "--namespace".to_owned(),
            CTL_NS.to_owned(),
            "--kubeconfig".to_owned(),
            kubeconfig.display().to_string(),
        ],
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
            .arg("ring-inspect")
            .args(&argv)
            .args(["--output", "json"])
            .env_clear()
            .output()
            .await
            .unwrap();
        let stdout = skipper_test_support::process::succeeded(&format!("ring-inspect {argv:?}"), out);
        let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
        let mut members: Vec<String> = v["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["ip"].as_str().unwrap().to_owned())
            .collect();
        members.sort();
        assert_eq!(members, expected, "{argv:?}");
    }
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"))
        .args(["ring-inspect", "--controller", "127.0.0.1:1"])
        .env_clear()
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--controller 127.0.0.1:1"));
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wrong_pod_ip_forwards_to_itself_once_and_does_not_deadlock() {
    let sim = Sim::with_pool("pool", 1).await;
    let real_ip = sim.controller_pod(CTL_NS, "controller-a").await;
    let listener = TcpListener::bind((real_ip.as_str(), 0)).await.unwrap();
    // --pod-ip does not match the pod's IP: the ring owner is "someone else"
    // who is in fact this very controller.
    let mut a = Ctl::start(&sim, ring_config(&sim, CTL_NS, "127.0.0.1"), listener).await;
    let f = function("pool", "mirror", 1);
    scales_to_one_at_once(&mut a, &f).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_binary_rejects_bad_flags_and_exits_zero_on_sigterm() {
    let sim = Sim::start().await;
    let key = sim.key.to_pem();
    let base = |extra: &[&str]| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_skipper"));
        cmd.arg("controller")
            .args(["--host", "127.0.0.1", "--port", "0", "--pod-ip", "127.0.0.1"])
            .args(["--function-namespaces", NS, "--log-format", "text"])
            // No peers to call: no token of its own.
            .args(["--token-file", ""])
            .args(extra)
            .env_clear()
            .env("KUBECONFIG", sim.backend.kubeconfig())
            .env("SKIPPER_PASETO_PRIVATE_KEY", &key)
            .kill_on_drop(true);
        cmd
    };
    let out = base(&["--namespace", CTL_NS, "--scale-interval", "0s"])
        .output()
        .await
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--scale-interval"));

    let mut child = base(&["--namespace", CTL_NS, "--single-controller-mode"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stderr);
    tokio::time::timeout(Duration::from_secs(20), async {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        loop {
            line.clear();
            let n = lines.read_line(&mut line).await.unwrap();
            assert!(n > 0, "controller exited before serving");
            if line.contains("controller serving") {
                return;
            }
        }
    })
    .await
    .expect("controller serving");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("stops on SIGTERM")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
