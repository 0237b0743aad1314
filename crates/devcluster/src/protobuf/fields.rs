//! Unknown fields of JSON bodies, found with the same k8s.io/api schema: what
//! kube-apiserver's strict decoding reports (`?fieldValidation=Strict`
//! refuses them, `Warn` — the default — and `Ignore` drop them).

use serde_json::{Map, Value};

use super::{Field, Message, Ty, schema};

/// Removes the members of `obj` (of `kind` in `api_version`) that its Go
/// type has no field for, and returns their paths in kube-apiserver's form
/// (`metadata.bogus`, `spec.template.spec.containers[0].bogus`). `None` when
/// the kind has no schema here (nothing is checked).
pub fn drop_unknown(obj: &mut Value, api_version: &str, kind: &str) -> Option<Vec<String>> {
    let index = kind_index(api_version, kind)?;
    let mut unknown = Vec::new();
    if let Value::Object(members) = obj {
        walk(index, members, "", true, &mut unknown);
    }
    Some(unknown)
}

/// Whether `obj` (of `kind` in `api_version`) has a member its Go type has
/// no field for: [`drop_unknown`]'s question without a copy or an
/// allocation, for the usual body that has none. `false` when the kind has
/// no schema here.
#[must_use]
pub fn has_unknown(obj: &Value, api_version: &str, kind: &str) -> bool {
    kind_index(api_version, kind).is_some_and(|index| {
        obj.as_object()
            .is_some_and(|members| any_unknown(index, members, true))
    })
}

fn any_unknown(index: u16, obj: &Map<String, Value>, top: bool) -> bool {
    let msg = &schema::MESSAGES[usize::from(index)];
    obj.iter().any(|(key, value)| {
        if top && (key == "apiVersion" || key == "kind") {
            return false;
        }
        let Some(field) = find(msg, key) else {
            return true;
        };
        let Ty::Msg(inner) = field.ty else {
            return false;
        };
        match value {
            Value::Object(child) if !field.repeated => any_unknown(inner, child, false),
            Value::Array(items) if field.repeated => items.iter().any(|item| {
                item.as_object()
                    .is_some_and(|child| any_unknown(inner, child, false))
            }),
            _ => false,
        }
    })
}

/// The schema's message for `kind` in `api_version`.
fn kind_index(api_version: &str, kind: &str) -> Option<u16> {
    schema::KINDS
        .iter()
        .find(|(v, k, _)| *v == api_version && *k == kind)
        .map(|(_, _, m)| *m)
}

/// The field of `msg` (or of its inline members) named `name` in JSON.
fn find(msg: &'static Message, name: &str) -> Option<&'static Field> {
    msg.fields.iter().find_map(|f| match f.ty {
        Ty::Msg(i) if f.inline => find(&schema::MESSAGES[usize::from(i)], name),
        _ => (f.json == name).then_some(f),
    })
}

fn walk(index: u16, obj: &mut Map<String, Value>, path: &str, top: bool, unknown: &mut Vec<String>) {
    let msg = &schema::MESSAGES[usize::from(index)];
    let keys: Vec<String> = obj.keys().cloned().collect();
    for key in keys {
        if top && (key == "apiVersion" || key == "kind") {
            continue;
        }
        let Some(field) = find(msg, &key) else {
            obj.remove(&key);
            unknown.push(format!("{path}{key}"));
            continue;
        };
        let Ty::Msg(inner) = field.ty else { continue };
        match obj.get_mut(&key) {
            Some(Value::Object(child)) if !field.repeated => {
                walk(inner, child, &format!("{path}{key}."), false, unknown);
            }
            Some(Value::Array(items)) if field.repeated => {
                for (n, item) in items.iter_mut().enumerate() {
                    if let Value::Object(child) = item {
                        walk(inner, child, &format!("{path}{key}[{n}]."), false, unknown);
                    }
                }
            }
            _ => {}
        }
    }
}

/// kube-apiserver's decode error for a quantity that is not one.
pub const QUANTITY_FORMAT_ERROR: &str =
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";

/// Whether `s` matches `^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$`, the
/// form resource.ParseQuantity checks first.
fn quantity_form(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let start = i;
    while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
        i += 1;
    }
    if i == start {
        return false;
    }
    while i < b.len() && b"eEinumkKMGTP".contains(&b[i]) {
        i += 1;
    }
    if i < b.len() && matches!(b[i], b'+' | b'-') {
        i += 1;
    }
    b[i..].iter().all(u8::is_ascii_digit)
}

/// Whether some quantity of `obj` (of `kind` in `api_version`) is not one
/// (kube-apiserver refuses such a body at decoding, [`QUANTITY_FORMAT_ERROR`]).
#[must_use]
pub fn has_malformed_quantity(obj: &Value, api_version: &str, kind: &str) -> bool {
    kind_index(api_version, kind).is_some_and(|index| malformed_quantity(index, obj))
}

fn malformed_quantity(index: u16, obj: &Value) -> bool {
    let Value::Object(members) = obj else {
        return false;
    };
    let msg = &schema::MESSAGES[usize::from(index)];
    let bad = |v: &Value| v.as_str().is_some_and(|s| !quantity_form(s));
    members.iter().any(|(key, value)| {
        let Some(field) = find(msg, key) else {
            return false;
        };
        match (field.ty, field.repeated) {
            (Ty::Quantity, false) => bad(value),
            (Ty::Map(_, Ty::Quantity), _) => value.as_object().is_some_and(|m| m.values().any(bad)),
            (Ty::Msg(i), false) => malformed_quantity(i, value),
            (Ty::Msg(i), true) => value
                .as_array()
                .is_some_and(|items| items.iter().any(|item| malformed_quantity(i, item))),
            _ => false,
        }
    })
}

/// What strict decoding found in a JSON body, in document order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Issue {
    /// A member the kind has no field for (dropped).
    Unknown(String),
    /// A member given twice in one object (the last one is kept).
    Duplicate(String),
}

impl std::fmt::Display for Issue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unknown(path) => write!(f, "unknown field {path:?}"),
            Self::Duplicate(path) => write!(f, "duplicate field {path:?}"),
        }
    }
}

/// Parses a JSON body of `kind` in `api_version` as kube-apiserver's strict
/// decoder reads it: members the kind has no field for are dropped, a
/// member given twice keeps its last value, and both are reported in
/// document order. A kind without a schema here is only checked for
/// duplicates.
///
/// # Errors
/// The body is not JSON.
pub fn decode_json(
    body: &[u8],
    api_version: &str,
    kind: &str,
) -> Result<(Value, Vec<Issue>), serde_json::Error> {
    use serde::de::DeserializeSeed as _;
    let index = schema::KINDS
        .iter()
        .find(|(v, k, _)| *v == api_version && *k == kind)
        .map(|(_, _, m)| *m);
    let issues = std::cell::RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = Node {
        shape: index.map_or(Shape::Free, Shape::Top),
        path: String::new(),
        issues: &issues,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((value, issues.into_inner()))
}

/// What a JSON value is expected to be.
#[derive(Clone, Copy)]
enum Shape {
    /// The object of a kind (also allows `apiVersion` and `kind`).
    Top(u16),
    /// An object of the message at this index.
    Object(u16),
    /// An array of such objects.
    Objects(u16),
    /// Anything (maps, scalars, raw JSON): only duplicates are checked.
    Free,
}

struct Node<'a> {
    shape: Shape,
    path: String,
    issues: &'a std::cell::RefCell<Vec<Issue>>,
}

impl Node<'_> {
    fn child(&self, shape: Shape, path: String) -> Node<'_> {
        Node {
            shape,
            path,
            issues: self.issues,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let shape = match self.shape {
                Shape::Objects(i) => Shape::Object(i),
                _ => Shape::Free,
            };
            let path = format!("{}[{}]", self.path, items.len());
            match seq.next_element_seed(self.child(shape, path))? {
                Some(v) => items.push(v),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let (msg, top) = match self.shape {
            Shape::Top(i) => (Some(&schema::MESSAGES[usize::from(i)]), true),
            Shape::Object(i) => (Some(&schema::MESSAGES[usize::from(i)]), false),
            Shape::Objects(_) | Shape::Free => (None, false),
        };
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            let field = match msg {
                Some(_) if top && (key == "apiVersion" || key == "kind") => None,
                Some(m) => match find(m, &key) {
                    Some(f) => Some(f),
                    None => {
                        self.issues.borrow_mut().push(Issue::Unknown(path));
                        map.next_value::<serde::de::IgnoredAny>()?;
                        continue;
                    }
                },
                None => None,
            };
            let shape = match field.map(|f| (f.ty, f.repeated)) {
                Some((Ty::Msg(i), false)) => Shape::Object(i),
                Some((Ty::Msg(i), true)) => Shape::Objects(i),
                _ => Shape::Free,
            };
            if out.contains_key(&key) {
                self.issues.borrow_mut().push(Issue::Duplicate(path.clone()));
            }
            let value = map.next_value_seed(self.child(shape, path))?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Issue, decode_json, drop_unknown, has_malformed_quantity, has_unknown, quantity_form};

    #[test]
    fn unknown_members_are_dropped_and_named_by_their_paths() {
        let mut d = json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "bogus": 1, "labels": {"any": "label"}},
            "spec": {
                "selector": {"matchLabels": {"a": "b"}, "x": 1},
                "template": {
                    "metadata": {"labels": {"a": "b"}},
                    "spec": {
                        "containers": [{"name": "c", "image": "i", "bogus": 1,
                                        "ports": [{"containerPort": 80, "y": 2}],
                                        "resources": {"limits": {"cpu": "1"}}}],
                        "volumes": [{"name": "v", "configMap": {"name": "x", "defaultMode": 420, "z": 3}}],
                    },
                },
                "strategy": {"rollingUpdate": {"maxSurge": 1}},
            },
            "top": 2,
        });
        assert!(has_unknown(&d, "apps/v1", "Deployment"));
        let unknown = drop_unknown(&mut d, "apps/v1", "Deployment").unwrap();
        assert_eq!(
            unknown,
            [
                "metadata.bogus",
                "spec.selector.x",
                "spec.template.spec.containers[0].bogus",
                "spec.template.spec.containers[0].ports[0].y",
                "spec.template.spec.volumes[0].configMap.z",
                "top",
            ]
        );
        assert_eq!(
            d,
            json!({
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "d", "labels": {"any": "label"}},
                "spec": {
                    "selector": {"matchLabels": {"a": "b"}},
                    "template": {
                        "metadata": {"labels": {"a": "b"}},
                        "spec": {
                            "containers": [{"name": "c", "image": "i",
                                            "ports": [{"containerPort": 80}],
                                            "resources": {"limits": {"cpu": "1"}}}],
                            "volumes": [{"name": "v", "configMap": {"name": "x", "defaultMode": 420}}],
                        },
                    },
                    "strategy": {"rollingUpdate": {"maxSurge": 1}},
                },
            })
        );
        assert!(!has_unknown(&d, "apps/v1", "Deployment"), "what is left is known");
        assert_eq!(drop_unknown(&mut json!({}), "example.com/v1", "Widget"), None);
        assert!(!has_unknown(&json!({"x": 1}), "example.com/v1", "Widget"));
    }

    #[test]
    fn one_unknown_member_at_any_depth_is_found_without_dropping() {
        let pod = |container: serde_json::Value| {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {"any": "x"}},
                   "spec": {"containers": [{"name": "a", "image": "i"}, container]}})
        };
        assert!(!has_unknown(
            &pod(json!({"name": "b", "image": "i"})),
            "v1",
            "Pod"
        ));
        let deep = pod(json!({"name": "b", "image": "i", "ports": [{"containerPort": 1, "bogus": 2}]}));
        assert!(has_unknown(&deep, "v1", "Pod"));
        assert_eq!(
            drop_unknown(&mut deep.clone(), "v1", "Pod").unwrap(),
            ["spec.containers[1].ports[0].bogus"]
        );
        assert!(has_unknown(
            &json!({"kind": "Pod", "status": {"bogus": 1}}),
            "v1",
            "Pod"
        ));
    }

    #[test]
    fn json_bodies_report_unknown_and_duplicate_members_in_document_order() {
        let body =
            br#"{"metadata":{"name":"d1","name":"d2"},"zz":1,"data":{"a":"1","a":"2"},"kind":"ConfigMap"}"#;
        let (v, issues) = decode_json(body, "v1", "ConfigMap").unwrap();
        assert_eq!(
            issues,
            [
                Issue::Duplicate("metadata.name".into()),
                Issue::Unknown("zz".into()),
                Issue::Duplicate("data.a".into()),
            ]
        );
        assert_eq!(
            issues.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [
                "duplicate field \"metadata.name\"",
                "unknown field \"zz\"",
                "duplicate field \"data.a\""
            ]
        );
        assert_eq!(
            v,
            json!({"metadata": {"name": "d2"}, "data": {"a": "2"}, "kind": "ConfigMap"})
        );
        let pod = br#"{"spec":{"containers":[{"name":"c","image":"i","image":"j","x":[1]}]}}"#;
        let (v, issues) = decode_json(pod, "v1", "Pod").unwrap();
        assert_eq!(
            issues,
            [
                Issue::Duplicate("spec.containers[0].image".into()),
                Issue::Unknown("spec.containers[0].x".into()),
            ]
        );
        assert_eq!(v, json!({"spec": {"containers": [{"name": "c", "image": "j"}]}}));
        // Without a schema only duplicates count; numbers and nesting survive.
        let (v, issues) = decode_json(br#"{"a":{"b":1.5,"b":-2},"c":[true,null,"s"]}"#, "", "").unwrap();
        assert_eq!(issues, [Issue::Duplicate("a.b".into())]);
        assert_eq!(v, json!({"a": {"b": -2}, "c": [true, null, "s"]}));
        assert!(decode_json(b"{\"a\":1} x", "", "").is_err());
    }

    #[test]
    fn quantities_are_checked_where_the_schema_has_them() {
        for ok in ["1", "250m", "1.5", "64Mi", "1e3", "+2", "-1", "1E-3", ".5"] {
            assert!(quantity_form(ok), "{ok}");
        }
        for bad in ["", "lots", "1 Mi", "m", "1.5 ", "--1", "1e3x"] {
            assert!(!quantity_form(bad), "{bad}");
        }
        let pod = |cpu: &str| {
            json!({"spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": cpu}}}],
                            "overhead": {"memory": "1Mi"}}})
        };
        assert!(!has_malformed_quantity(&pod("500m"), "v1", "Pod"));
        assert!(has_malformed_quantity(&pod("lots"), "v1", "Pod"));
        assert!(!has_malformed_quantity(&pod("lots"), "example.com/v1", "Widget"));
    }
}
