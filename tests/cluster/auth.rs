//! Authentication of the simulated API server: HTTPS only, client
//! certificates and ServiceAccount tokens accepted, everything else `401`,
//! and the fault endpoints for administrators only.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, Patch, PostParams};
use serde_json::{Value, json};
use skipper_devcluster::Credential;
use skipper_test_support::{api_error, patch};

const NS: &str = "auth";
const WAIT: Duration = Duration::from_secs(20);

fn anonymous_http(cluster: &skipper_devcluster::Cluster) -> reqwest::Client {
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(cluster.ca_pem().as_bytes()).unwrap())
        .build()
        .unwrap()
}

#[tokio::test]
async fn requests_without_valid_credentials_get_401_status() {
    let cluster = common::cluster(&[NS]).await;
    let http = anonymous_http(&cluster);
    for req in [
        http.get(format!("{}/api/v1/namespaces", cluster.base_url())),
        http.get(format!("{}/version", cluster.base_url())),
        http.get(format!("{}/api/v1/namespaces", cluster.base_url()))
            .bearer_auth("not-a-token"),
        http.post(format!("{}/_sim/compact", cluster.base_url())),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            body,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "Unauthorized", "reason": "Unauthorized", "code": 401})
        );
    }
    // Plain HTTP is not served.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/version", cluster.addr()))
        .send()
        .await;
    assert!(plain.is_err() || plain.unwrap().status() == 400);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_in_the_handshake() {
    let cluster = common::cluster(&[NS]).await;
    let foreign = skipper_devcluster::pki::Ca::generate("other").unwrap();
    let cert = foreign
        .issue_client("kubernetes-admin", &["system:masters"])
        .unwrap();
    let http = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(cluster.ca_pem().as_bytes()).unwrap())
        .identity(
            reqwest::Identity::from_pem(format!("{}{}", cert.cert_pem, cert.key_pem).as_bytes()).unwrap(),
        )
        .build()
        .unwrap();
    assert!(
        http.get(format!("{}/version", cluster.base_url()))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test]
async fn fault_endpoints_are_for_administrators_only() {
    let cluster = common::cluster(&[NS]).await;
    let admin = common::api_http(&cluster);
    let resp = admin
        .post(format!("{}/_sim/compact", cluster.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let alice = cluster
        .client_for(&Credential::User {
            name: "alice".into(),
            group: Some("developers".into()),
        })
        .unwrap();
    let req = http::Request::post("/_sim/compact").body(Vec::new()).unwrap();
    let (code, _, message) = api_error(alice.request_text(req).await.unwrap_err());
    assert_eq!(code, 403);
    assert_eq!(
        message,
        "forbidden: User \"alice\" cannot post path \"/_sim/compact\""
    );
}

#[tokio::test]
async fn certificates_tokens_and_node_credentials_authenticate() {
    let cluster = common::cluster(&[NS]).await;
    let admin = cluster.client().unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "robot"}})).unwrap(),
    )
    .await
    .unwrap();
    let credentials = [
        Credential::Admin,
        Credential::User {
            name: "alice".into(),
            group: None,
        },
        Credential::Node("sim-node-0".into()),
        Credential::ServiceAccount {
            namespace: NS.into(),
            name: "robot".into(),
        },
    ];
    for (credential, user) in credentials.iter().zip([
        "kubernetes-admin",
        "alice",
        "system:node:sim-node-0",
        "system:serviceaccount:auth:robot",
    ]) {
        let client = cluster.client_for(credential).unwrap();
        assert_eq!(whoami(&client).await["username"], user, "{credential:?}");
    }
    // A token stops working when its ServiceAccount is deleted.
    let robot = cluster
        .client_for(&Credential::ServiceAccount {
            namespace: NS.into(),
            name: "robot".into(),
        })
        .unwrap();
    sas.delete("robot", &Default::default()).await.unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(robot, NS);
    match cms.list(&ListParams::default()).await.unwrap_err() {
        kube::Error::Api(s) => assert_eq!(s.code, 401),
        other => panic!("{other}"),
    }
    // A ServiceAccount that does not exist gets no token.
    assert!(
        cluster
            .client_for(&Credential::ServiceAccount {
                namespace: NS.into(),
                name: "nobody".into(),
            })
            .is_err()
    );
}

#[tokio::test]
async fn every_namespace_gets_a_default_service_account_and_the_root_ca() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease", NS] {
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
        let ca = common::eventually(&format!("kube-root-ca.crt in {ns}"), WAIT, || {
            let (cms, sas) = (cms.clone(), sas.clone());
            async move {
                sas.get("default").await.ok()?;
                cms.get("kube-root-ca.crt").await.ok()
            }
        })
        .await;
        assert_eq!(ca.data.unwrap()["ca.crt"], cluster.ca_pem());
    }
    // The controllers put back what is changed or deleted.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    patch(
        &cms,
        "kube-root-ca.crt",
        Patch::Merge(json!({"data": {"ca.crt": "forged"}})),
    )
    .await;
    sas.delete("default", &DeleteParams::default()).await.unwrap();
    common::eventually("CA and ServiceAccount restored", WAIT, || {
        let (cms, sas) = (cms.clone(), sas.clone());
        let ca = cluster.ca_pem().to_owned();
        async move {
            sas.get("default").await.ok()?;
            let cm = cms.get("kube-root-ca.crt").await.ok()?;
            (cm.data?.get("ca.crt")? == &ca).then_some(())
        }
    })
    .await;
}

fn token_request(audiences: &[&str], seconds: Option<i64>, pod: Option<(&str, &str)>) -> TokenRequest {
    let mut spec = json!({"audiences": audiences});
    if let Some(s) = seconds {
        spec["expirationSeconds"] = json!(s);
    }
    if let Some((name, uid)) = pod {
        spec["boundObjectRef"] = json!({"kind": "Pod", "apiVersion": "v1", "name": name, "uid": uid});
    }
    serde_json::from_value(json!({"spec": spec})).unwrap()
}

fn claims(token: &str) -> Value {
    use base64::Engine as _;
    let part = token.split('.').nth(1).unwrap();
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(part)
            .unwrap(),
    )
    .unwrap()
}

async fn review(client: &kube::Client, token: &str, audiences: &[&str]) -> Value {
    let req = http::Request::post("/apis/authentication.k8s.io/v1/tokenreviews")
        .header("content-type", "application/json")
        .body(
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                   "spec": {"token": token, "audiences": audiences}})
            .to_string()
            .into_bytes(),
        )
        .unwrap();
    serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap()
}

#[tokio::test]
async fn token_requests_issue_bound_tokens_that_die_with_their_pod() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    // The cluster's namespaces come with their `default` ServiceAccount.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod = pods
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "holder"},
                "spec": {"containers": [{"name": "c", "image": "skipper", "command": ["sleep", "600"]}]}}))
            .unwrap(),
        )
        .await
        .unwrap();
    let uid = pod.metadata.uid.clone().unwrap();

    let tr = sas
        .create_token_request(
            "default",
            &PostParams::default(),
            &token_request(&["skipper"], Some(600), Some(("holder", &uid))),
        )
        .await
        .unwrap();
    let status = tr.status.unwrap();
    let c = claims(&status.token);
    assert_eq!(c["sub"], "system:serviceaccount:auth:default");
    assert_eq!(c["iss"], "https://kubernetes.default.svc.cluster.local");
    assert_eq!(c["aud"], json!(["skipper"]));
    assert_eq!(c["kubernetes.io"]["namespace"], NS);
    assert_eq!(c["kubernetes.io"]["serviceaccount"]["name"], "default");
    assert_eq!(c["kubernetes.io"]["pod"], json!({"name": "holder", "uid": uid}));
    assert_eq!(c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap(), 600);
    assert_eq!(c["nbf"], c["iat"]);
    assert_eq!(
        status.expiration_timestamp.0.as_second(),
        c["exp"].as_i64().unwrap()
    );

    // TokenReview: valid for its audience only.
    let ok = review(&client, &status.token, &["skipper"]).await;
    assert_eq!(ok["status"]["authenticated"], true, "{ok}");
    assert_eq!(
        ok["status"]["user"]["username"],
        "system:serviceaccount:auth:default"
    );
    assert_eq!(
        ok["status"]["user"]["groups"],
        json!([
            "system:serviceaccounts",
            "system:serviceaccounts:auth",
            "system:authenticated"
        ])
    );
    assert_eq!(
        ok["status"]["user"]["extra"]["authentication.kubernetes.io/pod-name"],
        json!(["holder"])
    );
    assert_eq!(ok["status"]["audiences"], json!(["skipper"]));
    let wrong = review(&client, &status.token, &["other"]).await;
    assert!(wrong["status"]["authenticated"].is_null(), "{wrong}");
    assert!(wrong["status"]["error"].as_str().unwrap().contains("audiences"));
    // Not an API-server audience: the token does not authenticate API requests.
    let http = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(cluster.ca_pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    let resp = http
        .get(format!("{}/api/v1/namespaces/{NS}/pods", cluster.base_url()))
        .bearer_auth(&status.token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    // A default-audience token does; and stops when the pod is gone.
    let api_token = sas
        .create_token_request(
            "default",
            &PostParams::default(),
            &token_request(&[], None, Some(("holder", &uid))),
        )
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    assert_eq!(
        claims(&api_token)["exp"].as_i64().unwrap() - claims(&api_token)["iat"].as_i64().unwrap(),
        3600
    );
    let get = || {
        http.get(format!(
            "{}/api/v1/namespaces/{NS}/configmaps",
            cluster.base_url()
        ))
        .bearer_auth(&api_token)
        .send()
    };
    assert_eq!(
        get().await.unwrap().status(),
        403,
        "authenticated, not authorized"
    );
    pods.delete("holder", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    common::eventually("pod gone", WAIT, || {
        let pods = pods.clone();
        async move { pods.get_opt("holder").await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert_eq!(get().await.unwrap().status(), 401);
    let gone = review(&client, &status.token, &["skipper"]).await;
    assert_eq!(
        gone["status"]["error"],
        "[invalid bearer token, service account token has been invalidated]"
    );
}

#[tokio::test]
async fn token_requests_are_validated_like_the_real_api() {
    let cluster = common::cluster(&[NS]).await;
    let client = cluster.client().unwrap();
    // The cluster's namespaces come with their `default` ServiceAccount.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    let err = |e: kube::Error| match e {
        kube::Error::Api(s) => (s.code, s.reason, s.message),
        other => panic!("{other}"),
    };
    let short = sas
        .create_token_request(
            "default",
            &PostParams::default(),
            &token_request(&[], Some(60), None),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err(short),
        (
            422,
            "Invalid".into(),
            "TokenRequest.authentication.k8s.io \"default\" is invalid: spec.expirationSeconds: Invalid value: 60: may not specify a duration less than 10 minutes".into()
        )
    );
    let missing = sas
        .create_token_request("nobody", &PostParams::default(), &token_request(&[], None, None))
        .await
        .unwrap_err();
    assert_eq!(
        err(missing),
        (
            404,
            "NotFound".into(),
            "serviceaccounts \"nobody\" not found".into()
        )
    );
    let no_pod = sas
        .create_token_request(
            "default",
            &PostParams::default(),
            &token_request(&[], None, Some(("ghost", "x"))),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err(no_pod),
        (404, "NotFound".into(), "pods \"ghost\" not found".into())
    );
}

/// The `userInfo` of a SelfSubjectReview (`kubectl auth whoami`) by `client`.
async fn whoami(client: &kube::Client) -> Value {
    let req = http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
        .header("content-type", "application/json")
        .body(br#"{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}"#.to_vec())
        .unwrap();
    let v: Value = serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap();
    v["status"]["userInfo"].clone()
}

#[tokio::test]
async fn self_subject_review_names_the_caller() {
    let cluster = common::cluster(&[NS]).await;
    let alice = cluster
        .client_for(&Credential::User {
            name: "alice".into(),
            group: Some("developers".into()),
        })
        .unwrap();
    assert_eq!(
        whoami(&alice).await,
        json!({"username": "alice", "groups": ["developers", "system:authenticated"]})
    );
}
