//! The instance table: views from stream messages, the local choice, the
//! concurrency limit and its queue.

use super::*;

fn inst(name: &str, port: u16, age_s: u64) -> api::Instance {
    api::Instance {
        name: Some(name.into()),
        addr: Some(format!("127.0.0.1:{port}")),
        assigned_at: Some((SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 - age_s)).into()),
        ..Default::default()
    }
}

fn change(i: api::Instance, state: InstanceState) -> api::InstanceChange {
    api::InstanceChange {
        instance: Some(i),
        state: Some(state as i32),
    }
}

fn snapshot(version: u64, changes: Vec<api::InstanceChange>) -> api::WatchInstancesResponse {
    api::WatchInstancesResponse {
        version: Some(version),
        previous_version: None,
        snapshot: Some(true),
        changes,
    }
}

fn delta(previous: u64, version: u64, changes: Vec<api::InstanceChange>) -> api::WatchInstancesResponse {
    api::WatchInstancesResponse {
        version: Some(version),
        previous_version: Some(previous),
        snapshot: Some(false),
        changes,
    }
}

fn names(slots: &[Arc<Slot>]) -> Vec<&str> {
    slots.iter().map(|s| s.name.as_str()).collect()
}

#[test]
fn snapshot_then_changes_in_version_order() {
    let none = HashMap::new();
    let v0 = View::default();
    let (v1, bad) = v0
        .apply(
            &snapshot(
                7,
                vec![
                    change(inst("a", 1, 10), InstanceState::Ready),
                    change(inst("b", 2, 5), InstanceState::Ready),
                ],
            ),
            &none,
        )
        .unwrap();
    assert!(bad.is_empty());
    assert_eq!(v1.version, Some(7));
    assert_eq!(names(&v1.choosable()), ["b", "a"], "newest first");

    let (v2, _) = v1
        .apply(
            &delta(
                7,
                9,
                vec![
                    change(inst("c", 3, 1), InstanceState::Ready),
                    change(inst("a", 1, 10), InstanceState::Draining),
                ],
            ),
            &none,
        )
        .unwrap();
    assert_eq!(
        names(&v2.choosable()),
        ["c", "b"],
        "a draining instance is not chosen"
    );
    assert_eq!(v2.slots.len(), 3, "but stays known until removed");

    let removed = api::Instance {
        name: Some("a".into()),
        ..Default::default()
    };
    let (v3, _) = v2
        .apply(
            &delta(9, 10, vec![change(removed, InstanceState::Removed)]),
            &none,
        )
        .unwrap();
    assert_eq!(v3.slots.len(), 2);

    // A gap, a repeated version or changes before any snapshot: refused.
    for (view, msg) in [
        (&v3, delta(9, 11, vec![])),
        (&v3, delta(11, 12, vec![])),
        (&v0, delta(0, 1, vec![])),
    ] {
        assert!(matches!(
            view.apply(&msg, &none),
            Err(ApplyError::VersionGap { .. })
        ));
    }
    let mut unversioned = snapshot(1, vec![]);
    unversioned.version = None;
    assert_eq!(v0.apply(&unversioned, &none).unwrap_err(), ApplyError::NoVersion);
}

#[test]
fn slots_carry_over_and_bad_instances_are_left_out() {
    let none = HashMap::new();
    let (v1, _) = View::default()
        .apply(
            &snapshot(1, vec![change(inst("a", 1, 1), InstanceState::Ready)]),
            &none,
        )
        .unwrap();
    let a = v1.slots["a"].clone();
    a.in_flight.fetch_add(2, Ordering::SeqCst);
    // A new stream's snapshot keeps the slot (and its count) of a known
    // instance at the same address; another address is a new slot.
    let (v2, _) = View::default()
        .apply(
            &snapshot(1, vec![change(inst("a", 1, 1), InstanceState::Ready)]),
            &v1.slots,
        )
        .unwrap();
    assert!(Arc::ptr_eq(&v2.slots["a"], &a));
    let (v3, _) = View::default()
        .apply(
            &snapshot(1, vec![change(inst("a", 9, 1), InstanceState::Ready)]),
            &v1.slots,
        )
        .unwrap();
    assert_eq!(v3.slots["a"].in_flight(), 0);

    let mut no_addr = inst("x", 1, 1);
    no_addr.addr = Some("nowhere".into());
    let (v4, bad) = v2
        .apply(
            &delta(
                1,
                2,
                vec![
                    change(no_addr, InstanceState::Ready),
                    change(inst("", 1, 1), InstanceState::Ready),
                ],
            ),
            &none,
        )
        .unwrap();
    assert_eq!(v4.slots.len(), 1);
    assert_eq!(bad.len(), 2);
}

fn slots(loads: &[u32]) -> Vec<Arc<Slot>> {
    loads
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let s = Slot::new(&inst(&format!("s{i}"), 1, i as u64)).unwrap();
            s.in_flight.store(*l, Ordering::SeqCst);
            Arc::new(s)
        })
        .collect()
}

#[test]
fn two_choices_prefer_the_less_loaded() {
    let ready = slots(&[5, 1, 3]);
    // Draws (0, then 0 of the remaining two → index 1): s0 vs s1.
    let mut draws = [0usize, 0].into_iter();
    let got = pick(&ready, 3, &[], |_| draws.next().unwrap()).unwrap();
    assert_eq!(got.name, "s1");
    // s2 vs s0 (draw 2, then 0): s2 has 3 < 5.
    let mut draws = [2usize, 0].into_iter();
    assert_eq!(
        pick(&ready, 3, &[], |_| draws.next().unwrap()).unwrap().name,
        "s2"
    );
    // Ties keep the first drawn.
    let even = slots(&[1, 1]);
    let mut draws = [1usize, 0].into_iter();
    assert_eq!(pick(&even, 3, &[], |_| draws.next().unwrap()).unwrap().name, "s1");
}

#[test]
fn max_instances_and_exclusions_narrow_the_candidates() {
    let ready = slots(&[0, 0, 0]);
    // Only the newest `max` (here one) are candidates.
    for _ in 0..50 {
        let got = pick(&ready, 1, &[], |n| rand::random_range(0..n)).unwrap();
        assert_eq!(got.name, "s0");
    }
    let got = pick(&ready, 3, &["s0".into(), "s2".into()], |n| {
        rand::random_range(0..n)
    })
    .unwrap();
    assert_eq!(got.name, "s1");
    assert!(
        pick(&ready, 2, &["s0".into(), "s1".into()], |n| rand::random_range(
            0..n
        ))
        .is_none()
    );
    assert!(pick(&[], 3, &[], |n| rand::random_range(0..n)).is_none());
    // Both candidates are always distinct.
    for _ in 0..200 {
        let two = slots(&[0, 9]);
        assert_eq!(
            pick(&two, 2, &[], |n| rand::random_range(0..n)).unwrap().name,
            "s0"
        );
    }
}

fn live_table(instances: &[(&str, u16, u64)]) -> (Arc<Table>, View) {
    let table = Arc::new(Table::new("t1"));
    let (v, _) = View::default()
        .apply(
            &snapshot(
                1,
                instances
                    .iter()
                    .map(|(n, p, age)| change(inst(n, *p, *age), InstanceState::Ready))
                    .collect(),
            ),
            &HashMap::new(),
        )
        .unwrap();
    table.publish(&v);
    (table, v)
}

fn chosen(c: Choice) -> SlotGuard {
    match c {
        Choice::Chosen(g) => g,
        other => panic!("nothing chosen: {other:?}"),
    }
}

#[test]
fn draining_slots_refuse_new_requests_and_report_idle_once() {
    let table = Arc::new(Table::new("t1"));
    assert!(
        matches!(table.choose(3, 0, &[]), Choice::Empty),
        "not live before a snapshot is published"
    );
    let (table, v) = live_table(&[("a", 1, 1), ("b", 2, 2)]);
    let a = table.adopt(&inst("a", 1, 1)).unwrap();
    let held = table.count_named(&a, 0).unwrap();
    let (v2, _) = v
        .apply(
            &delta(1, 2, vec![change(inst("a", 1, 1), InstanceState::Draining)]),
            &table.known(),
        )
        .unwrap();
    table.publish(&v2);
    assert!(
        Arc::ptr_eq(&table.adopt(&inst("a", 1, 1)).unwrap(), &a),
        "the table's own slot"
    );
    for _ in 0..20 {
        assert_eq!(
            chosen(table.choose(3, 0, &[])).slot().name,
            "b",
            "a draining instance is not chosen"
        );
    }
    assert!(table.newly_idle().is_empty(), "a request is still in flight");
    drop(held);
    assert_eq!(table.newly_idle(), ["a"]);
    assert!(table.newly_idle().is_empty(), "reported once per stream");
    table.set_down();
    assert!(
        matches!(table.choose(3, 0, &[]), Choice::Empty),
        "a table whose stream is down is not used"
    );
}

#[test]
fn the_limit_caps_each_instance_and_prefers_the_one_with_room() {
    let (table, _) = live_table(&[("a", 1, 1), ("b", 2, 2)]);
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(chosen(table.choose(3, 2, &[])));
    }
    let on = |name: &str| held.iter().filter(|g| g.slot().name == name).count();
    assert_eq!((on("a"), on("b")), (2, 2), "two each, whatever the draws");
    assert!(matches!(table.choose(3, 2, &[]), Choice::Full));
    assert!(
        matches!(table.choose(3, 2, &["a".into(), "b".into()]), Choice::Empty),
        "every candidate excluded: nothing to wait for here"
    );
    assert!(
        matches!(table.choose(3, 0, &[]), Choice::Chosen(_)),
        "without a limit there is always room"
    );
}

#[tokio::test]
async fn freed_room_goes_to_the_oldest_queued_request_and_newcomers_queue_behind() {
    let (table, _) = live_table(&[("a", 1, 1)]);
    let first = chosen(table.choose(1, 1, &[]));
    let mut q1 = table.enqueue(1, 1, &[]);
    let mut q2 = table.enqueue(1, 1, &[]);
    assert_eq!(table.queued(), 2);
    assert!(
        matches!(table.choose(1, 1, &[]), Choice::Full),
        "a newcomer does not overtake the queue"
    );
    drop(first);
    let Wake::Chosen(g1) = q1.woken().await else {
        panic!("the oldest is served first")
    };
    assert_eq!(table.queued(), 1);
    assert_eq!(g1.slot().in_flight(), 1, "the room was handed over, not freed");
    drop(g1);
    let Wake::Chosen(g2) = q2.woken().await else {
        panic!("then the next")
    };
    assert_eq!(table.queued(), 0);
    drop(g2);
    assert_eq!(table.adopt(&inst("a", 1, 1)).unwrap().in_flight(), 0);
}

#[tokio::test]
async fn a_request_leaving_the_queue_passes_its_turn_on() {
    let (table, _) = live_table(&[("a", 1, 1)]);
    let first = chosen(table.choose(1, 1, &[]));
    let q1 = table.enqueue(1, 1, &[]);
    let mut q2 = table.enqueue(1, 1, &[]);
    // The room goes to q1, which is gone before taking it.
    drop(first);
    drop(q1);
    let Wake::Chosen(g) = q2.woken().await else {
        panic!("q2 gets the room q1 left")
    };
    assert_eq!(g.slot().in_flight(), 1);
    assert_eq!(table.queued(), 0);
}

#[tokio::test]
async fn new_instances_serve_the_queue_and_a_lost_stream_sends_it_back_to_choosing() {
    let (table, v) = live_table(&[("a", 1, 1)]);
    let _held = chosen(table.choose(1, 1, &[]));
    let mut q1 = table.enqueue(2, 1, &[]);
    let mut q2 = table.enqueue(2, 1, &[]);
    let (v2, _) = v
        .apply(
            &delta(1, 2, vec![change(inst("b", 2, 0), InstanceState::Ready)]),
            &table.known(),
        )
        .unwrap();
    table.publish(&v2);
    let Wake::Chosen(g) = q1.woken().await else {
        panic!("the new instance has room")
    };
    assert_eq!(g.slot().name, "b");
    table.set_down();
    assert!(
        matches!(q2.woken().await, Wake::Reselect),
        "nothing to offer without the stream"
    );
    assert_eq!(table.queued(), 0);
}

#[test]
fn instances_a_controller_names_share_one_slot_that_the_stream_takes_over() {
    let table = Arc::new(Table::new("t1"));
    let a = table.adopt(&inst("a", 1, 1)).unwrap();
    assert!(Arc::ptr_eq(&a, &table.adopt(&inst("a", 1, 1)).unwrap()));
    let held = table.count_named(&a, 1).unwrap();
    assert!(
        table.count_named(&a, 1).is_none(),
        "the limit applies to named instances too"
    );
    let (v, _) = View::default()
        .apply(
            &snapshot(1, vec![change(inst("a", 1, 1), InstanceState::Ready)]),
            &table.known(),
        )
        .unwrap();
    assert!(
        Arc::ptr_eq(&v.slots["a"], &a),
        "the stream's view keeps the count"
    );
    table.publish(&v);
    assert_eq!(a.in_flight(), 1);
    drop(held);
    // The same name at another address is another instance.
    assert!(!Arc::ptr_eq(&a, &table.adopt(&inst("a", 9, 1)).unwrap()));
    for i in 0..2 * MAX_ADOPTED {
        table.adopt(&inst(&format!("x{i}"), 3, 1)).unwrap();
    }
    assert!(table.lock_adopted().len() <= MAX_ADOPTED, "bounded");
}
