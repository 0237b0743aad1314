//! The differential conformance suite: each scenario runs against the
//! simulator (`<name>::simulator`) and against the real control plane
//! (`<name>::real`) and asserts the same observable behaviour, driven by
//! kube-rs and kubectl. The real control plane is the oracle: a scenario
//! whose simulator run is ignored names the difference (listed with its
//! reason in the simulator's deviations).
//!
//! Without `make control-plane` the `real` runs report themselves skipped
//! (in CI they fail).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::backend;
use skipper_test_support::differential;

use std::time::Duration;

use backend::Backend;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use skipper_test_support::patch;

const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "conf";

fn from<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// The `Status` of a failed call, as JSON.
fn status(result: Result<impl std::fmt::Debug, kube::Error>) -> Value {
    match result {
        Err(kube::Error::Api(s)) => {
            let mut v = serde_json::to_value(&*s).unwrap();
            // An empty ListMeta says nothing.
            if v["metadata"] == json!({}) {
                v.as_object_mut().unwrap().remove("metadata");
            }
            v
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn deployment(name: &str, replicas: i32, extra_spec: &Value) -> Deployment {
    let mut d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app",
                        "image": "skipper",
                        "command": ["skipper", "fixture"],
                        "ports": [{"name": "http", "containerPort": 8888}],
                        // Nothing listens there: the pods never become Ready.
                        "readinessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1},
                    }],
                },
            },
        },
    });
    if let (Some(spec), Some(extra)) = (d["spec"].as_object_mut(), extra_spec.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    from(d)
}

// === RBAC ===

differential!(rbac_decisions_and_forbidden_texts, rbac, namespaces = [NS]);

async fn rbac(b: &Backend) {
    let admin = b.client().await;
    let roles: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(admin.clone(), NS);
    roles
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "reader"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
            })),
        )
        .await
        .unwrap();
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(admin.clone(), NS);
    bindings
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "reader"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
            })),
        )
        .await
        .unwrap();

    let alice = b.client_as("alice", &[]).await;
    let cms: Api<ConfigMap> = Api::namespaced(alice.clone(), NS);
    // RBAC takes effect within the authorizer's cache refresh.
    backend::eventually("alice may list configmaps", WAIT, || async {
        cms.list(&ListParams::default()).await.ok()
    })
    .await;
    assert_eq!(
        status(cms.get("nothere").await),
        json!({"status": "Failure", "code": 404, "reason": "NotFound",
               "message": "configmaps \"nothere\" not found",
               "details": {"name": "nothere", "kind": "configmaps"}}),
        "allowed to get, so not found"
    );
    assert_eq!(
        status(
            cms.create(&PostParams::default(), &from(json!({"metadata": {"name": "x"}})))
                .await
        ),
        json!({"status": "Failure", "code": 403, "reason": "Forbidden",
               "message": "configmaps is forbidden: User \"alice\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"conf\"",
               "details": {"kind": "configmaps"}})
    );
    let deployments: Api<Deployment> = Api::namespaced(alice.clone(), NS);
    assert_eq!(
        status(deployments.get("web").await),
        json!({"status": "Failure", "code": 403, "reason": "Forbidden",
               "message": "deployments.apps \"web\" is forbidden: User \"alice\" cannot get resource \"deployments\" in API group \"apps\" in the namespace \"conf\"",
               "details": {"name": "web", "group": "apps", "kind": "deployments"}})
    );
    let namespaces: Api<Namespace> = Api::all(alice.clone());
    assert_eq!(
        status(namespaces.list(&ListParams::default()).await)["message"],
        "namespaces is forbidden: User \"alice\" cannot list resource \"namespaces\" in API group \"\" at the cluster scope"
    );
    let bob: Api<ConfigMap> = Api::namespaced(b.client_as("bob", &[]).await, NS);
    assert_eq!(
        status(bob.list(&ListParams::default()).await)["message"],
        "configmaps is forbidden: User \"bob\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"conf\""
    );

    if backend::kubectl_available() {
        let no = b
            .kubectl(&["-n", NS, "--as", "alice", "auth", "can-i", "create", "configmaps"])
            .await;
        assert_eq!((no.ok, no.stdout.trim()), (false, "no"), "{no:?}");
        let yes = b
            .kubectl(&["-n", NS, "--as", "alice", "auth", "can-i", "list", "configmaps"])
            .await;
        assert_eq!((yes.ok, yes.stdout.trim()), (true, "yes"), "{yes:?}");
        let denied = b
            .kubectl(&["-n", NS, "--as", "alice", "get", "deployment", "web"])
            .await;
        assert!(!denied.ok);
        assert_eq!(
            denied.stderr.trim(),
            "Error from server (Forbidden): deployments.apps \"web\" is forbidden: User \"alice\" cannot get resource \"deployments\" in API group \"apps\" in the namespace \"conf\""
        );
    }
}

// === Validation and defaulting ===

differential!(
    validation_rejects_what_kubernetes_rejects,
    validation,
    namespaces = [NS]
);

async fn validation(b: &Backend) {
    let admin = b.client().await;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    let mut bad = deployment("bad", 1, &json!({}));
    bad.spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap()
        .containers[0]
        .ports
        .as_mut()
        .unwrap()[0]
        .container_port = 70000;
    assert_eq!(
        status(deployments.create(&PostParams::default(), &bad).await),
        json!({"status": "Failure", "code": 422, "reason": "Invalid",
               "message": "Deployment.apps \"bad\" is invalid: spec.template.spec.containers[0].ports[0].containerPort: Invalid value: 70000: must be between 1 and 65535, inclusive",
               "details": {"name": "bad", "group": "apps", "kind": "Deployment", "causes": [{
                   "reason": "FieldValueInvalid",
                   "message": "Invalid value: 70000: must be between 1 and 65535, inclusive",
                   "field": "spec.template.spec.containers[0].ports[0].containerPort"}]}})
    );

    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), NS);
    let err = status(
        cms.create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "Bad_Name"}})),
        )
        .await,
    );
    assert_eq!(
        (err["code"].as_u64(), err["reason"].as_str()),
        (Some(422), Some("Invalid"))
    );
    assert!(
        err["message"].as_str().unwrap().starts_with(
            "ConfigMap \"Bad_Name\" is invalid: metadata.name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ),
        "{err}"
    );
    let err = status(
        cms.create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "lbl", "labels": {"bad key!": "v"}}})),
        )
        .await,
    );
    assert_eq!(
        (err["code"].as_u64(), err["reason"].as_str()),
        (Some(422), Some("Invalid"))
    );
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .starts_with("ConfigMap \"lbl\" is invalid: metadata.labels: Invalid value: \"bad key!\": name part must consist of alphanumeric characters"),
        "{err}"
    );

    // Immutable fields stay as they are.
    deployments
        .create(&PostParams::default(), &deployment("good", 0, &json!({})))
        .await
        .unwrap();
    let err = status(
        deployments
            .patch(
                "good",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"selector": {"matchLabels": {"app": "other"}},
                                              "template": {"metadata": {"labels": {"app": "other"}}}}})),
            )
            .await,
    );
    assert_eq!(err["code"], 422);
    assert_eq!(
        err["message"],
        "Deployment.apps \"good\" is invalid: spec.selector: Invalid value: {\"matchLabels\":{\"app\":\"other\"}}: field is immutable"
    );
}

differential!(
    containers_config_keys_and_service_ports_are_validated,
    more_validation,
    namespaces = [NS]
);

async fn more_validation(b: &Backend) {
    let admin = b.client().await;
    let post = |path: &str, body: Value| {
        http::Request::post(format!("{path}?dryRun=All"))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    let deployment = json!({
        "metadata": {"name": "v"},
        "spec": {
            "replicas": -1,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [
                {"name": "Bad_Name"},
                {"name": "ok", "image": "i"},
                {"name": "ok", "image": "i"},
            ]}},
        },
    });
    let err = status(
        admin
            .request::<Value>(post(
                &format!("/apis/apps/v1/namespaces/{NS}/deployments"),
                deployment,
            ))
            .await,
    );
    assert_eq!(
        err["message"],
        "Deployment.apps \"v\" is invalid: [spec.replicas: Invalid value: -1: must be greater than or equal to 0, spec.template.spec.containers[0].name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?'), spec.template.spec.containers[0].image: Required value, spec.template.spec.containers[2].name: Duplicate value: \"ok\"]"
    );
    let reasons: Vec<&str> = err["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        [
            "FieldValueInvalid",
            "FieldValueInvalid",
            "FieldValueRequired",
            "FieldValueDuplicate"
        ]
    );
    let err = status(
        admin
            .request::<Value>(post(
                &format!("/api/v1/namespaces/{NS}/configmaps"),
                json!({"metadata": {"name": "k"}, "data": {"bad key": "1", "good.key_1": "2"}}),
            ))
            .await,
    );
    assert_eq!(
        err["message"],
        "ConfigMap \"k\" is invalid: data[bad key]: Invalid value: \"bad key\": a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
    );
    let err = status(
        admin
            .request::<Value>(post(
                &format!("/api/v1/namespaces/{NS}/pods"),
                json!({"metadata": {"name": "q"}, "spec": {"containers": [
                    {"name": "c", "image": "i", "resources": {"limits": {"cpu": "lots"}}},
                ]}}),
            ))
            .await,
    );
    assert_eq!(
        (err["code"].as_u64(), err["message"].as_str()),
        (
            Some(400),
            Some(
                "Pod in version \"v1\" cannot be handled as a Pod: quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
            )
        )
    );
    let err = status(
        admin
            .request::<Value>(post(
                &format!("/api/v1/namespaces/{NS}/services"),
                json!({"metadata": {"name": "s"}, "spec": {"ports": [{"port": 70000}], "selector": {"a": "b"}}}),
            ))
            .await,
    );
    assert_eq!(
        err["message"],
        "Service \"s\" is invalid: [spec.ports[0].port: Invalid value: 70000: must be between 1 and 65535, inclusive, spec.ports[0].targetPort: Invalid value: 70000: must be between 1 and 65535, inclusive]"
    );
}

differential!(
    unknown_fields_are_refused_under_strict_validation_and_dropped_otherwise,
    strict_field_validation,
    namespaces = [NS]
);

async fn strict_field_validation(b: &Backend) {
    let admin = b.client().await;
    // Unknown fields: refused under Strict field validation, dropped otherwise.
    let mut with_unknown = serde_json::to_value(deployment("unknown", 0, &json!({}))).unwrap();
    with_unknown["spec"]["template"]["spec"]["containers"][0]["bogus"] = json!(1);
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        admin.clone(),
        NS,
        &kube::api::ApiResource::erase::<Deployment>(&()),
    );
    let path = format!("/apis/apps/v1/namespaces/{NS}/deployments");
    let post = |query: &str| {
        http::Request::post(format!("{path}{query}"))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&with_unknown).unwrap())
            .unwrap()
    };
    let err = status(admin.request::<Value>(post("?fieldValidation=Strict")).await);
    assert_eq!(
        (err["code"].as_u64(), err["reason"].as_str()),
        (Some(400), Some("BadRequest"))
    );
    assert_eq!(
        err["message"],
        "Deployment in version \"v1\" cannot be handled as a Deployment: strict decoding error: unknown field \"spec.template.spec.containers[0].bogus\""
    );
    let stored = raw
        .create(&PostParams::default(), &from(with_unknown.clone()))
        .await
        .unwrap();
    assert!(
        stored.data["spec"]["template"]["spec"]["containers"][0]
            .get("bogus")
            .is_none()
    );

    // The default (Warn) names each dropped field in a Warning header;
    // Ignore drops them silently.
    let warnings = |response: &http::Response<kube::client::Body>| -> Vec<String> {
        response
            .headers()
            .get_all("warning")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    };
    let cm_path = format!("/api/v1/namespaces/{NS}/configmaps");
    let post_cm = |query: &str, name: &str| {
        http::Request::post(format!("{cm_path}{query}"))
            .header("content-type", "application/json")
            .body(
                serde_json::to_vec(
                    &json!({"metadata": {"name": name, "bogus": 1}, "data": {"a": "1"}, "top": 2}),
                )
                .unwrap(),
            )
            .unwrap()
    };
    let response = admin.send(post_cm("", "warned").map(Into::into)).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        warnings(&response),
        [
            "299 - \"unknown field \\\"metadata.bogus\\\"\"",
            "299 - \"unknown field \\\"top\\\"\""
        ]
    );
    let response = admin
        .send(post_cm("?fieldValidation=Ignore", "ignored").map(Into::into))
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert!(warnings(&response).is_empty());
    let err = status(
        admin
            .request::<Value>(post_cm("?fieldValidation=Strict", "strict"))
            .await,
    );
    assert_eq!(
        err["message"],
        "ConfigMap in version \"v1\" cannot be handled as a ConfigMap: strict decoding error: unknown field \"metadata.bogus\", unknown field \"top\""
    );
    let err = status(
        admin
            .request::<Value>(post_cm("?fieldValidation=Nope", "nope"))
            .await,
    );
    assert_eq!(
        (err["code"].as_u64(), err["message"].as_str()),
        (
            Some(422),
            Some(
                "CreateOptions.meta.k8s.io \"\" is invalid: fieldValidation: Unsupported value: \"Nope\": supported values: \"\", \"Ignore\", \"Strict\", \"Warn\""
            )
        )
    );
    // A member given twice: reported in document order with unknown ones;
    // the last value is kept.
    let duplicated = |query: &str| {
        http::Request::post(format!("{cm_path}{query}"))
            .header("content-type", "application/json")
            .body(br#"{"metadata":{"name":"dup","name":"dup"},"zz":1,"data":{"a":"1","a":"2"}}"#.to_vec())
            .unwrap()
    };
    let err = status(
        admin
            .request::<Value>(duplicated("?fieldValidation=Strict"))
            .await,
    );
    assert_eq!(
        err["message"],
        "ConfigMap in version \"v1\" cannot be handled as a ConfigMap: strict decoding error: duplicate field \"metadata.name\", unknown field \"zz\", duplicate field \"data.a\""
    );
    let response = admin.send(duplicated("").map(Into::into)).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(
        warnings(&response),
        [
            "299 - \"duplicate field \\\"metadata.name\\\"\"",
            "299 - \"unknown field \\\"zz\\\"\"",
            "299 - \"duplicate field \\\"data.a\\\"\"",
        ]
    );
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), NS);
    assert_eq!(cms.get("dup").await.unwrap().data.unwrap()["a"], "2");
    // Updates and patches are checked the same way.
    let mut current = serde_json::to_value(cms.get("warned").await.unwrap()).unwrap();
    current["bogus"] = json!(1);
    let put = http::Request::put(format!("{cm_path}/warned?fieldValidation=Strict"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&current).unwrap())
        .unwrap();
    let err = status(admin.request::<Value>(put).await);
    assert_eq!(
        err["message"],
        "ConfigMap in version \"v1\" cannot be handled as a ConfigMap: strict decoding error: unknown field \"bogus\""
    );
    let patch = |query: &str| {
        http::Request::patch(format!("{cm_path}/warned{query}"))
            .header("content-type", "application/merge-patch+json")
            .body(br#"{"bogus": 1, "data": {"b": "2"}}"#.to_vec())
            .unwrap()
    };
    let err = status(admin.request::<Value>(patch("?fieldValidation=Strict")).await);
    assert_eq!(err["code"], 422);
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .ends_with("strict decoding error: unknown field \"bogus\""),
        "{err}"
    );
    let response = admin.send(patch("").map(Into::into)).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(warnings(&response), ["299 - \"unknown field \\\"bogus\\\"\""]);
    let patched = cms.get("warned").await.unwrap();
    assert_eq!(patched.data.unwrap()["b"], "2");
}

differential!(
    defaulting_fills_what_kubernetes_fills,
    defaulting,
    namespaces = [NS]
);

async fn defaulting(b: &Backend) {
    let deployments: Api<Deployment> = Api::namespaced(b.client().await, NS);
    let minimal: Deployment = from(json!({
        "metadata": {"name": "minimal"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "minimal"}},
            "template": {"metadata": {"labels": {"app": "minimal"}},
                         "spec": {"containers": [{"name": "c", "image": "skipper"}]}},
        },
    }));
    let created = serde_json::to_value(
        deployments
            .create(&PostParams::default(), &minimal)
            .await
            .unwrap(),
    )
    .unwrap();
    let spec = &created["spec"];
    assert_eq!(
        spec["strategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}})
    );
    assert_eq!(spec["revisionHistoryLimit"], 10);
    assert_eq!(spec["progressDeadlineSeconds"], 600);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["restartPolicy"], "Always");
    assert_eq!(pod["terminationGracePeriodSeconds"], 30);
    assert_eq!(pod["dnsPolicy"], "ClusterFirst");
    assert_eq!(pod["schedulerName"], "default-scheduler");
    assert_eq!(pod["securityContext"], json!({}));
    let c = &pod["containers"][0];
    assert_eq!(c["terminationMessagePath"], "/dev/termination-log");
    assert_eq!(c["terminationMessagePolicy"], "File");
    assert_eq!(
        c["imagePullPolicy"], "Always",
        "an image without a tag is pulled always"
    );
    assert_eq!(c["resources"], json!({}));
    assert_eq!(created["metadata"]["generation"], 1);
}

// === Secrets: stringData on every write ===

differential!(
    secret_string_data_is_folded_into_data_on_every_write,
    secret_string_data,
    namespaces = [NS]
);

async fn secret_string_data(b: &Backend) {
    use base64::Engine as _;
    let secrets: Api<Secret> = Api::namespaced(b.client().await, NS);
    let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
    let data = |s: &Secret| -> Value {
        let v = serde_json::to_value(s).unwrap();
        assert!(v.get("stringData").is_none(), "stringData is never stored: {v}");
        v["data"].clone()
    };
    let created = secrets
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "sd"},
                         "data": {"a": b64("old"), "b": b64("kept")},
                         "stringData": {"c": "created"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        data(&created),
        json!({"a": b64("old"), "b": b64("kept"), "c": b64("created")})
    );
    // A merge patch of stringData replaces that key of data (a key rotation
    // written as `kubectl patch secret --type merge -p '{"stringData":...}'`).
    let patched = secrets
        .patch(
            "sd",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"a": "new"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        data(&patched),
        json!({"a": b64("new"), "b": b64("kept"), "c": b64("created")})
    );
    assert_eq!(data(&secrets.get("sd").await.unwrap()), data(&patched));
    // An update: stringData wins over data for the same key.
    let mut v = serde_json::to_value(&patched).unwrap();
    v["data"] = json!({"a": b64("from data")});
    v["stringData"] = json!({"a": "from stringData", "d": "updated"});
    let updated = secrets
        .replace("sd", &PostParams::default(), &from(v))
        .await
        .unwrap();
    assert_eq!(
        data(&updated),
        json!({"a": b64("from stringData"), "d": b64("updated")})
    );
}

// === kubectl create ===

differential!(imperative_kubectl_create, kubectl_create, namespaces = []);

async fn kubectl_create(b: &Backend) {
    if !backend::kubectl_available() {
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    for (args, said) in [
        (
            vec!["create", "namespace", "imperative"],
            "namespace/imperative created",
        ),
        (
            vec![
                "-n",
                "imperative",
                "create",
                "configmap",
                "settings",
                "--from-literal=SKIPPER_X=1",
            ],
            "configmap/settings created",
        ),
        (
            vec![
                "-n",
                "imperative",
                "create",
                "secret",
                "generic",
                "creds",
                "--from-literal=token=s3cret",
            ],
            "secret/creds created",
        ),
        (
            vec![
                "-n",
                "imperative",
                "create",
                "deployment",
                "web",
                "--image=skipper",
                "--replicas=2",
                "--port=8888",
            ],
            "deployment.apps/web created",
        ),
    ] {
        let out = b.kubectl(&args).await;
        assert!(out.ok, "kubectl {args:?}: {out:?}");
        assert_eq!(out.stdout.trim(), said);
    }
    let client = b.client().await;
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "imperative")
        .get("settings")
        .await
        .unwrap();
    assert_eq!(cm.data.unwrap()["SKIPPER_X"], "1");
    let secret = Api::<Secret>::namespaced(client.clone(), "imperative")
        .get("creds")
        .await
        .unwrap();
    assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    assert_eq!(secret.data.unwrap()["token"].0, b"s3cret");
    let d = Api::<Deployment>::namespaced(client.clone(), "imperative")
        .get("web")
        .await
        .unwrap();
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(spec.selector.match_labels.unwrap()["app"], "web");
    let c = &spec.template.spec.unwrap().containers[0];
    assert_eq!(
        (c.name.as_str(), c.image.as_deref()),
        ("skipper", Some("skipper"))
    );
    assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8888);
    // A second create of the same name is refused the way kubectl shows it.
    let again = b
        .kubectl(&["-n", "imperative", "create", "configmap", "settings"])
        .await;
    assert!(!again.ok);
    assert_eq!(
        again.stderr.trim(),
        "error: failed to create configmap: configmaps \"settings\" already exists"
    );
}

// === Request bodies: protobuf, YAML, JSON ===

differential!(
    request_bodies_in_protobuf_yaml_and_json,
    request_bodies,
    namespaces = [NS]
);

/// A protobuf field of wire type 2 (length-delimited).
fn pb_field(tag: u8, bytes: &[u8]) -> Vec<u8> {
    assert!(bytes.len() < 128, "one-byte lengths only");
    let mut out = vec![tag << 3 | 2, u8::try_from(bytes.len()).unwrap()];
    out.extend_from_slice(bytes);
    out
}

/// `k8s\0` + runtime.Unknown{typeMeta{apiVersion, kind}, raw} around a
/// ConfigMap named `name` with data `a: 1`.
fn pb_configmap(api_version: &str, kind: &str, name: &str) -> Vec<u8> {
    let meta = pb_field(1, name.as_bytes());
    let entry = [pb_field(1, b"a"), pb_field(2, b"1")].concat();
    let raw = [pb_field(1, &meta), pb_field(2, &entry)].concat();
    let type_meta = [pb_field(1, api_version.as_bytes()), pb_field(2, kind.as_bytes())].concat();
    [b"k8s\0".to_vec(), pb_field(1, &type_meta), pb_field(2, &raw)].concat()
}

async fn request_bodies(b: &Backend) {
    let client = b.client().await;
    let post = |resource: &str, content_type: &str, body: Vec<u8>| {
        http::Request::post(format!("/api/v1/namespaces/{NS}/{resource}"))
            .header("content-type", content_type)
            .body(body)
            .unwrap()
    };
    const PB: &str = "application/vnd.kubernetes.protobuf";
    let created = client
        .request::<Value>(post("configmaps", PB, pb_configmap("v1", "ConfigMap", "pb")))
        .await
        .unwrap();
    assert_eq!(
        (&created["kind"], &created["metadata"]["name"], &created["data"]),
        (&json!("ConfigMap"), &json!("pb"), &json!({"a": "1"}))
    );
    // An envelope without a kind holds the kind of the URL.
    let created = client
        .request::<Value>(post("configmaps", PB, pb_configmap("", "", "pb-kindless")))
        .await
        .unwrap();
    assert_eq!(created["kind"], "ConfigMap");
    let refused = [
        (
            post("configmaps", PB, pb_configmap("example.com/v1", "Widget", "w")),
            400,
            "Widget in version \"v1\" cannot be handled as a ConfigMap: no kind \"Widget\" is registered for version \"example.com/v1\" in scheme \"pkg/runtime/scheme.go:111\"",
        ),
        (
            post("secrets", PB, pb_configmap("v1", "ConfigMap", "c")),
            400,
            "ConfigMap in version \"v1\" cannot be handled as a Secret: converting (v1.ConfigMap) to (core.Secret): unknown conversion",
        ),
        (
            post(
                "secrets",
                "application/json",
                br#"{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"c"}}"#.to_vec(),
            ),
            400,
            "ConfigMap in version \"v1\" cannot be handled as a Secret: converting (v1.ConfigMap) to (core.Secret): unknown conversion",
        ),
        (
            post("configmaps", PB, br#"{"x":1}"#.to_vec()),
            400,
            "the object provided is unrecognized (must be of type ConfigMap): provided data does not appear to be a protobuf message, expected prefix [107 56 115 0] ({\"x\":1})",
        ),
        (
            post(
                "configmaps",
                "text/plain",
                br#"{"metadata":{"name":"t"}}"#.to_vec(),
            ),
            415,
            "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/vnd.kubernetes.protobuf",
        ),
    ];
    for (request, code, message) in refused {
        let err = status(client.request::<Value>(request).await);
        assert_eq!(
            (err["code"].as_u64(), err["message"].as_str()),
            (Some(code), Some(message))
        );
    }
    let yaml = client
        .request::<Value>(post(
            "configmaps",
            "application/yaml",
            b"metadata:\n  name: from-yaml\ndata:\n  a: \"1\"\n".to_vec(),
        ))
        .await
        .unwrap();
    assert_eq!(yaml["data"], json!({"a": "1"}));

    if !backend::kubectl_available() {
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    // kubectl's typed clients send protobuf for every kind below.
    for (args, said) in [
        (
            vec!["create", "serviceaccount", "robot"],
            "serviceaccount/robot created",
        ),
        (
            vec![
                "create",
                "role",
                "reader",
                "--verb=get,list",
                "--resource=configmaps",
            ],
            "role.rbac.authorization.k8s.io/reader created",
        ),
        (
            vec![
                "create",
                "rolebinding",
                "reader",
                "--role=reader",
                &format!("--serviceaccount={NS}:robot"),
            ],
            "rolebinding.rbac.authorization.k8s.io/reader created",
        ),
        (
            vec![
                "create",
                "clusterrole",
                "node-reader",
                "--verb=get",
                "--resource=nodes",
            ],
            "clusterrole.rbac.authorization.k8s.io/node-reader created",
        ),
        (
            vec![
                "create",
                "clusterrolebinding",
                "node-reader",
                "--clusterrole=node-reader",
                "--user=bob",
            ],
            "clusterrolebinding.rbac.authorization.k8s.io/node-reader created",
        ),
        (
            vec!["create", "service", "clusterip", "web", "--tcp=80:8080"],
            "service/web created",
        ),
    ] {
        let mut full = vec!["-n", NS];
        full.extend(args.iter().copied());
        let out = b.kubectl(&full).await;
        assert!(out.ok, "kubectl {full:?}: {out:?}");
        assert_eq!(out.stdout.trim(), said);
    }
    let svc: Value = client
        .request(
            http::Request::get(format!("/api/v1/namespaces/{NS}/services/web"))
                .body(vec![])
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        svc["spec"]["ports"],
        json!([{"name": "80-8080", "protocol": "TCP", "port": 80, "targetPort": 8080}])
    );
    assert_eq!(svc["spec"]["selector"], json!({"app": "web"}));
    let role: Value = client
        .request(
            http::Request::get(format!(
                "/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/reader"
            ))
            .body(vec![])
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}])
    );
    // TokenRequest, SelfSubjectAccessReview and SelfSubjectReview in protobuf.
    let token = b.kubectl(&["-n", NS, "create", "token", "robot"]).await;
    assert!(
        token.ok && token.stdout.trim().split('.').count() == 3,
        "{token:?}"
    );
    let robot = format!("system:serviceaccount:{NS}:robot");
    for (verb, resource, answer) in [("list", "configmaps", "yes"), ("delete", "configmaps", "no")] {
        let out = b
            .kubectl(&["-n", NS, "--as", &robot, "auth", "can-i", verb, resource])
            .await;
        assert_eq!(out.stdout.trim(), answer, "can-i {verb} {resource}: {out:?}");
    }
    backend::eventually("bob may get nodes", WAIT, || async {
        let out = b.kubectl(&["--as", "bob", "auth", "can-i", "get", "nodes"]).await;
        (out.stdout.trim() == "yes").then_some(())
    })
    .await;
    let whoami = b
        .kubectl(&[
            "--as",
            &robot,
            "auth",
            "whoami",
            "-o",
            "jsonpath={.status.userInfo.username}",
        ])
        .await;
    assert_eq!(whoami.stdout.trim(), robot, "{whoami:?}");
}

// === Field selectors ===

differential!(
    field_selectors_filter_and_unknown_fields_are_refused,
    field_selectors,
    namespaces = [NS]
);

async fn field_selectors(b: &Backend) {
    let client = b.client().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    for name in ["a", "b"] {
        cms.create(&PostParams::default(), &from(json!({"metadata": {"name": name}})))
            .await
            .unwrap();
    }
    let only_a = cms
        .list(&ListParams::default().fields("metadata.name=a"))
        .await
        .unwrap();
    assert_eq!(
        only_a
            .items
            .iter()
            .filter_map(|c| c.metadata.name.as_deref())
            .collect::<Vec<_>>(),
        ["a"]
    );
    let not_a = cms
        .list(&ListParams::default().fields("metadata.name!=a,metadata.name!=kube-root-ca.crt"))
        .await
        .unwrap();
    assert_eq!(
        not_a
            .items
            .iter()
            .filter_map(|c| c.metadata.name.as_deref())
            .collect::<Vec<_>>(),
        ["b"]
    );
    assert_eq!(
        status(cms.list(&ListParams::default().fields("spec.foo=bar")).await),
        json!({"status": "Failure", "code": 400, "reason": "BadRequest",
               "message": "\"spec.foo\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""})
    );
    let pods: Api<Pod> = Api::namespaced(client, NS);
    assert_eq!(
        status(pods.list(&ListParams::default().fields("spec.foo=bar")).await),
        json!({"status": "Failure", "code": 400, "reason": "BadRequest", "message": "field label not supported: spec.foo"})
    );
    pods.list(&ListParams::default().fields("spec.nodeName=nowhere,status.phase=Running"))
        .await
        .unwrap();
}

// === List and watch ===

differential!(list_and_watch_resource_versions, list_watch, namespaces = [NS]);

async fn list_watch(b: &Backend) {
    use futures::{StreamExt as _, TryStreamExt as _};
    let cms: Api<ConfigMap> = Api::namespaced(b.client().await, NS);
    let first = cms
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "first", "labels": {"t": "lw"}}})),
        )
        .await
        .unwrap();
    let mine = ListParams::default().labels("t=lw");
    let list = cms.list(&mine).await.unwrap();
    let list_rv = list.metadata.resource_version.clone().unwrap();
    let rv = |c: &ConfigMap| {
        c.metadata
            .resource_version
            .clone()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert!(list_rv.parse::<u64>().unwrap() >= rv(&first));

    // A watch from the list's version sees only what happened after it.
    let mut events = cms
        .watch(&WatchParams::default().labels("t=lw").timeout(30), &list_rv)
        .await
        .unwrap()
        .boxed();
    let second = cms
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "second", "labels": {"t": "lw"}}})),
        )
        .await
        .unwrap();
    assert!(rv(&second) > rv(&first), "resourceVersions grow");
    match tokio::time::timeout(WAIT, events.try_next())
        .await
        .unwrap()
        .unwrap()
    {
        Some(WatchEvent::Added(c)) => assert_eq!(c.metadata.name.as_deref(), Some("second")),
        other => panic!("expected ADDED second, got {other:?}"),
    }

    // An update with a stale resourceVersion conflicts.
    let mut stale = first.clone();
    patch(&cms, "first", Patch::Merge(json!({"data": {"k": "v"}}))).await;
    stale.data = Some([("k".to_owned(), "w".to_owned())].into());
    assert_eq!(
        status(cms.replace("first", &PostParams::default(), &stale).await),
        json!({"status": "Failure", "code": 409, "reason": "Conflict",
               "message": "Operation cannot be fulfilled on configmaps \"first\": the object has been modified; please apply your changes to the latest version and try again",
               "details": {"name": "first", "kind": "configmaps"}})
    );

    // Paging: a limit gives a continue token and the rest on the next page.
    cms.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "third", "labels": {"t": "lw"}}})),
    )
    .await
    .unwrap();
    let page = cms.list(&mine.clone().limit(1)).await.unwrap();
    assert_eq!(page.items.len(), 1);
    let token = page.metadata.continue_.clone().unwrap();
    // A list with a label selector does not count what remains.
    assert_eq!(page.metadata.remaining_item_count, None);
    let rest = cms
        .list(&mine.clone().limit(5).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(rest.items.len(), 2);
    assert!(rest.metadata.continue_.as_deref().unwrap_or("").is_empty());
}

// === Events ===

differential!(controllers_record_events, events, namespaces = [NS]);

async fn events(b: &Backend) {
    let client = b.client().await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &deployment("evented", 1, &json!({})))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let (scaled, created) =
        backend::eventually("ScalingReplicaSet and SuccessfulCreate events", WAIT, || async {
            let list = events.list(&ListParams::default()).await.ok()?;
            let find = |reason: &str| {
                list.items
                    .iter()
                    .find(|e| e.reason.as_deref() == Some(reason))
                    .cloned()
            };
            Some((find("ScalingReplicaSet")?, find("SuccessfulCreate")?))
        })
        .await;
    let rs = Api::<ReplicaSet>::namespaced(client, NS)
        .list(&ListParams::default().labels("app=evented"))
        .await
        .unwrap()
        .items
        .remove(0);
    let rs_name = rs.metadata.name.unwrap();
    assert_eq!(scaled.involved_object.kind.as_deref(), Some("Deployment"));
    assert_eq!(scaled.involved_object.name.as_deref(), Some("evented"));
    assert_eq!(scaled.type_.as_deref(), Some("Normal"));
    assert_eq!(
        scaled.message.as_deref(),
        Some(format!("Scaled up replica set {rs_name} from 0 to 1").as_str())
    );
    assert_eq!(
        scaled.source.and_then(|s| s.component).as_deref(),
        Some("deployment-controller")
    );
    assert_eq!(created.involved_object.kind.as_deref(), Some("ReplicaSet"));
    assert_eq!(created.involved_object.name.as_deref(), Some(rs_name.as_str()));
    assert!(created.message.unwrap().starts_with("Created pod: evented-"));
    // kubectl shows them.
    if backend::kubectl_available() {
        let out = b
            .kubectl(&["-n", NS, "get", "events", "-o", "jsonpath={.items[*].reason}"])
            .await;
        assert!(out.stdout.contains("ScalingReplicaSet"), "{out:?}");
    }
}

// === Finalizers and cascading deletion ===

differential!(
    finalizers_hold_deletion_until_removed,
    finalizers,
    namespaces = [NS]
);

async fn finalizers(b: &Backend) {
    let cms: Api<ConfigMap> = Api::namespaced(b.client().await, NS);
    cms.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "held", "finalizers": ["example.com/hold"]}})),
    )
    .await
    .unwrap();
    let deleted = cms.delete("held", &DeleteParams::default()).await.unwrap();
    let held = deleted.left().expect("the object stays while a finalizer is set");
    assert!(held.metadata.deletion_timestamp.is_some());
    let still = cms.get("held").await.unwrap();
    assert!(still.metadata.deletion_timestamp.is_some());
    assert_eq!(
        still.metadata.finalizers.as_deref(),
        Some(&["example.com/hold".to_owned()][..])
    );
    // Adding a finalizer to an object being deleted is refused.
    let err = status(
        cms.patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold", "example.com/more"]}})),
        )
        .await,
    );
    assert_eq!(err["code"], 422, "{err}");
    assert_eq!(
        err["message"],
        "ConfigMap \"held\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{\"example.com/more\"}",
        "{err}"
    );
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    backend::eventually("the configmap to be gone", WAIT, || async {
        matches!(cms.get_opt("held").await, Ok(None)).then_some(())
    })
    .await;
}

differential!(
    cascading_deletion_follows_the_propagation_policy,
    cascading_deletion,
    namespaces = [NS]
);

async fn cascading_deletion(b: &Backend) {
    let client = b.client().await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let owned = |name: &'static str| {
        let replicasets = replicasets.clone();
        let pods = pods.clone();
        async move {
            let rs = replicasets
                .list(&ListParams::default().labels(&format!("app={name}")))
                .await
                .unwrap()
                .items;
            let p = pods
                .list(&ListParams::default().labels(&format!("app={name}")))
                .await
                .unwrap()
                .items;
            (rs, p)
        }
    };

    // Orphan: the ReplicaSet stays, without its owner reference.
    deployments
        .create(&PostParams::default(), &deployment("orphaned", 1, &json!({})))
        .await
        .unwrap();
    backend::eventually("orphaned's replicaset and pod", WAIT, || async {
        let (rs, p) = owned("orphaned").await;
        (rs.len() == 1 && p.len() == 1).then_some(())
    })
    .await;
    deployments
        .delete("orphaned", &DeleteParams::orphan())
        .await
        .unwrap();
    backend::eventually("the deployment gone, its replicaset orphaned", WAIT, || async {
        if deployments.get_opt("orphaned").await.unwrap().is_some() {
            return None;
        }
        let (rs, _) = owned("orphaned").await;
        (rs.len() == 1 && rs[0].metadata.owner_references.as_ref().is_none_or(Vec::is_empty)).then_some(())
    })
    .await;

    // Foreground: the deployment waits, marked, until what it owns is gone.
    deployments
        .create(&PostParams::default(), &deployment("foreground", 1, &json!({})))
        .await
        .unwrap();
    backend::eventually("foreground's replicaset and pod", WAIT, || async {
        let (rs, p) = owned("foreground").await;
        (rs.len() == 1 && p.len() == 1).then_some(())
    })
    .await;
    let answer = deployments
        .delete("foreground", &DeleteParams::foreground())
        .await
        .unwrap();
    let marked = answer
        .left()
        .expect("foreground deletion answers with the object");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert_eq!(
        marked.metadata.finalizers.as_deref(),
        Some(&["foregroundDeletion".to_owned()][..])
    );
    backend::eventually("foreground and everything it owned gone", WAIT, || async {
        let (rs, p) = owned("foreground").await;
        (deployments.get_opt("foreground").await.unwrap().is_none() && rs.is_empty() && p.is_empty())
            .then_some(())
    })
    .await;

    // Background (the default): the deployment goes at once, the garbage
    // collector removes the rest.
    deployments
        .create(&PostParams::default(), &deployment("background", 1, &json!({})))
        .await
        .unwrap();
    backend::eventually("background's replicaset and pod", WAIT, || async {
        let (rs, p) = owned("background").await;
        (rs.len() == 1 && p.len() == 1).then_some(())
    })
    .await;
    deployments
        .delete("background", &DeleteParams::background())
        .await
        .unwrap();
    backend::eventually("background's replicaset and pods collected", WAIT, || async {
        let (rs, p) = owned("background").await;
        (rs.is_empty() && p.is_empty()).then_some(())
    })
    .await;
}

differential!(
    the_garbage_collector_follows_owner_references_of_any_kind,
    garbage_collection_of_any_kind,
    namespaces = [NS]
);

/// ConfigMaps owned by a ConfigMap: when the owner goes, a dependent with no
/// other owner is collected, one with another owner loses the dangling
/// reference and stays.
async fn garbage_collection_of_any_kind(b: &Backend) {
    let cms: Api<ConfigMap> = Api::namespaced(b.client().await, NS);
    let mut owners = Vec::new();
    for name in ["owner", "other-owner"] {
        let cm = cms
            .create(&PostParams::default(), &from(json!({"metadata": {"name": name}})))
            .await
            .unwrap();
        owners.push(json!({
            "apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": cm.metadata.uid.unwrap(),
        }));
    }
    cms.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "only-dependent", "ownerReferences": [owners[0]]}})),
    )
    .await
    .unwrap();
    cms.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "shared-dependent", "ownerReferences": owners}})),
    )
    .await
    .unwrap();
    cms.delete("owner", &DeleteParams::background()).await.unwrap();
    backend::eventually("the sole dependent collected", WAIT, || async {
        matches!(cms.get_opt("only-dependent").await, Ok(None)).then_some(())
    })
    .await;
    let shared = backend::eventually("the dangling reference removed", WAIT, || async {
        let cm = cms.get("shared-dependent").await.ok()?;
        (cm.metadata.owner_references.as_ref()?.len() == 1).then_some(cm)
    })
    .await;
    assert_eq!(shared.metadata.owner_references.unwrap()[0].name, "other-owner");
}

// === Namespace termination ===

differential!(
    a_terminating_namespace_refuses_new_content_and_waits_for_finalizers,
    namespace_termination,
    namespaces = ["doomed"]
);

async fn namespace_termination(b: &Backend) {
    let client = b.client().await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "doomed");
    cms.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "held", "finalizers": ["example.com/hold"]}})),
    )
    .await
    .unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    let ns = namespaces.get("doomed").await.unwrap();
    assert_eq!(ns.status.and_then(|s| s.phase).as_deref(), Some("Terminating"));
    assert_eq!(
        status(
            cms.create(
                &PostParams::default(),
                &from(json!({"metadata": {"name": "late"}}))
            )
            .await
        ),
        json!({"status": "Failure", "code": 403, "reason": "Forbidden",
               "message": "configmaps \"late\" is forbidden: unable to create new content in namespace doomed because it is being terminated",
               "details": {"name": "late", "kind": "configmaps",
                           "causes": [{"reason": "NamespaceTerminating",
                                       "message": "namespace doomed is being terminated",
                                       "field": "metadata.namespace"}]}})
    );
    let condition = backend::eventually("NamespaceFinalizersRemaining", WAIT, || async {
        let ns = namespaces.get("doomed").await.ok()?;
        ns.status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "NamespaceFinalizersRemaining" && c.status == "True")
    })
    .await;
    assert_eq!(
        condition.message.as_deref(),
        Some(
            "Some content in the namespace has finalizers remaining: example.com/hold in 1 resource instances"
        )
    );
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    backend::eventually("the namespace to be gone", WAIT, || async {
        matches!(namespaces.get_opt("doomed").await, Ok(None)).then_some(())
    })
    .await;
}

// === Rolling updates ===

differential!(
    a_rolling_update_surges_by_max_surge_and_keeps_unready_old_pods,
    rolling_update_surge,
    namespaces = [NS]
);

/// With `maxSurge: 1, maxUnavailable: 0` and pods that never become Ready,
/// a template change adds one new pod and keeps every old one.
async fn rolling_update_surge(b: &Backend) {
    let client = b.client().await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    let strategy =
        json!({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}});
    deployments
        .create(&PostParams::default(), &deployment("rolling", 3, &strategy))
        .await
        .unwrap();
    backend::eventually("the first replicaset at 3", WAIT, || async {
        let rs = replicasets
            .list(&ListParams::default().labels("app=rolling"))
            .await
            .ok()?
            .items;
        (rs.len() == 1 && rs[0].status.as_ref()?.replicas == 3).then_some(())
    })
    .await;
    let template = json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}});
    patch(&deployments, "rolling", Patch::Merge(template)).await;
    let (old, new) = backend::eventually("a new replicaset at 1 beside the old at 3", WAIT, || async {
        let rs = replicasets
            .list(&ListParams::default().labels("app=rolling"))
            .await
            .ok()?
            .items;
        if rs.len() != 2 {
            return None;
        }
        let revision = |r: &ReplicaSet| {
            r.metadata
                .annotations
                .as_ref()?
                .get("deployment.kubernetes.io/revision")
                .cloned()
        };
        let old = rs.iter().find(|r| revision(r).as_deref() == Some("1"))?.clone();
        let new = rs.iter().find(|r| revision(r).as_deref() == Some("2"))?.clone();
        (new.status.as_ref()?.replicas == 1).then_some((old, new))
    })
    .await;
    assert_eq!(
        old.spec.unwrap().replicas,
        Some(3),
        "maxUnavailable 0 keeps every old pod"
    );
    assert_eq!(new.spec.unwrap().replicas, Some(1), "maxSurge 1 adds one pod");
    let d = backend::eventually("the deployment's status to count 4 pods", WAIT, || async {
        let d = deployments.get("rolling").await.ok()?;
        (d.status.as_ref()?.replicas == Some(4)).then_some(d)
    })
    .await;
    let s = d.status.unwrap();
    assert_eq!(s.updated_replicas, Some(1));
    assert_eq!(s.ready_replicas.unwrap_or(0), 0);
}

differential!(
    kubectl_rollout_pause_resume_undo_and_history,
    rollout_undo,
    namespaces = [NS]
);

/// `kubectl rollout pause` holds a template change back (the Deployment
/// reports `DeploymentPaused`), `resume` rolls it out, `undo` brings back the
/// first template: its ReplicaSet is the new one again, under revision 3
/// with 1 in its history, and `rollout history` lists revisions 2 and 3.
async fn rollout_undo(b: &Backend) {
    if !backend::kubectl_available() {
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    let client = b.client().await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let replicasets: Api<ReplicaSet> = Api::namespaced(client.clone(), NS);
    let strategy =
        json!({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}});
    deployments
        .create(&PostParams::default(), &deployment("undo", 2, &strategy))
        .await
        .unwrap();
    let annotation =
        |r: &ReplicaSet, key: &str| r.metadata.annotations.as_ref().and_then(|a| a.get(key).cloned());
    let first = backend::eventually("the first replicaset at 2", WAIT, || async {
        let rs = replicasets
            .list(&ListParams::default().labels("app=undo"))
            .await
            .ok()?
            .items;
        (rs.len() == 1 && rs[0].status.as_ref()?.replicas == 2).then(|| rs[0].clone())
    })
    .await;
    assert_eq!(
        annotation(&first, "deployment.kubernetes.io/revision").as_deref(),
        Some("1")
    );
    assert_eq!(
        annotation(&first, "deployment.kubernetes.io/desired-replicas").as_deref(),
        Some("2")
    );
    assert_eq!(
        annotation(&first, "deployment.kubernetes.io/max-replicas").as_deref(),
        Some("3")
    );
    let first_name = first.metadata.name.clone().unwrap();

    let out = b
        .kubectl(&["-n", NS, "rollout", "pause", "deployment/undo"])
        .await;
    assert!(out.ok, "{out:?}");
    let patched = deployments
        .patch(
            "undo",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}})),
        )
        .await
        .unwrap();
    let generation = patched.metadata.generation.unwrap();
    let paused = backend::eventually("the paused template change to be observed", WAIT, || async {
        let d = deployments.get("undo").await.ok()?;
        let status = d.status.as_ref()?;
        (status.observed_generation == Some(generation)).then(|| status.clone())
    })
    .await;
    let progressing = paused
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Progressing")
        .expect("a Progressing condition");
    assert_eq!(
        (progressing.status.as_str(), progressing.reason.as_deref()),
        ("Unknown", Some("DeploymentPaused"))
    );
    assert_eq!(
        replicasets
            .list(&ListParams::default().labels("app=undo"))
            .await
            .unwrap()
            .items
            .len(),
        1,
        "a paused deployment creates no replicaset"
    );

    let out = b
        .kubectl(&["-n", NS, "rollout", "resume", "deployment/undo"])
        .await;
    assert!(out.ok, "{out:?}");
    let second_name = backend::eventually("a second replicaset at 1 (revision 2)", WAIT, || async {
        let rs = replicasets
            .list(&ListParams::default().labels("app=undo"))
            .await
            .ok()?
            .items;
        let second = rs
            .iter()
            .find(|r| annotation(r, "deployment.kubernetes.io/revision").as_deref() == Some("2"))?;
        (rs.len() == 2 && second.status.as_ref()?.replicas == 1)
            .then(|| second.metadata.name.clone().unwrap())
    })
    .await;

    let out = b.kubectl(&["-n", NS, "rollout", "undo", "deployment/undo"]).await;
    assert!(out.ok, "{out:?}");
    assert!(out.stdout.contains("rolled back"), "{out:?}");
    let (revived, second) = backend::eventually("the first replicaset under revision 3", WAIT, || async {
        let rs = replicasets
            .list(&ListParams::default().labels("app=undo"))
            .await
            .ok()?
            .items;
        let revived = rs
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(first_name.as_str()))?;
        let second = rs
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(second_name.as_str()))?;
        (rs.len() == 2 && annotation(revived, "deployment.kubernetes.io/revision").as_deref() == Some("3"))
            .then(|| (revived.clone(), second.clone()))
    })
    .await;
    assert_eq!(
        annotation(&revived, "deployment.kubernetes.io/revision-history").as_deref(),
        Some("1")
    );
    assert_eq!(revived.spec.unwrap().replicas, Some(2));
    assert_eq!(
        second.spec.unwrap().replicas,
        Some(1),
        "maxUnavailable 0 keeps the unready revision-2 pod until revision 3 is available"
    );
    let d = backend::eventually("the deployment at revision 3", WAIT, || async {
        let d = deployments.get("undo").await.ok()?;
        (d.metadata
            .annotations
            .as_ref()?
            .get("deployment.kubernetes.io/revision")?
            == "3")
            .then_some(d)
    })
    .await;
    let template_annotations = d.spec.unwrap().template.metadata.unwrap().annotations;
    assert!(
        template_annotations.is_none_or(|a| !a.contains_key("rev")),
        "the undo restores the first template"
    );
    let out = b
        .kubectl(&["-n", NS, "rollout", "history", "deployment/undo"])
        .await;
    assert!(out.ok, "{out:?}");
    let revisions: Vec<&str> = out
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("REVISION"))
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(revisions, ["2", "3"], "{out:?}");
}

// === ServiceAccount tokens ===

differential!(
    service_account_tokens_authenticate_under_rbac,
    service_account_tokens,
    namespaces = [NS]
);

/// A TokenRequest token authenticates as `system:serviceaccount:<ns>:<name>`
/// (in `system:serviceaccounts` and `system:serviceaccounts:<ns>`), and RBAC
/// bindings to the ServiceAccount decide what it may do.
async fn service_account_tokens(b: &Backend) {
    let admin = b.client().await;
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin.clone(), NS)
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "robot"}})),
        )
        .await
        .unwrap();
    Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(admin.clone(), NS)
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "reader"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            })),
        )
        .await
        .unwrap();
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(admin.clone(), NS)
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "robot-reads"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "robot", "namespace": NS}],
            })),
        )
        .await
        .unwrap();
    let robot = b.service_account_client(NS, "robot").await;
    let cms: Api<ConfigMap> = Api::namespaced(robot.clone(), NS);
    backend::eventually("robot may list configmaps", WAIT, || async {
        cms.list(&ListParams::default()).await.ok()
    })
    .await;
    assert_eq!(
        status(
            cms.create(&PostParams::default(), &from(json!({"metadata": {"name": "x"}})))
                .await
        )["message"],
        "configmaps is forbidden: User \"system:serviceaccount:conf:robot\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"conf\""
    );
    // Who the token says it is.
    let review: Value = robot
        .request(
            http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
                .header("content-type", "application/json")
                .body(
                    serde_json::to_vec(
                        &json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}),
                    )
                    .unwrap(),
                )
                .unwrap(),
        )
        .await
        .unwrap();
    let user = &review["status"]["userInfo"];
    assert_eq!(user["username"], "system:serviceaccount:conf:robot");
    assert_eq!(
        user["groups"],
        json!([
            "system:serviceaccounts",
            "system:serviceaccounts:conf",
            "system:authenticated"
        ])
    );
    // A token for a ServiceAccount that does not exist is refused.
    let ghost = Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(admin, NS)
        .create_token_request(
            "ghost",
            &PostParams::default(),
            &from(json!({"spec": {"audiences": []}})),
        )
        .await;
    assert_eq!(status(ghost)["code"], 404);
}

// === Compaction ===

differential!(
    an_exact_list_at_a_compacted_resource_version_is_gone,
    compacted_list,
    namespaces = [NS]
);

/// After compaction, a list at an older resourceVersion with
/// `resourceVersionMatch=Exact` answers 410 Gone (kube-rs: `VersionMatch::Exact`),
/// while `NotOlderThan` and `resourceVersion=0` still serve current data.
async fn compacted_list(b: &Backend) {
    let cms: Api<ConfigMap> = Api::namespaced(b.client().await, NS);
    let first = cms
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "old"}})),
        )
        .await
        .unwrap();
    let old_rv = first.metadata.resource_version.unwrap();
    // Before compaction the exact list works.
    cms.list(
        &ListParams::default()
            .at(&old_rv)
            .matching(kube::api::VersionMatch::Exact),
    )
    .await
    .unwrap();
    for i in 0..3 {
        cms.patch(
            "old",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"i": i.to_string()}})),
        )
        .await
        .unwrap();
    }
    b.compact().await;
    // The real API server's watch cache learns of the compaction within its
    // 15 s poll; until then it still serves the old snapshot.
    let exact = ListParams::default()
        .at(&old_rv)
        .matching(kube::api::VersionMatch::Exact);
    let gone = backend::eventually("410 for the exact list", WAIT, || async {
        match cms.list(&exact).await {
            Err(e) => Some(status(Err::<(), _>(e))),
            Ok(_) => None,
        }
    })
    .await;
    assert_eq!(
        (gone["code"].as_u64(), gone["reason"].as_str()),
        (Some(410), Some("Expired")),
        "{gone}"
    );
    assert_eq!(
        gone["message"],
        "The resourceVersion for the provided list is too old."
    );
    let current = cms
        .list(
            &ListParams::default()
                .at(&old_rv)
                .matching(kube::api::VersionMatch::NotOlderThan),
        )
        .await
        .unwrap();
    let old = current
        .items
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("old"))
        .unwrap();
    assert_eq!(old.data.as_ref().unwrap()["i"], "2");
    cms.list(&ListParams::default().at("0")).await.unwrap();
}

// === Node authorization ===

differential!(
    a_node_may_only_touch_itself_and_its_pods,
    node_authorization,
    namespaces = [NS]
);

/// What a kubelet (`system:node:<name>` in `system:nodes`) may do under
/// `--authorization-mode=Node,RBAC` with NodeRestriction: its own Node and
/// Lease, pods only through a `spec.nodeName=<itself>` field selector.
async fn node_authorization(b: &Backend) {
    let node = b.client_as("system:node:n1", &["system:nodes"]).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(node.clone());
    nodes
        .create(&PostParams::default(), &from(json!({"metadata": {"name": "n1"}})))
        .await
        .unwrap();
    let err = status(
        nodes
            .create(&PostParams::default(), &from(json!({"metadata": {"name": "n2"}})))
            .await,
    );
    assert_eq!(
        (err["code"].as_u64(), err["reason"].as_str()),
        (Some(403), Some("Forbidden")),
        "{err}"
    );
    assert_eq!(
        err["message"],
        "nodes \"n2\" is forbidden: node \"n1\" is not allowed to modify node \"n2\""
    );
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(node.clone(), "kube-node-lease");
    leases
        .create(
            &PostParams::default(),
            &from(json!({"metadata": {"name": "n1"}, "spec": {"holderIdentity": "n1"}})),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::all(node.clone());
    pods.list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(
        status(pods.list(&ListParams::default()).await)["message"],
        "pods is forbidden: User \"system:node:n1\" cannot list resource \"pods\" in API group \"\" at the cluster scope: node: can only list/watch pods with spec.nodeName field selector"
    );
    assert_eq!(
        status(pods.list(&ListParams::default().fields("spec.nodeName=n2")).await)["code"],
        403
    );
    let cms: Api<ConfigMap> = Api::namespaced(node, NS);
    assert_eq!(
        status(cms.list(&ListParams::default()).await)["message"],
        "configmaps is forbidden: User \"system:node:n1\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"conf\": node: No Object name found"
    );
}

// === Endpoint addresses ===

differential!(
    endpoint_addresses_may_not_be_loopback,
    loopback_endpoints,
    namespaces = [NS],
    sim_deviation = "the simulator's pods live on loopback IPs, so it accepts loopback endpoint addresses"
);

/// EndpointSlices and Endpoints refuse loopback addresses (pod status
/// does not): a Service whose pods have loopback IPs gets no endpoints
/// from the real EndpointSlice controller.
async fn loopback_endpoints(b: &Backend) {
    let client = b.client().await;
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> = Api::namespaced(client.clone(), NS);
    let err = status(
        slices
            .create(
                &PostParams::default(),
                &from(json!({
                    "metadata": {"name": "lo", "labels": {"kubernetes.io/service-name": "lo"}},
                    "addressType": "IPv4",
                    "endpoints": [{"addresses": ["127.0.5.6"], "conditions": {"ready": true}}],
                    "ports": [{"name": "http", "port": 8888, "protocol": "TCP"}],
                })),
            )
            .await,
    );
    assert_eq!(err["code"], 422);
    assert_eq!(
        err["message"],
        "EndpointSlice.discovery.k8s.io \"lo\" is invalid: endpoints[0].addresses[0]: Invalid value: \"127.0.5.6\": may not be in the loopback range (127.0.0.0/8, ::1/128)"
    );
    let pods: Api<Pod> = Api::namespaced(client, NS);
    pods.create(
        &PostParams::default(),
        &from(json!({"metadata": {"name": "lo"},
                     "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "skipper"}]}})),
    )
    .await
    .unwrap();
    pods.patch_status(
        "lo",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"podIP": "127.0.5.6", "podIPs": [{"ip": "127.0.5.6"}]}})),
    )
    .await
    .unwrap();
}

// === kubectl tables ===

differential!(
    tables_of_services_nodes_and_events,
    tables,
    namespaces = [NS],
    pods
);

/// The `meta.k8s.io/v1` Table `kubectl get` asks for, with whole objects
/// in its rows (`includeObject=Object`; the simulator always sends them).
async fn table(client: &kube::Client, path: &str) -> Value {
    let req = http::Request::get(format!("{path}?includeObject=Object"))
        .header(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
        )
        .body(Vec::new())
        .unwrap();
    client.request::<Value>(req).await.unwrap()
}

/// Name, type, format and priority of each column (the descriptions are
/// the API's documentation, which the simulator does not copy).
fn columns(t: &Value) -> Vec<(String, String, String, i64)> {
    t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                c["type"].as_str().unwrap().to_owned(),
                c["format"].as_str().unwrap_or("").to_owned(),
                c["priority"].as_i64().unwrap_or(0),
            )
        })
        .collect()
}

fn column_set(spec: &[(&str, &str, &str, i64)]) -> Vec<(String, String, String, i64)> {
    spec.iter()
        .map(|(n, t, f, p)| ((*n).to_owned(), (*t).to_owned(), (*f).to_owned(), *p))
        .collect()
}

/// The cells of the row of object `name` (by `object.metadata.name`).
fn row(t: &Value, name: &str) -> Vec<Value> {
    t["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["object"]["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no row {name}: {t}"))["cells"]
        .as_array()
        .unwrap()
        .clone()
}

/// `kubectl get svc,nodes,events` print the columns kube-apiserver's
/// printers define (`pkg/printers/internalversion`), with the same cells.
async fn tables(b: &Backend) {
    let client = b.client().await;
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), NS);
    services
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web", "tier": "front"},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8888},
                                   {"name": "dns", "port": 53, "protocol": "UDP"}]},
            })),
        )
        .await
        .unwrap();
    services
        .create(
            &PostParams::default(),
            &from(json!({
                "metadata": {"name": "headless"},
                "spec": {"clusterIP": "None", "selector": {"app": "web"},
                         "ports": [{"port": 50051}]},
            })),
        )
        .await
        .unwrap();
    let svc = table(&client, &format!("/api/v1/namespaces/{NS}/services")).await;
    assert_eq!(
        columns(&svc),
        column_set(&[
            ("Name", "string", "name", 0),
            ("Type", "string", "", 0),
            ("Cluster-IP", "string", "", 0),
            ("External-IP", "string", "", 0),
            ("Port(s)", "string", "", 0),
            ("Age", "string", "", 0),
            ("Selector", "string", "", 1),
        ])
    );
    let web = row(&svc, "web");
    assert_eq!(
        (&web[0], &web[1], &web[3], &web[4], &web[6]),
        (
            &json!("web"),
            &json!("ClusterIP"),
            &json!("<none>"),
            &json!("80/TCP,53/UDP"),
            &json!("app=web,tier=front")
        )
    );
    let headless = row(&svc, "headless");
    assert_eq!(
        (&headless[2], &headless[4]),
        (&json!("None"), &json!("50051/TCP"))
    );

    let nodes = backend::eventually("a node", WAIT, || async {
        let t = table(&client, "/api/v1/nodes").await;
        (!t["rows"].as_array().unwrap().is_empty()).then_some(t)
    })
    .await;
    assert_eq!(
        columns(&nodes),
        column_set(&[
            ("Name", "string", "name", 0),
            ("Status", "string", "", 0),
            ("Roles", "string", "", 0),
            ("Age", "string", "", 0),
            ("Version", "string", "", 0),
            ("Internal-IP", "string", "", 1),
            ("External-IP", "string", "", 1),
            ("OS-Image", "string", "", 1),
            ("Kernel-Version", "string", "", 1),
            ("Container-Runtime", "string", "", 1),
        ])
    );
    let first = &nodes["rows"][0];
    let node: k8s_openapi::api::core::v1::Node = from(first["object"].clone());
    let cells = first["cells"].as_array().unwrap();
    let info = node.status.as_ref().unwrap().node_info.clone().unwrap();
    let internal = node
        .status
        .as_ref()
        .unwrap()
        .addresses
        .iter()
        .flatten()
        .find(|a| a.type_ == "InternalIP")
        .unwrap()
        .address
        .clone();
    assert_eq!(
        cells[1..],
        [
            json!("Ready"),
            json!("<none>"),
            cells[3].clone(),
            json!(info.kubelet_version),
            json!(internal),
            json!("<none>"),
            json!(info.os_image),
            json!(format!("{} ({})", info.kernel_version, info.architecture)),
            json!(info.container_runtime_version),
        ]
    );

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(&PostParams::default(), &deployment("tabled", 1, &json!({})))
        .await
        .unwrap();
    let events = backend::eventually("a ScalingReplicaSet event", WAIT, || async {
        let t = table(&client, &format!("/api/v1/namespaces/{NS}/events")).await;
        t["rows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["object"]["reason"] == "ScalingReplicaSet")
            .then_some(t)
    })
    .await;
    assert_eq!(
        columns(&events),
        column_set(&[
            ("Last Seen", "string", "", 0),
            ("Type", "string", "", 0),
            ("Reason", "string", "", 0),
            ("Object", "string", "", 0),
            ("Subobject", "string", "", 1),
            ("Source", "string", "", 1),
            ("Message", "string", "", 0),
            ("First Seen", "string", "", 1),
            ("Count", "string", "", 1),
            ("Name", "string", "name", 1),
        ])
    );
    let scaled = events["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["object"]["reason"] == "ScalingReplicaSet")
        .unwrap();
    let cells = scaled["cells"].as_array().unwrap();
    let rs = scaled["object"]["message"].as_str().unwrap().to_owned();
    assert_eq!(
        (
            &cells[1], &cells[2], &cells[3], &cells[4], &cells[5], &cells[6], &cells[8], &cells[9]
        ),
        (
            &json!("Normal"),
            &json!("ScalingReplicaSet"),
            &json!("deployment/tabled"),
            &json!(""),
            &json!("deployment-controller"),
            &json!(rs),
            &json!(1),
            &scaled["object"]["metadata"]["name"],
        )
    );
    assert!(rs.starts_with("Scaled up replica set tabled-"), "{rs}");
    // kubectl prints the headers (and leaves the wide columns out).
    if backend::kubectl_available() {
        for (what, header) in [
            ("svc", "NAME TYPE CLUSTER-IP EXTERNAL-IP PORT(S) AGE"),
            ("nodes", "NAME STATUS ROLES AGE VERSION"),
            ("events", "LAST SEEN TYPE REASON OBJECT MESSAGE"),
        ] {
            let out = b.kubectl(&["-n", NS, "get", what]).await;
            assert!(out.ok, "{out:?}");
            let first = out.stdout.lines().next().unwrap_or_default();
            assert_eq!(
                first.split_whitespace().collect::<Vec<_>>().join(" "),
                header,
                "{out:?}"
            );
        }
    }
}

// === Container logs ===

differential!(
    container_logs_are_read_tailed_and_followed,
    container_logs,
    namespaces = [NS],
    pods
);

/// The log of a pod the node agent runs, through the API server (kube-rs
/// and kubectl): on the real control plane kube-apiserver asks the node's
/// kubelet API (the agent's HTTPS listener), on the simulator the API
/// server reads the log itself. The output so far, its last line, a byte
/// limit; `-f` streams a line printed later and ends when the container
/// does; what is not there or not kept (`--previous` of a first instance,
/// `--timestamps`) is refused with the same text on both.
async fn container_logs(b: &Backend) {
    use futures::AsyncBufReadExt as _;
    use futures::StreamExt as _;
    use kube::api::LogParams;
    use tokio::io::AsyncBufReadExt as _;

    let client = b.client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // The container prints its last line once this host directory (its
    // hostPath volume) holds `go`.
    let trigger = std::env::temp_dir().join(format!(
        "skipper-logs-{}-{:x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&trigger).unwrap();
    let script = "echo one; echo two; echo three; until [ -e /trigger/go ]; do sleep 0.1; done; echo four";
    pods.create(
        &PostParams::default(),
        &from(json!({
            "metadata": {"name": "talker"},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "trigger", "hostPath": {"path": trigger}}],
                "containers": [{
                    "name": "main",
                    "image": "debian",
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "trigger", "mountPath": "/trigger"}],
                }],
            },
        })),
    )
    .await
    .unwrap();
    let logs = async |params: LogParams| pods.logs("talker", &params).await;
    backend::eventually("the container's first three lines", WAIT, || async {
        (logs(LogParams::default()).await.ok()? == "one\ntwo\nthree\n").then_some(())
    })
    .await;
    let tail = |n| LogParams {
        tail_lines: Some(n),
        ..LogParams::default()
    };
    assert_eq!(logs(tail(1)).await.unwrap(), "three\n");
    assert_eq!(
        logs(LogParams {
            limit_bytes: Some(6),
            ..LogParams::default()
        })
        .await
        .unwrap(),
        "one\ntw"
    );
    let kubectl = backend::kubectl_available();
    if kubectl {
        let out = b.kubectl(&["-n", NS, "logs", "talker", "--tail=1"]).await;
        assert!(out.ok, "{out:?}");
        assert_eq!(out.stdout, "three\n");
    } else {
        eprintln!("kubectl is not installed: its steps are skipped");
    }

    // Followed from the last line, by kube-rs and by `kubectl logs -f`.
    let followed = LogParams {
        follow: true,
        ..tail(1)
    };
    let mut lines = pods.log_stream("talker", &followed).await.unwrap().lines();
    let mut kubectl_f = kubectl.then(|| {
        let mut child = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(b.kubeconfig())
            .args(["-n", NS, "logs", "-f", "--tail=1", "talker"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        (child, stdout)
    });
    let line = within("a line", lines.next()).await;
    assert_eq!(line.unwrap().unwrap(), "three");
    if let Some((_, out)) = kubectl_f.as_mut() {
        let line = within("kubectl's line", out.next_line()).await;
        assert_eq!(line.unwrap().as_deref(), Some("three"));
    }
    std::fs::write(trigger.join("go"), "").unwrap();
    let line = within("the line printed later", lines.next()).await;
    assert_eq!(line.unwrap().unwrap(), "four");
    let end = within(
        "the end of the followed log when the container ended",
        lines.next(),
    )
    .await;
    assert!(end.is_none(), "{end:?}");
    if let Some((mut child, mut out)) = kubectl_f {
        let line = within("kubectl's line printed later", out.next_line()).await;
        assert_eq!(line.unwrap().as_deref(), Some("four"));
        let status = within("kubectl logs -f to exit when the container ended", child.wait())
            .await
            .unwrap();
        assert!(status.success(), "kubectl logs -f: {status}");
    }

    let phase = backend::eventually("the pod to succeed", WAIT, || async {
        let phase = pods.get("talker").await.ok()?.status?.phase?;
        (phase == "Succeeded").then_some(phase)
    })
    .await;
    assert_eq!(phase, "Succeeded");
    assert_eq!(
        logs(LogParams::default()).await.unwrap(),
        "one\ntwo\nthree\nfour\n"
    );
    assert_eq!(logs(tail(2)).await.unwrap(), "three\nfour\n");
    let refused = |err: Value| (err["code"].clone(), err["reason"].clone(), err["message"].clone());
    assert_eq!(
        refused(status(
            logs(LogParams {
                previous: true,
                ..LogParams::default()
            })
            .await
        )),
        (
            json!(400),
            json!("BadRequest"),
            json!("previous terminated container \"main\" in pod \"talker\" not found")
        )
    );
    assert_eq!(
        refused(status(
            logs(LogParams {
                timestamps: true,
                ..LogParams::default()
            })
            .await
        )),
        (
            json!(400),
            json!("BadRequest"),
            json!(
                "timestamps is not supported by this node agent: container output is kept without the time of each line"
            )
        )
    );
    assert_eq!(
        refused(status(
            logs(LogParams {
                container: Some("nope".into()),
                ..LogParams::default()
            })
            .await
        )),
        (
            json!(400),
            json!("BadRequest"),
            json!("container nope is not valid for pod talker")
        )
    );
    if kubectl {
        let out = b.kubectl(&["-n", NS, "logs", "talker", "--timestamps"]).await;
        assert!(!out.ok, "{out:?}");
        assert!(
            out.stderr
                .contains("timestamps is not supported by this node agent"),
            "{out:?}"
        );
    }

    // The node proxy reaches the same kubelet API; other paths are not there.
    if b.is_real() {
        let node = pods.get("talker").await.unwrap().spec.unwrap().node_name.unwrap();
        let get = |path: String| {
            let client = client.clone();
            async move {
                client
                    .request_text(http::Request::get(path).body(Vec::new()).unwrap())
                    .await
            }
        };
        let proxied = get(format!(
            "/api/v1/nodes/{node}/proxy/containerLogs/{NS}/talker/main?tailLines=1"
        ))
        .await
        .unwrap();
        assert_eq!(proxied, "four\n");
        let missing = get(format!("/api/v1/nodes/{node}/proxy/exec/{NS}/talker/main")).await;
        assert_eq!(status(missing)["code"], 404);
    }
    std::fs::remove_dir_all(&trigger).unwrap();
}

/// `f`'s output, or a panic naming `what` after [`WAIT`].
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} within {WAIT:?}"))
}
