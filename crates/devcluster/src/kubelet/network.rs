//! Pod networking: where a pod's IP comes from and which network namespace
//! its containers share.
//!
//! - [`PodNetwork::Loopback`] (the simulator's default; works without
//!   privileges): every pod gets its own loopback address `127.a.b.c` in
//!   the host's network namespace.
//! - [`PodNetwork::Bridge`]: a real pod network, as the CNI `bridge` plugin
//!   builds it. The agent owns one Linux bridge on a private /24
//!   ([`SUBNET_RANGE`], one /24 per agent) with the gateway `.1` on the
//!   host; each pod gets its own network namespace (`ip netns`, a bind
//!   mount under `/run/netns` that keeps it alive like a pause container),
//!   a veth pair whose host end is on the bridge and whose pod end is
//!   `eth0` with the pod IP (and a MAC derived from it, `0a:58:<ip>`, as
//!   the CNI plugin does, so a reused IP never meets a stale ARP entry),
//!   `lo` up and a default route via the gateway. The host reaches every
//!   pod IP through the bridge (probes connect there, as a real kubelet's
//!   do), pods reach each other and the host's gateway address.
//!
//! Concurrent agents (one per test process) never share a /24: each /24
//! has a lock file under [`STATE_DIR`] that its agent holds (`flock`) while
//! it lives and removes with its bridge ([`crate::lockfile`]), and a /24
//! that overlaps any route of the host is skipped. A bridge, namespace or
//! lock file whose lock nobody holds belongs to a dead agent and is removed
//! when an agent starts.
//!
//! Links and namespaces are managed with the `ip` command of iproute2
//! rather than raw netlink: `ip netns` is the standard way to pin a network
//! namespace to a path, and an operator inspects what the agent built with
//! the same tool.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::lockfile::{self, Lock};

/// Where the per-/24 lock files live.
pub const STATE_DIR: &str = "/run/skipper-podnet";
/// Where `ip netns` pins network namespaces.
pub const NETNS_DIR: &str = "/run/netns";
/// The range the agents' /24s come from (`10.213.<slot>.0/24`).
pub const SUBNET_RANGE: &str = "10.213.0.0/16";
/// Bridges are `skpod<slot>`; pod namespaces `skpod<slot>-<seq>`.
pub const BRIDGE_PREFIX: &str = "skpod";
/// Host ends of pod veths are `skv<slot>-<seq>`.
pub const VETH_PREFIX: &str = "skv";
/// How many /24s the range holds.
const SLOTS: u16 = 256;
/// The pod addresses of a /24: `.2` to `.254` (`.1` is the gateway).
const FIRST_HOST: u8 = 2;
const LAST_HOST: u8 = 254;
/// `CAP_NET_ADMIN` and `CAP_SYS_ADMIN` (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;

/// How the agent gives pods their addresses.
#[derive(Debug, Clone, Default)]
pub enum PodNetwork {
    /// A loopback address per pod in the host's network namespace.
    #[default]
    Loopback,
    /// A network namespace per pod on this bridge.
    Bridge(Arc<Bridge>),
}

impl PodNetwork {
    /// The node's address (a pod's `hostIP`): the gateway on a bridge,
    /// `127.0.0.1` on loopback.
    #[must_use]
    pub fn host_ip(&self) -> Ipv4Addr {
        match self {
            Self::Loopback => Ipv4Addr::LOCALHOST,
            Self::Bridge(b) => b.gateway(),
        }
    }
}

/// Why the pod network could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error(
        "bridge pod networking needs {missing}, which this process lacks: run the node agent as root with full privileges"
    )]
    Capability { missing: String },
    #[error(
        "bridge pod networking needs the `ip` command of iproute2, which is not installed (apt-get install -y iproute2)"
    )]
    IpMissing,
    #[error("{what} {path}: {source}")]
    State {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`ip {args}` failed: {message}")]
    Command { args: String, message: String },
    #[error(
        "no free /24 for a pod bridge in {SUBNET_RANGE}: each is used by another agent or overlaps a route of this host"
    )]
    NoSubnet,
    #[error("no free pod address on the bridge {bridge} (it holds {capacity} pods)")]
    Exhausted { bridge: String, capacity: usize },
    #[error("the pod bridge {0} is removed")]
    Removed(String),
    #[error("setting up the pod's network was interrupted: {0}")]
    Interrupted(String),
}

// ---------------------------------------------------------------------------
// Pure parts: names, addresses, allocation.

/// The bridge of a slot.
#[must_use]
pub fn bridge_name(slot: u16) -> String {
    format!("{BRIDGE_PREFIX}{slot}")
}

/// The network namespace of the `seq`-th pod of a slot.
#[must_use]
pub fn netns_name(slot: u16, seq: u64) -> String {
    format!("{BRIDGE_PREFIX}{slot}-{seq}")
}

/// The host end of the veth of the `seq`-th pod of a slot (at most 15
/// bytes, the kernel's limit, for `seq` below 10^8).
#[must_use]
pub fn veth_name(slot: u16, seq: u64) -> String {
    format!("{VETH_PREFIX}{slot}-{}", seq % 100_000_000)
}

/// The slot of a bridge name (`skpod17` → 17).
#[must_use]
pub fn parse_bridge_name(name: &str) -> Option<u16> {
    let digits = name.strip_prefix(BRIDGE_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().filter(|s| *s < SLOTS)
}

/// The slot of a pod namespace name (`skpod17-4` → 17).
#[must_use]
pub fn parse_netns_name(name: &str) -> Option<u16> {
    let (bridge, seq) = name.split_once('-')?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    parse_bridge_name(bridge)
}

/// The /24 of a slot.
#[must_use]
pub fn subnet(slot: u16) -> Ipv4Addr {
    #[allow(clippy::cast_possible_truncation)] // slot < 256
    Ipv4Addr::new(10, 213, slot as u8, 0)
}

/// The gateway (host side) of a slot.
#[must_use]
pub fn gateway(slot: u16) -> Ipv4Addr {
    let [a, b, c, _] = subnet(slot).octets();
    Ipv4Addr::new(a, b, c, 1)
}

/// The MAC of a pod's `eth0`: `0a:58` and the IP, as the CNI bridge plugin
/// makes it.
#[must_use]
pub fn mac_for(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("0a:58:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// The bridge's own MAC: its gateway's [`mac_for`] (never a pod's, as the
/// gateway is never a pod's address). Set when the bridge is created, so
/// the kernel keeps it: a bridge whose address is not set takes the
/// lowest MAC of its ports and changes it as ports come and go. When the
/// port holding it goes with its pod, the pods whose ARP entry for the
/// gateway names it send to a MAC nothing answers to: their packets to the
/// host are lost until the host sends them something (its ARP request
/// carries the new MAC) or the entry expires.
#[must_use]
pub fn bridge_mac(slot: u16) -> String {
    mac_for(gateway(slot))
}

fn network_of(addr: Ipv4Addr, prefix: u8) -> u32 {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    u32::from(addr) & mask
}

/// Whether `a/pa` and `b/pb` share an address.
#[must_use]
pub fn overlaps((a, pa): (Ipv4Addr, u8), (b, pb): (Ipv4Addr, u8)) -> bool {
    let p = pa.min(pb);
    network_of(a, p) == network_of(b, p)
}

/// The destinations of `ip -j -4 route show table all` (the default route
/// left out: it overlaps everything and claims nothing).
#[must_use]
pub fn parse_routes(json: &str) -> Vec<(Ipv4Addr, u8)> {
    let routes: Vec<serde_json::Value> = serde_json::from_str(json).unwrap_or_default();
    routes
        .iter()
        .filter_map(|r| r.get("dst")?.as_str())
        .filter(|d| *d != "default")
        .filter_map(|d| {
            let (ip, prefix) = d.split_once('/').unwrap_or((d, "32"));
            Some((ip.parse().ok()?, prefix.parse().ok().filter(|p| *p <= 32)?))
        })
        .collect()
}

/// The capabilities bridge mode needs that `CapEff` of `/proc/self/status`
/// lacks.
#[must_use]
pub fn missing_capabilities(status: &str) -> Vec<&'static str> {
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    [(CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")]
        .into_iter()
        .filter(|(bit, _)| effective & (1 << bit) == 0)
        .map(|(_, name)| name)
        .collect()
}

/// The pod addresses of a /24, handed out round-robin (after the last one
/// given), as host-local IPAM does: a freed address is reused, but not at
/// once while others are free.
#[derive(Debug)]
pub struct IpPool {
    subnet: Ipv4Addr,
    used: BTreeSet<u8>,
    last: u8,
}

impl IpPool {
    /// The pool of `subnet` (a /24).
    #[must_use]
    pub fn new(subnet: Ipv4Addr) -> Self {
        Self {
            subnet,
            used: BTreeSet::new(),
            last: FIRST_HOST - 1,
        }
    }

    /// How many pods the /24 holds.
    #[must_use]
    pub fn capacity() -> usize {
        usize::from(LAST_HOST - FIRST_HOST + 1)
    }

    /// A free address, or `None` when every one is in use.
    pub fn allocate(&mut self) -> Option<Ipv4Addr> {
        let hosts = FIRST_HOST..=LAST_HOST;
        let after = hosts.clone().filter(|h| *h > self.last);
        let before = hosts.filter(|h| *h <= self.last);
        let host = after.chain(before).find(|h| !self.used.contains(h))?;
        self.used.insert(host);
        self.last = host;
        let [a, b, c, _] = self.subnet.octets();
        Some(Ipv4Addr::new(a, b, c, host))
    }

    /// Gives `ip` back.
    pub fn release(&mut self, ip: Ipv4Addr) {
        if ip.octets()[..3] == self.subnet.octets()[..3] {
            self.used.remove(&ip.octets()[3]);
        }
    }
}

// ---------------------------------------------------------------------------
// The `ip` command.

fn find_ip() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("ip"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"].map(PathBuf::from))
        .find(|p| p.is_file())
}

/// Runs `ip [-n netns] args` (or, with `batch`, `ip [-n netns] -batch -`
/// with those lines); its stdout.
fn ip(exe: &Path, netns: Option<&str>, args: &[&str], batch: &[String]) -> Result<String, NetworkError> {
    let mut cmd = Command::new(exe);
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    if batch.is_empty() {
        cmd.args(args);
    } else {
        cmd.args(["-batch", "-"]);
    }
    let shown = || {
        let mut all: Vec<String> = netns.map(|n| vec!["-n".into(), n.into()]).unwrap_or_default();
        if batch.is_empty() {
            all.extend(args.iter().map(|a| (*a).to_owned()));
        } else {
            all.push(format!("-batch [{}]", batch.join("; ")));
        }
        all.join(" ")
    };
    cmd.stdin(if batch.is_empty() {
        Stdio::null()
    } else {
        Stdio::piped()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| NetworkError::Command {
        args: shown(),
        message: e.to_string(),
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write as _;
        let _ = stdin.write_all(format!("{}\n", batch.join("\n")).as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| NetworkError::Command {
        args: shown(),
        message: e.to_string(),
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NetworkError::Command {
            args: shown(),
            message: String::from_utf8_lossy(&out.stderr).trim().replace('\n', "; "),
        })
    }
}

fn exists_error(e: &NetworkError) -> bool {
    matches!(e, NetworkError::Command { message, .. } if message.contains("File exists"))
}

/// Tries to take the lock of `slot` (`None` when another agent holds it).
fn try_lock(slot: u16) -> Result<Option<Lock>, NetworkError> {
    let path = Path::new(STATE_DIR).join(format!("{slot}.lock"));
    Lock::try_take(&path).map_err(|source| NetworkError::State {
        what: "locking",
        path,
        source,
    })
}

/// Pod namespaces pinned under [`NETNS_DIR`] that belong to `slot`.
fn namespaces_of(slot: u16) -> Vec<String> {
    std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| parse_netns_name(n) == Some(slot))
        .collect()
}

/// Removes what a slot left: its pod namespaces (their veths go with them)
/// and its bridge. Errors are ignored: this is cleanup.
fn clean_slot(exe: &Path, slot: u16) {
    for ns in namespaces_of(slot) {
        let _ = ip(exe, None, &["netns", "del", &ns], &[]);
    }
    let name = bridge_name(slot);
    if Path::new("/sys/class/net").join(&name).exists() {
        let _ = ip(exe, None, &["link", "del", &name], &[]);
    }
}

/// Removes the bridges and pod namespaces of agents that are gone (their
/// slot's lock is free).
fn sweep_stale(exe: &Path) -> Result<(), NetworkError> {
    let mut slots: BTreeSet<u16> = std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| parse_bridge_name(e.file_name().to_str()?))
        .collect();
    slots.extend(
        std::fs::read_dir(NETNS_DIR)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| parse_netns_name(e.file_name().to_str()?)),
    );
    // Lock files of slots whose bridge is gone already.
    slots.extend(
        lockfile::list(Path::new(STATE_DIR))
            .into_iter()
            .filter_map(|(name, _)| name.parse::<u16>().ok()),
    );
    for slot in slots {
        if let Some(lock) = try_lock(slot)? {
            if Path::new("/sys/class/net").join(bridge_name(slot)).exists() || !namespaces_of(slot).is_empty()
            {
                tracing::info!(bridge = %bridge_name(slot), "removing the pod network of an agent that is gone");
                clean_slot(exe, slot);
            }
            lock.remove();
        }
    }
    Ok(())
}

/// One agent's pod bridge. Removed (with every pod namespace still on it)
/// by [`Bridge::remove`] or on drop.
#[derive(Debug)]
pub struct Bridge {
    slot: u16,
    name: String,
    exe: PathBuf,
    pool: Mutex<IpPool>,
    seq: AtomicU64,
    lock: Mutex<Option<Lock>>,
    removed: AtomicBool,
}

impl Bridge {
    /// Removes the leftovers of dead agents, picks a free /24, creates the
    /// bridge with its fixed MAC ([`bridge_mac`]) and the gateway address,
    /// and brings it up.
    ///
    /// # Errors
    /// [`NetworkError`]: a missing capability or `ip` command (one line
    /// naming it), or no free /24.
    pub fn create() -> Result<Self, NetworkError> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let missing = missing_capabilities(&status);
        if !missing.is_empty() {
            return Err(NetworkError::Capability {
                missing: missing.join(" and "),
            });
        }
        let exe = find_ip().ok_or(NetworkError::IpMissing)?;
        sweep_stale(&exe)?;
        let routes = parse_routes(&ip(
            &exe,
            None,
            &["-j", "-4", "route", "show", "table", "all"],
            &[],
        )?);
        let start: u16 = rand::random_range(0..SLOTS);
        for i in 0..SLOTS {
            let slot = (start + i) % SLOTS;
            let Some(mut lock) = try_lock(slot)? else {
                continue;
            };
            if routes.iter().any(|r| overlaps(*r, (subnet(slot), 24))) {
                lock.remove();
                continue;
            }
            let name = bridge_name(slot);
            let mac = bridge_mac(slot);
            match ip(
                &exe,
                None,
                &["link", "add", "name", &name, "address", &mac, "type", "bridge"],
                &[],
            ) {
                Ok(_) => {}
                Err(e) if exists_error(&e) => {
                    lock.remove();
                    continue;
                }
                Err(e) => {
                    lock.remove();
                    return Err(e);
                }
            }
            let gw = format!("{}/24", gateway(slot));
            let up = ip(
                &exe,
                None,
                &[],
                &[format!("addr add {gw} dev {name}"), format!("link set {name} up")],
            );
            if let Err(e) = up {
                let _ = ip(&exe, None, &["link", "del", &name], &[]);
                lock.remove();
                return Err(e);
            }
            let _ = lock.write(&format!("{}\n", std::process::id()));
            tracing::info!(bridge = %name, gateway = %gateway(slot), "pod network ready");
            return Ok(Self {
                slot,
                name,
                exe,
                pool: Mutex::new(IpPool::new(subnet(slot))),
                seq: AtomicU64::new(1),
                lock: Mutex::new(Some(lock)),
                removed: AtomicBool::new(false),
            });
        }
        Err(NetworkError::NoSubnet)
    }

    /// The bridge's interface name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The gateway address, on the host.
    #[must_use]
    pub fn gateway(&self) -> Ipv4Addr {
        gateway(self.slot)
    }

    /// The pods' /24.
    #[must_use]
    pub fn subnet(&self) -> (Ipv4Addr, u8) {
        (subnet(self.slot), 24)
    }

    /// The pod namespaces that exist on this bridge.
    #[must_use]
    pub fn namespaces(&self) -> Vec<String> {
        namespaces_of(self.slot)
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, IpPool> {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new pod's network namespace, veth and address.
    ///
    /// # Errors
    /// [`NetworkError`]: no free address, or an `ip` command that failed.
    pub fn attach(self: &Arc<Self>) -> Result<PodLink, NetworkError> {
        if self.removed.load(Ordering::SeqCst) {
            return Err(NetworkError::Removed(self.name.clone()));
        }
        let addr = self.pool().allocate().ok_or_else(|| NetworkError::Exhausted {
            bridge: self.name.clone(),
            capacity: IpPool::capacity(),
        })?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let link = PodLink {
            bridge: self.clone(),
            ip: addr,
            netns: netns_name(self.slot, seq),
            veth: veth_name(self.slot, seq),
        };
        let host = [
            format!("netns add {}", link.netns),
            format!(
                "link add {} type veth peer name eth0 address {} netns {}",
                link.veth,
                mac_for(addr),
                link.netns
            ),
            format!("link set {} master {} up", link.veth, self.name),
        ];
        ip(&self.exe, None, &[], &host)?;
        let pod = [
            format!("addr add {addr}/24 dev eth0"),
            "link set lo up".to_owned(),
            "link set eth0 up".to_owned(),
            format!("route add default via {}", self.gateway()),
        ];
        ip(&self.exe, Some(&link.netns), &[], &pod)?;
        Ok(link)
    }

    /// Adds `addr` to the bridge as an address of the host (a /32 of the
    /// bridge's /24: a kubelet node's `InternalIP`); it goes with the bridge.
    ///
    /// # Errors
    /// [`NetworkError::Command`] when `ip` refuses.
    pub fn add_address(&self, addr: Ipv4Addr) -> Result<(), NetworkError> {
        match ip(
            &self.exe,
            None,
            &["addr", "add", &format!("{addr}/32"), "dev", &self.name],
            &[],
        ) {
            Err(e) if !exists_error(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Removes an address [`Bridge::add_address`] added (nothing when it is gone).
    pub fn remove_address(&self, addr: Ipv4Addr) {
        if !self.removed.load(Ordering::SeqCst) {
            let _ = ip(
                &self.exe,
                None,
                &["addr", "del", &format!("{addr}/32"), "dev", &self.name],
                &[],
            );
        }
    }

    /// Deletes every pod namespace of this bridge and the bridge, and lets
    /// another agent have its /24. Idempotent.
    pub fn remove(&self) {
        if self.removed.swap(true, Ordering::SeqCst) {
            return;
        }
        clean_slot(&self.exe, self.slot);
        // With the bridge gone, its lock file goes too (removed while held).
        if let Some(lock) = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            lock.remove();
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A pod's place on the bridge: its namespace, veth and address. Dropping
/// it deletes the veth and the namespace and frees the address.
#[derive(Debug)]
pub struct PodLink {
    bridge: Arc<Bridge>,
    ip: Ipv4Addr,
    netns: String,
    veth: String,
}

impl PodLink {
    /// The pod IP.
    #[must_use]
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The namespace's name (`ip netns`).
    #[must_use]
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// The path that pins the namespace (what containers `setns` into).
    #[must_use]
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns)
    }

    /// The host end of the pod's veth.
    #[must_use]
    pub fn veth(&self) -> &str {
        &self.veth
    }
}

impl Drop for PodLink {
    fn drop(&mut self) {
        // The veth goes first: a process that outlives the pod keeps the
        // namespace alive, but no longer the address on the bridge.
        let exe = &self.bridge.exe;
        if !self.bridge.removed.load(Ordering::SeqCst) {
            let _ = ip(exe, None, &["link", "del", &self.veth], &[]);
            let _ = ip(exe, None, &["netns", "del", &self.netns], &[]);
        }
        self.bridge.pool().release(self.ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bridge_mac_is_a_local_unicast_address_no_pod_has() {
        for slot in [0, 17, 255] {
            let mac = bridge_mac(slot);
            let first = u8::from_str_radix(&mac[..2], 16).unwrap();
            assert_eq!(first & 0x02, 0x02, "{mac}: locally administered");
            assert_eq!(first & 0x01, 0, "{mac}: unicast");
            let mut pool = IpPool::new(subnet(slot));
            while let Some(ip) = pool.allocate() {
                assert_ne!(mac_for(ip), mac, "pod {ip} of slot {slot}");
            }
        }
        assert_ne!(bridge_mac(1), bridge_mac(2));
    }

    #[test]
    fn names_fit_the_kernel_limit_and_parse_back() {
        assert_eq!(bridge_name(17), "skpod17");
        assert_eq!(parse_bridge_name("skpod17"), Some(17));
        assert_eq!(parse_bridge_name("skpod"), None);
        assert_eq!(parse_bridge_name("skpod256"), None, "out of the range");
        assert_eq!(parse_bridge_name("skpodx"), None);
        assert_eq!(parse_bridge_name("docker0"), None);
        assert_eq!(netns_name(255, 12), "skpod255-12");
        assert_eq!(parse_netns_name("skpod255-12"), Some(255));
        assert_eq!(parse_netns_name("skpod255"), None);
        assert_eq!(parse_netns_name("skpod3-"), None);
        assert_eq!(parse_netns_name("cni-1234"), None);
        assert!(veth_name(255, 99_999_999).len() <= 15);
        assert!(veth_name(255, u64::MAX).len() <= 15);
        assert!(bridge_name(255).len() <= 15);
    }

    #[test]
    fn slots_map_to_disjoint_private_subnets() {
        assert_eq!(subnet(0), Ipv4Addr::new(10, 213, 0, 0));
        assert_eq!(gateway(7), Ipv4Addr::new(10, 213, 7, 1));
        assert!(!overlaps((subnet(1), 24), (subnet(2), 24)));
        assert!(gateway(255).is_private());
    }

    #[test]
    fn overlap_of_networks() {
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert!(overlaps((ip("10.0.0.0"), 8), (ip("10.213.4.0"), 24)));
        assert!(overlaps((ip("10.213.4.9"), 32), (ip("10.213.4.0"), 24)));
        assert!(!overlaps((ip("10.213.5.9"), 32), (ip("10.213.4.0"), 24)));
        assert!(!overlaps((ip("192.0.2.0"), 24), (ip("10.213.4.0"), 24)));
        assert!(overlaps((ip("0.0.0.0"), 0), (ip("10.213.4.0"), 24)));
    }

    #[test]
    fn routes_parse_from_ip_json_without_the_default() {
        let json = r#"[{"dst":"default","gateway":"192.0.2.1","dev":"eth0"},
            {"dst":"192.0.2.0/24","dev":"eth0"},
            {"type":"local","dst":"127.0.0.1","dev":"lo","table":"local"},
            {"dst":"10.213.9.0/24","dev":"skpod9"},
            {"dst":"fe80::/64"}]"#;
        assert_eq!(
            parse_routes(json),
            [
                (Ipv4Addr::new(192, 0, 2, 0), 24),
                (Ipv4Addr::LOCALHOST, 32),
                (Ipv4Addr::new(10, 213, 9, 0), 24)
            ]
        );
        assert!(parse_routes("not json").is_empty());
    }

    #[test]
    fn capabilities_are_read_from_cap_eff() {
        let all = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(missing_capabilities(all).is_empty());
        let none = "CapEff:\t0000000000000000\n";
        assert_eq!(missing_capabilities(none), ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]);
        let sys_admin_only = format!("CapEff:\t{:016x}\n", 1u64 << 21);
        assert_eq!(missing_capabilities(&sys_admin_only), ["CAP_NET_ADMIN"]);
        assert_eq!(missing_capabilities(""), ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]);
    }

    #[test]
    fn pod_addresses_go_round_robin_and_are_reused_after_release() {
        let mut pool = IpPool::new(subnet(3));
        let first = pool.allocate().unwrap();
        assert_eq!(first, Ipv4Addr::new(10, 213, 3, 2), ".1 is the gateway");
        let second = pool.allocate().unwrap();
        assert_eq!(second, Ipv4Addr::new(10, 213, 3, 3));
        pool.release(first);
        assert_eq!(
            pool.allocate().unwrap(),
            Ipv4Addr::new(10, 213, 3, 4),
            "a freed address waits while others are free"
        );
        let mut all = vec![first, second];
        while let Some(ip) = pool.allocate() {
            all.push(ip);
        }
        assert_eq!(pool.used.len(), IpPool::capacity());
        assert!(all.iter().all(|ip| ip.octets()[3] >= 2 && ip.octets()[3] <= 254));
        pool.release(Ipv4Addr::new(10, 213, 3, 100));
        assert_eq!(
            pool.allocate(),
            Some(Ipv4Addr::new(10, 213, 3, 100)),
            "reused once freed"
        );
        assert_eq!(pool.allocate(), None);
        pool.release(Ipv4Addr::new(10, 213, 4, 100));
        assert_eq!(pool.allocate(), None, "an address of another /24 frees nothing");
    }

    #[test]
    fn macs_derive_from_the_ip() {
        assert_eq!(mac_for(Ipv4Addr::new(10, 213, 3, 17)), "0a:58:0a:d5:03:11");
    }
}
