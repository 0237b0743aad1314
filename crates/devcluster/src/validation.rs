//! Field validation of what the API server stores, with the real texts:
//! label keys and values, container ports, and the fields that may not
//! change once set. Pure functions of the objects; the store turns the
//! errors into a `422 Invalid` with `details.causes`.

use serde_json::Value;

use super::resources::ResourceDef;

/// One invalid field (`field.Error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// `spec.template.spec.containers[0].ports[0].containerPort`.
    pub field: String,
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueDuplicate`.
    pub reason: &'static str,
    /// `Invalid value: 70000: must be between 1 and 65535, inclusive`.
    pub message: String,
}

fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

impl FieldError {
    /// `Invalid value: <value>: <detail>`.
    #[must_use]
    pub fn invalid(field: String, value: &Value, detail: &str) -> Self {
        Self {
            field,
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {}: {detail}", shown(value)),
        }
    }

    /// `Required value`.
    fn required(field: String) -> Self {
        Self {
            field,
            reason: "FieldValueRequired",
            message: "Required value".into(),
        }
    }

    /// `Duplicate value: <value>`.
    fn duplicate(field: String, value: &Value) -> Self {
        Self {
            field,
            reason: "FieldValueDuplicate",
            message: format!("Duplicate value: {}", shown(value)),
        }
    }
}

const LABEL_NAME_MESSAGE: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MESSAGE: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
/// Why a name is not a DNS subdomain.
pub const SUBDOMAIN_MESSAGE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const PREFIX_MESSAGE: &str = "prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters: the
/// name part of a label key, and a non-empty label value.
pub(crate) fn is_label_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// A lowercase RFC 1123 subdomain of at most 253 characters.
pub(crate) fn is_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && part.starts_with(|c: char| c.is_ascii_alphanumeric())
                && part.ends_with(|c: char| c.is_ascii_alphanumeric())
        })
}

/// A qualified name (`[prefix/]name`): why it is not one, if it is not.
fn qualified_name_error(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !is_subdomain(p)
    {
        return Some(PREFIX_MESSAGE.to_owned());
    }
    if name.is_empty() {
        return Some("name part must be non-empty".to_owned());
    }
    if name.len() > 63 {
        return Some("name part must be no more than 63 characters".to_owned());
    }
    (!is_label_name(name)).then(|| LABEL_NAME_MESSAGE.to_owned())
}

fn labels(path: &str, labels: Option<&Value>, out: &mut Vec<FieldError>) {
    let Some(map) = labels.and_then(Value::as_object) else {
        return;
    };
    for (k, v) in map {
        if let Some(why) = qualified_name_error(k) {
            out.push(FieldError::invalid(
                path.to_owned(),
                &Value::String(k.clone()),
                &why,
            ));
        }
        if let Some(s) = v.as_str()
            && !s.is_empty()
            && !is_label_name(s)
        {
            let why = if s.len() > 63 {
                "must be no more than 63 characters"
            } else {
                LABEL_VALUE_MESSAGE
            };
            out.push(FieldError::invalid(path.to_owned(), v, why));
        }
    }
}

const LABEL_MESSAGE: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const CONFIG_KEY_MESSAGE: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";
const PORT_MESSAGE: &str = "must be between 1 and 65535, inclusive";

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Containers of a pod spec, each as `validateContainers` goes: its name (a
/// DNS label, unique in the pod), its image (required), its ports.
fn containers(path: &str, spec: &Value, out: &mut Vec<FieldError>) {
    let mut names = std::collections::HashSet::new();
    for list in ["initContainers", "containers"] {
        let Some(containers) = spec.get(list).and_then(Value::as_array) else {
            continue;
        };
        for (i, c) in containers.iter().enumerate() {
            let at = format!("{path}.{list}[{i}]");
            match c.get("name") {
                Some(Value::String(name)) if !name.is_empty() => {
                    if !is_dns_label(name) {
                        out.push(FieldError::invalid(
                            format!("{at}.name"),
                            &c["name"],
                            LABEL_MESSAGE,
                        ));
                    } else if !names.insert(name.clone()) {
                        out.push(FieldError::duplicate(format!("{at}.name"), &c["name"]));
                    }
                }
                _ => out.push(FieldError::required(format!("{at}.name"))),
            }
            if c.get("image")
                .and_then(Value::as_str)
                .is_none_or(|i| i.trim().is_empty())
            {
                out.push(FieldError::required(format!("{at}.image")));
            }
            let Some(ports) = c.get("ports").and_then(Value::as_array) else {
                continue;
            };
            for (j, p) in ports.iter().enumerate() {
                for (field, required) in [("containerPort", true), ("hostPort", false)] {
                    let Some(v) = p.get(field) else { continue };
                    let n = v.as_i64().unwrap_or(-1);
                    if (n == 0 && !required) || (1..=65535).contains(&n) {
                        continue;
                    }
                    out.push(FieldError::invalid(
                        format!("{path}.{list}[{i}].ports[{j}].{field}"),
                        v,
                        PORT_MESSAGE,
                    ));
                }
            }
        }
    }
}

/// The keys of a ConfigMap's or Secret's `data` and `binaryData`.
fn config_keys(obj: &Value, out: &mut Vec<FieldError>) {
    for field in ["data", "binaryData"] {
        let Some(map) = obj.get(field).and_then(Value::as_object) else {
            continue;
        };
        for key in map.keys() {
            let valid = !key.is_empty()
                && key.len() <= 253
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !valid {
                out.push(FieldError::invalid(
                    format!("{field}[{key}]"),
                    &Value::String(key.clone()),
                    CONFIG_KEY_MESSAGE,
                ));
            }
        }
    }
}

/// A Service's ports and numeric target ports (a missing `targetPort` is
/// the port, as defaulting makes it).
fn service_ports(obj: &Value, out: &mut Vec<FieldError>) {
    let Some(ports) = obj.pointer("/spec/ports").and_then(Value::as_array) else {
        return;
    };
    for (i, p) in ports.iter().enumerate() {
        let port = p.get("port").unwrap_or(&Value::Null);
        if !port.as_i64().is_some_and(|n| (1..=65535).contains(&n)) {
            out.push(FieldError::invalid(
                format!("spec.ports[{i}].port"),
                port,
                PORT_MESSAGE,
            ));
        }
        let target = p.get("targetPort").filter(|t| !t.is_null()).unwrap_or(port);
        if let Some(n) = target.as_i64()
            && !(1..=65535).contains(&n)
        {
            out.push(FieldError::invalid(
                format!("spec.ports[{i}].targetPort"),
                target,
                PORT_MESSAGE,
            ));
        }
    }
}

/// What is wrong with `obj` of kind `res` (empty when it may be stored).
#[must_use]
pub fn validate(res: &ResourceDef, obj: &Value) -> Vec<FieldError> {
    let mut out = Vec::new();
    labels("metadata.labels", obj.pointer("/metadata/labels"), &mut out);
    match res.kind {
        "Pod" => {
            if let Some(spec) = obj.get("spec") {
                containers("spec", spec, &mut out);
            }
        }
        "Deployment" | "ReplicaSet" => {
            if let Some(replicas) = obj.pointer("/spec/replicas")
                && replicas.as_i64().is_some_and(|n| n < 0)
            {
                out.push(FieldError::invalid(
                    "spec.replicas".into(),
                    replicas,
                    "must be greater than or equal to 0",
                ));
            }
            labels(
                "spec.template.metadata.labels",
                obj.pointer("/spec/template/metadata/labels"),
                &mut out,
            );
            if let Some(spec) = obj.pointer("/spec/template/spec") {
                containers("spec.template.spec", spec, &mut out);
            }
        }
        "ConfigMap" | "Secret" => config_keys(obj, &mut out),
        "Service" => service_ports(obj, &mut out),
        _ => {}
    }
    out
}

/// What an update may not change (on top of [`validate`] of the new object).
#[must_use]
pub fn validate_update(res: &ResourceDef, old: &Value, new: &Value) -> Vec<FieldError> {
    let mut out = validate(res, new);
    if matches!(res.kind, "Deployment" | "ReplicaSet") {
        let (was, is) = (old.pointer("/spec/selector"), new.pointer("/spec/selector"));
        if was.is_some() && was != is {
            out.push(FieldError::invalid(
                "spec.selector".into(),
                is.unwrap_or(&Value::Null),
                "field is immutable",
            ));
        }
    }
    out
}

/// `Deployment.apps "bad" is invalid: <field>: <message>` (several in
/// brackets, comma separated), as `errors.NewInvalid` words it.
#[must_use]
pub fn invalid_message(res: &ResourceDef, name: &str, errors: &[FieldError]) -> String {
    let kind = if res.group.is_empty() {
        res.kind.to_owned()
    } else {
        format!("{}.{}", res.kind, res.group)
    };
    let parts: Vec<String> = errors
        .iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect();
    let detail = if parts.len() == 1 {
        parts[0].clone()
    } else {
        format!("[{}]", parts.join(", "))
    };
    format!("{kind} {name:?} is invalid: {detail}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::resources::by_kind;

    #[test]
    fn ports_label_keys_and_values_are_checked_with_the_real_texts() {
        let d = json!({
            "metadata": {"name": "bad", "labels": {"bad key!": "v", "example.com/ok": "fine", "ok": "not ok"}},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i", "ports": [
                {"containerPort": 70000}, {"containerPort": 80, "hostPort": 0},
            ]}]}}},
        });
        let errors = validate(by_kind("Deployment"), &d);
        let fields: Vec<(&str, &str)> = errors
            .iter()
            .map(|e| (e.field.as_str(), e.message.as_str()))
            .collect();
        assert_eq!(fields.len(), 3, "{fields:?}");
        assert!(
            fields[0]
                .1
                .starts_with("Invalid value: \"bad key!\": name part must consist")
        );
        assert!(
            fields[1]
                .1
                .starts_with("Invalid value: \"not ok\": a valid label must be")
        );
        assert_eq!(
            fields[2],
            (
                "spec.template.spec.containers[0].ports[0].containerPort",
                "Invalid value: 70000: must be between 1 and 65535, inclusive"
            )
        );
        assert_eq!(
            invalid_message(by_kind("Deployment"), "bad", &errors[2..]),
            "Deployment.apps \"bad\" is invalid: spec.template.spec.containers[0].ports[0].containerPort: Invalid value: 70000: must be between 1 and 65535, inclusive"
        );
        assert!(
            invalid_message(by_kind("ConfigMap"), "x", &errors)
                .starts_with("ConfigMap \"x\" is invalid: [metadata.labels: ")
        );
    }

    #[test]
    fn a_workload_selector_is_immutable() {
        let old = json!({"spec": {"selector": {"matchLabels": {"app": "a"}}}});
        let new = json!({"spec": {"selector": {"matchLabels": {"app": "other"}}}});
        let errors = validate_update(by_kind("Deployment"), &old, &new);
        assert_eq!(
            invalid_message(by_kind("Deployment"), "good", &errors),
            "Deployment.apps \"good\" is invalid: spec.selector: Invalid value: {\"matchLabels\":{\"app\":\"other\"}}: field is immutable"
        );
        assert!(validate_update(by_kind("Deployment"), &old, &old).is_empty());
    }
}
