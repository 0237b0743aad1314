//! Traces across processes: an OTLP/HTTP receiver started here, `skipper
//! dev --otlp-endpoint` pointing every process at it, and one request for a
//! new tenant carrying a client `traceparent`. The receiver gets one trace
//! with the router's request and GetInstance spans, the controller's
//! GetInstance, claim, Kubernetes write and assign POST spans, and the
//! fixture's spans for the assign POST and the proxied request — each
//! parented across the process boundaries. The cold response carries
//! `Server-Timing` (claim, assign, ready); a warm one does not claim.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use tokio::sync::watch;

use crate::Timer;
use crate::harness::{Dev, Opts, single};

/// One received span.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    kind: i32,
    attributes: HashMap<String, String>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with protobuf bodies; the
/// counter moves with every batch received.
async fn receiver() -> (SocketAddr, Arc<Mutex<Vec<Span>>>, watch::Receiver<u64>) {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let store = spans.clone();
    let (batches, received) = watch::channel(0u64);
    let batches = Arc::new(batches);
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let store = store.clone();
            let batches = batches.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("ExportTraceServiceRequest");
                let mut out = store.lock().unwrap();
                for rs in req.resource_spans {
                    let service = rs
                        .resource
                        .iter()
                        .flat_map(|r| r.attributes.iter())
                        .find(|a| a.key == "service.name")
                        .and_then(|a| a.value.as_ref())
                        .and_then(|v| match &v.value {
                            Some(Value::StringValue(s)) => Some(s.clone()),
                            _ => None,
                        })
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            out.push(Span {
                                service: service.clone(),
                                name: s.name,
                                trace_id: hex(&s.trace_id),
                                span_id: hex(&s.span_id),
                                parent: hex(&s.parent_span_id),
                                kind: s.kind,
                                attributes: s
                                    .attributes
                                    .iter()
                                    .map(|a| {
                                        (a.key.clone(), format!("{:?}", a.value.as_ref().map(|v| &v.value)))
                                    })
                                    .collect(),
                            });
                        }
                    }
                }
                drop(out);
                batches.send_modify(|n| *n += 1);
                // An empty ExportTraceServiceResponse.
                (
                    [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    // Every address: on the real control plane pods have a network of
    // their own and reach the host's collector through the host's address
    // on it (`skipper dev` tells them that address instead of loopback).
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], listener.local_addr().unwrap().port()));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, spans, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_makes_one_trace_across_router_controller_and_pod() {
    let _t = Timer::start("traces across processes");
    let (otlp, spans, mut received) = receiver().await;
    let dev = Dev::start(Opts {
        extra: vec!["--otlp-endpoint".into(), format!("http://{otlp}")],
        ..Opts::default()
    })
    .await;
    assert!(
        dev.stdout.lock().unwrap().iter().any(|l| l.trim_start()
            == format!("traces:        OTLP/HTTP to http://{otlp} (router, controllers, pool pods)")),
        "skipper dev prints where traces go"
    );
    let trace_id = format!("{:032x}", rand::random::<u128>() | 1);
    let client_span = format!("{:016x}", rand::random::<u64>() | 1);
    let function = single("traced");
    let resp = dev
        .http
        .get(format!("{}/hello", dev.router))
        .header("X-Skipper-Function", &function)
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let timing = resp
        .headers()
        .get("server-timing")
        .expect("a cold response carries Server-Timing")
        .to_str()
        .unwrap()
        .to_owned();
    eprintln!("e2e: traces: cold Server-Timing: {timing}");
    for metric in ["claim;dur=", "assign;dur=", "ready;dur="] {
        assert!(timing.contains(metric), "{timing}");
    }
    let warm = dev
        .http
        .get(format!("{}/hello", dev.router))
        .header("X-Skipper-Function", &function)
        .send()
        .await
        .unwrap();
    assert_eq!(warm.status(), 200);
    let warm_timing = warm
        .headers()
        .get("server-timing")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    assert!(
        !warm_timing.contains("claim"),
        "a warm response claims nothing: {warm_timing}"
    );

    // Everything arrives within a few batch periods (5 s each): wait for
    // the next batch until the trace is complete.
    let wanted: &[(&str, &str)] = &[
        ("skipper.router", "HTTP GET"),
        ("skipper.router", "skipper.ControllerService/GetInstance"),
        ("skipper.controller", "skipper.ControllerService/GetInstance"),
        ("skipper.controller", "controller.assign"),
        ("skipper.controller", "controller.claim"),
        ("skipper.controller", "POST /__skipper/assign"),
        ("skipper.controller", "kubernetes PATCH pods"),
        ("skipper.fixture", "fixture"),
    ];
    let trace: Vec<Span> = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let got: Vec<Span> = spans
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.trace_id == trace_id)
                .cloned()
                .collect();
            let complete = wanted
                .iter()
                .all(|(svc, name)| got.iter().any(|s| s.service == *svc && s.name == *name))
                && got.iter().filter(|s| s.name == "fixture").count() >= 2;
            if complete {
                return got;
            }
            received.changed().await.unwrap();
        }
    })
    .await
    .unwrap_or_else(|_| {
        let got: Vec<(String, String, String)> = spans
            .lock()
            .unwrap()
            .iter()
            .map(|s| (s.trace_id.clone(), s.service.clone(), s.name.clone()))
            .collect();
        panic!("the trace is incomplete after 60s; received: {got:#?}")
    });

    let mut names: Vec<String> = trace
        .iter()
        .map(|s| format!("{}:{}", s.service, s.name))
        .collect();
    names.sort();
    eprintln!("e2e: traces: {} spans in the trace: {names:?}", trace.len());
    let one = |svc: &str, name: &str| -> Span {
        trace
            .iter()
            .find(|s| s.service == svc && s.name == name)
            .unwrap()
            .clone()
    };
    let by_id: HashMap<&str, &Span> = trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let router = one("skipper.router", "HTTP GET");
    assert_eq!(
        router.parent, client_span,
        "the client's traceparent is the router's parent"
    );
    assert_eq!(router.kind, 2, "server");
    let get_client = one("skipper.router", "skipper.ControllerService/GetInstance");
    assert_eq!(get_client.kind, 3, "client");
    let get_server = one("skipper.controller", "skipper.ControllerService/GetInstance");
    assert_eq!(
        get_server.parent, get_client.span_id,
        "gRPC metadata carries the context"
    );
    let post = one("skipper.controller", "POST /__skipper/assign");
    let fixture = |path: &str| -> Span {
        trace
            .iter()
            .find(|s| {
                s.name == "fixture"
                    && s.attributes
                        .get("url.path")
                        .is_some_and(|p| p.contains(&format!("\"{path}\"")))
            })
            .unwrap_or_else(|| panic!("a fixture span for {path}: {trace:#?}"))
            .clone()
    };
    let pod_assign = fixture("/__skipper/assign");
    assert_eq!(pod_assign.service, "skipper.fixture");
    assert_eq!(
        pod_assign.parent, post.span_id,
        "the assign POST carries the context"
    );
    let pod_request = fixture("/hello");
    let mut up = pod_request.parent.as_str();
    let mut chain = Vec::new();
    while let Some(s) = by_id.get(up) {
        chain.push(format!("{}:{}", s.service, s.name));
        up = &s.parent;
    }
    assert!(
        chain
            .iter()
            .any(|c| c.contains("skipper.router") && c.ends_with("HTTP GET")),
        "the proxied request descends from the router's span: {chain:?}"
    );
    // Every controller span of the request descends from its server span.
    let claim = one("skipper.controller", "controller.claim");
    let mut up = claim.parent.as_str();
    let mut reached = false;
    while let Some(s) = by_id.get(up) {
        if s.span_id == get_server.span_id {
            reached = true;
            break;
        }
        up = &s.parent;
    }
    assert!(reached, "the claim is part of GetInstance");
    let writes: Vec<&Span> = trace
        .iter()
        .filter(|s| s.service == "skipper.controller" && s.name.starts_with("kubernetes "))
        .collect();
    assert!(!writes.is_empty(), "the claim patch is a span: {trace:#?}");
    assert!(router.attributes.contains_key("http.response.status_code"));
}
