//! Patch application with API-server semantics: RFC 6902 JSON Patch (a
//! `test` of `null` succeeds for an absent member whose parent exists), JSON
//! merge patch, and strategic merge patch (maps merge; lists of objects merge
//! by their key — `name`, `containerPort`, `uid`, `mountPath` or `type` —
//! honouring `$patch: delete`; other lists are replaced).

use json_patch::PatchOperation;
use serde_json::Value;

use super::error::ApiError;

/// The patch flavours, by `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Json,
    Merge,
    Strategic,
}

impl PatchKind {
    /// Recognises the patch content type.
    ///
    /// # Errors
    /// [`ApiError::UnsupportedMediaType`] for any other type (e.g. server-side apply).
    pub fn from_content_type(ct: &str) -> Result<Self, ApiError> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/json-patch+json" => Ok(Self::Json),
            "application/merge-patch+json" => Ok(Self::Merge),
            "application/strategic-merge-patch+json" => Ok(Self::Strategic),
            _ => Err(ApiError::UnsupportedMediaType(
                "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json",
            )),
        }
    }
}

/// Applies `body` of `kind` to `doc`.
///
/// # Errors
/// [`ApiError::BadRequest`] for an unreadable patch, [`ApiError::Invalid`]
/// (422) when an operation does not apply (including a failed `test`).
pub fn apply(doc: &mut Value, kind: PatchKind, body: &[u8]) -> Result<(), ApiError> {
    match kind {
        PatchKind::Json => {
            let ops: Vec<PatchOperation> = serde_json::from_slice(body)
                .map_err(|e| ApiError::BadRequest(format!("the JSON patch could not be decoded: {e}")))?;
            apply_json_patch(doc, &ops)
        }
        PatchKind::Merge | PatchKind::Strategic => {
            let patch: Value = serde_json::from_slice(body)
                .map_err(|e| ApiError::BadRequest(format!("the patch could not be decoded: {e}")))?;
            if !patch.is_object() {
                return Err(ApiError::BadRequest("the patch must be a JSON object".into()));
            }
            if kind == PatchKind::Merge {
                json_patch::merge(doc, &patch);
            } else {
                check_merge_keys(&patch, &mut String::new())?;
                strategic_merge(doc, &patch);
            }
            Ok(())
        }
    }
}

const MERGE_KEYS: &[&str] = &["name", "containerPort", "uid", "mountPath", "type"];

fn strategic_merge(doc: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *doc = strip_directives(patch.clone());
        return;
    };
    if !doc.is_object() {
        *doc = Value::Object(serde_json::Map::new());
    }
    for (k, v) in p {
        if k.starts_with('$') {
            continue;
        }
        let Some(target) = doc.as_object_mut() else { return };
        match v {
            Value::Null => {
                target.remove(k);
            }
            Value::Object(_) => strategic_merge(target.entry(k.clone()).or_insert(Value::Null), v),
            Value::Array(items) => match target.get_mut(k) {
                Some(Value::Array(orig)) if merge_key(orig, items).is_some() => {
                    let key = merge_key(orig, items).unwrap_or("name");
                    merge_list(orig, items, key);
                }
                // A new list of keyed objects is merged into an empty one, so
                // `$patch: delete` items have nothing to delete and are left out.
                None if merge_key(&[], items).is_some() => {
                    let key = merge_key(&[], items).unwrap_or("name");
                    let mut list = Vec::new();
                    merge_list(&mut list, items, key);
                    target.insert(k.clone(), Value::Array(list));
                }
                _ => {
                    target.insert(k.clone(), strip_directives(v.clone()));
                }
            },
            other => {
                target.insert(k.clone(), other.clone());
            }
        }
    }
}

/// Rejects a list item whose merge key is an object or a list: items are
/// matched by comparing key values, and a key holding directives would be
/// stored without them, so the patch would append a new item each time it
/// applies (the API server, decoding into the typed object, refuses it too).
fn check_merge_keys(v: &Value, path: &mut String) -> Result<(), ApiError> {
    let len = path.len();
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                check_merge_keys(x, path)?;
                path.truncate(len);
            }
        }
        Value::Array(items) => {
            let keyed = items.iter().all(Value::is_object);
            for (i, item) in items.iter().enumerate() {
                path.push_str(&format!("[{i}]"));
                if keyed {
                    for key in MERGE_KEYS {
                        if item.get(*key).is_some_and(|x| x.is_object() || x.is_array()) {
                            return Err(ApiError::BadRequest(format!(
                                "the strategic merge patch is invalid: {path}.{key} is the item's merge key and must be a string or a number"
                            )));
                        }
                    }
                }
                check_merge_keys(item, path)?;
                path.truncate(len);
            }
        }
        _ => {}
    }
    Ok(())
}

/// The key a list of objects merges by: the first of [`MERGE_KEYS`] that
/// every item of the patch carries (the API server takes it from the
/// schema, where every stored item has it). `None` (the list is replaced)
/// when the patch's items share no key or the stored list holds anything
/// but objects.
fn merge_key(orig: &[Value], patch: &[Value]) -> Option<&'static str> {
    if patch.is_empty() || !orig.iter().all(Value::is_object) {
        return None;
    }
    MERGE_KEYS
        .iter()
        .copied()
        .find(|key| patch.iter().all(|e| e.get(*key).is_some_and(|v| !v.is_null())))
}

fn merge_list(orig: &mut Vec<Value>, patch: &[Value], key: &str) {
    for item in patch {
        let id = item.get(key);
        if item.get("$patch").and_then(Value::as_str) == Some("delete") {
            // Every item with the key goes, so the patch applies again unchanged.
            orig.retain(|o| o.get(key) != id);
            continue;
        }
        match orig.iter().position(|o| o.get(key) == id) {
            Some(i) => strategic_merge(&mut orig[i], item),
            // A new item is the patch item merged into nothing, so its own
            // keyed lists merge (duplicates included) as they will the next time.
            None => {
                let mut new = Value::Object(serde_json::Map::new());
                strategic_merge(&mut new, item);
                orig.push(new);
            }
        }
    }
}

/// Removes strategic-merge directives (`$patch`, `$setElementOrder/...`,
/// `$retainKeys`, `$deleteFromPrimitiveList/...`) that merge semantics do not know.
fn strip_directives(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k, strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(strip_directives).collect()),
        other => other,
    }
}

/// RFC 6902 with the API server's `test` rule for absent members.
///
/// # Errors
/// [`ApiError::Invalid`] naming the operation that does not apply.
pub fn apply_json_patch(doc: &mut Value, ops: &[PatchOperation]) -> Result<(), ApiError> {
    let mut work = doc.clone();
    for op in ops {
        if let PatchOperation::Test(t) = op {
            let path = t.path.to_string();
            let actual = work.pointer(&path);
            let ok = match actual {
                Some(v) => *v == t.value,
                None => t.value.is_null() && parent_exists(&work, &path),
            };
            if !ok {
                return Err(ApiError::Invalid(format!(
                    "the server rejected our request due to an error in our request: testing value {path} failed: test failed"
                )));
            }
            continue;
        }
        json_patch::patch(&mut work, std::slice::from_ref(op)).map_err(|e| {
            ApiError::Invalid(format!(
                "the server rejected our request due to an error in our request: {e}"
            ))
        })?;
    }
    // The API server decodes the result into the typed object: a patch that
    // replaces the root with a list or a scalar (`move` or `replace` at "")
    // is refused rather than stored.
    if doc.is_object() && !work.is_object() {
        return Err(ApiError::Invalid(
            "the server rejected our request due to an error in our request: the patched object is not a JSON object".into(),
        ));
    }
    *doc = work;
    Ok(())
}

fn parent_exists(doc: &Value, path: &str) -> bool {
    match path.rfind('/') {
        Some(0) => doc.is_object() || doc.is_array(),
        Some(idx) => doc
            .pointer(&path[..idx])
            .is_some_and(|p| p.is_object() || p.is_array()),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim_patch() -> Vec<u8> {
        json!([
            {"op":"test","path":"/metadata/ownerReferences/0/kind","value":"ReplicaSet"},
            {"op":"test","path":"/metadata/labels/skipper~1tenant","value":null},
            {"op":"test","path":"/metadata/annotations/skipper~1function","value":null},
            {"op":"copy","path":"/metadata/annotations/skipper~1replica-set","from":"/metadata/ownerReferences/0/name"},
            {"op":"add","path":"/metadata/labels/skipper~1tenant","value":"t"}
        ])
        .to_string()
        .into_bytes()
    }

    #[test]
    fn claim_patch_applies_once_and_then_fails_with_invalid() {
        let mut pod = json!({"metadata": {"name": "p", "labels": {}, "annotations": {"a": "b"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "rs-1"}]}});
        apply(&mut pod, PatchKind::Json, &claim_patch()).unwrap();
        assert_eq!(pod["metadata"]["labels"]["skipper/tenant"], "t");
        assert_eq!(pod["metadata"]["annotations"]["skipper/replica-set"], "rs-1");
        let before = pod.clone();
        let err = apply(&mut pod, PatchKind::Json, &claim_patch()).unwrap_err();
        assert_eq!(err.code_reason().1, "Invalid");
        assert_eq!(pod, before, "a failed patch changes nothing");
    }

    #[test]
    fn test_null_fails_when_the_parent_map_is_missing() {
        let mut pod = json!({"metadata": {"name": "p", "labels": {},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "rs-1"}]}});
        let err = apply(&mut pod, PatchKind::Json, &claim_patch()).unwrap_err();
        assert_eq!(err.code_reason().0.as_u16(), 422);
    }

    #[test]
    fn merge_and_strategic_patches_edit_metadata() {
        let mut obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        apply(
            &mut obj,
            PatchKind::Merge,
            br#"{"metadata":{"labels":{"a":null,"c":"3"}}}"#,
        )
        .unwrap();
        assert_eq!(obj["metadata"]["labels"], json!({"b": "2", "c": "3"}));
        apply(
            &mut obj,
            PatchKind::Strategic,
            br#"{"metadata":{"annotations":{"x":"y"},"$patch":"merge"}}"#,
        )
        .unwrap();
        assert_eq!(obj["metadata"]["annotations"]["x"], "y");
        assert!(PatchKind::from_content_type("application/apply-patch+yaml").is_err());
    }

    #[test]
    fn a_delete_directive_in_a_new_list_deletes_nothing_and_applies_again_unchanged() {
        let mut obj = json!({"spec": {}});
        let patch = br#"{"spec":{"containers":[{"name":"c","$patch":"delete"},{"name":"d","image":"i"}]}}"#;
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(
            obj,
            json!({"spec": {"containers": [{"name": "d", "image": "i"}]}})
        );
        let once = obj.clone();
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(obj, once);
    }

    #[test]
    fn a_merge_key_holding_an_object_is_refused_and_changes_nothing() {
        // Found by `fuzz_patch`: the key's `$patch` was stripped when the
        // item was stored, so each application appended another item.
        let mut obj = json!({"spec": {"containers": [{"name": "c"}]}});
        let before = obj.clone();
        let patch = br#"{"spec":{"containers":[{"name":{"containers":[{"name":"c","$patch":"delete"}]},"status":"False"}]}}"#;
        let err = apply(&mut obj, PatchKind::Strategic, patch).unwrap_err();
        assert_eq!(err.code_reason().0.as_u16(), 400);
        let ApiError::BadRequest(msg) = err else {
            unreachable!()
        };
        assert!(msg.contains("spec.containers[0].name"), "{msg}");
        assert_eq!(obj, before);
        // A merge patch has no merge keys: the same body replaces the list.
        apply(&mut obj, PatchKind::Merge, patch).unwrap();
        assert_eq!(obj["spec"]["containers"][0]["status"], "False");
    }

    #[test]
    fn a_json_patch_that_replaces_the_root_with_a_list_is_refused() {
        // Found by `fuzz_patch`: `move` to "" made the stored pod a list.
        let mut obj = json!({"spec": {"containers": [{"name": "c", "env": [{"name": "A"}]}]}});
        let before = obj.clone();
        let patch = br#"[{"op":"move","from":"/spec/containers/0/env","path":""}]"#;
        let err = apply(&mut obj, PatchKind::Json, patch).unwrap_err();
        assert_eq!(err.code_reason().0.as_u16(), 422);
        assert_eq!(obj, before);
        // Replacing the root with another object is a whole-object update.
        apply(
            &mut obj,
            PatchKind::Json,
            br#"[{"op":"replace","path":"","value":{"a":1}}]"#,
        )
        .unwrap();
        assert_eq!(obj, json!({"a": 1}));
    }

    #[test]
    fn a_list_merges_by_the_key_its_patch_items_carry_and_a_delete_removes_every_match() {
        // Found by `fuzz_patch`: a delete item keyed by `type` replaced a
        // list keyed by `name` and became an item itself.
        let mut obj = json!({"spec": {"containers": [{"name": "c"}]}});
        let patch = br#"{"spec":{"containers":[{"type":"c","$patch":"delete"}]}}"#;
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(obj, json!({"spec": {"containers": [{"name": "c"}]}}));
        let mut obj =
            json!({"spec": {"containers": [{"name": "c", "image": "a"}, {"name": "c"}, {"name": "d"}]}});
        let patch = br#"{"spec":{"containers":[{"name":"c","$patch":"delete"},{"name":"e"}]}}"#;
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        let once = obj.clone();
        assert_eq!(
            once,
            json!({"spec": {"containers": [{"name": "d"}, {"name": "e"}]}})
        );
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(obj, once);
    }

    #[test]
    fn a_new_item_s_own_lists_merge_as_they_do_when_it_applies_again() {
        // Found by `fuzz_patch`: a new item was stored as written, its list
        // of two `e` items kept both, and the next application merged them.
        let patch = br#"{"spec":{"containers":[{"name":"c","ports":[{"name":"e","image":"j"},{"name":"e","image":"k"}]}]}}"#;
        let mut obj = json!({"spec": {"containers": []}});
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(
            obj,
            json!({"spec": {"containers": [{"name": "c", "ports": [{"name": "e", "image": "k"}]}]}})
        );
        let once = obj.clone();
        apply(&mut obj, PatchKind::Strategic, patch).unwrap();
        assert_eq!(obj, once);
    }
}
