//! Fuzz target: the simulated API server's patches (`crates/devcluster/src/patch.rs`).
//!
//! Input: byte 0 picks JSON, merge or strategic merge; then the object as
//! JSON, a NUL byte, and the patch body (without the NUL, the object is a
//! pool pod). Properties: a patch that fails changes nothing (a JSON Patch
//! is applied whole or not at all); a JSON Patch of only `test` operations
//! never changes the object; a merge or strategic merge patch that applied
//! once applies again to its result without changing it (both are
//! idempotent); and the result of any patch is still an object when the
//! input was one (the API server stores objects). Run with `make fuzz`.

#![no_main]
// A fuzz target: a failed unwrap is a finding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use skipper_devcluster::patch::{PatchKind, apply};

static POD: LazyLock<Value> = LazyLock::new(|| {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "resourceVersion": "7",
            "labels": {"skipper/deployment": "fixture"},
            "annotations": {"a": "b"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "rs-1", "uid": "u1"}]},
        "spec": {"containers": [{"name": "c", "image": "i",
            "ports": [{"name": "http", "containerPort": 8888}],
            "env": [{"name": "A", "value": "1"}]}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    })
});

fuzz_target!(|data: &[u8]| {
    let Some((k, rest)) = data.split_first() else {
        return;
    };
    let kind = [PatchKind::Json, PatchKind::Merge, PatchKind::Strategic][usize::from(*k) % 3];
    let (doc, body) = match rest.iter().position(|b| *b == 0) {
        Some(i) => match serde_json::from_slice::<Value>(&rest[..i]) {
            Ok(doc) => (doc, &rest[i + 1..]),
            Err(_) => return,
        },
        None => (POD.clone(), rest),
    };
    let mut out = doc.clone();
    match apply(&mut out, kind, body) {
        Err(_) => assert_eq!(out, doc, "a failed {kind:?} patch changed the object"),
        Ok(()) => {
            if doc.is_object() {
                assert!(out.is_object(), "{kind:?} patch turned an object into {out}");
            }
            match kind {
                PatchKind::Json => {
                    let ops: Vec<Value> = serde_json::from_slice(body).unwrap();
                    if ops.iter().all(|op| op["op"] == "test") {
                        assert_eq!(out, doc, "a test-only JSON Patch changed the object");
                    }
                }
                PatchKind::Merge | PatchKind::Strategic => {
                    let mut twice = out.clone();
                    apply(&mut twice, kind, body).expect("a patch that applied applies again");
                    assert_eq!(twice, out, "{kind:?} patch is not idempotent");
                }
            }
        }
    }
});
