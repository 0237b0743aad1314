//! Where a cold start's time went: the claim (waiting for a pool pod and
//! patching it) and the assign POST, measured by the controller that
//! assigned the pod, carried back in the `x-skipper-assign-timing` gRPC
//! metadata entry (`Scale` between controllers, `GetInstance` to the
//! router) and shown to the user as `Server-Timing` with the router's own
//! `ready` (the time until it had a ready instance).

use std::time::Duration;

/// gRPC metadata entry carrying an [`AssignTiming`].
pub const ASSIGN_TIMING_METADATA: &str = "x-skipper-assign-timing";

/// Longest encoded value read (a pod name and two numbers).
const MAX_ENCODED: usize = 512;

/// The two phases of one assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignTiming {
    /// The pod that was assigned.
    pub instance: String,
    /// From the start of the assignment until the claim patch succeeded.
    pub claim: Duration,
    /// The assign POST to the pod.
    pub assign: Duration,
}

impl AssignTiming {
    /// `instance=<name>;claim=<µs>;assign=<µs>`.
    #[must_use]
    pub fn encode(&self) -> String {
        format!(
            "instance={};claim={};assign={}",
            self.instance,
            self.claim.as_micros(),
            self.assign.as_micros()
        )
    }

    /// Reads [`AssignTiming::encode`]'s form; `None` for anything else.
    #[must_use]
    pub fn decode(s: &str) -> Option<Self> {
        if s.len() > MAX_ENCODED {
            return None;
        }
        let mut parts = s.split(';');
        let instance = parts.next()?.strip_prefix("instance=")?;
        let claim = parts.next()?.strip_prefix("claim=")?.parse().ok()?;
        let assign = parts.next()?.strip_prefix("assign=")?.parse().ok()?;
        if parts.next().is_some() || instance.is_empty() {
            return None;
        }
        Some(Self {
            instance: instance.to_owned(),
            claim: Duration::from_micros(claim),
            assign: Duration::from_micros(assign),
        })
    }

    /// The `Server-Timing` value (milliseconds, RFC: `name;dur=ms`) with
    /// `ready`, the time until the instance was ready to serve.
    #[must_use]
    pub fn server_timing(&self, ready: Duration) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        format!(
            "claim;dur={:.1};desc=\"claim a pool pod\", assign;dur={:.1};desc=\"assign POST\", ready;dur={:.1};desc=\"until ready\"",
            ms(self.claim),
            ms(self.assign),
            ms(ready)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_round_trips_and_rejects_other_forms() {
        let t = AssignTiming {
            instance: "fixture-abc".into(),
            claim: Duration::from_micros(12_345),
            assign: Duration::from_micros(678),
        };
        assert_eq!(t.encode(), "instance=fixture-abc;claim=12345;assign=678");
        assert_eq!(AssignTiming::decode(&t.encode()), Some(t));
        for bad in [
            "",
            "instance=;claim=1;assign=2",
            "instance=a;claim=x;assign=2",
            "instance=a;claim=1",
            "instance=a;claim=1;assign=2;more",
            "claim=1;assign=2;instance=a",
        ] {
            assert_eq!(AssignTiming::decode(bad), None, "{bad}");
        }
        assert_eq!(AssignTiming::decode(&"x".repeat(MAX_ENCODED + 1)), None);
    }

    #[test]
    fn server_timing_lists_claim_assign_and_ready_in_milliseconds() {
        let t = AssignTiming {
            instance: "p".into(),
            claim: Duration::from_micros(12_345),
            assign: Duration::from_micros(2_000),
        };
        assert_eq!(
            t.server_timing(Duration::from_millis(20)),
            "claim;dur=12.3;desc=\"claim a pool pod\", assign;dur=2.0;desc=\"assign POST\", ready;dur=20.0;desc=\"until ready\""
        );
    }
}
