//! A container's environment as the kubelet builds it (pure, given the
//! ConfigMaps and Secrets it references): `envFrom`, then `env` (values with
//! `$(VAR)` expanded against what is defined so far and the service
//! variables; `valueFrom` with `fieldRef`, `resourceFieldRef`,
//! `configMapKeyRef` and `secretKeyRef`), then the service variables that
//! are not overridden. Also the downward API values shared with
//! `downwardAPI` volumes.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::quantity::parse_milli;

/// The data of a ConfigMap or Secret, by key (`None`: it does not exist).
pub type Data = Option<BTreeMap<String, Vec<u8>>>;

/// The objects a container's environment refers to.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub config_maps: BTreeMap<String, Data>,
    pub secrets: BTreeMap<String, Data>,
}

/// Facts about the pod only the kubelet knows.
#[derive(Debug, Clone)]
pub struct PodFacts<'a> {
    pub pod: &'a Pod,
    pub pod_ip: String,
    pub host_ip: String,
    pub node_name: String,
    /// Node allocatable CPU in millicores (the default for an unset CPU limit).
    pub node_cpu_milli: i128,
    /// Node allocatable memory in bytes (the default for an unset memory limit).
    pub node_memory: i128,
}

/// Why a container's environment cannot be built (the container waits in
/// `CreateContainerConfigError` with this message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("configmap \"{0}\" not found")]
    ConfigMapNotFound(String),
    #[error("secret \"{0}\" not found")]
    SecretNotFound(String),
    #[error("couldn't find key {key} in {kind} {namespace}/{name}")]
    KeyNotFound {
        key: String,
        kind: &'static str,
        namespace: String,
        name: String,
    },
    #[error("unsupported fieldPath: {0}")]
    UnsupportedField(String),
    #[error("unsupported container resource: {0}")]
    UnsupportedResource(String),
    #[error("invalid divisor {0:?}")]
    InvalidDivisor(String),
}

/// The ConfigMaps and Secrets a container's environment names.
#[must_use]
pub fn referenced(c: &Container) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut cms, mut secrets) = (BTreeSet::new(), BTreeSet::new());
    for from in c.env_from.iter().flatten() {
        if let Some(r) = &from.config_map_ref {
            cms.insert(r.name.clone());
        }
        if let Some(r) = &from.secret_ref {
            secrets.insert(r.name.clone());
        }
    }
    for var in c.env.iter().flatten() {
        let Some(from) = &var.value_from else { continue };
        if let Some(r) = &from.config_map_key_ref {
            cms.insert(r.name.clone());
        }
        if let Some(r) = &from.secret_key_ref {
            secrets.insert(r.name.clone());
        }
    }
    (cms, secrets)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Kubernetes `$(VAR)` expansion: `$$` is a literal `$`, unknown references stay as written.
#[must_use]
pub fn expand(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(a) = after.strip_prefix('(')
            && let Some(end) = a.find(')')
        {
            let name = &a[..end];
            match lookup(name) {
                Some(v) => out.push_str(&v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &a[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Go's `%q` of a string (the format of `downwardAPI` label and annotation files).
#[must_use]
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn map_file(map: Option<&BTreeMap<String, String>>) -> String {
    map.into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}\n", go_quote(v)))
        .collect()
}

fn keyed<'a>(path: &'a str, prefix: &str) -> Option<&'a str> {
    path.strip_prefix(prefix)?.strip_suffix("']")
}

/// The value of a downward API `fieldPath`. `metadata.labels` and
/// `metadata.annotations` (whole maps) are only valid in volumes.
///
/// # Errors
/// [`EnvError::UnsupportedField`].
pub fn field_value(facts: &PodFacts<'_>, path: &str, in_volume: bool) -> Result<String, EnvError> {
    let pod = facts.pod;
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" if in_volume => map_file(meta.labels.as_ref()),
        "metadata.annotations" if in_volume => map_file(meta.annotations.as_ref()),
        "spec.nodeName" => facts.node_name.clone(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into()),
        "status.hostIP" | "status.hostIPs" => facts.host_ip.clone(),
        "status.podIP" | "status.podIPs" => facts.pod_ip.clone(),
        other => {
            if let Some(k) = keyed(other, "metadata.labels['") {
                meta.labels
                    .as_ref()
                    .and_then(|m| m.get(k))
                    .cloned()
                    .unwrap_or_default()
            } else if let Some(k) = keyed(other, "metadata.annotations['") {
                meta.annotations
                    .as_ref()
                    .and_then(|m| m.get(k))
                    .cloned()
                    .unwrap_or_default()
            } else {
                return Err(EnvError::UnsupportedField(other.to_owned()));
            }
        }
    })
}

/// The value of a `resourceFieldRef` (`limits.cpu`, `requests.memory`, ...)
/// divided by `divisor` and rounded up; an unset limit is the node's allocatable.
///
/// # Errors
/// An unsupported resource or an invalid divisor.
pub fn resource_value(
    facts: &PodFacts<'_>,
    container: &Container,
    resource: &str,
    divisor: Option<&str>,
) -> Result<String, EnvError> {
    let (section, name) = resource
        .split_once('.')
        .ok_or_else(|| EnvError::UnsupportedResource(resource.to_owned()))?;
    let res = container.resources.as_ref();
    let get = |list: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        list.and_then(|l| l.get(name)).and_then(|q| parse_milli(&q.0))
    };
    let limits = get(res.and_then(|r| r.limits.as_ref()));
    let requests = get(res.and_then(|r| r.requests.as_ref()));
    let node = match name {
        "cpu" => facts.node_cpu_milli,
        "memory" | "ephemeral-storage" => facts.node_memory * 1000,
        _ => return Err(EnvError::UnsupportedResource(resource.to_owned())),
    };
    let value_milli = match section {
        "limits" => limits.unwrap_or(node),
        "requests" => requests.or(limits).unwrap_or(0),
        _ => return Err(EnvError::UnsupportedResource(resource.to_owned())),
    };
    let divisor_text = divisor.unwrap_or("1");
    let divisor_milli = parse_milli(divisor_text)
        .filter(|d| *d > 0)
        .ok_or_else(|| EnvError::InvalidDivisor(divisor_text.to_owned()))?;
    let value = (value_milli + divisor_milli - 1).div_euclid(divisor_milli);
    // CPU rounds up to at least one unit, as the kubelet does.
    let value = if name == "cpu" && value_milli > 0 {
        value.max(1)
    } else {
        value
    };
    Ok(value.to_string())
}

fn lookup_key(
    sources: &BTreeMap<String, Data>,
    kind: &'static str,
    namespace: &str,
    name: &str,
    key: &str,
    optional: bool,
) -> Result<Option<String>, EnvError> {
    match sources.get(name) {
        Some(Some(data)) => match data.get(key) {
            Some(v) => Ok(Some(text(v))),
            None if optional => Ok(None),
            None => Err(EnvError::KeyNotFound {
                key: key.to_owned(),
                kind,
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            }),
        },
        _ if optional => Ok(None),
        _ if kind == "ConfigMap" => Err(EnvError::ConfigMapNotFound(name.to_owned())),
        _ => Err(EnvError::SecretNotFound(name.to_owned())),
    }
}

/// The environment of `container`, `service` being the service variables
/// (`KUBERNETES_SERVICE_HOST`, ...).
///
/// # Errors
/// A missing ConfigMap, Secret or key that is not optional, or an unsupported field.
pub fn build(
    facts: &PodFacts<'_>,
    container: &Container,
    sources: &Sources,
    service: &[(String, String)],
) -> Result<BTreeMap<String, String>, EnvError> {
    let namespace = facts.pod.metadata.namespace.clone().unwrap_or_default();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let (data, optional, kind, name) = if let Some(r) = &from.config_map_ref {
            (
                sources.config_maps.get(&r.name),
                r.optional == Some(true),
                "ConfigMap",
                &r.name,
            )
        } else if let Some(r) = &from.secret_ref {
            (
                sources.secrets.get(&r.name),
                r.optional == Some(true),
                "Secret",
                &r.name,
            )
        } else {
            continue;
        };
        match data {
            Some(Some(data)) => {
                for (k, v) in data {
                    env.insert(format!("{prefix}{k}"), text(v));
                }
            }
            _ if optional => {}
            _ if kind == "ConfigMap" => return Err(EnvError::ConfigMapNotFound(name.clone())),
            _ => return Err(EnvError::SecretNotFound(name.clone())),
        }
    }
    let service_map: BTreeMap<&str, &str> = service.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for var in container.env.iter().flatten() {
        let value = if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                Some(field_value(facts, &f.field_path, false)?)
            } else if let Some(r) = &from.resource_field_ref {
                let target = match r.container_name.as_deref().filter(|n| !n.is_empty()) {
                    Some(name) => facts
                        .pod
                        .spec
                        .as_ref()
                        .and_then(|s| s.containers.iter().find(|c| c.name == name))
                        .unwrap_or(container),
                    None => container,
                };
                Some(resource_value(
                    facts,
                    target,
                    &r.resource,
                    r.divisor.as_ref().map(|d| d.0.as_str()),
                )?)
            } else if let Some(r) = &from.config_map_key_ref {
                lookup_key(
                    &sources.config_maps,
                    "ConfigMap",
                    &namespace,
                    &r.name,
                    &r.key,
                    r.optional == Some(true),
                )?
            } else if let Some(r) = &from.secret_key_ref {
                lookup_key(
                    &sources.secrets,
                    "Secret",
                    &namespace,
                    &r.name,
                    &r.key,
                    r.optional == Some(true),
                )?
            } else {
                None
            }
        } else {
            let raw = var.value.clone().unwrap_or_default();
            Some(expand(&raw, &|name| {
                env.get(name)
                    .cloned()
                    .or_else(|| service_map.get(name).map(|v| (*v).to_owned()))
            }))
        };
        if let Some(value) = value {
            env.insert(var.name.clone(), value);
        }
    }
    for (k, v) in service {
        env.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Ok(env)
}

/// The service variables of the API server at `host:port` (the `kubernetes`
/// Service of namespace `default`, as docker links).
#[must_use]
pub fn kubernetes_service(host: &str, port: u16) -> Vec<(String, String)> {
    vec![
        ("KUBERNETES_SERVICE_HOST".into(), host.into()),
        ("KUBERNETES_SERVICE_PORT".into(), port.to_string()),
        ("KUBERNETES_SERVICE_PORT_HTTPS".into(), port.to_string()),
        ("KUBERNETES_PORT".into(), format!("tcp://{host}:{port}")),
        (
            format!("KUBERNETES_PORT_{port}_TCP"),
            format!("tcp://{host}:{port}"),
        ),
        (format!("KUBERNETES_PORT_{port}_TCP_PROTO"), "tcp".into()),
        (format!("KUBERNETES_PORT_{port}_TCP_PORT"), port.to_string()),
        (format!("KUBERNETES_PORT_{port}_TCP_ADDR"), host.into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "ns", "uid": "u-1",
                         "labels": {"app": "web", "tier": "a\"b"}},
            "spec": {"containers": [{"name": "main", "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "250m"}}}]},
        }))
        .unwrap()
    }

    fn facts(p: &Pod) -> PodFacts<'_> {
        PodFacts {
            pod: p,
            pod_ip: "127.5.0.1".into(),
            host_ip: "127.0.0.1".into(),
            node_name: "node-0".into(),
            node_cpu_milli: 4000,
            node_memory: 8 << 30,
        }
    }

    #[test]
    fn expansion_follows_kubernetes() {
        let env: BTreeMap<String, String> = [("A".to_owned(), "x".to_owned())].into();
        let f = |n: &str| env.get(n).cloned();
        assert_eq!(expand("$(A)/t $(B) $$(A) $", &f), "x/t $(B) $(A) $");
    }

    #[test]
    fn env_from_then_env_with_sources_and_service_variables() {
        let p = pod();
        let c: Container = serde_json::from_value(json!({
            "name": "main",
            "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "250m"}},
            "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
            "env": [
                {"name": "CM_MODE", "value": "override"},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {"name": "URL", "value": "http://$(KUBERNETES_SERVICE_HOST):$(PORT)/$(IP)"},
                {"name": "PORT", "value": "1"},
                {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "p"}}},
                {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "p", "optional": true}}},
                {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
                {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            ],
        }))
        .unwrap();
        let mut sources = Sources::default();
        sources
            .config_maps
            .insert("cm".into(), Some([("MODE".to_owned(), b"test".to_vec())].into()));
        sources
            .secrets
            .insert("s".into(), Some([("p".to_owned(), b"hunter2".to_vec())].into()));
        sources.secrets.insert("gone".into(), None);
        let env = build(&facts(&p), &c, &sources, &kubernetes_service("127.0.0.1", 6443)).unwrap();
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("CM_MODE"), Some("override"));
        assert_eq!(get("IP"), Some("127.5.0.1"));
        assert_eq!(get("TIER"), Some("web"));
        assert_eq!(
            get("URL"),
            Some("http://127.0.0.1:$(PORT)/127.5.0.1"),
            "later variables are not yet defined"
        );
        assert_eq!(get("PASS"), Some("hunter2"));
        assert_eq!(get("OPT"), None);
        assert_eq!(get("CPU"), Some("250"));
        assert_eq!(get("MEM"), Some("64"));
        assert_eq!(
            get("CPU_LIMIT"),
            Some("4"),
            "an unset limit is the node's allocatable"
        );
        assert_eq!(get("KUBERNETES_SERVICE_PORT"), Some("6443"));
        assert_eq!(get("KUBERNETES_PORT_6443_TCP_ADDR"), Some("127.0.0.1"));
    }

    #[test]
    fn missing_sources_fail_with_the_kubelets_messages() {
        let p = pod();
        let sources = Sources::default();
        let c: Container = serde_json::from_value(json!({"name": "m",
            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}))
        .unwrap();
        assert_eq!(
            build(&facts(&p), &c, &sources, &[]).unwrap_err().to_string(),
            "configmap \"cm\" not found"
        );
        let mut sources = Sources::default();
        sources.config_maps.insert("cm".into(), Some(BTreeMap::new()));
        assert_eq!(
            build(&facts(&p), &c, &sources, &[]).unwrap_err().to_string(),
            "couldn't find key k in ConfigMap ns/cm"
        );
    }

    #[test]
    fn volume_fields_format_maps_like_the_kubelet() {
        let p = pod();
        assert_eq!(
            field_value(&facts(&p), "metadata.labels", true).unwrap(),
            "app=\"web\"\ntier=\"a\\\"b\"\n"
        );
        assert!(field_value(&facts(&p), "metadata.labels", false).is_err());
        assert_eq!(field_value(&facts(&p), "metadata.uid", false).unwrap(), "u-1");
    }
}
