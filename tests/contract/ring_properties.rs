//! Properties of the hash ring: minimal movement on membership changes,
//! determinism, balance and collision counts.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use skipper::ring::{HashRing, VNODES};

fn ip() -> impl Strategy<Value = String> {
    any::<u32>().prop_map(|v| Ipv4Addr::from(v).to_string())
}

fn members() -> impl Strategy<Value = Vec<String>> {
    prop::collection::btree_set(ip(), 1..8).prop_map(|s| s.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn adding_a_member_moves_keys_only_to_it(members in members(), new in ip(), keys in prop::collection::vec(any::<u32>(), 200)) {
        prop_assume!(!members.contains(&new));
        let before = HashRing::new(&members);
        let after = before.with_member(&new);
        for k in keys {
            let (b, a) = (before.owner_of_key(k).unwrap(), after.owner_of_key(k).unwrap());
            prop_assert!(a == b || a == new, "key {k:#x} moved from {b} to {a}, not to {new}");
        }
    }

    #[test]
    fn removing_a_member_moves_only_its_keys(members in members(), pick in any::<prop::sample::Index>(), keys in prop::collection::vec(any::<u32>(), 200)) {
        prop_assume!(members.len() > 1);
        let gone = pick.get(&members).clone();
        let before = HashRing::new(&members);
        let after = before.without_member(&gone);
        for k in keys {
            let (b, a) = (before.owner_of_key(k).unwrap(), after.owner_of_key(k).unwrap());
            if b != gone {
                prop_assert_eq!(a, b, "key {:#x} moved although its owner stayed", k);
            } else {
                prop_assert_ne!(a, gone.as_str());
            }
        }
    }

    #[test]
    fn lookups_are_deterministic(members in members(), keys in prop::collection::vec(any::<u32>(), 100)) {
        let a = HashRing::new(&members);
        let b = HashRing::new(&members);
        prop_assert_eq!(&a, &b);
        for k in keys {
            prop_assert_eq!(a.owner_of_key(k), b.owner_of_key(k));
            prop_assert_eq!(a.owner_of_key(k), a.owner_of_key(k));
        }
    }

    #[test]
    fn building_at_once_equals_adding_one_by_one(members in members()) {
        let incremental = members.iter().fold(HashRing::default(), |r, m| r.with_member(m));
        prop_assert_eq!(HashRing::new(&members), incremental);
    }

    #[test]
    fn add_then_remove_restores_the_ring(members in members(), new in ip()) {
        prop_assume!(!members.contains(&new));
        let ring = HashRing::new(&members);
        let back = ring.with_member(&new).without_member(&new);
        // Identical unless the new member won a collision (then the position disappears, as in Go).
        let collided = ring.len() + usize::from(VNODES) != ring.with_member(&new).len();
        prop_assert!(collided || back == ring);
    }
}

fn max_deviation(ring: &HashRing, keys: &[u32]) -> f64 {
    let members = ring.sorted_members();
    let mut counts = vec![0usize; members.len()];
    for &k in keys {
        let owner = ring.owner_of_key(k).unwrap();
        counts[members.iter().position(|m| &**m == owner).unwrap()] += 1;
    }
    let mean = keys.len() as f64 / members.len() as f64;
    counts
        .iter()
        .map(|&c| (c as f64 - mean).abs() / mean)
        .fold(0.0, f64::max)
}

#[test]
fn ten_thousand_keys_over_four_random_members_stay_within_11_percent() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for round in 0..20 {
        let mut set = BTreeSet::new();
        while set.len() < 4 {
            set.insert(Ipv4Addr::from(rng.random::<u32>()).to_string());
        }
        let keys: Vec<u32> = (0..10_000).map(|_| rng.random()).collect();
        let ring = HashRing::new(&set);
        let dev = max_deviation(&ring, &keys);
        assert!(dev < 0.11, "round {round}: members {set:?} deviate {dev:.3}");
        // Still balanced after a member joins and another leaves.
        let joined = ring.with_member(&Ipv4Addr::from(rng.random::<u32>()).to_string());
        assert!(max_deviation(&joined, &keys) < 0.11, "round {round} after add");
        let first = set.iter().next().unwrap().clone();
        assert!(
            max_deviation(&joined.without_member(&first), &keys) < 0.11,
            "round {round} after remove"
        );
    }
}

fn collisions(ips: &[String]) -> usize {
    ips.len() * usize::from(VNODES) - HashRing::new(ips).len()
}

#[test]
fn collision_counts_match_go() {
    let four: Vec<String> = (1..=4).map(|i| format!("10.0.0.{i}")).collect();
    assert_eq!(collisions(&four), 0);
    let ten: Vec<String> = (1..=10).map(|i| format!("10.0.0.{i}")).collect();
    assert!(collisions(&ten) <= 2);
    let twenty: Vec<String> = (1..=20)
        .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
        .collect();
    assert!(collisions(&twenty) <= 8);
    // Where positions collide, the member added first keeps them.
    for ips in [&ten, &twenty] {
        let incremental = ips.iter().fold(HashRing::default(), |r, m| r.with_member(m));
        assert_eq!(HashRing::new(ips), incremental);
    }
}

#[test]
fn distribution_shares_cover_the_key_space() {
    let ring = HashRing::new(["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    let dist = ring.distribution();
    let total: f64 = dist.iter().map(|d| d.2).sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
    assert!(dist.iter().all(|d| d.1 == 1024 && (0.28..0.39).contains(&d.2)));
    let after = ring.without_member("10.0.0.2");
    let moved = ring.moved_share(&after);
    let share_2 = dist.iter().find(|d| &*d.0 == "10.0.0.2").unwrap().2;
    assert!((moved - share_2).abs() < 1e-9, "moved {moved} vs share {share_2}");
}
