//! Controller discovery: keeps the client's [`Endpoints`] current.
//!
//! - DNS: the (headless) service host resolved to all its addresses,
//!   re-resolved every [`DNS_REFRESH`] and early when a call found a
//!   controller unavailable.
//! - EndpointSlices: a watch on the headless Service's slices
//!   (`kubernetes.io/service-name=<name>`); [`select`] picks the ready
//!   endpoints, preferring the router's zone (spec §6.9).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tokio_util::sync::CancellationToken;

use crate::client::Endpoints;

/// Period of DNS re-resolution.
pub const DNS_REFRESH: Duration = Duration::from_secs(30);
/// Minimum spacing of failure-triggered re-resolutions.
pub const DNS_MIN_SPACING: Duration = Duration::from_secs(1);
/// Bound on one DNS lookup.
pub const DNS_TIMEOUT: Duration = Duration::from_secs(5);

/// Resolves `host:port` to its addresses (sorted, de-duplicated).
///
/// # Errors
/// When the lookup fails or times out.
pub async fn resolve(host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let lookup = tokio::net::lookup_host((host, port));
    let mut addrs: Vec<SocketAddr> = tokio::time::timeout(DNS_TIMEOUT, lookup)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "DNS lookup timed out"))??
        .collect();
    addrs.sort();
    addrs.dedup();
    Ok(addrs)
}

/// Resolves once into `endpoints` (an empty answer keeps the previous set).
pub async fn refresh_dns(host: &str, port: u16, endpoints: &Endpoints) {
    match resolve(host, port).await {
        Ok(addrs) if addrs.is_empty() => {
            tracing::warn!(host, "controller host resolved to no addresses");
        }
        Ok(addrs) => {
            if addrs != endpoints.addrs() {
                tracing::info!(host, ?addrs, "controller addresses changed");
                endpoints.replace(&addrs);
            }
        }
        Err(e) => tracing::warn!(host, error = %e, "failed to resolve controller host"),
    }
}

/// Re-resolves `host` periodically and after failures until `stop`.
pub async fn run_dns(host: String, port: u16, endpoints: Endpoints, stop: CancellationToken) {
    let failures = endpoints.failures();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(DNS_REFRESH) => {}
            () = failures.notified() => {
                // Space out failure-driven lookups.
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(DNS_MIN_SPACING) => {}
                }
            }
        }
        refresh_dns(&host, port, &endpoints).await;
    }
}

/// Whether the chosen endpoints are in the router's zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneMatch {
    SameZone,
    AllZones,
}

/// The controller addresses of `slices`: every address of every endpoint
/// whose `ready` condition is not explicitly false, as `addr:port`; only the
/// same-zone ones when `zone` is set and at least one matches.
#[must_use]
pub fn select(slices: &[&EndpointSlice], zone: &str, port: u16) -> (Vec<SocketAddr>, ZoneMatch) {
    let mut all = Vec::new();
    let mut same = Vec::new();
    for slice in slices {
        for ep in &slice.endpoints {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready) != Some(false);
            if !ready {
                continue;
            }
            let in_zone = !zone.is_empty() && ep.zone.as_deref() == Some(zone);
            for a in &ep.addresses {
                let Ok(ip) = a.parse::<IpAddr>() else {
                    continue;
                };
                let sa = SocketAddr::new(ip, port);
                all.push(sa);
                if in_zone {
                    same.push(sa);
                }
            }
        }
    }
    if same.is_empty() {
        (all, ZoneMatch::AllZones)
    } else {
        (same, ZoneMatch::SameZone)
    }
}

/// Watches the EndpointSlices of `service` in `namespace` and pushes the
/// selected addresses into `endpoints` after the initial list and on every
/// change, until `stop`.
pub async fn run_endpoint_slices(
    client: kube::Client,
    namespace: String,
    service: String,
    port: u16,
    zone: String,
    endpoints: Endpoints,
    stop: CancellationToken,
) {
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let (reader, writer) = reflector::store();
    let events = reflector(writer, watcher(api, config)).default_backoff();
    futures::pin_mut!(events);
    let mut synced = false;
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            e = events.next() => e,
        };
        match event {
            None => return,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "controller EndpointSlice watch failed; retrying");
                continue;
            }
            Some(Ok(watcher::Event::InitDone)) => synced = true,
            Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => continue,
            Some(Ok(_)) => {}
        }
        if !synced {
            continue;
        }
        let state = reader.state();
        let slices: Vec<&EndpointSlice> = state.iter().map(AsRef::as_ref).collect();
        let (addrs, zone_match) = select(&slices, &zone, port);
        if addrs != endpoints.addrs() {
            tracing::info!(?addrs, ?zone_match, "controller endpoints changed");
            endpoints.replace(&addrs);
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions};

    use super::*;

    fn ep(addr: &str, ready: Option<bool>, zone: Option<&str>) -> Endpoint {
        Endpoint {
            addresses: vec![addr.to_owned()],
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            zone: zone.map(str::to_owned),
            ..Default::default()
        }
    }

    fn slice(eps: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: eps,
            ..Default::default()
        }
    }

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn selection_table() {
        let a = slice(vec![
            ep("10.0.0.1", Some(true), Some("z1")),
            ep("10.0.0.2", None, Some("z2")),
            ep("10.0.0.3", Some(false), Some("z1")),
        ]);
        let b = slice(vec![
            ep("fd00::4", Some(true), Some("z2")),
            ep("not-an-ip", None, None),
        ]);
        let cases: &[(&str, &[&str], ZoneMatch)] = &[
            (
                "",
                &["10.0.0.1:50051", "10.0.0.2:50051", "[fd00::4]:50051"],
                ZoneMatch::AllZones,
            ),
            ("z1", &["10.0.0.1:50051"], ZoneMatch::SameZone),
            ("z2", &["10.0.0.2:50051", "[fd00::4]:50051"], ZoneMatch::SameZone),
            (
                "z9",
                &["10.0.0.1:50051", "10.0.0.2:50051", "[fd00::4]:50051"],
                ZoneMatch::AllZones,
            ),
        ];
        for (zone, want, m) in cases {
            let got = select(&[&a, &b], zone, 50051);
            assert_eq!(got, (addrs(want), *m), "zone {zone:?}");
        }
    }

    #[test]
    fn a_not_ready_same_zone_endpoint_falls_back_to_all_zones() {
        let s = slice(vec![
            ep("10.0.0.1", Some(false), Some("z1")),
            ep("10.0.0.2", Some(true), Some("z2")),
        ]);
        assert_eq!(
            select(&[&s], "z1", 1),
            (addrs(&["10.0.0.2:1"]), ZoneMatch::AllZones)
        );
    }

    #[test]
    fn no_slices_give_no_endpoints() {
        assert_eq!(select(&[], "z1", 1), (vec![], ZoneMatch::AllZones));
        let s = slice(vec![]);
        assert_eq!(select(&[&s], "", 1), (vec![], ZoneMatch::AllZones));
    }

    #[tokio::test]
    async fn dns_resolves_localhost() {
        let e = Endpoints::new(crate::client::ChannelSettings::default());
        refresh_dns("localhost", 4242, &e).await;
        assert!(e.addrs().iter().all(|a| a.port() == 4242 && a.ip().is_loopback()));
        assert!(!e.addrs().is_empty());
    }
}
