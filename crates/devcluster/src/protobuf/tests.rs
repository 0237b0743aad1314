use serde_json::json;

use super::{DecodeError, has_kind, schema};

fn decode(body: &[u8]) -> Result<serde_json::Value, DecodeError> {
    super::decode(body, ("v1", "Namespace"))
}

/// A protobuf writer for the tests: fields in the order given.
#[derive(Default, Clone)]
struct Msg(Vec<u8>);

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Msg {
    fn key(mut self, tag: u32, wire: u8) -> Self {
        varint(&mut self.0, u64::from(tag) << 3 | u64::from(wire));
        self
    }
    fn int(self, tag: u32, v: i64) -> Self {
        let mut m = self.key(tag, 0);
        varint(&mut m.0, v as u64);
        m
    }
    fn bytes(self, tag: u32, b: &[u8]) -> Self {
        let mut m = self.key(tag, 2);
        varint(&mut m.0, b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }
    fn str(self, tag: u32, s: &str) -> Self {
        self.bytes(tag, s.as_bytes())
    }
    fn msg(self, tag: u32, m: &Msg) -> Self {
        self.bytes(tag, &m.0)
    }
    fn entry(self, tag: u32, k: &str, v: &Msg) -> Self {
        self.msg(tag, &Msg::default().str(1, k).msg(2, v))
    }
}

/// `k8s\0` + runtime.Unknown{typeMeta{apiVersion, kind}, raw}.
fn envelope(api_version: &str, kind: &str, raw: &Msg) -> Vec<u8> {
    let type_meta = Msg::default().str(1, api_version).str(2, kind);
    let unknown = Msg::default()
        .msg(1, &type_meta)
        .msg(2, raw)
        .str(3, "")
        .str(4, "");
    let mut out = b"k8s\0".to_vec();
    out.extend_from_slice(&unknown.0);
    out
}

/// ObjectMeta as gogo writes it: every non-pointer string, zero or not.
fn meta(name: &str, namespace: &str) -> Msg {
    Msg::default()
        .str(1, name)
        .str(2, "")
        .str(3, namespace)
        .str(4, "")
        .str(5, "")
        .str(6, "")
        .int(7, 0)
        // creationTimestamp: the zero time is an empty message.
        .msg(8, &Msg::default())
}

#[test]
fn a_configmap_keeps_its_data_and_drops_the_zero_values_a_sender_always_writes() {
    let raw = Msg::default()
        .msg(1, &meta("settings", "imperative"))
        .entry(2, "SKIPPER_X", &Msg::default())
        .msg(2, &Msg::default().str(1, "B").str(2, "2"))
        .msg(3, &Msg::default().str(1, "bin").bytes(2, b"\x00\x01"));
    // The Msg above writes map entries directly for `data` (tag 2) and
    // `binaryData` (tag 3); the first entry has an empty value message.
    let got = decode(&envelope("v1", "ConfigMap", &raw)).unwrap();
    assert_eq!(
        got,
        json!({
            "kind": "ConfigMap",
            "apiVersion": "v1",
            "metadata": {"name": "settings", "namespace": "imperative"},
            "data": {"SKIPPER_X": "", "B": "2"},
            "binaryData": {"bin": "AAE="},
        })
    );
}

#[test]
fn pointer_fields_keep_their_zero_values_and_structs_stay() {
    // Deployment {metadata, spec {replicas: 0 (pointer), selector, template, strategy {}}, status {}}.
    let container = Msg::default()
        .str(1, "web")
        .str(2, "skipper")
        .msg(
            6,
            &Msg::default()
                .str(1, "")
                .int(2, 0)
                .int(3, 8888)
                .str(4, "TCP")
                .str(5, ""),
        )
        // resources: an empty struct
        .msg(8, &Msg::default())
        .str(13, "")
        .str(14, "IfNotPresent")
        .int(16, 0)
        .int(17, 0)
        .int(18, 0);
    let pod_spec = Msg::default()
        .msg(2, &container)
        .str(3, "")
        // terminationGracePeriodSeconds (pointer) 0
        .int(4, 0);
    let template = Msg::default()
        .msg(
            1,
            &Msg::default()
                .str(1, "")
                .msg(11, &Msg::default().str(1, "app").str(2, "web")),
        )
        .msg(2, &pod_spec);
    let spec = Msg::default()
        .int(1, 0)
        .msg(
            2,
            &Msg::default().msg(1, &Msg::default().str(1, "app").str(2, "web")),
        )
        .msg(3, &template)
        .msg(4, &Msg::default())
        .int(5, 0);
    let raw = Msg::default()
        .msg(1, &meta("web", "imperative"))
        .msg(2, &spec)
        .msg(3, &Msg::default());
    let got = decode(&envelope("apps/v1", "Deployment", &raw)).unwrap();
    assert_eq!(
        got,
        json!({
            "kind": "Deployment",
            "apiVersion": "apps/v1",
            "metadata": {"name": "web", "namespace": "imperative"},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "containers": [{
                            "name": "web",
                            "image": "skipper",
                            "ports": [{"containerPort": 8888, "protocol": "TCP"}],
                            "resources": {},
                            "imagePullPolicy": "IfNotPresent",
                        }],
                        "terminationGracePeriodSeconds": 0,
                    },
                },
                "strategy": {},
            },
            "status": {},
        })
    );
}

#[test]
fn inline_members_flatten_and_special_types_take_their_json_forms() {
    // Volume {name, VolumeSource (inline) {configMap {name (inline LocalObjectReference), defaultMode 420}}}
    let volume = Msg::default().str(1, "cfg").msg(
        2,
        &Msg::default().msg(
            19,
            &Msg::default()
                .msg(1, &Msg::default().str(1, "settings"))
                .int(3, 0o644),
        ),
    );
    // Service port with targetPort as a string and as a number.
    let named = Msg::default()
        .str(1, "http")
        .str(2, "TCP")
        .int(3, 80)
        .msg(4, &Msg::default().int(1, 1).int(2, 0).str(3, "http"));
    let numbered = Msg::default()
        .str(1, "")
        .int(3, 81)
        .msg(4, &Msg::default().int(1, 0).int(2, 8081).str(3, ""));
    let pod = Msg::default()
        .msg(
            1,
            &meta("p", "d")
                // creationTimestamp 2026-12-01T01:02:03Z
                .msg(8, &Msg::default().int(1, 1_796_086_923)),
        )
        .msg(2, &Msg::default().msg(1, &volume));
    let got = decode(&envelope("v1", "Pod", &pod)).unwrap();
    assert_eq!(
        got["spec"]["volumes"],
        json!([{"name": "cfg", "configMap": {"name": "settings", "defaultMode": 420}}])
    );
    assert_eq!(got["metadata"]["creationTimestamp"], "2026-12-01T01:02:03Z");
    let svc = Msg::default()
        .msg(1, &meta("s", "d"))
        .msg(2, &Msg::default().msg(1, &named).msg(1, &numbered));
    let got = decode(&envelope("v1", "Service", &svc)).unwrap();
    assert_eq!(
        got["spec"]["ports"],
        json!([
            {"name": "http", "protocol": "TCP", "port": 80, "targetPort": "http"},
            {"port": 81, "targetPort": 8081},
        ])
    );
}

#[test]
fn a_self_subject_access_review_decodes_for_kubectl_auth_can_i() {
    let attrs = Msg::default()
        .str(1, "imperative")
        .str(2, "create")
        .str(3, "")
        .str(4, "")
        .str(5, "configmaps")
        .str(6, "")
        .str(7, "");
    let raw = Msg::default()
        .msg(1, &meta("", ""))
        .msg(2, &Msg::default().msg(1, &attrs))
        .msg(3, &Msg::default().int(1, 0).str(2, "").str(3, "").int(4, 0));
    let got = decode(&envelope(
        "authorization.k8s.io/v1",
        "SelfSubjectAccessReview",
        &raw,
    ))
    .unwrap();
    assert_eq!(
        got,
        json!({
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {},
            "spec": {"resourceAttributes": {"namespace": "imperative", "verb": "create", "resource": "configmaps"}},
            "status": {"allowed": false},
        })
    );
}

#[test]
fn unknown_field_numbers_are_skipped_and_bad_bodies_are_refused() {
    let good = Msg::default().msg(1, &meta("n", "")).int(99, 7).str(98, "x");
    assert_eq!(
        decode(&envelope("v1", "Namespace", &good)).unwrap(),
        json!({"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": "n"}})
    );
    // A fixed64 field without its eight bytes.
    let cut = good.clone().key(97, 1);
    assert!(matches!(
        decode(&envelope("v1", "Namespace", &cut)),
        Err(DecodeError::Object { reason, .. }) if reason == "unexpected EOF"
    ));
    // A number where a message belongs.
    let wrong = Msg::default().int(1, 5);
    assert_eq!(
        decode(&envelope("v1", "Namespace", &wrong)),
        Err(DecodeError::Object {
            api_version: "v1".into(),
            kind: "Namespace".into(),
            reason: "proto: wrong wireType = 0 for field metadata".into()
        })
    );
    assert_eq!(decode(b"{\"kind\":\"Namespace\"}"), Err(DecodeError::NoMagic));
    assert_eq!(
        decode(&envelope("example.com/v1", "Widget", &good)),
        Err(DecodeError::UnknownKind {
            api_version: "example.com/v1".into(),
            kind: "Widget".into()
        })
    );
    // Without a kind, the body is the resource's kind.
    assert_eq!(decode(&envelope("", "", &good)).unwrap()["kind"], "Namespace");
    // A length past the end of the envelope.
    let mut truncated = envelope("v1", "Namespace", &good);
    truncated.truncate(truncated.len() - 3);
    assert_eq!(
        decode(&truncated),
        Err(DecodeError::Envelope("unexpected EOF".into()))
    );
}

#[test]
fn the_schema_covers_the_kinds_kubectl_and_the_manifests_create() {
    for (api_version, kind) in [
        ("v1", "Namespace"),
        ("v1", "ConfigMap"),
        ("v1", "Secret"),
        ("v1", "ServiceAccount"),
        ("v1", "Service"),
        ("apps/v1", "Deployment"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("rbac.authorization.k8s.io/v1", "ClusterRole"),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
        ("authorization.k8s.io/v1", "SelfSubjectAccessReview"),
        ("authorization.k8s.io/v1", "SubjectAccessReview"),
        ("authentication.k8s.io/v1", "TokenRequest"),
        ("authentication.k8s.io/v1", "SelfSubjectReview"),
    ] {
        assert!(has_kind(api_version, kind), "{kind}");
        let found = schema::KINDS
            .iter()
            .find(|(v, k, _)| *v == api_version && *k == kind);
        let (_, _, index) = found.unwrap_or_else(|| panic!("{api_version} {kind} has no schema"));
        assert!(
            schema::MESSAGES[usize::from(*index)]
                .name
                .ends_with(&format!(".{kind}")),
            "{kind}"
        );
    }
}
