//! Table tests of the converge core: every worked example of spec §5.4 and
//! each tick and execution rule of §5.5–5.9.

use std::time::{Duration, SystemTime};

use super::*;
use crate::domain::Scale;

fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn func(min: u32, max: u32, cpu: u32, mem: u32, inflight: u32) -> Function {
    Function {
        namespace: "ns".into(),
        deployment: "dep".into(),
        tenant: "t".into(),
        metadata: None,
        scale: Some(Scale {
            min_instances: Some(min),
            max_instances: Some(max),
            target_cpu_usage_milli: Some(cpu),
            target_memory_usage_mib: Some(mem),
            target_in_flight_requests: Some(inflight),
            max_in_flight_requests: None,
        }),
        oneshot: None,
    }
}

/// An instance assigned long ago and ready long ago with `cpu` usage.
fn inst(name: &str, cpu: u32) -> Observed {
    Observed {
        name: name.into(),
        assigned_at: t0() - secs(600),
        ready_at: Some(t0() - secs(600)),
        cpu_milli: cpu,
        memory_mib: 0,
        target_cpu_milli: 100,
        target_memory_mib: 0,
    }
}

fn active() -> Combined {
    Combined {
        timestamp: Some(t0()),
        in_flight: 0,
    }
}

fn cpu_desired(instances: &[Observed]) -> u32 {
    desire(
        &func(0, 100, 100, 0, 0),
        active(),
        instances,
        t0(),
        &ScaleConfig::default(),
    )
    .desired
}

#[test]
fn cpu_worked_examples_of_the_spec() {
    assert_eq!(cpu_desired(&[inst("a", 200)]), 2);
    assert_eq!(cpu_desired(&[inst("a", 50), inst("b", 50)]), 1);
    assert_eq!(cpu_desired(&[inst("a", 100)]), 1);
    assert_eq!(cpu_desired(&[inst("a", 110)]), 1, "within tolerance");
    // [150, missing]: ratio 1.5, desired 3 > 2, adjusted ratio 0.75 flips: stays 2.
    assert_eq!(cpu_desired(&[inst("a", 150), inst("b", 0)]), 2);
    // [150 ready long ago, 150 ready just now]: the new one's CPU is ignored.
    let mut fresh = inst("b", 150);
    fresh.ready_at = Some(t0() - secs(5));
    assert_eq!(cpu_desired(&[inst("a", 150), fresh]), 2);
    // No metrics at all: stays at the current count.
    assert_eq!(cpu_desired(&[inst("a", 0), inst("b", 0)]), 2);
}

#[test]
fn cpu_reports_reason_and_average() {
    let d = desire(
        &func(0, 10, 100, 0, 0),
        active(),
        &[inst("a", 300)],
        t0(),
        &ScaleConfig::default(),
    );
    assert_eq!((d.desired, d.unclamped, d.reason), (3, 3, ScaleReason::Cpu));
    assert_eq!(d.metrics, vec![("cpu", 300.0)]);
}

#[test]
fn scale_down_with_missing_metrics_assumes_full_target() {
    // Three instances: two at 20, one missing. ratio 0.2 → desired 1 < 3;
    // adjusted total 40 + 100 = 140 → ratio 0.4667 → ceil(3 × 0.4667) = 2.
    let d = cpu_desired(&[inst("a", 20), inst("b", 20), inst("c", 0)]);
    assert_eq!(d, 2);
}

#[test]
fn memory_uses_instances_targets() {
    let mut a = inst("a", 0);
    a.memory_mib = 512;
    a.target_memory_mib = 128;
    let d = desire(
        &func(0, 10, 0, 128, 0),
        active(),
        &[a],
        t0(),
        &ScaleConfig::default(),
    );
    assert_eq!((d.desired, d.reason), (4, ScaleReason::Memory));
}

#[test]
fn in_flight_ceil_and_clamp() {
    let hb = Combined {
        timestamp: Some(t0()),
        in_flight: 25,
    };
    let d = desire(
        &func(0, 10, 0, 0, 10),
        hb,
        &[inst("a", 0)],
        t0(),
        &ScaleConfig::default(),
    );
    assert_eq!(
        (d.desired, d.unclamped, d.reason),
        (3, 3, ScaleReason::InFlightRequests)
    );
    let d = desire(
        &func(0, 2, 0, 0, 10),
        hb,
        &[inst("a", 0)],
        t0(),
        &ScaleConfig::default(),
    );
    assert_eq!((d.desired, d.unclamped), (2, 3), "clamped at max");
    let d = desire(&func(4, 10, 0, 0, 10), hb, &[], t0(), &ScaleConfig::default());
    assert_eq!(d.desired, 4, "raised to min");
    assert!(
        d.metrics[0].1.is_infinite(),
        "per-instance in-flight with no instances"
    );
}

#[test]
fn floor_of_one_with_unspecified_reason() {
    let d = desire(
        &func(0, 10, 0, 0, 0),
        active(),
        &[],
        t0(),
        &ScaleConfig::default(),
    );
    assert_eq!((d.desired, d.reason), (1, ScaleReason::Unspecified));
}

#[test]
fn heartbeat_timeout_is_zero() {
    let cfg = ScaleConfig::default();
    let f = func(1, 10, 0, 0, 0);
    let d = desire(&f, Combined::default(), &[inst("a", 0)], t0(), &cfg);
    assert_eq!((d.desired, d.reason), (0, ScaleReason::HeartbeatTimeout));
    let old = Combined {
        timestamp: Some(t0() - secs(90)),
        in_flight: 3,
    };
    assert_eq!(
        desire(&f, old, &[], t0(), &cfg).desired,
        0,
        "exactly the timeout counts"
    );
    let recent = Combined {
        timestamp: Some(t0() - secs(89)),
        in_flight: 0,
    };
    assert_eq!(desire(&f, recent, &[], t0(), &cfg).desired, 1);
}

#[test]
fn oneshot_follows_in_flight() {
    let mut f = func(0, 5, 0, 0, 0);
    f.oneshot = Some(true);
    let hb = Combined {
        timestamp: Some(t0()),
        in_flight: 7,
    };
    let d = desire(&f, hb, &[], t0(), &ScaleConfig::default());
    assert_eq!(
        (d.desired, d.unclamped, d.reason),
        (5, 7, ScaleReason::InFlightRequests)
    );
}

#[test]
fn window_keeps_the_maximum_and_expires() {
    let mut w = Window::default();
    let win = secs(90);
    assert_eq!(w.record(3, t0(), win), 3);
    assert_eq!(w.record(1, t0() + secs(30), win), 3);
    assert_eq!(
        w.record(1, t0() + secs(90), win),
        3,
        "entry exactly at the cutoff stays"
    );
    assert_eq!(w.record(1, t0() + secs(91), win), 1);
    assert_eq!(
        w.len(),
        1,
        "only recommendations that can still be the maximum are kept"
    );
}

#[test]
fn window_maximum_equals_the_maximum_over_every_recent_recommendation() {
    let win = secs(90);
    let mut w = Window::default();
    let mut all: Vec<(u32, SystemTime)> = Vec::new();
    // A deterministic pseudo-random walk of recommendations every 1–40 s.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut now = t0();
    let mut longest = 0;
    for _ in 0..5000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        now += secs(1 + x % 40);
        let desired = u32::try_from((x >> 8) % 12).unwrap();
        all.push((desired, now));
        let naive = all
            .iter()
            .filter(|(_, t)| *t >= now - win)
            .map(|(d, _)| *d)
            .max()
            .unwrap();
        assert_eq!(w.record(desired, now, win), naive);
        longest = longest.max(w.len());
    }
    assert!(longest <= 91, "at most one entry per second of the window");
}

fn tick(
    f: &Function,
    instances: &[Observed],
    hb: Combined,
    started_ago: u64,
    owner: bool,
    w: &mut Window,
) -> TickPlan {
    let input = TickInput {
        function: f,
        instances,
        heartbeat: hb,
        now: t0(),
        started_at: t0() - secs(started_ago),
        owner,
    };
    plan_tick(&input, w, &ScaleConfig::default())
}

#[test]
fn protection_period_blocks_scale_down() {
    let f = func(0, 10, 0, 0, 0);
    let mut w = Window::default();
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 10, true, &mut w);
    assert!(matches!(p, TickPlan::Idle { stop: false, .. }), "{p:?}");
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 100, true, &mut w);
    match p {
        TickPlan::Act {
            decision,
            event,
            stop,
            replace_stale,
            ..
        } => {
            assert_eq!(decision.desired, 0);
            assert!(stop);
            assert!(!replace_stale);
            assert_eq!(event.unwrap().kind, EventType::HeartbeatTimeout);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn scale_to_zero_stops_on_non_owners_too() {
    let f = func(0, 10, 0, 0, 0);
    let mut w = Window::default();
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 100, false, &mut w);
    assert!(matches!(p, TickPlan::Idle { stop: true, .. }), "{p:?}");
    assert_eq!(w.len(), 1, "the window is kept warm on non-owners");
}

#[test]
fn scale_down_uses_window_maximum() {
    let f = func(0, 10, 100, 0, 0);
    let mut w = Window::default();
    let three = [inst("a", 0), inst("b", 0), inst("c", 0)];
    // Earlier recommendation of 3 is in the window.
    w.record(3, t0() - secs(10), secs(90));
    let p = tick(
        &f,
        &[inst("a", 30), inst("b", 30), inst("c", 30)],
        active(),
        1000,
        true,
        &mut w,
    );
    match p {
        TickPlan::Act {
            decision,
            replace_stale,
            ..
        } => {
            assert_eq!(decision.desired, 3, "stabilized at the window maximum");
            assert!(
                !replace_stale,
                "no stale replacement while the raw recommendation is lower"
            );
        }
        other => panic!("{other:?}"),
    }
    let _ = three;
}

#[test]
fn stuck_instances_are_listed() {
    let f = func(0, 10, 0, 0, 0);
    let mut stuck = inst("stuck", 0);
    stuck.ready_at = None;
    stuck.assigned_at = t0() - secs(61);
    let mut young = inst("young", 0);
    young.ready_at = None;
    young.assigned_at = t0() - secs(59);
    let mut w = Window::default();
    match tick(&f, &[inst("ok", 0), stuck, young], active(), 1000, true, &mut w) {
        TickPlan::Act { stuck, .. } => assert_eq!(stuck, vec!["stuck".to_owned()]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn oneshot_safety_net() {
    let mut f = func(0, 10, 0, 0, 0);
    f.oneshot = Some(true);
    let mut w = Window::default();
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 10, true, &mut w);
    assert!(
        matches!(p, TickPlan::Idle { stop: false, .. }),
        "young controller waits"
    );
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 100, true, &mut w);
    assert_eq!(
        p,
        TickPlan::OneshotCleanup {
            delete: vec!["a".into()]
        }
    );
    let p = tick(&f, &[inst("a", 0)], Combined::default(), 100, false, &mut w);
    assert_eq!(p, TickPlan::OneshotCleanup { delete: vec![] });
    let p = tick(&f, &[inst("a", 0)], active(), 100, true, &mut w);
    assert!(matches!(p, TickPlan::Idle { stop: false, .. }));
    assert!(w.is_empty(), "oneshot has no stabilization window");
}

fn unready(name: &str, age: u64) -> Observed {
    let mut i = inst(name, 0);
    i.ready_at = None;
    i.assigned_at = t0() - secs(age);
    i
}

fn aged(name: &str, age: u64) -> Observed {
    let mut i = inst(name, 0);
    i.assigned_at = t0() - secs(age);
    i
}

#[test]
fn execution_rules() {
    let f = func(0, 3, 0, 0, 0);
    let d = |n| Decision::new(n, ScaleReason::Cpu);
    assert_eq!(execute(&f, &d(1), &[inst("a", 0)]), Execution::Noop);
    assert_eq!(
        execute(&f, &d(3), &[inst("a", 0)]),
        Execution::ScaleUp { count: 2 }
    );
    // max + 1 rule: 4 instances with max 3 → no more scale up.
    let four = [aged("a", 1), unready("b", 1), unready("c", 1), unready("d", 1)];
    assert_eq!(execute(&f, &d(2), &four), Execution::TooMany);
    // Three instances with max 3 may still add one (max + 1 allowance).
    let three = [aged("a", 1), unready("b", 1), unready("c", 1)];
    assert_eq!(execute(&f, &d(2), &three), Execution::ScaleUp { count: 1 });
    // Unready first, then oldest ready.
    let mix = [
        aged("new", 10),
        aged("old", 100),
        unready("u", 5),
        aged("mid", 50),
    ];
    assert_eq!(
        execute(&f, &d(1), &mix),
        Execution::ScaleDown {
            delete: vec!["u".into(), "old".into(), "mid".into()]
        }
    );
    // Cleanup of unready when desired == ready.
    assert_eq!(
        execute(&f, &d(1), &[aged("a", 1), unready("u", 1)]),
        Execution::ScaleDown {
            delete: vec!["u".into()]
        }
    );
    // NO_READY_INSTANCES never scales down.
    let guard = Decision::new(1, ScaleReason::NoReadyInstances);
    assert_eq!(
        execute(&f, &guard, &[aged("a", 1), aged("b", 2)]),
        Execution::Guarded
    );
    assert_eq!(execute(&f, &guard, &[]), Execution::ScaleUp { count: 1 });
    assert_eq!(
        execute(&f, &d(0), &[aged("a", 1), aged("b", 2)]),
        Execution::ScaleDown {
            delete: vec!["b".into(), "a".into()]
        }
    );
}
