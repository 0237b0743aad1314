//! Authorization of the simulated API server: RBAC decisions and the real
//! 403 texts, impersonation, access reviews, and the Node authorizer.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use skipper_devcluster::{Cluster, Credential};
use skipper_test_support::api_error;

const NS: &str = "rbac";

fn user(name: &str) -> Credential {
    Credential::User {
        name: name.into(),
        group: None,
    }
}

async fn apply(cluster: &Cluster, docs: Value) {
    let client = cluster.client().unwrap();
    for doc in docs.as_array().unwrap() {
        let kind = doc["kind"].as_str().unwrap();
        let ns = doc["metadata"]["namespace"].as_str();
        let (group, version) = match doc["apiVersion"].as_str().unwrap().split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (String::new(), doc["apiVersion"].as_str().unwrap().to_owned()),
        };
        let gvk = kube::core::GroupVersionKind::gvk(&group, &version, kind);
        let (ar, _) = kube::discovery::pinned_kind(&client, &gvk).await.unwrap();
        let api: Api<kube::core::DynamicObject> = match ns {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        api.create(
            &PostParams::default(),
            &serde_json::from_value(doc.clone()).unwrap(),
        )
        .await
        .unwrap();
    }
}

/// Creates Secrets `names` in [`NS`] (each holding `k: v`) as the
/// administrator.
async fn create_secrets(cluster: &Cluster, names: &[&str]) {
    let secrets: Api<Secret> = Api::namespaced(cluster.client().unwrap(), NS);
    for name in names {
        let secret = json!({"metadata": {"name": name}, "stringData": {"k": "v"}});
        secrets
            .create(&PostParams::default(), &serde_json::from_value(secret).unwrap())
            .await
            .unwrap();
    }
}

/// The status code of the error the API server answered `result` with;
/// panics when the request succeeded.
fn refused<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> u16 {
    api_error(result.unwrap_err()).0
}

/// Asserts that `client` may get Secret `allowed` of [`NS`] and is refused
/// (403) Secret `denied`; the Secrets API of `client`.
async fn reads_only_secret(client: &kube::Client, allowed: &str, denied: &str) -> Api<Secret> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    secrets.get(allowed).await.unwrap();
    assert_eq!(refused(secrets.get(denied).await), 403);
    secrets
}

#[tokio::test]
async fn forbidden_requests_get_the_real_403_text() {
    let cluster = common::cluster(&[NS, "skipper"]).await;
    let sa = cluster.client().unwrap();
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(sa, "skipper");
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "skipper-controller"}})).unwrap(),
    )
    .await
    .unwrap();
    let controller = cluster
        .client_for(&Credential::ServiceAccount {
            namespace: "skipper".into(),
            name: "skipper-controller".into(),
        })
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(controller.clone(), "default");
    let err = pods.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(
        api_error(err),
        (
            403,
            "Forbidden".into(),
            "pods is forbidden: User \"system:serviceaccount:skipper:skipper-controller\" cannot list resource \"pods\" in API group \"\" in the namespace \"default\"".into()
        )
    );
    let alice = cluster.client_for(&user("alice")).unwrap();
    let deployments: Api<Deployment> = Api::namespaced(alice.clone(), NS);
    assert_eq!(
        api_error(deployments.get("web").await.unwrap_err()).2,
        "deployments.apps \"web\" is forbidden: User \"alice\" cannot get resource \"deployments\" in API group \"apps\" in the namespace \"rbac\""
    );
    let nodes: Api<Node> = Api::all(alice.clone());
    assert_eq!(
        api_error(nodes.list(&ListParams::default()).await.unwrap_err()).2,
        "nodes is forbidden: User \"alice\" cannot list resource \"nodes\" in API group \"\" at the cluster scope"
    );
    // The Status details name the resource (and the object and group when the request does).
    let req = http::Request::get(format!("/apis/apps/v1/namespaces/{NS}/deployments/web"))
        .body(Vec::new())
        .unwrap();
    let body = match alice.request_text(req).await.unwrap_err() {
        kube::Error::Api(s) => s,
        other => panic!("{other}"),
    };
    assert_eq!(body.code, 403);
    let details = body.details.unwrap();
    assert_eq!(
        (
            details.name.as_str(),
            details.group.as_str(),
            details.kind.as_str()
        ),
        ("web", "apps", "deployments")
    );
}

#[tokio::test]
async fn roles_and_bindings_grant_exactly_what_they_say() {
    let cluster = common::cluster(&[NS, "other"]).await;
    apply(
        &cluster,
        json!([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "cm-reader", "namespace": NS},
             "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]},
                       {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["open"], "verbs": ["get"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "alice-reads", "namespace": NS},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "scaler"},
             "rules": [{"apiGroups": ["apps"], "resources": ["*/scale"], "verbs": ["*"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "devs-scale", "namespace": "other"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "scaler"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "developers"}]},
        ]),
    )
    .await;
    let admin = cluster.client().unwrap();
    create_secrets(&cluster, &["open", "closed"]).await;
    let alice = cluster.client_for(&user("alice")).unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(alice.clone(), NS);
    cms.list(&ListParams::default()).await.unwrap();
    cms.get("kube-root-ca.crt").await.unwrap();
    let create = cms
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        api_error(create).2,
        "configmaps is forbidden: User \"alice\" cannot create resource \"configmaps\" in API group \"\" in the namespace \"rbac\""
    );
    // Only in the binding's namespace.
    let elsewhere: Api<ConfigMap> = Api::namespaced(alice.clone(), "other");
    assert_eq!(
        api_error(elsewhere.list(&ListParams::default()).await.unwrap_err()).0,
        403
    );
    // resourceNames: one secret, and no list.
    let secrets = reads_only_secret(&alice, "open", "closed").await;
    assert_eq!(refused(secrets.list(&ListParams::default()).await), 403);

    // A ClusterRole bound by a RoleBinding to a group: scale subresources in that namespace only.
    let bob = cluster
        .client_for(&Credential::User {
            name: "bob".into(),
            group: Some("developers".into()),
        })
        .unwrap();
    Api::<Deployment>::namespaced(admin.clone(), "other")
        .create(
            &PostParams::default(),
            &skipper_devcluster::pool_deployment("other", "web", 0, "unused"),
        )
        .await
        .unwrap();
    let bobs: Api<Deployment> = Api::namespaced(bob.clone(), "other");
    bobs.patch_scale(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 0}})),
    )
    .await
    .unwrap();
    assert_eq!(
        api_error(bobs.get("web").await.unwrap_err()).2,
        "deployments.apps \"web\" is forbidden: User \"bob\" cannot get resource \"deployments\" in API group \"apps\" in the namespace \"other\""
    );
    let scale_elsewhere = Api::<Deployment>::namespaced(bob, NS)
        .get_scale("web")
        .await
        .unwrap_err();
    assert_eq!(
        api_error(scale_elsewhere).2,
        "deployments.apps \"web\" is forbidden: User \"bob\" cannot get resource \"deployments/scale\" in API group \"apps\" in the namespace \"rbac\""
    );
}

async fn post(client: &kube::Client, path: &str, body: Value) -> Result<Value, kube::Error> {
    let req = http::Request::post(path)
        .header("content-type", "application/json")
        .body(body.to_string().into_bytes())
        .unwrap();
    Ok(serde_json::from_str(&client.request_text(req).await?).unwrap())
}

/// `client`'s SelfSubjectAccessReview of `verb` on `resource` in [`NS`]:
/// the API server's answer.
async fn can_i(client: &kube::Client, verb: &str, resource: &str) -> Value {
    let review = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                        "spec": {"resourceAttributes": {"namespace": NS, "verb": verb, "resource": resource}}});
    post(
        client,
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        review,
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn access_reviews_answer_can_i() {
    let cluster = common::cluster(&[NS]).await;
    apply(
        &cluster,
        json!([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "alice-views"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]},
        ]),
    )
    .await;
    let alice = cluster.client_for(&user("alice")).unwrap();
    let yes = can_i(&alice, "list", "pods").await;
    assert_eq!(yes["status"]["allowed"], true);
    assert_eq!(
        yes["status"]["reason"],
        "RBAC: allowed by ClusterRoleBinding \"alice-views\" of ClusterRole \"view\" to User \"alice\""
    );
    let no = can_i(&alice, "delete", "pods").await;
    assert_eq!(no["status"], json!({"allowed": false}));

    // SubjectAccessReview needs its own permission; the administrator has it.
    let sar = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                     "spec": {"user": "alice", "resourceAttributes": {"namespace": NS, "verb": "get", "resource": "secrets"}}});
    assert_eq!(
        api_error(
            post(
                &alice,
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                sar.clone()
            )
            .await
            .unwrap_err()
        )
        .0,
        403
    );
    let admin = cluster.client().unwrap();
    let answer = post(&admin, "/apis/authorization.k8s.io/v1/subjectaccessreviews", sar)
        .await
        .unwrap();
    assert_eq!(answer["status"]["allowed"], false, "view does not read secrets");
    let invalid = post(
        &admin,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        json!({"spec": {"resourceAttributes": {"verb": "get", "resource": "pods"}}}),
    )
    .await
    .unwrap_err();
    assert_eq!(api_error(invalid).0, 422);

    let rules = post(
        &alice,
        "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews",
        json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": NS}}),
    )
    .await
    .unwrap();
    let resource_rules = rules["status"]["resourceRules"].as_array().unwrap();
    assert!(
        resource_rules
            .iter()
            .any(|r| r["resources"].as_array().unwrap().contains(&json!("pods"))
                && r["verbs"] == json!(["get", "list", "watch"])),
        "{rules}"
    );
    assert!(
        resource_rules
            .iter()
            .any(|r| r["resources"] == json!(["selfsubjectaccessreviews", "selfsubjectrulesreviews"])),
        "system:basic-user applies to everyone: {rules}"
    );
}

#[tokio::test]
async fn impersonation_needs_the_impersonate_verb() {
    let cluster = common::cluster(&[NS]).await;
    let mut config = kube::Config::new(cluster.base_url().parse().unwrap());
    config.root_cert = Some(vec![cluster.pki().ca.cert_der().to_vec()]);
    let admin = cluster.admin_cert();
    let auth: kube::config::AuthInfo = serde_json::from_value(json!({
        "client-certificate-data": base64_std(&admin.cert_pem),
        "client-key-data": base64_std(&admin.key_pem),
        "as": "alice",
        "as-groups": ["developers"],
    }))
    .unwrap();
    config.auth_info = auth;
    let as_alice = kube::Client::try_from(config).unwrap();
    let who = post(
        &as_alice,
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}),
    )
    .await
    .unwrap();
    assert_eq!(
        who["status"]["userInfo"],
        json!({"username": "alice", "groups": ["developers", "system:authenticated"]})
    );
    let pods: Api<Pod> = Api::namespaced(as_alice, NS);
    assert_eq!(
        api_error(pods.list(&ListParams::default()).await.unwrap_err()).2,
        "pods is forbidden: User \"alice\" cannot list resource \"pods\" in API group \"\" in the namespace \"rbac\""
    );
    // alice may not impersonate anyone.
    let alice = cluster.client_for(&user("alice")).unwrap();
    let req = http::Request::get(format!("/api/v1/namespaces/{NS}/pods"))
        .header("Impersonate-User", "bob")
        .body(Vec::new())
        .unwrap();
    assert_eq!(
        api_error(alice.request_text(req).await.unwrap_err()).2,
        "users \"bob\" is forbidden: User \"alice\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"
    );
}

fn base64_std(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[tokio::test]
async fn nodes_reach_only_their_own_objects_and_their_pods_references() {
    let cluster = common::cluster(&[NS]).await;
    let admin = cluster.client().unwrap();
    create_secrets(&cluster, &["mine", "theirs"]).await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    for (name, node, secret) in [("p0", "sim-node-0", "mine"), ("p1", "sim-node-1", "theirs")] {
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}, "spec": {
                "nodeName": node,
                "containers": [{"name": "c", "image": "skipper", "command": ["sleep", "600"],
                                "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": secret, "key": "k"}}}]}]}}))
            .unwrap(),
        )
        .await
        .unwrap();
    }
    let node = cluster
        .client_for(&Credential::Node("sim-node-0".into()))
        .unwrap();
    let node_pods: Api<Pod> = Api::namespaced(node.clone(), NS);
    node_pods.get("p0").await.unwrap();
    assert_eq!(api_error(node_pods.get("p1").await.unwrap_err()).0, 403);
    let mine = node_pods
        .list(&ListParams::default().fields("spec.nodeName=sim-node-0"))
        .await
        .unwrap();
    assert_eq!(mine.items.len(), 1);
    assert_eq!(
        api_error(node_pods.list(&ListParams::default()).await.unwrap_err()).0,
        403
    );
    reads_only_secret(&node, "mine", "theirs").await;
    // Its own Node object, not another's.
    let nodes: Api<Node> = Api::all(node.clone());
    nodes
        .list(&ListParams::default().fields("metadata.name=sim-node-0"))
        .await
        .unwrap();
    assert_eq!(
        api_error(nodes.list(&ListParams::default()).await.unwrap_err()).2,
        "nodes is forbidden: User \"system:node:sim-node-0\" cannot list resource \"nodes\" in API group \"\" at the cluster scope: node: node 'sim-node-0' cannot read all nodes, only its own Node object"
    );
    let label = Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}}));
    nodes
        .patch("sim-node-0", &PatchParams::default(), &label)
        .await
        .unwrap();
    assert_eq!(
        api_error(
            nodes
                .patch("sim-node-1", &PatchParams::default(), &label)
                .await
                .unwrap_err()
        )
        .2,
        "nodes \"sim-node-1\" is forbidden: node \"sim-node-0\" is not allowed to modify node \"sim-node-1\""
    );
    // Tokens only for the ServiceAccount of a pod on this node, bound to that pod.
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(node, NS);
    let p0_uid = pods.get("p0").await.unwrap().metadata.uid.unwrap();
    let bound = |pod: &str, uid: &str| -> k8s_openapi::api::authentication::v1::TokenRequest {
        serde_json::from_value(json!({"spec": {"audiences": [], "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid}}})).unwrap()
    };
    sas.create_token_request("default", &PostParams::default(), &bound("p0", &p0_uid))
        .await
        .unwrap();
    let p1_uid = pods.get("p1").await.unwrap().metadata.uid.unwrap();
    assert_eq!(
        api_error(
            sas.create_token_request("default", &PostParams::default(), &bound("p1", &p1_uid))
                .await
                .unwrap_err()
        )
        .0,
        403
    );
}
