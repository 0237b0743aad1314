//! Whether an exited container restarts, and the kubelet's crash back-off.
//!
//! Pure: no clock, no I/O; callers pass the instants. The back-off follows
//! the kubelet's `flowcontrol.Backoff` keyed by container: the first restart
//! is immediate, each later one waits twice as long as the one before (10 s,
//! 20 s, ... up to 5 min), counted from the moment the container finished;
//! a container that ran for more than twice the maximum (10 min) since its
//! last restart starts over at the initial delay.

use std::time::Duration;

use tokio::time::Instant;

/// `spec.restartPolicy` of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestartPolicy {
    #[default]
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    /// Parses the API value (`None` and unknown values are `Always`, the API default).
    #[must_use]
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            Some("OnFailure") => Self::OnFailure,
            Some("Never") => Self::Never,
            _ => Self::Always,
        }
    }
}

/// The role of a container in its pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// An init container that runs to completion before the next one starts.
    Init,
    /// An init container with `restartPolicy: Always` (a sidecar): it keeps
    /// running beside the regular containers.
    Sidecar,
    /// A container of `spec.containers`.
    Regular,
}

/// Whether a container of `role` that exited with `exit_code` runs again
/// under the pod's `policy`.
#[must_use]
pub fn restarts(policy: RestartPolicy, role: Role, exit_code: i32) -> bool {
    match role {
        Role::Sidecar => true,
        Role::Init => exit_code != 0 && policy != RestartPolicy::Never,
        Role::Regular => match policy {
            RestartPolicy::Always => true,
            RestartPolicy::OnFailure => exit_code != 0,
            RestartPolicy::Never => false,
        },
    }
}

/// The delays of the crash back-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// The wait before the second restart (the first is immediate).
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for BackoffPolicy {
    /// The kubelet's: 10 s doubling up to 5 min.
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffPolicy {
    /// Whether a container that finished at `event` has run long enough since
    /// the last restart (`last_update`) to start the back-off over.
    fn expired(&self, event: Instant, last_update: Instant) -> bool {
        event.saturating_duration_since(last_update) > self.max * 2
    }
}

/// The back-off state of one container.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backoff {
    entry: Option<(Duration, Instant)>,
}

impl Backoff {
    /// Until when a container that finished at `finished` must wait before
    /// it restarts (`None`: it may restart at once).
    #[must_use]
    pub fn hold_until(&self, policy: &BackoffPolicy, finished: Instant) -> Option<Instant> {
        let (delay, last_update) = self.entry?;
        if policy.expired(finished, last_update) {
            return None;
        }
        Some(finished + delay)
    }

    /// The delay that applies now (for the `back-off 20s restarting ...` message).
    #[must_use]
    pub fn delay(&self) -> Option<Duration> {
        self.entry.map(|(d, _)| d)
    }

    /// Records that the container that finished at `finished` restarts now.
    pub fn restarted(&mut self, policy: &BackoffPolicy, finished: Instant) {
        let delay = match self.entry {
            Some((delay, last_update)) if !policy.expired(finished, last_update) => {
                (delay * 2).min(policy.max)
            }
            _ => policy.initial.min(policy.max),
        };
        self.entry = Some((delay, finished));
    }
}

/// The kubelet's wording of a back-off delay (`10s`, `1m20s`, `5m0s`).
#[must_use]
pub fn go_duration(d: Duration) -> String {
    let total_ms = d.as_millis();
    if total_ms < 1000 {
        return format!("{total_ms}ms");
    }
    let secs = d.as_secs();
    let frac = d.subsec_millis();
    let sec_text = if frac == 0 {
        format!("{}s", secs % 60)
    } else {
        let s = format!("{}.{frac:03}", secs % 60);
        format!("{}s", s.trim_end_matches('0'))
    };
    match secs / 60 {
        0 => sec_text,
        m if m < 60 => format!("{m}m{sec_text}"),
        m => format!("{}h{}m{sec_text}", m / 60, m % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_policy_table() {
        use RestartPolicy::{Always, Never, OnFailure};
        use Role::{Init, Regular, Sidecar};
        for (policy, role, code, want) in [
            (Always, Regular, 0, true),
            (Always, Regular, 1, true),
            (OnFailure, Regular, 0, false),
            (OnFailure, Regular, 2, true),
            (Never, Regular, 0, false),
            (Never, Regular, 137, false),
            (Always, Init, 0, false),
            (Always, Init, 1, true),
            (OnFailure, Init, 1, true),
            (Never, Init, 1, false),
            (Never, Sidecar, 0, true),
            (Never, Sidecar, 1, true),
        ] {
            assert_eq!(
                restarts(policy, role, code),
                want,
                "{policy:?} {role:?} exit {code}"
            );
        }
        assert_eq!(RestartPolicy::parse(None), Always);
        assert_eq!(RestartPolicy::parse(Some("OnFailure")), OnFailure);
    }

    #[test]
    fn back_off_doubles_from_the_second_restart_and_caps() {
        let p = BackoffPolicy::default();
        let t0 = Instant::now();
        let mut b = Backoff::default();
        let mut finished = t0;
        assert_eq!(b.hold_until(&p, finished), None, "the first restart is immediate");
        let mut waits = Vec::new();
        for _ in 0..8 {
            if let Some(until) = b.hold_until(&p, finished) {
                waits.push(until - finished);
                finished = until;
            }
            b.restarted(&p, finished);
            // The container crashes a second after it starts.
            finished += Duration::from_secs(1);
        }
        let secs: Vec<u64> = waits.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(b.delay(), Some(Duration::from_secs(300)));
    }

    #[test]
    fn back_off_resets_after_ten_minutes_of_running() {
        let p = BackoffPolicy::default();
        let t0 = Instant::now();
        let mut b = Backoff::default();
        b.restarted(&p, t0);
        b.restarted(&p, t0 + Duration::from_secs(11));
        assert_eq!(b.delay(), Some(Duration::from_secs(20)));
        let late = t0 + Duration::from_secs(11 + 601);
        assert_eq!(b.hold_until(&p, late), None, "ran for 10 min: no wait");
        b.restarted(&p, late);
        assert_eq!(b.delay(), Some(Duration::from_secs(10)));
    }

    #[test]
    fn a_scaled_policy_keeps_the_shape() {
        let p = BackoffPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(350),
        };
        let t0 = Instant::now();
        let mut b = Backoff::default();
        b.restarted(&p, t0);
        assert_eq!(b.hold_until(&p, t0), Some(t0 + Duration::from_millis(100)));
        b.restarted(&p, t0);
        b.restarted(&p, t0);
        assert_eq!(b.delay(), Some(Duration::from_millis(350)));
    }

    #[test]
    fn durations_are_worded_like_go() {
        for (d, text) in [
            (Duration::from_secs(10), "10s"),
            (Duration::from_secs(80), "1m20s"),
            (Duration::from_secs(300), "5m0s"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_millis(1500), "1.5s"),
        ] {
            assert_eq!(go_duration(d), text);
        }
    }
}
