//! Pool poisoning: a tenant reads its own assignment token (it is in its own
//! pod) and replays it to every pool pod as it appears, while new tenants keep
//! arriving. A token names the pod it is for, so no pool pod accepts it, and
//! the controller assigns every new tenant.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::collections::HashSet;
use std::time::Duration;

use harness::{Ctl, NS, Sim, function, get_instance, name_of};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use skipper::api::EventType;
use skipper::domain::{HEADER_FUNCTION, HEADER_TOKEN};

/// How long the tenant replays its token.
const ATTACK: Duration = Duration::from_secs(30);
/// How often it looks for new pool pods (as the probe that found the flaw).
const POLL: Duration = Duration::from_millis(200);
/// How often a new tenant arrives.
const ARRIVALS: Duration = Duration::from_secs(2);

/// What the replaying tenant saw.
#[derive(Debug, Default)]
struct Replays {
    /// Pods that answered, by name.
    answered: HashSet<String>,
    /// Pods that accepted the token (answered 200).
    accepted: Vec<String>,
    /// Statuses seen, for the failure message.
    statuses: Vec<u16>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_replaying_its_token_to_pool_pods_assigns_none_and_new_tenants_are_served() {
    let sim = Sim::with_pool("pool", 6).await;
    let mut ctl = Ctl::single(&sim).await;

    let attacker = function("pool", "attacker", 1);
    let own = ctl.instance(&attacker, Duration::from_secs(30)).await;
    let own = own.name.unwrap();
    let token = sim.token_of(&own).expect("the tenant's pod kept its token");

    // The tenant: every pod of the pool it has not reached yet gets the
    // token, as soon as it has an address and answers.
    let pods: Api<Pod> = Api::namespaced(sim.client.clone(), NS);
    let stop = tokio_util::sync::CancellationToken::new();
    let replay = {
        let (stop, token, own) = (stop.clone(), token.clone(), own.clone());
        let header = attacker.to_json();
        tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let mut seen = Replays::default();
            let mut tick = tokio::time::interval(POLL);
            while !stop.is_cancelled() {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let Ok(list) = pods
                    .list(&ListParams::default().labels("skipper/deployment=pool"))
                    .await
                else {
                    continue;
                };
                for pod in list.items {
                    let name = name_of(&pod);
                    let Some(ip) = pod.status.and_then(|s| s.pod_ip) else {
                        continue;
                    };
                    if name == own || seen.answered.contains(&name) {
                        continue;
                    }
                    let Ok(resp) = http
                        .post(format!("http://{ip}:8888/__skipper/assign"))
                        .header(HEADER_TOKEN, &token)
                        .header(HEADER_FUNCTION, &header)
                        .send()
                        .await
                    else {
                        continue; // not listening yet: try again next round
                    };
                    let status = resp.status().as_u16();
                    seen.statuses.push(status);
                    if status == 200 {
                        seen.accepted.push(name.clone());
                    }
                    seen.answered.insert(name);
                }
            }
            seen
        })
    };

    // New tenants arrive throughout the attack.
    let started = tokio::time::Instant::now();
    let mut arrivals = tokio::time::interval(ARRIVALS);
    let mut tenants = Vec::new();
    let mut i = 0;
    while started.elapsed() < ATTACK {
        arrivals.tick().await;
        let f = function("pool", &format!("new-{i}"), 1);
        let mut grpc = ctl.grpc.clone();
        tenants.push(tokio::spawn(async move {
            let r = grpc.get_instance(get_instance(&f, Duration::from_secs(30))).await;
            (f.tenant, r.map(|r| r.into_inner().instance.and_then(|i| i.name)))
        }));
        i += 1;
    }
    let mut failed = Vec::new();
    let mut served = HashSet::new();
    for t in tenants {
        let (tenant, r) = t.await.unwrap();
        match r {
            Ok(Some(pod)) => {
                served.insert(pod);
            }
            Ok(None) => failed.push(format!("{tenant}: no instance")),
            Err(e) => failed.push(format!("{tenant}: {e:?}")),
        }
    }
    stop.cancel();
    let seen = replay.await.unwrap();

    assert!(
        seen.accepted.is_empty(),
        "pool pods accepted the replayed token: {:?}",
        seen.accepted
    );
    assert!(
        failed.is_empty(),
        "{} new tenants failed: {failed:?}",
        failed.len()
    );
    assert_eq!(served.len(), i, "every new tenant has a pod of its own");
    // The replay reached pods that were fresh when it arrived (the controller
    // claimed them afterwards), not only ones already assigned.
    let fresh = seen.statuses.iter().filter(|s| **s == 401).count();
    assert!(
        fresh >= 4,
        "the token reached {fresh} unassigned pods (statuses {:?})",
        seen.statuses
    );
    // Only the tenant's own pod holds a token for it.
    let list = Api::<Pod>::namespaced(sim.client.clone(), NS)
        .list(&ListParams::default().labels("skipper/deployment=pool"))
        .await
        .unwrap();
    for pod in list.items {
        let name = name_of(&pod);
        if let Some(t) = sim.token_of(&name) {
            let claims = sim.verifying_key().verify_signed(&t).unwrap();
            assert!(
                claims.sub != "attacker" || name == own,
                "pod {name} holds the tenant's token"
            );
        }
    }
    // No assignment failed, so nothing backed off.
    let events = ctl.core.cluster.events.snapshot();
    let failures: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventType::AssignmentFailed)
        .map(|e| e.message.clone())
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
    ctl.stop().await;
}
