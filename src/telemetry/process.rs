//! The standard `process_*` metrics (names and help strings as the
//! Prometheus client libraries export them), read from `/proc/self` and
//! `getrusage`/`getrlimit` at scrape time. On a system without `/proc` the
//! series that need it are left out.

use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// What one scrape reads.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sample {
    pub cpu_seconds: f64,
    pub open_fds: Option<i64>,
    pub max_fds: Option<i64>,
    pub virtual_memory_bytes: Option<i64>,
    pub virtual_memory_max_bytes: Option<f64>,
    pub resident_memory_bytes: Option<i64>,
    pub start_time_seconds: f64,
    pub threads: Option<i64>,
    pub network_receive_bytes: Option<u64>,
    pub network_transmit_bytes: Option<u64>,
}

/// The collector registered by [`register`].
#[derive(Debug)]
pub struct Process {
    start_time_seconds: f64,
}

/// Registers the `process_*` metrics in `registry` (at its root: no prefix).
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(Process::new()));
}

impl Process {
    /// A collector for this process.
    #[must_use]
    pub fn new() -> Self {
        Self {
            start_time_seconds: start_time().unwrap_or_else(|| unix_seconds(SystemTime::now())),
        }
    }

    /// Reads the current figures.
    #[must_use]
    pub fn sample(&self) -> Sample {
        let status = std::fs::read_to_string("/proc/self/status").ok();
        let kib = |key: &str| {
            status
                .as_deref()
                .and_then(|s| status_field(s, key))
                .map(|v| v.saturating_mul(1024))
        };
        let threads = status.as_deref().and_then(|s| status_field(s, "Threads:"));
        let (rx, tx) = std::fs::read_to_string("/proc/self/net/dev")
            .ok()
            .map_or((None, None), |s| {
                let (rx, tx) = network_totals(&s);
                (Some(rx), Some(tx))
            });
        Sample {
            cpu_seconds: cpu_seconds(),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| i64::try_from(d.count()).unwrap_or(i64::MAX)),
            max_fds: limit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
            virtual_memory_bytes: kib("VmSize:"),
            // Unlimited is reported as the largest value, as the Go client does.
            #[allow(clippy::cast_precision_loss)]
            virtual_memory_max_bytes: limit(nix::sys::resource::Resource::RLIMIT_AS).map(|l| l as f64),
            resident_memory_bytes: kib("VmRSS:"),
            start_time_seconds: self.start_time_seconds,
            threads,
            network_receive_bytes: rx,
            network_transmit_bytes: tx,
        }
    }
}

impl Default for Process {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// User plus system CPU time of the whole process.
fn cpu_seconds() -> f64 {
    match nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let secs = |t: nix::sys::time::TimeVal| {
                Duration::from_secs(u64::try_from(t.tv_sec()).unwrap_or(0))
                    + Duration::from_micros(u64::try_from(t.tv_usec()).unwrap_or(0))
            };
            (secs(u.user_time()) + secs(u.system_time())).as_secs_f64()
        }
        Err(_) => 0.0,
    }
}

fn limit(resource: nix::sys::resource::Resource) -> Option<u64> {
    nix::sys::resource::getrlimit(resource).ok().map(|(soft, _)| soft)
}

/// When the process started: its start tick (field 22 of `/proc/self/stat`)
/// over the clock rate, after the boot time (`btime` of `/proc/stat`).
fn start_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    start_from(&stat, &boot, ticks)
}

/// [`start_time`] from the texts of `/proc/self/stat` and `/proc/stat`.
#[allow(clippy::cast_precision_loss)]
fn start_from(stat: &str, boot: &str, ticks_per_second: i64) -> Option<f64> {
    // The command name (field 2) may contain spaces: fields count from the
    // last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let start_ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let btime: u64 = boot
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    if ticks_per_second <= 0 {
        return None;
    }
    Some(btime as f64 + start_ticks as f64 / ticks_per_second as f64)
}

/// The number after `key` in `/proc/self/status`.
fn status_field(status: &str, key: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Received and transmitted bytes summed over every interface of
/// `/proc/self/net/dev` (the process's network namespace).
fn network_totals(dev: &str) -> (u64, u64) {
    let mut rx = 0u64;
    let mut tx = 0u64;
    for line in dev.lines().skip(2) {
        let Some((_, counters)) = line.split_once(':') else {
            continue;
        };
        let fields: Vec<u64> = counters
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        if fields.len() >= 9 {
            rx = rx.saturating_add(fields[0]);
            tx = tx.saturating_add(fields[8]);
        }
    }
    (rx, tx)
}

fn counter(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: f64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge<T>(encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: T) -> std::fmt::Result
where
    ConstGauge<T>: EncodeMetric,
{
    let g = ConstGauge::new(v);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.sample();
        let e = &mut encoder;
        counter(
            e,
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            s.cpu_seconds,
        )?;
        if let Some(v) = s.open_fds {
            gauge(e, "process_open_fds", "Number of open file descriptors.", v)?;
        }
        if let Some(v) = s.max_fds {
            gauge(
                e,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                v,
            )?;
        }
        if let Some(v) = s.virtual_memory_bytes {
            gauge(
                e,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                v,
            )?;
        }
        if let Some(v) = s.virtual_memory_max_bytes {
            gauge(
                e,
                "process_virtual_memory_max_bytes",
                "Maximum amount of virtual memory available in bytes.",
                v,
            )?;
        }
        if let Some(v) = s.resident_memory_bytes {
            gauge(
                e,
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                v,
            )?;
        }
        gauge(
            e,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            s.start_time_seconds,
        )?;
        if let Some(v) = s.threads {
            gauge(e, "process_threads", "Number of OS threads in the process.", v)?;
        }
        #[allow(clippy::cast_precision_loss)]
        if let (Some(rx), Some(tx)) = (s.network_receive_bytes, s.network_transmit_bytes) {
            counter(
                e,
                "process_network_receive_bytes",
                "Number of bytes received by the process over the network.",
                rx as f64,
            )?;
            counter(
                e,
                "process_network_transmit_bytes",
                "Number of bytes sent by the process over the network.",
                tx as f64,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_counts_fields_after_the_command_name() {
        let stat = "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 7 0 2500 12345 678";
        let boot = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        assert_eq!(start_from(stat, boot, 100), Some(1_700_000_025.0));
        assert_eq!(start_from("garbage", boot, 100), None);
        assert_eq!(start_from(stat, "cpu 1", 100), None);
    }

    #[test]
    fn network_totals_sum_every_interface() {
        let dev = "Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    lo: 100 1 0 0 0 0 0 0 200 2 0 0 0 0 0 0\n  eth0: 1000 10 0 0 0 0 0 0 3000 30 0 0 0 0 0 0\n";
        assert_eq!(network_totals(dev), (1100, 3200));
    }

    #[test]
    fn the_exposition_has_the_standard_process_series() {
        let mut r = Registry::default();
        register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for line in [
            "# HELP process_cpu_seconds Total user and system CPU time spent in seconds.",
            "# TYPE process_cpu_seconds counter",
            "# TYPE process_resident_memory_bytes gauge",
            "# TYPE process_open_fds gauge",
            "# TYPE process_max_fds gauge",
            "# TYPE process_start_time_seconds gauge",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        assert!(out.contains("process_cpu_seconds_total "), "{out}");
        let sample = Process::new().sample();
        assert!(sample.resident_memory_bytes.unwrap_or(0) > 0);
        assert!(sample.open_fds.unwrap_or(0) > 0);
        let now = unix_seconds(SystemTime::now());
        assert!(
            sample.start_time_seconds <= now && sample.start_time_seconds > now - 3600.0,
            "start {} now {now}",
            sample.start_time_seconds
        );
    }
}
