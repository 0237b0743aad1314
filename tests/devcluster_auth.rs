//! Authentication of the simulated API server: HTTPS only, client
//! certificates and ServiceAccount tokens accepted, everything else `401`,
//! and the fault endpoints for administrators only.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[path = "common/devcluster.rs"]
mod common;

use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use skipper::devcluster::Credential;

const NS: &str = "auth";

fn anonymous_http(cluster: &skipper::devcluster::Cluster) -> reqwest::Client {
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
    let foreign = skipper::devcluster::pki::Ca::generate("other").unwrap();
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
    match alice.request_text(req).await.unwrap_err() {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 403);
            assert_eq!(
                s.message,
                "forbidden: User \"alice\" cannot post path \"/_sim/compact\""
            );
        }
        other => panic!("{other}"),
    }
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
    for credential in &credentials {
        let client = cluster.client_for(credential).unwrap();
        let cms: Api<ConfigMap> = Api::namespaced(client, NS);
        cms.list(&ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("{credential:?}: {e}"));
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
