//! Process checks shared by the integration tests and the end-to-end and
//! reliability suites (`e2e/harness.rs`): liveness,
//! process trees, the process behind a listening socket, and a command's
//! success.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;

/// Pids of every process (the numeric entries of `/proc`).
fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Every process descended from `pid` (children, grandchildren, ...).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of = HashMap::new();
    for p in all_pids() {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(pp) = ppid {
            parent_of.insert(p, pp);
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(cur) = frontier.pop() {
        for (child, parent) in &parent_of {
            if *parent == cur {
                out.push(*child);
                frontier.push(*child);
            }
        }
    }
    out
}

/// The pid of the process listening on `ip:port` (TCP), found the way
/// `ss -p` finds it: the socket in the TCP table of its network namespace
/// (`/proc/<pid>/net/tcp` of any process in it, so a pod in its own
/// network namespace is found too), then the process holding the socket.
pub fn listener_pid(ip: Ipv4Addr, port: u16) -> Option<u32> {
    let want = format!("{:08X}:{port:04X}", u32::from_le_bytes(ip.octets()));
    let pids = all_pids();
    let mut namespaces = HashSet::new();
    let inode = pids.iter().find_map(|pid| {
        let ns = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
        if !namespaces.insert(ns) {
            return None;
        }
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
        table.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // State 0A is LISTEN.
            (f.get(1) == Some(&want.as_str()) && f.get(3) == Some(&"0A"))
                .then(|| f.get(9).map(|s| (*s).to_owned()))?
        })
    })?;
    let link = format!("socket:[{inode}]");
    pids.into_iter().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == link))
    })
}

/// The standard output of a command that ran to success; panics naming
/// `what` with its status, standard output and standard error otherwise.
#[must_use]
pub fn succeeded(what: &str, out: std::process::Output) -> Vec<u8> {
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
