//! What the scenarios measure: process memory from `/proc`, the processes of
//! a playground (router, controllers), single-attempt load that counts every
//! outcome, and the pods left behind.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;

use crate::harness::{Dev, NS, TENANT, wait_until};

/// One mebibyte.
pub const MIB: u64 = 1024 * 1024;

/// Resident memory of a process: now (`VmRSS`) and its peak (`VmHWM`), in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Rss {
    pub now: u64,
    pub peak: u64,
}

/// Reads `/proc/<pid>/status`.
pub fn rss(pid: u32) -> Rss {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    let field = |name: &str| -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unreadable {line:?}"));
        kb * 1024
    };
    Rss {
        now: field("VmRSS:"),
        peak: field("VmHWM:"),
    }
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)]
    let m = bytes as f64 / MIB as f64;
    format!("{m:.1} MiB")
}

/// Prints one figure of the suite as a `chaos:` line (collected by `make chaos`).
pub fn figure(name: &str, value: impl std::fmt::Display) {
    eprintln!("chaos: {name}: {value}");
}

/// The parent pid and the arguments of process `pid`.
fn process(pid: u32) -> Option<(u32, Vec<String>)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`: comm may contain spaces, so split after the last ')'.
    let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some((ppid, args))
}

/// The pid of the playground's `skipper router` child process.
pub fn router_pid(dev: &Dev) -> u32 {
    let parent = dev.pid();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            process(*pid).is_some_and(|(ppid, args)| {
                ppid == parent && args.get(1).map(String::as_str) == Some("router")
            })
        })
        .unwrap_or_else(|| panic!("no router child of skipper dev (pid {parent})"))
}

/// Controller pods: `(pod name, pod IP, process id)` of every running one.
pub async fn controllers(dev: &Dev) -> Vec<(String, String, u32)> {
    let api: Api<Pod> = Api::namespaced(dev.client.clone(), "skipper");
    let mut out: Vec<(String, String, u32)> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            let ip = status.pod_ip.clone()?;
            // The controller process: the one serving gRPC on the pod IP.
            let pid = crate::harness::listener_pid(ip.parse().ok()?, 50051)?;
            Some((p.metadata.name?, ip, pid))
        })
        .collect();
    out.sort();
    out
}

/// Outcomes of requests by kind (`200`, `502`, `error: ...`).
#[derive(Debug, Default, Clone)]
pub struct Outcomes(pub BTreeMap<String, u64>);

impl Outcomes {
    fn add(&mut self, kind: String) {
        *self.0.entry(kind).or_default() += 1;
    }

    /// Requests whose outcome starts with `kind` (a status code: its answers
    /// are counted whatever their body).
    pub fn count(&self, kind: &str) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| k.as_str() == kind || k.starts_with(&format!("{kind} ")))
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests that did not end in a 2xx answer.
    pub fn failed(&self) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| !k.starts_with('2'))
            .map(|(_, n)| n)
            .sum()
    }

    fn merge(&mut self, other: &Self) {
        for (k, n) in &other.0 {
            *self.0.entry(k.clone()).or_default() += n;
        }
    }
}

impl std::fmt::Display for Outcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        f.write_str(&parts.join(", "))
    }
}

/// The outcome of one request through the router: its status (a 2xx only
/// when the echo names the function's tenant) or the client's error.
async fn outcome(http: &reqwest::Client, router: &str, function: &str, tenant: &str) -> String {
    let sent = http
        .get(format!("{router}/chaos"))
        .header("X-Skipper-Function", function)
        .send()
        .await;
    match sent {
        Ok(resp) => {
            let status = resp.status().as_u16();
            match resp.text().await {
                Ok(body) if (200..300).contains(&status) => {
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    if v["tenant"] == tenant {
                        status.to_string()
                    } else {
                        format!("wrong tenant: {body}")
                    }
                }
                Ok(body) => {
                    let line: String = body
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .chars()
                        .take(100)
                        .collect();
                    format!("{status} {line}")
                }
                Err(e) => format!("error reading the body after {status}: {e}"),
            }
        }
        Err(e) => format!("error: {e}"),
    }
}

/// Sends `count` requests through the router, `concurrency` at a time, the
/// `i`-th with function header `header(i)`; every outcome counted (no retry).
pub async fn burst(
    dev: &Dev,
    count: usize,
    concurrency: usize,
    header: impl Fn(usize) -> (String, String) + Send + Sync + 'static,
) -> Outcomes {
    let next = Arc::new(AtomicU64::new(0));
    let header = Arc::new(header);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (http, router, next, header) =
            (dev.http.clone(), dev.router.clone(), next.clone(), header.clone());
        set.spawn(async move {
            let mut seen = Outcomes::default();
            loop {
                let i = usize::try_from(next.fetch_add(1, Ordering::SeqCst)).unwrap();
                if i >= count {
                    return seen;
                }
                let (function, tenant) = header(i);
                seen.add(outcome(&http, &router, &function, &tenant).await);
            }
        });
    }
    let mut all = Outcomes::default();
    while let Some(r) = set.join_next().await {
        all.merge(&r.unwrap());
    }
    all
}

/// Steady single-attempt load over `functions` (`(header, tenant)`) until
/// [`Load::finish`]; each request's outcome is counted, nothing is retried.
pub struct Load {
    done: Arc<AtomicU64>,
    stop: CancellationToken,
    seen: Arc<Mutex<Outcomes>>,
    set: tokio::task::JoinSet<()>,
}

impl Load {
    /// Starts `workers` loops.
    pub fn start(dev: &Dev, functions: Vec<(String, String)>, workers: usize) -> Self {
        let functions = Arc::new(functions);
        let done = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let seen = Arc::new(Mutex::new(Outcomes::default()));
        let mut set = tokio::task::JoinSet::new();
        for w in 0..workers {
            let (http, router) = (dev.http.clone(), dev.router.clone());
            let (functions, done, stop, seen) = (functions.clone(), done.clone(), stop.clone(), seen.clone());
            set.spawn(async move {
                let mut i = w;
                while !stop.is_cancelled() {
                    let (f, tenant) = &functions[i % functions.len()];
                    i += 1;
                    let o = outcome(&http, &router, f, tenant).await;
                    seen.lock().unwrap().add(o);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        Self {
            done,
            stop,
            seen,
            set,
        }
    }

    /// Waits (at most 60 s) until `n` more requests have completed.
    pub async fn progress(&self, n: u64) {
        let target = self.done.load(Ordering::SeqCst) + n;
        wait_until(&format!("{n} more requests"), Duration::from_secs(60), || {
            (self.done.load(Ordering::SeqCst) >= target).then_some(())
        })
        .await;
    }

    /// The outcomes so far.
    pub fn outcomes(&self) -> Outcomes {
        self.seen.lock().unwrap().clone()
    }

    /// Stops the load (requests in flight complete) and returns every outcome.
    pub async fn finish(mut self) -> Outcomes {
        self.stop.cancel();
        while let Some(r) = self.set.join_next().await {
            r.unwrap();
        }
        self.outcomes()
    }
}

/// A new tenant every `every` until [`Arrivals::finish`]: one request each,
/// its outcome counted, nothing retried (a cold request claims a pool pod).
pub struct Arrivals {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Outcomes>,
}

impl Arrivals {
    /// Starts the arrivals of tenants `<prefix>-0`, `<prefix>-1`, ...
    pub fn start(dev: &Dev, prefix: &str, every: Duration) -> Self {
        let (http, router, prefix) = (dev.http.clone(), dev.router.clone(), prefix.to_owned());
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = Outcomes::default();
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for i in 0.. {
                tokio::select! {
                    () = token.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let tenant = format!("{prefix}-{i}");
                let function = crate::harness::single(&tenant);
                seen.add(outcome(&http, &router, &function, &tenant).await);
            }
            seen
        });
        Self { stop, task }
    }

    /// Stops the arrivals (the request in flight completes); every outcome.
    pub async fn finish(self) -> Outcomes {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// Tenant-labelled (claimed) pods that are not terminating.
pub async fn claimed_pods(dev: &Dev) -> Vec<String> {
    let api: Api<Pod> = Api::namespaced(dev.client.clone(), NS);
    api.list(&ListParams::default().labels(TENANT))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// Waits (at most `limit`) for every claimed pod to be deleted once the
/// tenants are idle; prints and returns the pods still there at the end.
pub async fn leaked_pods(dev: &Dev, scenario: &str, limit: Duration) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = claimed_pods(dev).await;
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            figure(&format!("{scenario}: leaked pods"), left.len());
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What [`Claims`] saw of the tenants' pods.
#[derive(Debug, Default, Clone)]
pub struct ClaimLog {
    /// Tenant → pods claimed for it while another of its pods was live and
    /// had been Ready ever since its own claim (the second claim of a race;
    /// a replacement of a pod that turned unready is not counted).
    pub over_claims: BTreeMap<String, Vec<String>>,
    /// Tenant → most live (claimed, not terminating) pods at once, whatever the reason.
    pub max_live: BTreeMap<String, usize>,
    /// Claimed pods that went from Ready to unready while live.
    pub unready_flips: usize,
}

/// Watches the pool namespace and judges every claim against the pods its
/// tenant already had (the watch sees the API server's own order of events).
pub struct Claims {
    log: Arc<Mutex<ClaimLog>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Seen {
    name: String,
    tenant: Option<String>,
    ready: bool,
    live: bool,
    /// Unready at some point since it was claimed.
    faltered: bool,
}

impl Claims {
    /// Starts watching; returns once the initial list has been seen.
    pub async fn start(dev: &Dev) -> Self {
        use futures::StreamExt as _;
        use kube::runtime::{WatchStreamExt as _, watcher};
        let api: Api<Pod> = Api::namespaced(dev.client.clone(), NS);
        let log = Arc::new(Mutex::new(ClaimLog::default()));
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
        let shared = log.clone();
        let task = tokio::spawn(async move {
            let mut synced_tx = Some(synced_tx);
            let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
            let mut pods: BTreeMap<String, Seen> = BTreeMap::new();
            while let Some(ev) = stream.next().await {
                let (pod, deleted) = match ev {
                    Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => (p, false),
                    Ok(watcher::Event::Delete(p)) => (p, true),
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                let tenant = pod.metadata.labels.as_ref().and_then(|l| l.get(TENANT)).cloned();
                let live = !deleted
                    && pod.metadata.deletion_timestamp.is_none()
                    && pod.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed");
                let ready = crate::harness::pod_ready(&pod);
                let mut log = shared.lock().unwrap();
                let before = pods.get(&uid);
                let newly_claimed = tenant.is_some() && before.is_none_or(|b| b.tenant.is_none());
                if before.is_some_and(|b| b.tenant.is_some() && b.live && b.ready) && live && !ready {
                    log.unready_flips += 1;
                }
                if let (true, Some(t)) = (newly_claimed && live, &tenant) {
                    let rival = pods.iter().any(|(u, s)| {
                        *u != uid && s.live && s.ready && !s.faltered && s.tenant.as_ref() == Some(t)
                    });
                    if rival {
                        let others: Vec<String> = pods
                            .iter()
                            .filter(|(u, s)| {
                                *u != &uid && s.live && s.ready && !s.faltered && s.tenant.as_ref() == Some(t)
                            })
                            .map(|(_, s)| s.name.clone())
                            .collect();
                        log.over_claims
                            .entry(t.clone())
                            .or_default()
                            .push(format!("{name} (while {} was Ready)", others.join(", ")));
                    }
                }
                let faltered = !newly_claimed
                    && tenant.is_some()
                    && (before.is_some_and(|b| b.faltered) || (live && !ready));
                pods.insert(
                    uid,
                    Seen {
                        name,
                        tenant,
                        ready,
                        live,
                        faltered,
                    },
                );
                let mut per: BTreeMap<&str, usize> = BTreeMap::new();
                for s in pods.values().filter(|s| s.live) {
                    if let Some(t) = &s.tenant {
                        *per.entry(t.as_str()).or_default() += 1;
                    }
                }
                for (t, n) in per {
                    let max = log.max_live.entry(t.to_owned()).or_default();
                    *max = (*max).max(n);
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), synced_rx)
            .await
            .expect("the pod watch did not list within 30s")
            .unwrap();
        Self { log, task }
    }

    /// What was seen so far.
    pub fn snapshot(&self) -> ClaimLog {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Claims {
    fn drop(&mut self) {
        self.task.abort();
    }
}
