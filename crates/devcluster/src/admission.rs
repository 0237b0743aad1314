//! Mutating admission of the simulated API server: what kube-apiserver's
//! admission plugins change in an object before it is stored.
//!
//! `ServiceAccount`: a pod without `automountServiceAccountToken: false`
//! (on the pod, or else on its ServiceAccount) gets the projected volume
//! `kube-api-access-<suffix>` — a ServiceAccount token (TokenRequest,
//! 3607 s), `ca.crt` from the `kube-root-ca.crt` ConfigMap and the
//! namespace from the downward API — mounted read-only at
//! `/var/run/secrets/kubernetes.io/serviceaccount` in every container that
//! does not mount something there already. Unlike kube-apiserver, a pod
//! naming a ServiceAccount that does not exist is admitted (its token
//! volume then cannot be set up, and the node agent says so).

use serde_json::{Value, json};

use super::resources::by_kind;
use super::store::Store;

/// Where in-cluster configuration finds the token, `ca.crt` and `namespace`.
pub const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Lifetime the admission plugin asks for (an hour and 7 s, as kube-apiserver's).
pub const TOKEN_EXPIRATION_SECONDS: i64 = 3607;

fn suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// The projected volume of a pod's ServiceAccount token.
#[must_use]
pub fn token_volume(name: &str) -> Value {
    json!({"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": TOKEN_EXPIRATION_SECONDS, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ]}})
}

/// Admits a pod being created in namespace `ns`.
#[must_use]
pub fn admit_pod(store: &Store, ns: &str, mut pod: Value) -> Value {
    let spec = &pod["spec"];
    let account = spec
        .get("serviceAccountName")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or("default")
        .to_owned();
    let automount = spec
        .get("automountServiceAccountToken")
        .and_then(Value::as_bool)
        .or_else(|| {
            store
                .get(by_kind("ServiceAccount"), ns, &account)?
                .get("automountServiceAccountToken")?
                .as_bool()
        })
        .unwrap_or(true);
    pod["spec"]["serviceAccountName"] = json!(account);
    if !automount {
        return pod;
    }
    let name = format!("kube-api-access-{}", suffix());
    let mut mounted = false;
    for list in ["initContainers", "containers"] {
        let Some(containers) = pod["spec"].get_mut(list).and_then(Value::as_array_mut) else {
            continue;
        };
        for c in containers {
            let has = c
                .get("volumeMounts")
                .and_then(Value::as_array)
                .is_some_and(|m| m.iter().any(|m| m["mountPath"] == SERVICE_ACCOUNT_MOUNT));
            if has {
                continue;
            }
            let mount = json!({"name": name, "readOnly": true, "mountPath": SERVICE_ACCOUNT_MOUNT});
            match c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                Some(m) => m.push(mount),
                None => c["volumeMounts"] = json!([mount]),
            }
            mounted = true;
        }
    }
    if mounted {
        let volume = token_volume(&name);
        match pod["spec"].get_mut("volumes").and_then(Value::as_array_mut) {
            Some(v) => v.push(volume),
            None => pod["spec"]["volumes"] = json!([volume]),
        }
    }
    pod
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Store {
        let s = Store::new(100);
        s.create(by_kind("Namespace"), "", json!({"metadata": {"name": "ns"}}))
            .unwrap();
        s
    }

    #[test]
    fn pods_get_the_token_volume_in_every_container() {
        let s = store();
        let pod = admit_pod(
            &s,
            "ns",
            json!({"spec": {"initContainers": [{"name": "i"}], "containers": [
                {"name": "a"},
                {"name": "b", "volumeMounts": [{"name": "own", "mountPath": SERVICE_ACCOUNT_MOUNT}]},
            ]}}),
        );
        assert_eq!(pod["spec"]["serviceAccountName"], "default");
        let volume = &pod["spec"]["volumes"][0];
        let name = volume["name"].as_str().unwrap();
        assert!(name.starts_with("kube-api-access-") && name.len() == 21, "{name}");
        assert_eq!(
            volume["projected"]["sources"][0]["serviceAccountToken"]["expirationSeconds"],
            3607
        );
        for c in ["initContainers", "containers"] {
            assert_eq!(pod["spec"][c][0]["volumeMounts"][0]["name"], name);
            assert_eq!(pod["spec"][c][0]["volumeMounts"][0]["readOnly"], true);
        }
        assert_eq!(
            pod["spec"]["containers"][1]["volumeMounts"]
                .as_array()
                .unwrap()
                .len(),
            1,
            "a container mounting the path itself keeps its own"
        );
    }

    #[test]
    fn automount_false_on_the_pod_or_its_account_opts_out() {
        let s = store();
        let pod = admit_pod(
            &s,
            "ns",
            json!({"spec": {"automountServiceAccountToken": false, "containers": [{"name": "a"}]}}),
        );
        assert!(pod["spec"].get("volumes").is_none());
        s.create(
            by_kind("ServiceAccount"),
            "ns",
            json!({"metadata": {"name": "quiet"}, "automountServiceAccountToken": false}),
        )
        .unwrap();
        let pod = admit_pod(
            &s,
            "ns",
            json!({"spec": {"serviceAccountName": "quiet", "containers": [{"name": "a"}]}}),
        );
        assert!(pod["spec"].get("volumes").is_none());
        let pod = admit_pod(
            &s,
            "ns",
            json!({"spec": {"serviceAccountName": "quiet", "automountServiceAccountToken": true,
                            "containers": [{"name": "a"}]}}),
        );
        assert!(pod["spec"]["volumes"].is_array(), "the pod's own setting wins");
    }
}
