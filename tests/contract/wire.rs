//! Field numbers, types and enum values of the gRPC contract (spec §2.1).
//!
//! Each message is hand-encoded field by field from the contract's table
//! with prost's low-level encoders, then decoded with the generated types
//! (and re-encoded, byte for byte). A renumbered or retyped field fails here.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use bytes::BytesMut;
use prost::Message;
use prost::encoding::{bool as pbool, double, int32, message, string, uint32};
use skipper::api;

fn ts(seconds: i64, nanos: i32) -> prost_types::Timestamp {
    prost_types::Timestamp { seconds, nanos }
}

/// Scale per contract: 1 min, 2 max, 3 cpu, 4 memory, 5 in-flight (uint32).
fn scale_bytes() -> Vec<u8> {
    let mut b = BytesMut::new();
    uint32::encode(1, &0, &mut b);
    uint32::encode(2, &10, &mut b);
    uint32::encode(3, &500, &mut b);
    uint32::encode(4, &256, &mut b);
    uint32::encode(5, &100, &mut b);
    b.to_vec()
}

/// Function per contract: 1 namespace, 2 deployment, 3 tenant, 4 metadata, 5 scale, 6 oneshot.
fn function_bytes() -> Vec<u8> {
    let mut b = BytesMut::new();
    string::encode(1, &"skipper-production".to_string(), &mut b);
    string::encode(2, &"my-app".to_string(), &mut b);
    string::encode(3, &"tenant-123".to_string(), &mut b);
    string::encode(4, &"metadata-value".to_string(), &mut b);
    prost::encoding::bytes::encode(5, &scale_bytes(), &mut b);
    pbool::encode(6, &true, &mut b);
    b.to_vec()
}

fn function() -> api::Function {
    api::Function {
        namespace: Some("skipper-production".into()),
        deployment: Some("my-app".into()),
        tenant: Some("tenant-123".into()),
        metadata: Some("metadata-value".into()),
        scale: Some(api::Scale {
            min_instances: Some(0),
            max_instances: Some(10),
            target_cpu_usage_milli: Some(500),
            target_memory_usage_mib: Some(256),
            target_in_flight_requests: Some(100),
            max_in_flight_requests: None,
        }),
        oneshot: Some(true),
    }
}

fn instance_bytes() -> Vec<u8> {
    let mut b = BytesMut::new();
    prost::encoding::bytes::encode(1, &function_bytes(), &mut b);
    string::encode(2, &"my-app-abc123".to_string(), &mut b);
    string::encode(3, &"10.0.0.1:8080".to_string(), &mut b);
    string::encode(4, &"my-app-5f4b8c".to_string(), &mut b);
    message::encode(5, &ts(1_705_314_600, 0), &mut b);
    message::encode(6, &ts(1_705_314_605, 0), &mut b);
    uint32::encode(7, &250, &mut b);
    uint32::encode(8, &128, &mut b);
    b.to_vec()
}

fn instance() -> api::Instance {
    api::Instance {
        function: Some(function()),
        name: Some("my-app-abc123".into()),
        addr: Some("10.0.0.1:8080".into()),
        replica_set: Some("my-app-5f4b8c".into()),
        assigned_at: Some(ts(1_705_314_600, 0)),
        ready_at: Some(ts(1_705_314_605, 0)),
        cpu_usage_milli: Some(250),
        memory_usage_mib: Some(128),
        protocol: None,
    }
}

fn check<M: Message + Default + PartialEq + std::fmt::Debug>(bytes: &[u8], want: &M) {
    let got = M::decode(bytes).expect("decode");
    assert_eq!(&got, want);
    assert_eq!(got.encode_to_vec(), bytes, "re-encoding is byte-identical");
}

#[test]
fn scale_function_and_instance() {
    check(&scale_bytes(), &function().scale.unwrap());
    check(&function_bytes(), &function());
    check(&instance_bytes(), &instance());
}

#[test]
fn explicit_zero_is_present_on_the_wire() {
    // min_instances = 0 is encoded (explicit presence), an absent one is not.
    let with_zero = api::Scale {
        min_instances: Some(0),
        ..Default::default()
    };
    assert_eq!(with_zero.encode_to_vec(), vec![0x08, 0x00]);
    assert!(api::Scale::default().encode_to_vec().is_empty());
}

#[test]
fn the_concurrency_limit_is_a_new_field_number() {
    // Field 6, varint: additive, so Go's encoding of a Scale (which has no
    // field 6) reads the same and the new field is absent from it.
    let limit = api::Scale {
        max_in_flight_requests: Some(4),
        ..Default::default()
    };
    assert_eq!(limit.encode_to_vec(), vec![0x30, 0x04]);
    let go = api::Scale::decode(&scale_bytes()[..]).unwrap();
    assert_eq!(go.max_in_flight_requests, None);
}

#[test]
fn rpc_messages() {
    // GetInstanceRequest: 1 function, 2 exclude_instance_names (repeated string).
    let mut b = BytesMut::new();
    prost::encoding::bytes::encode(1, &function_bytes(), &mut b);
    string::encode_repeated(2, &["a".to_string(), "b".to_string()], &mut b);
    check(
        &b,
        &api::GetInstanceRequest {
            function: Some(function()),
            exclude_instance_names: vec!["a".into(), "b".into()],
        },
    );

    // GetInstanceResponse: 1 instance.
    let mut b = BytesMut::new();
    prost::encoding::bytes::encode(1, &instance_bytes(), &mut b);
    check(
        &b,
        &api::GetInstanceResponse {
            instance: Some(instance()),
        },
    );

    // Heartbeat: 1 function, 2 timestamp, 3 in_flight_requests.
    let mut hb = BytesMut::new();
    prost::encoding::bytes::encode(1, &function_bytes(), &mut hb);
    message::encode(2, &ts(1_700_000_000, 5), &mut hb);
    uint32::encode(3, &7, &mut hb);
    let heartbeat = api::Heartbeat {
        function: Some(function()),
        timestamp: Some(ts(1_700_000_000, 5)),
        in_flight_requests: Some(7),
    };
    check(&hb, &heartbeat);

    // HeartbeatRequest: 1 router_ip, 2 heartbeats, 3 forwarded_for.
    let mut b = BytesMut::new();
    string::encode(1, &"10.1.0.1".to_string(), &mut b);
    prost::encoding::bytes::encode(2, &hb.to_vec(), &mut b);
    string::encode_repeated(3, &["10.0.0.1".to_string()], &mut b);
    check(
        &b,
        &api::HeartbeatRequest {
            router_ip: Some("10.1.0.1".into()),
            heartbeats: vec![heartbeat],
            forwarded_for: vec!["10.0.0.1".into()],
        },
    );

    // ScaleRequest: 1 function, 2 desired_instances, 3 reason (enum).
    let mut b = BytesMut::new();
    prost::encoding::bytes::encode(1, &function_bytes(), &mut b);
    uint32::encode(2, &3, &mut b);
    int32::encode(3, &5, &mut b);
    check(
        &b,
        &api::ScaleRequest {
            function: Some(function()),
            desired_instances: Some(3),
            reason: Some(api::ScaleReason::NoReadyInstances as i32),
        },
    );

    // ScaleResponse: 1 instances (repeated). ReleaseInstanceRequest: 1 instance.
    let mut b = BytesMut::new();
    prost::encoding::bytes::encode(1, &instance_bytes(), &mut b);
    check(
        &b,
        &api::ScaleResponse {
            instances: vec![instance()],
        },
    );
    check(
        &b,
        &api::ReleaseInstanceRequest {
            instance: Some(instance()),
        },
    );
}

#[test]
fn cluster_state_and_events() {
    // ScaleDecision: 1 desired, 2 unclamped, 3 reason, 4 metrics{1 name, 2 value}.
    let mut metric = BytesMut::new();
    string::encode(1, &"cpu".to_string(), &mut metric);
    double::encode(2, &0.75, &mut metric);
    let mut b = BytesMut::new();
    uint32::encode(1, &3, &mut b);
    uint32::encode(2, &5, &mut b);
    int32::encode(3, &1, &mut b);
    prost::encoding::bytes::encode(4, &metric.to_vec(), &mut b);
    check(
        &b,
        &api::ScaleDecision {
            desired_instances: Some(3),
            unclamped_desired_instances: Some(5),
            reason: Some(api::ScaleReason::Cpu as i32),
            metrics: vec![api::ScaleMetric {
                name: Some("cpu".into()),
                value: Some(0.75),
            }],
        },
    );

    // Event: 1 timestamp, 2 function, 3 type, 4 message, 5 severity.
    let mut ev = BytesMut::new();
    message::encode(1, &ts(1, 0), &mut ev);
    prost::encoding::bytes::encode(2, &function_bytes(), &mut ev);
    int32::encode(3, &7, &mut ev);
    string::encode(4, &"terminated stuck instance x".to_string(), &mut ev);
    int32::encode(5, &2, &mut ev);
    let event = api::Event {
        timestamp: Some(ts(1, 0)),
        function: Some(function()),
        r#type: Some(api::EventType::StuckInstanceCleanup as i32),
        message: Some("terminated stuck instance x".into()),
        severity: Some(api::EventSeverity::Warn as i32),
    };
    check(&ev, &event);

    // SupervisorState: 1 function, 2 instances, 3 router_heartbeats, 5 responsible ip, 7 active RS.
    let mut hs = BytesMut::new();
    string::encode(1, &"10.1.0.1".to_string(), &mut hs);
    let mut sup = BytesMut::new();
    prost::encoding::bytes::encode(1, &function_bytes(), &mut sup);
    prost::encoding::bytes::encode(2, &instance_bytes(), &mut sup);
    prost::encoding::bytes::encode(3, &hs.to_vec(), &mut sup);
    string::encode(5, &"10.0.0.2".to_string(), &mut sup);
    string::encode(7, &"my-app-5f4b8c".to_string(), &mut sup);
    let supervisor = api::SupervisorState {
        function: Some(function()),
        instances: vec![instance()],
        router_heartbeats: vec![api::HeartbeatState {
            router_ip: Some("10.1.0.1".into()),
            heartbeat: None,
        }],
        responsible_controller_ip: Some("10.0.0.2".into()),
        active_replica_set: Some("my-app-5f4b8c".into()),
        recent_recommendations: Vec::new(),
    };
    check(&sup, &supervisor);

    // ScaleRecommendation (Skipper's addition, field 8 of SupervisorState):
    // 1 timestamp, 2 decision, 3 acted.
    let mut dec = BytesMut::new();
    prost::encoding::uint32::encode(1, &2, &mut dec);
    let mut rec = BytesMut::new();
    message::encode(1, &ts(3, 0), &mut rec);
    prost::encoding::bytes::encode(2, &dec.to_vec(), &mut rec);
    prost::encoding::bool::encode(3, &true, &mut rec);
    let recommendation = api::ScaleRecommendation {
        timestamp: Some(ts(3, 0)),
        decision: Some(api::ScaleDecision {
            desired_instances: Some(2),
            ..Default::default()
        }),
        acted: Some(true),
        ticks: None,
        since: None,
    };
    check(&rec, &recommendation);
    let mut with_rec = sup.clone();
    prost::encoding::bytes::encode(8, &rec.to_vec(), &mut with_rec);
    check(
        &with_rec,
        &api::SupervisorState {
            recent_recommendations: vec![recommendation],
            ..supervisor.clone()
        },
    );

    // ClusterState: 1 pod_ip, 2 started_at, 3 controller_ips, 4 supervisors, 5 events, 6 config.
    let mut cfg = BytesMut::new();
    string::encode(1, &"scale-interval".to_string(), &mut cfg);
    string::encode(2, &"15s".to_string(), &mut cfg);
    string::encode(3, &"d".to_string(), &mut cfg);
    let mut b = BytesMut::new();
    string::encode(1, &"10.0.0.1".to_string(), &mut b);
    message::encode(2, &ts(2, 0), &mut b);
    string::encode_repeated(3, &["10.0.0.1".to_string(), "10.0.0.2".to_string()], &mut b);
    prost::encoding::bytes::encode(4, &sup.to_vec(), &mut b);
    prost::encoding::bytes::encode(5, &ev.to_vec(), &mut b);
    prost::encoding::bytes::encode(6, &cfg.to_vec(), &mut b);
    let state = api::ClusterState {
        pod_ip: Some("10.0.0.1".into()),
        started_at: Some(ts(2, 0)),
        controller_ips: vec!["10.0.0.1".into(), "10.0.0.2".into()],
        supervisors: vec![supervisor],
        events: vec![event],
        config: vec![api::ConfigValue {
            name: Some("scale-interval".into()),
            value: Some("15s".into()),
            description: Some("d".into()),
        }],
    };
    check(&b, &state);
    let mut resp = BytesMut::new();
    prost::encoding::bytes::encode(1, &b.to_vec(), &mut resp);
    check(
        &resp,
        &api::GetClusterStateResponse {
            cluster_state: Some(state),
        },
    );
}

#[test]
fn enum_values() {
    use api::{EventSeverity as S, EventType as E, ScaleReason as R};
    // Each name's number, and each number's name, as the Go proto has them.
    let number = |name: &str| {
        R::from_str_name(name)
            .map(|v| v as i32)
            .or_else(|| E::from_str_name(name).map(|v| v as i32))
            .or_else(|| S::from_str_name(name).map(|v| v as i32))
    };
    let name = |enum_: &str, n: i32| match enum_ {
        "SCALE_REASON" => R::try_from(n).ok().map(|v| v.as_str_name()),
        "EVENT_TYPE" => E::try_from(n).ok().map(|v| v.as_str_name()),
        _ => S::try_from(n).ok().map(|v| v.as_str_name()),
    };
    for (enum_, values) in [
        (
            "SCALE_REASON",
            &[
                "UNSPECIFIED",
                "CPU",
                "HEARTBEAT_TIMEOUT",
                "IN_FLIGHT_REQUESTS",
                "MEMORY",
                "NO_READY_INSTANCES",
            ][..],
        ),
        (
            "EVENT_TYPE",
            &[
                "UNSPECIFIED",
                "SCALE_UP",
                "SCALE_DOWN",
                "POD_ASSIGNED",
                "POD_DELETED",
                "STALE_REPLACEMENT",
                "HEARTBEAT_TIMEOUT",
                "STUCK_INSTANCE_CLEANUP",
            ],
        ),
        ("EVENT_SEVERITY", &["UNSPECIFIED", "INFO", "WARN"]),
    ] {
        for (n, value) in (0..).zip(values) {
            let full = format!("{enum_}_{value}");
            assert_eq!(number(&full), Some(n), "{full}");
            assert_eq!(name(enum_, n), Some(full.as_str()), "{full}");
        }
    }
}

#[tokio::test]
async fn service_and_method_paths() {
    use std::sync::{Arc, Mutex};
    // A transport that records each request path and fails the call.
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let transport = {
        let seen = seen.clone();
        tower::service_fn(move |req: http::Request<tonic::body::Body>| {
            seen.lock().unwrap().push(req.uri().path().to_owned());
            async move { Err::<http::Response<tonic::body::Body>, _>(std::io::Error::other("recorded")) }
        })
    };
    let mut client = api::controller_service_client::ControllerServiceClient::new(transport);
    let _ = client.get_instance(api::GetInstanceRequest::default()).await;
    let _ = client.heartbeat(api::HeartbeatRequest::default()).await;
    let _ = client.scale(api::ScaleRequest::default()).await;
    let _ = client
        .release_instance(api::ReleaseInstanceRequest::default())
        .await;
    let _ = client
        .get_cluster_state(api::GetClusterStateRequest::default())
        .await;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "/skipper.ControllerService/GetInstance",
            "/skipper.ControllerService/Heartbeat",
            "/skipper.ControllerService/Scale",
            "/skipper.ControllerService/ReleaseInstance",
            "/skipper.ControllerService/GetClusterState",
        ]
    );
}
