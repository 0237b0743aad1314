//! The Go implementation's contract vectors (spec §7.4 / Appendix B, copied
//! into `tests/data/go_vectors.json`): function identity hashes, their ring
//! keys, virtual-node positions, ring owners and boundary lookups.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use serde_json::Value;
use skipper::domain::FunctionId;
use skipper::ring::{HashRing, VNODES, vnode_hash};

fn vectors() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/go_vectors.json"))
        .expect("read vectors");
    serde_json::from_str(&text).expect("parse vectors")
}

fn hex32(v: &Value) -> u32 {
    let s = v.as_str().expect("hex string");
    u32::from_str_radix(s.trim_start_matches("0x"), 16).expect("hex u32")
}

fn str_of<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("{k} is a string"))
}

fn ring() -> HashRing {
    let v = vectors();
    let members: Vec<&str> = v["ring_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    HashRing::new(members)
}

#[test]
fn function_ids_match_go() {
    let v = vectors();
    let fns = v["functions"].as_array().unwrap();
    assert_eq!(fns.len(), 13);
    for f in fns {
        let name = str_of(f, "name");
        let (ns, dep, tenant) = (
            str_of(f, "namespace"),
            str_of(f, "deployment"),
            str_of(f, "tenant"),
        );
        let oneshot = f["oneshot"].as_bool().unwrap();
        // The documented byte layout is what gets hashed.
        let mut bytes = Vec::new();
        for part in [ns, dep, tenant] {
            bytes.extend_from_slice(part.as_bytes());
            bytes.push(0);
        }
        bytes.push(u8::from(oneshot));
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, str_of(f, "bytes_hex"), "{name}: input bytes");

        let id = FunctionId::of(ns, dep, tenant, oneshot);
        assert_eq!(id.to_string(), str_of(f, "xxh64"), "{name}: xxh64");
        assert_eq!(
            id.0,
            xxhash_rust::xxh64::xxh64(&bytes, 0),
            "{name}: one-shot digest"
        );
        assert_eq!(id.fold32(), hex32(&f["fold32"]), "{name}: fold32");
    }
}

#[test]
fn owners_positions_and_removal_match_go() {
    let v = vectors();
    let ring = ring();
    let after = ring.without_member("10.0.0.2");
    for f in v["functions"].as_array().unwrap() {
        let name = str_of(f, "name");
        let id = FunctionId::of(
            str_of(f, "namespace"),
            str_of(f, "deployment"),
            str_of(f, "tenant"),
            f["oneshot"].as_bool().unwrap(),
        );
        let (pos, owner) = ring.position_of_key(id.fold32()).unwrap();
        assert_eq!(pos, hex32(&f["ring_position"]), "{name}: position");
        assert_eq!(owner, str_of(f, "owner"), "{name}: owner");
        assert_eq!(ring.owner(id), Some(owner));
        if let Some(want) = f["owner_after_removing_10_0_0_2"].as_str() {
            assert_eq!(after.owner(id), Some(want), "{name}: owner after removal");
        }
    }
}

#[test]
fn vnode_hashes_match_go() {
    let v = vectors();
    let mut checked = 0;
    for (ip, by_idx) in v["vnodes"].as_object().unwrap() {
        for (idx, want) in by_idx.as_object().unwrap() {
            let idx: u16 = idx.parse().unwrap();
            assert_eq!(vnode_hash(ip, idx), hex32(want), "{ip} idx {idx}");
            checked += 1;
        }
    }
    assert_eq!(checked, 18);
}

#[test]
fn ring_shape_and_boundaries_match_go() {
    let v = vectors();
    let ring = ring();
    assert_eq!(ring.len(), v["ring"]["positions"].as_u64().unwrap() as usize);
    assert_eq!(ring.len(), 3 * usize::from(VNODES), "no collisions");
    let lowest = &v["ring"]["lowest"];
    assert_eq!(
        ring.position_of_key(0),
        Some((hex32(&lowest[0]), lowest[1].as_str().unwrap()))
    );
    for (ip, vnodes, _) in ring.distribution() {
        assert_eq!(
            vnodes as u64,
            v["ring"]["vnodes_per_member"][&*ip].as_u64().unwrap()
        );
    }
    for b in v["boundary_lookups"].as_array().unwrap() {
        let key = hex32(&b["key"]);
        let (pos, owner) = ring.position_of_key(key).unwrap();
        assert_eq!(pos, hex32(&b["position"]), "key {key:#x}");
        assert_eq!(owner, str_of(b, "owner"), "key {key:#x}");
    }
    let highest = &v["ring"]["highest"];
    let hi = hex32(&highest[0]);
    assert_eq!(ring.position_of_key(hi), Some((hi, highest[1].as_str().unwrap())));
}

/// The function part of the Go golden `Instance` JSON (spec §2.2).
const GOLDEN_FUNCTION: &str = r#"{"namespace":"skipper-production","deployment":"my-app","tenant":"tenant-123","metadata":"metadata-value","scale":{"min_instances":1,"max_instances":10,"target_cpu_usage_milli":500,"target_memory_usage_mib":256,"target_in_flight_requests":100}}"#;

#[test]
fn function_json_matches_the_go_golden() {
    use skipper::domain::Function;
    let f = Function::from_json(GOLDEN_FUNCTION).unwrap();
    assert_eq!(f.validate(), Ok(()));
    assert_eq!(f.to_json(), GOLDEN_FUNCTION);
    let camel = r#"{ "namespace": "skipper-production", "deployment": "my-app", "tenant": "tenant-123",
        "metadata": "metadata-value", "scale": { "minInstances": "1", "maxInstances": 10,
        "targetCpuUsageMilli": 500, "targetMemoryUsageMib": 256, "targetInFlightRequests": 100 },
        "nonce": "ignored" }"#;
    assert_eq!(Function::from_json(camel).unwrap(), f);
}
